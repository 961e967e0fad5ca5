//! Application-chosen memory-region keys (providers without `FI_MR_PROV_KEY`): unpredictable to
//! a stranger, and never repeated within one rail, so a key held from before a deregistration
//! can never reach a later registration.
//!
//! Each key is a counter run through a random permutation of the provider's key space
//! (`mr_key_size` bytes, at most 64 bits): a balanced Feistel network whose round keys come from
//! the OS random source once per rail. A permutation maps distinct counters to distinct keys, so
//! no key repeats until the whole key space is used, with no table of retired keys to keep. It is
//! not a cryptographic cipher; it stops walking keys (1, 2, 3...) and key reuse, while the
//! provider's key and range check stays the boundary.

/// Feistel rounds; four make each output bit depend on every input bit.
const ROUNDS: usize = 4;
const _: () = assert!(
    ROUNDS * 8 <= te_base::auth::NONCE_LEN,
    "one nonce must hold every round key"
);

/// The key sequence of one rail.
pub(crate) struct KeySequence {
    /// Bits per half of the key.
    half_bits: u32,
    round_keys: [u64; ROUNDS],
    next: u64,
}

impl KeySequence {
    /// A sequence over keys of `key_size` bytes (0 or more than 8: 64-bit keys).
    pub(crate) fn new(key_size: usize) -> KeySequence {
        let bytes = if key_size == 0 || key_size > 8 { 8 } else { key_size };
        // One 32-byte nonce holds the four 64-bit round keys.
        let nonce = te_base::auth::nonce();
        let mut round_keys = [0u64; ROUNDS];
        for (k, bytes) in round_keys.iter_mut().zip(nonce.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(bytes);
            *k = u64::from_le_bytes(b);
        }
        KeySequence {
            half_bits: bytes as u32 * 4,
            round_keys,
            next: 1,
        }
    }

    fn half_mask(&self) -> u64 {
        (1u64 << self.half_bits) - 1
    }

    /// The permutation of the key space.
    fn permute(&self, x: u64) -> u64 {
        let mask = self.half_mask();
        let (mut l, mut r) = ((x >> self.half_bits) & mask, x & mask);
        for &k in &self.round_keys {
            let f = mix(r ^ k) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half_bits) | r
    }

    /// The next key: nonzero (0 reads as "no key" in our descriptors) and never returned before
    /// by this sequence. `None` once the key space is used up.
    pub(crate) fn next_key(&mut self) -> Option<u64> {
        let space = if self.half_bits == 32 {
            u64::MAX
        } else {
            1u64 << (2 * self.half_bits)
        };
        while self.next < space {
            let k = self.permute(self.next);
            self.next += 1;
            if k != 0 {
                return Some(k);
            }
        }
        None
    }
}

/// splitmix64's finaliser: a fast bijective mixer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn keys_never_repeat_fit_the_key_size_and_are_not_a_walk() {
        for size in [0usize, 2, 4, 8, 16] {
            let mut seq = KeySequence::new(size);
            let keys: Vec<u64> = (0..4096).map(|_| seq.next_key().unwrap()).collect();
            let distinct: HashSet<_> = keys.iter().collect();
            assert_eq!(distinct.len(), keys.len(), "size {size}: a key repeated");
            assert!(keys.iter().all(|&k| k != 0));
            if (1..8).contains(&size) {
                assert!(keys.iter().all(|&k| k < 1u64 << (8 * size)), "size {size}");
            }
            let steps = keys.windows(2).filter(|w| w[1] == w[0].wrapping_add(1)).count();
            assert!(steps < 4, "size {size}: {steps} sequential steps");
        }
    }

    #[test]
    fn a_one_byte_key_space_is_used_exactly_once() {
        let mut seq = KeySequence::new(1);
        let keys: Vec<u64> = std::iter::from_fn(|| seq.next_key()).collect();
        let distinct: HashSet<_> = keys.iter().collect();
        // Every nonzero 8-bit key once (the counter starts at 1, so one key is never drawn).
        assert!(keys.len() >= 254 && keys.len() <= 255, "{}", keys.len());
        assert_eq!(distinct.len(), keys.len());
        assert!(keys.iter().all(|&k| (1..256).contains(&k)));
    }

    #[test]
    fn two_rails_draw_different_sequences() {
        let a: Vec<u64> = {
            let mut s = KeySequence::new(8);
            (0..8).map(|_| s.next_key().unwrap()).collect()
        };
        let b: Vec<u64> = {
            let mut s = KeySequence::new(8);
            (0..8).map(|_| s.next_key().unwrap()).collect()
        };
        assert_ne!(a, b);
    }
}
