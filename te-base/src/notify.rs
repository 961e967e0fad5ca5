//! Notifications: small messages a peer sends to a segment, delivered into the target's bounded
//! inbox by whichever transport carried them.
//!
//! The inbox is the only place undelivered notifications live on the target. It holds at most
//! `TE_NOTIFY_QUEUE_DEPTH` messages of at most `TE_NOTIFY_MAX_BYTES` each, so its memory is
//! bounded by their product (plus the sender names, at most [`MAX_SENDER_NAME`] bytes each). A
//! message that does not fit is refused and the refusal travels back to the sender as a typed
//! error ([`Error::NotificationQueueFull`], [`Error::NotificationTooLarge`]); nothing is dropped
//! silently and nothing grows without bound.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use event_listener::{Event, Listener};
use parking_lot::Mutex;

use crate::batch::BatchState;
use crate::config::{parse_bytes, parse_var, Env};
use crate::error::{Error, Result};
use crate::wire::{Reader, WireError, Writer};

/// Variable: most undelivered notifications the target keeps (default 1024).
pub const QUEUE_DEPTH_VAR: &str = "TE_NOTIFY_QUEUE_DEPTH";
/// Variable: largest notification payload the target accepts (default 4 KiB).
pub const MAX_BYTES_VAR: &str = "TE_NOTIFY_MAX_BYTES";
/// Largest payload any build puts on a wire; `TE_NOTIFY_MAX_BYTES` may not exceed it.
pub const MAX_PAYLOAD_LIMIT: usize = 64 << 10;
/// Longest sender segment name a notification carries.
pub const MAX_SENDER_NAME: usize = 255;
/// Largest accepted `TE_NOTIFY_QUEUE_DEPTH`.
pub const MAX_QUEUE_DEPTH: usize = 1 << 20;

/// One notification, as the target receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sender's segment name, as its (authenticated, when a key is configured) engine sent it.
    pub from: String,
    /// The message.
    pub payload: Vec<u8>,
}

/// Bounds of a target's inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotifyLimits {
    /// Most undelivered messages kept.
    pub queue_depth: usize,
    /// Largest payload accepted.
    pub max_bytes: usize,
}

impl Default for NotifyLimits {
    fn default() -> Self {
        NotifyLimits {
            queue_depth: 1024,
            max_bytes: 4096,
        }
    }
}

impl NotifyLimits {
    /// Reads `TE_NOTIFY_QUEUE_DEPTH` and `TE_NOTIFY_MAX_BYTES`; a malformed or out-of-range value
    /// is an [`Error::Config`] naming the variable.
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let mut limits = NotifyLimits::default();
        if let Some(depth) = parse_var::<usize>(env, QUEUE_DEPTH_VAR)? {
            if depth == 0 || depth > MAX_QUEUE_DEPTH {
                return Err(Error::config(
                    QUEUE_DEPTH_VAR,
                    depth.to_string(),
                    format!("must be 1..={MAX_QUEUE_DEPTH}"),
                ));
            }
            limits.queue_depth = depth;
        }
        if let Some(bytes) = parse_bytes(env, MAX_BYTES_VAR)? {
            if bytes == 0 || bytes > MAX_PAYLOAD_LIMIT as u64 {
                return Err(Error::config(
                    MAX_BYTES_VAR,
                    env.get(MAX_BYTES_VAR).unwrap_or_default(),
                    format!("must be 1..={MAX_PAYLOAD_LIMIT} bytes"),
                ));
            }
            limits.max_bytes = bytes as usize;
        }
        Ok(limits)
    }
}

/// Why an inbox refused a notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `queue_depth` messages are waiting already.
    QueueFull,
    /// The payload is above `max_bytes` (or the sender name above [`MAX_SENDER_NAME`]).
    TooLarge,
}

impl Refusal {
    /// The typed error the sender sees, naming the target segment.
    pub fn into_error(self, peer: &str, len: usize, max: usize) -> Error {
        match self {
            Refusal::QueueFull => Error::NotificationQueueFull { peer: peer.to_string() },
            Refusal::TooLarge => Error::NotificationTooLarge {
                peer: peer.to_string(),
                len,
                max,
            },
        }
    }
}

/// A target's answer to one notification, as the transports without frame types of their own
/// (efa's ANSWER message, rdma's immediate) carry it: a small code on the wire, and the same
/// settlement of the sender's request on every transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Queued in the target's inbox.
    Accepted = 0,
    /// The inbox is full.
    QueueFull = 1,
    /// The payload is above the target's maximum.
    TooLarge = 2,
    /// The message could not be decoded.
    Malformed = 3,
}

impl Outcome {
    /// Every outcome, in code order.
    pub const ALL: [Outcome; 4] = [
        Outcome::Accepted,
        Outcome::QueueFull,
        Outcome::TooLarge,
        Outcome::Malformed,
    ];

    /// Its wire code (0..=3).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The outcome of wire code `code`; `None` for an unknown one.
    pub fn from_code(code: u8) -> Option<Outcome> {
        Outcome::ALL.get(code as usize).copied()
    }

    /// Decodes a received body ([`decode_body`]) and offers it to `inbox`: the answer to send back.
    pub fn of_delivery(inbox: &NotifyInbox, body: &[u8]) -> Outcome {
        let Ok(note) = decode_body(body) else {
            return Outcome::Malformed;
        };
        match inbox.deliver(note) {
            Ok(()) => Outcome::Accepted,
            Err(Refusal::QueueFull) => Outcome::QueueFull,
            Err(Refusal::TooLarge) => Outcome::TooLarge,
        }
    }

    /// Settles the sender's request `index` of `done` (a `len`-byte payload to `peer`, whose
    /// maximum is `max`) from this answer: done, the refusal's typed error, or `malformed()`.
    pub fn settle(
        self,
        done: &BatchState,
        index: usize,
        (peer, len, max): (&str, usize, usize),
        malformed: impl FnOnce() -> Error,
    ) {
        match self {
            Outcome::Accepted => done.complete(index),
            Outcome::QueueFull => done.fail(index, Refusal::QueueFull.into_error(peer, len, max)),
            Outcome::TooLarge => done.fail(index, Refusal::TooLarge.into_error(peer, len, max)),
            Outcome::Malformed => done.fail(index, malformed()),
        }
    }
}

/// A target's bounded queue of received notifications. Transports deliver into it; the engine
/// hands them to the application in arrival order.
///
/// Written here (a `Mutex<VecDeque>` and an `event_listener::Event`) rather than taken from
/// `async-channel`: admission must say *why* it refused (full or too large) and run the test
/// observer under the same lock that admits the message, and receivers need a blocking receive
/// with a deadline and a poll form for the engine's `Stream`; a channel gives the first only as
/// an opaque `Full` and the others not at all.
pub struct NotifyInbox {
    limits: NotifyLimits,
    queue: Mutex<VecDeque<Notification>>,
    closed: AtomicBool,
    arrived: Event,
    observer: Mutex<Option<Observer>>,
}

/// A receiver's registration for the next arrival (see [`NotifyInbox::poll_recv`]).
pub type Waiter = event_listener::EventListener;

/// Sees each accepted notification on the delivering thread, just before it is queued.
pub type Observer = Box<dyn Fn(&Notification) + Send + Sync>;

impl std::fmt::Debug for NotifyInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifyInbox")
            .field("limits", &self.limits)
            .field("waiting", &self.len())
            .finish()
    }
}

impl NotifyInbox {
    /// An empty inbox with these bounds.
    pub fn new(limits: NotifyLimits) -> Arc<Self> {
        Arc::new(NotifyInbox {
            limits,
            queue: Mutex::new(VecDeque::new()),
            closed: AtomicBool::new(false),
            arrived: Event::new(),
            observer: Mutex::new(None),
        })
    }

    /// Installs (or with `None` removes) an observer that sees every accepted notification on the
    /// thread delivering it, before any receiver can: the conformance suite checks there that
    /// the data a notification follows is already in place. One lock per notification.
    pub fn observe(&self, observer: Option<Observer>) {
        *self.observer.lock() = observer;
    }

    /// Its bounds.
    pub fn limits(&self) -> NotifyLimits {
        self.limits
    }

    /// Queues `note`, or says why not. Never blocks on the receiver.
    pub fn deliver(&self, note: Notification) -> std::result::Result<(), Refusal> {
        if note.payload.len() > self.limits.max_bytes || note.from.len() > MAX_SENDER_NAME {
            return Err(Refusal::TooLarge);
        }
        let mut q = self.queue.lock();
        if q.len() >= self.limits.queue_depth {
            return Err(Refusal::QueueFull);
        }
        if let Some(observe) = &*self.observer.lock() {
            observe(&note);
        }
        q.push_back(note);
        drop(q);
        self.arrived.notify(1);
        Ok(())
    }

    /// The oldest waiting notification, without waiting.
    pub fn try_recv(&self) -> Option<Notification> {
        self.queue.lock().pop_front()
    }

    /// Puts back, as the oldest waiting, a notification taken by a receive that could not hand
    /// it over (its waiter was cancelled meanwhile): a cancelled wait never consumes a message.
    /// Not bounded by the queue depth (it was counted when it arrived), and wakes a receiver.
    pub fn put_back(&self, note: Notification) {
        self.queue.lock().push_front(note);
        self.arrived.notify(1);
    }

    /// Waits for the next notification; `None` once the inbox is closed and empty.
    pub async fn recv(&self) -> Option<Notification> {
        loop {
            if let Some(n) = self.try_recv() {
                return Some(n);
            }
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            let listener = self.arrived.listen();
            if let Some(n) = self.try_recv() {
                return Some(n);
            }
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            listener.await;
        }
    }

    /// The polling form of [`NotifyInbox::recv`], for a `Stream`: `waiter` is the caller's
    /// registration for the next arrival, kept between polls.
    pub fn poll_recv(&self, waiter: &mut Option<Waiter>, cx: &mut Context<'_>) -> Poll<Option<Notification>> {
        loop {
            if let Some(n) = self.try_recv() {
                *waiter = None;
                return Poll::Ready(Some(n));
            }
            if self.closed.load(Ordering::Acquire) {
                *waiter = None;
                return Poll::Ready(None);
            }
            match waiter {
                // Registered, then checked again above: an arrival in between is not missed.
                None => *waiter = Some(self.arrived.listen()),
                Some(l) => {
                    if Pin::new(l).poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    *waiter = None;
                }
            }
        }
    }

    /// Like [`NotifyInbox::recv`], blocking the thread for at most `timeout`.
    pub fn recv_blocking(&self, timeout: std::time::Duration) -> Option<Notification> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(n) = self.try_recv() {
                return Some(n);
            }
            let listener = self.arrived.listen();
            if let Some(n) = self.try_recv() {
                return Some(n);
            }
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            listener.wait_deadline(deadline)?;
        }
    }

    /// Messages waiting.
    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    /// True when none is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Wakes every receiver; [`NotifyInbox::recv`] returns `None` once the queue is drained.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.arrived.notify(usize::MAX);
    }
}

/// Encodes a notification body as transports carry it: one byte of sender-name length, the
/// name, the payload (the rest of the body: its carrier's frame says how long the body is).
/// Appended to `out`.
pub fn encode_body(from: &str, payload: &[u8], out: &mut Vec<u8>) -> Result<()> {
    if from.len() > MAX_SENDER_NAME {
        return Err(Error::InvalidDescriptor(format!(
            "segment name of {} bytes is too long to send notifications (at most {MAX_SENDER_NAME})",
            from.len()
        )));
    }
    if payload.len() > MAX_PAYLOAD_LIMIT {
        return Err(Error::NotificationTooLarge {
            peer: String::new(),
            len: payload.len(),
            max: MAX_PAYLOAD_LIMIT,
        });
    }
    out.reserve(1 + from.len() + payload.len());
    out.u8(from.len() as u8);
    out.bytes(from.as_bytes());
    out.bytes(payload);
    Ok(())
}

/// Largest encoded body: what a transport's wire bound must admit.
pub const MAX_BODY_LEN: usize = 1 + MAX_SENDER_NAME + MAX_PAYLOAD_LIMIT;

/// Decodes a body written by [`encode_body`]. A body over [`MAX_BODY_LEN`] is refused before
/// anything is read, and a name length is checked against the bytes that follow it, so nothing
/// is allocated beyond what the body holds.
pub fn decode_body(body: &[u8]) -> std::result::Result<Notification, WireError> {
    if body.len() > MAX_BODY_LEN {
        return Err(WireError::TooLarge {
            field: "notification body",
            len: body.len() as u64,
            max: MAX_BODY_LEN as u64,
        });
    }
    let mut r = Reader::new(body);
    let n = r.u8("sender name length")?;
    let at = r.position();
    let name = r.bytes("sender name", n as usize)?;
    let from = std::str::from_utf8(name).map_err(|_| WireError::BadUtf8 {
        field: "sender name",
        at,
    })?;
    Ok(Notification {
        from: from.to_owned(),
        payload: r.rest().to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MapEnv;
    use proptest::prelude::*;

    fn note(from: &str, payload: &[u8]) -> Notification {
        Notification {
            from: from.into(),
            payload: payload.to_vec(),
        }
    }

    #[test]
    fn outcome_codes_round_trip_and_delivery_answers_match_the_inbox() {
        for o in Outcome::ALL {
            assert_eq!(Outcome::from_code(o.code()), Some(o));
        }
        assert_eq!(Outcome::from_code(4), None);
        let inbox = NotifyInbox::new(NotifyLimits {
            queue_depth: 1,
            max_bytes: 4,
        });
        let body = |payload: &[u8]| {
            let mut b = Vec::new();
            encode_body("a", payload, &mut b).unwrap();
            b
        };
        assert_eq!(Outcome::of_delivery(&inbox, &body(b"12345")), Outcome::TooLarge);
        assert_eq!(Outcome::of_delivery(&inbox, &body(b"1")), Outcome::Accepted);
        assert_eq!(Outcome::of_delivery(&inbox, &body(b"2")), Outcome::QueueFull);
        assert_eq!(Outcome::of_delivery(&inbox, b"\xff"), Outcome::Malformed);
    }

    #[test]
    fn inbox_is_bounded_and_ordered() {
        let inbox = NotifyInbox::new(NotifyLimits {
            queue_depth: 2,
            max_bytes: 4,
        });
        assert_eq!(inbox.deliver(note("a", b"1")), Ok(()));
        assert_eq!(inbox.deliver(note("a", b"12345")), Err(Refusal::TooLarge));
        assert_eq!(inbox.deliver(note("b", b"2")), Ok(()));
        assert_eq!(inbox.deliver(note("c", b"3")), Err(Refusal::QueueFull));
        assert_eq!(inbox.try_recv(), Some(note("a", b"1")));
        assert_eq!(inbox.deliver(note("c", b"3")), Ok(()));
        assert_eq!(inbox.try_recv(), Some(note("b", b"2")));
        assert_eq!(inbox.try_recv(), Some(note("c", b"3")));
        assert_eq!(inbox.try_recv(), None);
    }

    #[test]
    fn a_note_put_back_is_the_next_received_and_wakes_a_waiter() {
        let inbox = NotifyInbox::new(NotifyLimits::default());
        inbox.deliver(note("a", b"1")).unwrap();
        inbox.deliver(note("a", b"2")).unwrap();
        let first = inbox.try_recv().unwrap();
        inbox.put_back(first.clone());
        assert_eq!(inbox.try_recv(), Some(first.clone()));
        assert_eq!(inbox.try_recv(), Some(note("a", b"2")));
        let rx = inbox.clone();
        let t = std::thread::spawn(move || rx.recv_blocking(std::time::Duration::from_secs(30)));
        inbox.put_back(first.clone());
        assert_eq!(t.join().unwrap(), Some(first));
    }

    #[test]
    fn recv_wakes_on_delivery_and_ends_on_close() {
        let inbox = NotifyInbox::new(NotifyLimits::default());
        let rx = inbox.clone();
        let t = std::thread::spawn(move || rx.recv_blocking(std::time::Duration::from_secs(30)));
        inbox.deliver(note("a", b"x")).unwrap();
        assert_eq!(t.join().unwrap(), Some(note("a", b"x")));
        inbox.close();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(rt.block_on(inbox.recv()), None);
    }

    #[test]
    fn limits_from_env_are_validated() {
        assert_eq!(
            NotifyLimits::from_env(&MapEnv::new([])).unwrap(),
            NotifyLimits::default()
        );
        let l = NotifyLimits::from_env(&MapEnv::new([(QUEUE_DEPTH_VAR, "8"), (MAX_BYTES_VAR, "8K")])).unwrap();
        assert_eq!((l.queue_depth, l.max_bytes), (8, 8192));
        for (var, v) in [
            (QUEUE_DEPTH_VAR, "0"),
            (QUEUE_DEPTH_VAR, "x"),
            (MAX_BYTES_VAR, "0"),
            (MAX_BYTES_VAR, "65537"),
        ] {
            match NotifyLimits::from_env(&MapEnv::new([(var, v)])) {
                Err(Error::Config { var: named, .. }) => assert_eq!(named, var),
                other => panic!("{var}={v}: {other:?}"),
            }
        }
    }

    proptest! {
        #[test]
        fn bodies_round_trip(from in "[a-z0-9_-]{0,255}", payload in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut out = Vec::new();
            encode_body(&from, &payload, &mut out).unwrap();
            prop_assert_eq!(decode_body(&out), Ok(note(&from, &payload)));
        }

        /// The layout of every body: one byte of name length, the name, the payload, nothing else.
        #[test]
        fn every_body_has_the_pinned_layout(from in "\\PC{0,63}", payload in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut out = Vec::new();
            encode_body(&from, &payload, &mut out).unwrap();
            let mut expected = vec![from.len() as u8];
            expected.extend_from_slice(from.as_bytes());
            expected.extend_from_slice(&payload);
            prop_assert_eq!(out, expected);
        }

        #[test]
        fn garbage_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(n) = decode_body(&body) {
                // An accepted body re-encodes to exactly itself.
                let mut out = Vec::new();
                encode_body(&n.from, &n.payload, &mut out).unwrap();
                prop_assert_eq!(out, body);
            }
        }
    }

    /// The exact bytes of a known body, pinned before the codec moved onto te-base's wire kit: all
    /// four transports put these bytes on the wire, so they must not change.
    #[test]
    fn a_known_body_has_these_exact_bytes() {
        let mut out = Vec::new();
        encode_body("node-1", b"\x00hi\xff", &mut out).unwrap();
        assert_eq!(out, b"\x06node-1\x00hi\xff");
        assert_eq!(decode_body(&out), Ok(note("node-1", b"\x00hi\xff")));
        // Appended to what the buffer holds (a transport's header, say), not over it.
        let mut out = b"hdr".to_vec();
        encode_body("", b"", &mut out).unwrap();
        assert_eq!(out, b"hdr\x00");
        let mut out = Vec::new();
        let name = "n".repeat(MAX_SENDER_NAME);
        encode_body(&name, b"p", &mut out).unwrap();
        assert_eq!(out[0], 255);
        assert_eq!(&out[1..256], name.as_bytes());
        assert_eq!(&out[256..], b"p");
    }

    #[test]
    fn hostile_bodies_are_rejected() {
        assert_eq!(
            decode_body(&[]),
            Err(WireError::Truncated {
                field: "sender name length",
                at: 0,
                need: 1,
                left: 0
            })
        );
        // A name length past the end of the body is refused, not trusted.
        assert_eq!(
            decode_body(&[5, b'a']),
            Err(WireError::Truncated {
                field: "sender name",
                at: 1,
                need: 5,
                left: 1
            })
        );
        assert_eq!(
            decode_body(&[1, 0xff]),
            Err(WireError::BadUtf8 {
                field: "sender name",
                at: 1
            })
        );
        assert_eq!(
            decode_body(&vec![0u8; MAX_BODY_LEN + 1]),
            Err(WireError::TooLarge {
                field: "notification body",
                len: MAX_BODY_LEN as u64 + 1,
                max: MAX_BODY_LEN as u64
            })
        );
    }
}
