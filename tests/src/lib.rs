//! Shared helpers for cross-crate and multi-process tests: network namespaces standing in for
//! hosts ([`netns`]), an etcd server started for a test ([`etcd`]), and engine processes driven
//! over their standard input ([`node`], the `te-node` binary).

pub mod etcd;
pub mod netns;
pub mod node;

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

/// The byte at `pos` of the verification pattern `seed`.
pub fn pattern(seed: u64, pos: u64) -> u8 {
    let x = pos
        .wrapping_add(seed.wrapping_mul(0x2545_F491_4F6C_DD1D))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8 ^ (pos as u8)
}
