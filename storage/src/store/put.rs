//! The write path: ranged puts into DRAM (falling back to SSD when DRAM cannot hold an object),
//! write-through to SSD, watermark-driven eviction with demotion to SSD, and promotion of objects
//! read from SSD.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use te_base::Phase;
use te_core::TransferRequest;

use super::{Dram, RangedPut, Store};
use crate::dram::tier::{DramState, ReserveError};
use crate::error::{Result, StoreError};
use crate::range_map::{check_put_ranges, map_range, Extent};
use crate::ssd::log::AppendItem;
use crate::ssd::record::align_up;

/// Where a put's bytes come from.
#[derive(Clone, Copy)]
enum Source {
    /// Registered caller buffers (the ranges' addresses).
    Caller,
    /// Store staging memory (promotion): no eviction is done for it.
    Staging,
}

impl Store {
    /// Writes objects given as ranges of registered caller memory that tile each object exactly.
    /// Shape errors (bad or repeated key, zero length, ranges that overlap, fall outside the
    /// object or leave a gap, unregistered memory) fail the whole call before anything is
    /// written. Per key: `Ok` once the object is stored, or its data error (no space, a
    /// concurrent put of the same key, I/O).
    pub fn batch_put_ranges(&self, items: &[RangedPut<'_>]) -> Result<Vec<Result<()>>> {
        self.check_open()?;
        let timer = self.inner.timer.clone();
        let t0 = timer.start();
        Self::check_keys(items.iter().map(|i| i.key))?;
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
            let callers = self.inner.callers.read();
            for (k, it) in items.iter().enumerate() {
                callers.check(k, it.ranges)?;
            }
        }
        timer.lap(Phase::Classify, t0);
        let mut errors: Vec<Option<StoreError>> = (0..items.len()).map(|_| None).collect();
        let all: Vec<usize> = (0..items.len()).collect();
        let mut to_ssd: Vec<usize> = Vec::new();
        let write_through = self.inner.cfg.write_through && self.inner.ssd.is_some();
        match &self.inner.dram {
            Some(d) => {
                self.put_dram(d, items, &all, Source::Caller, write_through, &mut errors, &mut to_ssd);
                if write_through {
                    to_ssd = (0..items.len()).filter(|&k| errors[k].is_none()).collect();
                }
            }
            None => to_ssd = all,
        }
        if !to_ssd.is_empty() {
            if self.inner.ssd.is_some() {
                self.put_ssd(items, &to_ssd, &mut errors)?;
            } else {
                for k in to_ssd {
                    errors[k].get_or_insert(StoreError::NoSpace {
                        key: items[k].key.to_owned(),
                        len: items[k].object_len,
                    });
                }
            }
        }
        if write_through {
            // A key whose SSD write failed is not durable: take its DRAM copy back out so the
            // call's result and the store agree.
            if let Some(d) = &self.inner.dram {
                let mut st = d.state.write();
                for (k, it) in items.iter().enumerate() {
                    if errors[k].is_some() {
                        let _ = st.remove(it.key);
                    }
                }
            }
        }
        let failed = errors.iter().filter(|e| e.is_some()).count() as u64;
        let c = &self.inner.counters;
        c.puts_ok.fetch_add(items.len() as u64 - failed, Ordering::Relaxed);
        c.puts_failed.fetch_add(failed, Ordering::Relaxed);
        // A put records classify and the submit/wait of its batches (and SSD appends as wait).
        timer.count_call(items.iter().map(|i| i.ranges.len()).sum());
        Ok(errors.into_iter().map(|e| e.map_or(Ok(()), Err)).collect())
    }

    /// Puts `keys` of `items` into DRAM. Keys that DRAM cannot hold go to `overflow`.
    #[allow(clippy::too_many_arguments)]
    fn put_dram(
        &self,
        d: &Dram,
        items: &[RangedPut<'_>],
        keys: &[usize],
        source: Source,
        on_ssd: bool,
        errors: &mut [Option<StoreError>],
        overflow: &mut Vec<usize>,
    ) -> u64 {
        let now = self.now();
        let own = self.inner.own;
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
            let mut attempt = match source {
                Source::Caller => st.reserve(it.key, it.object_len, it.depth),
                Source::Staging => st.reserve_absent(it.key, it.object_len, it.depth),
            };
            if attempt == Err(ReserveError::NoSpace)
                && matches!(source, Source::Caller)
                && st.footprint(it.object_len) <= cap
            {
                // Fragmented or over the low watermark: evict for this object and retry once.
                let fp = st.footprint(it.object_len);
                self.demote(d, &mut st, fp);
                attempt = st.reserve(it.key, it.object_len, it.depth);
            }
            match attempt {
                Ok(g) => reserved.push((k, g)),
                Err(ReserveError::Conflict) => {
                    errors[k] = Some(StoreError::WriteConflict { key: it.key.to_owned() });
                }
                Err(ReserveError::NoSpace) => overflow.push(k),
            }
        }
        let n: usize = reserved.iter().map(|&(k, _)| items[k].ranges.len()).sum();
        let mut requests: Vec<TransferRequest> = Vec::with_capacity(n);
        let mut owner: Vec<u32> = Vec::with_capacity(n);
        for &(k, _) in &reserved {
            let e = st.entry(items[k].key).expect("reserved under this lock");
            for r in items[k].ranges {
                map_range(&e.extents, r, |arena, src, len| {
                    requests.push(TransferRequest::write(src, own, arena, len));
                    owner.push(k as u32);
                });
            }
        }
        // Reserved entries are invisible and never evicted, so their copies run without the lock.
        drop(st);
        if let Err(e) = self.run_batch(&requests, &owner, errors) {
            for &(k, _) in &reserved {
                errors[k].get_or_insert(e.clone());
            }
        }
        let mut st = d.state.write();
        let mut stored = 0;
        for &(k, g) in &reserved {
            let ok = errors[k].is_none();
            stored += ok as u64;
            st.commit(items[k].key, g, ok, now, on_ssd);
        }
        stored
    }

    /// Evicts at least `bytes` from DRAM by the tier's policy, writing objects the SSD tier does
    /// not hold yet straight from the arena to the SSD log (the arena is 4 KiB-aligned).
    fn demote(&self, d: &Dram, st: &mut DramState, bytes: u64) {
        let mut victims = Vec::new();
        st.victims(d.policy, bytes, &mut victims);
        if victims.is_empty() {
            return;
        }
        let mut demoted = 0u64;
        let mut dropped = 0u64;
        match &self.inner.ssd {
            Some(ssd) => {
                let need_write: Vec<usize> = (0..victims.len())
                    .filter(|&i| st.entry(&victims[i]).is_some_and(|e| !e.on_ssd))
                    .collect();
                let items: Vec<AppendItem<'_>> = need_write
                    .iter()
                    .map(|&i| {
                        let e = st.entry(&victims[i]).expect("victim");
                        AppendItem {
                            key: &victims[i],
                            len: e.len,
                            depth: e.depth,
                        }
                    })
                    .collect();
                let payloads: Vec<&[Extent]> = need_write
                    .iter()
                    .map(|&i| &*st.entry(&victims[i]).expect("victim").extents)
                    .collect();
                // SAFETY: arena extents start on page boundaries (pages are multiples of 4 KiB),
                // every page is readable to its end, and the write lock we hold keeps them
                // unchanged until the append returns.
                let results = unsafe { ssd.log.append(&items, &payloads) };
                let failed = results.iter().filter(|r| r.is_err()).count() as u64;
                if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                    tracing::warn!("demotion of {failed} object(s) to SSD failed; dropping them: {e}");
                }
                dropped += failed;
                demoted += victims.len() as u64 - failed;
            }
            None => dropped += victims.len() as u64,
        }
        for v in &victims {
            st.evict(v);
        }
        let c = &self.inner.counters;
        c.demoted.fetch_add(demoted, Ordering::Relaxed);
        c.dropped.fetch_add(dropped, Ordering::Relaxed);
    }

    /// Writes `keys` of `items` to the SSD log through staging: caller bytes are copied into a
    /// staging slot by the engine, then appended from there.
    fn put_ssd(&self, items: &[RangedPut<'_>], keys: &[usize], errors: &mut [Option<StoreError>]) -> Result<()> {
        let ssd = self.inner.ssd.as_ref().expect("caller checked");
        let own = self.inner.own;
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
            let t = self.inner.timer.start();
            // SAFETY: every payload is at a 4 KiB-aligned offset of the slot we hold, padded with
            // zeros to whole blocks inside the slot.
            let results = unsafe { ssd.log.append(&append, &payloads) };
            self.inner.timer.lap(Phase::Wait, t);
            for (&(k, _), r) in ok.iter().zip(results) {
                if let Err(e) = r {
                    errors[k].get_or_insert(e);
                }
            }
        }
        Ok(())
    }

    /// Copies whole objects just read from SSD (in staging) into DRAM, if they fit under the high
    /// watermark without evicting anything. Returns how many were promoted.
    pub(crate) fn promote(&self, objs: &[(&str, u64, u64, u32)]) -> u64 {
        let Some(d) = &self.inner.dram else { return 0 };
        let ranges = super::whole_object_ranges(objs);
        let items = super::whole_object_puts(objs, &ranges);
        let keys: Vec<usize> = (0..items.len()).collect();
        let mut errors: Vec<Option<StoreError>> = (0..items.len()).map(|_| None).collect();
        let mut overflow = Vec::new();
        self.put_dram(d, &items, &keys, Source::Staging, true, &mut errors, &mut overflow)
    }
}
