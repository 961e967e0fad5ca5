//! Notifications and abort over the recording fake: the fake's two-sided operations (RC order,
//! RNR, length errors, flushes), the credit window, recovery of the notification channel, the
//! shared notification conformance checks, and aborts against a target that stops responding.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use te_base::conformance::{self, ConformanceOptions, ConformancePair};
use te_base::notify::NotifyLimits;
use te_base::{Batch, BatchState, Error, Notification, NotifyInbox, Peer, SubmitContext, Transport};

use super::tests::{config, descriptor, eventually, fabric, qps_created, region, transport, write};
use crate::config::RdmaConfig;
use crate::protocol::qp_state::{connect_transitions, ConnectParams, LocalQpEnd, QpState, RemoteQpEnd};
use crate::verbs::fake::{Call, FakeDevice, RecordingVerbs};
use crate::verbs::{Access, Completion, LinkLayer, Mtu, Opcode, QpCaps, RecvRequest, Verbs, WcStatus, WorkRequest};

fn two_devices() -> Arc<RecordingVerbs> {
    fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ])
}

fn inbox(queue_depth: usize) -> Arc<NotifyInbox> {
    NotifyInbox::new(NotifyLimits {
        queue_depth,
        max_bytes: 4096,
    })
}

// ---------------------------------------------------------------------------------------------
// The fake's receive path, driven directly

/// Two connected RC QPs `a` -> `b` on one fake device (RNR retries `rnr_retry`, 7 = forever), a
/// CQ shared by both, and a registered buffer of 64 KiB.
struct Pair {
    verbs: RecordingVerbs,
    cq: crate::verbs::fake::Handle,
    a: crate::verbs::fake::Handle,
    b: crate::verbs::fake::Handle,
    bqpn: u32,
    buf: Vec<u8>,
    lkey: u32,
}

fn pair(recv_depth: u32, rnr_retry: u8) -> Pair {
    let verbs = RecordingVerbs::new(vec![FakeDevice::roce("mlx5_0", [10, 0, 0, 1])]);
    let ctx = verbs.open_device("mlx5_0").unwrap();
    let pd = verbs.alloc_pd(&ctx).unwrap();
    let cq = verbs.create_cq(&ctx, 1024, None).unwrap();
    let caps = QpCaps {
        max_send_wr: 64,
        max_send_sge: 1,
        max_recv_wr: recv_depth,
    };
    let (a, aqpn) = verbs.create_qp(&pd, &cq, caps).unwrap();
    let (b, bqpn) = verbs.create_qp(&pd, &cq, caps).unwrap();
    let gid = FakeDevice::roce("x", [10, 0, 0, 1]).gids[3];
    for (qp, remote) in [(&a, bqpn), (&b, aqpn)] {
        let local = LocalQpEnd {
            port: 1,
            link_layer: LinkLayer::Ethernet,
            gid_index: 3,
            psn: 1,
            device_max_rd_atomic: 16,
        };
        let remote = RemoteQpEnd {
            qpn: remote,
            psn: 1,
            lid: 0,
            gid,
            link_layer: LinkLayer::Ethernet,
        };
        let params = ConnectParams {
            rnr_retry,
            ..ConnectParams::default()
        };
        for t in connect_transitions(&local, &remote, Mtu::M4096, &params).unwrap() {
            verbs.modify_qp(qp, &t).unwrap();
        }
    }
    let buf = vec![0u8; 64 << 10];
    // SAFETY: `buf` lives in the returned `Pair` with the fake and its registration, and moving
    // a `Vec` does not move its heap buffer; nothing posts after the pair is dropped.
    let (_mr, keys) = unsafe {
        verbs.reg_mr(
            &pd,
            buf.as_ptr() as u64,
            buf.len() as u64,
            Access {
                remote_write: true,
                remote_read: true,
            },
        )
    }
    .unwrap();
    Pair {
        verbs,
        cq,
        a,
        b,
        bqpn,
        lkey: keys.lkey,
        buf,
    }
}

impl Pair {
    fn addr(&self, off: usize) -> u64 {
        self.buf.as_ptr() as u64 + off as u64
    }

    fn send(&self, wr_id: u64, off: usize, len: u32) -> WorkRequest {
        WorkRequest {
            wr_id,
            opcode: Opcode::Send,
            local_addr: self.addr(off),
            len,
            lkey: self.lkey,
            remote_addr: 0,
            rkey: 0,
            signaled: true,
            imm_data: 0,
        }
    }

    fn recv(&self, wr_id: u64, off: usize, len: u32) -> RecvRequest {
        RecvRequest {
            wr_id,
            addr: self.addr(off),
            len,
            lkey: self.lkey,
        }
    }

    fn poll(&self) -> Vec<Completion> {
        let mut out = vec![Completion::default(); 64];
        let n = self.verbs.poll_cq(&self.cq, &mut out).unwrap();
        out.truncate(n);
        out
    }

    fn write_bytes(&mut self, off: usize, bytes: &[u8]) {
        self.buf[off..off + bytes.len()].copy_from_slice(bytes);
    }
}

#[test]
fn fake_sends_fill_receives_in_order_and_fail_with_rnr_when_none_is_posted() {
    let mut p = pair(4, 3);
    p.write_bytes(0, b"first");
    p.write_bytes(16, b"second");
    p.verbs
        .post_recv(&p.b, &[p.recv(100, 1024, 64), p.recv(101, 2048, 64)])
        .unwrap();
    p.verbs
        .post_send(
            &p.a,
            &[p.send(1, 0, 5), p.send(2, 16, 6), p.send(3, 0, 5), p.send(4, 0, 5)],
        )
        .unwrap();
    let c = p.poll();
    let recvs: Vec<(u64, u32, WcStatus)> = c
        .iter()
        .filter(|c| c.qp_num == p.bqpn)
        .map(|c| (c.wr_id, c.byte_len, c.status))
        .collect();
    assert_eq!(recvs, vec![(100, 5, WcStatus::SUCCESS), (101, 6, WcStatus::SUCCESS)]);
    assert_eq!(&p.buf[1024..1029], b"first");
    assert_eq!(&p.buf[2048..2054], b"second");
    let sends: Vec<(u64, WcStatus)> = c
        .iter()
        .filter(|c| c.qp_num != p.bqpn)
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        sends,
        vec![
            (1, WcStatus::SUCCESS),
            (2, WcStatus::SUCCESS),
            (3, WcStatus::RNR_RETRY_EXC_ERR),
            (4, WcStatus::WR_FLUSH_ERR)
        ],
        "the third SEND found no receive: RNR, the QP fails and flushes what follows"
    );
    assert_eq!(p.verbs.qp_state(p.bqpn - 1), Some(QpState::Error));
}

#[test]
fn fake_sends_retrying_rnr_forever_wait_for_a_receive_in_order() {
    let mut p = pair(4, 7);
    p.write_bytes(0, b"one");
    p.write_bytes(16, b"two");
    p.verbs.post_send(&p.a, &[p.send(1, 0, 3), p.send(2, 16, 3)]).unwrap();
    assert!(p.poll().is_empty(), "no receive posted: both wait, uncompleted");
    assert_eq!(p.verbs.held(p.bqpn - 1), 2);
    p.verbs.post_recv(&p.b, &[p.recv(100, 1024, 8)]).unwrap();
    let c: Vec<(u64, WcStatus)> = p.poll().iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        c,
        vec![(100, WcStatus::SUCCESS), (1, WcStatus::SUCCESS)],
        "the first went, in order"
    );
    assert_eq!(&p.buf[1024..1027], b"one");
    p.verbs.post_recv(&p.b, &[p.recv(101, 2048, 8)]).unwrap();
    let c: Vec<u64> = p.poll().iter().map(|c| c.wr_id).collect();
    assert_eq!(c, vec![101, 2]);
    assert_eq!(&p.buf[2048..2051], b"two");
}

#[test]
fn fake_oversized_sends_fail_both_ends_and_immediates_arrive() {
    let p = pair(4, 7);
    p.verbs
        .post_recv(
            &p.b,
            &[p.recv(100, 1024, 0), p.recv(101, 2048, 8), p.recv(102, 4096, 8)],
        )
        .unwrap();
    let imm = WorkRequest {
        opcode: Opcode::RdmaWriteWithImm,
        len: 0,
        imm_data: 0xabcd_0001,
        ..p.send(1, 0, 0)
    };
    p.verbs.post_send(&p.a, &[imm, p.send(2, 0, 16)]).unwrap();
    let c = p.poll();
    let at = |wr_id: u64| c.iter().find(|c| c.wr_id == wr_id).copied().unwrap();
    assert_eq!((at(100).status, at(100).imm), (WcStatus::SUCCESS, Some(0xabcd_0001)));
    assert_eq!(at(101).status, WcStatus::LOC_LEN_ERR, "16 bytes into an 8-byte receive");
    assert_eq!(at(2).status, WcStatus::REM_INV_REQ_ERR);
    assert_eq!(
        at(102).status,
        WcStatus::WR_FLUSH_ERR,
        "the receiver failed and flushed its ring"
    );
    assert_eq!(p.verbs.qp_state(p.bqpn), Some(QpState::Error));
}

#[test]
fn fake_receive_queues_are_bounded() {
    let p = pair(2, 7);
    let err = p
        .verbs
        .post_recv(&p.b, &[p.recv(1, 0, 8), p.recv(2, 8, 8), p.recv(3, 16, 8)])
        .unwrap_err();
    assert_eq!((err.posted, err.errno), (2, libc::ENOMEM));
    assert_eq!(p.verbs.posted_recvs(p.bqpn), 2);
}

// ---------------------------------------------------------------------------------------------
// Notifications through the transport

async fn notify_one(peer: &Arc<dyn Peer>, from: &str, payload: &[u8]) -> Result<(), Error> {
    let opts = ConformanceOptions {
        timeout: Duration::from_secs(30),
        ..ConformanceOptions::default()
    };
    conformance::notify::notify(
        peer,
        Notification {
            from: from.into(),
            payload: payload.to_vec(),
        },
        &opts,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_conformance_over_the_fake() {
    let verbs = two_devices();
    let cfg = RdmaConfig {
        max_mr_size: Some(16 << 20),
        ..config()
    };
    let target = transport(&verbs, &["mlx5_1"], "target", cfg.clone()).await;
    let inbox = inbox(64);
    target.deliver_notifications_to(inbox.clone());
    let pair = ConformancePair {
        initiator: transport(&verbs, &["mlx5_0"], "initiator", cfg).await,
        target,
        target_name: "target".into(),
    };
    conformance::notify::run_all(&pair, &inbox, &ConformanceOptions::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_notifications_in_flight_never_overrun_the_targets_receives() {
    let verbs = two_devices();
    // No RNR retries: a SEND that finds no receive posted fails the QP at once.
    let strict = RdmaConfig {
        connect: ConnectParams {
            rnr_retry: 0,
            ..ConnectParams::default()
        },
        ..config()
    };
    let a = transport(&verbs, &["mlx5_0"], "a", strict).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    let rx = inbox(1024);
    b.deliver_notifications_to(rx.clone());
    let dst = region(&b, 4096, true, 0).await;
    verbs.clear_calls();
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let slot0 = qps_created(&verbs.calls())[0];
    // Far more than the target's credits, handed over at once.
    const N: usize = 500;
    let state = BatchState::new(vec![1; N].into());
    for i in 0..N {
        let note = Notification {
            from: "a".into(),
            payload: (i as u32).to_le_bytes().to_vec(),
        };
        peer.notify(note, &state, i).unwrap();
    }
    let report = tokio::time::timeout(Duration::from_secs(60), Batch::new(state).wait()).await;
    assert!(matches!(report, Ok(Ok(_))), "every notification accepted: {report:?}");
    for i in 0..N {
        let n = rx.try_recv().unwrap_or_else(|| panic!("notification {i} missing"));
        assert_eq!(n.payload, (i as u32).to_le_bytes(), "in order");
    }
    assert_eq!(verbs.qp_state(slot0), Some(QpState::Rts), "no RNR ever broke the QP");
    let sends = verbs
        .calls()
        .iter()
        .filter(|c| matches!(c, Call::PostSend { qpn, wrs } if *qpn == slot0 && wrs[0].opcode == Opcode::Send))
        .count();
    assert_eq!(sends, N, "each notification sent exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_without_an_inbox_advertises_none_and_notify_says_so() {
    let verbs = two_devices();
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    assert!(b.endpoint().get("notify").is_none());
    let dst = region(&b, 4096, true, 0).await;
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let state = BatchState::new(vec![1].into());
    let note = Notification {
        from: "a".into(),
        payload: vec![1],
    };
    assert!(matches!(peer.notify(note, &state, 0), Err(Error::NotAvailable { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_lost_with_its_qp_fails_and_the_next_goes_through_the_reestablished_qp() {
    let verbs = two_devices();
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    let rx = inbox(16);
    b.deliver_notifications_to(rx.clone());
    let dst = region(&b, 4096, true, 0).await;
    verbs.clear_calls();
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let slot0 = qps_created(&verbs.calls())[0];
    notify_one(&peer, "a", b"before").await.unwrap();
    verbs.fail_next_wr(slot0, WcStatus::RETRY_EXC_ERR);
    match notify_one(&peer, "a", b"lost").await {
        Err(Error::PeerGone { .. }) => {}
        other => panic!("a SEND that failed with its QP answered {other:?}"),
    }
    eventually("slot 0 re-established", || verbs.qp_state(slot0) == Some(QpState::Rts)).await;
    notify_one(&peer, "a", b"after").await.unwrap();
    let got: Vec<Vec<u8>> = std::iter::from_fn(|| rx.try_recv()).map(|n| n.payload).collect();
    assert_eq!(got, vec![b"before".to_vec(), b"after".to_vec()]);
}

// ---------------------------------------------------------------------------------------------
// Abort

/// A write batch to a target whose device stopped responding, and what must outlive it.
struct Stalled {
    peer: Arc<dyn Peer>,
    state: Arc<BatchState>,
    /// The initiator's QPs.
    qps: Vec<u32>,
    _keep: (
        Arc<super::tests::Fake>,
        Arc<super::tests::Fake>,
        super::tests::Region,
        super::tests::Region,
    ),
}

/// Posts a batch of `n` writes to a target whose device stopped responding: held, unanswered.
async fn stalled_batch(verbs: &Arc<RecordingVerbs>, cfg: RdmaConfig, n: u32) -> Stalled {
    let a = transport(verbs, &["mlx5_0"], "a", cfg.clone()).await;
    let b = transport(verbs, &["mlx5_1"], "b", cfg).await;
    let src = region(&a, 1 << 20, false, 1).await;
    let dst = region(&b, 1 << 20, true, 2).await;
    verbs.clear_calls();
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let initiator_qps = qps_created(&verbs.calls())[..2].to_vec();
    verbs.stop_responding("mlx5_1");
    let reqs = (0..n)
        .map(|i| write(i, &src, u64::from(i) * 4096, &dst, 0, u64::from(i) * 4096, 4096))
        .collect();
    let state = BatchState::new(vec![4096; n as usize].into());
    peer.submit(reqs, &state, &SubmitContext::default()).unwrap();
    Stalled {
        peer,
        state,
        qps: initiator_qps,
        _keep: (a, b, src, dst),
    }
}

fn timeout() -> Error {
    Error::Timeout {
        what: "batch (its deadline)".into(),
        after_ms: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_on_a_silent_target_fails_the_batch_with_timeout_only_after_the_flush() {
    let verbs = two_devices();
    let Stalled {
        peer,
        state,
        qps,
        _keep,
    } = stalled_batch(&verbs, config(), 8).await;
    let held: usize = qps.iter().map(|&q| verbs.held(q)).sum();
    assert_eq!(held, 8, "the silent target holds every write unanswered");
    assert!(!state.is_complete());
    // What the engine's deadline timer does; the batch's completion releases its pins.
    let seen = Arc::new(Mutex::new(None));
    let probe = (verbs.clone(), seen.clone());
    state.on_complete(Box::new(move |_| {
        *probe.1.lock() = Some((probe.0.held_total(), probe.0.unpolled(), probe.0.flushed()));
    }));
    assert!(peer.abort(timeout()));
    let batch = Batch::new(state);
    let err = tokio::time::timeout(Duration::from_secs(30), batch.wait())
        .await
        .expect("the abort settles the batch")
        .unwrap_err();
    assert_eq!(err.progress.failed, 8);
    assert!(
        err.failures.iter().all(|(_, e)| matches!(e, Error::Timeout { .. })),
        "{err:?}"
    );
    let (held, unpolled, flushed) = seen.lock().expect("hook ran");
    assert_eq!(held, 0, "pins released while writes were still queued at the device");
    assert_eq!(unpolled, 0, "pins released before the flush completions came back");
    assert!(flushed >= 8);
    for q in qps {
        assert_eq!(verbs.qp_state(q), Some(QpState::Error));
    }
    assert!(!peer.is_healthy());
    let again = BatchState::new(vec![1].into());
    assert!(matches!(
        peer.submit(Vec::new(), &again, &SubmitContext::default()),
        Err(Error::PeerGone { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_whose_flushes_never_come_destroys_the_qps_before_releasing_anything() {
    let verbs = two_devices();
    verbs.stop_flushing("mlx5_0");
    let cfg = RdmaConfig {
        abort_flush_grace: Duration::from_millis(200),
        ..config()
    };
    let Stalled {
        peer,
        state,
        qps,
        _keep,
    } = stalled_batch(&verbs, cfg, 4).await;
    let holding: Vec<u32> = qps.iter().copied().filter(|&q| verbs.held(q) > 0).collect();
    assert!(!holding.is_empty());
    let destroyed_at_settle = Arc::new(Mutex::new(None));
    let probe = (verbs.clone(), destroyed_at_settle.clone(), qps.clone());
    state.on_complete(Box::new(move |_| {
        let calls = probe.0.calls();
        let destroyed: Vec<u32> = probe
            .2
            .iter()
            .copied()
            .filter(|q| calls.contains(&Call::DestroyQp { qpn: *q }))
            .collect();
        *probe.1.lock() = Some(destroyed);
    }));
    assert!(peer.abort(timeout()));
    assert!(
        !state.is_complete(),
        "no flush can have come back: the abort must still be waiting"
    );
    let batch = Batch::new(state);
    let err = tokio::time::timeout(Duration::from_secs(30), batch.wait())
        .await
        .expect("the grace bounds the abort")
        .unwrap_err();
    assert_eq!(err.progress.failed, 4);
    let destroyed = destroyed_at_settle.lock().clone().expect("hook ran");
    assert_eq!(
        destroyed, holding,
        "every QP that held writes was destroyed before the pins went"
    );
}

/// Waits until slot `qpn` was reset and is back in RTS.
async fn reestablished(verbs: &RecordingVerbs, qpn: u32, resets: usize) {
    eventually("the QP re-established", || {
        let calls = verbs.calls();
        let n = super::tests::transitions_of(&calls, qpn)
            .iter()
            .filter(|t| matches!(t, crate::protocol::qp_state::QpTransition::ToReset))
            .count();
        n >= resets && verbs.qp_state(qpn) == Some(QpState::Rts)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_messages_are_answered_malformed_or_cut_only_their_qp() {
    use crate::protocol::notify_wire::{encode_answer, Outcome};
    use crate::verbs::fake::Handle;
    let verbs = two_devices();
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    let rx = inbox(16);
    b.deliver_notifications_to(rx.clone());
    let src = region(&a, 64 << 10, false, 3).await;
    let dst = region(&b, 4096, true, 0).await;
    verbs.clear_calls();
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let qps = qps_created(&verbs.calls());
    let (slot0, ring) = (qps[0], qps[2]);
    assert_eq!(
        verbs.posted_recvs(ring),
        16,
        "the target's slot-0 QP has its ring posted"
    );
    let lkey = verbs.lkey_of(src.info.base, 64 << 10).unwrap();
    // Raw SENDs from the initiator's slot-0 QP, as a peer that ignores the format would post.
    let raw = |len: u32| WorkRequest {
        wr_id: 1 << 40,
        opcode: Opcode::Send,
        local_addr: src.info.base,
        len,
        lkey,
        remote_addr: 0,
        rkey: 0,
        signaled: true,
        imm_data: 0,
    };
    // The region's pattern starts with byte 3: not a version-1 message.
    verbs.post_send(&Handle(slot0), &[raw(64)]).unwrap();
    let malformed = encode_answer(Outcome::Malformed, 0);
    eventually("the target answered it as malformed", || {
        verbs
            .calls()
            .iter()
            .any(|c| matches!(c, Call::PostSend { qpn, wrs } if *qpn == ring && wrs[0].imm_data == malformed))
    })
    .await;
    assert!(rx.is_empty(), "nothing of it was queued");
    // The unexpected answer breaks the initiator's channel: its QP is re-established.
    reestablished(&verbs, slot0, 1).await;
    notify_one(&peer, "a", b"between").await.unwrap();
    let new_ring = *qps_created(&verbs.calls()).last().unwrap();
    // Longer than a receive buffer (8 + 256 + 4096 bytes): fails the target's receive and QP.
    verbs.post_send(&Handle(slot0), &[raw(8192)]).unwrap();
    eventually("the target's ring QP failed", || verbs.entered_error(new_ring)).await;
    reestablished(&verbs, slot0, 2).await;
    notify_one(&peer, "a", b"after").await.unwrap();
    let got: Vec<Vec<u8>> = std::iter::from_fn(|| rx.try_recv()).map(|n| n.payload).collect();
    assert_eq!(got, vec![b"between".to_vec(), b"after".to_vec()]);
    assert!(
        verbs.calls().contains(&Call::DestroyQp { qpn: new_ring }),
        "the failed ring was replaced"
    );
}

/// A deadline cuts short its own batch only. Two batches are held by a silent target on both
/// QPs; cutting one moves those QPs to ERROR: its requests fail with the timeout once every
/// piece came back flushed, and the other batch's pieces go again once the QPs are
/// re-established, completing byte for byte when the target answers again. The connection is
/// not aborted. (Before, the default cut the whole connection and both batches failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_cuts_only_its_own_batch_and_the_others_go_on() {
    let verbs = two_devices();
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    let src = region(&a, 1 << 20, false, 1).await;
    let dst = region(&b, 1 << 20, true, 2).await;
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    verbs.stop_responding("mlx5_1");
    let submit = |first: u64| {
        let reqs = (0..8u32)
            .map(|i| {
                let off = (first + u64::from(i)) * 4096;
                write(i, &src, off, &dst, 0, off, 4096)
            })
            .collect();
        let state = BatchState::new(vec![4096; 8].into());
        peer.submit(reqs, &state, &SubmitContext::default()).unwrap();
        state
    };
    let cut = submit(0);
    let other = submit(8);
    eventually("both batches held by the silent target", || verbs.held_total() == 16).await;
    assert!(peer.abort_batch(&cut, timeout()));
    let err = tokio::time::timeout(Duration::from_secs(30), Batch::new(cut).wait())
        .await
        .expect("the cut batch settles once its pieces came back")
        .unwrap_err();
    assert_eq!(err.progress.failed, 8, "{err:?}");
    assert!(
        err.failures.iter().all(|(_, e)| matches!(e, Error::Timeout { .. })),
        "{err:?}"
    );
    assert!(!other.is_complete(), "the other batch is still on its way");
    verbs.resume_responding("mlx5_1");
    let report = tokio::time::timeout(Duration::from_secs(30), Batch::new(other).wait())
        .await
        .expect("the other batch settles once the target answers");
    assert!(report.is_ok(), "another batch's deadline failed it: {report:?}");
    // SAFETY: both batches settled; nothing writes these buffers any more.
    let (s, d) = unsafe {
        (
            std::slice::from_raw_parts(src.buf.as_ptr(), 1 << 20),
            std::slice::from_raw_parts(dst.buf.as_ptr(), 1 << 20),
        )
    };
    assert!(
        s[8 * 4096..16 * 4096] == d[8 * 4096..16 * 4096],
        "the other batch's bytes landed"
    );
    assert!(peer.is_healthy(), "the connection was not aborted");
}
