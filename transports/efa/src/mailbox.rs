//! Notifications on a rail (rail 0 of each transport): the receive buffers a target keeps posted,
//! the answers it sends back, and the notifications this side sends and waits on. Owned and
//! driven by the rail's owner thread ([`crate::worker`]), which already polls the CQ.
//!
//! Why a message after the writes is enough: the engine hands a notification over only once every
//! write of its batch completed, and writes are posted with `FI_DELIVERY_COMPLETE`, so each
//! completion means the bytes are in the target's memory (tcp;ofi_rxm: the target's rxm has
//! copied them and acknowledged; shm: the copy into the target's memory is done when the
//! completion is written). The NOTIFY leaves after that, so the target cannot receive it first,
//! whatever order the provider keeps between operations.
//!
//! Order between notifications: to each destination at most one NOTIFY is unanswered at a time
//! (stop and wait). The target queues a message before it answers, so messages reach its inbox in
//! the order they were handed over, on every provider, without relying on `FI_ORDER_SAS`.
//!
//! Bounds: [`RECV_SLOTS`] receive buffers of the target's largest message (header, reply address,
//! sender name, `TE_NOTIFY_MAX_BYTES` payload, MAC), one answer buffer per receive slot (a receive
//! is posted again only once its answer went out, so answers in flight never exceed the receive
//! slots), [`SEND_SLOTS`] outgoing messages, and [`REPLY_BOOK`] reply addresses in the AV. A
//! message the buffer cannot hold is truncated by the provider and dropped (its sender learns its
//! limit from our descriptor and never sends one; a hostile one times out).

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::auth::AuthKey;
use te_base::notify::{MAX_BODY_LEN, MAX_SENDER_NAME};
use te_base::{BatchState, Error, NotifyInbox};

use crate::fabric::{Block, MemoryRegion, Rail, TRANSPORT};
use crate::ffi;
use crate::link::PeerLink;
use crate::note_wire::{self, DecodeError, Message, Outcome, ANSWER_LEN, HEADER_LEN, MAC_LEN, MAX_REPLY_ADDR};
use crate::reply_book::ReplyBook;

/// Receive buffers kept posted.
pub(crate) const RECV_SLOTS: usize = 16;
/// Notifications sent concurrently (to distinct destinations); more wait in order.
pub(crate) const SEND_SLOTS: usize = 4;
/// Reply addresses kept in the AV; more than [`RECV_SLOTS`], so an idle one can always be evicted.
pub(crate) const REPLY_BOOK: usize = 64;
/// Bytes of one answer buffer.
const ANSWER_BYTES: usize = 64;
const _: () = assert!(ANSWER_LEN <= ANSWER_BYTES && REPLY_BOOK > RECV_SLOTS);

/// A notification handed to the rail, waiting for its turn.
pub(crate) struct NoteJob {
    /// `te_base::notify::encode_body` of the sender name and payload.
    pub body: Vec<u8>,
    pub payload_len: usize,
    pub done: Arc<BatchState>,
    pub index: usize,
    /// The target: keeps its AV address (`dests[0]`) alive until the send completed.
    pub link: Arc<PeerLink>,
}

impl NoteJob {
    fn dest(&self) -> u64 {
        self.link.dests[0]
    }
}

/// A NOTIFY on the wire.
struct Sending {
    job: NoteJob,
    seq: u64,
    /// The provider still owns the buffer (no send completion yet).
    send_pending: bool,
    /// The request was settled (answered, failed or timed out).
    settled: bool,
    deadline: Instant,
}

/// A receive slot's state.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Recv {
    /// Posted: the provider owns the buffer.
    Posted,
    /// To be posted (the last attempt met a full queue).
    Idle,
    /// An answer of `len` bytes to `dest` waits to be posted.
    Answer { dest: u64, len: usize },
    /// The answer is on the wire; the slot is posted again when it completes.
    Answering { dest: u64 },
}

/// Layout of the retained area, in 64-byte blocks: contexts (receives, answers, sends), then the
/// receive buffers, the answer buffers and the send buffers.
struct Layout {
    recv_bytes: usize,
    send_bytes: usize,
}

impl Layout {
    const CONTEXTS: usize = 2 * RECV_SLOTS + SEND_SLOTS;

    fn blocks(&self) -> usize {
        Self::CONTEXTS + (RECV_SLOTS * (self.recv_bytes + ANSWER_BYTES) + SEND_SLOTS * self.send_bytes) / 64
    }
}

/// The rail's notification state (owner thread only).
pub(crate) struct Mailbox {
    rail: Arc<Rail>,
    inbox: Arc<NotifyInbox>,
    key: Option<AuthKey>,
    timeout: Duration,
    layout: Layout,
    /// Start of the retained area: contexts first.
    area: *mut Block,
    /// Its registration (local access) when the provider needs descriptors for message buffers.
    mr: Option<MemoryRegion>,
    recv: [Recv; RECV_SLOTS],
    sending: [Option<Sending>; SEND_SLOTS],
    waiting: VecDeque<NoteJob>,
    next_seq: u64,
    replies: ReplyBook,
}

// SAFETY: the mailbox moves into its owner thread once and is only used there; `area` points into
// memory the rail keeps until its endpoint closes.
unsafe impl Send for Mailbox {}

fn round64(n: usize) -> usize {
    n.div_ceil(64) * 64
}

impl Mailbox {
    /// Sets up the buffers of `rail` and posts its receives.
    pub(crate) fn open(
        rail: Arc<Rail>,
        inbox: Arc<NotifyInbox>,
        key: Option<AuthKey>,
        timeout: Duration,
    ) -> te_base::Result<Mailbox> {
        let max_payload = inbox.limits().max_bytes;
        let layout = Layout {
            recv_bytes: round64(HEADER_LEN + MAX_REPLY_ADDR + 1 + MAX_SENDER_NAME + max_payload + MAC_LEN),
            send_bytes: round64(HEADER_LEN + MAX_REPLY_ADDR + MAX_BODY_LEN + MAC_LEN),
        };
        let area = rail.retained_area(layout.blocks());
        let mr = if rail.attrs.local_desc() {
            let data = area.wrapping_add(Layout::CONTEXTS) as u64;
            Some(rail.register(data, ((layout.blocks() - Layout::CONTEXTS) * 64) as u64, false)?)
        } else {
            None
        };
        let mut mb = Mailbox {
            replies: ReplyBook::new(rail.clone(), REPLY_BOOK),
            rail,
            inbox,
            key,
            timeout,
            layout,
            area,
            mr,
            recv: [Recv::Idle; RECV_SLOTS],
            sending: std::array::from_fn(|_| None),
            waiting: VecDeque::new(),
            next_seq: first_seq(),
        };
        mb.pump();
        Ok(mb)
    }

    /// The local descriptor of the message buffers (null when the provider needs none).
    fn desc(&self) -> *mut c_void {
        self.mr.as_ref().map_or(std::ptr::null_mut(), |m| m.desc)
    }

    fn context(&self, i: usize) -> *mut c_void {
        self.area.wrapping_add(i).cast()
    }

    fn data(&self, offset: usize) -> *mut u8 {
        self.area
            .wrapping_add(Layout::CONTEXTS)
            .cast::<u8>()
            .wrapping_add(offset)
    }

    fn recv_buf(&self, i: usize) -> *mut u8 {
        self.data(i * self.layout.recv_bytes)
    }

    fn answer_buf(&self, i: usize) -> *mut u8 {
        self.data(RECV_SLOTS * self.layout.recv_bytes + i * ANSWER_BYTES)
    }

    fn send_buf(&self, i: usize) -> *mut u8 {
        self.data(RECV_SLOTS * (self.layout.recv_bytes + ANSWER_BYTES) + i * self.layout.send_bytes)
    }

    /// The context index of `ctx` when it is one of ours.
    pub(crate) fn owns(&self, ctx: *mut c_void) -> Option<usize> {
        let off = (ctx as usize).wrapping_sub(self.area as usize);
        (off < Layout::CONTEXTS * 64 && off.is_multiple_of(64)).then_some(off / 64)
    }

    /// Takes notifications handed to the rail.
    pub(crate) fn push(&mut self, jobs: impl IntoIterator<Item = NoteJob>) {
        self.waiting.extend(jobs);
    }

    /// Anything unanswered (the owner then watches the clock).
    pub(crate) fn busy(&self) -> bool {
        !self.waiting.is_empty() || self.sending.iter().any(Option::is_some)
    }

    /// Posts what can be posted: receives, answers, waiting notifications. True if anything was.
    pub(crate) fn pump(&mut self) -> bool {
        let mut any = false;
        for i in 0..RECV_SLOTS {
            match self.recv[i] {
                Recv::Idle => {
                    // SAFETY: the buffer and context lie in the retained area, alive until the
                    // endpoint closes; the slot is not posted, so nothing else writes it.
                    let rc = unsafe {
                        self.rail
                            .post_recv(self.recv_buf(i), self.layout.recv_bytes, self.desc(), self.context(i))
                    };
                    if rc == 0 {
                        self.recv[i] = Recv::Posted;
                        any = true;
                    } else if rc != -ffi::FI_EAGAIN {
                        tracing::warn!(error = %ffi::strerror(rc as i64), "efa: posting a notification receive failed");
                    }
                }
                Recv::Answer { dest, len } => {
                    // SAFETY: as above; the answer buffer of slot i is written only while the slot
                    // is not answering.
                    let rc = unsafe {
                        self.rail
                            .post_send(self.answer_buf(i), len, self.desc(), dest, self.context(RECV_SLOTS + i))
                    };
                    if rc == 0 {
                        self.recv[i] = Recv::Answering { dest };
                        any = true;
                    } else if rc != -ffi::FI_EAGAIN {
                        tracing::debug!(error = %ffi::strerror(rc as i64), "efa: sending a notification answer failed");
                        self.replies.release(dest);
                        self.recv[i] = Recv::Idle;
                    }
                }
                Recv::Posted | Recv::Answering { .. } => {}
            }
        }
        any | self.send_waiting()
    }

    /// Sends the oldest waiting notification of each destination that has none unanswered.
    fn send_waiting(&mut self) -> bool {
        let mut any = false;
        let mut k = 0;
        while k < self.waiting.len() {
            let dest = self.waiting[k].dest();
            let busy = self
                .sending
                .iter()
                .flatten()
                .any(|s| !s.settled && s.job.dest() == dest)
                || self.waiting.iter().take(k).any(|j| j.dest() == dest);
            if busy {
                k += 1;
                continue;
            }
            let Some(slot) = self.sending.iter().position(Option::is_none) else {
                break;
            };
            let job = &self.waiting[k];
            if !job.link.is_healthy() {
                let job = self.waiting.remove(k).expect("index in range");
                job.done.fail(job.index, job.link.gone_error());
                any = true;
                continue;
            }
            let reply = &self.rail.address;
            let len = note_wire::notify_len(reply, &job.body);
            if len > self.layout.send_bytes || reply.len() > MAX_REPLY_ADDR {
                let job = self.waiting.remove(k).expect("index in range");
                job.done.fail(
                    job.index,
                    Error::transport(TRANSPORT, format!("notification of {len} bytes does not fit a message")),
                );
                any = true;
                continue;
            }
            let seq = self.next_seq;
            // SAFETY: the send buffer of a free slot is ours alone, `send_bytes` long.
            let buf = unsafe { std::slice::from_raw_parts_mut(self.send_buf(slot), self.layout.send_bytes) };
            let n = note_wire::encode_notify(buf, seq, reply, &job.body, self.key.as_ref());
            // SAFETY: the buffer and context live in the retained area; the link keeps `dest` in the AV.
            let rc = unsafe {
                self.rail.post_send(
                    buf.as_ptr(),
                    n,
                    self.desc(),
                    job.dest(),
                    self.context(2 * RECV_SLOTS + slot),
                )
            };
            if rc == -ffi::FI_EAGAIN {
                break;
            }
            let job = self.waiting.remove(k).expect("index in range");
            any = true;
            if rc != 0 {
                let err = job
                    .link
                    .error_from("fi_sendmsg", &self.rail.error("fi_sendmsg", rc as i64));
                job.done.fail(job.index, err);
                continue;
            }
            self.next_seq = self.next_seq.wrapping_add(1);
            self.sending[slot] = Some(Sending {
                job,
                seq,
                send_pending: true,
                settled: false,
                deadline: Instant::now() + self.timeout,
            });
        }
        any
    }

    /// Handles the completion of context `i` (see [`Mailbox::owns`]): `len` received bytes, or
    /// the provider's error.
    pub(crate) fn completed(&mut self, i: usize, len: usize, error: Option<(i32, String)>) {
        if i < RECV_SLOTS {
            self.received(i, len, error);
        } else if i < 2 * RECV_SLOTS {
            let slot = i - RECV_SLOTS;
            if let Recv::Answering { dest } = self.recv[slot] {
                if let Some((_, text)) = error {
                    tracing::debug!(%text, "efa: a notification answer failed");
                }
                self.replies.release(dest);
            }
            self.recv[slot] = Recv::Idle;
        } else {
            let slot = i - 2 * RECV_SLOTS;
            let Some(s) = self.sending[slot].as_mut() else {
                return;
            };
            s.send_pending = false;
            if let Some((err, text)) = error {
                if !s.settled {
                    s.settled = true;
                    let e = Error::transport_caused(
                        TRANSPORT,
                        format!("notification to peer '{}' failed", s.job.link.name()),
                        te_base::NativeError {
                            library: "libfabric",
                            code: -(err.unsigned_abs() as i64),
                            text,
                        },
                    );
                    s.job.done.fail(s.job.index, e);
                }
            }
            if s.settled {
                self.sending[slot] = None;
            }
        }
    }

    fn received(&mut self, i: usize, len: usize, error: Option<(i32, String)>) {
        self.recv[i] = Recv::Idle;
        if let Some((_, text)) = error {
            // Truncated (larger than our buffer) or cancelled: nobody to answer.
            tracing::debug!(%text, "efa: a notification receive failed");
            return;
        }
        // SAFETY: the provider wrote `len` bytes of the slot's buffer and gave it back.
        let msg = unsafe { std::slice::from_raw_parts(self.recv_buf(i), len.min(self.layout.recv_bytes)) };
        match note_wire::decode(msg, self.key.as_ref()) {
            Ok(Message::Notify { seq, reply, body }) => {
                let (outcome, max) = self.deliver(body);
                let Ok(dest) = self.replies.acquire(reply) else {
                    return; // logged by the book; the sender times out
                };
                // SAFETY: the answer buffer of slot i, ANSWER_BYTES long, is not in flight.
                let buf = unsafe { std::slice::from_raw_parts_mut(self.answer_buf(i), ANSWER_BYTES) };
                let len = note_wire::encode_answer(buf, seq, outcome, max, self.key.as_ref());
                self.recv[i] = Recv::Answer { dest, len };
            }
            Ok(Message::Answer { seq, outcome, max }) => self.answered(seq, outcome, max),
            Err(e @ DecodeError::Unauthenticated) => {
                tracing::warn!(error = %e, "efa: dropped a notification message that does not prove the engine's key")
            }
            Err(e) => tracing::debug!(error = %e, "efa: dropped a notification message"),
        }
    }

    /// Queues a received body in the inbox: the answer, and the maximum a `TooLarge` carries.
    fn deliver(&self, body: &[u8]) -> (Outcome, u32) {
        match Outcome::of_delivery(&self.inbox, body) {
            Outcome::TooLarge => (Outcome::TooLarge, self.inbox.limits().max_bytes as u32),
            o => (o, 0),
        }
    }

    /// Settles the notification `seq` from the target's answer.
    fn answered(&mut self, seq: u64, outcome: Outcome, max: u32) {
        let Some(slot) = self
            .sending
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.seq == seq && !s.settled))
        else {
            return; // late (timed out) or unknown: nothing waits on it
        };
        let s = self.sending[slot].as_mut().expect("found above");
        s.settled = true;
        let (job, peer) = (&s.job, s.job.link.name());
        outcome.settle(&job.done, job.index, (peer, job.payload_len, max as usize), || {
            Error::Refused {
                peer: peer.to_string(),
                reason: "the target could not decode the notification".into(),
            }
        });
        if !s.send_pending {
            self.sending[slot] = None;
        }
    }

    /// Fails notifications unanswered past the timeout (their buffers stay with the provider
    /// until the send completes).
    pub(crate) fn check_timeouts(&mut self) {
        let now = Instant::now();
        let after_ms = self.timeout.as_millis() as u64;
        for entry in self.sending.iter_mut() {
            let Some(s) = entry else { continue };
            if s.settled || now < s.deadline {
                continue;
            }
            s.settled = true;
            s.job.done.fail(
                s.job.index,
                Error::Timeout {
                    what: format!("notification to segment '{}'", s.job.link.name()),
                    after_ms,
                },
            );
            if !s.send_pending {
                *entry = None;
            }
        }
    }

    /// The rail reset its endpoint: what was posted on the old one is gone. Receives are posted
    /// again; notifications whose NOTIFY was still on the wire fail with `err` (the target may
    /// have received them).
    pub(crate) fn endpoint_reset(&mut self, err: &Error) {
        for r in self.recv.iter_mut() {
            match *r {
                Recv::Posted => *r = Recv::Idle,
                Recv::Answering { dest } => {
                    self.replies.release(dest);
                    *r = Recv::Idle;
                }
                Recv::Idle | Recv::Answer { .. } => {}
            }
        }
        for entry in self.sending.iter_mut() {
            let Some(s) = entry else { continue };
            if !s.send_pending {
                continue;
            }
            if !s.settled {
                s.job.done.fail(s.job.index, err.clone());
            }
            *entry = None;
        }
    }

    /// The owner stops: every notification not yet answered fails with `err`. Posted buffers stay
    /// valid (the rail retains them until its endpoint closes).
    pub(crate) fn shut_down(&mut self, err: &Error) {
        for job in self.waiting.drain(..) {
            job.done.fail(job.index, err.clone());
        }
        for s in self.sending.iter_mut().flatten() {
            if !s.settled {
                s.settled = true;
                s.job.done.fail(s.job.index, err.clone());
            }
        }
        self.replies.forget();
    }
}

/// A random first sequence number, so an answer recorded earlier (another process, a restart)
/// does not match a notification of this one.
fn first_seq() -> u64 {
    u64::from_le_bytes(te_base::auth::nonce()[..8].try_into().expect("8 bytes"))
}
