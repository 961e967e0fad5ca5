//! Helpers for the tests of every crate (feature `test-support`): whether a missing piece of the
//! environment skips a test or fails it (`TE_REQUIRE`), and network namespaces standing in for
//! hosts ([`netns`]).

pub mod netns;

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
