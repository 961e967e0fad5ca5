//! The ranged read path.
//!
//! One call: describe every range's caller memory by its registration (one shared lock), resolve
//! every key per tier (one shared lock per tier) and check its ranges against the object, then
//! build one engine batch for the DRAM-resident keys (remote side: the store's arena) and submit
//! it while the arena's shared lock keeps the objects in place. Keys only on SSD are read block
//! span by block span into staging, verified, and copied out with a second batch. Bytes are
//! counted once per call.
//!
//! A caller that asks for the same key set again (the standalone server's key handles) may pass
//! a [`Resolved`]: the keys' committed DRAM entries from last time and the DRAM index epoch they
//! were read at. While the epoch is unchanged the call skips every key's hash and lookup. The
//! epoch is compared under the same shared lock the copy then runs under, and every publish,
//! remove and eviction changes it under the exclusive lock, so a reused entry is never stale and
//! its arena pages are never reused during the copy.
//!
//! Requests are built one per contiguous run: a range that continues the previous one of its key
//! both in the arena and in the same caller buffer extends that request instead of adding one.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use te_base::Phase;
use te_core::{SegmentId, TransferRequest};

use super::callers::CallerTable;
use super::hooks::{MissResolver, NoMisses};
use super::{check_keys, Core, RangedGet};
use crate::dram::tier::DramEntry;
use crate::error::{Result, StoreError, Tier};
use crate::range_map::{check_get_ranges, map_range, Range};
use crate::ssd::log::{LogCore, ReadSpan, SsdEntry};

/// Where a key of a read was found.
enum Found {
    Missing,
    Dram,
    Ssd(SsdEntry),
    /// A data error decided at resolve time (buffer too small, damaged record).
    Failed,
    /// Delivered by the call's miss resolver (distributed mode: the peer that owns it).
    Elsewhere,
}

/// What a ranged call resolved for its key set last time: each key's committed DRAM entry, in
/// order, and the DRAM index epoch they were read at (0: nothing reusable). Belongs to one key
/// set: pass it only with the same keys in the same order.
#[derive(Debug, Default)]
pub(crate) struct Resolved {
    epoch: u64,
    entries: Vec<Arc<DramEntry>>,
    /// Each entry's [`Spot`], in the same order: a reusing call reads this dense array instead
    /// of every entry (the entries are scattered over the heap; reading them was a cache miss per
    /// key, the largest cost of a 512-key hit call: `perf`, docs/PERFORMANCE.md).
    spots: Vec<Spot>,
}

/// What the request build needs of a committed DRAM entry: its length and, for an object in one
/// extent (the usual case), that extent's arena address.
#[derive(Debug, Clone, Copy)]
struct Spot {
    len: u64,
    single: Option<u64>,
}

impl Spot {
    fn of(e: &DramEntry) -> Spot {
        let single = match &*e.extents {
            [only] => Some(only.addr),
            _ => None,
        };
        Spot { len: e.len, single }
    }
}

/// The engine requests of a call being built: one per contiguous run (see the module doc).
struct Build<'c> {
    requests: Vec<TransferRequest>,
    /// The key of each request.
    owner: Vec<u32>,
    callers: &'c CallerTable,
    own: SegmentId,
    /// The end of the caller buffer of the last request: a merge stays inside it.
    caller_end: u64,
}

impl Build<'_> {
    /// Adds `len` bytes of key `k` from arena address `arena` to caller address `caller`,
    /// extending the last request when this continues it.
    #[inline(always)]
    fn piece(&mut self, k: u32, arena: u64, caller: u64, len: u64) {
        if let (Some(last), Some(&o)) = (self.requests.last_mut(), self.owner.last()) {
            let continues = o == k
                && last.local_addr + last.len == caller
                && last.remote_addr + last.len == arena
                && caller + len <= self.caller_end;
            if continues {
                last.len += len;
                return;
            }
        }
        self.caller_end = self.callers.region_end(caller).unwrap_or(0);
        self.requests.push(TransferRequest::read(caller, self.own, arena, len));
        self.owner.push(k);
    }
}

impl Resolved {
    /// Empty, with room for `n` keys (so its memory is known when the key set is remembered).
    pub(crate) fn with_capacity(n: usize) -> Resolved {
        Resolved {
            epoch: 0,
            entries: Vec::with_capacity(n),
            spots: Vec::with_capacity(n),
        }
    }

    /// Heap bytes held (the entry pointers and spots; the entries themselves are the store's).
    pub(crate) fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Arc<DramEntry>>()
            + self.spots.capacity() * std::mem::size_of::<Spot>()
    }
}

/// A resolution being refilled by a call: the cache, and the entries and spots collected so far.
type Refill<'c> = (&'c mut Resolved, Vec<Arc<DramEntry>>, Vec<Spot>);

/// A resolution being reused by a call: its entries and their spots.
type Reuse<'c> = (&'c [Arc<DramEntry>], &'c [Spot]);

/// What a read call asks for.
pub(crate) enum Wants<'a, 'b> {
    /// Ranges of each object.
    Ranges(&'b [RangedGet<'a>]),
    /// Whole objects: `(key, addr, capacity)`; the size is taken under the same lookup as the
    /// bytes.
    Whole(&'b [(&'a str, u64, u64)]),
}

impl<'a> Wants<'a, '_> {
    fn len(&self) -> usize {
        match self {
            Wants::Ranges(items) => items.len(),
            Wants::Whole(items) => items.len(),
        }
    }

    fn key(&self, k: usize) -> &'a str {
        match self {
            Wants::Ranges(items) => items[k].key,
            Wants::Whole(items) => items[k].0,
        }
    }
}

impl Core {
    /// Reads ranges of many objects into registered caller buffers (`Store::batch_get_ranges`
    /// documents the contract). Keys no tier holds go to `misses`.
    pub(crate) fn batch_get_ranges(
        &self,
        items: &[RangedGet<'_>],
        resolved: Option<&mut Resolved>,
        misses: &mut dyn MissResolver,
    ) -> Result<Vec<Result<u64>>> {
        self.get_objects(Wants::Ranges(items), resolved, misses)
    }

    /// Gets whole objects into registered caller buffers: `(key, addr, capacity)` each. Per key:
    /// the object's length, or its data error (`BufferTooSmall` when it does not fit). The size
    /// and the bytes come from one lookup, so a concurrent put never yields a truncated or mixed
    /// object. Only the local tiers are read.
    pub(crate) fn batch_get(&self, items: &[(&str, u64, u64)]) -> Result<Vec<Result<u64>>> {
        self.get_objects(Wants::Whole(items), None, &mut NoMisses)
    }

    fn get_objects(
        &self,
        wants: Wants<'_, '_>,
        cache: Option<&mut Resolved>,
        misses: &mut dyn MissResolver,
    ) -> Result<Vec<Result<u64>>> {
        self.check_open()?;
        let timer = self.timer.clone();
        let t0 = timer.start();
        let n = wants.len();
        check_keys((0..n).map(|k| wants.key(k)))?;
        if let Wants::Ranges(items) = &wants {
            let callers = self.callers.read();
            for (k, it) in items.iter().enumerate() {
                callers.check(k, it.ranges)?;
            }
        }
        let t1 = timer.lap(Phase::Classify, t0);

        let now = self.now();
        let mut found: Vec<Found> = Vec::with_capacity(n);
        let mut errors: Vec<Option<StoreError>> = (0..n).map(|_| None).collect();
        let mut whole: Vec<[Range; 1]> = Vec::new();
        let mut scratch = Vec::new();
        let dram_guard = self.dram.as_ref().map(|d| d.state.read());
        // Reuse the cache when the index has not changed since it was filled; else refill it.
        let epoch = dram_guard.as_ref().map_or(0, |d| d.epoch());
        let reuse = matches!(&cache, Some(c) if epoch != 0 && c.epoch == epoch && c.entries.len() == n);
        let (held, mut fill): (Option<Reuse<'_>>, Option<Refill<'_>>) = match cache {
            Some(c) if reuse => (Some((&c.entries, &c.spots)), None),
            Some(c) => {
                let (mut v, mut s) = (std::mem::take(&mut c.entries), std::mem::take(&mut c.spots));
                v.clear();
                s.clear();
                c.epoch = 0;
                (None, Some((c, v, s)))
            }
            None => (None, None),
        };
        // Each key's DRAM entry and spot, for the build below (no second lookup).
        let mut locs: Vec<Option<(&DramEntry, Spot)>> = Vec::with_capacity(n);
        let items: Cow<'_, [RangedGet<'_>]> = {
            // Both tiers are resolved under their shared locks held together: a put or remove
            // (which takes the DRAM lock exclusively) is either wholly before or after this.
            let ssd_index = self.ssd.as_ref().map(|s| s.log.index());
            if let Wants::Whole(_) = &wants {
                whole.reserve(n);
            }
            for k in 0..n {
                let key = wants.key(k);
                let dram_entry: Option<(&DramEntry, Spot)> = match held {
                    Some((entries, spots)) => Some((&entries[k], spots[k])),
                    None => dram_guard.as_ref().and_then(|d| d.get_shared(key)).map(|e| {
                        let spot = Spot::of(e);
                        if let Some((_, v, s)) = &mut fill {
                            v.push(e.clone());
                            s.push(spot);
                        }
                        (&**e, spot)
                    }),
                };
                locs.push(dram_entry);
                // The object's size; `None` when absent or damaged (a damaged record has no
                // trustworthy size: its key reads Corrupt below).
                let (mut f, size) = if let Some((_, spot)) = dram_entry {
                    (Found::Dram, Some(spot.len))
                } else if let Some(e) = ssd_index.as_ref().and_then(|s| s.get(key)) {
                    (Found::Ssd(e.clone()), (!e.is_damaged()).then_some(e.payload_len))
                } else {
                    (Found::Missing, None)
                };
                match &wants {
                    Wants::Ranges(items) => {
                        check_get_ranges(k, size.unwrap_or(u64::MAX), items[k].ranges, &mut scratch)?
                    }
                    Wants::Whole(items) => {
                        let (_, addr, cap) = items[k];
                        let len = size.unwrap_or(0);
                        if len > cap {
                            errors[k] = Some(StoreError::BufferTooSmall {
                                key: key.to_owned(),
                                need: len,
                                have: cap,
                            });
                            f = Found::Failed;
                        }
                        whole.push([Range::new(0, len, addr)]);
                    }
                }
                if let Some((e, _)) = dram_entry {
                    e.last_access.store(now, Ordering::Relaxed);
                }
                found.push(f);
            }
            let items = match &wants {
                Wants::Ranges(items) => Cow::Borrowed(*items),
                Wants::Whole(items) => Cow::Owned(
                    items
                        .iter()
                        .zip(&whole)
                        .map(|(i, r)| RangedGet { key: i.0, ranges: r })
                        .collect(),
                ),
            };
            if let Wants::Whole(_) = &wants {
                // Ranged calls checked their caller memory before the lookup; whole gets know
                // their ranges only now.
                let callers = self.callers.read();
                for (k, it) in items.iter().enumerate() {
                    if matches!(found[k], Found::Dram | Found::Ssd(_)) {
                        callers.check(k, it.ranges)?;
                    }
                }
            }
            for (k, f) in found.iter_mut().enumerate() {
                if let Found::Ssd(e) = f {
                    if e.is_damaged() {
                        errors[k] = Some(StoreError::Corrupt {
                            key: items[k].key.to_owned(),
                            tier: Tier::Ssd,
                            detail: "the record's header failed its CRC32C".into(),
                        });
                        *f = Found::Failed;
                    }
                }
            }
            items
        };
        let t2 = timer.lap(Phase::Resolve, t1);

        let mut dram_bytes = 0u64;
        if dram_guard.is_some() {
            let n: usize = items
                .iter()
                .zip(&found)
                .filter(|(_, f)| matches!(f, Found::Dram))
                .map(|(it, _)| it.ranges.len())
                .sum();
            let callers = self.callers.read();
            let mut b = Build {
                requests: Vec::with_capacity(n),
                owner: Vec::with_capacity(n),
                callers: &callers,
                own: self.own,
                caller_end: 0,
            };
            for (k, (it, f)) in items.iter().zip(&found).enumerate() {
                if !matches!(f, Found::Dram) {
                    continue;
                }
                let (e, spot) = locs[k].expect("resolved under this guard");
                let k = k as u32;
                for r in it.ranges {
                    // One extent (the usual case): the spot alone places the range.
                    match spot.single {
                        Some(base) => b.piece(k, base + r.offset, r.addr, r.len),
                        None => map_range(&e.extents, r, |arena, caller, len| b.piece(k, arena, caller, len)),
                    }
                    dram_bytes += r.len;
                }
            }
            let Build { requests, owner, .. } = b;
            drop(callers);
            drop(locs);
            timer.lap(Phase::Build, t2);
            // The shared lock stays held until the copies are done: nothing is evicted under them.
            self.run_batch(&requests, &owner, &mut errors)?;
        } else {
            drop(locs);
        }
        drop(dram_guard);
        if let Some((c, v, s)) = fill {
            // Reusable only when every key was in DRAM: a key on SSD or missing is resolved again.
            if v.len() == n && found.iter().all(|f| matches!(f, Found::Dram)) {
                c.epoch = epoch;
            }
            c.entries = v;
            c.spots = s;
        }

        let ssd_bytes = self.read_from_ssd(&items, &found, &mut errors)?;
        // Ranged reads of keys no local tier holds go to the call's resolver (distributed mode:
        // their owners). Whole gets need the size first and stay local.
        if let (Wants::Ranges(_), true) = (&wants, misses.resolves()) {
            let missed: Vec<usize> = (0..n).filter(|&k| matches!(found[k], Found::Missing)).collect();
            if !missed.is_empty() {
                for k in misses.resolve(self, &items, &missed, &mut errors) {
                    found[k] = Found::Elsewhere;
                }
            }
        }
        let t3 = timer.start();
        let mut results = Vec::with_capacity(items.len());
        let (mut local_hits, mut misses) = (0u64, 0u64);
        for (k, (it, f)) in items.iter().zip(found).enumerate() {
            let local = matches!(f, Found::Dram | Found::Ssd(_));
            results.push(match (errors[k].take(), f) {
                (Some(e), _) => Err(e),
                (None, Found::Missing | Found::Failed) => Err(StoreError::NotFound { key: it.key.to_owned() }),
                (None, _) => Ok(it.ranges.iter().map(|r| r.len).sum()),
            });
            match &results[k] {
                Ok(_) if local => local_hits += 1,
                Err(StoreError::NotFound { .. }) => misses += 1,
                _ => {}
            }
        }
        let c = &self.counters;
        c.local_hits.fetch_add(local_hits, Ordering::Relaxed);
        c.misses.fetch_add(misses, Ordering::Relaxed);
        c.dram_read_bytes.fetch_add(dram_bytes, Ordering::Relaxed);
        c.ssd_delivered_bytes.fetch_add(ssd_bytes, Ordering::Relaxed);
        if reuse {
            c.resolve_reused.fetch_add(1, Ordering::Relaxed);
        }
        timer.lap(Phase::Other, t3);
        timer.count_call(items.iter().map(|i| i.ranges.len()).sum());
        Ok(results)
    }

    /// Reads the SSD-resident keys of a call, a staging slot at a time. Returns bytes delivered.
    fn read_from_ssd(
        &self,
        items: &[RangedGet<'_>],
        found: &[Found],
        errors: &mut [Option<StoreError>],
    ) -> Result<u64> {
        let Some(ssd) = &self.ssd else { return Ok(0) };
        let keys: Vec<usize> = (0..items.len())
            .filter(|&k| matches!(found[k], Found::Ssd(_)))
            .collect();
        if keys.is_empty() {
            return Ok(0);
        }
        let timer = &self.timer;
        let slot = ssd.staging.acquire();
        let own = self.own;
        let mut delivered = 0u64;
        let promote_enabled = self.cfg.promote_on_read && self.dram.is_some();
        let mut next = 0usize;
        while next < keys.len() {
            let t0 = timer.start();
            // Plan as many keys as fit in the slot.
            let mut spans: Vec<ReadSpan> = Vec::new();
            let mut range_at: Vec<u64> = Vec::new();
            let mut entries: Vec<&SsdEntry> = Vec::new();
            let mut names: Vec<&str> = Vec::new();
            let mut chunk_keys: Vec<usize> = Vec::new();
            let mut key_spans: Vec<(usize, usize)> = Vec::new();
            let mut cursor = 0u64;
            while next < keys.len() {
                let k = keys[next];
                let Found::Ssd(e) = &found[k] else { unreachable!() };
                let (s0, r0, c0) = (spans.len(), range_at.len(), cursor);
                LogCore::plan_ranges(
                    entries.len(),
                    items[k].ranges.iter().map(|r| (r.offset, r.len)),
                    &mut spans,
                    &mut cursor,
                    &mut range_at,
                );
                if cursor > slot.len() {
                    spans.truncate(s0);
                    range_at.truncate(r0);
                    let need = cursor - c0;
                    cursor = c0;
                    if need > slot.len() {
                        errors[k] = Some(StoreError::TooLarge {
                            key: items[k].key.to_owned(),
                            need,
                            limit: slot.len(),
                        });
                        next += 1;
                        continue;
                    }
                    break;
                }
                key_spans.push((s0, spans.len()));
                entries.push(e);
                names.push(items[k].key);
                chunk_keys.push(k);
                next += 1;
            }
            if chunk_keys.is_empty() {
                continue;
            }
            let t1 = timer.lap(Phase::Plan, t0);
            let mut span_results = Vec::with_capacity(spans.len());
            // SAFETY: the slot is ours until dropped, 4 KiB-aligned, and every span was planned
            // inside it (cursor <= slot length).
            unsafe {
                ssd.log
                    .read_spans(&names, &entries, &spans, slot.ptr(), &mut span_results)
            };
            let t2 = timer.lap(Phase::Wait, t1);
            for (s, r) in spans.iter().zip(span_results) {
                if let Err(e) = r {
                    let k = chunk_keys[s.entry];
                    if errors[k].is_none() {
                        errors[k] = Some(e);
                    }
                }
            }
            let n: usize = chunk_keys.iter().map(|&k| items[k].ranges.len()).sum();
            let mut requests: Vec<TransferRequest> = Vec::with_capacity(n);
            let mut owner: Vec<u32> = Vec::with_capacity(n);
            let mut at = range_at.iter();
            for &k in &chunk_keys {
                let ok = errors[k].is_none();
                for r in items[k].ranges {
                    let staging = slot.addr() + at.next().expect("one offset per range");
                    if ok {
                        requests.push(TransferRequest::read(r.addr, own, staging, r.len));
                        owner.push(k as u32);
                    }
                }
            }
            timer.lap(Phase::Build, t2);
            self.run_batch(&requests, &owner, errors)?;
            // Whole objects read as one span from block 0 are promoted from staging into DRAM.
            let mut promote: Vec<(&str, u64, u64, u32, u64)> = Vec::new();
            for (c, &k) in chunk_keys.iter().enumerate() {
                if errors[k].is_some() {
                    continue;
                }
                let Found::Ssd(e) = &found[k] else { unreachable!() };
                let bytes: u64 = items[k].ranges.iter().map(|r| r.len).sum();
                delivered += bytes;
                let (s0, s1) = key_spans[c];
                if bytes == e.payload_len && s1 - s0 == 1 && spans[s0].first_block == 0 && promote_enabled {
                    promote.push((
                        items[k].key,
                        slot.addr() + spans[s0].staging_offset,
                        e.payload_len,
                        e.depth,
                        e.seq(),
                    ));
                }
            }
            if !promote.is_empty() {
                let promoted = self.promote(&promote);
                self.counters.promoted.fetch_add(promoted, Ordering::Relaxed);
            }
        }
        Ok(delivered)
    }
}
