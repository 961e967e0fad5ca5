//! The transports compiled into this build, each listed once (its crate's `DESCRIPTOR`), and
//! installing them. Everything te-core does per transport (install, known variables, the
//! configuration check, route preference) reads this list.

use std::sync::Arc;

use te_base::device::PluginAvailability;
use te_base::{InstallContext, Reach, Result, Transport, TransportDescriptor};

/// Lists each compiled-in transport crate once, by its cargo feature.
macro_rules! compiled {
    ($($feature:literal => $krate:ident),* $(,)?) => {
        /// Every compiled-in transport, as its crate declares itself.
        pub(crate) const DESCRIPTORS: &[&TransportDescriptor] = &[$(#[cfg(feature = $feature)] &$krate::DESCRIPTOR,)*];

        /// Transports compiled into this build, in the engine's order of preference (nearest
        /// reach first: [`Reach`]).
        pub const COMPILED_TRANSPORTS: &[&str] = &[$(#[cfg(feature = $feature)] $krate::DESCRIPTOR.name,)*];
    };
}

// In order of reach (the test below holds it to that), so the constant above is the preference.
compiled! {
    "local" => te_transport_local,
    "shm" => te_transport_shm,
    "rdma" => te_transport_rdma,
    "efa" => te_transport_efa,
    "tcp" => te_transport_tcp,
}

/// Where the compiled-in transport `name` reaches (`None`: not one of them, e.g. a custom one).
pub(crate) fn reach_of(name: &str) -> Option<Reach> {
    DESCRIPTORS.iter().find(|d| d.name == name).map(|d| d.reach)
}

type Installed = (&'static str, Result<Arc<dyn Transport>>);

/// Installs each compiled-in transport (or only those named). `NotAvailable` results mean
/// "compiled in but unusable here" and are reported, not fatal.
pub(crate) async fn install_all(ctx: &InstallContext, only: Option<&[String]>) -> Vec<Installed> {
    let wanted = |n: &str| only.is_none_or(|o| o.iter().any(|x| x == n));
    let mut out: Vec<Installed> = Vec::new();
    for d in DESCRIPTORS.iter().filter(|d| wanted(d.name)) {
        out.push((d.name, (d.install)(ctx).await));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_is_in_order_of_reach_and_names_each_transport_once() {
        assert!(DESCRIPTORS.windows(2).all(|w| w[0].reach <= w[1].reach));
        let names: Vec<&str> = DESCRIPTORS.iter().map(|d| d.name).collect();
        assert_eq!(names, COMPILED_TRANSPORTS);
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len());
    }
}
