//! Caller buffers registered through the store: a table sorted by base, searched by binary search,
//! so a whole call's ranges are described by their registration under one shared lock.

use te_core::Registration;

use crate::error::{Result, StoreError};
use crate::range_map::Range;

/// One registered caller buffer.
#[derive(Debug)]
pub(crate) struct CallerRegion {
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) registration: Registration,
}

/// Caller buffers, sorted by base, non-overlapping (the engine refuses overlaps).
#[derive(Debug, Default)]
pub(crate) struct CallerTable {
    regions: Vec<CallerRegion>,
}

impl CallerTable {
    pub(crate) fn insert(&mut self, region: CallerRegion) {
        let at = self.regions.partition_point(|r| r.base < region.base);
        self.regions.insert(at, region);
    }

    pub(crate) fn remove(&mut self, base: u64) -> Option<CallerRegion> {
        let at = self.regions.binary_search_by_key(&base, |r| r.base).ok()?;
        Some(self.regions.remove(at))
    }

    /// True when `[addr, addr + len)` lies inside one registered buffer.
    #[inline]
    pub(crate) fn covers(&self, addr: u64, len: u64) -> bool {
        let i = self.regions.partition_point(|r| r.base <= addr);
        i > 0 && {
            let r = &self.regions[i - 1];
            len <= r.len && addr - r.base <= r.len - len
        }
    }

    /// The registered buffer that holds `addr`, as `(base, end)`.
    #[inline]
    fn region_of(&self, addr: u64) -> Option<(u64, u64)> {
        let i = self.regions.partition_point(|r| r.base <= addr);
        let r = self.regions.get(i.checked_sub(1)?)?;
        (addr - r.base < r.len).then_some((r.base, r.base + r.len))
    }

    /// The end of the registered buffer that holds `addr`, if one does: requests of one call
    /// that continue each other may be merged only inside it (one registration per request).
    #[inline]
    pub(crate) fn region_end(&self, addr: u64) -> Option<u64> {
        self.region_of(addr).map(|(_, end)| end)
    }

    /// Checks that every range of key `key_index` points into registered memory. A range inside
    /// the buffer of the one before it (the usual case: one KV buffer) skips the search.
    #[inline]
    pub(crate) fn check(&self, key_index: usize, ranges: &[Range]) -> Result<()> {
        let (mut lo, mut hi) = (0u64, 0u64);
        for (i, r) in ranges.iter().enumerate() {
            if r.addr >= lo && r.addr < hi && r.len <= hi - r.addr {
                continue;
            }
            if !self.covers(r.addr, r.len) {
                return Err(StoreError::Unregistered {
                    key_index,
                    range_index: i,
                    addr: r.addr,
                    len: r.len,
                });
            }
            if let Some(region) = self.region_of(r.addr) {
                (lo, hi) = region;
            }
        }
        Ok(())
    }

    pub(crate) fn drain(&mut self) -> Vec<CallerRegion> {
        std::mem::take(&mut self.regions)
    }
}
