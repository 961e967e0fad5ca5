//! A connected peer: its QP slots (per rail pair, `TE_RDMA_QPS_PER_PEER` each), the data path
//! that cuts a batch into work requests, what happens when a QP fails, and the peer's
//! notifications (see [`super::notify`]) and abort (see [`super::abort`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use parking_lot::Mutex;
use te_base::{
    BatchAborts, BatchState, Error, Peer, ResolvedRequest, Result, SegmentDescriptor, SubmitContext, TransferOp,
};
use te_topology::{common_rails, RailRate, Stripe, StripePlanner};

use super::abort::Drain;
use super::notify::{is_note, NoteChannel, NoteJob, MAX_QUEUED_NOTES, NOTE_RECV, NOTE_SEND};
use super::Shared;
use crate::protocol::completion::BatchTracker;
use crate::protocol::handshake::{mtu_offer, ConnectRequest, EndpointInfo, QpOffer, PROTOCOL_VERSION};
use crate::protocol::notify_wire::NotifyParams;
use crate::protocol::qp_state::{connect_transitions, LocalQpEnd, QpMachine, QpState, QpTransition, RemoteQpEnd};
use crate::protocol::recovery::{classify, request_error, Backoff, ErrorClass};
use crate::protocol::remote_keys::{KeyMiss, RemoteKeyTable};
use crate::protocol::send_queue::SendQueue;
use crate::protocol::slicing::{slice, ChunkGrid};
use crate::verbs::{Completion, Opcode, PostError, Verbs, WcStatus, WorkRequest};

/// One RDMA message waiting for, or occupying, a send-queue slot.
pub(crate) struct Piece {
    tracker: Arc<BatchTracker>,
    index: u32,
    opcode: Opcode,
    local_addr: u64,
    len: u32,
    lkey: u32,
    remote_addr: u64,
    rkey: u32,
    attempts: u32,
}

impl Piece {
    /// Fails the request this piece belongs to.
    pub(crate) fn fail(self, err: Error) {
        self.tracker.fail(self.index, err);
    }
}

/// The mutable state of one QP.
pub(crate) struct QpInner<V: Verbs> {
    pub(crate) qp: Option<V::Qp>,
    pub(crate) qpn: u32,
    pub(crate) machine: QpMachine,
    pub(crate) sq: SendQueue<Piece>,
    pub(crate) backoff: Backoff,
    pub(crate) reconnecting: bool,
    scratch: Vec<WorkRequest>,
    /// Slot 0 of a peer that takes notifications: their channel.
    pub(crate) notes: Option<NoteChannel<V>>,
    /// Aborted with work requests in flight: waiting for their completions.
    pub(crate) draining: bool,
}

/// One QP of a connection, between one local and one remote rail.
pub(crate) struct QpSlot<V: Verbs> {
    pub(crate) slot: u32,
    pub(crate) pair: usize,
    /// Local rail (holds the CQ room this QP reserved).
    pub(crate) rail: usize,
    /// CQ entries reserved for this QP (its depth, plus the notification channel's on slot 0).
    pub(crate) cq_room: u32,
    pub(crate) inner: Mutex<QpInner<V>>,
}

/// A local rail joined to a remote rail.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RailPair {
    pub(crate) local: usize,
    pub(crate) remote: usize,
}

/// Everything a connection owns. Its QPs are destroyed when the last `Arc` goes (the `RdmaPeer`
/// and every batch still using it hold one).
pub(crate) struct PeerInner<V: Verbs> {
    pub(crate) shared: Arc<Shared<V>>,
    pub(crate) descriptor: SegmentDescriptor,
    pub(crate) endpoint: EndpointInfo,
    pub(crate) handshake_addr: SocketAddr,
    pub(crate) keys: RemoteKeyTable,
    pub(crate) pairs: Vec<RailPair>,
    /// `pair_of_rail[rail number]`: the index in `pairs` of that rail's pair, if it has one.
    pub(crate) pair_of_rail: Vec<Option<usize>>,
    pub(crate) slots: Vec<Arc<QpSlot<V>>>,
    pub(crate) qps_per_pair: usize,
    pub(crate) rotation: AtomicUsize,
    pub(crate) planner: StripePlanner,
    /// What the target advertises for notifications (`None`: it takes none).
    pub(crate) notify: Option<NotifyParams>,
    /// Notifications handed over and not yet posted, in order (a lock of their own: `notify` runs
    /// in completion hooks, possibly while a slot is locked).
    pub(crate) notes_in: Mutex<VecDeque<NoteJob>>,
    /// Set once by [`Peer::abort`].
    pub(crate) abort: OnceLock<Arc<Drain>>,
    /// Batches cut short by their deadline ([`Peer::abort_batch`]): their pieces are dropped
    /// wherever they come back, never posted again.
    pub(crate) cut_batches: BatchAborts,
}

/// The `Peer` handed to the engine.
pub struct RdmaPeer<V: Verbs> {
    pub(crate) inner: Arc<PeerInner<V>>,
}

impl<V: Verbs> PeerInner<V> {
    fn name(&self) -> &str {
        &self.descriptor.name
    }

    /// A handshake request for `offers`.
    pub(crate) fn request(&self, offers: Vec<QpOffer>) -> ConnectRequest {
        ConnectRequest {
            version: PROTOCOL_VERSION,
            from_segment: self.shared.segment_name.clone(),
            from_instance: self.shared.instance,
            from_claim: crate::protocol::handshake::hex32(&self.shared.claim),
            to_instance: self.endpoint.instance,
            rails: self.shared.rails().rails.iter().map(|r| r.info()).collect(),
            qps: offers,
        }
    }

    /// Moves a fresh (RESET) QP of `slot` to RTS against the target's answer.
    pub(crate) fn bring_up(
        &self,
        slot: &QpSlot<V>,
        inner: &mut QpInner<V>,
        mine: &QpOffer,
        theirs: &QpOffer,
    ) -> Result<()> {
        let pair = self.pairs[slot.pair];
        let rail = &self.shared.rails().rails[pair.local];
        let remote_rail = &self.endpoint.rails[pair.remote];
        let local = LocalQpEnd {
            port: rail.port,
            link_layer: rail.port_attrs.link_layer,
            gid_index: rail.gid_index,
            psn: mine.psn,
            device_max_rd_atomic: rail.attrs.max_qp_rd_atom,
        };
        let remote = RemoteQpEnd {
            qpn: theirs.qpn,
            psn: theirs.psn,
            lid: remote_rail.lid,
            gid: remote_rail.gid()?,
            link_layer: remote_rail.link_layer,
        };
        let qp = inner.qp.as_ref().expect("slot owns a QP");
        for t in connect_transitions(&local, &remote, theirs.mtu, &self.shared.config.connect)? {
            self.shared.verbs.modify_qp(qp, &t)?;
            inner.machine.apply(&t)?;
        }
        if let Some(ch) = &inner.notes {
            ch.post_answer_recvs(&*self.shared.verbs, qp)?;
        }
        Ok(())
    }

    /// The offer of `slot` for a (re)connect, with a fresh PSN.
    pub(crate) fn offer(&self, slot: &QpSlot<V>, qpn: u32) -> QpOffer {
        let pair = self.pairs[slot.pair];
        let rail = &self.shared.rails().rails[pair.local];
        QpOffer {
            slot: slot.slot,
            initiator_rail: pair.local as u16,
            target_rail: pair.remote as u16,
            qpn,
            psn: self.shared.next_psn(),
            mtu: mtu_offer(rail.port_attrs.active_mtu, self.shared.config.connect.mtu_cap),
        }
    }

    /// Hands `pieces` that were on `from` to a healthy sibling QP of the same rail pair (or back
    /// to `from`, to go out once it is re-established). Pieces past the retry limit fail.
    fn requeue(self: &Arc<Self>, from: usize, pieces: Vec<Piece>, status: WcStatus, vendor_err: u32) {
        if pieces.is_empty() {
            return;
        }
        let limit = self.shared.config.retry_limit;
        let pair = self.slots[from].pair;
        let first = pair * self.qps_per_pair;
        let target = (first..first + self.qps_per_pair)
            .filter(|&i| i != from)
            .find(|&i| {
                let s = self.slots[i].inner.lock();
                s.machine.state() == QpState::Rts && !s.sq.is_broken()
            })
            .unwrap_or(from);
        let mut inner = self.slots[target].inner.lock();
        if let Some(drain) = self.abort.get() {
            // Checked under the slot lock: either the abort already took this slot's waiting
            // pieces and these are doomed here, or it takes them after us.
            for p in pieces {
                drain.doom(p);
            }
            return;
        }
        for mut p in pieces {
            // Checked under the slot lock, as the cut takes the slot's waiting pieces under it.
            if let Some(err) = self.cut_batches.error_of(p.tracker.state()) {
                p.tracker.piece_cut(p.index, &err);
                continue;
            }
            p.attempts += 1;
            if p.attempts > limit {
                p.tracker.fail(p.index, request_error(status, vendor_err, self.name()));
            } else {
                inner.sq.push(p);
            }
        }
        if target != from {
            let stranded = self.shared.pump(&mut inner);
            drop(inner);
            self.post_failed(target, stranded);
        }
    }

    /// The provider refused a post on slot `index`: its pieces go elsewhere and the QP is
    /// re-established like after an error completion.
    fn post_failed(self: &Arc<Self>, index: usize, stranded: Vec<Piece>) {
        if stranded.is_empty() {
            return;
        }
        self.slots[index].inner.lock().backoff.on_failure(Instant::now());
        self.requeue(index, stranded, WcStatus::GENERAL_ERR, 0);
        self.shared.broken.lock().push((Arc::downgrade(self), index));
    }

    /// Handles one completion of slot `index`.
    pub(crate) fn on_completion(self: &Arc<Self>, index: usize, c: &Completion, now: Instant) {
        let slot = &self.slots[index];
        let mut inner = slot.inner.lock();
        if let Some(drain) = self.abort.get() {
            self.on_drain_completion(&mut inner, c, drain);
            return;
        }
        if is_note(c.wr_id) {
            self.on_note_completion(index, &mut inner, c, now);
            return;
        }
        let before = inner.sq.in_flight();
        if c.status == WcStatus::SUCCESS {
            inner.sq.on_success(c.wr_id, |p| p.tracker.piece_done(p.index));
            self.shared.retired(before - inner.sq.in_flight());
            let stranded = self.shared.pump(&mut inner);
            drop(inner);
            self.post_failed(index, stranded);
            return;
        }
        let Some(split) = inner.sq.on_error(c.wr_id) else {
            return;
        };
        self.shared.retired(before);
        inner.machine.mark_error();
        inner.backoff.on_failure(now);
        self.fail_notes(&mut inner, c.status);
        drop(inner);
        tracing::debug!(peer = %self.name(), qp = slot.slot, status = c.status.0, "rdma QP failed");
        for p in split.done {
            p.tracker.piece_done(p.index);
        }
        let mut requeue = split.requeue;
        if let Some(p) = split.failed {
            if classify(c.status) == ErrorClass::Transient {
                requeue.push(p);
            } else {
                p.tracker
                    .fail(p.index, request_error(c.status, c.vendor_err, self.name()));
            }
        }
        // Flushed pieces were not at fault: they keep their attempt count.
        self.requeue(index, requeue, WcStatus::RETRY_EXC_ERR, c.vendor_err);
        self.shared.broken.lock().push((Arc::downgrade(self), index));
    }

    /// Re-establishes slot `index` through the handshake (called once per backoff period).
    pub(crate) async fn reestablish(self: Arc<Self>, index: usize) {
        let slot = &self.slots[index];
        let prepared = {
            let mut inner = slot.inner.lock();
            if self.abort.get().is_some() {
                // Aborted since the attempt was claimed: the QP stays down (the abort may even
                // have destroyed it).
                inner.reconnecting = false;
                return;
            }
            let qp = inner.qp.as_ref().expect("slot owns a QP");
            let reset = self.shared.verbs.modify_qp(qp, &QpTransition::ToReset);
            reset
                .and_then(|_| inner.machine.apply(&QpTransition::ToReset))
                .map(|_| {
                    self.shared.retired(inner.sq.in_flight());
                    inner.sq.reset();
                    self.fail_notes(&mut inner, WcStatus::WR_FLUSH_ERR);
                    self.offer(slot, inner.qpn)
                })
        };
        let result = match prepared {
            Ok(offer) => {
                let request = self.request(vec![offer]);
                match super::handshake_io::exchange(
                    self.handshake_addr,
                    self.name(),
                    &request,
                    self.shared.auth.as_ref(),
                )
                .await
                {
                    Ok(resp) => resp
                        .accepted_for(&request, self.endpoint.rails.len())
                        .map(|qps| (offer, qps[0])),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        let mut inner = slot.inner.lock();
        inner.reconnecting = false;
        if let Some(drain) = self.abort.get() {
            // Aborted meanwhile: the QP stays down (RESET: nothing of it runs).
            inner.machine.mark_error();
            for p in inner.sq.drain_all() {
                drain.doom(p);
            }
            return;
        }
        let outcome = result.and_then(|(mine, theirs)| self.bring_up(slot, &mut inner, &mine, &theirs));
        match outcome {
            Ok(()) => {
                inner.backoff.on_success();
                let stranded = self.shared.pump(&mut inner);
                self.pump_notes(&mut inner);
                drop(inner);
                self.post_failed(index, stranded);
            }
            Err(e) => {
                tracing::debug!(peer = %self.name(), qp = slot.slot, "rdma QP re-establishment failed: {e}");
                inner.machine.mark_error();
                inner.backoff.on_failure(Instant::now());
                let stranded = inner.sq.drain_all();
                drop(inner);
                for p in stranded {
                    p.tracker.fail(
                        p.index,
                        Error::PeerGone {
                            peer: self.name().to_string(),
                            reason: format!("QP could not be re-established: {e}"),
                        },
                    );
                }
                self.shared.broken.lock().push((Arc::downgrade(&self), index));
            }
        }
    }

    /// Cuts `requests` into pieces and queues them; returns pieces per slot to pump.
    fn plan(&self, requests: &[ResolvedRequest], tracker: &Arc<BatchTracker>) -> Vec<(usize, Piece)> {
        let shared = &self.shared;
        let chunk = shared.rails().chunk;
        let regions = shared.regions.read();
        let mut out = Vec::with_capacity(requests.len());
        let mut stripes: Vec<Stripe> = Vec::with_capacity(self.pairs.len());
        let mut common: Vec<RailRate> = Vec::with_capacity(self.pairs.len());
        let rotation = self.rotation.fetch_add(1, Ordering::Relaxed);
        let mut rr = rotation;
        for (position, r) in requests.iter().enumerate() {
            let fail = |e: Error| tracker.fail(r.index, e);
            let Some(region) = regions.get(&r.local_region) else {
                fail(Error::Unregistered {
                    addr: r.local_addr,
                    len: r.len,
                });
                continue;
            };
            if !region.info.contains(r.local_addr, r.len) {
                fail(Error::PartlyRegistered {
                    addr: r.local_addr,
                    len: r.len,
                    region_base: region.info.base,
                    region_len: region.info.len,
                });
                continue;
            }
            let remote_grid = match self.keys.grid(r.remote_buffer as usize, r.remote_addr, r.len) {
                Ok(g) => g,
                Err(KeyMiss::NoBuffer | KeyMiss::NoRail) => {
                    fail(Error::Refused {
                        peer: self.name().to_string(),
                        reason: format!("buffer {} is not exported over rdma", r.remote_buffer),
                    });
                    continue;
                }
                Err(KeyMiss::OutOfBounds) => {
                    fail(Error::OutOfBounds {
                        segment: self.name().to_string(),
                        addr: r.remote_addr,
                        len: r.len,
                    });
                    continue;
                }
            };
            let local_grid = ChunkGrid {
                base: region.info.base,
                chunk,
            };
            let opcode = match r.op {
                TransferOp::Write => Opcode::RdmaWrite,
                TransferOp::Read => Opcode::RdmaRead,
            };
            // Only rails holding both buffers (and connected: same link layer) can serve the
            // request; it is striped over them in proportion to the slower side's link rate
            // (equal when unknown), and requests too small to stripe rotate over them.
            let remote_rails = self.keys.rails(r.remote_buffer as usize);
            common_rails(&region.rails, remote_rails, &mut common);
            common.retain(|c| self.pair_of_rail.get(c.rail).is_some_and(Option::is_some));
            if common.is_empty() {
                fail(self.no_common_rail(region, r.remote_buffer, remote_rails));
                continue;
            }
            self.planner
                .plan(r.len, &common, rotation.wrapping_add(position), &mut stripes);
            let start = out.len();
            let mut bad = None;
            for s in &stripes {
                let pair_index = self.pair_of_rail[s.rail].expect("common rails have pairs");
                let pair = self.pairs[pair_index];
                let first_slot = pair_index * self.qps_per_pair;
                let la = r.local_addr + s.offset;
                let ra = r.remote_addr + s.offset;
                slice(la, ra, s.len, shared.slice_size, local_grid, remote_grid, |p| {
                    let local_addr = la + p.offset;
                    let remote_addr = ra + p.offset;
                    let lchunk = ((local_addr - region.info.base) / chunk) as usize;
                    let rkey = match self.keys.rkey(r.remote_buffer as usize, s.rail, remote_addr) {
                        Ok(k) => k,
                        Err(_) => {
                            bad = Some(s.rail);
                            return;
                        }
                    };
                    let slot = first_slot + rr % self.qps_per_pair;
                    rr = rr.wrapping_add(1);
                    out.push((
                        slot,
                        Piece {
                            tracker: tracker.clone(),
                            index: r.index,
                            opcode,
                            local_addr,
                            len: p.len as u32,
                            lkey: region.lkeys[pair.local][lchunk],
                            remote_addr,
                            rkey,
                            attempts: 0,
                        },
                    ));
                });
            }
            if let Some(rail) = bad {
                out.truncate(start);
                fail(Error::Refused {
                    peer: self.name().to_string(),
                    reason: format!("buffer {} has no key for rail {rail}", r.remote_buffer),
                });
                continue;
            }
            tracker.add_pieces(r.index, (out.len() - start) as u32);
        }
        out
    }
}

impl<V: Verbs> PeerInner<V> {
    /// A completion of a notification work request on slot `index` (slot 0).
    fn on_note_completion(self: &Arc<Self>, index: usize, inner: &mut QpInner<V>, c: &Completion, now: Instant) {
        let Some(ch) = inner.notes.as_mut() else { return };
        if !ch.current(c) {
            return; // of a QP incarnation already failed and reset
        }
        let broken = if c.wr_id & NOTE_RECV != 0 {
            if c.status != WcStatus::SUCCESS {
                // Flushed: the QP failed; its send side reports how.
                return;
            }
            let qp = inner.qp.as_ref().expect("slot owns a QP");
            match ch.on_answer(&*self.shared.verbs, qp, c, self.name()) {
                Ok(()) => {
                    self.pump_notes(inner);
                    return;
                }
                Err(why) => {
                    tracing::debug!(peer = %self.name(), "rdma: notification protocol error: {why}");
                    WcStatus::GENERAL_ERR
                }
            }
        } else {
            debug_assert!(c.wr_id & NOTE_SEND != 0);
            if c.status == WcStatus::SUCCESS {
                return; // the answer settles it
            }
            c.status
        };
        self.note_qp_failed(index, inner, broken, now);
    }

    /// The notification channel broke slot `index`'s QP (an error completion of a SEND, an answer
    /// breaking the protocol, a refused post): the QP goes to ERROR (its data work requests are
    /// flushed and handed back by their own completions) and is re-established.
    fn note_qp_failed(self: &Arc<Self>, index: usize, inner: &mut QpInner<V>, status: WcStatus, now: Instant) {
        self.fail_notes(inner, status);
        if inner.machine.state() == QpState::Error {
            return;
        }
        if let Some(qp) = inner.qp.as_ref() {
            let _ = self.shared.verbs.modify_qp(qp, &QpTransition::ToError);
        }
        inner.machine.mark_error();
        inner.backoff.on_failure(now);
        self.shared.broken.lock().push((Arc::downgrade(self), index));
    }

    /// Fails every notification of this slot still waiting for its answer.
    fn fail_notes(&self, inner: &mut QpInner<V>, status: WcStatus) {
        if let Some(ch) = inner.notes.as_mut() {
            ch.fail_outstanding(&Error::PeerGone {
                peer: self.name().to_string(),
                reason: format!(
                    "the connection failed (work completion status {}) before the target answered a \
                     notification; it may or may not have been queued",
                    status.0
                ),
            });
        }
    }

    /// Posts waiting notifications on slot 0 while it is up and has credits. Called with the slot
    /// locked.
    pub(crate) fn pump_notes(self: &Arc<Self>, inner: &mut QpInner<V>) {
        if inner.machine.state() != QpState::Rts || self.abort.get().is_some() {
            return;
        }
        let QpInner { qp, notes, .. } = inner;
        let (Some(qp), Some(ch)) = (qp.as_ref(), notes.as_mut()) else {
            return;
        };
        let posted = ch.pump(
            &*self.shared.verbs,
            qp,
            || self.notes_in.lock().pop_front(),
            |job| self.notes_in.lock().push_front(job),
        );
        if let Err(errno) = posted {
            if errno == libc::ENOMEM {
                return; // send queue full after all: the next completion pumps again
            }
            tracing::warn!(
                "rdma: ibv_post_send (notification): {}",
                std::io::Error::from_raw_os_error(errno)
            );
            self.note_qp_failed(0, inner, WcStatus::GENERAL_ERR, Instant::now());
        }
    }

    /// A completion of slot `index` after the abort: retires what it names; the slot's last one
    /// lets the abort fail what did not complete.
    fn on_drain_completion(&self, inner: &mut QpInner<V>, c: &Completion, drain: &Drain) {
        if is_note(c.wr_id) || !inner.draining {
            return;
        }
        let ok = c.status == WcStatus::SUCCESS;
        let n = inner.sq.retire_through(c.wr_id, |p, named| {
            if ok || !named {
                // RC completes in order: everything before the named request ran to the end.
                p.tracker.piece_done(p.index);
            } else {
                drain.doom(p);
            }
        });
        self.shared.retired(n);
        if inner.sq.in_flight() == 0 {
            inner.draining = false;
            drain.release();
        }
    }

    /// Starts the abort: every QP to ERROR, waiting pieces and notifications collected or failed.
    fn begin_abort(self: &Arc<Self>, err: Error) {
        let drain = Drain::new(err, Instant::now() + self.shared.config.abort_flush_grace);
        if self.abort.set(drain.clone()).is_err() {
            return; // aborted already
        }
        for job in self.notes_in.lock().drain(..) {
            job.fail(drain.err.clone());
        }
        for slot in &self.slots {
            let mut inner = slot.inner.lock();
            if let Some(qp) = inner.qp.as_ref() {
                if matches!(inner.machine.state(), QpState::Rtr | QpState::Rts) {
                    if let Err(e) = self.shared.verbs.modify_qp(qp, &QpTransition::ToError) {
                        // The QP keeps running what it has; the flush grace then destroys it.
                        tracing::warn!(peer = %self.name(), "rdma abort: moving a QP to ERROR: {e}");
                    }
                }
            }
            inner.machine.mark_error();
            if let Some(ch) = inner.notes.as_mut() {
                ch.fail_outstanding(&drain.err);
            }
            for p in inner.sq.take_pending() {
                drain.doom(p);
            }
            if inner.sq.in_flight() > 0 {
                inner.draining = true;
                drain.hold();
            }
        }
        drain.release();
        if !drain.finished() {
            self.shared.aborting.lock().push(Arc::downgrade(self));
            self.shared.wake_progress();
        }
    }

    /// Cuts one batch short (its deadline passed): its pieces never posted are dropped, and each
    /// QP with one of its pieces in flight goes to ERROR, so the device hands every work request
    /// back (flushed); there the batch's pieces are dropped and every other batch's go again, on
    /// a sibling QP or once this one is re-established (the path of any QP failure). A request
    /// of the batch fails with `err` once its last piece is accounted for. False when the whole
    /// connection is being aborted already.
    fn cut_batch(self: &Arc<Self>, batch: &Arc<BatchState>, err: &Error) -> bool {
        if self.abort.get().is_some() {
            return false;
        }
        self.cut_batches.abort(batch, err.clone());
        let mine = |p: &Piece| Arc::ptr_eq(p.tracker.state(), batch);
        let mut flushing = false;
        for slot in &self.slots {
            let mut inner = slot.inner.lock();
            let dropped = inner.sq.take_pending_where(mine);
            if inner.sq.any_in_flight(mine) && matches!(inner.machine.state(), QpState::Rtr | QpState::Rts) {
                flushing = true;
                if let Some(qp) = inner.qp.as_ref() {
                    if let Err(e) = self.shared.verbs.modify_qp(qp, &QpTransition::ToError) {
                        // Its pieces then finish (or fail) on their own; the batch waits for them.
                        tracing::warn!(peer = %self.name(), qp = slot.slot, "rdma: cutting a batch short: moving a QP to ERROR: {e}");
                    }
                }
            }
            drop(inner);
            for p in dropped {
                p.tracker.piece_cut(p.index, err);
            }
        }
        self.shared.wake_progress();
        if flushing {
            // A device that never hands its work requests back (wedged) would keep the batch
            // forever: past the flush grace the whole connection is aborted, whose grace then
            // destroys the QPs.
            let (peer, batch, err) = (Arc::downgrade(self), Arc::downgrade(batch), err.clone());
            let grace = self.shared.config.abort_flush_grace;
            self.shared.runtime.spawn(async move {
                tokio::time::sleep(grace).await;
                let (Some(peer), Some(batch)) = (peer.upgrade(), batch.upgrade()) else { return };
                let stuck = peer.slots.iter().any(|s| {
                    s.inner
                        .lock()
                        .sq
                        .any_in_flight(|p| Arc::ptr_eq(p.tracker.state(), &batch))
                });
                if stuck {
                    tracing::warn!(peer = %peer.name(), "rdma: a cut batch's work requests never came back; aborting the connection");
                    peer.begin_abort(err);
                }
            });
        }
        true
    }

    /// Called by the progress thread: past the flush grace, destroys every QP still draining (no
    /// work request of a destroyed QP runs any more) and lets the abort finish. True when done.
    pub(crate) fn give_up_draining(&self, now: Instant) -> bool {
        let Some(drain) = self.abort.get() else { return true };
        if drain.finished() {
            return true;
        }
        if now < drain.give_up_at {
            return false;
        }
        let mut map = self.shared.qps.write();
        for s in &self.slots {
            let mut inner = s.inner.lock();
            if !inner.draining {
                continue;
            }
            let Some(qp) = inner.qp.take() else { continue };
            if let Err(e) = self.shared.verbs.destroy_qp(qp) {
                // Cannot prove the device is done with the memory: keep it pinned (leaked).
                tracing::error!(peer = %self.name(), "rdma abort: destroying a QP that never flushed: {e}");
                continue;
            }
            tracing::warn!(peer = %self.name(), qp = s.slot, "rdma abort: QP never flushed; destroyed it");
            map.remove(&inner.qpn);
            self.shared.rails().rails[s.rail].release_cq(s.cq_room);
            self.shared.retired(inner.sq.in_flight());
            for p in inner.sq.drain_all() {
                drain.doom(p);
            }
            inner.draining = false;
            drain.release();
        }
        drain.finished()
    }

    /// The error of a request whose two buffers share no connected rail, naming both sides' rails.
    fn no_common_rail(&self, local: &super::LocalRegion<V>, remote_buffer: u32, remote: &[RailRate]) -> Error {
        let rails = self.shared.rails();
        let local_names: Vec<String> = local
            .rails
            .iter()
            .map(|r| match rails.position(r.rail) {
                Some(p) => format!("{} ({})", r.rail, rails.rails[p].name),
                None => r.rail.to_string(),
            })
            .collect();
        let remote_names: Vec<String> = remote
            .iter()
            .map(
                |r| match self.endpoint.rails.iter().find(|i| i.rail as usize == r.rail) {
                    Some(info) => format!("{} ({})", r.rail, info.device),
                    None => r.rail.to_string(),
                },
            )
            .collect();
        Error::Refused {
            peer: self.name().to_string(),
            reason: format!(
                "no common rail: local region {:#x} is on rails [{}], remote buffer {remote_buffer} on rails [{}]",
                local.info.base,
                local_names.join(", "),
                remote_names.join(", ")
            ),
        }
    }
}

impl<V: Verbs> Peer for RdmaPeer<V> {
    fn descriptor(&self) -> &SegmentDescriptor {
        &self.inner.descriptor
    }

    fn submit(&self, requests: Vec<ResolvedRequest>, batch: &Arc<BatchState>, _ctx: &SubmitContext) -> Result<()> {
        if let Some(drain) = self.inner.abort.get() {
            return Err(self.inner.aborted(drain));
        }
        if batch.cancel_requested() {
            for r in &requests {
                batch.cancel(r.index as usize);
            }
            return Ok(());
        }
        let tracker = Arc::new(BatchTracker::new(batch.clone()));
        batch.keep_alive(Box::new(self.inner.clone()));
        let mut pieces = self.inner.plan(&requests, &tracker);
        // Group by slot so each QP is locked once per batch.
        pieces.sort_by_key(|(slot, _)| *slot);
        let mut it = pieces.into_iter().peekable();
        while let Some((slot, first)) = it.next() {
            let mut inner = self.inner.slots[slot].inner.lock();
            inner.sq.push(first);
            while let Some((_, p)) = it.next_if(|(s, _)| *s == slot) {
                inner.sq.push(p);
            }
            let stranded = self.inner.shared.pump(&mut inner);
            drop(inner);
            self.inner.post_failed(slot, stranded);
        }
        self.inner.shared.wake_progress();
        Ok(())
    }

    fn is_healthy(&self) -> bool {
        if self.inner.abort.get().is_some() {
            return false;
        }
        // Unhealthy once every QP failed and its re-establishment kept failing: the engine then
        // reconnects from a fresh descriptor (the peer may have restarted).
        !self.inner.slots.iter().all(|s| {
            let inner = s.inner.lock();
            inner.machine.state() == QpState::Error && inner.backoff.failures() >= 3
        })
    }

    /// Every QP to ERROR; outstanding requests fail with `err` once their flush completions came
    /// back (see [`super::abort`]).
    fn abort(&self, err: Error) -> bool {
        self.inner.begin_abort(err);
        true
    }

    /// Only `batch` (see `PeerInner::cut_batch`): other batches on the connection go on.
    fn abort_batch(&self, batch: &Arc<BatchState>, err: Error) -> bool {
        self.inner.cut_batch(batch, &err)
    }

    /// A SEND on slot 0 after whatever it carries (see [`super::notify`]); the engine calls it
    /// only once the batch it follows completed.
    fn notify(&self, note: te_base::Notification, done: &Arc<BatchState>, index: usize) -> Result<()> {
        let peer = &self.inner;
        let Some(params) = peer.notify else {
            let why = match peer.endpoint.notify {
                None => format!("segment '{}' does not take them over rdma", peer.name()),
                Some(p) => format!(
                    "segment '{}' takes them in a form this build does not speak (format version {}, \
                     {} credits, {} bytes)",
                    peer.name(),
                    p.version,
                    p.credits,
                    p.max_bytes
                ),
            };
            return Err(Error::not_available("rdma notifications", why));
        };
        if let Some(drain) = peer.abort.get() {
            return Err(peer.aborted(drain));
        }
        let mut body = Vec::new();
        te_base::notify::encode_body(&note.from, &note.payload, &mut body)?;
        let max = params.max_bytes as usize;
        if note.payload.len() > max {
            // The target's advertised limit: it would refuse the same way.
            done.fail(
                index,
                te_base::notify::Refusal::TooLarge.into_error(peer.name(), note.payload.len(), max),
            );
            return Ok(());
        }
        {
            let mut q = peer.notes_in.lock();
            if q.len() >= MAX_QUEUED_NOTES {
                drop(q);
                done.fail(
                    index,
                    Error::NotificationQueueFull {
                        peer: peer.name().into(),
                    },
                );
                return Ok(());
            }
            q.push_back(NoteJob {
                body,
                payload_len: note.payload.len(),
                done: done.clone(),
                index,
            });
        }
        // Slot 0 may be locked by this very thread (a batch completing in its completion handler
        // runs this hook): then the progress thread posts it.
        match peer.slots[0].inner.try_lock() {
            Some(mut inner) => peer.pump_notes(&mut inner),
            None => {
                peer.shared.note_waiting.lock().push(Arc::downgrade(peer));
                peer.shared.wake_progress();
            }
        }
        Ok(())
    }
}

impl<V: Verbs> PeerInner<V> {
    /// The error submits and notifications get after an abort.
    fn aborted(&self, drain: &Drain) -> Error {
        Error::PeerGone {
            peer: self.name().to_string(),
            reason: format!("the connection was cut: {}", drain.err),
        }
    }
}

impl<V: Verbs> Drop for PeerInner<V> {
    fn drop(&mut self) {
        let mut map = self.shared.qps.write();
        for s in &self.slots {
            let mut inner = s.inner.lock();
            map.remove(&inner.qpn);
            self.shared.retired(inner.sq.in_flight());
            for p in inner.sq.drain_all() {
                p.tracker.fail(p.index, Error::Closed("rdma connection".into()));
            }
            if let Some(qp) = inner.qp.take() {
                if let Err(e) = self.shared.verbs.destroy_qp(qp) {
                    tracing::warn!("rdma: destroying a QP: {e}");
                }
                self.shared.rails().rails[s.rail].release_cq(s.cq_room);
            }
            if let Some(mut ch) = inner.notes.take() {
                // After the QP: nothing receives into or sends from the buffers any more.
                ch.fail_outstanding(&Error::Closed("rdma connection".into()));
                ch.release(&*self.shared.verbs);
            }
        }
        for job in self.notes_in.get_mut().drain(..) {
            job.fail(Error::Closed("rdma connection".into()));
        }
    }
}

impl<V: Verbs> QpInner<V> {
    pub(crate) fn new(qp: V::Qp, qpn: u32, depth: u32, signal_every: u32, backoff: Backoff) -> Self {
        QpInner {
            qp: Some(qp),
            qpn,
            machine: QpMachine::default(),
            sq: SendQueue::new(depth, signal_every),
            backoff,
            reconnecting: false,
            scratch: Vec::with_capacity(depth as usize),
            notes: None,
            draining: false,
        }
    }
}

impl<V: Verbs> Shared<V> {
    /// Posts what the slot's send queue allows. Called with the slot locked. Returns the pieces
    /// stranded by a post the provider refused (empty otherwise): the caller hands them to
    /// [`PeerInner::post_failed`] after unlocking.
    #[must_use]
    pub(crate) fn pump(&self, inner: &mut QpInner<V>) -> Vec<Piece> {
        if inner.machine.state() != QpState::Rts {
            return Vec::new();
        }
        let QpInner {
            sq,
            scratch,
            qp,
            machine,
            ..
        } = inner;
        let Some(qp) = qp.as_ref() else { return Vec::new() };
        scratch.clear();
        let n = sq.post_ready(|slot, p| {
            scratch.push(WorkRequest {
                wr_id: slot.seq,
                opcode: p.opcode,
                local_addr: p.local_addr,
                len: p.len,
                lkey: p.lkey,
                remote_addr: p.remote_addr,
                rkey: p.rkey,
                signaled: slot.signaled,
                imm_data: 0,
            })
        });
        if n == 0 {
            return Vec::new();
        }
        match self.verbs.post_send(qp, scratch) {
            Ok(()) => {
                self.posted(n);
                Vec::new()
            }
            Err(PostError { posted, errno }) => {
                sq.unpost(n, posted);
                self.posted(posted);
                if errno == libc::ENOMEM {
                    // Send queue full after all (the provider counts differently): wait for
                    // completions to free slots.
                    return Vec::new();
                }
                self.retired(sq.in_flight());
                // The provider refused the QP itself: move it to ERROR (what it accepted is
                // flushed and never executes) and hand every piece back.
                tracing::warn!("rdma: ibv_post_send: {}", std::io::Error::from_raw_os_error(errno));
                let _ = self.verbs.modify_qp(qp, &QpTransition::ToError);
                machine.mark_error();
                sq.fail_all()
            }
        }
    }
}

/// What the progress thread does about a broken slot.
pub(crate) enum Reconnect {
    /// Start a re-establishment now.
    Start,
    /// Its backoff has not elapsed: look again later.
    Wait,
    /// Healthy again, or an attempt is running (it re-lists the slot if it fails).
    Nothing,
}

/// Claims a re-establishment attempt of slot `index` if its backoff allows one at `now`.
pub(crate) fn try_begin_reconnect<V: Verbs>(peer: &PeerInner<V>, index: usize, now: Instant) -> Reconnect {
    let mut inner = peer.slots[index].inner.lock();
    if inner.reconnecting || inner.machine.state() != QpState::Error || peer.abort.get().is_some() {
        return Reconnect::Nothing;
    }
    if inner.backoff.try_begin(now) {
        inner.reconnecting = true;
        return Reconnect::Start;
    }
    Reconnect::Wait
}

/// Keeps a weak reference usable in maps keyed by QP number.
pub(crate) type SlotRef<V> = (Weak<PeerInner<V>>, usize);
