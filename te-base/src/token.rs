//! Random 64-bit tokens that tell engine and transport instances apart (a restarted peer gets a
//! new one).

use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

/// A fresh random, non-zero token.
///
/// `RandomState` is seeded from the OS's random source (once per process, then stepped per
/// instance), which is all an instance token needs; mixing in the time and the pid keeps two
/// processes apart even if that source were weak. A crate for it would add nothing.
pub fn random_token() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokens_are_non_zero_and_distinct() {
        let a = super::random_token();
        let b = super::random_token();
        assert_ne!(a, 0);
        assert_ne!(a, b);
    }
}
