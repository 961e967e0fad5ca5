//! RDMA verbs transport (RoCE / InfiniBand).
//!
//! Layers, bottom up:
//! - [`verbs`]: the thin verbs layer. [`verbs::Verbs`] is implemented by
//!   [`verbs::loaded::LoadedVerbs`] (libibverbs opened at run time, so nothing links rdma-core and
//!   a host without it runs the same binary) and, for tests, by a recording fake.
//! - [`protocol`]: pure logic with no verbs calls, driven by inputs and producing actions: the QP
//!   state machine and its attributes, the connection handshake and MTU negotiation, work-request
//!   batching with signalled completions, completion accounting, error classification and retry,
//!   QP re-establishment with backoff, registration splitting and remote key lookup per rail.
//! - [`transport`]: the transport over any [`verbs::Verbs`]: rails, rail-local registration
//!   (te-base's `NicPlacement`; GPU memory through the device plugins' dma-bufs or peer memory),
//!   connection, the data path over the rails both buffers are on, and the progress thread.
//! - [`install`]: discovers devices and reports `rdma: not available: ...` where there are none.

pub mod config;
pub mod protocol;
pub mod transport;
pub mod verbs;

use std::path::Path;
use std::sync::Arc;

use te_base::{Error, InstallContext, Result, Transport};
use te_topology::{NicPlacement, Topology};

use crate::config::RdmaConfig;
use crate::transport::RdmaTransport;
use crate::verbs::loaded::LoadedVerbs;
use crate::verbs::Verbs;

/// The transport's name in descriptors and reports.
pub const NAME: &str = "rdma";

/// Installs the RDMA transport.
///
/// `Error::NotAvailable { what: "rdma", reason }` when libibverbs is not installed ("libibverbs
/// not found: ...") or the host has no RDMA device ("no RDMA device"); the engine then keeps going
/// with its other transports. A malformed `TE_RDMA_*` variable is an `Error::Config`.
pub async fn install(ctx: &InstallContext) -> Result<Arc<dyn Transport>> {
    let config = RdmaConfig::from_env(ctx.env.as_ref())?;
    let verbs = LoadedVerbs::load()?;
    let devices = select_devices(&verbs, &config)?;
    // Rail numbering, link rates and rail-local placement come from te-base's topology; without
    // it (unreadable sysfs) rails keep the device order, stripe evenly and every region is
    // registered on every rail. A malformed placement variable is an error.
    let placement = match Topology::discover() {
        // `start` maps GPU ordinals through the plugins.
        Ok(topology) => Some(NicPlacement::from_env(topology, ctx.env.as_ref())?),
        Err(e) => {
            tracing::warn!("rdma: topology discovery failed; rails keep device order, regions go on every rail: {e}");
            None
        }
    };
    let transport = RdmaTransport::start(
        Arc::new(verbs),
        &devices,
        placement,
        ctx.devices.clone(),
        config,
        &ctx.segment_name,
        Path::new("/sys"),
        ctx.auth.clone(),
    )
    .await?;
    transport.deliver_notifications_to(ctx.notifications.clone());
    Ok(Arc::new(transport))
}

/// The devices to use: `TE_RDMA_DEVICES`, or every device the library lists.
fn select_devices<V: Verbs>(verbs: &V, config: &RdmaConfig) -> Result<Vec<String>> {
    let present = verbs.device_names()?;
    if present.is_empty() {
        return Err(Error::not_available(NAME, "no RDMA device"));
    }
    match &config.devices {
        None => Ok(present),
        Some(wanted) => {
            if let Some(missing) = wanted.iter().find(|w| !present.contains(w)) {
                return Err(Error::config(
                    "TE_RDMA_DEVICES",
                    wanted.join(","),
                    format!("no RDMA device named {missing:?} (present: {})", present.join(", ")),
                ));
            }
            Ok(wanted.clone())
        }
    }
}

/// The rdma transport as te-core lists it.
pub const DESCRIPTOR: te_base::TransportDescriptor = te_base::TransportDescriptor {
    name: "rdma",
    reach: te_base::Reach::Fabric,
    env_vars: config::ENV_VARS,
    check_env: |env| config::RdmaConfig::from_env(env).map(drop),
    install: |ctx| Box::pin(install(ctx)),
};
