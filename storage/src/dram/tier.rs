//! The DRAM tier's bookkeeping: which objects live where in the arena, their recency and depth,
//! and what to evict under pressure. The bytes themselves are moved by the store through the
//! transfer engine; this module only hands out and takes back arena extents.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::allocator::{PageAllocator, PageRun};
use crate::eviction::{choose_victims, Candidate, EvictionPolicy};
use crate::range_map::Extent;

/// Most runs one object may be split into when the arena is fragmented.
const MAX_RUNS: usize = 8;

/// One object in the arena.
#[derive(Debug)]
pub struct DramEntry {
    /// Object length in bytes.
    pub len: u64,
    /// Depth hint given at put.
    pub depth: u32,
    /// Where its bytes are (arena addresses), in object order.
    pub extents: Box<[Extent]>,
    runs: Box<[PageRun]>,
    /// Logical time of the last access.
    pub last_access: AtomicU64,
    /// The object's version (shared with the SSD log's sequence numbers): a copy never replaces
    /// a newer one.
    pub version: u64,
    /// True when the SSD tier holds this same version (written through, or promoted from it):
    /// demoting it needs no write. Atomic because a committed entry is shared (see
    /// [`DramState::epoch`]); written only under the state's exclusive lock.
    pub on_ssd: AtomicBool,
    /// The reservation this entry was copied into: unique per arena placement, so a remote
    /// reader that saw it before and after its read knows the pages were not reused meanwhile.
    pub generation: u64,
}

/// A reservation: space being copied into, invisible to readers and never evicted.
#[derive(Debug)]
struct Pending {
    key: Arc<str>,
    entry: DramEntry,
}

/// Why a reservation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveError {
    /// Not enough free pages (in few enough runs).
    NoSpace,
}

/// The arena's index and allocator. Committed objects and reservations are kept apart: a
/// reservation never hides or frees the committed version of its key, and several puts (or a put
/// and a promotion) of one key may copy at once; the newest version wins at commit.
#[derive(Debug)]
pub struct DramState {
    /// Hashed with foldhash, not SipHash (about 6% of the standalone server's time went to
    /// SipHash in a profile; docs/PERFORMANCE.md). Keys come from this process, from standalone
    /// workers that passed SO_PEERCRED (and the shared-key handshake when one is set), or from
    /// cluster peers (authenticated when a shared key is set; an open listener is warned about),
    /// so collision flooding needs a peer we already let in. foldhash's per-map random seed still
    /// keeps the layout unpredictable from outside; full HashDoS resistance is not bought here.
    map: HashMap<Arc<str>, Arc<DramEntry>, foldhash::fast::RandomState>,
    pending: HashMap<u64, Pending>,
    alloc: PageAllocator,
    base: u64,
    page: u64,
    runs: Vec<PageRun>,
    next_generation: u64,
    epoch: u64,
}

impl DramState {
    /// An empty arena of `capacity` bytes at address `base`, allocated in pages of `page` bytes.
    pub fn new(base: u64, capacity: u64, page: u64) -> Self {
        DramState {
            map: HashMap::default(),
            pending: HashMap::new(),
            alloc: PageAllocator::new((capacity / page) as u32),
            base,
            page,
            runs: Vec::with_capacity(MAX_RUNS),
            next_generation: 1,
            epoch: 1,
        }
    }

    /// Bytes the arena can hold.
    pub fn capacity(&self) -> u64 {
        self.alloc.total_pages() as u64 * self.page
    }

    /// Bytes allocated (whole pages, committed and reserved).
    pub fn used(&self) -> u64 {
        (self.alloc.total_pages() - self.alloc.free_pages()) as u64 * self.page
    }

    /// Bytes an object of `len` bytes occupies.
    pub fn footprint(&self, len: u64) -> u64 {
        len.div_ceil(self.page) * self.page
    }

    /// Number of committed objects.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no object is committed.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The committed entry of `key`.
    #[inline]
    pub fn get(&self, key: &str) -> Option<&DramEntry> {
        self.map.get(key).map(|e| &**e)
    }

    /// The committed entry of `key`, shared: a caller may keep it to skip the lookup next time,
    /// and may use it again only while [`DramState::epoch`] is unchanged.
    #[inline]
    pub fn get_shared(&self, key: &str) -> Option<&Arc<DramEntry>> {
        self.map.get(key)
    }

    /// Changes with every change of the committed index: a publish (put, promotion), a remove,
    /// an eviction (demotion or drop). While it is unchanged, every committed entry seen before
    /// is still its key's committed entry and its pages are not reused. Read under the state's
    /// shared lock (every change takes the exclusive one), so a reader that checks it and then
    /// copies under the same guard never reads a reused arena page. Never 0.
    #[inline]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Reserves arena space for version `version` of `key`. The committed entry of the key (if
    /// any) stays visible until [`DramState::commit`]. Returns the reservation's generation.
    pub fn reserve(&mut self, key: &str, len: u64, depth: u32, version: u64) -> Result<u64, ReserveError> {
        let pages = len.div_ceil(self.page);
        if pages == 0 || pages > u32::MAX as u64 {
            return Err(ReserveError::NoSpace);
        }
        let mut runs = std::mem::take(&mut self.runs);
        let ok = self.alloc.allocate(pages as u32, MAX_RUNS, &mut runs);
        if !ok {
            self.runs = runs;
            return Err(ReserveError::NoSpace);
        }
        let mut left = len;
        let extents: Box<[Extent]> = runs
            .iter()
            .map(|r| {
                let n = (r.pages as u64 * self.page).min(left);
                left -= n;
                Extent {
                    addr: self.base + r.start as u64 * self.page,
                    len: n,
                }
            })
            .collect();
        let entry = DramEntry {
            len,
            depth,
            extents,
            runs: runs.as_slice().into(),
            last_access: AtomicU64::new(0),
            version,
            on_ssd: AtomicBool::new(false),
            generation: self.next_generation,
        };
        self.runs = runs;
        let generation = self.next_generation;
        self.next_generation += 1;
        self.pending.insert(
            generation,
            Pending {
                key: Arc::from(key),
                entry,
            },
        );
        Ok(generation)
    }

    /// Where reservation `generation` copies to.
    pub fn pending_extents(&self, generation: u64) -> Option<&[Extent]> {
        self.pending.get(&generation).map(|p| &*p.entry.extents)
    }

    /// Ends reservation `generation`: when `ok`, `allowed` agrees and no newer version of the key
    /// is committed, it becomes the key's committed entry (the older one's pages are freed;
    /// readers of them hold this state's shared lock, so none is reading). Otherwise its pages
    /// are freed. Returns true when it was published.
    pub fn commit(
        &mut self,
        generation: u64,
        ok: bool,
        now: u64,
        on_ssd: bool,
        allowed: impl FnOnce(&str, u64) -> bool,
    ) -> bool {
        let Some(Pending { key, mut entry }) = self.pending.remove(&generation) else {
            return false;
        };
        let newer_committed = self.map.get(&key).is_some_and(|e| e.version >= entry.version);
        if ok && !newer_committed && allowed(&key, entry.version) {
            entry.on_ssd = AtomicBool::new(on_ssd);
            entry.last_access.store(now, Ordering::Relaxed);
            self.epoch += 1;
            if let Some(old) = self.map.insert(key, Arc::new(entry)) {
                self.free_runs(&old);
            }
            true
        } else {
            self.free_runs(&entry);
            false
        }
    }

    fn free_runs(&mut self, e: &DramEntry) {
        for &r in e.runs.iter() {
            self.alloc.free(r);
        }
    }

    /// Removes the committed entry of `key`. False if there is none.
    pub fn remove(&mut self, key: &str) -> bool {
        match self.map.remove(key) {
            None => false,
            Some(e) => {
                self.epoch += 1;
                self.free_runs(&e);
                true
            }
        }
    }

    /// Removes the committed entry of `key` if its version is below `version` (a newer version
    /// was stored elsewhere). True if one was removed.
    pub fn remove_older(&mut self, key: &str, version: u64) -> bool {
        if self.map.get(key).is_some_and(|e| e.version < version) {
            self.remove(key)
        } else {
            false
        }
    }

    /// Chooses committed objects to evict so that at least `bytes` are freed, by `policy`.
    pub fn victims(&self, policy: EvictionPolicy, bytes: u64, out: &mut Vec<Arc<str>>) {
        let keys: Vec<&Arc<str>> = self.map.keys().collect();
        let mut cands: Vec<Candidate> = keys
            .iter()
            .enumerate()
            .map(|(id, k)| {
                let e = &self.map[&***k];
                Candidate {
                    id,
                    last_access: e.last_access.load(Ordering::Relaxed),
                    depth: e.depth,
                    bytes: self.footprint(e.len),
                }
            })
            .collect();
        let mut ids = Vec::new();
        choose_victims(&mut cands, policy, bytes, &mut ids);
        out.extend(ids.into_iter().map(|i| keys[i].clone()));
    }

    /// Takes `key` out of the index and frees its pages; returns the entry (whose extents must
    /// not be read after the caller releases the lock it holds on this state).
    pub fn evict(&mut self, key: &str) -> Option<Arc<DramEntry>> {
        let e = self.map.remove(key)?;
        self.epoch += 1;
        self.free_runs(&e);
        Some(e)
    }

    /// Keys of the committed objects.
    pub fn keys(&self) -> impl Iterator<Item = &Arc<str>> {
        self.map.keys()
    }

    /// Records that the SSD tier holds the committed version of `key`.
    pub fn mark_on_ssd(&mut self, key: &str) {
        if let Some(e) = self.map.get(key) {
            e.on_ssd.store(true, Ordering::Relaxed);
        }
    }

    /// The committed entry of `key` (for demotion).
    pub fn entry(&self, key: &str) -> Option<&DramEntry> {
        self.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> DramState {
        DramState::new(1 << 20, 64 * 4096, 4096)
    }

    fn put(s: &mut DramState, key: &str, len: u64, depth: u32, now: u64) {
        let v = now;
        let g = s.reserve(key, len, depth, v).unwrap();
        assert!(s.commit(g, true, now, false, |_, _| true));
    }

    #[test]
    fn reservations_never_hide_the_committed_version() {
        let mut s = state();
        put(&mut s, "a", 4096, 0, 1);
        let g = s.reserve("a", 5000, 0, 5).unwrap();
        // The committed version stays readable while the new one copies in.
        assert_eq!(s.get("a").unwrap().version, 1);
        // A second writer of the same key is no conflict.
        let g2 = s.reserve("a", 100, 0, 6).unwrap();
        let mut v = Vec::new();
        s.victims(EvictionPolicy::Lru, u64::MAX, &mut v);
        assert_eq!(v.len(), 1, "reservations are never victims");
        assert!(s.commit(g2, true, 2, false, |_, _| true));
        // The older version finishing later does not replace the newer one.
        assert!(!s.commit(g, true, 3, false, |_, _| true));
        assert_eq!(s.get("a").unwrap().version, 6);
        assert_eq!(s.used(), 4096);
        assert!(s.remove("a"));
        assert_eq!(s.used(), 0);
    }

    #[test]
    fn a_refused_or_failed_commit_frees_and_removes_are_final() {
        let mut s = state();
        let g = s.reserve("a", 4096, 0, 1).unwrap();
        assert!(!s.commit(g, false, 1, false, |_, _| true));
        assert!(s.is_empty());
        assert_eq!(s.used(), 0);
        // A promotion the caller's check refuses (the SSD copy changed) is dropped.
        let g = s.reserve("a", 4096, 0, 2).unwrap();
        assert!(!s.commit(g, true, 1, false, |_, _| false));
        assert!(s.get("a").is_none());
        put(&mut s, "a", 4096, 0, 3);
        put(&mut s, "a", 3 * 4096, 0, 4);
        assert_eq!(s.used(), 3 * 4096);
        assert!(!s.remove_older("a", 4));
        assert!(s.remove_older("a", 5));
        assert_eq!(s.reserve("big", 65 * 4096, 0, 9), Err(ReserveError::NoSpace));
    }

    #[test]
    fn eviction_order_lru_and_prefix_aware() {
        let mut s = state();
        // Four pages of a prefix: depth 0..4, stored in order; then page 0 and 1 are read again.
        for d in 0..4u32 {
            put(&mut s, &format!("p{d}"), 4096, d, d as u64 + 1);
        }
        s.get("p0").unwrap().last_access.store(10, Ordering::Relaxed);
        s.get("p1").unwrap().last_access.store(11, Ordering::Relaxed);
        let mut v = Vec::new();
        s.victims(EvictionPolicy::Lru, 2 * 4096, &mut v);
        assert_eq!(v.iter().map(|k| &**k).collect::<Vec<_>>(), ["p2", "p3"]);
        v.clear();
        s.victims(EvictionPolicy::Lru, 3 * 4096, &mut v);
        assert_eq!(v.iter().map(|k| &**k).collect::<Vec<_>>(), ["p2", "p3", "p0"]);
        // Untouched prefix: LRU would evict the shared root first; prefix-aware evicts the tail.
        let mut s = state();
        for d in 0..4u32 {
            put(&mut s, &format!("q{d}"), 4096, d, d as u64 + 1);
        }
        v.clear();
        s.victims(EvictionPolicy::Lru, 4096, &mut v);
        assert_eq!(&*v[0], "q0");
        v.clear();
        s.victims(EvictionPolicy::PrefixAware { window: 4 }, 2 * 4096, &mut v);
        assert_eq!(v.iter().map(|k| &**k).collect::<Vec<_>>(), ["q3", "q2"]);
    }
}
