//! The transport over the recording fake: connection, MTU negotiation, work-request batching,
//! completion accounting, error and retry paths, QP re-establishment, remote keys per rail,
//! registration splitting, and the shared conformance suite with byte verification.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::conformance::{self, ConformanceOptions, ConformancePair};
use te_base::{
    Batch, BatchState, Error, ExportedBuffer, HostBuffer, HostBufferOptions, MemoryLocation, Peer, RegionId,
    RegionInfo, RequestStatus, ResolvedRequest, SegmentDescriptor, SubmitContext, TransferOp, Transport,
    TransportEndpoint,
};

use super::RdmaTransport;
use crate::config::RdmaConfig;
use crate::protocol::handshake::{
    decode, encode, frame_len, hex32, AuthMessage, ConnectRequest, ConnectResponse, QpOffer, MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
};
use crate::protocol::qp_state::{QpState, QpTransition};
use crate::protocol::remote_keys::BufferKeys;
use crate::verbs::fake::{Call, FakeDevice, RecordingVerbs};
use crate::verbs::{Mtu, Opcode, WcStatus};

pub(super) type Fake = RdmaTransport<RecordingVerbs>;

pub(super) fn config() -> RdmaConfig {
    RdmaConfig {
        handshake_addr: Some("127.0.0.1:0".parse().unwrap()),
        backoff_ms: (1, 4),
        ..RdmaConfig::default()
    }
}

pub(super) fn fabric(devices: Vec<FakeDevice>) -> Arc<RecordingVerbs> {
    Arc::new(RecordingVerbs::new(devices))
}

pub(super) async fn transport(
    verbs: &Arc<RecordingVerbs>,
    devices: &[&str],
    name: &str,
    config: RdmaConfig,
) -> Arc<Fake> {
    transport_with_key(verbs, devices, name, config, None).await
}

async fn transport_with_key(
    verbs: &Arc<RecordingVerbs>,
    devices: &[&str],
    name: &str,
    config: RdmaConfig,
    auth: Option<te_base::auth::AuthKey>,
) -> Arc<Fake> {
    let devices: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
    let t = RdmaTransport::start(
        verbs.clone(),
        &devices,
        None,
        Vec::new(),
        config,
        name,
        Path::new("/nonexistent-sysfs"),
        auth,
    )
    .await
    .expect("start over the fake");
    Arc::new(t)
}

pub(super) struct Region {
    pub(super) buf: HostBuffer,
    pub(super) info: RegionInfo,
    pub(super) key: serde_json::Value,
}

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(super) async fn region(t: &Fake, len: usize, exported: bool, seed: u8) -> Region {
    let buf = HostBuffer::allocate(len, HostBufferOptions::default()).unwrap();
    // SAFETY: freshly allocated, `len` bytes, nothing else touches it yet.
    let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), len) };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    let info = RegionInfo {
        id: RegionId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
        base: buf.addr(),
        len: len as u64,
        location: MemoryLocation::HOST,
        exported,
    };
    let key = t.register(std::slice::from_ref(&info)).await.unwrap().remove(0);
    Region { buf, info, key }
}

pub(super) fn bytes(r: &Region) -> &[u8] {
    // SAFETY: live buffer; read after the batches touching it completed.
    unsafe { std::slice::from_raw_parts(r.buf.as_ptr(), r.buf.len()) }
}

pub(super) fn descriptor(target: &Fake, name: &str, exported: &[&Region]) -> SegmentDescriptor {
    let mut d = SegmentDescriptor::new(name, 1);
    d.transports.push(TransportEndpoint {
        transport: "rdma".into(),
        info: target.endpoint(),
    });
    for r in exported {
        d.buffers.push(ExportedBuffer {
            base: r.info.base,
            len: r.info.len,
            location: MemoryLocation::HOST,
            keys: [("rdma".to_string(), r.key.clone())].into_iter().collect(),
        });
    }
    d.buffers.sort_by_key(|b| b.base);
    d
}

pub(super) fn write(
    index: u32,
    src: &Region,
    off: u64,
    dst: &Region,
    dst_buffer: u32,
    roff: u64,
    len: u64,
) -> ResolvedRequest {
    ResolvedRequest {
        index,
        op: TransferOp::Write,
        len,
        local_addr: src.info.base + off,
        local_region: src.info.id,
        remote_addr: dst.info.base + roff,
        remote_buffer: dst_buffer,
    }
}

pub(super) async fn run(peer: &Arc<dyn Peer>, reqs: Vec<ResolvedRequest>) -> Vec<RequestStatus> {
    let n = reqs.len();
    let state = BatchState::new(reqs.iter().map(|r| r.len).collect());
    peer.submit(reqs, &state, &SubmitContext::default()).unwrap();
    let batch = Batch::new(state);
    let waited = tokio::time::timeout(Duration::from_secs(60), batch.wait()).await;
    assert!(waited.is_ok(), "batch of {n} requests did not complete in 60 s");
    (0..n).map(|i| batch.status(i).unwrap()).collect()
}

/// Waits until `cond` holds (QP re-establishment happens on other tasks), failing after 30 s.
pub(super) async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

pub(super) fn qps_created(calls: &[Call]) -> Vec<u32> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::CreateQp { qpn, .. } => Some(*qpn),
            _ => None,
        })
        .collect()
}

pub(super) fn transitions_of(calls: &[Call], qpn: u32) -> Vec<QpTransition> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::ModifyQp { qpn: q, transition } if *q == qpn => Some(*transition),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_programs_both_sides_with_each_others_qpn_psn_and_the_smaller_mtu() {
    let mut slow = FakeDevice::roce("mlx5_1", [10, 0, 0, 2]);
    slow.port.active_mtu = Mtu::M1024;
    let verbs = fabric(vec![FakeDevice::roce("mlx5_0", [10, 0, 0, 1]), slow]);
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    let dst = region(&b, 4096, true, 0).await;
    verbs.clear_calls();
    let _peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let calls = verbs.calls();
    let qpns = qps_created(&calls);
    assert_eq!(
        qpns.len(),
        4,
        "2 initiator QPs (TE_RDMA_QPS_PER_PEER default) + 2 target QPs"
    );
    let (mine, theirs) = qpns.split_at(2);
    for (&m, &t) in mine.iter().zip(theirs) {
        let tm = transitions_of(&calls, m);
        let tt = transitions_of(&calls, t);
        assert_eq!(tm.len(), 3, "RESET->INIT->RTR->RTS");
        assert_eq!(tt.len(), 3);
        let (
            QpTransition::ToRtr {
                dest_qpn: md,
                rq_psn: mr,
                path_mtu: mm,
                ..
            },
            QpTransition::ToRts { sq_psn: ms, .. },
        ) = (tm[1], tm[2])
        else {
            panic!("initiator transitions {tm:?}");
        };
        let (
            QpTransition::ToRtr {
                dest_qpn: td,
                rq_psn: tr,
                path_mtu: tmtu,
                ..
            },
            QpTransition::ToRts { sq_psn: ts, .. },
        ) = (tt[1], tt[2])
        else {
            panic!("target transitions {tt:?}");
        };
        assert_eq!((md, td), (t, m), "each side targets the other's QP");
        assert_eq!((mr, tr), (ts, ms), "each side expects the other's send PSN");
        assert_eq!(
            (mm, tmtu),
            (Mtu::M1024, Mtu::M1024),
            "MTU negotiated down to the smaller side"
        );
        assert_eq!(verbs.qp_state(m), Some(QpState::Rts));
        assert_eq!(verbs.qp_state(t), Some(QpState::Rts));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_respect_the_send_queue_and_signal_every_n() {
    let verbs = fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]);
    let cfg = RdmaConfig {
        qps_per_peer: 1,
        send_queue_depth: 8,
        signal_every: 3,
        ..config()
    };
    let a = transport(&verbs, &["mlx5_0"], "a", cfg.clone()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", cfg).await;
    let src = region(&a, 1 << 20, false, 1).await;
    let dst = region(&b, 1 << 20, true, 2).await;
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    verbs.clear_calls();
    let reqs: Vec<_> = (0..50)
        .map(|i| write(i, &src, i as u64 * 4096, &dst, 0, i as u64 * 4096, 4096))
        .collect();
    let statuses = run(&peer, reqs).await;
    assert!(statuses
        .iter()
        .all(|s| matches!(s, RequestStatus::Done { bytes: 4096 })));
    assert_eq!(&bytes(&dst)[..50 * 4096], &bytes(&src)[..50 * 4096]);
    let posts: Vec<Vec<crate::verbs::WorkRequest>> = verbs
        .calls()
        .into_iter()
        .filter_map(|c| match c {
            Call::PostSend { wrs, .. } => Some(wrs),
            _ => None,
        })
        .collect();
    let total: usize = posts.iter().map(|p| p.len()).sum();
    assert_eq!(total, 50, "one WR per 4 KiB request");
    for p in &posts {
        assert!(p.len() <= 8, "a post never exceeds the send queue depth: {}", p.len());
        assert!(p.last().unwrap().signaled, "the last WR of every post is signalled");
        let mut run = 0;
        for wr in p {
            run = if wr.signaled { 0 } else { run + 1 };
            assert!(run < 3, "at most signal_every-1 unsignalled WRs in a row");
            assert_eq!(wr.opcode, Opcode::RdmaWrite);
        }
    }
    let signalled = posts.iter().flatten().filter(|w| w.signaled).count();
    assert!(signalled < 50, "not every WR is signalled ({signalled})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_registrations_are_split_and_each_rail_uses_its_own_keys() {
    let verbs = fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 1, 1]),
        FakeDevice::roce("mlx5_2", [10, 0, 0, 2]),
        FakeDevice::roce("mlx5_3", [10, 0, 1, 2]),
    ]);
    let cfg = RdmaConfig {
        max_mr_size: Some(1 << 20),
        qps_per_peer: 1,
        ..config()
    };
    let a = transport(&verbs, &["mlx5_0", "mlx5_1"], "a", cfg.clone()).await;
    let b = transport(&verbs, &["mlx5_2", "mlx5_3"], "b", cfg).await;
    let len = (3 << 20) + (1 << 19);
    verbs.clear_calls();
    let dst = region(&b, len, true, 3).await;
    let regs = verbs.calls().iter().filter(|c| matches!(c, Call::RegMr { .. })).count();
    assert_eq!(
        regs, 8,
        "3.5 MiB at a 1 MiB max MR size: 4 registrations on each of 2 rails"
    );
    let keys: BufferKeys = serde_json::from_value(dst.key.clone()).unwrap();
    assert_eq!(keys.chunk, 1 << 20);
    assert_eq!(keys.rkeys.len(), 2);
    assert!(keys.rkeys.iter().all(|r| r.len() == 4));
    assert_ne!(keys.rkeys[0], keys.rkeys[1], "each rail has its own keys");

    let src = region(&a, len, false, 4).await;
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let qpns = qps_created(&verbs.calls());
    let initiator_qp_rail = |qpn: u32| qpns.iter().position(|&q| q == qpn).filter(|&i| i < 2);
    verbs.clear_calls();
    // One request crossing every chunk boundary, from an unaligned offset: striped over both rails.
    let statuses = run(&peer, vec![write(0, &src, 1000, &dst, 0, 777, len as u64 - 2000)]).await;
    assert!(matches!(statuses[0], RequestStatus::Done { .. }), "{statuses:?}");
    assert_eq!(&bytes(&dst)[777..777 + len - 2000], &bytes(&src)[1000..len - 1000]);
    let mut rails_used = [false; 2];
    for c in verbs.calls() {
        if let Call::PostSend { qpn, wrs } = c {
            let rail = initiator_qp_rail(qpn).expect("posted on an initiator QP");
            rails_used[rail] = true;
            for wr in wrs {
                let chunk = ((wr.remote_addr - dst.info.base) >> 20) as usize;
                assert_eq!(
                    wr.rkey, keys.rkeys[rail][chunk],
                    "rail {rail} must use its own rkey of chunk {chunk}"
                );
                let end = wr.remote_addr + u64::from(wr.len) - 1;
                assert_eq!((end - dst.info.base) >> 20, chunk as u64, "a WR crosses a remote chunk");
            }
        }
    }
    assert_eq!(rails_used, [true, true], "striped across both rails");
}

/// `TE_STRIPE_MIN_BYTES` decides whether one request is striped over the rails: a 512 KiB write
/// goes over both rails under the default threshold (128 KiB) and over one above it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stripe_threshold_decides_whether_a_request_uses_every_rail() {
    use te_base::config::MapEnv;
    let from_env = RdmaConfig::from_env(&MapEnv::new([("TE_STRIPE_MIN_BYTES", "1M")])).unwrap();
    assert_eq!(from_env.stripe_min_bytes, 1 << 20);
    assert!(RdmaConfig::from_env(&MapEnv::new([("TE_STRIPE_MIN_BYTES", "12Q")])).is_err());
    for (threshold, rails) in [(None, 2), (Some(from_env.stripe_min_bytes), 1)] {
        let verbs = fabric(vec![
            FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
            FakeDevice::roce("mlx5_1", [10, 0, 1, 1]),
            FakeDevice::roce("mlx5_2", [10, 0, 0, 2]),
            FakeDevice::roce("mlx5_3", [10, 0, 1, 2]),
        ]);
        let mut cfg = RdmaConfig {
            qps_per_peer: 1,
            ..config()
        };
        if let Some(t) = threshold {
            cfg.stripe_min_bytes = t;
        }
        let a = transport(&verbs, &["mlx5_0", "mlx5_1"], "a", cfg.clone()).await;
        let b = transport(&verbs, &["mlx5_2", "mlx5_3"], "b", cfg).await;
        let len = 512 << 10;
        let dst = region(&b, len, true, 3).await;
        let src = region(&a, len, false, 4).await;
        let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
        let qpns = qps_created(&verbs.calls());
        let initiator_qp_rail = |qpn: u32| qpns.iter().position(|&q| q == qpn).filter(|&i| i < 2);
        verbs.clear_calls();
        let statuses = run(&peer, vec![write(0, &src, 0, &dst, 0, 0, len as u64)]).await;
        assert!(matches!(statuses[0], RequestStatus::Done { .. }), "{statuses:?}");
        assert_eq!(bytes(&dst)[..len], bytes(&src)[..len]);
        let mut used = [false; 2];
        for c in verbs.calls() {
            if let Call::PostSend { qpn, .. } = c {
                used[initiator_qp_rail(qpn).expect("posted on an initiator QP")] = true;
            }
        }
        assert_eq!(
            used.iter().filter(|u| **u).count(),
            rails,
            "threshold {threshold:?}: 512 KiB on {rails} rail(s)"
        );
    }
}

#[tokio::test]
async fn a_failed_verb_keeps_its_errno_as_the_error_source() {
    let verbs = fabric(vec![FakeDevice::roce("mlx5_0", [10, 0, 0, 1])]);
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let buf = HostBuffer::allocate(1 << 16, HostBufferOptions::default()).unwrap();
    let info = RegionInfo {
        id: RegionId(1),
        base: buf.addr(),
        len: 1 << 16,
        location: MemoryLocation::Host { numa: None },
        exported: true,
    };
    verbs.fail_next_call("reg_mr", libc::ENOMEM);
    let err = a.register(std::slice::from_ref(&info)).await.unwrap_err();
    // A registration batch lists each item's cause; walk that cause's chain to the OS error.
    let Error::RegistrationFailed { failures } = &err else {
        panic!("expected RegistrationFailed, got {err:?}");
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&*failures[0].cause);
    let mut errno = None;
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            errno = io.raw_os_error();
        }
        cause = c.source();
    }
    assert_eq!(errno, Some(libc::ENOMEM), "errno lost from the chain of: {err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_errors_retry_on_a_sibling_and_the_failed_qp_is_reestablished() {
    let verbs = fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]);
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    let src = region(&a, 1 << 20, false, 5).await;
    let dst = region(&b, 1 << 20, true, 6).await;
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let qpns = qps_created(&verbs.calls());
    let victim = qpns[0];
    verbs.fail_next_wr(victim, WcStatus::RETRY_EXC_ERR);
    verbs.clear_calls();
    let reqs: Vec<_> = (0..64)
        .map(|i| write(i, &src, i as u64 * 16384, &dst, 0, i as u64 * 16384, 16384))
        .collect();
    let statuses = run(&peer, reqs).await;
    assert!(
        statuses.iter().all(|s| matches!(s, RequestStatus::Done { .. })),
        "every request completes despite the failed QP: {statuses:?}"
    );
    assert_eq!(bytes(&dst), bytes(&src));
    // The failed QP is reset and brought back through a handshake, once.
    eventually("the failed QP is back in RTS", || {
        verbs.qp_state(victim) == Some(QpState::Rts)
    })
    .await;
    let t = transitions_of(&verbs.calls(), victim);
    assert_eq!(
        t.iter().filter(|t| **t == QpTransition::ToReset).count(),
        1,
        "one re-establishment: {t:?}"
    );
    assert!(matches!(t.last(), Some(QpTransition::ToRts { .. })));
    assert!(peer.is_healthy());
    // And it carries traffic again.
    let statuses = run(&peer, (0..8).map(|i| write(i, &src, 0, &dst, 0, 0, 4096)).collect()).await;
    assert!(statuses.iter().all(|s| matches!(s, RequestStatus::Done { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_post_moves_the_work_to_a_sibling_and_recovers_the_qp() {
    let verbs = fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]);
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    let src = region(&a, 1 << 20, false, 9).await;
    let dst = region(&b, 1 << 20, true, 10).await;
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let victim = qps_created(&verbs.calls())[1];
    verbs.fail_next_post(victim, libc::EINVAL);
    let reqs: Vec<_> = (0..16)
        .map(|i| write(i, &src, i as u64 * 65536, &dst, 0, i as u64 * 65536, 65536))
        .collect();
    let statuses = run(&peer, reqs).await;
    assert!(
        statuses.iter().all(|s| matches!(s, RequestStatus::Done { .. })),
        "{statuses:?}"
    );
    assert_eq!(bytes(&dst), bytes(&src));
    eventually("the refused QP is back in RTS", || {
        verbs.qp_state(victim) == Some(QpState::Rts)
    })
    .await;
    assert!(transitions_of(&verbs.calls(), victim).contains(&QpTransition::ToReset));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_fails_alone_and_retries_are_bounded() {
    let verbs = fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]);
    let cfg = RdmaConfig {
        qps_per_peer: 1,
        retry_limit: 0,
        ..config()
    };
    let a = transport(&verbs, &["mlx5_0"], "a", cfg.clone()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", cfg).await;
    let src = region(&a, 1 << 16, false, 7).await;
    let dst = region(&b, 1 << 16, true, 8).await;
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let qpn = qps_created(&verbs.calls())[0];

    // A remote access error is the target's refusal: that request fails, with Refused.
    verbs.fail_next_wr(qpn, WcStatus::REM_ACCESS_ERR);
    let statuses = run(&peer, vec![write(0, &src, 0, &dst, 0, 0, 4096)]).await;
    assert!(
        matches!(&statuses[0], RequestStatus::Failed(Error::Refused { .. })),
        "{statuses:?}"
    );
    eventually("QP re-established", || verbs.qp_state(qpn) == Some(QpState::Rts)).await;

    // With no retries allowed, a transient error fails the request as PeerGone; the rest of the
    // batch went out on the same QP after it and is failed, not lost.
    verbs.fail_next_wr(qpn, WcStatus::RETRY_EXC_ERR);
    let statuses = run(&peer, (0..4).map(|i| write(i, &src, 0, &dst, 0, 0, 4096)).collect()).await;
    assert!(
        matches!(&statuses[0], RequestStatus::Failed(Error::PeerGone { .. })),
        "{statuses:?}"
    );
    assert!(statuses.iter().all(|s| !matches!(s, RequestStatus::Pending)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_went_away_fails_requests_and_turns_unhealthy_without_a_storm() {
    let verbs = fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]);
    let cfg = RdmaConfig {
        qps_per_peer: 1,
        ..config()
    };
    let a = transport(&verbs, &["mlx5_0"], "a", cfg.clone()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", cfg).await;
    let src = region(&a, 1 << 16, false, 11).await;
    let dst = region(&b, 1 << 16, true, 12).await;
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let qpn = qps_created(&verbs.calls())[0];
    // The target process dies: its listener closes and its registrations are gone.
    drop(b);
    let statuses = run(&peer, vec![write(0, &src, 0, &dst, 0, 0, 4096)]).await;
    assert!(matches!(&statuses[0], RequestStatus::Failed(_)), "{statuses:?}");
    eventually("the peer reports unhealthy", || !peer.is_healthy()).await;
    // Unhealthy after three failures: the QP error and two failed re-establishments. Each attempt
    // resets the QP once; attempts are spaced by the backoff, so they are few even though the
    // progress thread looks at the QP continuously.
    let resets = transitions_of(&verbs.calls(), qpn)
        .iter()
        .filter(|t| **t == QpTransition::ToReset)
        .count();
    assert!((2..=10).contains(&resets), "{resets} re-establishment attempts");
    // Nothing hangs: new work fails promptly instead of waiting for a peer that is gone.
    let statuses = run(&peer, vec![write(0, &src, 0, &dst, 0, 0, 4096)]).await;
    assert!(statuses.iter().all(|s| !matches!(s, RequestStatus::Pending)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_queues_never_promise_more_completions_than_the_cq_holds() {
    let verbs = fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]);
    let cfg = RdmaConfig {
        cq_depth: 16,
        send_queue_depth: 8,
        signal_every: 4,
        qps_per_peer: 2,
        ..config()
    };
    let a = transport(&verbs, &["mlx5_0"], "a", cfg.clone()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", cfg).await;
    let dst = region(&b, 4096, true, 0).await;
    let d = descriptor(&b, "b", &[&dst]);
    let first = a.connect(&d).await.unwrap();
    verbs.clear_calls();
    let err = match a.connect(&d).await {
        Ok(_) => panic!("a second peer's 2 x 8 send slots fit a 16-entry CQ already holding 16"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("TE_RDMA_CQ_DEPTH"), "{err}");
    let created = qps_created(&verbs.calls());
    let destroyed: Vec<u32> = verbs
        .calls()
        .iter()
        .filter_map(|c| match c {
            Call::DestroyQp { qpn } => Some(*qpn),
            _ => None,
        })
        .collect();
    assert_eq!(created, destroyed, "QPs of the refused attempt are released");
    drop(first);
    a.connect(&d)
        .await
        .expect("room again once the first connection is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_target_refuses_stale_handshakes() {
    let verbs = fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]);
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    let dst = region(&b, 4096, true, 0).await;
    let mut d = descriptor(&b, "b", &[&dst]);
    let info = &mut d.transports[0].info;
    info["instance"] = serde_json::json!(info["instance"].as_u64().unwrap() ^ 1);
    let err = match a.connect(&d).await {
        Ok(_) => panic!("connected with a stale instance"),
        Err(e) => e,
    };
    assert!(matches!(err, Error::Refused { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_over_the_fake() {
    let verbs = fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]);
    let cfg = RdmaConfig {
        max_mr_size: Some(16 << 20),
        ..config()
    };
    let pair = ConformancePair {
        initiator: transport(&verbs, &["mlx5_0"], "initiator", cfg.clone()).await,
        target: transport(&verbs, &["mlx5_1"], "target", cfg).await,
        target_name: "target".into(),
    };
    conformance::run_all(&pair, &ConformanceOptions::default()).await;
}

// ---------------------------------------------------------------------------------------------
// Facing peers that are not who they say

fn key(byte: u8) -> te_base::auth::AuthKey {
    te_base::auth::AuthKey::from_bytes(&[byte; 32]).unwrap()
}

fn two_devices() -> Arc<RecordingVerbs> {
    fabric(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ])
}

fn accepted_qps(t: &Fake) -> Vec<(String, u64, u32)> {
    let mut k: Vec<_> = t.shared.accepted.lock().qps.keys().cloned().collect();
    k.sort();
    k
}

/// A request as `claimant` would send it, for one slot, with a claim of our choosing.
fn forged_request(claimant: &Fake, name: &str, target: &Fake, claim: [u8; 32]) -> ConnectRequest {
    ConnectRequest {
        version: PROTOCOL_VERSION,
        from_segment: name.into(),
        from_instance: claimant.shared.instance,
        from_claim: hex32(&claim),
        to_instance: target.shared.instance,
        rails: claimant.shared.rails().rails.iter().map(|r| r.info()).collect(),
        qps: vec![QpOffer {
            slot: 0,
            initiator_rail: 0,
            target_rail: 0,
            qpn: 0x4242,
            psn: 1,
            mtu: Mtu::M1024,
        }],
    }
}

/// Sends `frames` on a fresh connection to `target`'s listener and reads until it closes (at most
/// 64 KiB, within 10 s).
async fn raw_exchange(target: &Fake, frames: &[Vec<u8>]) -> Vec<u8> {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(target.handshake_addr()).await.unwrap();
    for f in frames {
        s.write_all(f).await.unwrap();
    }
    te_base::test_support::read_until_closed(&mut s, 64 << 10, Duration::from_secs(10))
        .await
        .expect("the target kept the connection open")
}

fn reveals_no_instance(text: &str, t: &Fake) -> bool {
    let i = t.shared.instance;
    !text.contains(&i.to_string()) && !text.contains(&format!("{i:x}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_key_only_peers_that_hold_it_connect() {
    let verbs = two_devices();
    let b = transport_with_key(&verbs, &["mlx5_1"], "b", config(), Some(key(1))).await;
    let dst = region(&b, 4096, true, 0).await;
    let d = descriptor(&b, "b", &[&dst]);

    let friend = transport_with_key(&verbs, &["mlx5_0"], "friend", config(), Some(key(1))).await;
    let src = region(&friend, 4096, false, 9).await;
    let peer = friend.connect(&d).await.unwrap();
    let st = run(&peer, vec![write(0, &src, 0, &dst, 0, 0, 4096)]).await;
    assert!(matches!(st[0], RequestStatus::Done { .. }), "{:?}", st[0]);
    assert_eq!(bytes(&dst), bytes(&src));
    let served = accepted_qps(&b);

    for (who, auth) in [("wrong key", Some(key(2))), ("no key", None)] {
        let stranger = transport_with_key(&verbs, &["mlx5_0"], who, config(), auth).await;
        let err = match stranger.connect(&d).await {
            Ok(_) => panic!("{who}: connected"),
            Err(e) => e,
        };
        assert!(matches!(err, Error::Unauthenticated { .. }), "{who}: {err}");
        assert!(reveals_no_instance(&err.to_string(), &b), "{who}: {err}");
        assert_eq!(accepted_qps(&b), served, "{who}: the target created nothing");
    }
    // A keyed initiator does not trust a target without a key.
    let open = transport(&verbs, &["mlx5_1"], "open", config()).await;
    let open_dst = region(&open, 4096, true, 0).await;
    let err = match friend.connect(&descriptor(&open, "open", &[&open_dst])).await {
        Ok(_) => panic!("connected to a target without a key"),
        Err(e) => e,
    };
    assert!(matches!(err, Error::Unauthenticated { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_peers_hear_one_word_and_a_close() {
    let verbs = two_devices();
    let b = transport_with_key(&verbs, &["mlx5_1"], "b", config(), Some(key(1))).await;
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let request = forged_request(&a, "a", &b, [7; 32]);
    let unauthenticated = encode(&ConnectResponse::Unauthenticated);
    let hello = encode(&AuthMessage::Hello { nonce: hex32(&[5; 32]) });
    let forged_proof = encode(&AuthMessage::Proof { proof: hex32(&[0; 32]) });
    let huge = {
        let mut f = (MAX_MESSAGE_BYTES as u32).to_be_bytes().to_vec();
        f.extend_from_slice(&[b'{'; 2000]);
        f
    };
    let attempts: Vec<(&str, Vec<Vec<u8>>)> = vec![
        ("a bare request", vec![encode(&request)]),
        ("a request after hello", vec![hello.clone(), encode(&request)]),
        ("a forged proof", vec![hello.clone(), forged_proof, encode(&request)]),
        ("a megabyte announced before proving anything", vec![huge]),
        ("garbage", vec![b"GET / HTTP/1.1\r\n\r\n".to_vec()]),
    ];
    for (what, frames) in attempts {
        let got = raw_exchange(&b, &frames).await;
        let text = String::from_utf8_lossy(&got);
        assert!(reveals_no_instance(&text, &b), "{what}: {text}");
        let mut rest = &got[..];
        if frames[0] == hello {
            let n = frame_len(rest[..4].try_into().unwrap()).unwrap();
            assert!(
                matches!(
                    decode::<AuthMessage>(&rest[4..4 + n]),
                    Ok(AuthMessage::Challenge { .. })
                ),
                "{what}"
            );
            rest = &rest[4 + n..];
        }
        assert_eq!(rest, &unauthenticated[..], "{what}: {text}");
    }
    assert!(accepted_qps(&b).is_empty(), "nothing was created for anyone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claiming_a_peers_name_does_not_take_over_its_qps() {
    let verbs = two_devices();
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let b = transport(&verbs, &["mlx5_1"], "b", config()).await;
    let src = region(&a, 8192, false, 3).await;
    let dst = region(&b, 8192, true, 0).await;
    let peer = a.connect(&descriptor(&b, "b", &[&dst])).await.unwrap();
    let served = accepted_qps(&b);
    assert_eq!(served.len(), 2);
    let qps_before: Vec<u32> = qps_created(&verbs.calls());

    // Someone who read a's name and instance (both public) but not its claim: refused, and a's
    // QPs at b are the same ones, still working.
    let impostor = forged_request(&a, "a", &b, [0xee; 32]);
    let got = raw_exchange(&b, &[encode(&impostor)]).await;
    let n = frame_len(got[..4].try_into().unwrap()).unwrap();
    let answer = decode::<ConnectResponse>(&got[4..4 + n]).unwrap();
    let ConnectResponse::Refused { reason } = answer else {
        panic!("an impostor was answered {answer:?}");
    };
    assert!(reason.contains("another initiator"), "{reason}");
    assert_eq!(accepted_qps(&b), served);
    assert_eq!(
        qps_created(&verbs.calls()),
        qps_before,
        "no QP created for the impostor"
    );
    let st = run(&peer, vec![write(0, &src, 0, &dst, 0, 0, 8192)]).await;
    assert!(matches!(st[0], RequestStatus::Done { .. }), "{:?}", st[0]);
    assert_eq!(bytes(&dst), bytes(&src));

    // The real a, with its claim, re-establishing a slot: accepted, replacing only that slot.
    let own = forged_request(&a, "a", &b, a.shared.claim);
    let got = raw_exchange(&b, &[encode(&own)]).await;
    let n = frame_len(got[..4].try_into().unwrap()).unwrap();
    assert!(matches!(
        decode::<ConnectResponse>(&got[4..4 + n]).unwrap(),
        ConnectResponse::Accepted { .. }
    ));
    assert_eq!(accepted_qps(&b), served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_source_holds_at_most_its_quota_of_target_qps() {
    let verbs = two_devices();
    let b = transport(
        &verbs,
        &["mlx5_1"],
        "b",
        RdmaConfig {
            max_qps_per_source: 3,
            ..config()
        },
    )
    .await;
    let dst = region(&b, 4096, true, 0).await;
    let d = descriptor(&b, "b", &[&dst]);
    let a = transport(&verbs, &["mlx5_0"], "a", config()).await;
    let _peer = a.connect(&d).await.unwrap();
    let c = transport(&verbs, &["mlx5_0"], "c", config()).await;
    let err = match c.connect(&d).await {
        Ok(_) => panic!("a fourth and fifth QP from one address"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("TE_RDMA_MAX_QPS_PER_SOURCE"), "{err}");
    assert_eq!(accepted_qps(&b).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_without_an_active_port_is_skipped_and_reported() {
    let mut down = FakeDevice::roce("mlx5_1", [10, 0, 0, 2]);
    down.port.active = false;
    let verbs = fabric(vec![FakeDevice::roce("mlx5_0", [10, 0, 0, 1]), down]);
    let t = transport(&verbs, &["mlx5_0", "mlx5_1"], "skips", config()).await;
    assert_eq!(t.shared.rails().rails.len(), 1);
    let skipped = te_base::Transport::skipped_devices(&*t);
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert_eq!(
        (skipped[0].name.as_str(), skipped[0].reason.as_str()),
        ("mlx5_1", "no active port")
    );
}
