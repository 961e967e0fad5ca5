//! The rdma transport under the engine, on the fake verbs layer (no NIC needed): a batch deadline
//! against a target that stops responding without closing anything. The engine's deadline timer
//! calls `Peer::abort`; the batch must fail with a timeout, and only once the transport released
//! the memory (its source can be deregistered, which is refused while a batch pins it). In both
//! ways the progress thread can wait: sleeping on the completion channels (the flush completions
//! of the abort must wake it through a channel event) and busy-polling (no CQ is ever armed).

mod fake;

use std::sync::Arc;
use std::time::Duration;

use te_core::config::MapEnv;
use te_core::metadata::InProcessStore;
use te_core::{HostBufferOptions, SubmitOptions, TransferEngine, TransferRequest};
use te_transport_rdma::config::PollMode;
use te_transport_rdma::verbs::fake::{FakeDevice, RecordingVerbs};

const LEN: u64 = 1 << 20;

async fn engine(
    verbs: &Arc<RecordingVerbs>,
    device: &str,
    name: &str,
    store: &InProcessStore,
    poll: PollMode,
) -> TransferEngine {
    let rdma = fake::rdma_on(verbs, device, name, poll).await;
    TransferEngine::builder()
        .segment_name(name)
        .transports(Vec::<String>::new())
        .with_transport(Arc::new(rdma))
        .metadata(Arc::new(store.clone()))
        .env(Arc::new(MapEnv::default()))
        .build()
        .await
        .expect("engine")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_a_batch_to_a_target_that_stopped_responding() {
    // Spin 0: the thread sleeps as soon as a poll finds nothing, so only a channel event can
    // bring it back for the flush (or the 100 ms timeout, which the event count tells apart).
    let verbs = deadline_against_a_silent_target(PollMode::Adaptive { spin: Duration::ZERO }).await;
    assert!(
        verbs.events_raised() > 0,
        "the flush completions reached an armed CQ and raised an event"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_polling_ends_it_too_and_never_arms_a_cq() {
    let verbs = deadline_against_a_silent_target(PollMode::Busy).await;
    assert_eq!(verbs.events_raised(), 0, "busy polling arms no CQ");
}

async fn deadline_against_a_silent_target(poll: PollMode) -> Arc<RecordingVerbs> {
    let verbs = Arc::new(RecordingVerbs::new(vec![
        FakeDevice::roce("mlx5_0", [10, 0, 0, 1]),
        FakeDevice::roce("mlx5_1", [10, 0, 0, 2]),
    ]));
    let store = InProcessStore::new();
    let a = engine(&verbs, "mlx5_0", "rd-a", &store, poll).await;
    let b = engine(&verbs, "mlx5_1", "rd-b", &store, poll).await;
    let _dst = b.allocate(LEN as usize, HostBufferOptions::default()).await.unwrap();
    let src = a.allocate(LEN as usize, HostBufferOptions::default()).await.unwrap();
    let seg = a.open_segment("rd-b").await.unwrap();
    let remote = seg.buffers()[0].base;
    let write = [TransferRequest::write(src.addr(), seg.id(), remote, LEN)];
    a.transfer(&write).await.expect("the target answers while it runs");

    verbs.stop_responding("mlx5_1");
    let opts = SubmitOptions {
        deadline: Some(Duration::from_millis(200)),
        ..SubmitOptions::default()
    };
    let batch = a.submit_with(&write, &opts).unwrap();
    assert!(verbs.held_total() > 0, "the silent target holds the writes");
    let waited = tokio::time::timeout(Duration::from_secs(30), batch.wait()).await;
    let err = waited
        .expect("the batch stayed in progress past its deadline")
        .expect_err("a batch to a silent target cannot succeed");
    assert!(!err.failures.is_empty());
    for (i, e) in &err.failures {
        assert!(e.is_timeout(), "request {i}: {e}");
    }
    assert_eq!(verbs.held_total(), 0, "every held write was flushed");
    src.deregister()
        .await
        .expect("the timed-out batch still pins its memory");
    verbs
}
