//! The TCP transport driven directly through the `Transport` and `Peer` traits: two transports in
//! one process (each with its own runtime and listener), real loopback sockets.

use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::pattern::pattern_bytes;
use te_base::{
    Batch, BatchState, Error, ExportedBuffer, InstallContext, MemoryLocation, Peer, RegionId, RegionInfo,
    ResolvedRequest, SegmentDescriptor, SubmitContext, TransferOp, Transport, TransportEndpoint,
};
use te_transport_tcp::{TcpConfig, TcpTransport};

/// A heap buffer registered with a transport.
struct Buf {
    data: Box<[u8]>,
    id: RegionId,
}

impl Buf {
    fn new(id: u64, len: usize, seed: u8) -> Buf {
        let data = pattern_bytes(seed as u64, 0, len).into_boxed_slice();
        Buf { data, id: RegionId(id) }
    }
    fn addr(&self) -> u64 {
        self.data.as_ptr() as u64
    }
    fn info(&self) -> RegionInfo {
        RegionInfo {
            id: self.id,
            base: self.addr(),
            len: self.data.len() as u64,
            location: MemoryLocation::HOST,
            exported: true,
        }
    }
}

async fn transport(extra: &[(&str, &str)]) -> Arc<TcpTransport> {
    let mut env = MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0"), ("TE_TCP_TIMEOUT_MS", "2000")]);
    for (k, v) in extra {
        env.0.insert(k.to_string(), v.to_string());
    }
    Arc::new(TcpTransport::start(TcpConfig::from_env(&env).unwrap()).await.unwrap())
}

fn descriptor(name: &str, t: &TcpTransport, bufs: &[&Buf]) -> SegmentDescriptor {
    let mut d = SegmentDescriptor::new(name, 1);
    d.transports.push(TransportEndpoint {
        transport: "tcp".into(),
        info: t.endpoint(),
    });
    let mut sorted: Vec<&&Buf> = bufs.iter().collect();
    sorted.sort_by_key(|b| b.addr());
    for b in sorted {
        d.buffers.push(ExportedBuffer {
            base: b.addr(),
            len: b.data.len() as u64,
            location: MemoryLocation::HOST,
            keys: Default::default(),
        });
    }
    d.validate().unwrap();
    d
}

fn req(index: u32, op: TransferOp, local: &Buf, local_off: u64, remote_addr: u64, len: u64) -> ResolvedRequest {
    ResolvedRequest {
        index,
        op,
        len,
        local_addr: local.addr() + local_off,
        local_region: local.id,
        remote_addr,
        remote_buffer: 0,
    }
}

async fn run(
    peer: &Arc<dyn Peer>,
    requests: Vec<ResolvedRequest>,
) -> Result<te_base::BatchReport, te_base::BatchError> {
    let lens: Vec<u64> = requests.iter().map(|r| r.len).collect();
    let state = BatchState::new(lens.into());
    let batch = Batch::new(state.clone());
    if let Err(e) = peer.submit(requests, &state, &SubmitContext::default()) {
        let all: Vec<usize> = (0..state.len()).collect();
        state.fail_many(all, &e);
    }
    batch.wait().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_every_size_across_lanes_and_slices() {
    for lanes in ["1", "3"] {
        let a = transport(&[("TE_TCP_LANES", lanes), ("TE_TCP_SLICE_BYTES", "64K")]).await;
        let b = transport(&[]).await;
        let len = 4 << 20;
        let src = Buf::new(1, len, 0x11);
        let dst = Buf::new(2, len, 0x22);
        let back = Buf::new(3, len, 0);
        a.register(&[src.info(), back.info()]).await.unwrap();
        b.register(&[dst.info()]).await.unwrap();
        let peer = a.connect(&descriptor("b", &b, &[&dst])).await.unwrap();

        // Sizes from 1 byte to the whole buffer, at odd offsets, in one batch, non-overlapping.
        let mut reqs = Vec::new();
        let mut off = 0u64;
        for (i, size) in [1u64, 7, 4095, 4096, 65_537, 300_001, 1 << 20].into_iter().enumerate() {
            reqs.push(req(
                i as u32,
                TransferOp::Write,
                &src,
                off + 3,
                dst.addr() + off + 5,
                size,
            ));
            off += size + 11;
        }
        let report = run(&peer, reqs.clone()).await.unwrap();
        assert_eq!(report.requests, reqs.len());
        for r in &reqs {
            let l = (r.local_addr - src.addr()) as usize;
            let d = (r.remote_addr - dst.addr()) as usize;
            assert_eq!(&src.data[l..l + r.len as usize], &dst.data[d..d + r.len as usize]);
        }

        // Read the whole target buffer back and compare byte for byte.
        let whole = vec![req(0, TransferOp::Read, &back, 0, dst.addr(), len as u64)];
        run(&peer, whole).await.unwrap();
        assert!(back.data == dst.data, "lanes={lanes}: read-back differs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_small_requests_in_one_batch() {
    let a = transport(&[("TE_TCP_LANES", "2")]).await;
    let b = transport(&[]).await;
    let src = Buf::new(1, 10_000 * 64, 0x5a);
    let dst = Buf::new(2, 10_000 * 64, 0);
    a.register(&[src.info()]).await.unwrap();
    b.register(&[dst.info()]).await.unwrap();
    let peer = a.connect(&descriptor("b", &b, &[&dst])).await.unwrap();
    let reqs: Vec<_> = (0..10_000u64)
        .map(|i| req(i as u32, TransferOp::Write, &src, i * 64, dst.addr() + i * 64, 64))
        .collect();
    assert_eq!(run(&peer, reqs).await.unwrap().requests, 10_000);
    assert!(src.data == dst.data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_refuses_what_it_did_not_export_and_keeps_serving() {
    let a = transport(&[]).await;
    let b = transport(&[]).await;
    let src = Buf::new(1, 8192, 0x33);
    let exported = Buf::new(2, 4096, 0);
    let private = Buf::new(3, 4096, 0x44);
    a.register(&[src.info()]).await.unwrap();
    b.register(&[exported.info()]).await.unwrap();
    b.register(&[RegionInfo {
        exported: false,
        ..private.info()
    }])
    .await
    .unwrap();
    // A descriptor that lies: it claims the private buffer is exported, as a hostile or stale
    // peer could. The target must still refuse.
    let lie = descriptor("b", &b, &[&exported, &private]);
    let peer = a.connect(&lie).await.unwrap();
    let reqs = vec![
        req(0, TransferOp::Write, &src, 0, private.addr(), 16),
        req(1, TransferOp::Read, &src, 0, private.addr(), 16),
        req(2, TransferOp::Write, &src, 0, exported.addr() + 4000, 200), // runs past the end
        req(3, TransferOp::Write, &src, 0, exported.addr(), 4096),       // fine
    ]
    .into_iter()
    .map(|mut r| {
        r.remote_buffer = lie.find_buffer(r.remote_addr, 1).unwrap() as u32;
        r
    })
    .collect();
    let err = run(&peer, reqs).await.unwrap_err();
    assert_eq!(err.progress.done, 1);
    assert_eq!(err.failures.len(), 3);
    // The target refuses what it did not export; the initiator itself stops the request that
    // runs past the end of what the descriptor lists.
    for (i, e) in &err.failures[..2] {
        assert!(matches!(e, Error::Refused { peer, .. } if peer == "b"), "#{i}: {e}");
    }
    assert!(
        matches!(&err.failures[2].1, Error::OutOfBounds { .. }),
        "{}",
        err.failures[2].1
    );
    assert!(
        private.data == Buf::new(9, 4096, 0x44).data,
        "refused write touched private memory"
    );
    assert_eq!(&exported.data[..], &src.data[..4096]);
    // The connection survived the refusals. The descriptor lists its buffers by address, so the
    // exported one's index is looked up (it is not 0 when the private buffer sits lower).
    assert!(peer.is_healthy());
    let mut read = req(0, TransferOp::Read, &src, 4096, exported.addr(), 4096);
    read.remote_buffer = lie.find_buffer(exported.addr(), 4096).unwrap() as u32;
    run(&peer, vec![read]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistered_memory_is_no_longer_served() {
    let a = transport(&[]).await;
    let b = transport(&[]).await;
    let src = Buf::new(1, 4096, 1);
    let dst = Buf::new(2, 4096, 0);
    a.register(&[src.info()]).await.unwrap();
    b.register(&[dst.info()]).await.unwrap();
    let peer = a.connect(&descriptor("b", &b, &[&dst])).await.unwrap();
    run(&peer, vec![req(0, TransferOp::Write, &src, 0, dst.addr(), 4096)])
        .await
        .unwrap();
    b.deregister(&[dst.info()]).await.unwrap();
    let err = run(&peer, vec![req(0, TransferOp::Write, &src, 0, dst.addr(), 1)])
        .await
        .unwrap_err();
    assert!(matches!(err.failures[0].1, Error::Refused { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_peer_fails_old_requests_and_is_reachable_again() {
    let a = transport(&[]).await;
    let src = Buf::new(1, 1 << 20, 7);
    let dst = Buf::new(2, 1 << 20, 0);
    a.register(&[src.info()]).await.unwrap();
    // A port from outside the ephemeral range, so no connection takes it while B is down.
    let listen = format!("127.0.0.1:{}", te_base::test_support::free_port().unwrap());
    let b1 = transport(&[("TE_TCP_LISTEN", listen.as_str())]).await;
    b1.register(&[dst.info()]).await.unwrap();
    let old = descriptor("b", &b1, &[&dst]);
    let peer = a.connect(&old).await.unwrap();
    run(&peer, vec![req(0, TransferOp::Write, &src, 0, dst.addr(), 1 << 20)])
        .await
        .unwrap();

    // B goes away. The next batch fails with PeerGone naming it, and the peer turns unhealthy.
    b1.shutdown().await;
    drop(b1);
    let err = run(&peer, vec![req(0, TransferOp::Write, &src, 0, dst.addr(), 1 << 20)])
        .await
        .unwrap_err();
    assert!(
        matches!(&err.failures[0].1, Error::PeerGone { peer, .. } if peer == "b"),
        "{err}"
    );
    assert!(!peer.is_healthy());

    // B restarts on the same port with a new instance token.
    let b2 = transport(&[("TE_TCP_LISTEN", listen.as_str())]).await;
    b2.register(&[dst.info()]).await.unwrap();
    // The stale descriptor names the old instance: refused as a restart.
    let stale = a.connect(&old).await.err().expect("stale instance must be refused");
    assert!(matches!(stale, Error::PeerGone { .. }), "{stale}");
    let fresh = a.connect(&descriptor("b", &b2, &[&dst])).await.unwrap();
    let src2 = Buf::new(3, 1 << 20, 9);
    a.register(&[src2.info()]).await.unwrap();
    run(&fresh, vec![req(0, TransferOp::Write, &src2, 0, dst.addr(), 1 << 20)])
        .await
        .unwrap();
    assert!(src2.data == dst.data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_twice_reuses_the_lanes() {
    let a = transport(&[]).await;
    let b = transport(&[]).await;
    let dst = Buf::new(2, 4096, 0);
    b.register(&[dst.info()]).await.unwrap();
    let d = descriptor("b", &b, &[&dst]);
    let p1 = a.connect(&d).await.unwrap();
    let p2 = a.connect(&d).await.unwrap();
    // Two peers (each checks requests against the descriptor it was given), one connection.
    assert!(!Arc::ptr_eq(&p1, &p2));
    assert_eq!(b.served_connections(), 1);
    assert!(p1.is_healthy() && p2.is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_peer_is_peer_gone() {
    let a = transport(&[("TE_TCP_TIMEOUT_MS", "500")]).await;
    // A port nobody listens on, from outside the ephemeral range (so no connection of ours owns it).
    let port = te_base::test_support::free_port().unwrap();
    let mut d = SegmentDescriptor::new("nobody", 1);
    d.transports.push(TransportEndpoint {
        transport: "tcp".into(),
        info: serde_json::json!({"addrs": [format!("127.0.0.1:{port}")], "token": 5}),
    });
    let err = a.connect(&d).await.err().unwrap();
    assert!(
        matches!(&err, Error::PeerGone { peer, .. } if peer == "nobody"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_reads_the_environment() {
    let ctx = InstallContext {
        auth: None,
        env: Arc::new(MapEnv::new([("TE_TCP_LANES", "0")])),
        segment_name: "x".into(),
        devices: Vec::new(),
        notifications: te_base::NotifyInbox::new(Default::default()),
    };
    let err = te_transport_tcp::install(&ctx).await.err().unwrap();
    assert!(err.to_string().contains("TE_TCP_LANES"));
    let ctx = InstallContext {
        auth: None,
        env: Arc::new(MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")])),
        segment_name: "x".into(),
        devices: Vec::new(),
        notifications: te_base::NotifyInbox::new(Default::default()),
    };
    let t = te_transport_tcp::install(&ctx).await.unwrap();
    assert_eq!(t.name(), "tcp");
}

/// A fake target that greets correctly, then either stalls (reads nothing more, answers nothing)
/// or closes the connection after the first request header.
async fn fake_target(stall: bool) -> (SegmentDescriptor, tokio::task::JoinHandle<()>) {
    use te_transport_tcp::wire::{Header, Opcode, HEADER_LEN};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let token = 77u64;
    let task = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut raw = [0u8; HEADER_LEN];
        s.read_exact(&mut raw).await.unwrap();
        let ack = Header {
            token,
            ..Header::new(Opcode::HelloAck)
        };
        s.write_all(&ack.to_bytes()).await.unwrap();
        if stall {
            // Hold the connection open without reading: the initiator's requests stay outstanding.
            std::future::pending::<()>().await;
        } else {
            let _ = s.read_exact(&mut raw).await;
            drop(s);
        }
    });
    let mut d = SegmentDescriptor::new("fake", 1);
    d.transports.push(TransportEndpoint {
        transport: "tcp".into(),
        info: serde_json::json!({"addrs": [addr.to_string()], "token": token}),
    });
    d.buffers.push(ExportedBuffer {
        base: 0x1000_0000,
        len: 64 << 20,
        location: MemoryLocation::HOST,
        keys: Default::default(),
    });
    (d, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_peer_fails_outstanding_requests_within_the_timeout() {
    let a = transport(&[("TE_TCP_TIMEOUT_MS", "300")]).await;
    let src = Buf::new(1, 32 << 20, 3);
    a.register(&[src.info()]).await.unwrap();
    let (d, task) = fake_target(true).await;
    let peer = a.connect(&d).await.unwrap();
    let err = run(&peer, vec![req(0, TransferOp::Write, &src, 0, 0x1000_0000, 32 << 20)])
        .await
        .unwrap_err();
    assert!(
        matches!(&err.failures[0].1, Error::PeerGone { peer, reason } if peer == "fake" && reason.contains("no progress")),
        "{err}"
    );
    assert!(!peer.is_healthy());
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_closing_mid_batch_fails_every_outstanding_request() {
    let a = transport(&[("TE_TCP_LANES", "2")]).await;
    let src = Buf::new(1, 8 << 20, 3);
    a.register(&[src.info()]).await.unwrap();
    let (d, task) = fake_target(false).await;
    let peer = a.connect(&d).await.err();
    // Two lanes: the fake accepts only one connection, so connecting the second lane fails...
    assert!(matches!(peer, Some(Error::PeerGone { .. })), "{peer:?}");
    task.abort();
    // ...and with one lane the connection closes after the first request.
    let a = transport(&[]).await;
    a.register(&[src.info()]).await.unwrap();
    let (d, task) = fake_target(false).await;
    let peer = a.connect(&d).await.unwrap();
    let reqs: Vec<_> = (0..8u64)
        .map(|i| {
            req(
                i as u32,
                TransferOp::Read,
                &src,
                i << 20,
                0x1000_0000 + (i << 20),
                1 << 20,
            )
        })
        .collect();
    let err = run(&peer, reqs).await.unwrap_err();
    assert_eq!(err.progress.failed, 8);
    assert!(err.failures.iter().all(|(_, e)| matches!(e, Error::PeerGone { .. })));
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_reads_and_writes_in_one_batch_over_three_lanes() {
    let a = transport(&[("TE_TCP_LANES", "3"), ("TE_TCP_SLICE_BYTES", "4K")]).await;
    let b = transport(&[]).await;
    let local = Buf::new(1, 1 << 20, 0x61);
    let remote = Buf::new(2, 1 << 20, 0x19);
    a.register(&[local.info()]).await.unwrap();
    b.register(&[remote.info()]).await.unwrap();
    let peer = a.connect(&descriptor("b", &b, &[&remote])).await.unwrap();
    // Even 64 KiB chunks are written from local to remote, odd ones read from remote to local,
    // each cut into 16 slices spread over three lanes.
    let chunk = 64 << 10;
    let reqs: Vec<_> = (0..16u64)
        .map(|i| {
            let op = if i % 2 == 0 {
                TransferOp::Write
            } else {
                TransferOp::Read
            };
            req(i as u32, op, &local, i * chunk, remote.addr() + i * chunk, chunk)
        })
        .collect();
    let local_before = local.data.clone();
    let remote_before = remote.data.clone();
    run(&peer, reqs).await.unwrap();
    for i in 0..16usize {
        let r = i * chunk as usize..(i + 1) * chunk as usize;
        if i % 2 == 0 {
            assert!(remote.data[r.clone()] == local_before[r], "chunk {i} written");
        } else {
            assert!(local.data[r.clone()] == remote_before[r], "chunk {i} read");
        }
    }
}
