//! How a transport crate declares itself to te-core, once: its name, where it reaches (which
//! orders the routes to a segment), the variables it reads, the check of its settings, and its
//! installer. te-core lists each compiled-in crate's descriptor once; everything it does per
//! transport (install, known variables, the configuration check, route preference) comes from
//! that list.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::config::Env;
use crate::error::Result;
use crate::transport::{InstallContext, Transport};

/// Where a transport reaches a peer. Routes to a segment are tried nearest first; transports of
/// one reach keep the order of te-core's list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reach {
    /// This process only (the in-process copy): it fails only with the process, so no second
    /// route of the same capabilities is connected behind it.
    InProcess,
    /// Processes of this host (cross-memory attach).
    SameHost,
    /// Hosts on an RDMA-capable fabric (verbs, libfabric).
    Fabric,
    /// Any host the network reaches (TCP).
    Network,
}

/// A transport's installer: builds it from the engine's context; `Error::NotAvailable` when it
/// is compiled in but unusable here.
pub type Installer =
    for<'a> fn(&'a InstallContext) -> Pin<Box<dyn Future<Output = Result<Arc<dyn Transport>>> + Send + 'a>>;

/// A transport crate, as it declares itself (`DESCRIPTOR` in each transport crate).
#[derive(Clone, Copy)]
pub struct TransportDescriptor {
    /// Its name in descriptors, reports and `TE_TRANSPORTS`.
    pub name: &'static str,
    /// Where it reaches.
    pub reach: Reach,
    /// Every variable it reads.
    pub env_vars: &'static [&'static str],
    /// Parses its variables (a malformed one is the `Error::Config` its install would return),
    /// whether or not it is usable on this host.
    pub check_env: fn(&dyn Env) -> Result<()>,
    /// Installs it.
    pub install: Installer,
}

impl std::fmt::Debug for TransportDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportDescriptor")
            .field("name", &self.name)
            .field("reach", &self.reach)
            .finish_non_exhaustive()
    }
}
