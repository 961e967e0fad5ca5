//! What a remote peer may ask of this store's exported memory (distributed mode's owner side),
//! as named operations of the core: where keys' bytes are (DRAM extents with their placement
//! generation, or SSD ranges read into a staging slot), whether a placement is still the
//! committed one, and reservations a remote writer fills and then commits. The cluster layer
//! keeps the leases and deadlines; the core only answers for its tiers.
//!
//! Consistency is a seqlock-style check, not a pin (see `cluster::owner`): an entry's pages are
//! freed only when it leaves the index, so "same generation after the read" means no byte of it
//! was reused while the read ran.

use std::sync::atomic::Ordering;

use super::Core;
use crate::ssd::log::{LogCore, ReadSpan, SsdEntry};

/// Where one asked-for key is in exported memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Exported {
    /// In the DRAM arena as committed generation `generation`, at `extents` (`(addr, len)` in
    /// object order).
    Dram {
        object_len: u64,
        generation: u64,
        extents: Vec<(u64, u64)>,
    },
    /// Read from SSD into the answer's staging slot: the address of each asked-for range, in
    /// order (none when a range lies outside the object: the reader checks them against
    /// `object_len`).
    Staged { object_len: u64, addrs: Vec<u64> },
    /// Held here but not servable.
    Failed(&'static str),
    /// Not held here.
    Missing,
}

/// Arena space reserved for a remote writer: the reservation's generation (COMMIT names it) and
/// its extents (`(addr, len)` in object order).
pub(crate) struct Reserved {
    pub(crate) generation: u64,
    pub(crate) extents: Vec<(u64, u64)>,
}

/// One object a remote writer wants space for.
pub(crate) struct Wanted<'a> {
    pub(crate) key: &'a str,
    pub(crate) len: u64,
    pub(crate) depth: u32,
}

impl Core {
    /// The phase timer of ranged calls (off unless `UMBP_RANGED_CALL_DEBUG=1`).
    pub(crate) fn timer(&self) -> &te_base::PhaseTimer {
        &self.timer
    }

    /// DRAM bytes below the high watermark not yet allocated (what a remote put may use
    /// here; membership announces it).
    pub(crate) fn dram_free(&self) -> u64 {
        self.dram
            .as_ref()
            .map(|d| d.high.saturating_sub(d.state.read().used()))
            .unwrap_or(0)
    }

    /// Every key the tiers hold, sorted.
    pub(crate) fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = Vec::new();
        if let Some(d) = &self.dram {
            keys.extend(d.state.read().keys().map(|k| k.to_string()));
        }
        if let Some(s) = &self.ssd {
            keys.extend(s.log.index().keys().map(|k| k.to_string()));
        }
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// Where each key's `ranges` (`(offset, len)`) are. SSD-resident keys are read into one
    /// staging slot taken without waiting; the slot is returned and stays taken until
    /// [`Core::release_staging_slot`]. Keys that do not fit it, or whose blocks fail, are
    /// `Failed`.
    pub(crate) fn export_ranges(&self, keys: &[(&str, &[(u64, u64)])]) -> (Option<usize>, Vec<Exported>) {
        let mut places = Vec::with_capacity(keys.len());
        let mut on_ssd: Vec<(usize, SsdEntry)> = Vec::new();
        {
            let dram = self.dram.as_ref().map(|d| d.state.read());
            let ssd = self.ssd.as_ref().map(|s| s.log.index());
            let now = self.now();
            for (i, &(key, _)) in keys.iter().enumerate() {
                if let Some(e) = dram.as_ref().and_then(|d| d.get(key)) {
                    e.last_access.store(now, Ordering::Relaxed);
                    places.push(Exported::Dram {
                        object_len: e.len,
                        generation: e.generation,
                        extents: e.extents.iter().map(|x| (x.addr, x.len)).collect(),
                    });
                } else {
                    if let Some(e) = ssd.as_ref().and_then(|s| s.get(key)) {
                        on_ssd.push((i, e.clone()));
                    }
                    places.push(Exported::Missing);
                }
            }
        }
        let slot = if on_ssd.is_empty() {
            None
        } else {
            self.stage(keys, &on_ssd, &mut places)
        };
        (slot, places)
    }

    /// Reads the SSD-resident keys' ranges into one staging slot; `None` when no slot is free.
    fn stage(
        &self,
        keys: &[(&str, &[(u64, u64)])],
        on_ssd: &[(usize, SsdEntry)],
        places: &mut [Exported],
    ) -> Option<usize> {
        let ssd = self.ssd.as_ref()?;
        let Some(slot) = ssd.staging.try_acquire_index() else {
            for &(i, _) in on_ssd {
                places[i] = Exported::Failed("no staging slot free on the owner");
            }
            return None;
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
            let (key, ranges) = keys[*i];
            if e.is_damaged() {
                places[*i] = Exported::Failed("corrupt record");
                continue;
            }
            if ranges
                .iter()
                .any(|&(o, l)| l == 0 || o > e.payload_len || l > e.payload_len - o)
            {
                // The reader checks ranges against the length it is told; nothing to stage.
                places[*i] = Exported::Staged {
                    object_len: e.payload_len,
                    addrs: Vec::new(),
                };
                continue;
            }
            let (s0, r0, c0) = (spans.len(), range_at.len(), cursor);
            LogCore::plan_ranges(
                entries.len(),
                ranges.iter().copied(),
                &mut spans,
                &mut cursor,
                &mut range_at,
            );
            if cursor > slot_len {
                spans.truncate(s0);
                range_at.truncate(r0);
                cursor = c0;
                places[*i] = Exported::Failed("does not fit one staging slot on the owner");
                continue;
            }
            entries.push(e);
            names.push(key);
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
                Exported::Failed("the record failed its check on the owner")
            } else {
                let n = keys[i].1.len();
                Exported::Staged {
                    object_len: entries[j].payload_len,
                    addrs: range_at[r0..r0 + n].iter().map(|off| slot_addr + off).collect(),
                }
            };
        }
        Some(slot)
    }

    /// Returns a staging slot [`Core::export_ranges`] took.
    pub(crate) fn release_staging_slot(&self, slot: usize) {
        if let Some(ssd) = &self.ssd {
            ssd.staging.release_index(slot);
        }
    }

    /// Per key, whether what a reader read was stable: for a DRAM key (generation > 0), that its
    /// committed entry still has that generation; for a staged key (generation 0), `staged_ok`
    /// (the caller's lease on the slot was still held).
    pub(crate) fn still_committed(&self, keys: &[(String, u64)], staged_ok: bool) -> Vec<bool> {
        let st = self.dram.as_ref().map(|d| d.state.read());
        keys.iter()
            .map(|(k, g)| match g {
                0 => staged_ok,
                g => st.as_ref().and_then(|st| st.get(k)).is_some_and(|e| e.generation == *g),
            })
            .collect()
    }

    /// Reserves arena space for each object, from free space below the high watermark only (a
    /// remote writer never evicts here), per object placed. A
    /// reservation is invisible to readers until [`Core::finish_reservations`] commits it.
    pub(crate) fn reserve_exported(&self, objs: &[Wanted<'_>]) -> Vec<Option<Reserved>> {
        let Some(d) = &self.dram else {
            return objs.iter().map(|_| None).collect();
        };
        let versions: Vec<u64> = self.next_versions(objs.len()).collect();
        let mut st = d.state.write();
        objs.iter()
            .zip(versions)
            .map(|(o, v)| {
                if o.len == 0 || st.used() + st.footprint(o.len) > d.high {
                    return None;
                }
                let generation = st.reserve(o.key, o.len, o.depth, v).ok()?;
                let extents = st.pending_extents(generation).unwrap_or_default();
                Some(Reserved {
                    generation,
                    extents: extents.iter().map(|x| (x.addr, x.len)).collect(),
                })
            })
            .collect()
    }

    /// Commits (`publish`) or frees the reservations `generations`; per generation, whether it
    /// is now committed.
    pub(crate) fn finish_reservations(&self, generations: &[u64], publish: bool) -> Vec<bool> {
        let Some(d) = &self.dram else {
            return vec![false; generations.len()];
        };
        let now = self.now();
        let mut st = d.state.write();
        generations
            .iter()
            .map(|&g| st.commit(g, publish, now, false, |_, _| publish))
            .collect()
    }
}
