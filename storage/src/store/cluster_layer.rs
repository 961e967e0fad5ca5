//! Distributed mode as a layer over the peer's core: misses are read from their owners,
//! overflow goes to other peers, and remove, close and stats involve the cluster.

use std::sync::Arc;

use super::over_core::Layer;
use super::StoreStats;
use crate::cluster::Peer;
use crate::core::{Core, RangedGet, RangedPut, Resolved};
use crate::error::Result;

#[async_trait::async_trait]
impl Layer for Peer {
    fn core(&self) -> &Arc<Core> {
        Peer::core(self)
    }

    fn check_local_reads(&self) -> Result<()> {
        self.check_standing()
    }

    fn remove(&self, key: &str) -> Result<bool> {
        Peer::remove(self, key)
    }

    fn batch_get_ranges(&self, items: &[RangedGet<'_>], resolved: Option<&mut Resolved>) -> Result<Vec<Result<u64>>> {
        Peer::batch_get_ranges(self, items, resolved)
    }

    fn batch_put_ranges(&self, items: &[RangedPut<'_>]) -> Result<Vec<Result<()>>> {
        Peer::batch_put_ranges(self, items)
    }

    async fn close(&self) -> Result<()> {
        Peer::close(self).await
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            core: Peer::core(self).stats(),
            cluster: Some(Peer::stats(self)),
            ..Default::default()
        }
    }

    fn cluster(&self) -> Option<&Peer> {
        Some(self)
    }
}
