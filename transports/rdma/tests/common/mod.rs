//! What the tests on a real RDMA device share: the device they run on, and the install context
//! of a transport on it.

use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::notify::NotifyLimits;
use te_base::test_support::required;
use te_base::InstallContext;

/// The device `TE_TEST_RDMA_DEVICE` names; `None` (the test skips, saying so) when it names
/// none, a failure instead when `TE_REQUIRE` names `rdma`.
pub fn device() -> Option<String> {
    match std::env::var("TE_TEST_RDMA_DEVICE") {
        Ok(d) if !d.is_empty() => Some(d),
        _ => {
            assert!(
                !required("rdma"),
                "TE_REQUIRE names rdma but TE_TEST_RDMA_DEVICE does not name a device"
            );
            eprintln!("skipped: no RDMA device named (set TE_TEST_RDMA_DEVICE=mlx5_0 on a RoCE or InfiniBand host)");
            None
        }
    }
}

/// A transport on `device` only, for segment `segment`: the environment's other `TE_RDMA_*` and
/// `MC_*` variables apply, then `extra`; the handshake listener defaults to 127.0.0.1.
pub fn context(device: &str, segment: &str, extra: &[(&str, &str)], limits: NotifyLimits) -> InstallContext {
    let mut vars: std::collections::HashMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("TE_RDMA_") || k.starts_with("MC_"))
        .collect();
    vars.insert("TE_RDMA_DEVICES".into(), device.into());
    vars.entry("TE_RDMA_HANDSHAKE_ADDR".into())
        .or_insert_with(|| "127.0.0.1:0".into());
    for (k, v) in extra {
        vars.insert(k.to_string(), v.to_string());
    }
    InstallContext {
        auth: None,
        env: Arc::new(MapEnv(vars)),
        segment_name: segment.into(),
        devices: Vec::new(),
        notifications: te_base::NotifyInbox::new(limits),
    }
}
