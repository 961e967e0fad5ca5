//! Installing the transports compiled into this build, in order of preference.

use std::sync::Arc;

use te_base::{InstallContext, Result, Transport};

/// Transports compiled into this build, in the engine's order of preference.
pub const COMPILED_TRANSPORTS: &[&str] = &[
    #[cfg(feature = "local")]
    "local",
    #[cfg(feature = "rdma")]
    "rdma",
    #[cfg(feature = "efa")]
    "efa",
    #[cfg(feature = "tcp")]
    "tcp",
];

type Installed = (&'static str, Result<Arc<dyn Transport>>);

/// Installs each compiled-in transport (or only those named). `NotAvailable` results mean
/// "compiled in but unusable here" and are reported, not fatal.
pub(crate) async fn install_all(ctx: &InstallContext, only: Option<&[String]>) -> Vec<Installed> {
    let wanted = |n: &str| only.is_none_or(|o| o.iter().any(|x| x == n));
    #[allow(unused_mut)]
    let mut out: Vec<Installed> = Vec::new();
    #[cfg(feature = "local")]
    if wanted("local") {
        out.push(("local", te_transport_local::install(ctx).await));
    }
    #[cfg(feature = "rdma")]
    if wanted("rdma") {
        out.push(("rdma", te_transport_rdma::install(ctx).await));
    }
    #[cfg(feature = "efa")]
    if wanted("efa") {
        out.push(("efa", te_transport_efa::install(ctx).await));
    }
    #[cfg(feature = "tcp")]
    if wanted("tcp") {
        out.push(("tcp", te_transport_tcp::install(ctx).await));
    }
    let _ = (ctx, &wanted);
    out
}

/// A device-memory plugin compiled into this build and whether it loads here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginStatus {
    /// Plugin name (`cuda`, `hip`).
    pub name: &'static str,
    /// `None` when loaded; otherwise why not.
    pub unavailable: Option<String>,
}

/// Device plugins compiled in (cargo features `cuda`, `hip`) and whether each loads here.
#[allow(clippy::vec_init_then_push)] // each push is behind its own cargo feature
pub fn device_plugins() -> Vec<PluginStatus> {
    #[allow(unused_mut)]
    let mut out = Vec::new();
    #[cfg(feature = "cuda")]
    out.push(PluginStatus {
        name: "cuda",
        unavailable: te_plugin_cuda::load().err().map(|e| reason(&e)),
    });
    #[cfg(feature = "hip")]
    out.push(PluginStatus {
        name: "hip",
        unavailable: te_plugin_hip::load().err().map(|e| reason(&e)),
    });
    out
}

#[cfg(any(feature = "cuda", feature = "hip"))]
fn reason(e: &te_base::Error) -> String {
    match e {
        te_base::Error::NotAvailable { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}
