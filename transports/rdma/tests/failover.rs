//! Failover from rdma to tcp under the engine, on the fake verbs layer (no NIC needed) with the
//! real tcp transport on loopback as the second route: queue pairs killed mid-batch (every QP of
//! the initiator completes a work request with a fatal status), a route flapping under load, a
//! lost connection found at submit, and the batch deadline still bounding all of it. Every
//! outcome is checked byte for byte at the target.

mod fake;

use std::sync::Arc;
use std::time::Duration;

use te_core::config::MapEnv;
use te_core::metadata::InProcessStore;
use te_core::{
    HostBufferOptions, Registration, RouteState, SegmentHandle, SubmitOptions, TransferEngine, TransferRequest,
};
use te_transport_rdma::config::RdmaConfig;
use te_transport_rdma::protocol::values::WcStatus;
use te_transport_rdma::verbs::fake::{Call, FakeDevice, RecordingVerbs};

const LEN: u64 = 4 << 20;
const BLOCK: u64 = 64 << 10;

async fn engine(
    verbs: &Arc<RecordingVerbs>,
    device: &str,
    name: &str,
    store: &InProcessStore,
    env: &[(&str, &str)],
) -> TransferEngine {
    let rdma = fake::rdma_on(verbs, device, name, RdmaConfig::default().poll).await;
    let vars = [("TE_TCP_LISTEN", "127.0.0.1:0")].iter().chain(env);
    let env = MapEnv(vars.map(|(k, v)| (k.to_string(), v.to_string())).collect());
    TransferEngine::builder()
        .segment_name(name)
        .transports(["tcp"])
        .with_transport(Arc::new(rdma))
        .metadata(Arc::new(store.clone()))
        .env(Arc::new(env))
        .build()
        .await
        .expect("engine")
}

/// Two engines on one fake fabric, `a` initiating to `b`, and their buffers.
struct Pair {
    verbs: Arc<RecordingVerbs>,
    a: TransferEngine,
    b: TransferEngine,
    src: Registration,
    dst: Registration,
    seg: SegmentHandle,
}

async fn pair(env: &[(&str, &str)]) -> Pair {
    let verbs = Arc::new(RecordingVerbs::new(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]));
    let store = InProcessStore::new();
    let a = engine(&verbs, "mlx5_0", "fo-a", &store, env).await;
    let b = engine(&verbs, "mlx5_1", "fo-b", &store, env).await;
    let dst = b.allocate(LEN as usize, HostBufferOptions::default()).await.unwrap();
    let src = a.allocate(LEN as usize, HostBufferOptions::default()).await.unwrap();
    let seg = a.open_segment("fo-b").await.unwrap();
    Pair {
        verbs,
        a,
        b,
        src,
        dst,
        seg,
    }
}

fn pattern(seed: u8, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn contents(r: &Registration) -> Vec<u8> {
    let mut out = vec![0u8; r.len() as usize];
    r.read_at(0, &mut out).unwrap();
    out
}

impl Pair {
    fn writes(&self) -> Vec<TransferRequest> {
        let remote = self.seg.buffers()[0].base;
        (0..LEN / BLOCK)
            .map(|k| TransferRequest::write(self.src.addr() + k * BLOCK, self.seg.id(), remote + k * BLOCK, BLOCK))
            .collect()
    }

    fn reads(&self) -> Vec<TransferRequest> {
        let remote = self.seg.buffers()[0].base;
        (0..LEN / BLOCK)
            .map(|k| TransferRequest::read(self.src.addr() + k * BLOCK, self.seg.id(), remote + k * BLOCK, BLOCK))
            .collect()
    }

    /// Every queue pair of the initiator completes its next work request with a fatal status.
    fn kill_initiator_qps(&self) -> usize {
        let qps: Vec<u32> = self
            .verbs
            .calls()
            .iter()
            .filter_map(|c| match c {
                Call::CreateQp { qpn, .. } => Some(*qpn),
                _ => None,
            })
            .filter(|&q| self.verbs.device_of(q).as_deref() == Some("mlx5_0"))
            .collect();
        for &q in &qps {
            self.verbs.fail_next_wr(q, WcStatus::GENERAL_ERR);
        }
        qps.len()
    }

    fn route_states(&self) -> Vec<(&'static str, RouteState)> {
        self.a
            .routes(&self.seg)
            .unwrap()
            .into_iter()
            .map(|r| (r.transport, r.state))
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_transports_are_routes_and_rdma_carries_while_it_works() {
    let p = pair(&[]).await;
    assert_eq!(
        p.route_states(),
        [("rdma", RouteState::Active), ("tcp", RouteState::Active)],
        "rdma preferred, tcp behind it"
    );
    let data = pattern(1, LEN);
    p.src.write_at(0, &data).unwrap();
    p.a.transfer(&p.writes()).await.unwrap();
    assert!(contents(&p.dst) == data);
    assert_eq!(p.a.metrics().failovers, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_whose_queue_pairs_die_mid_batch_are_redone_on_tcp_exactly() {
    let p = pair(&[]).await;
    p.dst.write_at(0, &pattern(9, LEN)).unwrap();
    let data = pattern(2, LEN);
    p.src.write_at(0, &data).unwrap();
    assert!(p.kill_initiator_qps() >= 1);
    let report =
        p.a.transfer(&p.writes())
            .await
            .expect("every write lands on some route");
    assert_eq!(report.bytes, LEN);
    assert!(contents(&p.dst) == data, "the target holds exactly the written bytes");
    assert!(p.a.metrics().failovers >= 1, "some writes failed over");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_whose_queue_pairs_die_mid_batch_land_in_full() {
    let p = pair(&[]).await;
    let data = pattern(3, LEN);
    p.dst.write_at(0, &data).unwrap();
    p.src.write_at(0, &vec![0u8; LEN as usize]).unwrap();
    assert!(p.kill_initiator_qps() >= 1);
    p.a.transfer(&p.reads()).await.expect("every read lands");
    assert!(contents(&p.src) == data);
    assert!(p.a.metrics().failovers >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_failover_the_batch_reports_the_failure() {
    let p = pair(&[]).await;
    p.src.write_at(0, &pattern(4, LEN)).unwrap();
    p.kill_initiator_qps();
    let opts = SubmitOptions {
        no_failover: true,
        ..SubmitOptions::default()
    };
    let err = p.a.submit_with(&p.writes(), &opts).unwrap().wait().await.unwrap_err();
    assert!(!err.failures.is_empty());
    assert_eq!(p.a.metrics().failovers, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_off_connects_one_route_per_memory_kind() {
    let p = pair(&[("TE_FAILOVER", "0")]).await;
    assert_eq!(p.route_states(), [("rdma", RouteState::Active)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_bounds_a_silent_target_and_leaves_the_route_to_the_next_batch() {
    let p = pair(&[]).await;
    let data = pattern(5, LEN);
    p.src.write_at(0, &data).unwrap();
    p.verbs.stop_responding("mlx5_1");
    let opts = SubmitOptions {
        deadline: Some(Duration::from_millis(200)),
        ..SubmitOptions::default()
    };
    let batch = p.a.submit_with(&p.writes(), &opts).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(30), batch.wait())
        .await
        .expect("the deadline ends the batch")
        .expect_err("a silent target cannot complete it");
    for (i, e) in &err.failures {
        assert!(e.is_timeout(), "request {i}: {e}");
    }
    assert_eq!(p.a.metrics().failovers, 0, "a deadline's timeout is not failed over");
    // The deadline cut its own batch only (its queue pairs flushed and re-established), not the
    // connection: once the target answers again, the next batch lands on rdma, nothing failed
    // over. (Before, a deadline aborted the whole rdma connection.)
    p.verbs.resume_responding("mlx5_1");
    p.dst.write_at(0, &vec![0u8; LEN as usize]).unwrap();
    let again = tokio::time::timeout(Duration::from_secs(30), p.a.submit(&p.writes()).unwrap().wait())
        .await
        .expect("bounded");
    again.expect("the route the deadline left carries the next batch");
    assert!(contents(&p.dst) == data);
    assert_eq!(p.a.metrics().failovers, 0);
    assert_eq!(p.route_states()[0], ("rdma", RouteState::Active));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_route_is_paused_probed_and_resumed_while_every_batch_lands() {
    let p = pair(&[("TE_ROUTE_PAUSE_MS", "50")]).await;
    let mut paused_seen = false;
    for round in 0..24u8 {
        let data = pattern(round, LEN);
        p.src.write_at(0, &data).unwrap();
        // Rounds 0-5 kill the queue pairs every batch: the third error pauses rdma.
        if round < 6 {
            p.kill_initiator_qps();
        }
        let batch = p.a.submit(&p.writes()).unwrap();
        tokio::time::timeout(Duration::from_secs(30), batch.wait())
            .await
            .expect("bounded")
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(contents(&p.dst) == data, "round {round}: bytes differ");
        paused_seen |= p.route_states()[0].1 != RouteState::Active;
    }
    let rdma = &p.a.routes(&p.seg).unwrap()[0];
    assert!(rdma.pauses >= 1, "three errors within the window paused rdma");
    assert!(paused_seen, "a batch ran while rdma was paused or probing");
    // Its probe brings it back once the fault is gone.
    let mut state = rdma.state;
    for _ in 0..200 {
        if state == RouteState::Active {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        state = p.route_states()[0].1;
    }
    assert_eq!(state, RouteState::Active, "the probe passed and rdma carries again");
    drop(p.b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notified_batch_that_failed_over_notifies_once_after_its_bytes() {
    let p = pair(&[]).await;
    let inbox = p.b.notifications();
    let data = pattern(6, LEN);
    p.src.write_at(0, &data).unwrap();
    p.kill_initiator_qps();
    let nb =
        p.a.submit_notified(&p.writes(), b"first".to_vec(), &SubmitOptions::default())
            .unwrap();
    nb.wait().await.expect("data and notification delivered");
    assert!(p.a.metrics().failovers >= 1, "the batch failed over");
    let note = tokio::time::timeout(Duration::from_secs(30), inbox.recv())
        .await
        .expect("the notification arrives")
        .expect("inbox open");
    assert_eq!(note.payload, b"first");
    assert!(
        contents(&p.dst) == data,
        "every byte was there when the notification was"
    );
    // A second notified batch: the next message is its own, not a duplicate of the first.
    let nb =
        p.a.submit_notified(&p.writes(), b"second".to_vec(), &SubmitOptions::default())
            .unwrap();
    nb.wait().await.unwrap();
    let note = tokio::time::timeout(Duration::from_secs(30), inbox.recv())
        .await
        .expect("the second notification arrives")
        .expect("inbox open");
    assert_eq!(note.payload, b"second", "the first notification was delivered once");
}
