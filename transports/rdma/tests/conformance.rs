//! The shared transport conformance suite, notifications included, on a real RDMA device. Runs where
//! `TE_TEST_RDMA_DEVICE` names one (`TE_TEST_RDMA_DEVICE=mlx5_0 cargo test -p te-transport-rdma
//! --test conformance`); skips with a message otherwise, and fails instead when `TE_REQUIRE`
//! names `rdma`. Initiator and target are two transports in this process on the same device (the
//! HCA loops the traffic back), so the suite can verify the target's memory byte for byte.
//!
//! Other `TE_RDMA_*` variables of the environment apply to both transports; the handshake
//! listener defaults to 127.0.0.1 here.

mod common;

use te_base::conformance::{run_all, ConformanceOptions, ConformancePair};
use te_base::notify::NotifyLimits;

/// Small notification limits, so the conformance suite can fill the inbox.
fn context(device: &str, segment: &str) -> te_base::InstallContext {
    common::context(
        device,
        segment,
        &[],
        NotifyLimits {
            queue_depth: 64,
            max_bytes: 4096,
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance_on_a_real_device() {
    let Some(device) = common::device() else { return };
    let initiator = te_transport_rdma::install(&context(&device, "conformance-initiator"))
        .await
        .unwrap_or_else(|e| panic!("install on {device}: {e}"));
    let target_context = context(&device, "conformance-target");
    let inbox = target_context.notifications.clone();
    let target = te_transport_rdma::install(&target_context)
        .await
        .unwrap_or_else(|e| panic!("install on {device}: {e}"));
    let pair = ConformancePair {
        initiator,
        target,
        target_name: "conformance-target".into(),
    };
    let opts = ConformanceOptions::default();
    run_all(&pair, &opts).await;
    te_base::conformance::notify::run_all(&pair, &inbox, &opts).await;
}
