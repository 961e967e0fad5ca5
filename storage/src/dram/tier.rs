//! The DRAM tier's bookkeeping: which objects live where in the arena, their recency and depth,
//! and what to evict under pressure. The bytes themselves are moved by the store through the
//! transfer engine; this module only hands out and takes back arena extents.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// False while its put is still copying in: invisible to readers, never evicted.
    pub ready: bool,
    /// Identifies the put that created it.
    pub generation: u64,
    /// True when the SSD tier holds this same version (written through, or promoted from it):
    /// demoting it needs no write.
    pub on_ssd: bool,
}

/// Why a reservation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveError {
    /// Another put of the key is still copying in.
    Conflict,
    /// Not enough free pages (in few enough runs).
    NoSpace,
}

/// The arena's index and allocator.
#[derive(Debug)]
pub struct DramState {
    map: HashMap<Arc<str>, DramEntry>,
    alloc: PageAllocator,
    base: u64,
    page: u64,
    runs: Vec<PageRun>,
    next_generation: u64,
}

impl DramState {
    /// An empty arena of `capacity` bytes at address `base`, allocated in pages of `page` bytes.
    pub fn new(base: u64, capacity: u64, page: u64) -> Self {
        DramState {
            map: HashMap::new(),
            alloc: PageAllocator::new((capacity / page) as u32),
            base,
            page,
            runs: Vec::with_capacity(MAX_RUNS),
            next_generation: 1,
        }
    }

    /// Bytes the arena can hold.
    pub fn capacity(&self) -> u64 {
        self.alloc.total_pages() as u64 * self.page
    }

    /// Bytes allocated (whole pages).
    pub fn used(&self) -> u64 {
        (self.alloc.total_pages() - self.alloc.free_pages()) as u64 * self.page
    }

    /// Bytes an object of `len` bytes occupies.
    pub fn footprint(&self, len: u64) -> u64 {
        len.div_ceil(self.page) * self.page
    }

    /// Number of objects (ready or not).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no object is stored.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The ready entry of `key`.
    #[inline]
    pub fn get(&self, key: &str) -> Option<&DramEntry> {
        self.map.get(key).filter(|e| e.ready)
    }

    /// Reserves arena space for `key`, replacing a ready entry of it. The new entry is invisible
    /// until [`DramState::commit`]. Returns its generation.
    pub fn reserve(&mut self, key: &str, len: u64, depth: u32) -> Result<u64, ReserveError> {
        if let Some(old) = self.map.get(key) {
            if !old.ready {
                return Err(ReserveError::Conflict);
            }
        }
        self.reserve_unchecked(key, len, depth)
    }

    /// Like [`DramState::reserve`], but only when `key` is not in the arena at all (promotion must
    /// never replace a newer version put meanwhile).
    pub fn reserve_absent(&mut self, key: &str, len: u64, depth: u32) -> Result<u64, ReserveError> {
        if self.map.contains_key(key) {
            return Err(ReserveError::Conflict);
        }
        self.reserve_unchecked(key, len, depth)
    }

    fn reserve_unchecked(&mut self, key: &str, len: u64, depth: u32) -> Result<u64, ReserveError> {
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
        let generation = self.next_generation;
        self.next_generation += 1;
        let entry = DramEntry {
            len,
            depth,
            extents,
            runs: runs.as_slice().into(),
            last_access: AtomicU64::new(0),
            ready: false,
            generation,
            on_ssd: false,
        };
        self.runs = runs;
        if let Some(old) = self.map.insert(Arc::from(key), entry) {
            self.free_runs(&old);
        }
        Ok(generation)
    }

    /// Publishes (`ok`) or drops the entry reserved for `key` by `generation`; `on_ssd` says the
    /// SSD tier holds the same bytes.
    pub fn commit(&mut self, key: &str, generation: u64, ok: bool, now: u64, on_ssd: bool) {
        let Some(e) = self.map.get_mut(key) else { return };
        if e.generation != generation {
            return;
        }
        if ok {
            e.ready = true;
            e.on_ssd = on_ssd;
            e.last_access.store(now, Ordering::Relaxed);
        } else if let Some(old) = self.map.remove(key) {
            self.free_runs(&old);
        }
    }

    fn free_runs(&mut self, e: &DramEntry) {
        for &r in e.runs.iter() {
            self.alloc.free(r);
        }
    }

    /// Removes `key`. `Err(Conflict)` while a put of it is copying in.
    pub fn remove(&mut self, key: &str) -> Result<bool, ReserveError> {
        match self.map.get(key) {
            None => Ok(false),
            Some(e) if !e.ready => Err(ReserveError::Conflict),
            Some(_) => {
                let e = self.map.remove(key).expect("present");
                self.free_runs(&e);
                Ok(true)
            }
        }
    }

    /// Chooses ready objects to evict so that at least `bytes` are freed, by `policy`.
    pub fn victims(&self, policy: EvictionPolicy, bytes: u64, out: &mut Vec<Arc<str>>) {
        let keys: Vec<&Arc<str>> = self.map.iter().filter(|(_, e)| e.ready).map(|(k, _)| k).collect();
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
    pub fn evict(&mut self, key: &str) -> Option<DramEntry> {
        let e = self.map.remove(key)?;
        self.free_runs(&e);
        Some(e)
    }

    /// The entry of `key`, ready or not (for demotion).
    pub fn entry(&self, key: &str) -> Option<&DramEntry> {
        self.map.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> DramState {
        DramState::new(1 << 20, 64 * 4096, 4096)
    }

    fn put(s: &mut DramState, key: &str, len: u64, depth: u32, now: u64) {
        let g = s.reserve(key, len, depth).unwrap();
        s.commit(key, g, true, now, false);
    }

    #[test]
    fn pending_entries_are_invisible_and_conflict() {
        let mut s = state();
        let g = s.reserve("a", 5000, 0).unwrap();
        assert!(s.get("a").is_none());
        assert_eq!(s.reserve("a", 10, 0), Err(ReserveError::Conflict));
        assert_eq!(s.remove("a"), Err(ReserveError::Conflict));
        let mut v = Vec::new();
        s.victims(EvictionPolicy::Lru, u64::MAX, &mut v);
        assert!(v.is_empty(), "a pending entry is never a victim");
        s.commit("a", g, true, 1, false);
        let e = s.get("a").unwrap();
        assert_eq!(e.extents.iter().map(|x| x.len).sum::<u64>(), 5000);
        assert_eq!(s.used(), 8192);
        assert_eq!(s.remove("a"), Ok(true));
        assert_eq!(s.used(), 0);
    }

    #[test]
    fn promotion_never_replaces_a_present_key() {
        let mut s = state();
        put(&mut s, "a", 4096, 0, 1);
        assert_eq!(s.reserve_absent("a", 4096, 0), Err(ReserveError::Conflict));
        assert!(s.reserve_absent("b", 4096, 0).is_ok());
    }

    #[test]
    fn failed_commit_frees_and_replacement_reuses() {
        let mut s = state();
        let g = s.reserve("a", 4096, 0).unwrap();
        s.commit("a", g, false, 1, false);
        assert!(s.is_empty());
        assert_eq!(s.used(), 0);
        put(&mut s, "a", 4096, 0, 1);
        put(&mut s, "a", 3 * 4096, 0, 2);
        assert_eq!(s.used(), 3 * 4096);
        assert_eq!(s.reserve("big", 65 * 4096, 0), Err(ReserveError::NoSpace));
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
