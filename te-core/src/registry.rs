//! The registration table: every region registered with the engine, sorted by base address and
//! searched by binary search. A whole batch resolves under one shared lock.
//!
//! A region is registered on the transports once and may be shared by several handles: its own
//! and those of sub-ranges registered while it lives (the registration cache, [`Registry::share`]).
//! The table holds only the covering regions, so views add nothing to a lookup, a descriptor or
//! a batch's pins; the region leaves the table when its last handle goes ([`Registry::release_handle`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard};
use te_base::{Error, HostBuffer, MemoryLocation, RegionId, RegionInfo, Result};

/// One registered region.
#[derive(Debug)]
pub(crate) struct Region {
    pub info: RegionInfo,
    /// Per-transport access keys returned by registration, by transport name.
    pub keys: Vec<(&'static str, serde_json::Value)>,
    /// Batches currently using the region.
    pub in_flight: AtomicU64,
    /// Dropped by its owner while in flight: removed when the last batch finishes.
    pub dying: AtomicBool,
    /// Live handles sharing this registration: the one it was registered with and every view
    /// of a sub-range the cache handed out. Lowered only under the table's write lock, and raised
    /// only under its read lock while non-zero, so a region whose count reached zero is never
    /// handed out again.
    pub handles: AtomicU64,
    /// What owns the memory (engine-allocated host memory, or a foreign owner handed to
    /// [`crate::TransferEngine::register_raw_owned`]), dropped when the last reference goes:
    /// after the transports released the region.
    pub _owned: Option<Owner>,
}

/// The owner of a region's memory, kept alive with the region.
pub(crate) enum Owner {
    /// Memory the engine allocated.
    Host(#[allow(dead_code)] HostBuffer),
    /// Whatever a caller of `register_raw_owned` handed over (a Python buffer export...).
    Foreign(#[allow(dead_code)] Box<dyn std::any::Any + Send + Sync>),
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Host(b) => f.debug_tuple("Host").field(b).finish(),
            Owner::Foreign(_) => f.write_str("Foreign"),
        }
    }
}

/// Regions sorted by base address.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    regions: RwLock<Vec<Arc<Region>>>,
}

/// The regions of one batch, pinned until its last request completes.
pub(crate) struct Pins(Vec<Arc<Region>>);

impl Pins {
    /// True if an owner dropped one of the pinned regions while this batch ran.
    pub fn any_dying(&self) -> bool {
        self.0.iter().any(|r| r.dying.load(Ordering::Acquire))
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        for r in &self.0 {
            r.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// What releasing one handle of a region did.
#[derive(Debug)]
pub(crate) enum Released {
    /// Other handles still share the region: nothing changes for the transports.
    Shared,
    /// That was the last handle and no batch uses the region: it left the table and must be
    /// deregistered from the transports.
    Removed(Arc<Region>),
    /// That was the last handle but batches use the region: it stops accepting new batches and
    /// is reaped when the last one completes.
    Dying,
    /// The region had already left the table (a rolled-back registration).
    Gone,
}

impl Registry {
    /// The live region that contains `[addr, addr + len)`, with one more handle counted on it, if
    /// `check` accepts it; `Ok(None)` if no registered region overlaps the range. A range that
    /// overlaps a region without lying inside it, or lies inside one that is on its way out, is
    /// [`Error::AlreadyRegistered`] naming that region. One binary search under the read lock.
    pub fn share(
        &self,
        addr: u64,
        len: u64,
        check: impl FnOnce(&RegionInfo) -> Result<()>,
    ) -> Result<Option<Arc<Region>>> {
        let regions = self.regions.read();
        let end = addr + len;
        let idx = regions.partition_point(|r| r.info.base < end);
        let Some(r) = idx.checked_sub(1).map(|i| &regions[i]).filter(|r| r.info.end() > addr) else {
            return Ok(None);
        };
        let inside = r.info.base <= addr && end <= r.info.end();
        // A region with no handle left is being released (its removal may wait for batches).
        if !inside || r.dying.load(Ordering::Acquire) || r.handles.load(Ordering::Acquire) == 0 {
            return Err(Error::AlreadyRegistered {
                addr,
                len,
                region_base: r.info.base,
                region_len: r.info.len,
            });
        }
        check(&r.info)?;
        r.handles.fetch_add(1, Ordering::AcqRel);
        Ok(Some(r.clone()))
    }

    /// Releases one handle of `region`. The last one removes the region from the table if no
    /// batch uses it; otherwise, with `refuse_in_flight`, it is refused with
    /// [`Error::InFlight`] (the handle stays counted), and without, the region is marked dying.
    pub fn release_handle(&self, region: &Arc<Region>, refuse_in_flight: bool) -> Result<Released> {
        let mut regions = self.regions.write();
        let handles = region.handles.load(Ordering::Acquire);
        if handles > 1 {
            region.handles.store(handles - 1, Ordering::Release);
            return Ok(Released::Shared);
        }
        let idx = regions.partition_point(|r| r.info.base < region.info.base);
        let Some(r) = regions.get(idx).filter(|r| r.info.id == region.info.id) else {
            region.handles.store(0, Ordering::Release);
            return Ok(Released::Gone);
        };
        let in_flight = r.in_flight.load(Ordering::Acquire);
        if in_flight > 0 {
            if refuse_in_flight {
                return Err(Error::InFlight {
                    base: r.info.base,
                    len: r.info.len,
                    in_flight,
                });
            }
            region.handles.store(0, Ordering::Release);
            r.dying.store(true, Ordering::Release);
            return Ok(Released::Dying);
        }
        region.handles.store(0, Ordering::Release);
        Ok(Released::Removed(regions.remove(idx)))
    }

    /// Finds an overlap of `[addr, addr + len)` with any registered region.
    pub fn overlap(&self, addr: u64, len: u64) -> Option<RegionInfo> {
        let regions = self.regions.read();
        let end = addr + len;
        let idx = regions.partition_point(|r| r.info.base < end);
        // Only the region starting last before `end` can overlap (regions never overlap).
        idx.checked_sub(1)
            .map(|i| &regions[i])
            .filter(|r| r.info.end() > addr)
            .map(|r| r.info.clone())
    }

    /// Inserts regions, keeping the table sorted. Fails (inserting nothing) on overlap.
    pub fn insert(&self, new: Vec<Arc<Region>>) -> Result<()> {
        let mut regions = self.regions.write();
        for r in &new {
            let end = r.info.end();
            let idx = regions.partition_point(|x| x.info.base < end);
            if let Some(prev) = idx.checked_sub(1).map(|i| &regions[i]) {
                if prev.info.end() > r.info.base {
                    return Err(Error::AlreadyRegistered {
                        addr: r.info.base,
                        len: r.info.len,
                        region_base: prev.info.base,
                        region_len: prev.info.len,
                    });
                }
            }
        }
        regions.extend(new);
        regions.sort_unstable_by_key(|r| r.info.base);
        Ok(())
    }

    /// Removes a region if nothing is in flight on it; otherwise `Err(InFlight)`.
    pub fn remove_idle(&self, id: RegionId, base: u64) -> Result<Option<Arc<Region>>> {
        let mut regions = self.regions.write();
        let idx = regions.partition_point(|r| r.info.base < base);
        let Some(r) = regions.get(idx).filter(|r| r.info.id == id) else {
            return Ok(None);
        };
        let in_flight = r.in_flight.load(Ordering::Acquire);
        if in_flight > 0 {
            return Err(Error::InFlight {
                base: r.info.base,
                len: r.info.len,
                in_flight,
            });
        }
        Ok(Some(regions.remove(idx)))
    }

    /// Marks a region as dying (owner dropped it while in flight) so no new batch may use it.
    pub fn mark_dying(&self, id: RegionId, base: u64) {
        let regions = self.regions.read();
        let idx = regions.partition_point(|r| r.info.base < base);
        if let Some(r) = regions.get(idx).filter(|r| r.info.id == id) {
            r.dying.store(true, Ordering::Release);
        }
    }

    /// Dying regions whose last batch has finished.
    pub fn take_finished_dying(&self) -> Vec<Arc<Region>> {
        let mut regions = self.regions.write();
        let mut out = Vec::new();
        regions.retain(|r| {
            let done = r.dying.load(Ordering::Acquire) && r.in_flight.load(Ordering::Acquire) == 0;
            if done {
                out.push(r.clone());
            }
            !done
        });
        out
    }

    /// Snapshot of every region (for descriptors and reports).
    pub fn snapshot(&self) -> Vec<Arc<Region>> {
        self.regions.read().clone()
    }

    /// Resolves the local side of a batch under one shared lock, held until the returned
    /// resolver is turned into [`Pins`].
    pub fn local_resolver(&self) -> LocalResolver<'_> {
        LocalResolver {
            regions: self.regions.read(),
            pinned: Vec::new(),
            base: 0,
            span: 0,
            last: None,
        }
    }
}

/// Resolves local ranges of one batch against the table (read-locked for its lifetime). Ranges
/// usually fall in the region the previous one used, so that region's bounds, id and location are
/// kept by value and compared first; only a range outside them searches. Every distinct region
/// found is pinned once.
pub(crate) struct LocalResolver<'a> {
    regions: RwLockReadGuard<'a, Vec<Arc<Region>>>,
    pinned: Vec<usize>,
    /// The last region found: its base, its length and what a request needs of it.
    base: u64,
    span: u64,
    last: Option<LocalRegion>,
}

/// What resolving a local range yields: the region's id and where its memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LocalRegion {
    pub id: RegionId,
    pub location: MemoryLocation,
}

impl LocalResolver<'_> {
    /// The region holding `[addr, addr + len)`, or why none does.
    #[inline]
    pub fn resolve(&mut self, addr: u64, len: u64) -> Result<LocalRegion> {
        let off = addr.wrapping_sub(self.base);
        match self.last {
            // Inside the last region: `off <= span` rules out addresses below its base (they wrap
            // to huge offsets), and `len <= span - off` cannot overflow.
            Some(hit) if len != 0 && off <= self.span && len <= self.span - off => Ok(hit),
            _ => self.search(addr, len),
        }
    }

    #[cold]
    fn search(&mut self, addr: u64, len: u64) -> Result<LocalRegion> {
        let idx = find(&self.regions, addr, len)?;
        let region = &self.regions[idx];
        if region.dying.load(Ordering::Acquire) {
            return Err(Error::Unregistered { addr, len });
        }
        let hit = LocalRegion {
            id: region.info.id,
            location: region.info.location,
        };
        (self.base, self.span) = (region.info.base, region.info.len);
        // Deduplicated in `pins`: a batch may alternate between many regions.
        self.pinned.push(idx);
        self.last = Some(hit);
        Ok(hit)
    }

    /// Pins every region resolved (one counter update each) and releases the lock.
    pub fn pins(mut self) -> Pins {
        self.pinned.sort_unstable();
        self.pinned.dedup();
        let pins: Vec<Arc<Region>> = self.pinned.iter().map(|&i| self.regions[i].clone()).collect();
        for r in &pins {
            r.in_flight.fetch_add(1, Ordering::AcqRel);
        }
        Pins(pins)
    }
}

fn find(regions: &[Arc<Region>], addr: u64, len: u64) -> Result<usize> {
    if len == 0 {
        return Err(Error::ZeroLength { index: 0 });
    }
    if addr.checked_add(len).is_none() {
        return Err(Error::LengthOverflow { addr, len });
    }
    let idx = regions.partition_point(|r| r.info.base <= addr);
    let Some(i) = idx.checked_sub(1) else {
        return Err(Error::Unregistered { addr, len });
    };
    let r = &regions[i].info;
    if r.contains(addr, len) {
        Ok(i)
    } else if addr < r.end() {
        Err(Error::PartlyRegistered {
            addr,
            len,
            region_base: r.base,
            region_len: r.len,
        })
    } else {
        Err(Error::Unregistered { addr, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SLOT: u64 = 1 << 16;

    fn region(id: u64, base: u64, len: u64) -> Arc<Region> {
        Arc::new(Region {
            info: RegionInfo {
                id: RegionId(id),
                base,
                len,
                location: MemoryLocation::HOST,
                exported: true,
            },
            keys: Vec::new(),
            in_flight: AtomicU64::new(0),
            dying: AtomicBool::new(false),
            handles: AtomicU64::new(1),
            _owned: None,
        })
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Share `[at, at + len)` (relative to the first slot's base, which is `SLOT` in).
        Share { at: u64, len: u64 },
        /// Release the `i`-th live handle (modulo their count).
        Release { i: usize },
        /// Register slot `slot` afresh (whole slot, half of it: `half`).
        Insert { slot: u64, half: bool },
        /// A batch starts on the `i`-th region of the table (modulo), or the batches on every
        /// region finish (`None`) and dying regions are reaped.
        Batch { i: Option<usize> },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            // Anywhere from a slot before the first region to past the last, up to two slots long,
            // half of them near a slot boundary (where inside and crossing meet).
            (0..9 * SLOT, 1..2 * SLOT).prop_map(|(at, len)| Op::Share { at, len }),
            (0..9u64, 0..128u64, 1..SLOT + 128).prop_map(|(k, d, len)| Op::Share {
                at: (k * SLOT + d).saturating_sub(64),
                len,
            }),
            any::<usize>().prop_map(|i| Op::Release { i }),
            (0..4u64, any::<bool>()).prop_map(|(slot, half)| Op::Insert { slot, half }),
            proptest::option::of(any::<usize>()).prop_map(|i| Op::Batch { i }),
        ]
    }

    proptest! {
        /// Share and release against a model of the table: the region a range lies inside is
        /// shared, a crossing range names the region it overlaps, a free one finds nothing, and
        /// a region leaves the table exactly when its last handle goes.
        #[test]
        fn sharing_and_releasing_follow_the_model(ops in proptest::collection::vec(op(), 1..120)) {
            let table = Registry::default();
            // Model: regions in the table (base, len), those of them whose last handle went while
            // a batch ran (dying), and the handles held, each naming its region.
            let mut live: Vec<(u64, u64)> = Vec::new();
            let mut dying: Vec<u64> = Vec::new();
            let mut handles: Vec<Arc<Region>> = Vec::new();
            let mut next_id = 1;
            let base0 = 1u64 << 30;
            for op in ops {
                match op {
                    Op::Insert { slot, half } => {
                        let base = base0 + slot * 2 * SLOT;
                        let len = if half { SLOT / 2 } else { SLOT };
                        if live.iter().any(|&(b, l)| b < base + len && base < b + l) {
                            continue;
                        }
                        let r = region(next_id, base, len);
                        next_id += 1;
                        table.insert(vec![r.clone()]).unwrap();
                        live.push((base, len));
                        handles.push(r);
                    }
                    Op::Share { at, len } => {
                        let addr = base0 - SLOT + at;
                        let got = table.share(addr, len, |_| Ok(()));
                        let inside = live
                            .iter()
                            .filter(|&&(b, _)| !dying.contains(&b))
                            .find(|&&(b, l)| b <= addr && addr + len <= b + l);
                        let crossing = live.iter().find(|&&(b, l)| b < addr + len && addr < b + l);
                        match (got, inside, crossing) {
                            (Ok(Some(r)), Some(&(b, _)), _) => {
                                prop_assert_eq!(r.info.base, b);
                                handles.push(r);
                            }
                            (Ok(None), None, None) => {}
                            (Err(Error::AlreadyRegistered { region_base, .. }), None, Some(_)) => {
                                prop_assert!(live.iter().any(|&(b, _)| b == region_base));
                            }
                            (got, inside, crossing) => {
                                prop_assert!(false, "share {addr:#x}+{len}: {got:?}, model inside {inside:?} crossing {crossing:?}");
                            }
                        }
                    }
                    Op::Release { i } => {
                        if handles.is_empty() {
                            continue;
                        }
                        let h = handles.swap_remove(i % handles.len());
                        let others = handles.iter().filter(|o| Arc::ptr_eq(o, &h)).count();
                        match table.release_handle(&h, false).unwrap() {
                            Released::Shared => prop_assert!(others > 0),
                            Released::Removed(r) => {
                                prop_assert_eq!(others, 0);
                                prop_assert_eq!(h.in_flight.load(Ordering::Acquire), 0);
                                prop_assert!(Arc::ptr_eq(&r, &h));
                                live.retain(|&(b, _)| b != h.info.base);
                            }
                            Released::Dying => {
                                prop_assert_eq!(others, 0);
                                prop_assert!(h.in_flight.load(Ordering::Acquire) > 0);
                                dying.push(h.info.base);
                            }
                            other => prop_assert!(false, "unexpected {other:?}"),
                        }
                    }
                    Op::Batch { i: Some(i) } => {
                        let regions = table.snapshot();
                        if let Some(r) = regions.get(i % regions.len().max(1)) {
                            r.in_flight.fetch_add(1, Ordering::AcqRel);
                        }
                    }
                    Op::Batch { i: None } => {
                        for r in table.snapshot() {
                            r.in_flight.store(0, Ordering::Release);
                        }
                        let reaped: Vec<u64> = table.take_finished_dying().iter().map(|r| r.info.base).collect();
                        let mut expected = dying.clone();
                        let mut got = reaped.clone();
                        expected.sort_unstable();
                        got.sort_unstable();
                        prop_assert_eq!(got, expected);
                        live.retain(|(b, _)| !reaped.contains(b));
                        dying.clear();
                    }
                }
                let mut in_table: Vec<(u64, u64)> =
                    table.snapshot().iter().map(|r| (r.info.base, r.info.len)).collect();
                let mut model = live.clone();
                in_table.sort_unstable();
                model.sort_unstable();
                prop_assert_eq!(in_table, model);
            }
        }
    }
}
