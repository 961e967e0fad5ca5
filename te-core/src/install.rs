//! Installing the transports compiled into this build, in order of preference.

use std::sync::Arc;

use te_base::{InstallContext, Result, Transport};

/// Transports compiled into this build, in the engine's order of preference.
pub const COMPILED_TRANSPORTS: &[&str] = &[
    #[cfg(feature = "local")]
    "local",
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
    let _ = (ctx, &wanted);
    out
}
