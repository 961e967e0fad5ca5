//! A peer process restarting under an open segment, followed without reopening: through etcd's
//! watch (the old process frozen with SIGSTOP, so its requests are still in flight when the new
//! instance appears and must fail with `PeerRestarted`), and through peer-to-peer metadata, which
//! cannot watch and fetches the descriptor again once a submit finds the connection lost.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use te_core::config::MapEnv;
use te_core::{
    Error, HostBufferOptions, MetadataStore, SegmentDescriptor, SegmentEvent, SegmentId, TransferEngine,
    TransferRequest,
};
use te_tests::node::Node;
use te_tests::pattern;
use tokio::sync::broadcast::Receiver;

const SLOT: u64 = 1 << 20;
/// Bound on waiting for what is pushed at once (not a performance assertion).
const PATIENCE: Duration = Duration::from_secs(30);

fn node(name: &str, metadata: &[&str]) -> Node {
    let mut c = Command::new(env!("CARGO_BIN_EXE_te-node"));
    c.args(["--name", name, "--ip", "127.0.0.1"]).args(metadata).args([
        "--slot-bytes",
        &SLOT.to_string(),
        "--slots",
        "2",
    ]);
    Node::start(c).unwrap_or_else(|e| panic!("{name}: {e}"))
}

async fn engine(name: &str, store: Arc<dyn MetadataStore>) -> TransferEngine {
    // The tcp watchdog must not be what fails the requests to the frozen process.
    let env = MapEnv::new([("TE_TCP_TIMEOUT_MS", "600000"), ("TE_TCP_LISTEN", "127.0.0.1:0")]);
    TransferEngine::builder()
        .segment_name(name)
        .metadata(store)
        .env(Arc::new(env))
        .transports(["tcp"])
        .build()
        .await
        .unwrap()
}

/// The base of the peer's slots: its largest exported buffer.
fn slots_of(d: &SegmentDescriptor) -> u64 {
    d.buffers.iter().max_by_key(|b| b.len).expect("a buffer").base
}

/// Waits for the restart to be reported, then for the new process's descriptor to show its
/// slots (it publishes before it registers them): the descriptor the segment now follows.
async fn restarted(events: &mut Receiver<SegmentEvent>) -> Arc<SegmentDescriptor> {
    let has_slots = |d: &SegmentDescriptor| d.buffers.iter().any(|b| b.len >= 2 * SLOT);
    tokio::time::timeout(PATIENCE, async {
        let mut instance = None;
        loop {
            match events.recv().await {
                Ok(SegmentEvent::Restarted(d)) => {
                    instance = Some(d.instance);
                    if has_slots(&d) {
                        return d;
                    }
                }
                Ok(SegmentEvent::Changed(d)) if instance == Some(d.instance) && has_slots(&d) => return d,
                Ok(_) => {}
                Err(e) => panic!("event channel: {e}"),
            }
        }
    })
    .await
    .expect("the restart was never reported")
}

/// Writes pattern `seed` into the peer's slot 0 through `seg`, which the new process must hold.
async fn write_slot(a: &TransferEngine, seg: SegmentId, remote: u64, seed: u64) -> Result<(), String> {
    let src = a.allocate(SLOT as usize, HostBufferOptions::default()).await.unwrap();
    let data: Vec<u8> = (0..SLOT).map(|i| pattern(seed, i)).collect();
    src.write_at(0, &data).unwrap();
    let w = [TransferRequest::write(src.addr(), seg, remote, SLOT)];
    a.transfer(&w).await.map(|_| ()).map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_fails_in_flight_requests_and_new_ones_reach_the_new_process() {
    use te_base::test_support::etcd::EtcdServer;
    use te_core::metadata::etcd::{EtcdConfig, EtcdStore};
    let Some(server) = EtcdServer::start_on_loopback() else {
        return;
    };
    let metadata = ["--metadata", "etcd", "--etcd", server.endpoint.as_str()];
    let old = node("lv-b", &metadata);
    let mut config = EtcdConfig::new(vec![server.endpoint.clone()]);
    config.prefix = "/te-multihost".into(); // te-node's prefix
    let a = engine("lv-a", Arc::new(EtcdStore::connect(config).await.unwrap())).await;
    let seg = a.open_segment("lv-b").await.unwrap();
    let mut events = seg.events();
    write_slot(&a, seg.id(), slots_of(seg.descriptor()), 1).await.unwrap();

    old.freeze();
    let src = a.allocate(SLOT as usize, HostBufferOptions::default()).await.unwrap();
    let stuck = a
        .submit(&[TransferRequest::write(
            src.addr(),
            seg.id(),
            slots_of(seg.descriptor()),
            SLOT,
        )])
        .unwrap();
    let mut new = node("lv-b", &metadata);
    let d = restarted(&mut events).await;
    let err = tokio::time::timeout(PATIENCE, stuck.wait())
        .await
        .expect("the request to the old process stayed in progress")
        .expect_err("the old process is frozen");
    for (i, e) in &err.failures {
        assert!(matches!(e, Error::PeerRestarted { .. }), "request {i}: {e}");
    }
    src.deregister()
        .await
        .expect("the failed request still pins its memory");

    write_slot(&a, seg.id(), slots_of(&d), 2)
        .await
        .expect("the new process answers");
    new.ok("check 0 2");
    old.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_restart_is_found_by_fetching_again_after_the_connection_broke() {
    use te_core::metadata::p2p::P2pStore;
    let port = te_base::test_support::free_port().unwrap().to_string();
    let metadata = ["--metadata", "p2p", "--p2p-port", port.as_str()];
    let old = node("lv-p", &metadata);
    let store = P2pStore::bind("127.0.0.1:0".parse().unwrap(), Duration::from_secs(5))
        .await
        .unwrap();
    let a = engine("lv-q", Arc::new(store)).await;
    let seg = a.open_segment(&old.p2p_addr).await.unwrap();
    let mut events = seg.events();
    write_slot(&a, seg.id(), slots_of(seg.descriptor()), 3).await.unwrap();

    old.kill();
    let mut new = node("lv-p", &metadata);
    // The first submit after the restart meets the broken connection; by the second at the
    // latest the engine knows it is lost and fetches the descriptor again.
    let remote = slots_of(seg.descriptor());
    assert!(write_slot(&a, seg.id(), remote, 4).await.is_err());
    let _ = write_slot(&a, seg.id(), remote, 4).await;
    let d = restarted(&mut events).await;
    write_slot(&a, seg.id(), slots_of(&d), 5)
        .await
        .expect("the new process answers");
    new.ok("check 0 5");
}
