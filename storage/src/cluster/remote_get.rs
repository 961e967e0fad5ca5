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

use te_base::SegmentId;
use te_core::TransferRequest;

use super::conn::Conn;
use super::wire::{self, Op, Place};
use super::Cluster;
use crate::error::StoreError;
use crate::range_map::{map_range, Extent};
use crate::store::{RangedGet, Store};

/// One owner's share of a call.
struct OwnerWork {
    owner: Arc<str>,
    addr: SocketAddr,
    /// Indices (into the call's items) of the keys it owns.
    keys: Vec<usize>,
}

/// What RESOLVE brought back from one owner.
struct Resolved {
    conn: Conn,
    lease: u64,
    places: Vec<Place>,
    segment: SegmentId,
    control_bytes: u64,
}

fn remote_err(key: &str, peer: &str, reason: impl std::fmt::Display) -> StoreError {
    StoreError::Remote {
        key: key.to_owned(),
        peer: peer.to_owned(),
        reason: reason.to_string(),
    }
}

/// Totals of one call.
#[derive(Default)]
pub(crate) struct RemoteOutcome {
    pub(crate) hits: u64,
    pub(crate) bytes: u64,
}

impl Cluster {
    /// Reads `missed` keys of `items` from their owners. Per key, sets `errors[k]` on failure or
    /// pushes `k` to `hits` when its bytes were delivered and validated.
    pub(crate) fn get_remote(
        self: &Arc<Self>,
        store: &Store,
        items: &[RangedGet<'_>],
        missed: &[usize],
        errors: &mut [Option<StoreError>],
        hits: &mut Vec<usize>,
    ) -> RemoteOutcome {
        let mut out = RemoteOutcome::default();
        if missed.is_empty() || !self.dir.is_live() {
            return out;
        }
        let owners = self.dir.owners(missed.iter().map(|&k| items[k].key));
        let mut work: Vec<OwnerWork> = Vec::new();
        for (&k, o) in missed.iter().zip(owners) {
            let Some((owner, addr)) = o else { continue };
            match work.iter_mut().find(|w| w.owner == owner) {
                Some(w) => w.keys.push(k),
                None => work.push(OwnerWork {
                    owner,
                    addr,
                    keys: vec![k],
                }),
            }
        }
        if work.is_empty() {
            return out;
        }

        // RESOLVE at every owner at once (and open its segment the first time).
        let timeout = self.cfg.timeout;
        let futs: Vec<_> = work
            .iter()
            .map(|w| {
                let body = wire::encode_resolve(w.keys.iter().map(|&k| (items[k].key, items[k].ranges)));
                let (me, owner, addr) = (self.clone(), w.owner.clone(), w.addr);
                let engine = store.engine().clone();
                async move { me.resolve_at(engine, owner, addr, body).await }
            })
            .collect();
        let resolved = self.run_all(futs, timeout * 2);

        // One engine batch per owner, all submitted before any is waited on.
        let mut batches = Vec::with_capacity(work.len());
        for (w, r) in work.iter().zip(resolved) {
            let r = match r {
                Some(Ok(r)) => r,
                failed => {
                    let why = match failed {
                        Some(Err(e)) => e,
                        _ => format!("no answer within {} ms", (timeout * 2).as_millis()),
                    };
                    self.forget(&w.owner);
                    for &k in &w.keys {
                        errors[k] = Some(remote_err(items[k].key, &w.owner, &why));
                    }
                    batches.push(None);
                    continue;
                }
            };
            batches.push(Some(self.submit_owner(store, items, w, r, errors)));
        }

        // Wait for each owner's batch, then VALIDATE what was read.
        let mut validations = Vec::new();
        let mut validated_keys: Vec<(usize, Vec<(usize, u64)>)> = Vec::new();
        for (wi, b) in batches.into_iter().enumerate() {
            let Some(sub) = b else { continue };
            let w = &work[wi];
            let SubmitState {
                r,
                batch,
                owner_of_request,
                read,
                requests,
            } = sub;
            if let Some(batch) = batch {
                match batch.wait_blocking(Some(timeout)) {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        self.forget(&w.owner);
                        for (i, err) in e.failures {
                            let k = owner_of_request[i] as usize;
                            if errors[k].is_none() {
                                errors[k] = Some(remote_err(items[k].key, &w.owner, err));
                            }
                        }
                    }
                    None => {
                        batch.cancel();
                        self.forget(&w.owner);
                        for &(k, _) in &read {
                            errors[k].get_or_insert_with(|| {
                                remote_err(
                                    items[k].key,
                                    &w.owner,
                                    format!("read not done within {} ms", timeout.as_millis()),
                                )
                            });
                        }
                    }
                }
            }
            self.counters.remote_requests.fetch_add(requests, Ordering::Relaxed);
            let checked: Vec<(usize, u64)> = read.into_iter().filter(|&(k, _)| errors[k].is_none()).collect();
            let body = wire::encode_validate(r.lease, checked.iter().map(|&(k, g)| (items[k].key, g)));
            let me = self.clone();
            let owner = w.owner.clone();
            let Resolved {
                conn, control_bytes, ..
            } = r;
            self.counters.control_bytes.fetch_add(control_bytes, Ordering::Relaxed);
            validations.push(async move { me.validate_at(owner, conn, body).await });
            validated_keys.push((wi, checked));
        }
        let verdicts = self.run_all(validations, timeout * 2);
        let mut stale = 0u64;
        for ((wi, checked), v) in validated_keys.into_iter().zip(verdicts) {
            let w = &work[wi];
            match v {
                Some(Ok(ok)) if ok.len() == checked.len() => {
                    for (&(k, _), good) in checked.iter().zip(ok) {
                        if good {
                            hits.push(k);
                            out.hits += 1;
                            out.bytes += items[k].ranges.iter().map(|r| r.len).sum::<u64>();
                        } else {
                            // The object moved or changed while it was read: a miss, not data.
                            stale += 1;
                            errors[k] = Some(StoreError::NotFound {
                                key: items[k].key.to_owned(),
                            });
                        }
                    }
                }
                other => {
                    let why = match other {
                        Some(Err(e)) => e,
                        Some(Ok(_)) => "VALIDATE answered the wrong number of keys".into(),
                        None => format!("VALIDATE not answered within {} ms", (timeout * 2).as_millis()),
                    };
                    self.forget(&w.owner);
                    for &(k, _) in &checked {
                        errors[k] = Some(remote_err(items[k].key, &w.owner, &why));
                    }
                }
            }
        }
        let c = &self.counters;
        c.remote_hits.fetch_add(out.hits, Ordering::Relaxed);
        c.remote_bytes.fetch_add(out.bytes, Ordering::Relaxed);
        c.stale.fetch_add(stale, Ordering::Relaxed);
        let failed = missed
            .iter()
            .filter(|&&k| matches!(errors[k], Some(StoreError::Remote { .. })))
            .count();
        c.remote_errors.fetch_add(failed as u64, Ordering::Relaxed);
        out
    }

    /// Builds and submits one owner's batch from its places; keys that cannot be read get their
    /// error now.
    fn submit_owner(
        &self,
        store: &Store,
        items: &[RangedGet<'_>],
        w: &OwnerWork,
        r: Resolved,
        errors: &mut [Option<StoreError>],
    ) -> SubmitState {
        let n: usize = w.keys.iter().map(|&k| items[k].ranges.len()).sum();
        let mut requests: Vec<TransferRequest> = Vec::with_capacity(n);
        let mut owner_of_request: Vec<u32> = Vec::with_capacity(n);
        let mut read: Vec<(usize, u64)> = Vec::with_capacity(w.keys.len());
        let mut extents: Vec<Extent> = Vec::new();
        let seg = r.segment;
        if r.places.len() != w.keys.len() {
            for &k in &w.keys {
                errors[k] = Some(remote_err(
                    items[k].key,
                    &w.owner,
                    "RESOLVE answered the wrong number of keys",
                ));
            }
            return SubmitState::empty(r);
        }
        for (&k, place) in w.keys.iter().zip(&r.places) {
            let it = &items[k];
            let (object_len, generation) = match place {
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
            match place {
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
            read.push((k, generation));
        }
        let count = requests.len() as u64;
        let batch = if requests.is_empty() {
            None
        } else {
            match store.engine().submit(&requests) {
                Ok(b) => Some(b),
                Err(e) => {
                    for &(k, _) in &read {
                        errors[k] = Some(remote_err(items[k].key, &w.owner, &e));
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
        }
    }

    async fn resolve_at(
        self: Arc<Self>,
        engine: te_core::TransferEngine,
        owner: Arc<str>,
        addr: SocketAddr,
        body: Vec<u8>,
    ) -> Result<Resolved, String> {
        let mut conn = match self.take_conn(&owner) {
            Some(c) => c,
            None => Conn::connect(addr, self.cfg.auth.as_ref(), self.cfg.timeout)
                .await
                .map_err(|e| format!("control connection: {e}"))?,
        };
        let segment = match self.segment(&owner) {
            Some(s) => s,
            None => {
                let s = tokio::time::timeout(self.cfg.timeout, engine.open_segment(&owner))
                    .await
                    .map_err(|_| "opening its segment timed out".to_string())?
                    .map_err(|e| format!("opening its segment: {e}"))?
                    .id();
                self.remember_segment(owner.clone(), s);
                s
            }
        };
        let sent = body.len() + wire::HEAD;
        let (op, answer) = conn.call(Op::Resolve, &body).await.map_err(|e| e.to_string())?;
        let control_bytes = (sent + wire::HEAD + answer.len()) as u64;
        if op != Op::Places {
            return Err(format!("RESOLVE answered {op:?}: {}", String::from_utf8_lossy(&answer)));
        }
        let (lease, places) = wire::decode_places(&answer).map_err(|e| format!("malformed PLACES: {e}"))?;
        Ok(Resolved {
            conn,
            lease,
            places,
            segment,
            control_bytes,
        })
    }

    async fn validate_at(self: Arc<Self>, owner: Arc<str>, mut conn: Conn, body: Vec<u8>) -> Result<Vec<bool>, String> {
        let (op, answer) = conn.call(Op::Validate, &body).await.map_err(|e| e.to_string())?;
        self.counters
            .control_bytes
            .fetch_add((2 * wire::HEAD + body.len() + answer.len()) as u64, Ordering::Relaxed);
        if op != Op::Verdicts {
            return Err(format!("VALIDATE answered {op:?}"));
        }
        let v = wire::decode_verdicts(&answer).map_err(|e| format!("malformed VERDICTS: {e}"))?;
        self.put_conn(owner, conn);
        Ok(v)
    }
}

/// One owner's submitted batch and what it covers.
struct SubmitState {
    r: Resolved,
    batch: Option<te_core::Batch>,
    owner_of_request: Vec<u32>,
    /// `(key index, generation)` of every key whose ranges are in the batch.
    read: Vec<(usize, u64)>,
    requests: u64,
}

impl SubmitState {
    fn empty(r: Resolved) -> Self {
        SubmitState {
            r,
            batch: None,
            owner_of_request: Vec::new(),
            read: Vec::new(),
            requests: 0,
        }
    }
}
