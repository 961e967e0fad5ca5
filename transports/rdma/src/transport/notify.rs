//! Notifications over verbs: a SEND on the connection's first QP (slot 0) into a receive buffer
//! the target keeps posted, answered by a zero-byte RDMA WRITE WITH IMMEDIATE on the same QP
//! (format in [`crate::protocol::notify_wire`]).
//!
//! Ordering: the engine hands a batch's notification over only once every request of the batch
//! completed, and an RDMA WRITE completes at the initiator only once the target acknowledged it,
//! i.e. its bytes are in the target's memory; messages to one peer then leave in hand-over order
//! on one RC QP, which delivers them in order. The target queues each in its inbox from its
//! progress thread, re-posts the buffer, and answers.
//!
//! Bounds: the target keeps [`NOTIFY_CREDITS`] receive buffers posted per connection (slot 0 only)
//! and advertises that and its payload limit in its descriptor; a sender has at most that many
//! messages unanswered, holds at most [`MAX_QUEUED_NOTES`] more waiting for a credit (beyond that
//! a notification fails with `NotificationQueueFull` at once), and refuses a payload above the
//! advertised limit itself (`NotificationTooLarge`, nothing sent). A message the target cannot read
//! is answered `Malformed`; one longer than its receive buffer fails the target's receive
//! (`LOC_LEN_ERR`) and the QP, never a panic.

use std::collections::VecDeque;
use std::sync::Arc;

use te_base::{BatchState, Error, HostBuffer, HostBufferOptions, NotifyInbox, Result};

use crate::protocol::notify_wire::{
    answers, decode_answer, decode_message, encode_answer, encode_header, NotifyParams, Outcome, HEADER_LEN,
    NOTIFY_VERSION,
};
use crate::verbs::{Access, Completion, Opcode, RecvRequest, Verbs, WcStatus, WorkRequest};

/// Receive buffers a target keeps posted per connection.
pub(crate) const NOTIFY_CREDITS: u32 = 16;
/// Notifications a sender holds per peer while every credit is in use.
pub(crate) const MAX_QUEUED_NOTES: usize = 4096;
/// `wr_id` tag of a notification SEND (initiator) or an answer (target).
pub(crate) const NOTE_SEND: u64 = 1 << 63;
/// `wr_id` tag of a notification receive buffer (either side).
pub(crate) const NOTE_RECV: u64 = 1 << 62;
const TAGS: u64 = NOTE_SEND | NOTE_RECV;

/// True for the `wr_id` of a notification work request (data requests are small sequence numbers).
pub(crate) fn is_note(wr_id: u64) -> bool {
    wr_id & TAGS != 0
}

fn tag(kind: u64, epoch: u32, index: u32) -> u64 {
    kind | (u64::from(epoch) << 32) | u64::from(index)
}

fn untag(wr_id: u64) -> (u32, u32) {
    (((wr_id & !TAGS) >> 32) as u32, wr_id as u32)
}

/// The parameters this target advertises when it has an inbox.
pub(crate) fn params(inbox: &NotifyInbox) -> NotifyParams {
    NotifyParams {
        version: NOTIFY_VERSION,
        credits: NOTIFY_CREDITS,
        max_bytes: inbox.limits().max_bytes as u32,
    }
}

/// `slots` buffers of `slot_len` bytes registered on one protection domain. Deregistered by
/// [`NoteMemory::release`], which the owner calls only after destroying the QP using it.
pub(crate) struct NoteMemory<V: Verbs> {
    buf: HostBuffer,
    mr: Option<V::Mr>,
    lkey: u32,
    slot_len: usize,
}

impl<V: Verbs> NoteMemory<V> {
    pub(crate) fn new(verbs: &V, pd: &V::Pd, slots: usize, slot_len: usize) -> Result<Self> {
        let len = slots * slot_len;
        let buf = HostBuffer::allocate(len, HostBufferOptions::default())?;
        let local = Access {
            remote_write: false,
            remote_read: false,
        };
        // SAFETY: `buf` is memory of this process that lives in `self` and is deregistered (by
        // `release`, or leaked with it if never released) before it is freed; it is not exported
        // (no remote access), so only our own QP's receives write into it.
        let (mr, keys) = unsafe { verbs.reg_mr(pd, buf.addr(), len as u64, local)? };
        Ok(NoteMemory {
            buf,
            mr: Some(mr),
            lkey: keys.lkey,
            slot_len,
        })
    }

    fn addr(&self, slot: u32) -> u64 {
        self.buf.addr() + u64::from(slot) * self.slot_len as u64
    }

    /// The first `len` bytes of `slot` (clamped to the slot).
    fn read(&self, slot: u32, len: usize) -> &[u8] {
        let len = len.min(self.slot_len);
        // SAFETY: `slot` is below the slot count (callers check) so the range lies in `buf`; the
        // device wrote it before the receive completion we are handling, and writes nothing into
        // a slot until it is posted again.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().add(slot as usize * self.slot_len), len) }
    }

    /// Slot `slot` for writing a message into (nothing of the device reads it while it is free).
    fn write(&mut self, slot: u32) -> &mut [u8] {
        // SAFETY: as in `read`; a free slot is not part of any posted work request.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr().add(slot as usize * self.slot_len), self.slot_len) }
    }

    pub(crate) fn release(&mut self, verbs: &V) {
        if let Some(mr) = self.mr.take() {
            if let Err(e) = verbs.dereg_mr(mr) {
                tracing::warn!("rdma: deregistering notification buffers: {e}");
            }
        }
    }
}

/// One notification handed to [`crate::transport::peer::RdmaPeer`] and where its outcome goes.
pub(crate) struct NoteJob {
    pub(crate) body: Vec<u8>,
    pub(crate) payload_len: usize,
    pub(crate) done: Arc<BatchState>,
    pub(crate) index: usize,
}

impl NoteJob {
    pub(crate) fn fail(self, err: Error) {
        self.done.fail(self.index, err);
    }
}

struct Sent {
    seq: u32,
    slot: u32,
    job: NoteJob,
}

/// The initiator's end of the notification channel, kept with slot 0's QP under its lock.
pub(crate) struct NoteChannel<V: Verbs> {
    pub(crate) params: NotifyParams,
    mem: NoteMemory<V>,
    free: Vec<u32>,
    outstanding: VecDeque<Sent>,
    next_seq: u32,
    /// Bumped whenever the QP is reset: completions of an older epoch are ignored.
    epoch: u32,
}

impl<V: Verbs> NoteChannel<V> {
    pub(crate) fn new(verbs: &V, pd: &V::Pd, params: NotifyParams) -> Result<Self> {
        let mem = NoteMemory::new(verbs, pd, params.credits as usize, params.message_len())?;
        Ok(NoteChannel {
            params,
            mem,
            free: (0..params.credits).rev().collect(),
            outstanding: VecDeque::with_capacity(params.credits as usize),
            next_seq: 0,
            epoch: 0,
        })
    }

    /// Posts one zero-byte receive per credit for the answers (after the QP reached RTS).
    pub(crate) fn post_answer_recvs(&self, verbs: &V, qp: &V::Qp) -> Result<()> {
        post_recvs(verbs, qp, (0..self.params.credits).map(|i| answer_recv(self.epoch, i)))
    }

    /// Posts queued notifications while credits last; `take` hands out the next waiting one.
    /// `Err`: the provider refused the QP (the job went back to the front of the queue).
    pub(crate) fn pump(
        &mut self,
        verbs: &V,
        qp: &V::Qp,
        mut take: impl FnMut() -> Option<NoteJob>,
        mut put_back: impl FnMut(NoteJob),
    ) -> std::result::Result<(), i32> {
        while let Some(&slot) = self.free.last() {
            let Some(job) = take() else { return Ok(()) };
            let len = HEADER_LEN + job.body.len();
            if len > self.mem.slot_len {
                // `notify` refuses payloads above the target's limit before queueing; a guard.
                job.fail(Error::transport(
                    "rdma",
                    "notification larger than the target's buffers",
                ));
                continue;
            }
            let seq = self.next_seq;
            let out = self.mem.write(slot);
            encode_header(seq, &mut out[..HEADER_LEN]);
            out[HEADER_LEN..len].copy_from_slice(&job.body);
            let wr = WorkRequest {
                wr_id: tag(NOTE_SEND, self.epoch, slot),
                opcode: Opcode::Send,
                local_addr: self.mem.addr(slot),
                len: len as u32,
                lkey: self.mem.lkey,
                remote_addr: 0,
                rkey: 0,
                signaled: true,
                imm_data: 0,
            };
            if let Err(e) = verbs.post_send(qp, std::slice::from_ref(&wr)) {
                put_back(job);
                return Err(e.errno);
            }
            self.free.pop();
            self.next_seq = self.next_seq.wrapping_add(1);
            self.outstanding.push_back(Sent { seq, slot, job });
        }
        Ok(())
    }

    /// True when `c` belongs to the current epoch.
    pub(crate) fn current(&self, c: &Completion) -> bool {
        untag(c.wr_id).0 == self.epoch
    }

    /// The answer `c` arrived (a successful receive of this epoch): settles the oldest message,
    /// frees its credit and re-posts the receive. `Err`: the answer breaks the protocol.
    pub(crate) fn on_answer(
        &mut self,
        verbs: &V,
        qp: &V::Qp,
        c: &Completion,
        peer: &str,
    ) -> std::result::Result<(), String> {
        let Some((outcome, seq)) = c.imm.and_then(decode_answer) else {
            return Err(format!("unreadable notification answer {:?}", c.imm));
        };
        let Some(front) = self.outstanding.front() else {
            return Err("a notification answer with none outstanding".into());
        };
        if !answers(seq, front.seq) {
            return Err(format!("answer for message {seq}, expected {}", front.seq));
        }
        let sent = self.outstanding.pop_front().expect("checked");
        self.free.push(sent.slot);
        let (epoch, slot) = untag(c.wr_id);
        if let Err(e) = verbs.post_recv(qp, &[answer_recv(epoch, slot)]) {
            tracing::debug!("rdma: re-posting a notification answer receive: errno {}", e.errno);
        }
        let job = sent.job;
        let max = self.params.max_bytes as usize;
        outcome.settle(&job.done, job.index, (peer, job.payload_len, max), || {
            Error::transport("rdma", "the target could not read a notification")
        });
        Ok(())
    }

    /// The QP failed or is being reset: every unanswered message fails with `err` (the target may
    /// or may not have queued it), every credit comes back, and a new epoch starts.
    pub(crate) fn fail_outstanding(&mut self, err: &Error) {
        for s in self.outstanding.drain(..) {
            s.job.fail(err.clone());
        }
        self.free = (0..self.params.credits).rev().collect();
        self.epoch = self.epoch.wrapping_add(1);
    }

    pub(crate) fn release(&mut self, verbs: &V) {
        self.mem.release(verbs);
    }
}

/// The target's end: the receive ring of one accepted slot-0 QP.
pub(crate) struct NoteRing<V: Verbs> {
    mem: NoteMemory<V>,
    credits: u32,
    /// Answers posted and not yet completed: more than `credits` means the sender ignores its
    /// credits, and the QP is cut.
    answering: u32,
}

impl<V: Verbs> NoteRing<V> {
    pub(crate) fn new(verbs: &V, pd: &V::Pd, params: NotifyParams) -> Result<Self> {
        Ok(NoteRing {
            mem: NoteMemory::new(verbs, pd, params.credits as usize, params.message_len())?,
            credits: params.credits,
            answering: 0,
        })
    }

    fn recv(&self, slot: u32) -> RecvRequest {
        RecvRequest {
            wr_id: tag(NOTE_RECV, 0, slot),
            addr: self.mem.addr(slot),
            len: self.mem.slot_len as u32,
            lkey: self.mem.lkey,
        }
    }

    /// Posts every receive buffer (once the QP is past INIT, before the handshake answers).
    pub(crate) fn post_all(&self, verbs: &V, qp: &V::Qp) -> Result<()> {
        post_recvs(verbs, qp, (0..self.credits).map(|i| self.recv(i)))
    }

    /// Handles a completion of this ring's QP: a message is queued in `inbox` (or refused), its
    /// buffer re-posted, and the answer sent. `Err`: the QP must be cut (the provider refused a
    /// post, or the sender overran its credits).
    pub(crate) fn on_completion(
        &mut self,
        verbs: &V,
        qp: &V::Qp,
        c: &Completion,
        inbox: &NotifyInbox,
    ) -> std::result::Result<(), String> {
        if c.wr_id & NOTE_SEND != 0 {
            self.answering = self.answering.saturating_sub(1);
            return Ok(());
        }
        if c.status != WcStatus::SUCCESS {
            // Flushed (the QP failed or is being torn down), or a message longer than its
            // buffer: the QP is in ERROR; the sender re-establishes it and gets a fresh ring.
            return Ok(());
        }
        let (_, slot) = untag(c.wr_id);
        if slot >= self.credits {
            return Err(format!("receive completion for unknown buffer {slot}"));
        }
        let (outcome, seq) = match decode_message(self.mem.read(slot, c.byte_len as usize)) {
            Ok((seq, body)) => (Outcome::of_delivery(inbox, body), seq),
            Err(e) => {
                tracing::debug!("rdma: unreadable notification: {e}");
                (Outcome::Malformed, 0)
            }
        };
        // The buffer goes back before the answer: when the sender gets its credit back, the
        // receive it may use next is posted.
        verbs
            .post_recv(qp, std::slice::from_ref(&self.recv(slot)))
            .map_err(|e| format!("ibv_post_recv: errno {}", e.errno))?;
        if self.answering >= self.credits {
            return Err("the sender ignores its notification credits".into());
        }
        let answer = WorkRequest {
            wr_id: tag(NOTE_SEND, 0, slot),
            opcode: Opcode::RdmaWriteWithImm,
            local_addr: 0,
            len: 0,
            lkey: 0,
            remote_addr: 0,
            rkey: 0,
            signaled: true,
            imm_data: encode_answer(outcome, seq),
        };
        verbs
            .post_send(qp, std::slice::from_ref(&answer))
            .map_err(|e| format!("ibv_post_send (answer): errno {}", e.errno))?;
        self.answering += 1;
        Ok(())
    }

    pub(crate) fn release(&mut self, verbs: &V) {
        self.mem.release(verbs);
    }
}

/// A zero-byte receive for an answer.
fn answer_recv(epoch: u32, index: u32) -> RecvRequest {
    RecvRequest {
        wr_id: tag(NOTE_RECV, epoch, index),
        addr: 0,
        len: 0,
        lkey: 0,
    }
}

/// Posts a connection's receives (once per connection, not on the data path).
fn post_recvs<V: Verbs>(verbs: &V, qp: &V::Qp, rrs: impl Iterator<Item = RecvRequest>) -> Result<()> {
    let rrs: Vec<RecvRequest> = rrs.collect();
    verbs
        .post_recv(qp, &rrs)
        .map_err(|e| Error::transport("rdma", format!("ibv_post_recv: errno {}", e.errno)))
}
