//! State the transport shares with its connected peers: configuration, the rail workers and the
//! region table. Its own module, so the transport (which creates peers) and the peers (which
//! submit through it) do not import each other.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::config::FabricConfig;
use crate::registry::RegionTable;
use crate::worker::RailWorker;

/// State shared by the transport and its peers.
pub(crate) struct Inner {
    pub config: FabricConfig,
    /// The provider every rail uses (as fi_getinfo names it, e.g. `tcp;ofi_rxm`).
    pub provider: String,
    pub workers: Vec<RailWorker>,
    pub regions: RegionTable,
    /// Largest single RMA operation over every rail.
    pub max_fragment: u64,
    pub(crate) endpoint: serde_json::Value,
    /// Domains not opened at install, each with why.
    pub(crate) skipped: Vec<te_base::SkippedDevice>,
    pub(crate) closed: AtomicBool,
}

impl Inner {
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}
