//! Installing the transports compiled into this build, in order of preference.

use std::sync::Arc;

use te_base::device::PluginAvailability;
use te_base::{InstallContext, Result, Transport};

/// Transports compiled into this build, in the engine's order of preference.
pub const COMPILED_TRANSPORTS: &[&str] = &[
    #[cfg(feature = "local")]
    "local",
    #[cfg(feature = "shm")]
    "shm",
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
    #[cfg(feature = "shm")]
    if wanted("shm") {
        out.push(("shm", te_transport_shm::install(ctx).await));
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

/// Loads every device plugin compiled in (cargo features `cuda`, `hip`).
#[allow(clippy::vec_init_then_push)] // each push is behind its own cargo feature
pub(crate) fn load_plugins() -> Vec<PluginAvailability> {
    #[allow(unused_mut)]
    let mut out: Vec<PluginAvailability> = Vec::new();
    #[cfg(feature = "cuda")]
    out.push(PluginAvailability::from_load("cuda", te_plugin_cuda::load()));
    #[cfg(feature = "hip")]
    out.push(PluginAvailability::from_load("hip", te_plugin_hip::load()));
    out
}

/// Device plugins compiled in (cargo features `cuda`, `hip`) and whether each loads here.
pub fn device_plugins() -> Vec<PluginStatus> {
    load_plugins()
        .iter()
        .map(|p| match p {
            PluginAvailability::Loaded(plugin) => PluginStatus {
                name: plugin.name(),
                unavailable: None,
            },
            PluginAvailability::Unavailable { name, error } => PluginStatus {
                name,
                unavailable: Some(reason(error)),
            },
        })
        .collect()
}

fn reason(e: &te_base::Error) -> String {
    match e {
        te_base::Error::NotAvailable { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}
