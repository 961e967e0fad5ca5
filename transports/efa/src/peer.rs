//! A connected peer segment: its addresses in each rail's AV, its buffers' keys, and the planner
//! that turns one submitted batch into one job per rail.
//!
//! Planning is per batch: one read lock of the region table, one allocation per rail for the
//! fragments, one per batch for the per-request fragment counters; nothing per fragment.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use te_base::notify::{encode_body, Refusal};
use te_base::{
    BatchAborts, BatchState, Error, Notification, Peer, ResolvedRequest, Result, SegmentDescriptor, SubmitContext,
};

use crate::fabric::{Rail, TRANSPORT};
use crate::inner::Inner;
use crate::link::PeerLink;
use crate::mailbox::NoteJob;
use crate::registry::LocalRegion;
use crate::wire::{BufferKeys, EndpointInfo};
use crate::worker::{BatchPlan, Fragment, RailJob};

/// Requests striped across rails are cut at multiples of this (page) size.
const STRIPE_ALIGN: u64 = 4096;

/// A peer's exported memory as this transport needs it.
struct RemoteBuffers {
    virt_addr: bool,
    rails: usize,
    /// `keys[buffer * rails + remote rail]` (0 where the buffer is not on that rail).
    keys: Vec<u64>,
    /// Per buffer: our rails that can reach it (bit r: the peer rail paired with our rail r holds
    /// the buffer). 0 when the buffer carries no efa keys.
    reach: Vec<u64>,
}

/// A connected peer.
pub(crate) struct FabricPeer {
    descriptor: SegmentDescriptor,
    link: Arc<PeerLink>,
    remote: RemoteBuffers,
    inner: Arc<Inner>,
    next_rail: AtomicUsize,
    /// Largest notification payload the peer accepts (`None`: it accepts none over efa).
    notify_max: Option<usize>,
}

impl FabricPeer {
    /// Inserts the peer's rail addresses into our AVs and parses its buffers' keys.
    pub(crate) fn connect(inner: Arc<Inner>, descriptor: &SegmentDescriptor) -> Result<FabricPeer> {
        descriptor.validate()?;
        let name = &descriptor.name;
        let info = descriptor.endpoint(TRANSPORT).ok_or_else(|| Error::NoTransport {
            segment: name.clone(),
            reason: "the segment does not advertise the efa transport".into(),
        })?;
        let ep = EndpointInfo::parse(name, info)?;
        if ep.provider != inner.provider {
            return Err(Error::NoTransport {
                segment: name.clone(),
                reason: format!(
                    "it uses libfabric provider '{}', this engine '{}'",
                    ep.provider, inner.provider
                ),
            });
        }
        let rails: Vec<Arc<Rail>> = inner.workers.iter().map(|w| w.rail().clone()).collect();
        let mut dests = Vec::with_capacity(rails.len());
        for (i, rail) in rails.iter().enumerate() {
            let addr = &ep.addrs[i % ep.addrs.len()];
            // Providers read as many bytes as their address format needs: hand them a zero-padded
            // copy so a short (hostile) address cannot make them read past our buffer.
            let mut padded = vec![0u8; addr.len().max(rail.address.len()).max(256)];
            padded[..addr.len()].copy_from_slice(addr);
            match rail.av_acquire(&padded) {
                Ok(d) => dests.push(d),
                Err(e) => {
                    for (r, &d) in rails.iter().zip(&dests) {
                        r.av_release(d);
                    }
                    return Err(Error::transport(
                        TRANSPORT,
                        format!("connecting to segment '{name}': {e}"),
                    ));
                }
            }
        }
        let n = ep.addrs.len();
        let mut keys = vec![0u64; descriptor.buffers.len() * n];
        let mut reach = vec![0u64; descriptor.buffers.len()];
        for (b, buf) in descriptor.buffers.iter().enumerate() {
            if let Some(v) = buf.keys.get(TRANSPORT) {
                let k = BufferKeys::parse(name, b, v, n)?;
                for (j, key) in k.iter().enumerate() {
                    keys[b * n + j] = key.unwrap_or(0);
                }
                reach[b] = (0..rails.len())
                    .filter(|r| k[r % n].is_some())
                    .fold(0u64, |m, r| m | (1 << r));
            }
        }
        let link = Arc::new(PeerLink {
            name: name.clone(),
            healthy: AtomicBool::new(true),
            gone_reason: Mutex::new(None),
            aborted: Mutex::new(None),
            cuts: BatchAborts::default(),
            dests,
            rails,
        });
        Ok(FabricPeer {
            descriptor: descriptor.clone(),
            link,
            remote: RemoteBuffers {
                virt_addr: ep.virt_addr,
                rails: n,
                keys,
                reach,
            },
            inner,
            next_rail: AtomicUsize::new(0),
            notify_max: ep.notify_max,
        })
    }

    /// Checks one request against the peer's buffers; the remote address and key base on success.
    fn remote_of(&self, r: &ResolvedRequest) -> Result<u64> {
        let b = r.remote_buffer as usize;
        let Some(buf) = self.descriptor.buffers.get(b) else {
            return Err(Error::OutOfBounds {
                segment: self.descriptor.name.clone(),
                addr: r.remote_addr,
                len: r.len,
            });
        };
        if !buf.contains(r.remote_addr, r.len) {
            return Err(Error::OutOfBounds {
                segment: self.descriptor.name.clone(),
                addr: r.remote_addr,
                len: r.len,
            });
        }
        if self.remote.reach[b] == 0 {
            return Err(Error::Refused {
                peer: self.descriptor.name.clone(),
                reason: format!("buffer {b} at {:#x} carries no efa keys", buf.base),
            });
        }
        Ok(if self.remote.virt_addr {
            r.remote_addr
        } else {
            r.remote_addr - buf.base
        })
    }
}

/// The `k`-th set bit of `mask` (which has more than `k` set bits).
fn nth_rail(mask: u64, k: usize) -> usize {
    if mask.count_ones() as usize == 64 - mask.leading_zeros() as usize {
        return k; // rails 0..n all usable: the common case
    }
    let mut m = mask;
    for _ in 0..k {
        m &= m - 1;
    }
    m.trailing_zeros() as usize
}

/// Calls `f(rail, offset, len)` for each fragment of a request of `len` bytes over the rails in
/// `mask` (non-zero).
fn for_each_fragment(
    len: u64,
    mask: u64,
    first_rail: usize,
    stripe: u64,
    max_frag: u64,
    mut f: impl FnMut(usize, u64, u64),
) {
    let rails = mask.count_ones() as usize;
    let (parts, part_len) = if rails > 1 && len >= stripe {
        let per = len
            .div_ceil(rails as u64)
            .next_multiple_of(STRIPE_ALIGN)
            .max(STRIPE_ALIGN);
        (len.div_ceil(per) as usize, per)
    } else {
        (1, len)
    };
    for p in 0..parts {
        let rail = nth_rail(mask, (first_rail + p) % rails);
        let start = p as u64 * part_len;
        let end = (start + part_len).min(len);
        let mut off = start;
        while off < end {
            let n = (end - off).min(max_frag);
            f(rail, off, n);
            off += n;
        }
    }
}

impl Peer for FabricPeer {
    fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    /// One per rail: libfabric's rxm connects a rail to the peer on its first message, and a
    /// batch's requests start on the rails in turn (`for_each_fragment`), so that many small
    /// reads connect every rail.
    fn lazy_paths(&self) -> usize {
        self.inner.workers.len()
    }

    /// Fails every request outstanding to this peer with `err`, each once the provider holds no
    /// part of it: fragments not yet posted at once, posted ones when their completions come back
    /// or, after a short drain, when the rail resets its endpoint (see `worker::Owner::reap_dead`).
    fn abort(&self, err: Error) -> bool {
        self.link.abort(err);
        for w in &self.inner.workers {
            w.nudge();
        }
        true
    }

    /// Cuts one batch short (its deadline passed), leaving the link and other batches alone: its
    /// fragments not yet posted fail at once; posted ones fail when their completions come back,
    /// or are taken back by resetting the rail's endpoint after a short drain, and the other
    /// batches' fragments lost in that reset are posted again (see `worker::Owner::reap_cut`).
    fn abort_batch(&self, batch: &Arc<BatchState>, err: Error) -> bool {
        self.link.cuts.abort(batch, err);
        for w in &self.inner.workers {
            w.nudge();
        }
        true
    }

    /// A NOTIFY message from our rail 0 to the peer's rail 0 (see [`crate::mailbox`]); the engine
    /// calls it only once the batch it follows completed, and every write completes only when its
    /// bytes are in the target's memory.
    fn notify(&self, note: Notification, done: &Arc<BatchState>, index: usize) -> Result<()> {
        if !self.link.is_healthy() {
            return Err(self.link.gone_error());
        }
        if self.inner.is_closed() {
            return Err(Error::Closed("efa transport".into()));
        }
        let peer = &self.descriptor.name;
        let Some(max) = self.notify_max else {
            return Err(Error::not_available(
                "efa notifications",
                format!(
                    "segment '{peer}' does not advertise efa notifications of version {}",
                    crate::note_wire::VERSION
                ),
            ));
        };
        if note.payload.len() > max {
            return Err(Refusal::TooLarge.into_error(peer, note.payload.len(), max));
        }
        let mut body = Vec::new();
        encode_body(&note.from, &note.payload, &mut body)?;
        let worker = self
            .inner
            .workers
            .first()
            .ok_or_else(|| Error::Closed("efa transport".into()))?;
        worker.enqueue_note(NoteJob {
            body,
            payload_len: note.payload.len(),
            done: done.clone(),
            index,
            link: self.link.clone(),
        });
        Ok(())
    }

    fn submit(&self, requests: Vec<ResolvedRequest>, batch: &Arc<BatchState>, _ctx: &SubmitContext) -> Result<()> {
        if !self.link.is_healthy() {
            return Err(self.link.gone_error());
        }
        if self.inner.is_closed() {
            return Err(Error::Closed("efa transport".into()));
        }
        let rails = self.inner.workers.len();
        let stripe = self.inner.config.stripe_bytes;
        let max_frag = self.inner.max_fragment;
        let first = self.next_rail.fetch_add(1, Ordering::Relaxed);

        // Pass 1: validate, count fragments per request and per rail, collect the regions used.
        let mut per_rail = vec![0usize; rails];
        let fragments_left: Box<[AtomicU32]> = (0..batch.len()).map(|_| AtomicU32::new(0)).collect();
        let mut regions: Vec<Arc<LocalRegion>> = Vec::new();
        let mut rejected = 0usize;
        let resolved: Vec<Option<(u64, usize, u64)>> = self.inner.regions.with(|table| {
            requests
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let idx = r.index as usize;
                    let local = match table.get(&r.local_region) {
                        Some(l) if l.info.contains(r.local_addr, r.len) => l,
                        _ => {
                            batch.fail(
                                idx,
                                Error::Unregistered {
                                    addr: r.local_addr,
                                    len: r.len,
                                },
                            );
                            rejected += 1;
                            return None;
                        }
                    };
                    let remote = match self.remote_of(r) {
                        Ok(a) => a,
                        Err(e) => {
                            batch.fail(idx, e);
                            rejected += 1;
                            return None;
                        }
                    };
                    let mask = local.usable & self.remote.reach[r.remote_buffer as usize];
                    if mask == 0 {
                        batch.fail(
                            idx,
                            Error::Refused {
                                peer: self.descriptor.name.clone(),
                                reason: format!(
                                    "no rail holds both local region {:#x} and remote buffer {}",
                                    local.info.base, r.remote_buffer
                                ),
                            },
                        );
                        rejected += 1;
                        return None;
                    }
                    let same = matches!(regions.last(), Some(l) if Arc::ptr_eq(l, local));
                    if !same {
                        regions.push(local.clone());
                    }
                    let region_index = regions.len() - 1;
                    let mut n = 0u32;
                    for_each_fragment(r.len, mask, first + i, stripe, max_frag, |rail, _, _| {
                        per_rail[rail] += 1;
                        n += 1;
                    });
                    if let Some(c) = fragments_left.get(idx) {
                        c.store(n, Ordering::Relaxed);
                    }
                    Some((remote, region_index, mask))
                })
                .collect()
        });
        if rejected == requests.len() {
            return Ok(());
        }

        let plan = Arc::new(BatchPlan {
            batch: batch.clone(),
            peer: self.link.clone(),
            fragments_left,
            regions,
            errors: Mutex::new(HashMap::new()),
            has_errors: AtomicBool::new(false),
        });

        // Pass 2: build one fragment list per rail with exact capacity.
        let mut lists: Vec<Vec<Fragment>> = per_rail.iter().map(|&n| Vec::with_capacity(n)).collect();
        let n_remote = self.remote.rails;
        for (i, (r, res)) in requests.iter().zip(&resolved).enumerate() {
            let Some((remote, region_index, mask)) = *res else {
                continue;
            };
            let region = &plan.regions[region_index];
            let b = r.remote_buffer as usize;
            for_each_fragment(r.len, mask, first + i, stripe, max_frag, |rail, off, len| {
                lists[rail].push(Fragment {
                    request: r.index,
                    op: r.op,
                    local: r.local_addr + off,
                    len,
                    desc: region.desc(rail),
                    remote: remote + off,
                    rkey: self.remote.keys[b * n_remote + rail % n_remote],
                    dest: self.link.dests[rail],
                });
            });
        }
        for (rail, list) in lists.into_iter().enumerate() {
            if !list.is_empty() {
                self.inner.workers[rail].enqueue(RailJob::new(plan.clone(), list.into_iter()));
            }
        }
        Ok(())
    }

    fn is_healthy(&self) -> bool {
        self.link.is_healthy()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frags(len: u64, rails: usize, stripe: u64, max: u64) -> Vec<(usize, u64, u64)> {
        let mut v = vec![];
        let mask = if rails == 64 { u64::MAX } else { (1u64 << rails) - 1 };
        for_each_fragment(len, mask, 0, stripe, max, |r, o, l| v.push((r, o, l)));
        v
    }

    #[test]
    fn partial_rail_sets_use_only_their_rails() {
        let mut used = std::collections::BTreeSet::new();
        for_each_fragment(16 << 20, 0b1010_0100, 0, 1 << 20, 1 << 20, |r, _, _| {
            used.insert(r);
        });
        assert_eq!(used.into_iter().collect::<Vec<_>>(), vec![2, 5, 7]);
        assert_eq!(nth_rail(0b111, 2), 2);
        assert_eq!(nth_rail(0b1000_0001, 1), 7);
        assert_eq!(nth_rail(u64::MAX, 63), 63);
    }

    #[test]
    fn fragments_cover_the_request_exactly() {
        for (len, rails, stripe, max) in [
            (1u64, 1usize, 1u64 << 20, u64::MAX),
            (10 << 20, 1, 1 << 20, 1 << 20),
            (10 << 20, 4, 1 << 20, u64::MAX),
            ((10 << 20) + 123, 3, 1 << 20, 300_000),
            (5000, 4, 4096, 1000),
            (100, 32, 1, u64::MAX),
        ] {
            let v = frags(len, rails, stripe, max);
            let mut off = 0;
            for &(r, o, l) in &v {
                assert!(r < rails && l > 0 && l <= max);
                assert_eq!(o, off, "{len} {rails} {stripe} {max}: {v:?}");
                off += l;
            }
            assert_eq!(off, len);
        }
        // Striping spreads a large request over every rail.
        let used: std::collections::BTreeSet<usize> =
            frags(8 << 20, 4, 1 << 20, u64::MAX).iter().map(|f| f.0).collect();
        assert_eq!(used.len(), 4);
    }
}
