//! Shared helpers for cross-crate and multi-process tests: network namespaces standing in for
//! hosts ([`netns`]), an etcd server started for a test ([`etcd`]), and engine processes driven
//! over their standard input ([`node`], the `te-node` binary).

pub mod node;
pub mod notify_check;

pub use te_base::test_support::{etcd, netns, required, skip_or_fail};

/// The byte at `pos` of the verification pattern `seed`.
pub fn pattern(seed: u64, pos: u64) -> u8 {
    let x = pos
        .wrapping_add(seed.wrapping_mul(0x2545_F491_4F6C_DD1D))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8 ^ (pos as u8)
}
