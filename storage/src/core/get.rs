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
use std::time::Instant;

use te_base::Phase;
use te_core::{SegmentId, TransferRequest};

use super::callers::CallerTable;
use super::hooks::{MissResolver, NoMisses};
use super::{check_keys, Core, RangedGet};
use crate::dram::tier::{DramEntry, DramState};
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

    /// One read call, phase by phase: check the request; resolve every key under the tiers'
    /// shared locks; copy the DRAM-resident keys while the DRAM lock is still held; read the
    /// SSD-resident ones through staging; hand the keys no tier holds to `misses`; count the call.
    fn get_objects(
        &self,
        wants: Wants<'_, '_>,
        cache: Option<&mut Resolved>,
        misses: &mut dyn MissResolver,
    ) -> Result<Vec<Result<u64>>> {
        self.check_open()?;
        let timer = self.timer.clone();
        let t0 = timer.start();
        self.check_request(&wants)?;
        let t1 = timer.lap(Phase::Classify, t0);

        let n = wants.len();
        let mut errors: Vec<Option<StoreError>> = (0..n).map(|_| None).collect();
        let mut whole: Vec<[Range; 1]> = Vec::new();
        let dram_guard = self.dram.as_ref().map(|d| d.state.read());
        let dram = dram_guard.as_deref();
        // Reuse the cache when the index has not changed since it was filled; else refill it.
        let epoch = dram.map_or(0, DramState::epoch);
        let (reuse, held, mut fill) = open_cache(cache, epoch, n);
        let Lookup { mut found, locs } = self.look_up_keys(&wants, dram, held, &mut fill, &mut whole, &mut errors)?;
        let items = items_of(&wants, &whole);
        if let Wants::Whole(_) = &wants {
            // Ranged calls checked their caller memory before the lookup; whole gets know their
            // ranges only now.
            self.check_found_callers(&items, &found)?;
        }
        fail_damaged(&items, &mut found, &mut errors);
        let t2 = timer.lap(Phase::Resolve, t1);

        let dram_bytes = match dram {
            Some(_) => self.copy_from_dram(&items, &found, locs, &mut errors, t2)?,
            None => {
                drop(locs);
                0
            }
        };
        drop(dram_guard);
        if let Some(fill) = fill {
            close_cache(fill, epoch, &found);
        }

        let ssd_bytes = self.read_from_ssd(&items, &found, &mut errors)?;
        if let Wants::Ranges(_) = &wants {
            self.resolve_misses(&items, &mut found, &mut errors, misses);
        }
        let t3 = timer.start();
        let (results, tally) = results_of(&items, found, &mut errors);
        self.count_get(Tally {
            dram_bytes,
            ssd_bytes,
            reused: reuse,
            ..tally
        });
        timer.lap(Phase::Other, t3);
        timer.count_call(items.iter().map(|i| i.ranges.len()).sum());
        Ok(results)
    }

    /// Checks what can be checked before any lookup: every key, and (ranged calls) that every
    /// range's caller memory lies inside one registered buffer.
    fn check_request(&self, wants: &Wants<'_, '_>) -> Result<()> {
        check_keys((0..wants.len()).map(|k| wants.key(k)))?;
        if let Wants::Ranges(items) = wants {
            let callers = self.callers.read();
            for (k, it) in items.iter().enumerate() {
                callers.check(k, it.ranges)?;
            }
        }
        Ok(())
    }

    /// Looks every key up in DRAM (or takes it from the reused resolution, refilling `fill` as
    /// it goes) and on SSD, under both tiers' shared locks held together: a put or remove (which
    /// takes the DRAM lock exclusively) is either wholly before or after this. Checks each key's
    /// ask against the object's size and marks its DRAM entry used. A whole get's one range goes
    /// to `whole`.
    fn look_up_keys<'g>(
        &self,
        wants: &Wants<'_, '_>,
        dram: Option<&'g DramState>,
        held: Option<Reuse<'g>>,
        fill: &mut Option<Refill<'_>>,
        whole: &mut Vec<[Range; 1]>,
        errors: &mut [Option<StoreError>],
    ) -> Result<Lookup<'g>> {
        let n = wants.len();
        let now = self.now();
        let mut found: Vec<Found> = Vec::with_capacity(n);
        // Each key's DRAM entry and spot, for the build below (no second lookup).
        let mut locs: Vec<Option<(&'g DramEntry, Spot)>> = Vec::with_capacity(n);
        let mut scratch = Vec::new();
        let ssd_index = self.ssd.as_ref().map(|s| s.log.index());
        if let Wants::Whole(_) = wants {
            whole.reserve(n);
        }
        for k in 0..n {
            let key = wants.key(k);
            let dram_entry = dram_entry_of(k, key, dram, held, fill);
            locs.push(dram_entry);
            // The object's size; `None` when absent or damaged (a damaged record has no
            // trustworthy size: its key reads Corrupt later).
            let (f, size) = if let Some((_, spot)) = dram_entry {
                (Found::Dram, Some(spot.len))
            } else if let Some(e) = ssd_index.as_ref().and_then(|s| s.get(key)) {
                (Found::Ssd(e.clone()), (!e.is_damaged()).then_some(e.payload_len))
            } else {
                (Found::Missing, None)
            };
            let fits = check_size(wants, k, size, &mut scratch, whole, errors)?;
            if let Some((e, _)) = dram_entry {
                e.last_access.store(now, Ordering::Relaxed);
            }
            found.push(if fits { f } else { Found::Failed });
        }
        Ok(Lookup { found, locs })
    }

    /// Whole gets: checks the caller memory of every key a tier holds (ranged calls did this in
    /// [`Core::check_request`]).
    fn check_found_callers(&self, items: &[RangedGet<'_>], found: &[Found]) -> Result<()> {
        let callers = self.callers.read();
        for (k, it) in items.iter().enumerate() {
            if matches!(found[k], Found::Dram | Found::Ssd(_)) {
                callers.check(k, it.ranges)?;
            }
        }
        Ok(())
    }

    /// Copies the DRAM-resident keys: one engine request per contiguous run (remote side: the
    /// arena), run as one batch. The caller holds the DRAM shared lock until this returns, so
    /// nothing is evicted under the copies. Returns the bytes asked of DRAM.
    fn copy_from_dram(
        &self,
        items: &[RangedGet<'_>],
        found: &[Found],
        locs: Vec<Option<(&DramEntry, Spot)>>,
        errors: &mut [Option<StoreError>],
        since: Option<Instant>,
    ) -> Result<u64> {
        let (requests, owner, bytes) = self.dram_requests(items, found, &locs);
        drop(locs);
        self.timer.lap(Phase::Build, since);
        self.run_batch(&requests, &owner, errors)?;
        Ok(bytes)
    }

    /// The requests of the DRAM-resident keys, their keys, and the bytes they ask for. One
    /// extent (the usual case): the spot alone places a range.
    fn dram_requests(
        &self,
        items: &[RangedGet<'_>],
        found: &[Found],
        locs: &[Option<(&DramEntry, Spot)>],
    ) -> (Vec<TransferRequest>, Vec<u32>, u64) {
        let n: usize = items
            .iter()
            .zip(found)
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
        let mut bytes = 0u64;
        for (k, (it, f)) in items.iter().zip(found).enumerate() {
            if !matches!(f, Found::Dram) {
                continue;
            }
            let (e, spot) = locs[k].expect("resolved under this guard");
            let k = k as u32;
            for r in it.ranges {
                match spot.single {
                    Some(base) => b.piece(k, base + r.offset, r.addr, r.len),
                    None => map_range(&e.extents, r, |arena, caller, len| b.piece(k, arena, caller, len)),
                }
                bytes += r.len;
            }
        }
        let Build { requests, owner, .. } = b;
        (requests, owner, bytes)
    }

    /// Ranged reads of keys no local tier holds go to the call's resolver (distributed mode:
    /// their owners); the keys it delivered are marked so. Whole gets need the size first and
    /// stay local.
    fn resolve_misses(
        &self,
        items: &[RangedGet<'_>],
        found: &mut [Found],
        errors: &mut [Option<StoreError>],
        misses: &mut dyn MissResolver,
    ) {
        if !misses.resolves() {
            return;
        }
        let missed: Vec<usize> = (0..found.len())
            .filter(|&k| matches!(found[k], Found::Missing))
            .collect();
        if !missed.is_empty() {
            for k in misses.resolve(self, items, &missed, errors) {
                found[k] = Found::Elsewhere;
            }
        }
    }

    /// Adds a call's tally to the store's counters: one atomic add per counter per call.
    fn count_get(&self, t: Tally) {
        let c = &self.counters;
        c.local_hits.fetch_add(t.local_hits, Ordering::Relaxed);
        c.misses.fetch_add(t.misses, Ordering::Relaxed);
        c.dram_read_bytes.fetch_add(t.dram_bytes, Ordering::Relaxed);
        c.ssd_delivered_bytes.fetch_add(t.ssd_bytes, Ordering::Relaxed);
        if t.reused {
            c.resolve_reused.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Reads the SSD-resident keys of a call, a staging slot at a time: plan the keys that fit,
    /// read and verify their blocks, copy their ranges out of staging, then count and promote.
    /// Returns bytes delivered.
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
        let mut delivered = 0u64;
        let promote_enabled = self.cfg.promote_on_read && self.dram.is_some();
        let mut next = 0usize;
        while next < keys.len() {
            let t0 = timer.start();
            let chunk = plan_chunk(items, found, &keys, &mut next, slot.len(), errors);
            if chunk.keys.is_empty() {
                continue;
            }
            let t1 = timer.lap(Phase::Plan, t0);
            let mut span_results = Vec::with_capacity(chunk.spans.len());
            // SAFETY: the slot is ours until dropped, 4 KiB-aligned, and every span was planned
            // inside it (cursor <= slot length).
            unsafe {
                ssd.log.read_spans(
                    &chunk.names,
                    &chunk.entries,
                    &chunk.spans,
                    slot.ptr(),
                    &mut span_results,
                )
            };
            let t2 = timer.lap(Phase::Wait, t1);
            chunk.record_span_errors(span_results, errors);
            let (requests, owner) = chunk.copy_out_requests(items, slot.addr(), self.own, errors);
            timer.lap(Phase::Build, t2);
            self.run_batch(&requests, &owner, errors)?;
            delivered += self.deliver_chunk(items, found, &chunk, slot.addr(), promote_enabled, errors);
        }
        Ok(delivered)
    }

    /// Counts the bytes of a chunk's keys that were delivered, and promotes from staging into
    /// DRAM the whole objects read as one span from block 0. Returns the bytes delivered.
    fn deliver_chunk(
        &self,
        items: &[RangedGet<'_>],
        found: &[Found],
        chunk: &Chunk<'_>,
        staging: u64,
        promote_enabled: bool,
        errors: &[Option<StoreError>],
    ) -> u64 {
        let mut delivered = 0u64;
        let mut promote: Vec<(&str, u64, u64, u32, u64)> = Vec::new();
        for (c, &k) in chunk.keys.iter().enumerate() {
            if errors[k].is_some() {
                continue;
            }
            let Found::Ssd(e) = &found[k] else { unreachable!() };
            let bytes: u64 = items[k].ranges.iter().map(|r| r.len).sum();
            delivered += bytes;
            let (s0, s1) = chunk.key_spans[c];
            let spans = &chunk.spans;
            if bytes == e.payload_len && s1 - s0 == 1 && spans[s0].first_block == 0 && promote_enabled {
                promote.push((
                    items[k].key,
                    staging + spans[s0].staging_offset,
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
        delivered
    }
}

/// What resolving a call's keys yields, per key in order.
struct Lookup<'g> {
    found: Vec<Found>,
    /// Each key's committed DRAM entry and its spot (`None`: not in DRAM).
    locs: Vec<Option<(&'g DramEntry, Spot)>>,
}

/// What a call adds to the store's counters.
#[derive(Default)]
struct Tally {
    local_hits: u64,
    misses: u64,
    dram_bytes: u64,
    ssd_bytes: u64,
    reused: bool,
}

/// Opens a call's cached resolution: reused as it is while the DRAM index is at the epoch it
/// was filled at and it holds the call's `n` keys, else emptied for this call to refill. Returns
/// whether it is reused, the reused entries, and the refill.
fn open_cache(cache: Option<&mut Resolved>, epoch: u64, n: usize) -> (bool, Option<Reuse<'_>>, Option<Refill<'_>>) {
    match cache {
        Some(c) if epoch != 0 && c.epoch == epoch && c.entries.len() == n => {
            let c: &Resolved = c;
            (true, Some((&c.entries, &c.spots)), None)
        }
        Some(c) => {
            let (mut v, mut s) = (std::mem::take(&mut c.entries), std::mem::take(&mut c.spots));
            v.clear();
            s.clear();
            c.epoch = 0;
            (false, None, Some((c, v, s)))
        }
        None => (false, None, None),
    }
}

/// Puts the refilled entries back into the cache, reusable (stamped with `epoch`) only when every
/// key was in DRAM: a key on SSD or missing is resolved again.
fn close_cache((c, v, s): Refill<'_>, epoch: u64, found: &[Found]) {
    if v.len() == found.len() && found.iter().all(|f| matches!(f, Found::Dram)) {
        c.epoch = epoch;
    }
    c.entries = v;
    c.spots = s;
}

/// Key `k`'s committed DRAM entry and its spot: from the reused resolution, or looked up (and
/// recorded into the refill).
#[inline(always)]
fn dram_entry_of<'g>(
    k: usize,
    key: &str,
    dram: Option<&'g DramState>,
    held: Option<Reuse<'g>>,
    fill: &mut Option<Refill<'_>>,
) -> Option<(&'g DramEntry, Spot)> {
    match held {
        Some((entries, spots)) => Some((&entries[k], spots[k])),
        None => dram.and_then(|d| d.get_shared(key)).map(|e| {
            let spot = Spot::of(e);
            if let Some((_, v, s)) = fill {
                v.push(e.clone());
                s.push(spot);
            }
            (&**e, spot)
        }),
    }
}

/// Checks key `k`'s ask against its object's size (`None`: absent or damaged). Ranges must lie
/// inside the object (an error for the whole call). A whole get's buffer must hold the object:
/// when it does not, the key fails with `BufferTooSmall` and this returns false; its one range
/// goes to `whole` either way.
#[inline(always)]
fn check_size(
    wants: &Wants<'_, '_>,
    k: usize,
    size: Option<u64>,
    scratch: &mut Vec<u32>,
    whole: &mut Vec<[Range; 1]>,
    errors: &mut [Option<StoreError>],
) -> Result<bool> {
    match wants {
        Wants::Ranges(items) => {
            check_get_ranges(k, size.unwrap_or(u64::MAX), items[k].ranges, scratch)?;
            Ok(true)
        }
        Wants::Whole(items) => {
            let (key, addr, cap) = items[k];
            let len = size.unwrap_or(0);
            whole.push([Range::new(0, len, addr)]);
            if len > cap {
                errors[k] = Some(StoreError::BufferTooSmall {
                    key: key.to_owned(),
                    need: len,
                    have: cap,
                });
                return Ok(false);
            }
            Ok(true)
        }
    }
}

/// The call's items as ranged gets: a ranged call's own, or a whole get's one range per key.
fn items_of<'w>(wants: &Wants<'w, 'w>, whole: &'w [[Range; 1]]) -> Cow<'w, [RangedGet<'w>]> {
    match wants {
        Wants::Ranges(items) => Cow::Borrowed(*items),
        Wants::Whole(items) => Cow::Owned(
            items
                .iter()
                .zip(whole)
                .map(|(i, r)| RangedGet { key: i.0, ranges: r })
                .collect(),
        ),
    }
}

/// Fails the keys whose SSD record is damaged (its header failed its CRC) with `Corrupt`.
fn fail_damaged(items: &[RangedGet<'_>], found: &mut [Found], errors: &mut [Option<StoreError>]) {
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
}

/// Per key: its byte count, its recorded error, or NotFound; and the call's hits and misses.
fn results_of(
    items: &[RangedGet<'_>],
    found: Vec<Found>,
    errors: &mut [Option<StoreError>],
) -> (Vec<Result<u64>>, Tally) {
    let mut results = Vec::with_capacity(items.len());
    let mut t = Tally::default();
    for (k, (it, f)) in items.iter().zip(found).enumerate() {
        let local = matches!(f, Found::Dram | Found::Ssd(_));
        results.push(match (errors[k].take(), f) {
            (Some(e), _) => Err(e),
            (None, Found::Missing | Found::Failed) => Err(StoreError::NotFound { key: it.key.to_owned() }),
            (None, _) => Ok(it.ranges.iter().map(|r| r.len).sum()),
        });
        match &results[k] {
            Ok(_) if local => t.local_hits += 1,
            Err(StoreError::NotFound { .. }) => t.misses += 1,
            _ => {}
        }
    }
    (results, t)
}

/// The SSD keys of one staging slot's worth: their block spans, where each range lands in
/// staging, and which spans are each key's.
struct Chunk<'i> {
    spans: Vec<ReadSpan>,
    /// The staging offset of each range's first byte, keys in order.
    range_at: Vec<u64>,
    entries: Vec<&'i SsdEntry>,
    names: Vec<&'i str>,
    /// The call's key index of each entry.
    keys: Vec<usize>,
    /// Each key's spans, `[start, end)` in `spans`.
    key_spans: Vec<(usize, usize)>,
}

/// Plans as many of `keys` from `*next` on as fit in a staging slot of `slot_len` bytes. A key
/// that alone exceeds the slot fails with `TooLarge` and is skipped.
fn plan_chunk<'i>(
    items: &[RangedGet<'i>],
    found: &'i [Found],
    keys: &[usize],
    next: &mut usize,
    slot_len: u64,
    errors: &mut [Option<StoreError>],
) -> Chunk<'i> {
    let mut c = Chunk {
        spans: Vec::new(),
        range_at: Vec::new(),
        entries: Vec::new(),
        names: Vec::new(),
        keys: Vec::new(),
        key_spans: Vec::new(),
    };
    let mut cursor = 0u64;
    while *next < keys.len() {
        let k = keys[*next];
        let Found::Ssd(e) = &found[k] else { unreachable!() };
        let (s0, r0, c0) = (c.spans.len(), c.range_at.len(), cursor);
        LogCore::plan_ranges(
            c.entries.len(),
            items[k].ranges.iter().map(|r| (r.offset, r.len)),
            &mut c.spans,
            &mut cursor,
            &mut c.range_at,
        );
        if cursor > slot_len {
            c.spans.truncate(s0);
            c.range_at.truncate(r0);
            let need = cursor - c0;
            cursor = c0;
            if need > slot_len {
                errors[k] = Some(StoreError::TooLarge {
                    key: items[k].key.to_owned(),
                    need,
                    limit: slot_len,
                });
                *next += 1;
                continue;
            }
            break;
        }
        c.key_spans.push((s0, c.spans.len()));
        c.entries.push(e);
        c.names.push(items[k].key);
        c.keys.push(k);
        *next += 1;
    }
    c
}

impl Chunk<'_> {
    /// Records each failed span's error as its key's (the first one wins).
    fn record_span_errors(&self, span_results: Vec<Result<()>>, errors: &mut [Option<StoreError>]) {
        for (s, r) in self.spans.iter().zip(span_results) {
            if let Err(e) = r {
                let k = self.keys[s.entry];
                if errors[k].is_none() {
                    errors[k] = Some(e);
                }
            }
        }
    }

    /// The requests that copy the ranges of the chunk's keys that read cleanly from staging
    /// (at `staging`) into their caller buffers, and their keys.
    fn copy_out_requests(
        &self,
        items: &[RangedGet<'_>],
        staging: u64,
        own: SegmentId,
        errors: &[Option<StoreError>],
    ) -> (Vec<TransferRequest>, Vec<u32>) {
        let n: usize = self.keys.iter().map(|&k| items[k].ranges.len()).sum();
        let mut requests: Vec<TransferRequest> = Vec::with_capacity(n);
        let mut owner: Vec<u32> = Vec::with_capacity(n);
        let mut at = self.range_at.iter();
        for &k in &self.keys {
            let ok = errors[k].is_none();
            for r in items[k].ranges {
                let from = staging + at.next().expect("one offset per range");
                if ok {
                    requests.push(TransferRequest::read(r.addr, own, from, r.len));
                    owner.push(k as u32);
                }
            }
        }
        (requests, owner)
    }
}
