//! The position-dependent byte pattern tests and benchmarks verify against.

/// Byte `pos` of the pattern with `seed`: every byte depends on its position, so misplaced,
/// missing or stale data shows.
pub fn pattern_byte(seed: u64, pos: u64) -> u8 {
    let word = (pos / 8).wrapping_add(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mixed = word.wrapping_mul(0xD6E8_FEB8_6659_FD93).rotate_left(29) ^ seed;
    (mixed >> ((pos % 8) * 8)) as u8
}

/// Fills `buf` (which starts at pattern position `start`).
pub fn fill(buf: &mut [u8], seed: u64, start: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(seed, start + i as u64);
    }
}

/// Bytes of `buf` (starting at pattern position `start`) that differ from the pattern.
pub fn mismatches(buf: &[u8], seed: u64, start: u64) -> u64 {
    buf.iter()
        .enumerate()
        .filter(|(i, &b)| b != pattern_byte(seed, start + *i as u64))
        .count() as u64
}
