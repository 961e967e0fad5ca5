//! The shared transport conformance suite, run against the local copy in each of its modes.

use std::sync::Arc;

use te_base::conformance::{run_all, ConformanceOptions, ConformancePair};
use te_base::Transport;
use te_transport_local::{LocalConfig, LocalTransport, NtKernel};

fn transport(config: LocalConfig, kernel: NtKernel) -> Arc<dyn Transport> {
    Arc::new(LocalTransport::with_kernel(config, kernel).expect("local transport"))
}

fn pair(config: LocalConfig, kernel: NtKernel) -> ConformancePair {
    ConformancePair {
        initiator: transport(config, kernel),
        target: transport(config, kernel),
        target_name: "local-conformance-target".into(),
    }
}

/// Runs the whole suite on one pair from `make`.
async fn run_each(make: impl Fn() -> ConformancePair, opts: &ConformanceOptions) {
    run_all(&make(), opts).await;
}

fn smaller() -> ConformanceOptions {
    ConformanceOptions {
        max_bytes: 8 << 20,
        ..ConformanceOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_configuration_passes_the_suite() {
    run_each(
        || pair(LocalConfig::default(), NtKernel::detect()),
        &ConformanceOptions::default(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_copy_passes_the_suite() {
    let config = LocalConfig {
        copy_threads: 1,
        ..LocalConfig::default()
    };
    run_each(|| pair(config, NtKernel::detect()), &smaller()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordinary_copies_only_pass_the_suite() {
    let config = LocalConfig {
        nt_copy_min_bytes: u64::MAX,
        ..LocalConfig::default()
    };
    run_each(|| pair(config, NtKernel::detect()), &smaller()).await;
}

/// Every streaming kernel the CPU has, with the fan-out forced on for small batches too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kernel_with_eager_fanout_passes_the_suite() {
    for kernel in NtKernel::supported() {
        let config = LocalConfig {
            copy_threads: 3,
            nt_copy_min_bytes: 64,
            fanout_min_bytes: 1,
            fanout_needs_awake_helper: false,
        };
        eprintln!("kernel {}", kernel.name());
        run_each(|| pair(config, kernel), &smaller()).await;
    }
}

/// A segment talking to itself: initiator and target are the same transport instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_passes_the_suite() {
    let loopback = || {
        let t = transport(LocalConfig::default(), NtKernel::detect());
        ConformancePair {
            initiator: t.clone(),
            target: t,
            target_name: "local-loopback".into(),
        }
    };
    run_each(loopback, &smaller()).await;
}

/// Notifications: delivered into the target's inbox after the copies, in completion order, and
/// bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_follow_their_data_in_order() {
    let inbox = te_base::NotifyInbox::new(te_base::NotifyLimits {
        queue_depth: 64,
        max_bytes: 4096,
    });
    let config = LocalConfig::default();
    let target = LocalTransport::with_inbox(config, NtKernel::detect(), &[], inbox.clone()).unwrap();
    let pair = ConformancePair {
        initiator: transport(config, NtKernel::detect()),
        target: Arc::new(target),
        target_name: "local-conformance-target".into(),
    };
    te_base::conformance::notify::run_all(&pair, &inbox, &smaller()).await;
}
