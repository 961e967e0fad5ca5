//! The table of regions the serving side may touch: registered AND exported, nothing else.
//!
//! Lookups are lock-free (an atomically swapped sorted snapshot, binary search). A lookup that
//! succeeds pins the region until its guard drops; deregistration revokes the region and waits
//! for the pins, so memory is never released under a remote read or write.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use te_base::{Error, RegionId, RegionInfo, Result};
use tokio::sync::Notify;

/// One served region.
#[derive(Debug)]
pub(crate) struct ServedRegion {
    id: RegionId,
    base: u64,
    len: u64,
    pins: AtomicU64,
    revoked: AtomicBool,
    drained: Notify,
}

impl ServedRegion {
    fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && len <= self.len && addr - self.base <= self.len - len
    }
}

/// A pin on a served region, held while a remote request touches its memory.
#[derive(Debug)]
pub(crate) struct RegionGuard(Arc<ServedRegion>);

impl Drop for RegionGuard {
    fn drop(&mut self) {
        if self.0.pins.fetch_sub(1, Ordering::SeqCst) == 1 && self.0.revoked.load(Ordering::SeqCst) {
            self.0.drained.notify_waiters();
        }
    }
}

/// Why a lookup was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LookupError {
    /// Zero-length range.
    ZeroLength,
    /// `addr + len` overflows.
    Overflow,
    /// Not inside one served region.
    Outside,
}

/// Regions sorted by base: the exported ones (serving side) or all of them (initiator side).
#[derive(Default)]
pub(crate) struct RegionTable {
    snapshot: ArcSwap<Vec<Arc<ServedRegion>>>,
    writer: Mutex<()>,
    include_private: bool,
}

/// A lock-free view of a table, taken once per batch.
pub(crate) struct TableView(arc_swap::Guard<Arc<Vec<Arc<ServedRegion>>>>);

impl TableView {
    /// True if `[addr, addr + len)` lies in the region `id`.
    pub fn holds(&self, id: RegionId, addr: u64, len: u64) -> bool {
        let idx = self.0.partition_point(|r| r.base <= addr);
        matches!(idx.checked_sub(1).map(|i| &self.0[i]), Some(r) if r.id == id && r.contains(addr, len))
    }
}

impl RegionTable {
    /// A table of every registered region (exported or not): the initiator's view of its own
    /// memory.
    pub fn with_private() -> Self {
        RegionTable {
            include_private: true,
            ..RegionTable::default()
        }
    }

    /// The current regions, without locking.
    pub fn view(&self) -> TableView {
        TableView(self.snapshot.load())
    }

    /// Pins the region holding all of `[addr, addr + len)`.
    pub fn acquire(&self, addr: u64, len: u64) -> std::result::Result<RegionGuard, LookupError> {
        if len == 0 {
            return Err(LookupError::ZeroLength);
        }
        if addr.checked_add(len).is_none() {
            return Err(LookupError::Overflow);
        }
        let table = self.snapshot.load();
        let idx = table.partition_point(|r| r.base <= addr);
        let region = match idx.checked_sub(1).map(|i| &table[i]) {
            Some(r) if r.contains(addr, len) => r,
            _ => return Err(LookupError::Outside),
        };
        region.pins.fetch_add(1, Ordering::SeqCst);
        let guard = RegionGuard(region.clone());
        // Deregistration sets `revoked` before it waits for pins to drain: seeing it unset after
        // pinning means the deregistration will wait for this guard.
        if region.revoked.load(Ordering::SeqCst) {
            return Err(LookupError::Outside);
        }
        Ok(guard)
    }

    /// Starts serving the exported regions of `regions`. Refuses overlaps with served regions.
    pub fn add(&self, regions: &[RegionInfo]) -> Result<()> {
        let _w = self.writer.lock();
        let mut next: Vec<Arc<ServedRegion>> = self.snapshot.load().as_ref().clone();
        for r in regions.iter().filter(|r| r.exported || self.include_private) {
            next.push(Arc::new(ServedRegion {
                id: r.id,
                base: r.base,
                len: r.len,
                pins: AtomicU64::new(0),
                revoked: AtomicBool::new(false),
                drained: Notify::new(),
            }));
        }
        next.sort_by_key(|r| r.base);
        for w in next.windows(2) {
            if w[0].base + w[0].len > w[1].base {
                return Err(Error::AlreadyRegistered {
                    addr: w[1].base,
                    len: w[1].len,
                    region_base: w[0].base,
                    region_len: w[0].len,
                });
            }
        }
        self.snapshot.store(Arc::new(next));
        Ok(())
    }

    /// Stops serving `regions` and waits until no remote request touches them any more.
    pub async fn remove(&self, regions: &[RegionInfo]) {
        let removed: Vec<Arc<ServedRegion>> = {
            let _w = self.writer.lock();
            let current = self.snapshot.load();
            let (gone, kept): (Vec<_>, Vec<_>) = current
                .iter()
                .cloned()
                .partition(|s| regions.iter().any(|r| r.id == s.id));
            for s in &gone {
                s.revoked.store(true, Ordering::SeqCst);
            }
            self.snapshot.store(Arc::new(kept));
            gone
        };
        for region in removed {
            loop {
                let drained = region.drained.notified();
                tokio::pin!(drained);
                drained.as_mut().enable();
                if region.pins.load(Ordering::SeqCst) == 0 {
                    break;
                }
                drained.await;
            }
        }
    }

    /// Remote requests touching served regions right now.
    pub fn pins(&self) -> u64 {
        self.snapshot
            .load()
            .iter()
            .map(|r| r.pins.load(Ordering::Relaxed))
            .sum()
    }

    /// Number of served regions.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.snapshot.load().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::MemoryLocation;

    fn region(id: u64, base: u64, len: u64, exported: bool) -> RegionInfo {
        RegionInfo {
            id: RegionId(id),
            base,
            len,
            location: MemoryLocation::HOST,
            exported,
        }
    }

    #[test]
    fn serves_only_exported_ranges() {
        let t = RegionTable::default();
        t.add(&[region(1, 0x1000, 0x1000, true), region(2, 0x4000, 0x1000, false)])
            .unwrap();
        assert_eq!(t.len(), 1);
        assert!(t.acquire(0x1000, 0x1000).is_ok());
        assert!(t.acquire(0x1fff, 1).is_ok());
        assert_eq!(t.acquire(0x1fff, 2).unwrap_err(), LookupError::Outside);
        assert_eq!(t.acquire(0x4000, 1).unwrap_err(), LookupError::Outside);
        assert_eq!(t.acquire(0xfff, 1).unwrap_err(), LookupError::Outside);
        assert_eq!(t.acquire(0x1000, 0).unwrap_err(), LookupError::ZeroLength);
        assert_eq!(t.acquire(u64::MAX, 2).unwrap_err(), LookupError::Overflow);
        assert!(t.add(&[region(3, 0x1800, 0x1000, true)]).is_err());
    }

    #[tokio::test]
    async fn removal_waits_for_pins() {
        let t = Arc::new(RegionTable::default());
        let r = region(1, 0x1000, 0x1000, true);
        t.add(std::slice::from_ref(&r)).unwrap();
        let guard = t.acquire(0x1000, 8).unwrap();
        let t2 = t.clone();
        let removal = tokio::spawn(async move { t2.remove(&[r]).await });
        // The region is revoked at once for new lookups...
        tokio::task::yield_now().await;
        while t.len() != 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(t.acquire(0x1000, 8).unwrap_err(), LookupError::Outside);
        // ...but removal completes only after the pin is released.
        assert!(!removal.is_finished());
        drop(guard);
        removal.await.unwrap();
    }
}
