//! Open segments follow their peer's descriptor, through the in-process store and through etcd (a
//! real etcd-server on loopback): a buffer the peer adds is usable without reopening while
//! another transfer runs, one it removes is refused at submit, a restart is followed to the new
//! instance, and `close_segment` ends the segment. The stores push changes (no polling).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use te_core::config::MapEnv;
use te_core::metadata::InProcessStore;
use te_core::{Error, HostBufferOptions, MetadataStore, SegmentEvent, TransferEngine, TransferRequest};
use tokio::sync::broadcast::Receiver;

const BIG: usize = 1 << 20;
const SMALL: usize = 64 << 10;
/// Bound on waiting for an event that is pushed at once (not a performance assertion).
const PATIENCE: Duration = Duration::from_secs(20);

async fn engine(name: &str, store: Arc<dyn MetadataStore>) -> TransferEngine {
    TransferEngine::builder()
        .segment_name(name)
        .metadata(store)
        .env(Arc::new(MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")])))
        .transports(["tcp"])
        .build()
        .await
        .expect("engine")
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    te_base::pattern::pattern_bytes(seed as u64, 0, len)
}

/// Waits for the first event that `want` accepts, skipping others.
async fn event_where(events: &mut Receiver<SegmentEvent>, want: impl Fn(&SegmentEvent) -> bool) -> SegmentEvent {
    tokio::time::timeout(PATIENCE, async {
        loop {
            match events.recv().await {
                Ok(e) if want(&e) => return e,
                Ok(_) => {}
                Err(e) => panic!("event channel: {e}"),
            }
        }
    })
    .await
    .expect("the event was never reported")
}

fn holds(e: &SegmentEvent, addr: u64) -> Option<bool> {
    match e {
        SegmentEvent::Changed(d) => Some(d.buffers.iter().any(|b| b.base == addr)),
        _ => None,
    }
}

/// `b` adds a buffer and removes it while `a` keeps writing into another of its buffers.
async fn buffers_come_and_go_during_transfers(a: &TransferEngine, b: &TransferEngine) {
    let steady = b.allocate(BIG, HostBufferOptions::default()).await.unwrap();
    let seg = a.open_segment(b.segment_name()).await.unwrap();
    let mut events = seg.events();
    let src = a.allocate(BIG, HostBufferOptions::default()).await.unwrap();
    src.write_at(0, &pattern(7, BIG)).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let runner = tokio::spawn({
        let (a, stop) = (a.clone(), stop.clone());
        let write = [TransferRequest::write(src.addr(), seg.id(), steady.addr(), BIG as u64)];
        async move {
            let mut rounds = 0u64;
            while !stop.load(Ordering::Acquire) || rounds == 0 {
                a.transfer(&write)
                    .await
                    .expect("the steady transfer failed while buffers changed");
                rounds += 1;
                tokio::task::yield_now().await;
            }
            rounds
        }
    });

    let added = b.allocate(SMALL, HostBufferOptions::default()).await.unwrap();
    let added_addr = added.addr();
    event_where(&mut events, |e| holds(e, added_addr) == Some(true)).await;
    let w = [TransferRequest::write(src.addr(), seg.id(), added_addr, SMALL as u64)];
    a.transfer(&w).await.expect("a new buffer is usable without reopening");
    let mut back = vec![0u8; SMALL];
    added.read_at(0, &mut back).unwrap();
    assert!(back == pattern(7, SMALL), "the new buffer holds other bytes");

    added.deregister().await.unwrap();
    event_where(&mut events, |e| holds(e, added_addr) == Some(false)).await;
    match a.submit(&w) {
        Err(Error::OutOfBounds { addr, .. }) => assert_eq!(addr, added_addr),
        other => panic!("a removed buffer must be refused at submit, got {other:?}"),
    }

    stop.store(true, Ordering::Release);
    let rounds = runner.await.unwrap();
    assert!(rounds >= 1);
    let mut back = vec![0u8; BIG];
    steady.read_at(0, &mut back).unwrap();
    assert!(back == pattern(7, BIG), "the steady buffer holds other bytes");
}

/// `b` shuts down (gone), a successor takes its name (restarted): `a` follows it without
/// reopening. Then `a` closes the segment.
async fn restart_then_close(a: &TransferEngine, b: TransferEngine, b_store: Arc<dyn MetadataStore>) {
    let name = b.segment_name().to_string();
    let seg = a.open_segment(&name).await.unwrap();
    let mut events = seg.events();
    let src = a.allocate(SMALL, HostBufferOptions::default()).await.unwrap();
    src.write_at(0, &pattern(9, SMALL)).unwrap();

    b.shutdown().await.unwrap();
    drop(b);
    event_where(&mut events, |e| matches!(e, SegmentEvent::Gone)).await;

    let b2 = engine(&name, b_store).await;
    let dst = b2.allocate(SMALL, HostBufferOptions::default()).await.unwrap();
    let dst_addr = dst.addr();
    event_where(&mut events, |e| match e {
        SegmentEvent::Restarted(d) | SegmentEvent::Changed(d) => {
            d.instance == b2.instance() && d.buffers.iter().any(|b| b.base == dst_addr)
        }
        _ => false,
    })
    .await;
    let w = [TransferRequest::write(src.addr(), seg.id(), dst_addr, SMALL as u64)];
    a.transfer(&w).await.expect("new submits reach the restarted peer");
    let mut back = vec![0u8; SMALL];
    dst.read_at(0, &mut back).unwrap();
    assert!(back == pattern(9, SMALL));

    a.close_segment(seg.id()).await.unwrap();
    event_where(&mut events, |e| matches!(e, SegmentEvent::Closed)).await;
    match a.transfer(&w).await {
        Err(Error::SegmentClosed(n)) => assert_eq!(n, name),
        other => panic!("submits to a closed segment must be refused, got {other:?}"),
    }
    assert!(matches!(a.close_segment(seg.id()).await, Err(Error::UnknownSegment(_))));
    let again = a.open_segment(&name).await.unwrap();
    assert_ne!(again.id(), seg.id());
    let w = [TransferRequest::write(src.addr(), again.id(), dst_addr, SMALL as u64)];
    a.transfer(&w).await.expect("the reopened segment works");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_store_pushes_buffer_changes_and_restarts() {
    let store: Arc<dyn MetadataStore> = Arc::new(InProcessStore::new());
    let a = engine("live-a", store.clone()).await;
    let b = engine("live-b", store.clone()).await;
    buffers_come_and_go_during_transfers(&a, &b).await;
    restart_then_close(&a, b, store).await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_watch_pushes_buffer_changes_and_restarts() {
    use te_base::test_support::etcd::EtcdServer;
    use te_core::metadata::etcd::{EtcdConfig, EtcdStore};

    let Some(server) = EtcdServer::start_on_loopback() else {
        return;
    };
    let store = || async {
        let mut c = EtcdConfig::new(vec![server.endpoint.clone()]);
        c.prefix = "/te-test/live".into();
        Arc::new(EtcdStore::connect(c).await.unwrap()) as Arc<dyn MetadataStore>
    };
    let a = engine("live-a", store().await).await;
    let b = engine("live-b", store().await).await;
    buffers_come_and_go_during_transfers(&a, &b).await;
    restart_then_close(&a, b, store().await).await;
}
