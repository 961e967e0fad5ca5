//! Batch deadlines against a peer that stops answering without closing: a `te-node` process
//! frozen with SIGSTOP keeps its TCP connections open and its kernel keeps acknowledging, but
//! nothing is ever written back. The transport's own no-progress watchdog is set to ten minutes,
//! so only the batch deadline can end the batch; without it the batch would stay in progress.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use te_core::config::MapEnv;
use te_core::metadata::p2p::P2pStore;
use te_core::{Error, HostBufferOptions, SubmitOptions, TransferEngine, TransferRequest};
use te_tests::node::Node;

const SLOT: u64 = 1 << 20;
/// Far longer than the test: the tcp watchdog must not be what ends the batch.
const TCP_TIMEOUT_MS: &str = "600000";
/// Bound on waiting for a batch whose deadline is far shorter (not a performance assertion).
const PATIENCE: Duration = Duration::from_secs(30);

fn node(name: &str) -> Node {
    let port = te_base::test_support::free_port().unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_te-node"));
    c.args(["--name", name, "--ip", "127.0.0.1", "--metadata", "p2p"])
        .args(["--p2p-port", &port.to_string()])
        .args(["--slot-bytes", &SLOT.to_string(), "--slots", "2"])
        .env("TE_TCP_TIMEOUT_MS", TCP_TIMEOUT_MS);
    Node::start(c).unwrap_or_else(|e| panic!("{name}: {e}"))
}

async fn engine(name: &str, env: &[(&str, &str)]) -> TransferEngine {
    let mut vars = MapEnv::new([("TE_TCP_TIMEOUT_MS", TCP_TIMEOUT_MS), ("TE_TCP_LISTEN", "127.0.0.1:0")]);
    vars.0.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let store = P2pStore::bind("127.0.0.1:0".parse().unwrap(), Duration::from_secs(5))
        .await
        .unwrap();
    TransferEngine::builder()
        .segment_name(name)
        .metadata(Arc::new(store))
        .env(Arc::new(vars))
        .transports(["tcp"])
        .build()
        .await
        .unwrap()
}

/// Every failure of a batch that ran into its deadline is a timeout.
fn assert_timed_out(result: Result<te_core::BatchReport, te_core::BatchError>) {
    let err = result.expect_err("a batch to a frozen peer cannot succeed");
    assert!(!err.failures.is_empty(), "{err:?}");
    for (i, e) in &err.failures {
        assert!(e.is_timeout(), "request {i}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_peer_cannot_keep_a_batch_in_progress() {
    let b = node("dl-b");
    // `a` takes its deadline from TE_TRANSFER_TIMEOUT_MS, `c` from the submit options.
    let a = engine("dl-a", &[("TE_TRANSFER_TIMEOUT_MS", "300")]).await;
    let c = engine("dl-c", &[]).await;
    let seg_a = a.open_segment(&b.p2p_addr).await.unwrap();
    let seg_c = c.open_segment(&b.p2p_addr).await.unwrap();
    let remote = seg_a.buffers()[0].base;
    let src_a = a.allocate(SLOT as usize, HostBufferOptions::default()).await.unwrap();
    let src_c = c.allocate(SLOT as usize, HostBufferOptions::default()).await.unwrap();
    let write_a = [TransferRequest::write(src_a.addr(), seg_a.id(), remote, SLOT)];
    let write_c = [TransferRequest::write(src_c.addr(), seg_c.id(), remote, SLOT)];
    a.transfer(&write_a).await.expect("the peer answers while it runs");
    c.transfer(&write_c).await.expect("the peer answers while it runs");

    b.freeze();
    let batch_a = a.submit(&write_a).unwrap();
    let opts = SubmitOptions {
        deadline: Some(Duration::from_millis(200)),
        ..SubmitOptions::default()
    };
    let batch_c = c.submit_with(&write_c, &opts).unwrap();
    for batch in [batch_a, batch_c] {
        let waited = tokio::time::timeout(PATIENCE, batch.wait()).await;
        assert_timed_out(waited.expect("the batch stayed in progress past its deadline"));
    }
    // Every request settled only once the transport stopped touching the memory, and with it the
    // pins went: the sources can be deregistered (refused with InFlight while pinned).
    src_a
        .deregister()
        .await
        .expect("the timed-out batch still pins its memory");
    src_c
        .deregister()
        .await
        .expect("the timed-out batch still pins its memory");

    // Thawed, the peer is reachable again through the reopened segment.
    b.signal("CONT");
    let seg = a.open_segment(&b.p2p_addr).await.unwrap();
    assert_eq!(seg.id(), seg_a.id());
    let src = a.allocate(SLOT as usize, HostBufferOptions::default()).await.unwrap();
    let write = [TransferRequest::write(src.addr(), seg.id(), remote, SLOT)];
    a.transfer(&write).await.expect("the thawed peer answers");
}

/// A deadline is its batch's own. A one-slice batch sits on lane 0's wire (the peer is frozen, so
/// its acknowledgement cannot come) when its deadline passes: lane 0 is cut to stop it. A batch
/// without a deadline that lane 0 carried behind it goes on on a sibling lane and completes,
/// byte for byte, once the peer runs again (before, it failed with "the connection was cut").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_cut_for_one_batch_deadline_fails_no_other_batch() {
    // One lane (the default): the rest goes on a fresh connection.
    cut_for_one_deadline("dl-d", "dl-e", &[]).await;
}

/// Four lanes and 64 KiB slices: the long batch is on every lane, and lane 0's share of it goes
/// on a sibling lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_cut_for_one_batch_deadline_hands_the_rest_to_a_sibling() {
    cut_for_one_deadline(
        "dl-f",
        "dl-g",
        &[("TE_TCP_LANES", "4"), ("TE_TCP_SLICE_BYTES", "65536")],
    )
    .await;
}

async fn cut_for_one_deadline(target: &str, initiator: &str, env: &[(&str, &str)]) {
    let b = node(target);
    let a = engine(initiator, env).await;
    let seg = a.open_segment(&b.p2p_addr).await.unwrap();
    let remote = seg.buffers()[0].base;
    let small = a.allocate(4096, HostBufferOptions::default()).await.unwrap();
    let big = a.allocate(SLOT as usize, HostBufferOptions::default()).await.unwrap();
    let data: Vec<u8> = (0..SLOT).map(|i| te_tests::pattern(7, i)).collect();
    big.write_at(0, &data).unwrap();
    let short = [TransferRequest::write(small.addr(), seg.id(), remote, 4096)];
    a.transfer(&short).await.expect("the peer answers while it runs");

    b.freeze();
    let opts = SubmitOptions {
        deadline: Some(Duration::from_millis(300)),
        ..SubmitOptions::default()
    };
    let timed = a.submit_with(&short, &opts).unwrap();
    let long = a
        .submit(&[TransferRequest::write(big.addr(), seg.id(), remote + SLOT, SLOT)])
        .unwrap();
    let waited = tokio::time::timeout(PATIENCE, timed.wait()).await;
    assert_timed_out(waited.expect("the short batch stayed in progress past its deadline"));
    b.signal("CONT");
    let report = tokio::time::timeout(PATIENCE, long.wait())
        .await
        .expect("the long batch settles once the peer runs");
    assert!(report.is_ok(), "another batch's deadline failed it: {report:?}");
    // The cut lane's connection is gone: the next batch waits for the reconnect it starts.
    let back = a.allocate(SLOT as usize, HostBufferOptions::default()).await.unwrap();
    a.transfer(&[TransferRequest::read(back.addr(), seg.id(), remote + SLOT, SLOT)])
        .await
        .expect("the peer answers");
    let mut got = vec![0u8; SLOT as usize];
    back.read_at(0, &mut got).unwrap();
    assert!(got == data, "the bytes of the batch that went on are at the peer");
}

/// A batch submitted while its route's connection is lost waits for the reconnect it starts and
/// goes on the new connection; its deadline still bounds that wait. Here the peer is frozen, so
/// the reconnect cannot finish: the batch fails with a timeout at its deadline. Thawed, the next
/// batch (no deadline) waits for the reconnect and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_waiting_for_a_reconnect_still_ends_at_its_deadline() {
    let b = node("dl-h");
    let a = engine("dl-i", &[]).await;
    let seg = a.open_segment(&b.p2p_addr).await.unwrap();
    let remote = seg.buffers()[0].base;
    let src = a.allocate(4096, HostBufferOptions::default()).await.unwrap();
    let write = [TransferRequest::write(src.addr(), seg.id(), remote, 4096)];
    a.transfer(&write).await.expect("the peer answers while it runs");
    b.freeze();
    let opts = SubmitOptions {
        deadline: Some(Duration::from_millis(300)),
        ..SubmitOptions::default()
    };
    // On the wire when its deadline passes: the lane is cut and the route is lost.
    let first = a.submit_with(&write, &opts).unwrap();
    assert_timed_out(tokio::time::timeout(PATIENCE, first.wait()).await.expect("bounded"));
    let waiting = a.submit_with(&write, &opts).unwrap();
    assert_timed_out(
        tokio::time::timeout(PATIENCE, waiting.wait())
            .await
            .expect("the wait for the reconnect ended at the deadline"),
    );
    b.signal("CONT");
    a.transfer(&write)
        .await
        .expect("the next batch waits for the reconnect and completes");
}

#[tokio::test]
async fn a_zero_deadline_is_refused_and_a_bad_variable_is_named() {
    let a = engine("dl-z", &[]).await;
    let opts = SubmitOptions {
        deadline: Some(Duration::ZERO),
        ..SubmitOptions::default()
    };
    let err = a.submit_with(&[], &opts).unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err}");
    let store = P2pStore::bind("127.0.0.1:0".parse().unwrap(), Duration::from_secs(5))
        .await
        .unwrap();
    let err = TransferEngine::builder()
        .segment_name("dl-y")
        .metadata(Arc::new(store))
        .env(Arc::new(MapEnv::new([("TE_TRANSFER_TIMEOUT_MS", "soon")])))
        .transports(["tcp"])
        .build()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("TE_TRANSFER_TIMEOUT_MS"), "{err}");
}
