//! The overflow path of a put: objects local DRAM cannot hold go to the live peer that announced
//! the most free DRAM (membership carries it, refreshed every keep-alive period).
//!
//! ALLOCATE (control round trip: the owner reserves arena space, invisible to readers, and says
//! where), one engine batch writing the caller's ranges straight into those extents, then COMMIT
//! (the owner publishes the objects and writes them to the directory before answering). A
//! reservation the writer never commits is freed by the owner at its deadline. Objects that could
//! not be placed remotely are left to the local path (SSD, or `NoSpace`).

use std::sync::Arc;

use te_core::TransferRequest;

use super::request_error::{RequestError, PLACES, VERDICTS};
use super::wire::{self, Op, Place};
use super::Cluster;
use crate::core::{Core, RangedPut};
use crate::range_map::{map_range, Extent};

impl Cluster {
    /// Stores `keys` of `items` on another peer; returns those stored there.
    pub(crate) fn put_remote(&self, core: &Core, items: &[RangedPut<'_>], keys: &[usize]) -> Vec<usize> {
        if keys.is_empty() || !self.dir.is_live() {
            return Vec::new();
        }
        let need: u64 = keys.iter().map(|&k| items[k].object_len).sum();
        self.forget_restarted();
        let Some((owner, addr)) = self.dir.roomiest_peer(need) else {
            return Vec::new();
        };
        match self.put_at(core, items, keys, &owner, addr) {
            Ok(stored) => stored,
            Err(e) => {
                tracing::warn!("umbp cluster: remote put on {owner} failed: {e}");
                self.forget(&owner);
                Vec::new()
            }
        }
    }

    fn put_at(
        &self,
        core: &Core,
        items: &[RangedPut<'_>],
        keys: &[usize],
        owner: &Arc<str>,
        addr: std::net::SocketAddr,
    ) -> Result<Vec<usize>, RequestError> {
        // One deadline for the whole remote put: ALLOCATE, the writes and COMMIT.
        let end = std::time::Instant::now() + self.cfg.timeout;
        let seg = self.segment_for(core, owner, end)?;
        let mut conn = self.conn_to(owner, addr, end)?;
        let objs: Vec<(&str, u64, u32)> = keys
            .iter()
            .map(|&k| (items[k].key, items[k].object_len, items[k].depth))
            .collect();
        conn.send(Op::Allocate, &wire::encode_allocate(objs.into_iter()))
            .map_err(|e| self.io_failure(owner, "sending ALLOCATE", e))?;
        let (op, answer) = conn
            .recv()
            .map_err(|e| self.io_failure(owner, "reading its answer", e))?;
        let (_, places) = RequestError::decode("ALLOCATE", PLACES, op, &answer, wire::decode_places)?;
        if places.len() != keys.len() {
            return Err(RequestError::WrongCount { request: "ALLOCATE" });
        }
        let n: usize = keys.iter().map(|&k| items[k].ranges.len()).sum();
        let mut requests = Vec::with_capacity(n);
        let mut owner_of_request: Vec<usize> = Vec::with_capacity(n);
        let mut placed: Vec<(usize, usize, u64)> = Vec::with_capacity(keys.len());
        let mut extents: Vec<Extent> = Vec::new();
        for (j, (&k, p)) in keys.iter().zip(&places).enumerate() {
            let Place::Dram {
                object_len,
                generation,
                extents: ex,
            } = p
            else {
                continue;
            };
            extents.clear();
            extents.extend(ex.iter().map(|&(addr, len)| Extent { addr, len }));
            if *object_len != items[k].object_len || extents.iter().map(|e| e.len).sum::<u64>() < *object_len {
                continue;
            }
            for r in items[k].ranges {
                map_range(&extents, r, |remote, caller, len| {
                    requests.push(TransferRequest::write(caller, seg, remote, len));
                    owner_of_request.push(j);
                });
            }
            placed.push((j, k, *generation));
        }
        let mut failed = vec![false; keys.len()];
        if !requests.is_empty() {
            let batch = core.engine().submit(&requests).map_err(|source| RequestError::Engine {
                what: "writing",
                source,
            })?;
            match batch.wait_blocking(Some(end.saturating_duration_since(std::time::Instant::now()))) {
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    for (i, _) in e.failures {
                        failed[owner_of_request[i]] = true;
                    }
                }
                None => {
                    batch.cancel();
                    return Err(RequestError::timed_out("writing"));
                }
            }
        }
        let done: Vec<(usize, u64)> = placed
            .into_iter()
            .filter(|&(j, _, _)| !failed[j])
            .map(|(_, k, g)| (k, g))
            .collect();
        let body = wire::encode_validate(0, done.iter().map(|&(k, g)| (items[k].key, g)));
        conn.send(Op::Commit, &body)
            .map_err(|e| self.io_failure(owner, "sending COMMIT", e))?;
        let (op, answer) = conn
            .recv()
            .map_err(|e| self.io_failure(owner, "reading its answer", e))?;
        let ok = RequestError::decode("COMMIT", VERDICTS, op, &answer, wire::decode_verdicts)?;
        if ok.len() != done.len() {
            return Err(RequestError::WrongCount { request: "COMMIT" });
        }
        self.put_conn(owner.clone(), conn);
        Ok(done
            .iter()
            .zip(ok)
            .filter(|(_, ok)| *ok)
            .map(|(&(k, _), _)| k)
            .collect())
    }
}
