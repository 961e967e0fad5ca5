//! The shared transport conformance suite, notifications included, on a real RDMA device. Runs where
//! `TE_TEST_RDMA_DEVICE` names one (`TE_TEST_RDMA_DEVICE=mlx5_0 cargo test -p te-transport-rdma
//! --test conformance`); skips with a message otherwise, and fails instead when `TE_REQUIRE`
//! names `rdma`. Initiator and target are two transports in this process on the same device (the
//! HCA loops the traffic back), so the suite can verify the target's memory byte for byte.
//!
//! Other `TE_RDMA_*` variables of the environment apply to both transports; the handshake
//! listener defaults to 127.0.0.1 here.

use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::conformance::{run_all, ConformanceOptions, ConformancePair};
use te_base::test_support::required;
use te_base::InstallContext;

fn context(device: &str, segment: &str) -> InstallContext {
    let mut vars: std::collections::HashMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("TE_RDMA_") || k.starts_with("MC_"))
        .collect();
    vars.insert("TE_RDMA_DEVICES".into(), device.into());
    vars.entry("TE_RDMA_HANDSHAKE_ADDR".into())
        .or_insert_with(|| "127.0.0.1:0".into());
    InstallContext {
        auth: None,
        env: Arc::new(MapEnv(vars)),
        segment_name: segment.into(),
        devices: Vec::new(),
        // Small, so the conformance suite can fill it.
        notifications: te_base::NotifyInbox::new(te_base::notify::NotifyLimits {
            queue_depth: 64,
            max_bytes: 4096,
        }),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance_on_a_real_device() {
    let device = match std::env::var("TE_TEST_RDMA_DEVICE") {
        Ok(d) if !d.is_empty() => d,
        _ => {
            assert!(
                !required("rdma"),
                "TE_REQUIRE names rdma but TE_TEST_RDMA_DEVICE does not name a device"
            );
            eprintln!("skipped: no RDMA device named (set TE_TEST_RDMA_DEVICE=mlx5_0 on a RoCE or InfiniBand host)");
            return;
        }
    };
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
