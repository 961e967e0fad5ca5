//! The owner's side of remote reads and writes, as the control listener answers them: say where
//! each asked-for key's bytes are in this peer's exported memory, and afterwards whether the
//! placement a reader used is still the committed one; reserve space for a remote writer and
//! commit it.
//!
//! Consistency is a seqlock-style check, not a pin: RESOLVE reports each DRAM object's arena
//! extents with the generation of its placement (unique per reservation: a re-placed object, even
//! of the same version, has a new one); the reader reads one-sidedly; VALIDATE answers whether
//! each key's committed entry still has that generation. An entry's pages are freed only when it
//! leaves the index (eviction, overwrite, removal), so "same generation after the read" means no
//! byte of it was reused while the read ran. Nothing on the owner waits for a reader, and a reader
//! that dies holds nothing.
//!
//! SSD-resident keys are read by the core into a registered staging slot (verified block CRCs),
//! held here under a lease until the reader's VALIDATE or the lease's deadline, whichever is
//! first. The tiers are touched only through the core's named operations (`core::exported`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::leases::Leases;
use super::wire::{Allocation, Place, WantedKey};
use crate::core::exported::{Exported, Reserved, Wanted};
use crate::core::Core;

/// What this peer holds for remote readers and writers, over its core (held weakly: a store
/// that is dropped stops serving).
pub(crate) struct Owner {
    core: Weak<Core>,
    timeout: Duration,
    leases: Leases,
    /// Reservations peers are writing into (remote puts), with their deadlines.
    reservations: Mutex<HashMap<u64, Instant>>,
    /// The versions of the keys this peer wrote (sharded directory: the last write wins).
    pub(crate) versions: Versions,
}

/// The versions this peer minted for its writes: a hybrid clock (wall-clock milliseconds in the
/// high bits, a counter below, never repeating or going back in this process), one version per
/// put call, recorded per key for re-publication and retirement. Versions order writes of one
/// key across peers by their writers' clocks (ties by owner name, `shard::newer`).
#[derive(Default)]
pub(crate) struct Versions {
    last: AtomicU64,
    keys: Mutex<VersionMap>,
}

#[derive(Default)]
struct VersionMap {
    of: HashMap<String, u64>,
    /// Size at which entries of keys the core no longer holds (evicted) are pruned.
    prune_at: usize,
}

/// Bits of a version below the milliseconds: about a million versions per millisecond.
const COUNTER_BITS: u32 = 20;

impl Versions {
    /// A new version, above every one minted here before.
    pub(crate) fn mint(&self) -> u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
            << COUNTER_BITS;
        let prev = self
            .last
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| Some(now.max(l + 1)))
            .unwrap_or_else(|l| l);
        now.max(prev + 1)
    }

    /// Moves the clock past `seen` (a version another peer minted): the next write here is newer.
    pub(crate) fn observe(&self, seen: u64) {
        self.last.fetch_max(seen, Ordering::AcqRel);
    }

    /// Mints one version for a put of `keys` and records it for each (one lock per call).
    pub(crate) fn stamp(&self, keys: &[String], core: Option<&Core>) -> Vec<u64> {
        let v = self.mint();
        let mut m = self.keys.lock();
        if m.of.len() + keys.len() > m.prune_at {
            if let Some(core) = core {
                let held: std::collections::HashSet<String> = core.keys().into_iter().collect();
                m.of.retain(|k, _| held.contains(k));
            }
            m.prune_at = (2 * m.of.len()).max(4096);
        }
        for k in keys {
            m.of.insert(k.clone(), v);
        }
        vec![v; keys.len()]
    }

    /// The recorded version of each of `keys` (0: none recorded, as for keys a restarted peer
    /// found in its SSD log: any write since supersedes them).
    pub(crate) fn recorded(&self, keys: &[String]) -> Vec<u64> {
        let m = self.keys.lock();
        keys.iter().map(|k| m.of.get(k).copied().unwrap_or(0)).collect()
    }

    /// Forgets `key`'s version (removed here).
    pub(crate) fn forget(&self, key: &str) {
        self.keys.lock().of.remove(key);
    }
}

impl Owner {
    pub(crate) fn new(core: Weak<Core>, timeout: Duration) -> Owner {
        Owner {
            core,
            timeout,
            leases: Leases::default(),
            reservations: Mutex::new(HashMap::new()),
            versions: Versions::default(),
        }
    }

    /// RETIRE: drops the copies of `keys` this peer still holds at the given (superseded)
    /// versions; a copy written here since (a newer version) stays. Returns how many went.
    pub(crate) fn retire(&self, core: &Core, keys: &[(String, u64)]) -> usize {
        let mut m = self.versions.keys.lock();
        let mut gone = 0;
        for (k, v) in keys {
            let held = m.of.get(k).copied().unwrap_or(0);
            if held <= *v && core.remove(k).unwrap_or(false) {
                m.of.remove(k);
                gone += 1;
            }
        }
        gone
    }

    /// The core, while the store is open.
    pub(crate) fn core(&self) -> Option<Arc<Core>> {
        self.core.upgrade()
    }

    /// RESOLVE: one place per key, and the lease holding any staging slot used (0: none).
    pub(crate) fn resolve(&self, core: &Core, keys: &[WantedKey]) -> (u64, Vec<Place>) {
        for s in self.leases.expire() {
            core.release_staging_slot(s);
        }
        let asked: Vec<(&str, &[(u64, u64)])> = keys.iter().map(|k| (k.key.as_str(), k.ranges.as_slice())).collect();
        let (slot, places) = core.export_ranges(&asked);
        let lease = slot.map_or(0, |s| self.leases.hold(s, Instant::now() + self.timeout));
        (lease, places.into_iter().map(place).collect())
    }

    /// VALIDATE: releases `lease` and says, per key, whether what the reader read was stable.
    pub(crate) fn validate(&self, core: &Core, lease: u64, keys: &[(String, u64)]) -> Vec<bool> {
        let mut lease_held = false;
        if let Some((slot, in_time)) = self.leases.release(lease) {
            core.release_staging_slot(slot);
            lease_held = in_time;
        }
        core.still_committed(keys, lease_held)
    }

    /// Frees what peers hold past their deadline: staging slots of SSD reads never validated,
    /// and DRAM reserved for remote puts never committed. The cluster's reaper calls it
    /// periodically, so a dead reader or writer holds its slot or space only until its deadline,
    /// whether or not another request arrives.
    pub(crate) fn expire_holds(&self, core: &Core) {
        for s in self.leases.expire() {
            core.release_staging_slot(s);
        }
        let now = Instant::now();
        let expired: Vec<u64> = {
            let mut held = self.reservations.lock();
            let gone: Vec<u64> = held.iter().filter(|(_, &d)| d <= now).map(|(&g, _)| g).collect();
            for g in &gone {
                held.remove(g);
            }
            gone
        };
        if !expired.is_empty() {
            core.finish_reservations(&expired, false);
        }
    }

    /// ALLOCATE: reserves arena space for each object of a remote put, from free space below the
    /// high watermark only (a peer's put never evicts here). A reservation is invisible to
    /// readers; it is published by COMMIT, or freed when `UMBP_CLUSTER_TIMEOUT_MS` passes first.
    pub(crate) fn allocate(&self, core: &Core, objs: &[Allocation]) -> Vec<Place> {
        self.expire_holds(core);
        let wanted: Vec<Wanted<'_>> = objs
            .iter()
            .map(|o| Wanted {
                key: &o.key,
                len: o.len,
                depth: o.depth,
            })
            .collect();
        let reserved = core.reserve_exported(&wanted);
        let deadline = Instant::now() + self.timeout;
        let mut held = self.reservations.lock();
        objs.iter()
            .zip(reserved)
            .map(|(o, r)| match r {
                Some(Reserved { generation, extents }) => {
                    held.insert(generation, deadline);
                    Place::Dram {
                        object_len: o.len,
                        generation,
                        extents,
                    }
                }
                None => Place::Failed("no space".into()),
            })
            .collect()
    }

    /// COMMIT: publishes the reservations a peer wrote into (those still held); returns a verdict
    /// per key and the keys now committed here.
    pub(crate) fn commit(&self, core: &Core, keys: &[(String, u64)]) -> (Vec<bool>, Vec<String>) {
        self.expire_holds(core);
        // A reservation is finished by whoever takes it out of the map: this commit, or expiry.
        let taken: Vec<bool> = {
            let mut held = self.reservations.lock();
            keys.iter().map(|(_, g)| held.remove(g).is_some()).collect()
        };
        let generations: Vec<u64> = keys
            .iter()
            .zip(&taken)
            .filter(|(_, &t)| t)
            .map(|((_, g), _)| *g)
            .collect();
        let mut committed_now = core.finish_reservations(&generations, true).into_iter();
        let mut committed = Vec::new();
        let verdicts = keys
            .iter()
            .zip(taken)
            .map(|((k, _), t)| {
                let ok = t && committed_now.next().unwrap_or(false);
                if ok {
                    committed.push(k.clone());
                }
                ok
            })
            .collect();
        (verdicts, committed)
    }
}

fn place(e: Exported) -> Place {
    match e {
        Exported::Dram {
            object_len,
            generation,
            extents,
        } => Place::Dram {
            object_len,
            generation,
            extents,
        },
        Exported::Staged { object_len, addrs } => Place::Staged { object_len, addrs },
        Exported::Failed(why) => Place::Failed(why.into()),
        Exported::Missing => Place::Missing,
    }
}
