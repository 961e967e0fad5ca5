//! The miss path of a ranged get: keys this peer does not hold are read from their owners.
//!
//! Per call: one directory lookup for the missed keys (one read lock), then per owner, all owners
//! at once: RESOLVE over a pooled control connection; one engine batch reading exactly the
//! requested spans from the owner's exported memory into the caller's registered buffers;
//! VALIDATE, which also releases any staging lease. A key whose placement changed while it was
//! read is a miss (`NotFound`), never data; an owner that fails or does not answer within the
//! cluster timeout fails only its own keys (`Remote`).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use te_base::{Phase, SegmentId};
use te_core::TransferRequest;

use super::conn::Conn;
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
        self.pass(core, items, missed, true, end, errors, hits, &mut out, &mut retry);
        if !retry.is_empty() {
            for &k in &retry {
                errors[k] = None;
            }
            let mut again = Vec::new();
            self.pass(core, items, &retry, false, end, errors, hits, &mut out, &mut again);
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
    /// owner, VALIDATE. Stale remembered keys go to `retry`.
    #[allow(clippy::too_many_arguments)]
    fn pass(
        &self,
        core: &Core,
        items: &[RangedGet<'_>],
        keys: &[usize],
        use_cache: bool,
        end: Instant,
        errors: &mut [Option<StoreError>],
        hits: &mut Vec<usize>,
        out: &mut RemoteOutcome,
        retry: &mut Vec<usize>,
    ) {
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
        if work.is_empty() {
            return;
        }
        // With the phase report on: resolve = RESOLVE round trips, build + submit = the batches,
        // wait = the reads, other = VALIDATE.
        let timer = &core.timer();
        let t0 = timer.start();

        let timeout = self.cfg.timeout;
        // RESOLVE: sent to every owner before any answer is read, so the owners work at once.
        let mut sent: Vec<Option<(Conn, SegmentId, u64, bool)>> = Vec::with_capacity(work.len());
        // Connections first, all owners at once (a silent owner's handshake holds up no other).
        let live: Vec<bool> = work.iter().map(|w| !self.pool.is_suspect(&w.owner, timeout)).collect();
        let targets: Vec<(&str, SocketAddr)> = work
            .iter()
            .zip(&live)
            .filter(|(_, &l)| l)
            .map(|(w, _)| (&*w.owner, w.addr))
            .collect();
        let mut conns = self.pool.get_many(&targets, end).into_iter();
        for (w, live) in work.iter().zip(live) {
            if !live {
                // It did not answer in time lately: its keys fail now rather than wait again.
                for &k in &w.keys {
                    errors[k] = Some(remote_err(
                        items[k].key,
                        &w.owner,
                        format!(
                            "it did not answer within the last {} ms; passed over",
                            timeout.as_millis()
                        ),
                    ));
                }
                sent.push(None);
                continue;
            }
            let conn = conns
                .next()
                .unwrap_or_else(|| Err(std::io::Error::other("no connection")))
                .map(|(c, _)| c)
                .map_err(|e| self.io_failure(&w.owner, "control connection", e));
            let r = self.segment_for(core, &w.owner, end).and_then(|seg| {
                let mut conn = conn?;
                let fresh = w.keys.iter().zip(&w.cached).filter(|(_, c)| c.is_none());
                if fresh.clone().next().is_none() {
                    return Ok((conn, seg, 0, false));
                }
                let body = wire::encode_resolve(
                    fresh
                        .map(|(&k, _)| (items[k].key, items[k].ranges))
                        .collect::<Vec<_>>()
                        .into_iter(),
                );
                conn.send(Op::Resolve, &body)
                    .map_err(|e| self.io_failure(&w.owner, "sending RESOLVE", e))?;
                Ok((conn, seg, (body.len() + wire::HEAD) as u64, true))
            });
            sent.push(self.keep_or_fail(r, w, items, errors));
        }
        let mut batches: Vec<Option<SubmitState>> = Vec::with_capacity(work.len());
        let mut t1 = t0;
        for (w, s) in work.iter().zip(sent) {
            let resolved = s.map(|(mut conn, segment, out_bytes, asked)| {
                let (mut lease, mut fresh, mut in_bytes) = (0, Vec::new().into_iter(), 0);
                if asked {
                    let (op, answer) = conn
                        .recv()
                        .map_err(|e| self.io_failure(&w.owner, "reading PLACES", e))?;
                    if op != Op::Places {
                        return Err(format!("RESOLVE answered {op:?}"));
                    }
                    let (l, places) = wire::decode_places(&answer).map_err(|e| format!("malformed PLACES: {e}"))?;
                    if places.len() != w.cached.iter().filter(|c| c.is_none()).count() {
                        return Err("RESOLVE answered the wrong number of keys".into());
                    }
                    (lease, fresh, in_bytes) = (l, places.into_iter(), wire::HEAD + answer.len());
                }
                let places = w
                    .cached
                    .iter()
                    .map(|c| {
                        c.clone()
                            .unwrap_or_else(|| Arc::new(fresh.next().unwrap_or(Place::Missing)))
                    })
                    .collect();
                Ok(Resolved {
                    conn,
                    lease,
                    places,
                    segment,
                    control_bytes: out_bytes + in_bytes as u64,
                })
            });
            t1 = timer.lap(Phase::Resolve, t1);
            // One engine batch per owner, all submitted before any is waited on.
            batches.push(match resolved {
                Some(r) => self
                    .keep_or_fail(r, w, items, errors)
                    .map(|r| self.submit_owner(core, items, w, r, errors)),
                None => None,
            });
        }

        let t2 = timer.lap(Phase::Submit, t1);
        // Wait for each owner's batch, then VALIDATE what was read (sent to all, then read).
        let mut validating: Vec<(usize, Vec<ReadKey>, Conn, u64)> = Vec::new();
        for (wi, b) in batches.into_iter().enumerate() {
            let Some(sub) = b else { continue };
            let w = &work[wi];
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
                retry.extend(again);
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
                                retry.push(k);
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
                        continue;
                    }
                }
            }
            self.counters.remote_requests.fetch_add(requests, Ordering::Relaxed);
            let checked: Vec<ReadKey> = read.into_iter().filter(|x| errors[x.k].is_none()).collect();
            if checked.is_empty() && r.lease == 0 {
                // Nothing to check and nothing to release.
                self.put_conn(w.owner.clone(), r.conn);
                continue;
            }
            let body = wire::encode_validate(r.lease, checked.iter().map(|x| (items[x.k].key, x.generation)));
            let Resolved {
                mut conn,
                control_bytes,
                ..
            } = r;
            match conn.send(Op::Validate, &body) {
                Ok(()) => validating.push((wi, checked, conn, control_bytes + (body.len() + wire::HEAD) as u64)),
                Err(e) => {
                    let e = self.io_failure(&w.owner, "sending VALIDATE", e);
                    self.forget(&w.owner);
                    for x in &checked {
                        errors[x.k] = Some(remote_err(items[x.k].key, &w.owner, &e));
                    }
                }
            }
        }
        let t3 = timer.lap(Phase::Wait, t2);
        let mut stale = 0u64;
        let mut control = 0u64;
        for (wi, checked, mut conn, bytes) in validating {
            let w = &work[wi];
            let verdicts = conn
                .recv()
                .map_err(|e| self.io_failure(&w.owner, "reading VERDICTS", e))
                .and_then(|(op, a)| {
                    control += bytes + (wire::HEAD + a.len()) as u64;
                    match op {
                        Op::Verdicts => wire::decode_verdicts(&a).map_err(|e| format!("malformed VERDICTS: {e}")),
                        other => Err(format!("VALIDATE answered {other:?}")),
                    }
                });
            match verdicts {
                Ok(ok) if ok.len() == checked.len() => {
                    self.put_conn(w.owner.clone(), conn);
                    let mut placements = self.placements.write();
                    for (x, good) in checked.into_iter().zip(ok) {
                        let key = items[x.k].key;
                        if good {
                            hits.push(x.k);
                            out.hits += 1;
                            out.bytes += items[x.k].ranges.iter().map(|r| r.len).sum::<u64>();
                            if !x.cached && matches!(*x.place, Place::Dram { .. }) {
                                if placements.len() >= MAX_PLACEMENTS {
                                    placements.clear();
                                }
                                placements.insert(key.to_owned(), (w.owner.clone(), x.place));
                            }
                        } else if x.cached {
                            // The remembered placement is gone: resolve the key afresh.
                            placements.remove(key);
                            retry.push(x.k);
                        } else {
                            // The object moved or changed while it was read: a miss, not data.
                            stale += 1;
                            errors[x.k] = Some(StoreError::NotFound { key: key.to_owned() });
                        }
                    }
                }
                other => {
                    let why = match other {
                        Err(e) => e,
                        Ok(_) => "VALIDATE answered the wrong number of keys".into(),
                    };
                    self.forget(&w.owner);
                    for x in &checked {
                        errors[x.k] = Some(remote_err(items[x.k].key, &w.owner, &why));
                    }
                }
            }
        }
        self.counters.control_bytes.fetch_add(control, Ordering::Relaxed);
        self.counters.stale.fetch_add(stale, Ordering::Relaxed);
        timer.lap(Phase::Other, t3);
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
        r: Result<T, String>,
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
    pub(crate) fn conn_to(&self, owner: &Arc<str>, addr: SocketAddr, end: Instant) -> Result<Conn, String> {
        self.pool
            .get(owner, addr, end)
            .map(|(c, _)| c)
            .map_err(|e| self.io_failure(owner, "control connection", e))
    }

    /// Describes a failed control round trip with `owner`; one that timed out marks it suspect
    /// (the next calls pass it over at once instead of waiting again).
    pub(crate) fn io_failure(&self, owner: &Arc<str>, what: &str, e: std::io::Error) -> String {
        if e.kind() == std::io::ErrorKind::TimedOut {
            self.pool.suspect(owner);
        }
        format!("{what}: {e}")
    }

    /// `owner`'s engine segment, opened (on the control runtime, by `end`) the first time.
    pub(crate) fn segment_for(&self, core: &Core, owner: &Arc<str>, end: Instant) -> Result<SegmentId, String> {
        if let Some(s) = self.segment(owner) {
            return Ok(s);
        }
        let (engine, name) = (core.engine().clone(), owner.to_string());
        let opened = self.run(
            async move { engine.open_segment(&name).await.map(|h| h.id()) },
            end.saturating_duration_since(Instant::now()),
        );
        let s = opened
            .ok_or_else(|| "opening its segment timed out".to_string())?
            .map_err(|e| format!("opening its segment: {e}"))?;
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
