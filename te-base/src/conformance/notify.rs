//! Conformance checks of notifications ([`Peer::notify`]): run by every transport's tests with
//! the inbox its target delivers into.
//!
//! - [`notified_batches`]: many pipelined write batches, each sending a notification from its
//!   completion hook (as the engine does). Every byte of a batch must be in the target's memory
//!   when its notification is delivered (checked by an inbox observer on the delivering thread,
//!   so a notification that overtakes its data fails deterministically) and again when a reader
//!   on another thread takes it; and they must arrive in exactly the order the batches completed.
//! - [`inbox_bounds`]: a full inbox refuses with `NotificationQueueFull` at the sender, a payload
//!   above the target's maximum with `NotificationTooLarge`, and both recover.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{connect, region, release, ConformanceOptions, ConformancePair};
use crate::batch::{Batch, BatchState};
use crate::error::Error;
use crate::notify::{Notification, NotifyInbox};
use crate::request::{ResolvedRequest, TransferOp};
use crate::transport::{Peer, SubmitContext};

/// Runs every notification check.
pub async fn run_all(pair: &ConformancePair, inbox: &Arc<NotifyInbox>, opts: &ConformanceOptions) {
    super::checked(pair, "notify::notified_batches", notified_batches(pair, inbox, opts)).await;
    super::checked(pair, "notify::inbox_bounds", inbox_bounds(pair, inbox, opts)).await;
}

/// Sends one bare notification and waits for the target's answer.
pub async fn notify(peer: &Arc<dyn Peer>, note: Notification, opts: &ConformanceOptions) -> Result<(), Error> {
    let state = BatchState::new(vec![0].into());
    peer.notify(note, &state, 0)?;
    match tokio::time::timeout(opts.timeout, Batch::new(state).wait()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.into_first_error()),
        Err(_) => panic!("notification not answered within {:?}", opts.timeout),
    }
}

fn drain(inbox: &NotifyInbox) {
    while inbox.try_recv().is_some() {}
}

/// Pipelined notified batches: data in place when each notification is read, and notifications
/// in the order the batches completed.
pub async fn notified_batches(pair: &ConformancePair, inbox: &Arc<NotifyInbox>, opts: &ConformanceOptions) {
    const BATCHES: usize = 32;
    const PARTS: u64 = 4;
    let name = pair.initiator.name();
    drain(inbox);
    // Large enough that a notification overtaking its data would be caught mid-copy.
    let slot = (opts.max_bytes / 8).clamp(64 << 10, 1 << 20);
    let total = slot as usize * BATCHES;
    let (src, _) = region(&pair.initiator, total, false).await;
    let (dst, dkey) = region(&pair.target, total, true).await;
    src.fill(16);
    let peer = connect(pair, &[(&dst, &dkey)]).await;

    // The target's checks: each batch's bytes at delivery (observer) and at reading (reader).
    let expected: Arc<Vec<u8>> = Arc::new(src.bytes().to_vec());
    let dst_addr = dst.info.base as usize;
    let early: Arc<Mutex<Vec<String>>> = Arc::default();
    {
        let (expected, early) = (expected.clone(), early.clone());
        inbox.observe(Some(Box::new(move |n: &Notification| {
            if let Err(e) = slot_in_place(n, dst_addr, slot as usize, &expected) {
                early.lock().push(format!("at delivery: {e}"));
            }
        })));
    }
    let reader_inbox = inbox.clone();
    let timeout = opts.timeout;
    let reader = std::thread::spawn(move || {
        let mut order = Vec::with_capacity(BATCHES);
        for _ in 0..BATCHES {
            let Some(n) = reader_inbox.recv_blocking(timeout) else {
                return Err(format!("only {} of {BATCHES} notifications arrived", order.len()));
            };
            let k = slot_in_place(&n, dst_addr, slot as usize, &expected).map_err(|e| format!("when read: {e}"))?;
            order.push(k);
        }
        Ok(order)
    });

    let completed: Arc<Mutex<Vec<u32>>> = Arc::new(Mutex::new(Vec::with_capacity(BATCHES)));
    let answers = BatchState::new(vec![0; BATCHES].into());
    let mut batches = Vec::with_capacity(BATCHES);
    for k in 0..BATCHES {
        let part = slot / PARTS;
        let reqs: Vec<ResolvedRequest> = (0..PARTS)
            .map(|i| {
                let off = k as u64 * slot + i * part;
                let len = if i + 1 == PARTS { slot - i * part } else { part };
                ResolvedRequest {
                    index: i as u32,
                    op: TransferOp::Write,
                    len,
                    local_addr: src.info.base + off,
                    local_region: src.info.id,
                    remote_addr: dst.info.base + off,
                    remote_buffer: 0,
                }
            })
            .collect();
        let state = BatchState::new(reqs.iter().map(|r| r.len).collect());
        let (p, order, ans) = (peer.clone(), completed.clone(), answers.clone());
        state.on_complete(Box::new(move |b| {
            if !b.succeeded() {
                ans.cancel(k);
                return;
            }
            // Held across the hand-over, so the recorded order is the order of `notify` calls.
            let mut order = order.lock();
            order.push(k as u32);
            let note = Notification {
                from: "conformance-initiator".into(),
                payload: (k as u32).to_le_bytes().to_vec(),
            };
            if let Err(e) = p.notify(note, &ans, k) {
                ans.fail(k, e);
            }
        }));
        if let Err(e) = peer.submit(reqs, &state, &SubmitContext::default()) {
            state.fail_many(0..PARTS as usize, &e);
        }
        batches.push(Batch::new(state));
    }
    for (k, b) in batches.iter().enumerate() {
        let r = tokio::time::timeout(opts.timeout, b.wait()).await;
        assert!(
            matches!(r, Ok(Ok(_))),
            "{name}: notified batch {k} did not complete: {r:?}"
        );
    }
    let r = tokio::time::timeout(opts.timeout, Batch::new(answers).wait()).await;
    assert!(matches!(r, Ok(Ok(_))), "{name}: notifications not all accepted: {r:?}");
    let received = tokio::task::spawn_blocking(move || reader.join())
        .await
        .expect("join the reader")
        .expect("reader thread panicked");
    inbox.observe(None);
    let early = early.lock().clone();
    assert!(
        early.is_empty(),
        "{name}: {} notification(s) delivered before their data, first: {}",
        early.len(),
        early[..early.len().min(3)].join("; ")
    );
    let received = received.unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(
        received,
        *completed.lock(),
        "{name}: notifications arrived out of the order their batches completed"
    );
    release(&pair.initiator, &[&src]).await;
    release(&pair.target, &[&dst]).await;
}

/// Checks that the slot of the batch `n` names holds its data; returns the batch number.
fn slot_in_place(n: &Notification, dst_addr: usize, slot: usize, expected: &[u8]) -> Result<u32, String> {
    let k: [u8; 4] = n
        .payload
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or("short payload")?;
    let k = u32::from_le_bytes(k);
    let at = k as usize * slot;
    let want = expected.get(at..at + slot).ok_or("batch number out of range")?;
    // SAFETY: the slot lies in the live, registered destination buffer (the check ends before it
    // is released); batch k is its only writer, and reading it racing that write is the point.
    let got = unsafe { std::slice::from_raw_parts((dst_addr + at) as *const u8, slot) };
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(p) => Err(format!(
            "notification of batch {k} while byte {p} of its data was not in place"
        )),
        None => Ok(k),
    }
}

/// A full inbox and an oversized payload are typed errors at the sender; both recover.
pub async fn inbox_bounds(pair: &ConformancePair, inbox: &Arc<NotifyInbox>, opts: &ConformanceOptions) {
    let name = pair.initiator.name();
    let limits = inbox.limits();
    assert!(
        limits.queue_depth <= 4096,
        "{name}: give the conformance target a small inbox (queue depth {} is slow to fill)",
        limits.queue_depth
    );
    drain(inbox);
    let (dst, dkey) = region(&pair.target, 4096, true).await;
    let peer = connect(pair, &[(&dst, &dkey)]).await;
    let note = |i: usize, len: usize| Notification {
        from: "conformance-initiator".into(),
        payload: (0..len).map(|j| (i + j) as u8).collect(),
    };
    for i in 0..limits.queue_depth {
        if let Err(e) = notify(&peer, note(i, 8), opts).await {
            panic!("{name}: notification {i} of {} refused: {e}", limits.queue_depth);
        }
    }
    match notify(&peer, note(0, 8), opts).await {
        Err(Error::NotificationQueueFull { peer }) => assert_eq!(peer, pair.target_name, "{name}: names the target"),
        other => panic!("{name}: a full inbox answered {other:?}, not NotificationQueueFull"),
    }
    for i in 0..limits.queue_depth {
        assert_eq!(
            inbox.try_recv(),
            Some(note(i, 8)),
            "{name}: notification {i} lost or reordered"
        );
    }
    assert_eq!(inbox.try_recv(), None, "{name}: the refused notification was queued");

    let big = limits.max_bytes + 1;
    if big <= crate::notify::MAX_PAYLOAD_LIMIT {
        match notify(&peer, note(1, big), opts).await {
            Err(Error::NotificationTooLarge { len, max, .. }) => {
                assert_eq!((len, max), (big, limits.max_bytes), "{name}: sizes in the refusal")
            }
            other => panic!("{name}: a payload of {big} bytes answered {other:?}, not NotificationTooLarge"),
        }
    }
    // Both refusals leave the connection usable.
    notify(&peer, note(2, limits.max_bytes), opts)
        .await
        .unwrap_or_else(|e| panic!("{name}: notification after refusals: {e}"));
    let got = inbox.recv_blocking(Duration::from_secs(10));
    assert_eq!(got, Some(note(2, limits.max_bytes)), "{name}: largest accepted payload");
    release(&pair.target, &[&dst]).await;
}
