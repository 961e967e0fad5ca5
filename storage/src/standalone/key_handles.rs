//! Key handles: a ranged get names a key set the server already knows with an 8-byte handle
//! instead of resending every key (seed 004).
//!
//! - Client: [`ClientCache`], `UMBP_KEY_HANDLE_SLOTS` (128) key sets, fingerprint -> handle, with a
//!   full key comparison as the source of correctness. Slots 0 turns it off *and* sends a zero
//!   fingerprint, so the server remembers nothing and no key is hashed for an answer thrown away.
//! - Server: [`ServerTable`], `UMBP_KEY_HANDLE_CAPACITY` (512) entries, each tagged with the session
//!   that minted it. Capacity 0 turns it off (no insert, so no eviction loop to spin).
//! - Both replace at random, with no LRU and no aging: a chunked reader walks a fixed cycle of key
//!   sets, and LRU evicts exactly the entry needed next once the cycle exceeds its capacity (a
//!   cliff), while random replacement degrades in proportion.
//! - Handles are minted from 1 and never reused; an unknown handle is answered
//!   `key_handle_unknown` and the client resends the keys. The handle is a hint, never trusted.
//! - Both tables allocate lazily (nothing until the first mint).
//!
//! The reuse-distance histogram (`UMBP_KEY_HANDLE_DEBUG=1`) says which capacity an LRU would have
//! needed for each reuse: the diagnosis that named the fix in the seed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::core::Resolved;

/// Default client slots.
pub const DEFAULT_SLOTS: usize = 128;
/// Default server entries.
pub const DEFAULT_CAPACITY: usize = 512;
/// Reuse-distance buckets: `< 8, < 16, ... < 1024`, then the rest.
pub const BUCKETS: [usize; 8] = [8, 16, 32, 64, 128, 256, 512, 1024];
/// Key sets the debug histogram tracks (older ones count as the last bucket).
const TRACKED: usize = 4096;
/// Fingerprints remembered to tell remints from first mints.
const MINTED_MEMORY: usize = 1 << 16;

/// 64-bit fingerprint of a key set (never 0: 0 means "do not remember"): foldhash over every
/// key's length and bytes, with a fixed seed. Only this process compares fingerprints (the server
/// takes them as opaque), so the hash need not be stable across builds. foldhash replaced CRC32C
/// here: the `crc32c` crate's per-call cost made a 128-byte key about 140 instructions, most of
/// a handle hit's client work (callgrind, docs/PERFORMANCE.md). Collisions only cost a miss: the
/// full key comparison decides.
pub fn fingerprint<'a>(keys: impl Iterator<Item = &'a str>) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = foldhash::fast::FixedState::with_seed(FINGERPRINT_SEED).build_hasher();
    for k in keys {
        h.write_usize(k.len());
        h.write(k.as_bytes());
    }
    h.finish().max(1)
}

/// Seed of [`fingerprint`] (any fixed value).
const FINGERPRINT_SEED: u64 = 0x756d_6270_6b68_7331;

/// A key set, each key in its own allocation: naming key `i` as a `&str` reads only its pointer
/// and length, never its bytes. One blob with end offsets would be denser, but slicing a `str`
/// checks char boundaries by reading the bytes at both ends; on the server's hit path that was a
/// cache miss per key (7% of the server's samples in a 512-key call, `perf`, docs/PERFORMANCE.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySet {
    keys: Box<[Box<str>]>,
}

impl KeySet {
    /// Copies `keys`.
    pub fn new<'a>(keys: impl Iterator<Item = &'a str>) -> KeySet {
        KeySet {
            keys: keys.map(Box::from).collect(),
        }
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// True without keys.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Key `i`.
    pub fn key(&self, i: usize) -> &str {
        &self.keys[i]
    }

    /// The keys in order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|k| &**k)
    }

    /// True if these are exactly `keys`, in order.
    pub fn equals<'a>(&self, keys: impl ExactSizeIterator<Item = &'a str>) -> bool {
        keys.len() == self.len() && keys.zip(self.keys.iter()).all(|(a, b)| a.as_bytes() == b.as_bytes())
    }

    /// Heap bytes held: the keys' bytes and one pointer and length per key.
    pub fn bytes(&self) -> usize {
        self.keys.len() * std::mem::size_of::<Box<str>>() + self.keys.iter().map(|k| k.len()).sum::<usize>()
    }
}

/// Counters of the client cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientCounts {
    /// Calls that named their keys by a handle the server accepted.
    pub hits: u64,
    /// Calls that sent their keys (no slot, or a slot with other keys).
    pub misses: u64,
    /// Handles received for key sets sent.
    pub mints: u64,
    /// Mints of a key set minted before (it was evicted or forgotten since).
    pub remints: u64,
}

struct Slot {
    fingerprint: u64,
    handle: u64,
    keys: KeySet,
}

/// The client's key-set cache.
pub struct ClientCache {
    slots: usize,
    entries: Vec<Slot>,
    by_fp: HashMap<u64, usize>,
    minted: HashSet<u64>,
    counts: ClientCounts,
    rng: fastrand::Rng,
    reuse: Option<ReuseHistogram>,
    /// The server session the held handles belong to; handles minted by another are refused.
    session: u64,
}

/// What a call sends for its key set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// Fingerprint to send (0 with the cache off).
    pub fingerprint: u64,
    /// Handle to send instead of the keys (0: send the keys).
    pub handle: u64,
}

impl ClientCache {
    /// A cache of `slots` key sets; `debug` keeps the reuse-distance histogram.
    pub fn new(slots: usize, debug: bool, seed: u64) -> ClientCache {
        ClientCache {
            slots,
            entries: Vec::new(),
            by_fp: HashMap::new(),
            minted: HashSet::new(),
            counts: ClientCounts::default(),
            rng: fastrand::Rng::with_seed(seed),
            reuse: debug.then(ReuseHistogram::default),
            session: 0,
        }
    }

    /// The fingerprint and handle for a call with `keys`. With no slots nothing is hashed and
    /// the fingerprint is 0.
    pub fn lookup<'a>(&mut self, keys: impl ExactSizeIterator<Item = &'a str> + Clone) -> Lookup {
        if self.slots == 0 || keys.len() == 0 {
            return Lookup {
                fingerprint: 0,
                handle: 0,
            };
        }
        let fp = fingerprint(keys.clone());
        if let Some(r) = &mut self.reuse {
            r.access(fp);
        }
        let handle = match self.by_fp.get(&fp) {
            Some(&i) if self.entries[i].keys.equals(keys) => self.entries[i].handle,
            _ => 0,
        };
        Lookup {
            fingerprint: fp,
            handle,
        }
    }

    /// The server accepted `handle`.
    pub fn hit(&mut self) {
        self.counts.hits += 1;
    }

    /// The call sent its keys.
    pub fn miss(&mut self) {
        self.counts.misses += 1;
    }

    /// The server did not know the handle for `fingerprint`: drop it (the keys are resent).
    pub fn forget(&mut self, fingerprint: u64) {
        if let Some(i) = self.by_fp.remove(&fingerprint) {
            self.remove_at(i);
        }
    }

    /// The server minted `handle` for `keys` (fingerprint `fp`): keep it, replacing a random slot
    /// when full.
    pub fn insert<'a>(&mut self, fp: u64, handle: u64, keys: impl Iterator<Item = &'a str>) {
        if self.slots == 0 || handle == 0 {
            return;
        }
        self.counts.mints += 1;
        if !self.minted.insert(fp) {
            self.counts.remints += 1;
        } else if self.minted.len() > MINTED_MEMORY {
            self.minted.clear();
        }
        if let Some(i) = self.by_fp.remove(&fp) {
            self.remove_at(i);
        }
        if self.entries.len() >= self.slots {
            let victim = self.rng.usize(..self.entries.len());
            let fp = self.entries[victim].fingerprint;
            self.by_fp.remove(&fp);
            self.remove_at(victim);
        }
        self.by_fp.insert(fp, self.entries.len());
        self.entries.push(Slot {
            fingerprint: fp,
            handle,
            keys: KeySet::new(keys),
        });
    }

    fn remove_at(&mut self, i: usize) {
        self.entries.swap_remove(i);
        if let Some(moved) = self.entries.get(i) {
            self.by_fp.insert(moved.fingerprint, i);
        }
    }

    /// Forgets every handle and holds only those of `session` from now on (a new server, or a
    /// new session, knows none of the old ones; a reply of the old session arriving late must
    /// not bring one back).
    pub fn reset(&mut self, session: u64) {
        self.entries.clear();
        self.by_fp.clear();
        self.session = session;
    }

    /// The session the held handles belong to.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// Counters.
    pub fn counts(&self) -> ClientCounts {
        self.counts
    }

    /// Key sets held.
    pub fn held(&self) -> usize {
        self.entries.len()
    }

    /// The reuse-distance histogram (with debug on).
    pub fn reuse(&self) -> Option<&ReuseHistogram> {
        self.reuse.as_ref()
    }
}

/// LRU stack distances of key-set reuses: for each reuse, how many distinct key sets were used
/// since; an LRU of capacity N would have hit it iff the distance is below N.
#[derive(Debug, Default, Clone)]
pub struct ReuseHistogram {
    /// Most recent first.
    stack: Vec<u64>,
    /// Reuses per bucket of [`BUCKETS`], then at or beyond the last.
    pub counts: [u64; 9],
}

impl ReuseHistogram {
    fn access(&mut self, fp: u64) {
        match self.stack.iter().position(|&f| f == fp) {
            Some(d) => {
                let b = BUCKETS.iter().position(|&n| d < n).unwrap_or(BUCKETS.len());
                self.counts[b] += 1;
                self.stack.remove(d);
            }
            None if self.stack.len() >= TRACKED => {
                self.stack.pop();
            }
            None => {}
        }
        self.stack.insert(0, fp);
    }

    /// Reuses seen.
    pub fn reuses(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Share of reuses an LRU of capacity `BUCKETS[i]` would have caught.
    pub fn would_hit(&self) -> [f64; 8] {
        let total = self.reuses().max(1) as f64;
        let mut acc = 0;
        let mut out = [0.0; 8];
        for (i, o) in out.iter_mut().enumerate() {
            acc += self.counts[i];
            *o = acc as f64 / total * 100.0;
        }
        out
    }

    /// `would hit at capacity: <8 x% <16 y% ... <1024 z%`.
    pub fn line(&self) -> String {
        let parts: Vec<String> = BUCKETS
            .iter()
            .zip(self.would_hit())
            .map(|(n, p)| format!("<{n} {p:.1}%"))
            .collect();
        format!("would hit at capacity: {} ({} reuses)", parts.join(" "), self.reuses())
    }
}

/// Counters of the server table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerCounts {
    /// Handles resolved.
    pub hits: u64,
    /// Handles not known (evicted, another session's, never minted).
    pub misses: u64,
    /// Handles minted.
    pub mints: u64,
    /// Entries held now.
    pub held: u64,
    /// Heap bytes the entries hold now.
    pub bytes: u64,
}

/// A key set the server holds for a handle, and what the store resolved for it last time (the
/// keys' DRAM locations, reused on a hit while the store's index is unchanged; see
/// `store::Resolved`). Keys and resolution belong together: the keys never change.
pub struct Held {
    /// The keys, in the order the client sent them.
    pub keys: KeySet,
    /// The store's last resolution of `keys`; a call that finds it locked resolves afresh.
    pub(crate) resolved: Mutex<Resolved>,
}

impl Held {
    fn new(keys: KeySet) -> Held {
        let resolved = Mutex::new(Resolved::with_capacity(keys.len()));
        Held { keys, resolved }
    }

    /// Heap bytes held: the keys, their ends and one location pointer per key.
    pub fn bytes(&self) -> usize {
        self.keys.bytes() + self.resolved.lock().bytes()
    }
}

struct Entry {
    session: u64,
    fingerprint: u64,
    held: Arc<Held>,
    bytes: usize,
}

/// The server's key-set table.
pub struct ServerTable {
    capacity: usize,
    entries: HashMap<u64, Entry>,
    ids: Vec<u64>,
    next: u64,
    counts: ServerCounts,
    rng: fastrand::Rng,
}

impl ServerTable {
    /// A table of `capacity` entries (0: off).
    pub fn new(capacity: usize, seed: u64) -> ServerTable {
        ServerTable {
            capacity,
            entries: HashMap::new(),
            ids: Vec::new(),
            next: 1,
            counts: ServerCounts::default(),
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// The keys `handle` names for `session`, if it minted it for a key set of `fingerprint` with
    /// `nkeys` keys.
    pub fn resolve(&mut self, session: u64, handle: u64, fingerprint: u64, nkeys: usize) -> Option<Arc<Held>> {
        match self.entries.get(&handle) {
            Some(e) if e.session == session && e.fingerprint == fingerprint && e.held.keys.len() == nkeys => {
                self.counts.hits += 1;
                Some(e.held.clone())
            }
            _ => {
                self.counts.misses += 1;
                None
            }
        }
    }

    /// Remembers `keys` for `session` and returns their new handle; 0 when the table is off or
    /// the fingerprint is 0 (the client asks not to be remembered).
    pub fn mint<'a>(&mut self, session: u64, fingerprint: u64, keys: impl Iterator<Item = &'a str>) -> u64 {
        self.mint_held(session, fingerprint, keys).0
    }

    /// As [`ServerTable::mint`], also returning the new entry (so the minting call can fill its
    /// resolution and the first hit already reuses it).
    pub fn mint_held<'a>(
        &mut self,
        session: u64,
        fingerprint: u64,
        keys: impl Iterator<Item = &'a str>,
    ) -> (u64, Option<Arc<Held>>) {
        if self.capacity == 0 || fingerprint == 0 {
            return (0, None);
        }
        if self.ids.len() >= self.capacity {
            let victim = self.ids.swap_remove(self.rng.usize(..self.ids.len()));
            if let Some(e) = self.entries.remove(&victim) {
                self.counts.bytes -= e.bytes as u64;
            }
        }
        let handle = self.next;
        self.next += 1;
        let held = Arc::new(Held::new(KeySet::new(keys)));
        let bytes = held.bytes();
        self.counts.bytes += bytes as u64;
        self.counts.mints += 1;
        self.entries.insert(
            handle,
            Entry {
                session,
                fingerprint,
                held: held.clone(),
                bytes,
            },
        );
        self.ids.push(handle);
        (handle, Some(held))
    }

    /// Drops every entry of `session` (it ended).
    pub fn drop_session(&mut self, session: u64) {
        let entries = &mut self.entries;
        let bytes = &mut self.counts.bytes;
        self.ids.retain(|h| {
            let keep = entries.get(h).is_some_and(|e| e.session != session);
            if !keep {
                if let Some(e) = entries.remove(h) {
                    *bytes -= e.bytes as u64;
                }
            }
            keep
        });
    }

    /// Counters, with `held` and `bytes` as of now.
    pub fn counts(&self) -> ServerCounts {
        ServerCounts {
            held: self.ids.len() as u64,
            ..self.counts
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sets(c: usize) -> Vec<Vec<String>> {
        (0..c)
            .map(|s| (0..4).map(|k| format!("layer-group-{s}/key-{k}")).collect())
            .collect()
    }

    /// Walks a cycle of `c` key sets `rounds` times through a client cache of `slots` in front
    /// of a server table of `capacity`; returns (hit rate over reuses, mints, remints).
    fn cycle(c: usize, slots: usize, capacity: usize, rounds: usize) -> (f64, ClientCounts) {
        let sets = sets(c);
        let mut client = ClientCache::new(slots, true, 7);
        let mut server = ServerTable::new(capacity, 11);
        for _ in 0..rounds {
            for s in &sets {
                let l = client.lookup(s.iter().map(String::as_str));
                if l.handle != 0 {
                    if server.resolve(1, l.handle, l.fingerprint, s.len()).is_some() {
                        client.hit();
                        continue;
                    }
                    client.forget(l.fingerprint);
                }
                client.miss();
                let h = server.mint(1, l.fingerprint, s.iter().map(String::as_str));
                client.insert(l.fingerprint, h, s.iter().map(String::as_str));
            }
        }
        let n = client.counts();
        let reuses = (c * (rounds - 1)) as f64;
        (n.hits as f64 / reuses, n)
    }

    #[test]
    fn a_cycle_that_fits_hits_every_reuse_without_remints() {
        let (rate, n) = cycle(8, 8, 512, 56);
        assert_eq!(rate, 1.0);
        assert_eq!((n.mints, n.remints), (8, 0));
    }

    #[test]
    fn a_cycle_longer_than_the_client_degrades_in_proportion() {
        // Random replacement on a cycle: ~77% at C = 9 and ~19% at C = 16 for 8 slots; LRU
        // gives 0 on both (every reuse is at distance C - 1 >= 8).
        let (r9, n9) = cycle(9, 8, 512, 200);
        let (r16, _) = cycle(16, 8, 512, 200);
        let (r32, _) = cycle(32, 8, 512, 200);
        let (r40, _) = cycle(40, 8, 512, 200);
        assert!(r9 >= 0.70, "C=9: {r9}");
        assert!(r16 >= 0.15, "C=16: {r16}");
        assert!(r32 > 0.0 && r40 > 0.0, "C=32: {r32}, C=40: {r40}");
        assert!(n9.remints > 0 && n9.remints < n9.mints);
    }

    #[test]
    fn a_cycle_longer_than_the_server_table_degrades_in_proportion() {
        let (r9, _) = cycle(9, 512, 8, 200);
        let (r16, _) = cycle(16, 512, 8, 200);
        assert!(r9 >= 0.70, "C=9: {r9}");
        assert!(r16 >= 0.15, "C=16: {r16}");
    }

    #[test]
    fn the_histogram_names_the_capacity_a_cycle_needs() {
        let sets = sets(9);
        let mut client = ClientCache::new(8, true, 1);
        for _ in 0..10 {
            for s in &sets {
                client.lookup(s.iter().map(String::as_str));
            }
        }
        let r = client.reuse().unwrap();
        assert_eq!(r.reuses(), 81);
        assert_eq!(r.would_hit()[0], 0.0);
        assert_eq!(r.would_hit()[1], 100.0);
        assert!(
            r.line().starts_with("would hit at capacity: <8 0.0% <16 100.0%"),
            "{}",
            r.line()
        );
    }

    #[test]
    fn capacity_zero_remembers_nothing_and_returns() {
        // The seed's eviction loop spun forever at capacity 0: bound the wait.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut t = ServerTable::new(0, 1);
            let minted: Vec<u64> = (0..1000u64).map(|i| t.mint(1, i + 1, ["k"].into_iter())).collect();
            let _ = tx.send((minted, t.counts()));
        });
        let (minted, counts) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("minting at capacity 0 did not return");
        assert!(minted.iter().all(|&h| h == 0));
        assert_eq!(counts, ServerCounts::default());
    }

    #[test]
    fn slots_zero_hashes_nothing_and_asks_for_nothing() {
        let mut c = ClientCache::new(0, false, 1);
        let l = c.lookup(["a", "b"].into_iter());
        assert_eq!(
            l,
            Lookup {
                fingerprint: 0,
                handle: 0
            }
        );
        c.insert(5, 9, ["a"].into_iter());
        assert_eq!(c.held(), 0);
    }

    #[test]
    fn handles_are_never_reused_and_belong_to_their_session() {
        let mut t = ServerTable::new(2, 3);
        let a = t.mint(1, 10, ["a"].into_iter());
        let b = t.mint(1, 11, ["b"].into_iter());
        let c = t.mint(2, 12, ["c"].into_iter());
        assert_eq!((a, b, c), (1, 2, 3));
        assert!(t.resolve(1, c, 12, 1).is_none(), "another session's handle");
        assert!(t.resolve(2, c, 13, 1).is_none(), "wrong fingerprint");
        assert_eq!(t.resolve(2, c, 12, 1).unwrap().keys.key(0), "c");
        t.drop_session(2);
        assert!(t.resolve(2, c, 12, 1).is_none());
        assert_eq!(t.counts().held, 1);
        assert!(t.counts().bytes > 0);
        t.drop_session(1);
        assert_eq!((t.counts().held, t.counts().bytes), (0, 0));
    }

    #[test]
    fn a_fingerprint_collision_is_caught_by_the_key_comparison() {
        let mut c = ClientCache::new(4, false, 1);
        let fp = fingerprint(["a"].into_iter());
        c.insert(fp, 1, ["a"].into_iter());
        // Another key set presented under the same fingerprint: the full comparison says no.
        c.by_fp.insert(fingerprint(["b"].into_iter()), 0);
        assert_eq!(c.lookup(["b"].into_iter()).handle, 0);
        assert_eq!(c.lookup(["a"].into_iter()).handle, 1);
    }
}
