//! Helpers for the tests of every crate (feature `test-support`): whether a missing piece of the
//! environment skips a test or fails it (`TE_REQUIRE`), network namespaces standing in for hosts
//! ([`netns`]), an etcd server started for a test ([`etcd`]) and killing a live TCP connection
//! from outside its process ([`socket_destroy`]).

pub mod etcd;
pub mod netns;
pub mod socket_destroy;

/// True if `TE_REQUIRE` (a comma-separated list) names `thing`: a missing `thing` must then fail
/// the test instead of skipping it.
pub fn required(thing: &str) -> bool {
    std::env::var("TE_REQUIRE")
        .map(|v| v.split(',').any(|r| r.trim() == thing))
        .unwrap_or(false)
}

/// Skips (prints why and returns) or, when `TE_REQUIRE` names `thing`, panics.
pub fn skip_or_fail(thing: &str, why: &str) {
    assert!(!required(thing), "TE_REQUIRE names {thing}, but: {why}");
    eprintln!("skipping: {thing} not available: {why}");
}

/// A TCP port free on loopback right now (for a server a test is about to start).
pub fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

/// Reads what a peer sends until it closes the connection, at most `max` bytes, within `within`.
/// `None` if the peer still held the connection open at the deadline: a hostile-input test
/// asserts that a listener answered and hung up.
#[cfg(feature = "conformance")]
pub async fn read_until_closed<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    max: usize,
    within: std::time::Duration,
) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let read = tokio::time::timeout(within, async {
        let mut chunk = [0u8; 4096];
        while out.len() < max {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => out.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    read.ok().map(|()| out)
}
