//! Distributed mode (cargo feature `cluster`): every peer runs a local store plus a control
//! listener; a key one peer misses is read from the peer that owns it, straight from that peer's
//! exported DRAM arena (or a staging slot its SSD tier filled) into the caller's registered
//! buffer, by te-core's engine over whichever transport reaches it (tcp here, efa/rdma on
//! clusters). Only the requested spans move.
//!
//! - Membership lives in etcd (`directory.rs`), cached in memory and followed by a watch; a dead
//!   peer's membership vanishes with its lease. The key directory is sharded over the peers
//!   (`sharded.rs`: each key's entry at its three rendezvous peers, written before the put
//!   returns, asked on a miss), or, in the design kept to measure against, in etcd too.
//! - Each peer's engine publishes its segment (arena and staging, exported) in etcd too, so a
//!   reader opens an owner's segment by name.
//! - A remote read is RESOLVE (control round trip: extents and placement generations), one
//!   engine batch per owner per call, then VALIDATE (was any page reused meanwhile): see
//!   `owner.rs` for why a seqlock-style check rather than a pin.
//!
//! Control work (etcd, the listener, control requests) runs on a small runtime the cluster owns,
//! so the store's blocking data calls work from any thread, inside a runtime or not.

pub mod config;
pub(crate) mod conn;
pub(crate) mod directory;
mod etcd_keys;
pub mod guard;
mod key_directory;
pub(crate) mod leases;
mod membership;
pub(crate) mod owner;
mod peer;
pub(crate) mod remote_get;
pub(crate) mod remote_put;
mod rendezvous;
mod request_error;
pub(crate) mod server;
mod shard;
mod sharded;
pub(crate) mod standing;
pub mod stats;
mod wake;
pub mod wire;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use te_base::listener::ListenerLimits;
use te_base::SegmentId;

pub use config::ClusterConfig;
use conn::{Conn, ConnPool};
use directory::{Directory, FreeBytes, LocalKeys};
use owner::Owner;
pub(crate) use peer::Peer;
use server::Server;

use crate::error::{ClusterError, Result, StoreError};

/// Counters of the distributed path, updated once per call.
#[derive(Debug, Default)]
pub(crate) struct ClusterCounters {
    pub(crate) remote_hits: AtomicU64,
    pub(crate) remote_bytes: AtomicU64,
    pub(crate) remote_requests: AtomicU64,
    pub(crate) control_bytes: AtomicU64,
    pub(crate) stale: AtomicU64,
    pub(crate) remote_errors: AtomicU64,
}

/// A remote placement read before: its owner and where the object was.
pub(crate) type Remembered = (Arc<str>, Arc<wire::Place>);

/// One peer's cluster state.
pub(crate) struct Cluster {
    pub(crate) cfg: ClusterConfig,
    rt: ControlRuntime,
    pub(crate) dir: Arc<Directory>,
    server: Option<Server>,
    pool: Arc<ConnPool>,
    /// This peer's owner side (its keys' versions, retirement).
    pub(crate) owner: Arc<Owner>,
    segments: RwLock<HashMap<Arc<str>, SegmentId>>,
    /// Placements of remote DRAM objects read before (owner, extents, generation): a later read
    /// of the same key skips RESOLVE; VALIDATE still checks it, and a stale one is resolved again.
    pub(crate) placements: RwLock<HashMap<String, Remembered>>,
    pub(crate) counters: ClusterCounters,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The listener's task belongs to the runtime; neither may block the dropping thread (the
        // runtime goes right after, with the fields).
        self.server.take();
    }
}

impl Cluster {
    /// Starts the control listener on `rt` (the cluster's runtime, see [`control_runtime`]),
    /// then joins the directory over `etcd` (the engine's etcd connection). `local_keys` lists
    /// the keys this peer holds (re-published after an etcd outage or a membership change).
    pub(crate) async fn start(
        rt: ControlRuntime,
        etcd: etcd_client::Client,
        cfg: ClusterConfig,
        name: &str,
        owner: Arc<Owner>,
        local_keys: LocalKeys,
        free_bytes: FreeBytes,
    ) -> Result<Arc<Cluster>> {
        let env = te_base::config::ProcessEnv;
        let limits = ListenerLimits::from_env(&env, "UMBP_CLUSTER", cfg.timeout)?;
        let server = rt
            .spawn(Server::start(cfg.listen, cfg.auth.clone(), limits, owner.clone()))
            .await
            .map_err(|e| ClusterError::Task {
                what: "starting the control listener",
                message: e.to_string(),
            })?
            .map_err(|e| StoreError::io(format!("binding the control listener on {}", cfg.listen), e))?;
        // Connections to other peers leave from the announced control IP: a peer checking a
        // member's source address against its announcement sees that one.
        let source = Some(server.addr.ip()).filter(|ip| !ip.is_unspecified());
        let pool = Arc::new(ConnPool::new(cfg.auth.clone(), Arc::from(name), source, cfg.timeout));
        let dir = rt
            .spawn(Directory::join(
                cfg.clone(),
                etcd,
                pool.clone(),
                name.to_owned(),
                server.addr,
                local_keys,
                free_bytes,
                Arc::downgrade(&owner),
            ))
            .await
            .map_err(|e| ClusterError::Task {
                what: "joining",
                message: e.to_string(),
            })??;
        server.joined(dir.clone());
        Ok(Arc::new(Cluster {
            cfg,
            rt,
            dir,
            server: Some(server),
            pool,
            owner,
            segments: RwLock::new(HashMap::new()),
            placements: RwLock::new(HashMap::new()),
            counters: ClusterCounters::default(),
        }))
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.rt.handle()
    }

    /// Runs `futs` concurrently on the control runtime and waits (blocking this thread) for them,
    /// at most `limit` in all; a future not done by then reports `None`.
    pub(crate) fn run_all<F, T>(&self, futs: Vec<F>, limit: Duration) -> Vec<Option<T>>
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let n = futs.len();
        let (tx, rx) = std::sync::mpsc::channel();
        for (i, f) in futs.into_iter().enumerate() {
            let tx = tx.clone();
            self.handle().spawn(async move {
                let _ = tx.send((i, f.await));
            });
        }
        drop(tx);
        let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
        let end = std::time::Instant::now() + limit;
        for _ in 0..n {
            let left = end.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok((i, v)) => out[i] = Some(v),
                Err(_) => break,
            }
        }
        out
    }

    /// Runs one future on the control runtime, waiting at most `limit`.
    pub(crate) fn run<F, T>(&self, fut: F, limit: Duration) -> Option<T>
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        self.run_all(vec![fut], limit).pop().flatten()
    }

    /// Returns a healthy connection to the pool.
    pub(crate) fn put_conn(&self, owner: Arc<str>, c: Conn) {
        self.pool.put(owner, c);
    }

    /// The engine segment of `owner`, if already opened.
    pub(crate) fn segment(&self, owner: &str) -> Option<SegmentId> {
        self.segments.read().get(owner).copied()
    }

    pub(crate) fn remember_segment(&self, owner: Arc<str>, id: SegmentId) {
        self.segments.write().insert(owner, id);
    }

    /// Forgets `owner`'s segment, connections and remembered placements (it failed, perhaps
    /// restarted; the next call re-opens and re-resolves).
    pub(crate) fn forget(&self, owner: &str) {
        self.segments.write().remove(owner);
        self.pool.forget(owner);
        self.placements.write().retain(|_, (o, _)| **o != *owner);
    }

    /// Forgets the segments, connections and remembered placements of peers the membership saw
    /// leave or restart (a new instance has a new segment and new placements).
    pub(crate) fn forget_restarted(&self) {
        for peer in self.dir.take_restarted() {
            self.forget(&peer);
        }
    }

    /// Writes `keys` to the directory as owned here (a fresh write), blocking this thread at
    /// most the cluster timeout. Returns the keys the directory did not take (index into `keys`,
    /// why): their put is not acknowledged.
    pub(crate) fn publish(&self, keys: Vec<String>) -> Vec<(usize, String)> {
        if !self.dir.is_live() {
            // etcd is out of reach: every local key is written again when it answers.
            self.dir.mark_dirty();
            if self.dir.keys().lives_in_etcd() {
                // A directory in etcd cannot take it now: the put stays local and fast.
                return Vec::new();
            }
            // The sharded directory takes it at the key's directory peers under the membership
            // last seen (a member cut off from etcd alone stays in it through the others'
            // RENEW), retiring the copies it supersedes. (Kept local, it was acknowledged while
            // another member's older copy stayed readable.)
        }
        // Blocking on this thread: the sharded directory's messages go out from here.
        self.dir.publish(&keys, true, self.dir.deadline())
    }

    /// Removes `key` from the directory if this peer still owns it there (best effort, within
    /// the cluster timeout).
    pub(crate) fn unpublish(&self, key: &str) {
        self.dir.keys().unpublish(&[key.to_owned()], self.dir.deadline());
    }

    /// Leaves the cluster: membership and keys vanish now (bounded by the cluster timeout).
    pub(crate) fn leave(&self) {
        let dir = self.dir.clone();
        let _ = self.run(async move { dir.leave().await }, self.cfg.timeout);
    }
}

/// The runtime a peer's control work runs on: the listener, etcd (the engine's metadata
/// included, so that one connection serves both), and the directory's tasks.
pub(crate) fn control_runtime() -> Result<ControlRuntime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("umbp-cluster")
        .enable_all()
        .build()
        .map(|rt| ControlRuntime(Some(rt)))
        .map_err(|e| StoreError::io("starting the cluster runtime", e))
}

/// The cluster's own runtime. It is created inside the caller's async code (`Peer::open`), so
/// an early error drops it there too: dropping shuts it down in the background, where tokio's
/// own drop would panic ("Cannot drop a runtime in a context where blocking is not allowed").
pub(crate) struct ControlRuntime(Option<tokio::runtime::Runtime>);

impl std::ops::Deref for ControlRuntime {
    type Target = tokio::runtime::Runtime;

    fn deref(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("present until drop")
    }
}

impl Drop for ControlRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// The engine of a peer: its segment (arena and staging, exported) published in the cluster's
/// etcd under the same prefix and lease TTL, with the cluster's key on every transport. The
/// etcd store is connected on `rt`; its client is returned for the directory to share.
pub(crate) async fn engine(
    rt: &tokio::runtime::Runtime,
    cc: &ClusterConfig,
    name: &str,
) -> Result<(te_core::TransferEngine, etcd_client::Client)> {
    let mut ec = te_core::metadata::etcd::EtcdConfig::new(cc.endpoints.clone());
    ec.prefix = cc.prefix.clone();
    ec.lease_ttl_s = cc.lease_ttl_s;
    ec.timeout = cc.timeout;
    let meta = rt
        .spawn(te_core::metadata::etcd::EtcdStore::connect(ec))
        .await
        .map_err(|e| ClusterError::Task {
            what: "connecting to etcd",
            message: e.to_string(),
        })??;
    let client = meta.client();
    let mut b = te_core::TransferEngine::builder()
        .segment_name(name)
        .metadata(Arc::new(meta));
    if let Some(k) = &cc.auth {
        b = b.auth_key(k.clone());
    }
    Ok((b.build().await?, client))
}

impl Cluster {
    /// The distributed path's counters and the directory's size, as a stats section.
    pub(crate) fn stats(&self) -> stats::ClusterStats {
        let c = &self.counters;
        let l = |c: &AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let d = self.dir.counters();
        stats::ClusterStats {
            remote_hits: l(&c.remote_hits),
            remote_bytes: l(&c.remote_bytes),
            remote_requests: l(&c.remote_requests),
            remote_control_bytes: l(&c.control_bytes),
            remote_stale: l(&c.stale),
            remote_errors: l(&c.remote_errors),
            directory_entries: d.entries,
            directory_messages: d.messages,
            directory_refused_identity: d.refused_identity,
            directory_refused_capped: d.refused_capped,
            directory_lookups_throttled: d.lookups_throttled,
            lease_rejoins: self.dir.rejoins(),
        }
    }
}
