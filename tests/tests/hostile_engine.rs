//! The engine facing a hostile or failing world, over the TCP transport on 127.0.0.1: a peer that
//! never drains its read replies, a handle dropped while remote requests pin it, a peer that
//! re-registers its buffers, and a metadata store that fails to publish. Every loop is bounded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::config::MapEnv;
use te_core::metadata::{InProcessStore, MetadataStore};
use te_core::{
    Error, HostBufferOptions, MemoryLocation, RegisterOptions, Result, SegmentDescriptor, TransferEngine,
    TransferRequest,
};
use te_transport_tcp::wire::{Header, Opcode, RefusalCode, HEADER_LEN};
use te_transport_tcp::TcpEndpoint;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TIMEOUT_MS: u64 = 500;

async fn engine(name: &str, store: Arc<dyn MetadataStore>) -> TransferEngine {
    let env = MapEnv::new([
        ("TE_TCP_LISTEN", "127.0.0.1:0"),
        ("TE_TCP_ADVERTISE", "127.0.0.1"),
        ("TE_TCP_TIMEOUT_MS", "500"),
    ]);
    TransferEngine::builder()
        .segment_name(name)
        .transports(["tcp"])
        .env(Arc::new(env))
        .metadata(store)
        .build()
        .await
        .unwrap()
}

/// A raw connection to `desc`'s TCP listener, greeted.
async fn raw_peer(desc: &SegmentDescriptor) -> (TcpStream, u64) {
    let ep = TcpEndpoint::of(desc).unwrap();
    let mut s = TcpStream::connect(ep.addrs[0]).await.unwrap();
    let hello = Header {
        token: ep.token,
        ..Header::new(Opcode::Hello)
    };
    s.write_all(&hello.to_bytes()).await.unwrap();
    let mut raw = [0u8; HEADER_LEN];
    s.read_exact(&mut raw).await.unwrap();
    assert_eq!(Header::decode(&raw).unwrap().opcode, Opcode::HelloAck);
    (s, ep.token)
}

/// Asks for `count` reads of `[addr, +len)` and never reads a reply.
async fn undrained_reads(s: &mut TcpStream, token: u64, addr: u64, len: u64, count: u64) {
    for id in 0..count {
        send_read(s, token, id, addr, len).await;
    }
    // The first reply's header shows the target is serving them (and holding their pins); its
    // payload (32 MiB, more than the socket buffers hold) and the rest are never read.
    assert_eq!(reply_header(s).await.opcode, Opcode::ReadData);
}

/// Sends one READ request of `[addr, +len)`.
async fn send_read(s: &mut TcpStream, token: u64, request_id: u64, addr: u64, len: u64) {
    let h = Header {
        request_id,
        token,
        addr,
        len,
        ..Header::new(Opcode::Read)
    };
    s.write_all(&h.to_bytes()).await.unwrap();
}

/// The next reply's header.
async fn reply_header(s: &mut TcpStream) -> Header {
    let mut raw = [0u8; HEADER_LEN];
    s.read_exact(&mut raw).await.unwrap();
    Header::decode(&raw).unwrap()
}

/// One read of `[addr, +len)` on a fresh connection: the reply's opcode and refusal code.
async fn probe_read(desc: &SegmentDescriptor, addr: u64, len: u64) -> (Opcode, RefusalCode) {
    let (mut s, token) = raw_peer(desc).await;
    send_read(&mut s, token, 0, addr, len).await;
    let h = reply_header(&mut s).await;
    (h.opcode, RefusalCode::from_u16(h.code))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undrained_replies_bound_deregister_and_never_block_allocate() {
    let victim = engine("hostile-undrained", Arc::new(InProcessStore::new())).await;
    let reg = victim.allocate(32 << 20, HostBufferOptions::default()).await.unwrap();
    let (mut s, token) = raw_peer(&victim.descriptor()).await;
    undrained_reads(&mut s, token, reg.addr(), reg.len(), 64).await;

    let t0 = Instant::now();
    let deregistering = tokio::spawn(reg.deregister());
    tokio::task::yield_now().await;
    // Meanwhile the engine's control plane is free: allocate does not wait behind the peer.
    let other = tokio::time::timeout(Duration::from_millis(TIMEOUT_MS / 2), async {
        victim.allocate(4096, HostBufferOptions::default()).await
    })
    .await
    .expect("allocate blocked behind a remote peer")
    .unwrap();
    assert!(other.len() == 4096);
    assert!(!deregistering.is_finished(), "the replies did not pin the region");
    tokio::time::timeout(Duration::from_millis(TIMEOUT_MS + 1000), deregistering)
        .await
        .expect("deregister completes within the timeout + 1 s")
        .unwrap()
        .unwrap();
    assert!(t0.elapsed() < Duration::from_millis(TIMEOUT_MS + 1000));
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_dropped_while_pinned_returns_at_once_and_is_released_later() {
    let victim = engine("hostile-drop", Arc::new(InProcessStore::new())).await;
    let reg = victim.allocate(32 << 20, HostBufferOptions::default()).await.unwrap();
    let (addr, len) = (reg.addr(), reg.len());
    let before = victim.descriptor();
    let (mut s, token) = raw_peer(&before).await;
    undrained_reads(&mut s, token, addr, len, 64).await;

    let t0 = Instant::now();
    drop(reg);
    assert!(
        t0.elapsed() < Duration::from_millis(50),
        "drop blocked for {:?}",
        t0.elapsed()
    );

    // The stalled connection is cut within the timeout, its pins go, and the region is released:
    // gone from the descriptor and refused to a new reader.
    let end = Instant::now() + Duration::from_millis(TIMEOUT_MS + 3000);
    while victim.descriptor().buffers.iter().any(|b| b.base == addr) && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!victim.descriptor().buffers.iter().any(|b| b.base == addr));
    let mut refused = false;
    while !refused && Instant::now() < end {
        refused = probe_read(&before, addr, 8).await == (Opcode::Error, RefusalCode::OutOfBounds);
        if !refused {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(refused, "the dropped region is still served");
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reregistered_peer_is_read_correctly_after_reopening() {
    let store: Arc<dyn MetadataStore> = Arc::new(InProcessStore::new());
    let target = engine("hostile-rereg-target", store.clone()).await;
    let reader = engine("hostile-rereg-reader", store).await;
    let dst = reader.allocate(8192, HostBufferOptions::default()).await.unwrap();

    let first = target.allocate(8192, HostBufferOptions::default()).await.unwrap();
    first.write_at(0, &[1u8; 8192]).unwrap();
    let seg = reader.open_segment("hostile-rereg-target").await.unwrap();
    reader
        .transfer(&[TransferRequest::read(dst.addr(), seg.id(), first.addr(), 8192)])
        .await
        .unwrap();

    // The target replaces its buffer (and registers one more); the reader re-opens the segment
    // over the same pooled connection and must check against the new buffer list.
    first.deregister().await.unwrap();
    let second = target.allocate(8192, HostBufferOptions::default()).await.unwrap();
    let third = target.allocate(4096, HostBufferOptions::default()).await.unwrap();
    second.write_at(0, &[2u8; 8192]).unwrap();
    third.write_at(0, &[3u8; 4096]).unwrap();
    let seg = reader.open_segment("hostile-rereg-target").await.unwrap();
    reader
        .transfer(&[
            TransferRequest::read(dst.addr(), seg.id(), second.addr(), 4096),
            TransferRequest::read(dst.addr() + 4096, seg.id(), third.addr(), 4096),
        ])
        .await
        .unwrap();
    let mut out = vec![0u8; 8192];
    dst.read_at(0, &mut out).unwrap();
    assert!(out[..4096].iter().all(|&b| b == 2) && out[4096..].iter().all(|&b| b == 3));
}

/// A metadata store whose publishes fail while `failing` is set.
struct FlakyStore {
    inner: InProcessStore,
    failing: AtomicBool,
}

#[async_trait::async_trait]
impl MetadataStore for FlakyStore {
    fn name(&self) -> &'static str {
        "flaky"
    }
    async fn publish(&self, d: &SegmentDescriptor) -> Result<()> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(Error::Metadata("injected publish failure".into()));
        }
        self.inner.publish(d).await
    }
    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        self.inner.fetch(name).await
    }
    async fn remove(&self, name: &str) -> Result<()> {
        self.inner.remove(name).await
    }
}

/// Registers (and exports) `mem`, which the caller keeps alive longer than the registration.
async fn register(engine: &TransferEngine, mem: &[u8]) -> Result<te_core::Registration> {
    // SAFETY: every caller keeps `mem` alive until the registration is dropped (or failed).
    unsafe {
        engine.register_raw(
            mem.as_ptr() as u64,
            mem.len() as u64,
            MemoryLocation::HOST,
            RegisterOptions::default(),
        )
    }
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_publish_leaves_nothing_reachable() {
    let store = Arc::new(FlakyStore {
        inner: InProcessStore::new(),
        failing: AtomicBool::new(false),
    });
    let victim = engine("hostile-publish", store.clone()).await;
    let desc = victim.descriptor();
    let secret = vec![0x5Eu8; 8192];
    store.failing.store(true, Ordering::SeqCst);
    let err = register(&victim, &secret).await.unwrap_err();
    assert!(matches!(err, Error::Metadata(_)), "{err}");
    assert!(victim.descriptor().buffers.is_empty());
    // A peer that knows the address gets nothing.
    let got = probe_read(&desc, secret.as_ptr() as u64, 64).await;
    assert_eq!(got, (Opcode::Error, RefusalCode::OutOfBounds));
    // Publishing works again: the same memory can be registered.
    store.failing.store(false, Ordering::SeqCst);
    let reg = register(&victim, &secret).await.unwrap();
    assert_eq!(probe_read(&desc, reg.addr(), 64).await.0, Opcode::ReadData);
}
