//! The local-copy transport: host memory to host memory between segments of one process.
//!
//! Built as the seed's fixed design: a batch is resolved against registration tables (sorted,
//! binary search, one shared lock per batch), planned (ordered by destination, exactly adjacent
//! fragments coalesced into one copy), and copied with non-temporal stores for copies of
//! `TE_NT_COPY_MIN_BYTES` (2 KiB) and more, fanned out over a persistent pool of
//! `TE_COPY_THREADS` workers (2, the submitting thread included). Background submissions stay
//! inline. See [`peer`](crate::LocalTransport) for what happens when requests of one batch touch
//! the same memory.
//!
//! The engine installs it with [`install`]; [`copy`], [`plan`] and [`parts`] are public for the
//! benchmarks.

pub mod config;
pub mod copy;
mod domain;
pub mod parts;
mod peer;
pub mod plan;
mod pool;
mod resolve;
mod table;
mod transport;

use std::sync::Arc;

pub use config::LocalConfig;
pub use copy::NtKernel;
pub use domain::LocalEndpoint;
pub use transport::LocalTransport;

/// The transport's name in descriptors and reports.
pub const NAME: &str = "local";

/// Creates the local-copy transport from the engine's configuration (`TE_COPY_THREADS`,
/// `TE_NT_COPY_MIN_BYTES`). Fails only on malformed configuration or if a helper thread cannot
/// be started; the local copy is usable on every host.
pub async fn install(ctx: &te_base::InstallContext) -> te_base::Result<Arc<dyn te_base::Transport>> {
    let config = LocalConfig::from_env(&*ctx.env)?;
    Ok(Arc::new(LocalTransport::new(config)?))
}
