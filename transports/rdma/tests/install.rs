//! `install()` on a host without RDMA hardware reports "not available" cleanly, and malformed
//! configuration is a typed error naming the variable.

use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::{Error, InstallContext};

fn ctx(env: MapEnv) -> InstallContext {
    InstallContext {
        auth: None,
        env: Arc::new(env),
        segment_name: "install-test".into(),
        devices: Vec::new(),
        notifications: te_base::NotifyInbox::new(Default::default()),
    }
}

fn host_has_rdma_device() -> bool {
    std::fs::read_dir("/sys/class/infiniband")
        .map(|mut d| d.next().is_some())
        .unwrap_or(false)
}

#[tokio::test]
async fn reports_not_available_without_a_device() {
    if host_has_rdma_device() {
        eprintln!("skipped: this host has RDMA devices (/sys/class/infiniband is not empty)");
        return;
    }
    let err = match te_transport_rdma::install(&ctx(MapEnv::default())).await {
        Ok(_) => panic!("install succeeded on a host without /sys/class/infiniband entries"),
        Err(e) => e,
    };
    match &err {
        Error::NotAvailable { what, reason } => {
            assert_eq!(what, "rdma");
            assert!(
                reason == "no RDMA device" || reason.starts_with("libibverbs not found"),
                "unexpected reason: {reason}"
            );
        }
        other => panic!("expected NotAvailable, got {other:?}"),
    }
    let text = err.to_string();
    eprintln!("install: {text}");
    assert!(text.starts_with("rdma: not available: "), "{text}");
}

#[tokio::test]
async fn malformed_configuration_is_an_error_before_anything_is_opened() {
    let err = match te_transport_rdma::install(&ctx(MapEnv::new([("TE_RDMA_QPS_PER_PEER", "lots")]))).await {
        Ok(_) => panic!("install accepted TE_RDMA_QPS_PER_PEER=lots"),
        Err(e) => e,
    };
    assert!(
        matches!(err, Error::Config { ref var, .. } if var == "TE_RDMA_QPS_PER_PEER"),
        "{err}"
    );
}
