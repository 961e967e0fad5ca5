//! The shared transport conformance suite on the shm transport: initiator and target are two
//! transport instances in this process, each with its own control socket, so every byte moves by
//! `process_vm_writev/readv` through the same code as between two processes (the kernel accepts
//! our own pid), and the suite can check the target's memory directly. `two_process.rs` runs the
//! same kinds of transfers with the target in a child process.

use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::conformance::{
    concurrent_batches, deregistered_target_is_refused, hostile_requests_fail_alone, large_batch, unaligned_offsets,
    write_read_sizes, ConformanceOptions, ConformancePair,
};
use te_base::{NotifyInbox, NotifyLimits, Transport};
use te_transport_shm::{ShmConfig, ShmTransport};

fn transport(inline: &str, inbox: Arc<NotifyInbox>) -> Arc<dyn Transport> {
    let config = ShmConfig::from_env(&MapEnv::new([("TE_SHM_INLINE_BYTES", inline)])).unwrap();
    Arc::new(ShmTransport::start(config, None, inbox).unwrap())
}

fn pair(inline: &str) -> ConformancePair {
    let inbox = || NotifyInbox::new(NotifyLimits::default());
    ConformancePair {
        initiator: transport(inline, inbox()),
        target: transport(inline, inbox()),
        target_name: "shm-conformance-target".into(),
    }
}

/// Every check on a fresh pair (the suite frees buffers without deregistering them).
async fn run_each(inline: &str, opts: &ConformanceOptions) {
    write_read_sizes(&pair(inline), opts).await;
    unaligned_offsets(&pair(inline), opts).await;
    large_batch(&pair(inline), opts).await;
    concurrent_batches(&pair(inline), opts).await;
    hostile_requests_fail_alone(&pair(inline), opts).await;
    deregistered_target_is_refused(&pair(inline), opts).await;
}

/// Batches up to 1 MiB copied on the submitting thread, larger ones shared by the copy threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_inline_threshold() {
    run_each("1M", &ConformanceOptions::default()).await;
}

/// Every batch shared by the copy threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_on_the_copy_threads() {
    let opts = ConformanceOptions {
        max_bytes: 16 << 20,
        ..ConformanceOptions::default()
    };
    run_each("0", &opts).await;
}

/// Notifications (ordering after the data, inbox bounds) over the control socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_follow_their_data_in_order() {
    let inbox = NotifyInbox::new(NotifyLimits {
        queue_depth: 64,
        max_bytes: 4096,
    });
    let pair = ConformancePair {
        initiator: transport("1M", NotifyInbox::new(NotifyLimits::default())),
        target: transport("1M", inbox.clone()),
        target_name: "shm-conformance-target".into(),
    };
    let opts = ConformanceOptions {
        max_bytes: 16 << 20,
        ..ConformanceOptions::default()
    };
    te_base::conformance::notify::run_all(&pair, &inbox, &opts).await;
}
