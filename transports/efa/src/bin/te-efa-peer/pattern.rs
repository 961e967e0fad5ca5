//! The position-dependent byte pattern tests and benchmarks verify against.

use te_base::pattern::pattern as pattern_byte;

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

/// Bytes of `buf` (starting at pattern position `start`) that match neither pattern `a` nor `b`.
#[allow(dead_code)] // used by the serve command, not by the tests that share this file
pub fn foreign(buf: &[u8], a: u64, b: u64, start: u64) -> u64 {
    buf.iter()
        .enumerate()
        .filter(|(i, &x)| {
            let at = start + *i as u64;
            x != pattern_byte(a, at) && x != pattern_byte(b, at)
        })
        .count() as u64
}
