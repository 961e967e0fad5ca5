//! What a transport shares with the peers it connected, in its own module so that the transport
//! (which creates peers) and the peers (which use it) do not import each other.

use std::sync::Arc;

use crate::config::LocalConfig;
use crate::copy::NtKernel;
use crate::device::DeviceRoutes;
use crate::domain::Domain;
use crate::pool::CopyPool;

/// What a transport shares with the peers it connected: its domain, copy pool and settings.
#[derive(Debug)]
pub(crate) struct Shared {
    pub domain: Arc<Domain>,
    pub pool: CopyPool,
    pub config: LocalConfig,
    pub kernel: NtKernel,
    /// Plugins for requests with a device side.
    pub devices: DeviceRoutes,
}
