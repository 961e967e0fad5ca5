//! Distributed mode as a layer over the core: a peer is a local core plus its cluster state.
//! Ranged gets hand the keys no local tier holds to their owners ([`MissResolver`]), puts offer
//! what local DRAM cannot hold to the roomiest peer ([`Overflow`]) and write the keys stored here
//! to the directory, removes leave the directory, and close leaves the cluster.

use std::sync::Arc;

use super::directory::{FreeBytes, LocalKeys};
use super::owner::Owner;
use super::stats::ClusterStats;
use super::{engine, Cluster, ClusterConfig};
use crate::core::config::CoreConfig;
use crate::core::hooks::{MissResolver, Overflow};
use crate::core::{Core, RangedGet, RangedPut, Resolved};
use crate::error::{ClusterError, Result, StoreError};

/// One peer of a cluster.
pub(crate) struct Peer {
    core: Arc<Core>,
    cluster: Arc<Cluster>,
}

impl Peer {
    /// Opens the core on an engine that publishes its segment in the cluster's etcd, starts the
    /// control listener, joins the directory, and writes every key the core already holds (a
    /// restarted peer's SSD keys) to it.
    pub(crate) async fn open(cfg: CoreConfig, cc: ClusterConfig, name: &str) -> Result<Peer> {
        let rt = super::control_runtime()?;
        let (engine, etcd) = engine(&rt, &cc, name).await?;
        let core = Arc::new(Core::open(cfg, engine, true).await?);
        let weak = Arc::downgrade(&core);
        let lister = weak.clone();
        let local_keys: LocalKeys = Box::new(move || lister.upgrade().map(|c| c.keys()).unwrap_or_default());
        let free = weak.clone();
        let free_bytes: FreeBytes = Box::new(move || free.upgrade().map(|c| c.dram_free()).unwrap_or(0));
        let owner = Arc::new(Owner::new(weak.clone(), cc.timeout));
        let cluster = Cluster::start(rt, etcd, cc, name, owner.clone(), local_keys, free_bytes).await?;
        let (dir, keys) = (cluster.dir.clone(), core.keys());
        let end = dir.deadline();
        let _ = cluster
            .handle()
            .spawn_blocking(move || dir.publish(&keys, false, end))
            .await;
        // Frees staging slots and DRAM reservations whose holder died, at half the deadline's
        // granularity; ends with the core.
        let period = (cluster.cfg.timeout / 2).max(std::time::Duration::from_millis(10));
        cluster.handle().spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let Some(core) = weak.upgrade() else {
                    return;
                };
                owner.expire_holds(&core);
            }
        });
        Ok(Peer { core, cluster })
    }

    /// The local core.
    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// Whether this peer may serve reads now: its lease must be known to stand
    /// (`standing.rs`), or its own copies could be older than a write acknowledged elsewhere.
    pub(crate) fn check_standing(&self) -> Result<()> {
        if self.cluster.dir.standing.may_serve_local() {
            return Ok(());
        }
        Err(ClusterError::NotStanding.into())
    }

    /// A ranged get: local tiers first, then the owners of the keys they miss.
    pub(crate) fn batch_get_ranges(
        &self,
        items: &[RangedGet<'_>],
        resolved: Option<&mut Resolved>,
    ) -> Result<Vec<Result<u64>>> {
        self.check_standing()?;
        self.core
            .batch_get_ranges(items, resolved, &mut RemoteReads(&self.cluster))
    }

    /// A ranged put: what local DRAM cannot hold goes to the roomiest peer first; the keys stored
    /// here are routable to this peer before the put returns.
    pub(crate) fn batch_put_ranges(&self, items: &[RangedPut<'_>]) -> Result<Vec<Result<()>>> {
        let mut remote = RemotePuts {
            cluster: &self.cluster,
            placed: Vec::new(),
        };
        let mut results = self.core.batch_put_ranges(items, &mut remote)?;
        let mut elsewhere = vec![false; items.len()];
        for k in remote.placed {
            elsewhere[k] = true;
        }
        let at: Vec<usize> = (0..items.len())
            .filter(|&k| results[k].is_ok() && !elsewhere[k])
            .collect();
        let local: Vec<String> = at.iter().map(|&k| items[k].key.to_owned()).collect();
        // A key the directory did not take is not acknowledged (and its copy here is dropped).
        for (i, reason) in self.cluster.publish(local) {
            let k = at[i];
            results[k] = Err(StoreError::Unacknowledged {
                key: items[k].key.to_owned(),
                reason,
            });
        }
        Ok(results)
    }

    /// Removes `key` here and, if it was here, from the directory.
    pub(crate) fn remove(&self, key: &str) -> Result<bool> {
        let found = self.core.remove(key)?;
        self.cluster.owner.versions.forget(key);
        if found {
            self.cluster.unpublish(key);
        }
        Ok(found)
    }

    /// Leaves the cluster (membership and keys vanish now), then closes the core.
    pub(crate) async fn close(&self) -> Result<()> {
        if self.core.check_open().is_err() {
            return Ok(());
        }
        self.cluster.leave();
        self.core.close().await.map(|_| ())
    }

    /// The distributed path's counters.
    pub(crate) fn stats(&self) -> ClusterStats {
        self.cluster.stats()
    }

    /// The peer this peer's copy of the directory names as `key`'s owner.
    pub(crate) fn owner_of(&self, key: &str) -> Option<String> {
        self.cluster.dir.owner_of(key).map(|o| o.to_string())
    }

    /// The live members this peer knows, with their control addresses.
    pub(crate) fn members(&self) -> Vec<(String, std::net::SocketAddr)> {
        self.cluster
            .dir
            .members()
            .into_iter()
            .map(|(n, a)| (n.to_string(), a))
            .collect()
    }
}

/// Reads a get's missed keys from their owners.
struct RemoteReads<'a>(&'a Arc<Cluster>);

impl MissResolver for RemoteReads<'_> {
    fn resolve(
        &mut self,
        core: &Core,
        items: &[RangedGet<'_>],
        missed: &[usize],
        errors: &mut [Option<StoreError>],
    ) -> Vec<usize> {
        let mut hits = Vec::new();
        self.0.get_remote(core, items, missed, errors, &mut hits);
        hits
    }
}

/// Places a put's overflow on other peers, remembering which keys went there (their owner
/// writes them to the directory).
struct RemotePuts<'a> {
    cluster: &'a Cluster,
    placed: Vec<usize>,
}

impl Overflow for RemotePuts<'_> {
    fn place(&mut self, core: &Core, items: &[RangedPut<'_>], keys: &[usize]) -> Vec<usize> {
        let placed = self.cluster.put_remote(core, items, keys);
        self.placed.extend_from_slice(&placed);
        placed
    }
}
