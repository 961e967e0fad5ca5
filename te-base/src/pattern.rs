//! The verification pattern of benches, examples and tests: a byte that depends on its position
//! and a seed, so a shifted, misplaced, stale or torn copy shows up as mismatched bytes.

/// The byte at position `pos` of pattern `seed`. Different seeds give unrelated patterns.
pub fn pattern(seed: u64, pos: u64) -> u8 {
    let x = pos
        .wrapping_add(seed.wrapping_mul(0x2545_F491_4F6C_DD1D))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8 ^ (pos as u8)
}

/// A pattern seed derived from a key (FNV-1a), so each key's bytes differ from every other key's
/// and a value read back under the wrong key shows.
pub fn key_seed(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Bytes `[start, start + len)` of pattern `seed`.
pub fn pattern_bytes(seed: u64, start: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| pattern(seed, start + i)).collect()
}

/// Fills `buf` with bytes `[start, start + buf.len())` of pattern `seed`.
pub fn fill_pattern(buf: &mut [u8], seed: u64, start: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(seed, start + i as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_and_positions_give_different_bytes() {
        let a = pattern_bytes(1, 0, 4096);
        let b = pattern_bytes(2, 0, 4096);
        let shifted = pattern_bytes(1, 1, 4096);
        assert!(
            a.iter().zip(&b).filter(|(x, y)| x == y).count() < 64,
            "seeds 1 and 2 look alike"
        );
        assert!(
            a.iter().zip(&shifted).filter(|(x, y)| x == y).count() < 64,
            "a one-byte shift looks alike"
        );
        let mut filled = vec![0u8; 100];
        fill_pattern(&mut filled, 1, 7);
        assert_eq!(filled, pattern_bytes(1, 7, 100));
        assert_ne!(key_seed("page-1"), key_seed("page-2"));
    }
}
