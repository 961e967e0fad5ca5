//! What a mode above the core adds to a ranged call, passed in by that mode: the core calls the
//! hook and never knows which mode it serves. Local mode passes [`NoMisses`] and [`NoOverflow`].

use super::{Core, RangedGet, RangedPut};
use crate::error::StoreError;

/// Serves the keys of a ranged get that no local tier holds (distributed mode: from the peers
/// that own them).
pub(crate) trait MissResolver {
    /// False when it never delivers anything: the core then skips listing the missed keys (local
    /// mode pays nothing for the hook).
    fn resolves(&self) -> bool {
        true
    }

    /// Delivers what it can of `missed` (key indices of `items`) into their caller buffers,
    /// records a per-key error for keys that failed, and returns the keys it delivered.
    fn resolve(
        &mut self,
        core: &Core,
        items: &[RangedGet<'_>],
        missed: &[usize],
        errors: &mut [Option<StoreError>],
    ) -> Vec<usize>;
}

/// Places objects of a put that local DRAM cannot hold before they fall back to the SSD tier
/// (distributed mode: on the peer with the most free DRAM).
pub(crate) trait Overflow {
    /// Stores what it can of `keys` (key indices of `items`) elsewhere and returns those stored;
    /// the core then drops its own older copies of them.
    fn place(&mut self, core: &Core, items: &[RangedPut<'_>], keys: &[usize]) -> Vec<usize>;
}

/// No resolver: a key no tier holds is `NotFound`.
pub(crate) struct NoMisses;

impl MissResolver for NoMisses {
    fn resolves(&self) -> bool {
        false
    }

    fn resolve(&mut self, _: &Core, _: &[RangedGet<'_>], _: &[usize], _: &mut [Option<StoreError>]) -> Vec<usize> {
        Vec::new()
    }
}

/// No overflow: what DRAM cannot hold goes to SSD, or fails with `NoSpace`.
pub(crate) struct NoOverflow;

impl Overflow for NoOverflow {
    fn place(&mut self, _: &Core, _: &[RangedPut<'_>], _: &[usize]) -> Vec<usize> {
        Vec::new()
    }
}
