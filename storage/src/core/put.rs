//! The write path: ranged puts into DRAM (falling back to SSD when DRAM cannot hold an object),
//! write-through to SSD, watermark-driven eviction with demotion to SSD, and promotion of objects
//! read from SSD.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use te_base::Phase;
use te_core::TransferRequest;

use super::hooks::Overflow;
use super::{check_keys, Core, Dram, RangedPut, Ssd};
use crate::dram::tier::{DramState, ReserveError};
use crate::error::{Result, StoreError};
use crate::range_map::{check_put_ranges, map_range, Extent};
use crate::ssd::log::{AppendItem, SsdEntry};
use crate::ssd::record::align_up;

/// Where a put's bytes come from.
#[derive(Clone, Copy)]
enum Source {
    /// Registered caller buffers (the ranges' addresses).
    Caller,
    /// Store staging memory (promotion): no eviction is done for it.
    Staging,
}

impl Core {
    /// Writes objects given as ranges of registered caller memory that tile each object exactly
    /// (`Store::batch_put_ranges` documents the contract). What DRAM cannot hold is offered to
    /// `overflow` before it goes to the SSD tier.
    pub(crate) fn batch_put_ranges(
        &self,
        items: &[RangedPut<'_>],
        overflow_to: &mut dyn Overflow,
    ) -> Result<Vec<Result<()>>> {
        self.check_open()?;
        check_keys(items.iter().map(|i| i.key))?;
        let timer = self.timer.clone();
        let t0 = timer.start();
        if items.len() > 1 {
            let mut seen: HashMap<&str, usize> = HashMap::with_capacity(items.len());
            for (k, it) in items.iter().enumerate() {
                if let Some(&first_index) = seen.get(it.key) {
                    return Err(StoreError::DuplicateKey {
                        key_index: k,
                        first_index,
                    });
                }
                seen.insert(it.key, k);
            }
        }
        let mut scratch = Vec::new();
        for (k, it) in items.iter().enumerate() {
            check_put_ranges(k, it.object_len, it.ranges, &mut scratch)?;
        }
        {
            let callers = self.callers.read();
            for (k, it) in items.iter().enumerate() {
                callers.check(k, it.ranges)?;
            }
        }
        timer.lap(Phase::Classify, t0);
        let versions: Vec<u64> = self.next_versions(items.len()).collect();
        let mut errors: Vec<Option<StoreError>> = (0..items.len()).map(|_| None).collect();
        let all: Vec<usize> = (0..items.len()).collect();
        let has_ssd = self.ssd.is_some();
        let write_through = self.cfg.write_through && has_ssd;
        match &self.dram {
            Some(d) if write_through => {
                // SSD first: DRAM never holds a version the SSD write then failed to store.
                self.put_ssd(items, &all, &versions, &mut errors)?;
                let stored: Vec<usize> = all.iter().copied().filter(|&k| errors[k].is_none()).collect();
                let mut overflow = Vec::new();
                let mut dram_errors: Vec<Option<StoreError>> = (0..items.len()).map(|_| None).collect();
                self.put_dram(
                    d,
                    items,
                    &stored,
                    &versions,
                    Source::Caller,
                    true,
                    &mut dram_errors,
                    &mut overflow,
                );
                // The SSD holds the new version either way: no older DRAM copy may stay.
                self.drop_older_dram(d, items, &stored, &versions);
            }
            Some(d) => {
                let mut overflow = Vec::new();
                self.put_dram(
                    d,
                    items,
                    &all,
                    &versions,
                    Source::Caller,
                    false,
                    &mut errors,
                    &mut overflow,
                );
                // What local DRAM cannot hold goes to the overflow hook first; the older local
                // copies of what it placed are dropped.
                if !overflow.is_empty() {
                    let mut placed = vec![false; items.len()];
                    for k in overflow_to.place(self, items, &overflow) {
                        placed[k] = true;
                        self.remove_unchecked(items[k].key)?;
                    }
                    overflow.retain(|&k| !placed[k]);
                }
                if !overflow.is_empty() {
                    if has_ssd {
                        self.put_ssd(items, &overflow, &versions, &mut errors)?;
                        let stored: Vec<usize> = overflow.iter().copied().filter(|&k| errors[k].is_none()).collect();
                        self.drop_older_dram(d, items, &stored, &versions);
                    } else {
                        for k in overflow {
                            errors[k].get_or_insert(StoreError::NoSpace {
                                key: items[k].key.to_owned(),
                                len: items[k].object_len,
                            });
                        }
                    }
                }
            }
            None => self.put_ssd(items, &all, &versions, &mut errors)?,
        }
        let failed = errors.iter().filter(|e| e.is_some()).count() as u64;
        let c = &self.counters;
        c.puts_ok.fetch_add(items.len() as u64 - failed, Ordering::Relaxed);
        c.puts_failed.fetch_add(failed, Ordering::Relaxed);
        // A put records classify and the submit/wait of its batches (and SSD appends as wait).
        timer.count_call(items.iter().map(|i| i.ranges.len()).sum());
        Ok(errors.into_iter().map(|e| e.map_or(Ok(()), Err)).collect())
    }

    /// Removes DRAM copies of `keys` older than the versions just stored on SSD.
    fn drop_older_dram(&self, d: &Dram, items: &[RangedPut<'_>], keys: &[usize], versions: &[u64]) {
        if keys.is_empty() {
            return;
        }
        let mut st = d.state.write();
        for &k in keys {
            st.remove_older(items[k].key, versions[k]);
        }
    }

    /// Puts `keys` of `items` into DRAM as versions `versions[k]`. Keys that DRAM cannot hold go
    /// to `overflow`. A version older than the committed one is dropped (a newer put won).
    /// Promotions (`Source::Staging`) never evict, and commit only while the SSD log still holds
    /// exactly the version they read.
    #[allow(clippy::too_many_arguments)]
    fn put_dram(
        &self,
        d: &Dram,
        items: &[RangedPut<'_>],
        keys: &[usize],
        versions: &[u64],
        source: Source,
        on_ssd: bool,
        errors: &mut [Option<StoreError>],
        overflow: &mut Vec<usize>,
    ) -> u64 {
        let now = self.now();
        let own = self.own;
        let mut st = d.state.write();
        let cap = st.capacity();
        let need: u64 = keys
            .iter()
            .map(|&k| st.footprint(items[k].object_len))
            .filter(|&f| f <= cap)
            .sum();
        if st.used() + need > d.high {
            if matches!(source, Source::Staging) {
                return 0; // promotion never evicts
            }
            let to_free = (st.used() + need).saturating_sub(d.low);
            self.demote(d, &mut st, to_free);
        }
        let mut reserved: Vec<(usize, u64)> = Vec::with_capacity(keys.len());
        for &k in keys {
            let it = &items[k];
            let mut attempt = st.reserve(it.key, it.object_len, it.depth, versions[k]);
            if attempt.is_err() && matches!(source, Source::Caller) && st.footprint(it.object_len) <= cap {
                // Fragmented or over the low watermark: evict for this object and retry once.
                let fp = st.footprint(it.object_len);
                self.demote(d, &mut st, fp);
                attempt = st.reserve(it.key, it.object_len, it.depth, versions[k]);
            }
            match attempt {
                Ok(g) => reserved.push((k, g)),
                Err(ReserveError::NoSpace) => overflow.push(k),
            }
        }
        let n: usize = reserved.iter().map(|&(k, _)| items[k].ranges.len()).sum();
        let mut requests: Vec<TransferRequest> = Vec::with_capacity(n);
        let mut owner: Vec<u32> = Vec::with_capacity(n);
        for &(k, g) in &reserved {
            let extents = st.pending_extents(g).expect("reserved under this lock");
            for r in items[k].ranges {
                map_range(extents, r, |arena, src, len| {
                    requests.push(TransferRequest::write(src, own, arena, len));
                    owner.push(k as u32);
                });
            }
        }
        // Reservations are invisible and never evicted, so their copies run without the lock.
        drop(st);
        if let Err(e) = self.run_batch(&requests, &owner, errors) {
            for &(k, _) in &reserved {
                errors[k].get_or_insert(e.clone());
            }
        }
        let mut st = d.state.write();
        // A promotion commits only if the SSD log still holds the version it read (no remove or
        // newer put happened since): checked under the DRAM lock, which removes also hold.
        let ssd_index = match source {
            Source::Staging => self.ssd.as_ref().map(|s| s.log.index()),
            Source::Caller => None,
        };
        let mut stored = 0;
        for &(k, g) in &reserved {
            let ok = errors[k].is_none();
            let published = st.commit(g, ok, now, on_ssd, |key, version| match &ssd_index {
                None => true,
                Some(index) => index.get(key).is_some_and(|e| e.seq() == version && !e.is_damaged()),
            });
            stored += published as u64;
        }
        stored
    }

    /// Evicts at least `bytes` from DRAM by the tier's policy, writing objects the SSD tier does
    /// not hold yet straight from the arena to the SSD log (the arena is 4 KiB-aligned). An
    /// object whose demotion fails stays in DRAM (counted in `demotion_failed`).
    fn demote(&self, d: &Dram, st: &mut DramState, bytes: u64) {
        let mut victims = Vec::new();
        st.victims(d.policy, bytes, &mut victims);
        if victims.is_empty() {
            return;
        }
        let c = &self.counters;
        let Some(ssd) = &self.ssd else {
            for v in &victims {
                st.evict(v);
            }
            c.dropped.fetch_add(victims.len() as u64, Ordering::Relaxed);
            return;
        };
        // Objects whose version (or a newer one) the SSD log already holds need no write.
        let need_write: Vec<usize> = {
            let index = ssd.log.index();
            (0..victims.len())
                .filter(|&i| !ssd_holds(&index, &victims[i], st.entry(&victims[i]).expect("victim").version))
                .collect()
        };
        let results = append_from_arena(ssd, st, need_write.iter().map(|&i| &victims[i]));
        let mut keep = vec![false; victims.len()];
        let mut failed = 0u64;
        for (&i, r) in need_write.iter().zip(&results) {
            if let Err(e) = r {
                if failed == 0 {
                    tracing::warn!("demotion to SSD failed; keeping the object in DRAM: {e}");
                }
                keep[i] = true;
                failed += 1;
            }
        }
        for (v, keep) in victims.iter().zip(keep) {
            if !keep {
                st.evict(v);
            }
        }
        c.demoted.fetch_add(victims.len() as u64 - failed, Ordering::Relaxed);
        c.demotion_failed.fetch_add(failed, Ordering::Relaxed);
    }

    /// Writes every committed DRAM object the SSD log does not hold (in this version or a newer
    /// one) to the log, straight from the arena, keeping it in DRAM. Used by `flush`.
    pub(crate) fn write_back(&self, d: &Dram) -> Result<()> {
        let Some(ssd) = &self.ssd else { return Ok(()) };
        let mut st = d.state.write();
        let keys: Vec<Arc<str>> = {
            let index = ssd.log.index();
            st.keys()
                .filter(|k| {
                    let e = st.entry(k).expect("listed");
                    !e.on_ssd.load(Ordering::Relaxed) && !ssd_holds(&index, k, e.version)
                })
                .cloned()
                .collect()
        };
        if keys.is_empty() {
            return Ok(());
        }
        let results = append_from_arena(ssd, &mut st, keys.iter());
        let mut first_error = None;
        for (k, r) in keys.iter().zip(results) {
            match r {
                Ok(()) => st.mark_on_ssd(k),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Writes `keys` of `items` to the SSD log through staging: caller bytes are copied into a
    /// staging slot by the engine, then appended from there.
    fn put_ssd(
        &self,
        items: &[RangedPut<'_>],
        keys: &[usize],
        versions: &[u64],
        errors: &mut [Option<StoreError>],
    ) -> Result<()> {
        let ssd = self.ssd.as_ref().expect("caller checked");
        let own = self.own;
        let slot = ssd.staging.acquire();
        let mut next = 0usize;
        while next < keys.len() {
            let mut chunk: Vec<(usize, u64)> = Vec::new();
            let mut cursor = 0u64;
            while next < keys.len() {
                let k = keys[next];
                let padded = align_up(items[k].object_len);
                if padded > slot.len() {
                    errors[k].get_or_insert(StoreError::TooLarge {
                        key: items[k].key.to_owned(),
                        need: padded,
                        limit: slot.len(),
                    });
                    next += 1;
                    continue;
                }
                if cursor + padded > slot.len() {
                    break;
                }
                chunk.push((k, cursor));
                cursor += padded;
                next += 1;
            }
            if chunk.is_empty() {
                continue;
            }
            let n: usize = chunk.iter().map(|&(k, _)| items[k].ranges.len()).sum();
            let mut requests: Vec<TransferRequest> = Vec::with_capacity(n);
            let mut owner: Vec<u32> = Vec::with_capacity(n);
            for &(k, at) in &chunk {
                for r in items[k].ranges {
                    requests.push(TransferRequest::write(r.addr, own, slot.addr() + at + r.offset, r.len));
                    owner.push(k as u32);
                }
                // Zero the padding so the record's last block is deterministic.
                let len = items[k].object_len;
                let pad = (align_up(len) - len) as usize;
                // SAFETY: [at + len, at + padded) lies inside the slot, which we hold.
                unsafe { std::ptr::write_bytes(slot.ptr().add((at + len) as usize), 0, pad) };
            }
            self.run_batch(&requests, &owner, errors)?;
            let ok: Vec<(usize, u64)> = chunk.into_iter().filter(|&(k, _)| errors[k].is_none()).collect();
            let append: Vec<AppendItem<'_>> = ok
                .iter()
                .map(|&(k, _)| AppendItem {
                    key: items[k].key,
                    len: items[k].object_len,
                    depth: items[k].depth,
                    seq: versions[k],
                })
                .collect();
            let extents: Vec<[Extent; 1]> = ok
                .iter()
                .map(|&(k, at)| {
                    [Extent {
                        addr: slot.addr() + at,
                        len: items[k].object_len,
                    }]
                })
                .collect();
            let payloads: Vec<&[Extent]> = extents.iter().map(|e| e.as_slice()).collect();
            let t = self.timer.start();
            // SAFETY: every payload is at a 4 KiB-aligned offset of the slot we hold, padded with
            // zeros to whole blocks inside the slot.
            let results = unsafe { ssd.log.append(&append, &payloads) };
            self.timer.lap(Phase::Wait, t);
            for (&(k, _), r) in ok.iter().zip(results) {
                if let Err(e) = r {
                    errors[k].get_or_insert(e);
                }
            }
        }
        Ok(())
    }

    /// Copies whole objects just read from SSD (in staging) into DRAM, if they fit under the high
    /// watermark without evicting anything: `(key, staging addr, len, depth, version)` each.
    /// Returns how many were promoted (a key put or removed meanwhile is not).
    pub(crate) fn promote(&self, objs: &[(&str, u64, u64, u32, u64)]) -> u64 {
        let Some(d) = &self.dram else { return 0 };
        let plain: Vec<(&str, u64, u64, u32)> = objs.iter().map(|&(k, a, l, dp, _)| (k, a, l, dp)).collect();
        let versions: Vec<u64> = objs.iter().map(|o| o.4).collect();
        let ranges = super::whole_object_ranges(&plain);
        let items = super::whole_object_puts(&plain, &ranges);
        let keys: Vec<usize> = (0..items.len()).collect();
        let mut errors: Vec<Option<StoreError>> = (0..items.len()).map(|_| None).collect();
        let mut overflow = Vec::new();
        self.put_dram(
            d,
            &items,
            &keys,
            &versions,
            Source::Staging,
            true,
            &mut errors,
            &mut overflow,
        )
    }
}

/// True when the SSD log holds `key` in version `version` or a newer one (a damaged record holds
/// nothing).
fn ssd_holds(index: &HashMap<Arc<str>, SsdEntry>, key: &str, version: u64) -> bool {
    index.get(key).is_some_and(|x| !x.is_damaged() && x.seq() >= version)
}

/// Appends the committed DRAM objects `keys` to the SSD log in their versions, straight from the
/// arena. Per-key results.
fn append_from_arena<'k>(ssd: &Ssd, st: &mut DramState, keys: impl Iterator<Item = &'k Arc<str>>) -> Vec<Result<()>> {
    let st: &DramState = st;
    let mut items: Vec<AppendItem<'_>> = Vec::new();
    let mut payloads: Vec<&[Extent]> = Vec::new();
    for k in keys {
        let e = st.entry(k).expect("committed");
        items.push(AppendItem {
            key: k,
            len: e.len,
            depth: e.depth,
            seq: e.version,
        });
        payloads.push(&e.extents);
    }
    // SAFETY: arena extents start on page boundaries (pages are multiples of 4 KiB), every page is
    // readable to its end, and `st` is borrowed exclusively (the caller holds the arena's write
    // lock), which keeps them unchanged until the append returns.
    unsafe { ssd.log.append(&items, &payloads) }
}
