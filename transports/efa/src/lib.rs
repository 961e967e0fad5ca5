//! libfabric transport: EFA on AWS, and the same code on libfabric's software providers
//! (`tcp;ofi_rxm`, `shm`, `sockets`) everywhere else.
//!
//! Shape:
//! - [`ffi`] binds a small C shim (`csrc/fi_shim.c`) over libfabric's inline functions; `fabric`
//!   wraps it safely (provider discovery, rails, memory regions).
//! - Nothing links libfabric: [`library`] opens `libfabric.so.1` at run time (`TE_FABRIC_LIBRARY`,
//!   else `/opt/amazon/efa/lib` first, then the system's), so one binary runs on hosts with
//!   libfabric 1.17, 2.x or none ("not available: libfabric.so.1 not found").
//! - One rail per NIC (provider domain): fabric, domain, RDM endpoint, address vector and
//!   completion queue, driven by one owner thread (`worker`) that posts and polls, so a full
//!   transmit queue can never deadlock against its own completions.
//! - Writes use `FI_DELIVERY_COMPLETE`: a request completes only when its bytes are in the target's
//!   memory (tcp;ofi_rxm otherwise reports completion before the data lands).
//! - Large requests are striped across rails and split at the provider's maximum message size.
//! - Registration caches are kept off ([`mr_cache`]): deregistration revokes a region's remote key
//!   before `deregister` returns, on every provider.
//! - Only exported regions get remote access, each registration covers exactly the exported
//!   range, and application-chosen keys never repeat; the provider checks keys and bounds, and
//!   [`RefusalReport`] says what the initiator sees when it refuses (shm on libfabric 2.x reports
//!   success).
//!
//! Configuration: `TE_FABRIC_PROVIDER` (default `efa`), `TE_FABRIC_DOMAINS`, `TE_FABRIC_MAX_RAILS`,
//! `TE_FABRIC_TIMEOUT_MS`, `TE_FABRIC_MAX_FRAGMENT_BYTES`, `TE_FABRIC_STRIPE_BYTES`,
//! `TE_FABRIC_IDLE`, `TE_FABRIC_SHM`, `TE_FABRIC_LIBRARY` (see [`config`]).
//!
//! ```no_run
//! # async fn demo() -> te_base::Result<()> {
//! use std::sync::Arc;
//! use te_base::config::MapEnv;
//! let ctx = te_base::InstallContext {
//!     auth: None,
//!     env: Arc::new(MapEnv::new([("TE_FABRIC_PROVIDER", "tcp;ofi_rxm")])),
//!     segment_name: "node-a".into(),
//!     devices: Vec::new(),
//!     notifications: te_base::NotifyInbox::new(Default::default()),
//! };
//! let transport = te_transport_efa::install(&ctx).await?;
//! assert_eq!(transport.name(), "efa");
//! # Ok(()) }
//! ```

use std::sync::Arc;

use te_base::{InstallContext, Result, Transport};

mod address_table;
pub mod config;
mod fabric;
pub mod ffi;
mod idle;
mod inner;
pub mod library;
mod link;
mod mailbox;
pub mod mr_cache;
mod mr_keys;
pub mod note_wire;
mod peer;
mod refusal;
mod registry;
mod reply_book;
mod signals;
mod transport;
pub mod wire;
mod worker;

pub use fabric::libfabric_versions;
pub use library::{libfabric, Libfabric};
pub use refusal::RefusalReport;
pub use transport::FabricTransport;

/// Installs the `efa` transport: opens one rail per NIC of the provider named by
/// `TE_FABRIC_PROVIDER` (default `efa`). [`te_base::Error::NotAvailable`] when libfabric is not
/// installed ("libfabric.so.1 not found (tried: ...)", see [`library`]) or the provider is not
/// present here; the message then lists the providers that are.
pub async fn install(ctx: &InstallContext) -> Result<Arc<dyn Transport>> {
    Ok(Arc::new(transport::install_from(ctx)?))
}

/// Names of the libfabric providers offering RDM endpoints with RMA on this host
/// (`tcp;ofi_rxm`, `shm`...). Empty when none (or libfabric finds nothing).
pub fn available_providers() -> Vec<String> {
    fabric::providers_found()
}

/// The domains (NICs) `provider` offers RDM endpoints with RMA on, in provider order: the names
/// `TE_FABRIC_DOMAINS` accepts. Empty when the provider is not present.
pub fn provider_domains(provider: &str) -> Vec<String> {
    fabric::domains_of(provider)
}

/// The efa transport as te-core lists it.
pub const DESCRIPTOR: te_base::TransportDescriptor = te_base::TransportDescriptor {
    name: "efa",
    reach: te_base::Reach::Fabric,
    env_vars: config::ENV_VARS,
    check_env: |env| config::FabricConfig::from_env(env).map(drop),
    install: |ctx| Box::pin(install(ctx)),
};
