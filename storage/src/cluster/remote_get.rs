//! The miss path of a ranged get: keys this peer does not hold are read from their owners.
//!
//! Per call: one directory lookup for the missed keys (one read lock), then per owner, all owners
//! at once, each moving to its next step as soon as its own answer or batch is in (so a silent
//! owner holds up only its own keys): RESOLVE over a pooled control connection; one engine batch reading exactly the
//! requested spans from the owner's exported memory into the caller's registered buffers;
//! VALIDATE, which also releases any staging lease. A key whose placement changed while it was
//! read is a miss (`NotFound`), never data; an owner that fails or does not answer within the
//! cluster timeout fails only its own keys (`Remote`).

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use te_base::{Phase, SegmentId};
use te_core::TransferRequest;

use parking_lot::Mutex;

use super::conn::Conn;
use super::request_error::{RequestError, PLACES, VERDICTS};
use super::wake::{wait_any, Wake};
use super::wire::{self, Op, Place};
use super::{Cluster, Remembered};
use crate::core::{Core, RangedGet};
use crate::error::StoreError;
use crate::range_map::{map_range, Extent};

/// One owner's share of a call.
struct OwnerWork {
    owner: Arc<str>,
    addr: SocketAddr,
    /// Indices (into the call's items) of the keys it owns.
    keys: Vec<usize>,
    /// Per key, the placement remembered from an earlier read (no RESOLVE needed for it).
    cached: Vec<Option<Arc<Place>>>,
}

/// A key's owner, and its placement when one is remembered.
struct Located {
    owner: Arc<str>,
    addr: SocketAddr,
    cached: Option<Arc<Place>>,
}

/// Where one owner's keys are: from RESOLVE, or remembered.
struct Resolved {
    conn: Conn,
    lease: u64,
    places: Vec<Arc<Place>>,
    segment: SegmentId,
    control_bytes: u64,
}

/// A key whose ranges are in an owner's batch.
struct ReadKey {
    k: usize,
    generation: u64,
    place: Arc<Place>,
    /// The placement came from the cache (if it turns out stale, the key is resolved again).
    cached: bool,
}

fn remote_err(key: &str, peer: &str, reason: impl std::fmt::Display) -> StoreError {
    StoreError::Remote {
        key: key.to_owned(),
        peer: peer.to_owned(),
        reason: reason.to_string(),
    }
}

/// Most placements remembered (about 100 bytes each); the map is cleared when it is full.
const MAX_PLACEMENTS: usize = 1 << 16;

/// Totals of one call.
#[derive(Default)]
pub(crate) struct RemoteOutcome {
    pub(crate) hits: u64,
    pub(crate) bytes: u64,
}

/// What every step of one pass reads: the store's core, the call's items and deadline, whether
/// the pass names several owners, and then the eventfd that wakes the caller when a batch or a
/// new connection is done (`None` with one owner, or when no fd was left: then the caller polls
/// in short steps).
struct Pass<'c, 'i> {
    core: &'c Core,
    items: &'c [RangedGet<'i>],
    end: Instant,
    several: bool,
    wake: Option<Arc<Wake>>,
}

impl Cluster {
    /// Reads `missed` keys of `items` from their owners. Per key, sets `errors[k]` on failure or
    /// pushes `k` to `hits` when its bytes were delivered and validated. Keys read through a
    /// remembered placement that turned out stale are resolved and read once more.
    pub(crate) fn get_remote(
        self: &Arc<Self>,
        core: &Core,
        items: &[RangedGet<'_>],
        missed: &[usize],
        errors: &mut [Option<StoreError>],
        hits: &mut Vec<usize>,
    ) -> RemoteOutcome {
        let mut out = RemoteOutcome::default();
        if missed.is_empty() || !self.dir.is_live() {
            return out;
        }
        self.forget_restarted();
        // One deadline for the whole call: the lookup, every round trip, the reads and a second
        // pass all spend what is left of it.
        let end = Instant::now() + self.cfg.timeout;
        let mut retry = Vec::new();
        self.pass(
            core,
            items,
            missed,
            true,
            end,
            &mut PassOut::new(errors, hits, &mut out, &mut retry),
        );
        if !retry.is_empty() {
            for &k in &retry {
                errors[k] = None;
            }
            let mut again = Vec::new();
            self.pass(
                core,
                items,
                &retry,
                false,
                end,
                &mut PassOut::new(errors, hits, &mut out, &mut again),
            );
        }
        let c = &self.counters;
        c.remote_hits.fetch_add(out.hits, Ordering::Relaxed);
        c.remote_bytes.fetch_add(out.bytes, Ordering::Relaxed);
        let failed = missed
            .iter()
            .filter(|&&k| matches!(errors[k], Some(StoreError::Remote { .. })))
            .count();
        c.remote_errors.fetch_add(failed as u64, Ordering::Relaxed);
        out
    }

    /// One round: RESOLVE (keys without a usable remembered placement), one engine batch per
    /// owner, VALIDATE. Stale remembered keys go to `acc.retry`.
    ///
    /// Several owners: each moves through its steps as soon as its own answer or batch is in, so
    /// a silent owner fails only its own keys.
    fn pass(
        &self,
        core: &Core,
        items: &[RangedGet<'_>],
        keys: &[usize],
        use_cache: bool,
        end: Instant,
        acc: &mut PassOut<'_>,
    ) {
        let work = self.owners_of(items, keys, use_cache, end);
        if work.is_empty() {
            return;
        }
        // With the phase report on: resolve = connecting and RESOLVE, wait = the reads and the
        // waits on several owners, other = VALIDATE.
        let timer = &core.timer();
        let mut t = timer.start();
        let several = work.len() > 1;
        let call = Pass {
            core,
            items,
            end,
            several,
            wake: if several { Wake::new() } else { None },
        };
        let slots: Vec<Mutex<Option<std::io::Result<Conn>>>> = work.iter().map(|_| Mutex::new(None)).collect();
        std::thread::scope(|s| {
            let mut steps: Vec<Step<'_, '_>> = work
                .iter()
                .zip(&slots)
                .map(|(w, slot)| self.start_owner(s, &call, w, slot, acc))
                .collect();
            t = timer.lap(Phase::Resolve, t);
            while let Some((ready, polled)) = ready_steps(&steps, call.wake.as_deref(), end) {
                if polled {
                    t = timer.lap(Phase::Wait, t);
                }
                for i in ready {
                    let step = std::mem::replace(&mut steps[i], Step::Done);
                    let phase = step.phase();
                    steps[i] = self.advance(&call, &work[i], step, acc);
                    t = timer.lap(phase, t);
                }
            }
        });
        self.counters.control_bytes.fetch_add(acc.control, Ordering::Relaxed);
        self.counters.stale.fetch_add(acc.stale, Ordering::Relaxed);
    }

    /// This pass's keys grouped by owner, in the order the owners first appear. A key `locate`
    /// finds no remote owner for is in no group (it stays a miss).
    fn owners_of(&self, items: &[RangedGet<'_>], keys: &[usize], use_cache: bool, end: Instant) -> Vec<OwnerWork> {
        let mut work: Vec<OwnerWork> = Vec::new();
        for (&k, o) in keys.iter().zip(self.locate(items, keys, use_cache, end)) {
            let Some(Located { owner, addr, cached }) = o else {
                continue;
            };
            match work.iter_mut().find(|w| w.owner == owner) {
                Some(w) => {
                    w.keys.push(k);
                    w.cached.push(cached);
                }
                None => work.push(OwnerWork {
                    owner,
                    addr,
                    keys: vec![k],
                    cached: vec![cached],
                }),
            }
        }
        work
    }

    /// Starts one owner's part. An owner that did not answer in time lately fails its keys at
    /// once; with a pooled connection the part moves on to RESOLVE (or the read) now; a new
    /// connection is made on a thread of its own when there are other owners, so a silent
    /// owner's handshake holds up no other.
    fn start_owner<'s, 'm: 's>(
        &'s self,
        s: &'s std::thread::Scope<'s, '_>,
        call: &Pass<'_, '_>,
        w: &OwnerWork,
        slot: &'m Mutex<Option<std::io::Result<Conn>>>,
        acc: &mut PassOut<'_>,
    ) -> Step<'s, 'm> {
        let timeout = self.cfg.timeout;
        if self.pool.is_suspect(&w.owner, timeout) {
            for &k in &w.keys {
                acc.errors[k] = Some(remote_err(
                    call.items[k].key,
                    &w.owner,
                    format!(
                        "it did not answer within the last {} ms; passed over",
                        timeout.as_millis()
                    ),
                ));
            }
            return Step::Done;
        }
        match self.pool.pooled(&w.owner, call.end) {
            Some(c) => self.begin(call, w, Ok(c), acc),
            None if call.several => {
                let (pool, addr, end, wake) = (&self.pool, w.addr, call.end, call.wake.clone());
                let handle = s.spawn(move || {
                    *slot.lock() = Some(pool.connect(addr, end));
                    if let Some(w) = wake {
                        w.signal();
                    }
                });
                Step::Connecting { handle, slot }
            }
            None => self.begin(call, w, self.pool.connect(w.addr, call.end), acc),
        }
    }

    /// Moves one owner's part of the call on by one step: the step's answer or batch is in, or
    /// this waits for it (by the call's deadline).
    fn advance<'s, 'm>(
        &self,
        call: &Pass<'_, '_>,
        w: &OwnerWork,
        step: Step<'s, 'm>,
        acc: &mut PassOut<'_>,
    ) -> Step<'s, 'm> {
        match step {
            Step::Connecting { handle, slot } => {
                let _ = handle.join();
                let conn = slot
                    .lock()
                    .take()
                    .unwrap_or_else(|| Err(std::io::Error::other("the connecting thread failed")));
                self.begin(call, w, conn, acc)
            }
            Step::Places {
                mut conn,
                segment,
                sent,
            } => {
                let r = (|| {
                    let (op, answer) = conn
                        .recv()
                        .map_err(|e| self.io_failure(&w.owner, "reading PLACES", e))?;
                    let (lease, places) = RequestError::decode("RESOLVE", PLACES, op, &answer, wire::decode_places)?;
                    if places.len() != w.cached.iter().filter(|c| c.is_none()).count() {
                        return Err(RequestError::WrongCount { request: "RESOLVE" });
                    }
                    Ok((lease, places, sent + (wire::HEAD + answer.len()) as u64))
                })();
                match self.keep_or_fail(r, w, call.items, acc.errors) {
                    Some((lease, places, bytes)) => {
                        let r = resolved(w, conn, segment, lease, places, bytes);
                        self.read_step(call, w, r, acc)
                    }
                    None => Step::Done,
                }
            }
            Step::Reading(sub) => self.after_read(call, w, sub, acc),
            Step::Verdicts { checked, conn, bytes } => {
                self.take_verdicts(call.items, w, checked, conn, bytes, acc);
                Step::Done
            }
            Step::Done => Step::Done,
        }
    }

    /// With a connection to the owner: sends RESOLVE for the keys without a remembered
    /// placement, or, when every key has one, submits the read at once.
    fn begin<'s, 'm>(
        &self,
        call: &Pass<'_, '_>,
        w: &OwnerWork,
        conn: std::io::Result<Conn>,
        acc: &mut PassOut<'_>,
    ) -> Step<'s, 'm> {
        let items = call.items;
        let conn = conn.map_err(|e| self.io_failure(&w.owner, "control connection", e));
        let r = self.segment_for(call.core, &w.owner, call.end).and_then(|segment| {
            let mut conn = conn?;
            let fresh = w.keys.iter().zip(&w.cached).filter(|(_, c)| c.is_none());
            if fresh.clone().next().is_none() {
                return Ok((conn, segment, None));
            }
            let body = wire::encode_resolve(
                fresh
                    .map(|(&k, _)| (items[k].key, items[k].ranges))
                    .collect::<Vec<_>>()
                    .into_iter(),
            );
            conn.send(Op::Resolve, &body)
                .map_err(|e| self.io_failure(&w.owner, "sending RESOLVE", e))?;
            Ok((conn, segment, Some((body.len() + wire::HEAD) as u64)))
        });
        match self.keep_or_fail(r, w, items, acc.errors) {
            Some((conn, segment, Some(sent))) => Step::Places { conn, segment, sent },
            Some((conn, segment, None)) => {
                let r = resolved(w, conn, segment, 0, Vec::new(), 0);
                self.read_step(call, w, r, acc)
            }
            None => Step::Done,
        }
    }

    /// Submits the owner's engine batch (its completion signals the pass's wake, if any).
    fn read_step<'s, 'm>(
        &self,
        call: &Pass<'_, '_>,
        w: &OwnerWork,
        r: Resolved,
        acc: &mut PassOut<'_>,
    ) -> Step<'s, 'm> {
        let sub = self.submit_owner(call.core, call.items, w, r, acc.errors);
        if let (Some(b), Some(wake)) = (&sub.batch, &call.wake) {
            wake.on_complete(b);
        }
        Step::Reading(sub)
    }

    /// The owner's batch is done (or this waits for it by the call's deadline): sends VALIDATE
    /// for what was read.
    fn after_read<'s, 'm>(
        &self,
        call: &Pass<'_, '_>,
        w: &OwnerWork,
        sub: SubmitState,
        acc: &mut PassOut<'_>,
    ) -> Step<'s, 'm> {
        let (items, end) = (call.items, call.end);
        let timeout = self.cfg.timeout;
        let errors = &mut *acc.errors;
        let SubmitState {
            r,
            batch,
            owner_of_request,
            read,
            requests,
            retry: again,
        } = sub;
        if !again.is_empty() {
            let mut placements = self.placements.write();
            for &k in &again {
                placements.remove(items[k].key);
            }
            acc.retry.extend(again);
        }
        if let Some(batch) = batch {
            match batch.wait_blocking(Some(end.saturating_duration_since(Instant::now()))) {
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    self.forget(&w.owner);
                    for (i, err) in e.failures {
                        let k = owner_of_request[i] as usize;
                        if errors[k].is_some() {
                            continue;
                        }
                        if read.iter().any(|x| x.k == k && x.cached) {
                            // Marked so VALIDATE skips it; read afresh in the next round.
                            errors[k] = Some(StoreError::NotFound {
                                key: items[k].key.to_owned(),
                            });
                            acc.retry.push(k);
                        } else {
                            errors[k] = Some(remote_err(items[k].key, &w.owner, err));
                        }
                    }
                }
                None => {
                    batch.cancel();
                    self.forget(&w.owner);
                    self.pool.suspect(&w.owner);
                    for k in read.iter().map(|x| x.k) {
                        errors[k].get_or_insert_with(|| {
                            remote_err(
                                items[k].key,
                                &w.owner,
                                format!("read not done within {} ms", timeout.as_millis()),
                            )
                        });
                    }
                    // The call's deadline has passed: no VALIDATE waits on the owner again
                    // (a staging lease it holds ends at its own deadline).
                    self.counters.remote_requests.fetch_add(requests, Ordering::Relaxed);
                    return Step::Done;
                }
            }
        }
        self.counters.remote_requests.fetch_add(requests, Ordering::Relaxed);
        let checked: Vec<ReadKey> = read.into_iter().filter(|x| errors[x.k].is_none()).collect();
        if checked.is_empty() && r.lease == 0 {
            // Nothing to check and nothing to release.
            self.put_conn(w.owner.clone(), r.conn);
            return Step::Done;
        }
        let body = wire::encode_validate(r.lease, checked.iter().map(|x| (items[x.k].key, x.generation)));
        let Resolved {
            mut conn,
            control_bytes,
            ..
        } = r;
        match conn.send(Op::Validate, &body) {
            Ok(()) => Step::Verdicts {
                checked,
                conn,
                bytes: control_bytes + (body.len() + wire::HEAD) as u64,
            },
            Err(e) => {
                let e = self.io_failure(&w.owner, "sending VALIDATE", e);
                self.forget(&w.owner);
                for x in &checked {
                    errors[x.k] = Some(remote_err(items[x.k].key, &w.owner, &e));
                }
                Step::Done
            }
        }
    }

    /// Reads the owner's VERDICTS: validated keys are hits, stale remembered ones go to the
    /// retry, stale fresh ones are misses.
    fn take_verdicts(
        &self,
        items: &[RangedGet<'_>],
        w: &OwnerWork,
        checked: Vec<ReadKey>,
        mut conn: Conn,
        bytes: u64,
        acc: &mut PassOut<'_>,
    ) {
        let verdicts = conn
            .recv()
            .map_err(|e| self.io_failure(&w.owner, "reading VERDICTS", e))
            .and_then(|(op, a)| {
                acc.control += bytes + (wire::HEAD + a.len()) as u64;
                RequestError::decode("VALIDATE", VERDICTS, op, &a, wire::decode_verdicts)
            });
        match verdicts {
            Ok(ok) if ok.len() == checked.len() => {
                self.put_conn(w.owner.clone(), conn);
                let mut placements = self.placements.write();
                for (x, good) in checked.into_iter().zip(ok) {
                    let key = items[x.k].key;
                    if good {
                        acc.hits.push(x.k);
                        acc.out.hits += 1;
                        acc.out.bytes += items[x.k].ranges.iter().map(|r| r.len).sum::<u64>();
                        if !x.cached && matches!(*x.place, Place::Dram { .. }) {
                            if placements.len() >= MAX_PLACEMENTS {
                                placements.clear();
                            }
                            placements.insert(key.to_owned(), (w.owner.clone(), x.place));
                        }
                    } else if x.cached {
                        // The remembered placement is gone: resolve the key afresh.
                        placements.remove(key);
                        acc.retry.push(x.k);
                    } else {
                        // The object moved or changed while it was read: a miss, not data.
                        acc.stale += 1;
                        acc.errors[x.k] = Some(StoreError::NotFound { key: key.to_owned() });
                    }
                }
            }
            other => {
                let why = match other {
                    Err(e) => e,
                    Ok(_) => RequestError::WrongCount { request: "VALIDATE" },
                };
                self.forget(&w.owner);
                for x in &checked {
                    acc.errors[x.k] = Some(remote_err(items[x.k].key, &w.owner, &why));
                }
            }
        }
    }

    /// The owner of each of `keys`: a remembered placement's owner while it is a live member,
    /// with the placement (VALIDATE still checks the read), the directory's answer for the rest
    /// (one lookup). One read lock of the placements and one of the membership per call.
    fn locate(&self, items: &[RangedGet<'_>], keys: &[usize], use_cache: bool, end: Instant) -> Vec<Option<Located>> {
        let mut out: Vec<Option<Located>> = (0..keys.len()).map(|_| None).collect();
        let mut remembered: Vec<(usize, Remembered)> = Vec::new();
        if use_cache {
            let placements = self.placements.read();
            remembered.extend(
                keys.iter()
                    .enumerate()
                    .filter_map(|(j, &k)| Some((j, placements.get(items[k].key)?.clone()))),
            );
        }
        let addrs = self.dir.addrs_of(remembered.iter().map(|(_, (o, _))| &**o));
        for ((j, (owner, place)), addr) in remembered.into_iter().zip(addrs) {
            if let Some(addr) = addr {
                out[j] = Some(Located {
                    owner,
                    addr,
                    cached: Some(place),
                });
            }
        }
        let ask: Vec<usize> = (0..keys.len()).filter(|&j| out[j].is_none()).collect();
        if !ask.is_empty() {
            let names: Vec<&str> = ask.iter().map(|&j| items[keys[j]].key).collect();
            for (j, o) in ask.into_iter().zip(self.dir.owners(&names, end)) {
                out[j] = o.map(|(owner, addr)| Located {
                    owner,
                    addr,
                    cached: None,
                });
            }
        }
        out
    }

    /// `Ok` passes through; an error fails every key of the owner (and forgets its connections
    /// and segment, so the next call starts afresh).
    fn keep_or_fail<T>(
        &self,
        r: Result<T, RequestError>,
        w: &OwnerWork,
        items: &[RangedGet<'_>],
        errors: &mut [Option<StoreError>],
    ) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(why) => {
                self.forget(&w.owner);
                for &k in &w.keys {
                    errors[k] = Some(remote_err(items[k].key, &w.owner, &why));
                }
                None
            }
        }
    }

    /// A pooled control connection to `owner`, or a new one, bounded by `end` until it is
    /// returned to the pool.
    pub(crate) fn conn_to(&self, owner: &Arc<str>, addr: SocketAddr, end: Instant) -> Result<Conn, RequestError> {
        self.pool
            .get(owner, addr, end)
            .map(|(c, _)| c)
            .map_err(|e| self.io_failure(owner, "control connection", e))
    }

    /// Describes a failed control round trip with `owner`; one that timed out marks it suspect
    /// (the next calls pass it over at once instead of waiting again).
    pub(crate) fn io_failure(&self, owner: &Arc<str>, what: &'static str, e: std::io::Error) -> RequestError {
        let e = RequestError::io(what, e);
        if e.is_timeout() {
            self.pool.suspect(owner);
        }
        e
    }

    /// `owner`'s engine segment, opened (on the control runtime, by `end`) the first time.
    pub(crate) fn segment_for(&self, core: &Core, owner: &Arc<str>, end: Instant) -> Result<SegmentId, RequestError> {
        if let Some(s) = self.segment(owner) {
            return Ok(s);
        }
        let (engine, name) = (core.engine().clone(), owner.to_string());
        let opened = self.run(
            async move { engine.open_segment(&name).await.map(|h| h.id()) },
            end.saturating_duration_since(Instant::now()),
        );
        let s = opened
            .ok_or_else(|| RequestError::timed_out("opening its segment"))?
            .map_err(|source| RequestError::Engine {
                what: "opening its segment",
                source,
            })?;
        self.remember_segment(owner.clone(), s);
        Ok(s)
    }

    /// Builds and submits one owner's batch from its places; keys that cannot be read get their
    /// error now.
    fn submit_owner(
        &self,
        core: &Core,
        items: &[RangedGet<'_>],
        w: &OwnerWork,
        r: Resolved,
        errors: &mut [Option<StoreError>],
    ) -> SubmitState {
        let n: usize = w.keys.iter().map(|&k| items[k].ranges.len()).sum();
        let mut requests: Vec<TransferRequest> = Vec::with_capacity(n);
        let mut owner_of_request: Vec<u32> = Vec::with_capacity(n);
        let mut read: Vec<ReadKey> = Vec::with_capacity(w.keys.len());
        let mut retry = Vec::new();
        let mut extents: Vec<Extent> = Vec::new();
        let seg = r.segment;
        for ((&k, place), cached) in w.keys.iter().zip(&r.places).zip(&w.cached) {
            let it = &items[k];
            let (object_len, generation) = match &**place {
                Place::Dram {
                    object_len, generation, ..
                } => (*object_len, *generation),
                Place::Staged { object_len, .. } => (*object_len, 0),
                Place::Missing => {
                    errors[k] = Some(StoreError::NotFound { key: it.key.to_owned() });
                    continue;
                }
                Place::Failed(why) => {
                    errors[k] = Some(remote_err(it.key, &w.owner, why));
                    continue;
                }
            };
            if let Some((i, bad)) = it
                .ranges
                .iter()
                .enumerate()
                .find(|(_, x)| x.offset > object_len || x.len > object_len - x.offset)
            {
                if cached.is_some() {
                    // The remembered size may be an older version's: ask the owner.
                    retry.push(k);
                    continue;
                }
                errors[k] = Some(StoreError::RangeOutsideObject {
                    key_index: k,
                    range_index: i,
                    offset: bad.offset,
                    len: bad.len,
                    object_len,
                });
                continue;
            }
            let start = requests.len();
            match &**place {
                Place::Dram { extents: ex, .. } => {
                    extents.clear();
                    extents.extend(ex.iter().map(|&(addr, len)| Extent { addr, len }));
                    if extents.iter().map(|e| e.len).sum::<u64>() < object_len {
                        errors[k] = Some(remote_err(it.key, &w.owner, "extents do not cover the object"));
                        continue;
                    }
                    for x in it.ranges {
                        map_range(&extents, x, |remote, caller, len| {
                            requests.push(TransferRequest::read(caller, seg, remote, len));
                            owner_of_request.push(k as u32);
                        });
                    }
                }
                Place::Staged { addrs, .. } => {
                    if addrs.len() != it.ranges.len() {
                        errors[k] = Some(remote_err(it.key, &w.owner, "staged addresses do not match the ranges"));
                        continue;
                    }
                    for (x, &a) in it.ranges.iter().zip(addrs) {
                        requests.push(TransferRequest::read(x.addr, seg, a, x.len));
                        owner_of_request.push(k as u32);
                    }
                }
                _ => unreachable!("handled above"),
            }
            debug_assert!(requests.len() > start);
            read.push(ReadKey {
                k,
                generation,
                place: place.clone(),
                cached: cached.is_some(),
            });
        }
        let count = requests.len() as u64;
        let batch = if requests.is_empty() {
            None
        } else {
            match core.engine().submit(&requests) {
                Ok(b) => Some(b),
                Err(e) => {
                    for x in read.drain(..) {
                        if x.cached {
                            // Remembered from an earlier instance of the owner, perhaps.
                            retry.push(x.k);
                        } else {
                            errors[x.k] = Some(remote_err(items[x.k].key, &w.owner, &e));
                        }
                    }
                    None
                }
            }
        };
        SubmitState {
            r,
            batch,
            owner_of_request,
            read,
            requests: count,
            retry,
        }
    }
}

/// Where one owner's part of a call stands.
enum Step<'s, 'm> {
    /// A new control connection being made on a thread of its own; it fills `slot`.
    Connecting {
        handle: std::thread::ScopedJoinHandle<'s, ()>,
        slot: &'m Mutex<Option<std::io::Result<Conn>>>,
    },
    /// RESOLVE sent (`sent` bytes); PLACES awaited.
    Places {
        conn: Conn,
        segment: SegmentId,
        sent: u64,
    },
    /// The owner's engine batch is running.
    Reading(SubmitState),
    /// VALIDATE sent; VERDICTS awaited (`bytes`: the owner's control bytes so far).
    Verdicts {
        checked: Vec<ReadKey>,
        conn: Conn,
        bytes: u64,
    },
    Done,
}

/// What one pass's steps write to.
struct PassOut<'a> {
    errors: &'a mut [Option<StoreError>],
    hits: &'a mut Vec<usize>,
    out: &'a mut RemoteOutcome,
    retry: &'a mut Vec<usize>,
    stale: u64,
    control: u64,
}

impl<'a> PassOut<'a> {
    fn new(
        errors: &'a mut [Option<StoreError>],
        hits: &'a mut Vec<usize>,
        out: &'a mut RemoteOutcome,
        retry: &'a mut Vec<usize>,
    ) -> Self {
        PassOut {
            errors,
            hits,
            out,
            retry,
            stale: 0,
            control: 0,
        }
    }
}

impl Step<'_, '_> {
    /// Where the phase report counts the time spent moving this step on.
    fn phase(&self) -> Phase {
        match self {
            Step::Reading(_) => Phase::Wait,
            Step::Verdicts { .. } => Phase::Other,
            _ => Phase::Resolve,
        }
    }
}

/// The owners' steps that can move on now, waiting until one can (by `end`), and whether this
/// polled; `None` once every owner is done. With one owner left, or past the deadline, every
/// pending step is ready: each is then waited on directly, and every such wait ends by the
/// deadline (past it, only what already arrived is taken).
fn ready_steps(steps: &[Step<'_, '_>], wake: Option<&Wake>, end: Instant) -> Option<(Vec<usize>, bool)> {
    let pending: Vec<usize> = (0..steps.len()).filter(|&i| !matches!(steps[i], Step::Done)).collect();
    if pending.is_empty() {
        return None;
    }
    if pending.len() == 1 || Instant::now() >= end {
        return Some((pending, false));
    }
    let mut socks = Vec::new();
    let mut on_sock = Vec::new();
    let mut ready = Vec::new();
    let mut background = false;
    for &i in &pending {
        let done = match &steps[i] {
            Step::Places { conn, .. } | Step::Verdicts { conn, .. } => {
                socks.push(conn.as_fd());
                on_sock.push(i);
                continue;
            }
            Step::Reading(sub) => sub.batch.as_ref().is_none_or(|b| b.is_complete()),
            Step::Connecting { slot, .. } => slot.lock().is_some(),
            Step::Done => continue,
        };
        if done {
            ready.push(i);
        } else {
            background = true;
        }
    }
    let readable = wait_any(&socks, wake, !ready.is_empty(), background, end);
    ready.extend(on_sock.into_iter().zip(readable).filter(|(_, r)| *r).map(|(i, _)| i));
    Some((ready, true))
}

/// An owner's placements: remembered ones, the rest from PLACES (`fresh`, in key order).
fn resolved(
    w: &OwnerWork,
    conn: Conn,
    segment: SegmentId,
    lease: u64,
    fresh: Vec<Place>,
    control_bytes: u64,
) -> Resolved {
    let mut fresh = fresh.into_iter();
    let places = w
        .cached
        .iter()
        .map(|c| {
            c.clone()
                .unwrap_or_else(|| Arc::new(fresh.next().unwrap_or(Place::Missing)))
        })
        .collect();
    Resolved {
        conn,
        lease,
        places,
        segment,
        control_bytes,
    }
}

/// One owner's submitted batch and what it covers.
struct SubmitState {
    r: Resolved,
    batch: Option<te_core::Batch>,
    owner_of_request: Vec<u32>,
    /// Every key whose ranges are in the batch.
    read: Vec<ReadKey>,
    /// Keys whose remembered placement could not serve the ranges (resolve them again).
    retry: Vec<usize>,
    requests: u64,
}
