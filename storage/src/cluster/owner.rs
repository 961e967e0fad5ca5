//! The owner's side of a remote read: say where each asked-for key's bytes are in this peer's
//! exported memory, and afterwards whether the placement a reader used is still the committed one.
//!
//! Consistency is a seqlock-style check, not a pin: RESOLVE reports each DRAM object's arena
//! extents with the generation of its placement (unique per reservation: a re-placed object, even
//! of the same version, has a new one); the reader reads one-sidedly; VALIDATE answers whether
//! each key's committed entry still has that generation. An entry's pages are freed only when it
//! leaves the index (eviction, overwrite, removal), so "same generation after the read" means no
//! byte of it was reused while the read ran. Nothing on the owner waits for a reader, and a reader
//! that dies holds nothing.
//!
//! SSD-resident keys are read by the owner into a registered staging slot (verified block CRCs),
//! held under a lease until the reader's VALIDATE or the lease's deadline, whichever is first.

use std::time::Instant;

use super::wire::{Allocation, Place, WantedKey};
use crate::ssd::log::{LogCore, ReadSpan, SsdEntry};
use crate::store::Store;

impl Store {
    /// RESOLVE: one place per key, and the lease holding any staging slot used (0: none).
    pub(crate) fn places_for_peer(&self, keys: &[WantedKey]) -> (u64, Vec<Place>) {
        let mut places = Vec::with_capacity(keys.len());
        let mut on_ssd: Vec<(usize, SsdEntry)> = Vec::new();
        {
            let dram = self.inner.dram.as_ref().map(|d| d.state.read());
            let ssd = self.inner.ssd.as_ref().map(|s| s.log.index());
            let now = self.now();
            for (i, k) in keys.iter().enumerate() {
                if let Some(e) = dram.as_ref().and_then(|d| d.get(k.key.as_str())) {
                    e.last_access.store(now, std::sync::atomic::Ordering::Relaxed);
                    places.push(Place::Dram {
                        object_len: e.len,
                        generation: e.generation,
                        extents: e.extents.iter().map(|x| (x.addr, x.len)).collect(),
                    });
                } else if let Some(e) = ssd.as_ref().and_then(|s| s.get(k.key.as_str())) {
                    on_ssd.push((i, e.clone()));
                    places.push(Place::Missing);
                } else {
                    places.push(Place::Missing);
                }
            }
        }
        let lease = if on_ssd.is_empty() {
            0
        } else {
            self.stage_for_peer(keys, &on_ssd, &mut places)
        };
        (lease, places)
    }

    /// Reads the SSD-resident keys' requested ranges into one staging slot held under a new
    /// lease. Keys that do not fit the slot, or whose blocks fail, get `Failed`.
    fn stage_for_peer(&self, keys: &[WantedKey], on_ssd: &[(usize, SsdEntry)], places: &mut [Place]) -> u64 {
        let (Some(ssd), Some(cluster)) = (&self.inner.ssd, self.inner.cluster.get()) else {
            return 0;
        };
        for s in cluster.leases.expire() {
            ssd.staging.release_index(s);
        }
        let Some(slot) = ssd.staging.try_acquire_index() else {
            for &(i, _) in on_ssd {
                places[i] = Place::Failed("no staging slot free on the owner".into());
            }
            return 0;
        };
        let slot_addr = ssd.staging.slot_addr(slot);
        let slot_len = ssd.staging.slot_bytes;
        let mut spans: Vec<ReadSpan> = Vec::new();
        let mut range_at: Vec<u64> = Vec::new();
        let mut entries: Vec<&SsdEntry> = Vec::new();
        let mut names: Vec<&str> = Vec::new();
        let mut planned: Vec<(usize, usize)> = Vec::new(); // (key index, first range_at)
        let mut cursor = 0u64;
        for (i, e) in on_ssd {
            let k = &keys[*i];
            if e.is_damaged() {
                places[*i] = Place::Failed("corrupt record".into());
                continue;
            }
            if k.ranges
                .iter()
                .any(|&(o, l)| l == 0 || o > e.payload_len || l > e.payload_len - o)
            {
                // The reader checks ranges against the length it is told; nothing to stage.
                places[*i] = Place::Staged {
                    object_len: e.payload_len,
                    addrs: Vec::new(),
                };
                continue;
            }
            let (s0, r0, c0) = (spans.len(), range_at.len(), cursor);
            LogCore::plan_ranges(
                entries.len(),
                k.ranges.iter().copied(),
                &mut spans,
                &mut cursor,
                &mut range_at,
            );
            if cursor > slot_len {
                spans.truncate(s0);
                range_at.truncate(r0);
                cursor = c0;
                places[*i] = Place::Failed("does not fit one staging slot on the owner".into());
                continue;
            }
            entries.push(e);
            names.push(&k.key);
            planned.push((*i, r0));
        }
        let mut results = Vec::with_capacity(spans.len());
        // SAFETY: the slot index was taken from the free list and is ours until released; every
        // span was planned inside the slot (cursor <= slot length), which is 4 KiB-aligned.
        unsafe {
            ssd.log
                .read_spans(&names, &entries, &spans, ssd.staging.slot_ptr(slot), &mut results)
        };
        let mut failed = vec![false; entries.len()];
        for (s, r) in spans.iter().zip(results) {
            if r.is_err() {
                failed[s.entry] = true;
            }
        }
        for (j, &(i, r0)) in planned.iter().enumerate() {
            places[i] = if failed[j] {
                Place::Failed("the record failed its check on the owner".into())
            } else {
                let n = keys[i].ranges.len();
                Place::Staged {
                    object_len: entries[j].payload_len,
                    addrs: range_at[r0..r0 + n].iter().map(|off| slot_addr + off).collect(),
                }
            };
        }
        let deadline = Instant::now() + cluster.cfg.timeout;
        cluster.leases.hold(slot, deadline)
    }

    /// VALIDATE: releases `lease` and says, per key, whether what the reader read was stable:
    /// for a DRAM key (generation > 0), that its committed entry still has that generation; for
    /// a staged key (generation 0), that the lease was still held, so the slot was not reused.
    pub(crate) fn validate_for_peer(&self, lease: u64, keys: &[(String, u64)]) -> Vec<bool> {
        let mut lease_held = false;
        if let (Some(ssd), Some(cluster)) = (&self.inner.ssd, self.inner.cluster.get()) {
            if let Some((slot, in_time)) = cluster.leases.release(lease) {
                ssd.staging.release_index(slot);
                lease_held = in_time;
            }
        }
        let st = self.inner.dram.as_ref().map(|d| d.state.read());
        keys.iter()
            .map(|(k, g)| match g {
                0 => lease_held,
                g => st.as_ref().and_then(|st| st.get(k)).is_some_and(|e| e.generation == *g),
            })
            .collect()
    }
}

impl Store {
    /// Frees what peers hold past their deadline: staging slots of SSD reads never validated,
    /// and DRAM reserved for remote puts never committed. The cluster's reaper calls it
    /// periodically, so a dead reader or writer holds its slot or space only until its deadline,
    /// whether or not another request arrives.
    pub(crate) fn expire_peer_holds(&self) {
        let Some(c) = self.inner.cluster.get() else {
            return;
        };
        if let Some(ssd) = &self.inner.ssd {
            for s in c.leases.expire() {
                ssd.staging.release_index(s);
            }
        }
        if let Some(d) = &self.inner.dram {
            if c.reservations.lock().is_empty() {
                return;
            }
            let now = self.now();
            let mut st = d.state.write();
            expire(&mut st, &mut c.reservations.lock(), now);
        }
    }

    /// ALLOCATE: reserves arena space for each object of a remote put, from free space below the
    /// high watermark only (a peer's put never evicts here). A reservation is invisible to
    /// readers; it is published by COMMIT, or freed when `UMBP_CLUSTER_TIMEOUT_MS` passes first.
    pub(crate) fn allocate_for_peer(&self, objs: &[Allocation]) -> Vec<Place> {
        let (Some(d), Some(c)) = (&self.inner.dram, self.inner.cluster.get()) else {
            return vec![Place::Failed("no DRAM tier".into()); objs.len()];
        };
        let versions: Vec<u64> = self.next_versions(objs.len()).collect();
        let deadline = Instant::now() + c.cfg.timeout;
        let mut st = d.state.write();
        let mut held = c.reservations.lock();
        expire(&mut st, &mut held, self.now());
        objs.iter()
            .zip(versions)
            .map(|(o, v)| {
                if o.len == 0 || st.used() + st.footprint(o.len) > d.high {
                    return Place::Failed("no space".into());
                }
                match st.reserve(&o.key, o.len, o.depth, v) {
                    Ok(generation) => {
                        held.insert(generation, deadline);
                        Place::Dram {
                            object_len: o.len,
                            generation,
                            extents: st
                                .pending_extents(generation)
                                .unwrap_or_default()
                                .iter()
                                .map(|x| (x.addr, x.len))
                                .collect(),
                        }
                    }
                    Err(_) => Place::Failed("no space".into()),
                }
            })
            .collect()
    }

    /// COMMIT: publishes the reservations a peer wrote into (those still held); returns a verdict
    /// per key and the keys now committed here.
    pub(crate) fn commit_for_peer(&self, keys: &[(String, u64)]) -> (Vec<bool>, Vec<String>) {
        let (Some(d), Some(c)) = (&self.inner.dram, self.inner.cluster.get()) else {
            return (vec![false; keys.len()], Vec::new());
        };
        let now = self.now();
        let mut st = d.state.write();
        let mut held = c.reservations.lock();
        expire(&mut st, &mut held, now);
        let mut committed = Vec::new();
        let verdicts = keys
            .iter()
            .map(|(k, g)| {
                let ok = held.remove(g).is_some() && st.commit(*g, true, now, false, |_, _| true);
                if ok {
                    committed.push(k.clone());
                }
                ok
            })
            .collect();
        (verdicts, committed)
    }
}

/// Frees the reservations of remote puts whose deadline passed (their writer died or gave up).
fn expire(st: &mut crate::dram::tier::DramState, held: &mut std::collections::HashMap<u64, Instant>, now: u64) {
    let t = Instant::now();
    held.retain(|&g, &mut deadline| {
        let keep = deadline > t;
        if !keep {
            st.commit(g, false, now, false, |_, _| false);
        }
        keep
    });
}
