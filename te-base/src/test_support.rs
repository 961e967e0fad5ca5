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

/// A TCP port free on loopback right now, for a server a test is about to start (or restart on
/// the same port). Drawn at random below the kernel's ephemeral range: a port from `bind(0)` lies
/// inside that range, where any outgoing connection may take it as its local port before the
/// server binds it (CI once saw "Address already in use" that way). Below the range, only an
/// explicit bind takes a port. One process never hands out the same port twice. A host whose
/// ephemeral range leaves no room below it gets a port from `bind(0)`, as before.
pub fn free_port() -> Result<u16, String> {
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    const FLOOR: u16 = 10_000;
    let ceiling = ephemeral_floor();
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    if ceiling > FLOOR + 100 {
        for _ in 0..1_000 {
            let mut r = [0u8; 2];
            getrandom::fill(&mut r).map_err(|e| format!("finding a free port: {e}"))?;
            let port = FLOOR + u16::from_le_bytes(r) % (ceiling - FLOOR);
            if !handed_out.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                handed_out.insert(port);
                return Ok(port);
            }
        }
    }
    for _ in 0..1_000 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("finding a free port: {e}"))?;
        if handed_out.insert(port) {
            return Ok(port);
        }
    }
    Err("finding a free port: 1,000 draws gave only ports already handed out".into())
}

/// The first port of the kernel's ephemeral range (`net.ipv4.ip_local_port_range`).
fn ephemeral_floor() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let floor = ephemeral_floor();
        let ports: Vec<u16> = (0..64).map(|_| free_port().unwrap()).collect();
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice: {ports:?}");
        for p in ports {
            if floor > 10_100 {
                assert!(
                    (10_000..floor).contains(&p),
                    "{p} is not below the ephemeral range at {floor}"
                );
            }
            std::net::TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }
}
