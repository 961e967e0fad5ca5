//! The shared transport conformance suite on the shm transport's mapped path: every buffer of
//! this test process is a sealed memfd (the process default backing), so the target transport
//! hands each exported one to the initiator, which maps it and copies with the local transport's
//! kernels. `conformance.rs` runs the same suite on cross-memory attach; `memfd.rs` runs the
//! mapped path between two processes.

use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::conformance::{
    concurrent_batches, deregistered_target_is_refused, hostile_requests_fail_alone, large_batch, unaligned_offsets,
    write_read_sizes, ConformanceOptions, ConformancePair,
};
use te_base::shared_memory::{set_default_backing, HostBacking};
use te_base::{NotifyInbox, NotifyLimits, Transport};
use te_transport_shm::{ShmConfig, ShmTransport};

fn pair(inline: &str) -> (ConformancePair, Arc<ShmTransport>) {
    set_default_backing(HostBacking::Memfd);
    let start = || {
        let config = ShmConfig::from_env(&MapEnv::new([("TE_SHM_INLINE_BYTES", inline)])).unwrap();
        Arc::new(ShmTransport::start(config, None, NotifyInbox::new(NotifyLimits::default())).unwrap())
    };
    let initiator = start();
    let target: Arc<dyn Transport> = start();
    (
        ConformancePair {
            initiator: initiator.clone(),
            target,
            target_name: "shm-memfd-conformance-target".into(),
        },
        initiator,
    )
}

async fn run_each(inline: &str, opts: &ConformanceOptions) {
    type Check = for<'a> fn(
        &'a ConformancePair,
        &'a ConformanceOptions,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 'a>>;
    let checks: [(&str, Check); 6] = [
        ("write_read_sizes", |p, o| Box::pin(write_read_sizes(p, o))),
        ("unaligned_offsets", |p, o| Box::pin(unaligned_offsets(p, o))),
        ("large_batch", |p, o| Box::pin(large_batch(p, o))),
        ("concurrent_batches", |p, o| Box::pin(concurrent_batches(p, o))),
        ("hostile_requests_fail_alone", |p, o| {
            Box::pin(hostile_requests_fail_alone(p, o))
        }),
        ("deregistered_target_is_refused", |p, o| {
            Box::pin(deregistered_target_is_refused(p, o))
        }),
    ];
    for (name, check) in checks {
        let (p, initiator) = pair(inline);
        check(&p, opts).await;
        let c = initiator.route_counters();
        // (The deregistration check moves no byte: its requests are all refused.)
        let moves = name != "deregistered_target_is_refused";
        assert!(
            !moves || c.mapped_bytes > 0,
            "{name}: the mapped path carried it: {c:?}"
        );
        assert_eq!(c.cma_bytes, 0, "{name}: nothing went by cross-memory attach: {c:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_inline_threshold() {
    run_each("1M", &ConformanceOptions::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_on_the_copy_threads() {
    let opts = ConformanceOptions {
        max_bytes: 16 << 20,
        ..ConformanceOptions::default()
    };
    run_each("0", &opts).await;
}
