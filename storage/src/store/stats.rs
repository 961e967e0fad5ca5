//! What [`crate::Store::stats`] reports: the core's counters, plus a section for the mode the
//! store runs in.

use crate::core::stats::CoreStats;
use crate::standalone::stats::StandaloneStats;

/// Counters of a store since open: its tiers' (in standalone mode, the server's), and one
/// section per mode layer in use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// The tiers: DRAM, SSD, puts, hits and misses.
    pub core: CoreStats,
    /// Standalone mode: the client's key-handle cache and the server's tables; `None` in the
    /// other modes.
    pub standalone: Option<StandaloneStats>,
    /// Distributed mode: reads from and writes to other peers (a standalone client reports its
    /// server's, when that server is a cluster peer); `None` otherwise.
    #[cfg(feature = "cluster")]
    pub cluster: Option<crate::cluster::stats::ClusterStats>,
}
