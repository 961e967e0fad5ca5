//! The store's public face: one API over the three modes, each a `backend::Backend` built
//! once at open from the configured mode.
//!
//! - local: the store core (tiers, ranged get and put, eviction, compaction) in this process;
//! - standalone: a client of the node's `umbp-server`, which owns the tiers
//!   ([`crate::standalone`]);
//! - distributed: a core plus its cluster layer, which reads missed keys from their owners and
//!   places overflow on other peers ([`crate::cluster`]).
//!
//! The methods here check that the store is open and forward to the backend; the core below
//! knows none of the modes.

pub(crate) mod backend;
mod blocking;
#[cfg(feature = "cluster")]
mod cluster_layer;
mod metrics;
mod over_core;
mod standalone_client;
pub mod stats;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use te_base::PhaseReport;
use te_core::TransferEngine;

use crate::config::{ModeConfig, StoreBuilder, StoreConfig};
use crate::core::{whole_object_puts, whole_object_ranges, Core};
pub use crate::core::{RangedGet, RangedPut};
use crate::error::{Result, StoreError};
use crate::standalone::KvBuffer;
use backend::{Backend, CallerMemory};
use over_core::{Local, OverCore};
use standalone_client::Standalone;
pub use stats::StoreStats;

struct Inner {
    cfg: StoreConfig,
    backend: Arc<dyn Backend>,
}

/// The UMBP store. Cheap to clone; clones share one store. Data calls are blocking and may run
/// on many threads at once; registration and opening are async.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("config", &self.inner.cfg).finish()
    }
}

static STORE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A segment name unique in this process.
fn fresh_name(what: &str) -> String {
    format!(
        "{what}-{}-{}",
        std::process::id(),
        STORE_COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// An engine for moving bytes inside this process only: the local-copy transport is all a
/// local store (or a standalone worker) needs. Installing the others would open network
/// listeners nobody uses and, with efa compiled in, load libfabric, whose shm provider installs
/// its own SIGTERM handler.
async fn local_engine(name: String) -> Result<TransferEngine> {
    Ok(TransferEngine::builder()
        .segment_name(name)
        .transports(["local"])
        .build()
        .await?)
}

impl StoreBuilder {
    /// Opens a store in the configured mode, with its own engine (segment name from the
    /// builder, else `umbp-<pid>-<n>`). Must run inside a tokio runtime (the engine's
    /// requirement).
    pub async fn open(self) -> Result<Store> {
        let cfg = self.config()?;
        let name = cfg.segment_name.clone().unwrap_or_else(|| fresh_name("umbp"));
        let backend: Arc<dyn Backend> = match &cfg.mode {
            ModeConfig::Local => Arc::new(OverCore(Local(Arc::new(
                Core::open(cfg.core.clone(), local_engine(name).await?, true).await?,
            )))),
            ModeConfig::Standalone(sc) => Arc::new(Standalone::connect(sc.clone(), fresh_name("umbp-client")).await?),
            #[cfg(feature = "cluster")]
            ModeConfig::Cluster(cc) => Arc::new(OverCore(
                crate::cluster::Peer::open(cfg.core.clone(), cc.clone(), &name).await?,
            )),
        };
        Ok(Store::exported(cfg, backend))
    }

    /// Opens a local-mode store on an existing engine (the store registers its memory there and
    /// opens the engine's own segment). A configuration naming another mode is refused.
    pub async fn open_on(self, engine: TransferEngine) -> Result<Store> {
        let cfg = self.config()?;
        if !matches!(cfg.mode, ModeConfig::Local) {
            return Err(StoreError::Engine(te_base::Error::config(
                "mode",
                cfg.mode.name(),
                "a store opened on an existing engine runs in local mode",
            )));
        }
        let core = Core::open(cfg.core.clone(), engine, false).await?;
        Ok(Store::exported(cfg, Arc::new(OverCore(Local(Arc::new(core))))))
    }
}

impl Store {
    /// A builder; unset options come from `UMBP_*` variables.
    ///
    /// ```
    /// # #[tokio::main]
    /// # async fn main() -> umbp::Result<()> {
    /// // A local store with a 16 MiB DRAM tier and no SSD tier.
    /// let store = umbp::Store::builder().dram_capacity(16 << 20).ssd_dirs(vec![]).open().await?;
    /// store.put("k", b"value", 0).await?;
    /// assert_eq!(store.get("k").await?, b"value");
    /// store.close().await?;
    /// # Ok(()) }
    /// ```
    pub fn builder() -> StoreBuilder {
        StoreBuilder::new()
    }

    /// The store, with its counters exported through its engine's metrics.
    fn exported(cfg: StoreConfig, backend: Arc<dyn Backend>) -> Store {
        let store = Store {
            inner: Arc::new(Inner { cfg, backend }),
        };
        let weak = Arc::downgrade(&store.inner);
        metrics::export(store.engine(), move || {
            weak.upgrade().map(|inner| Store { inner }.stats())
        });
        store
    }

    /// Every call after [`Store::close`] fails with [`StoreError::Closed`], in every mode.
    fn check_open(&self) -> Result<()> {
        self.inner.backend.check_open()
    }

    /// The mode's backend (the standalone server serves it).
    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// True in standalone mode.
    pub fn is_standalone(&self) -> bool {
        self.inner.backend.is_standalone()
    }

    /// Allocates a KV buffer of `len` bytes as a sealed memfd mapped shared: in standalone mode
    /// the only memory the server can map; in the other modes an ordinary buffer. Register it
    /// with [`Store::register_buffer`] and release it with [`Store::free_buffer`].
    pub fn alloc_buffer(&self, len: usize) -> Result<KvBuffer> {
        self.check_open()?;
        self.inner.backend.alloc_buffer(len)
    }

    /// Deregisters (if registered) and releases a buffer from [`Store::alloc_buffer`].
    pub async fn free_buffer(&self, buf: KvBuffer) -> Result<()> {
        self.inner.backend.free_buffer(buf).await
    }

    /// Standalone mode: the client's reuse-distance line (`UMBP_KEY_HANDLE_DEBUG=1`), and the
    /// request bytes and count of its ranged gets.
    pub fn key_handle_report(&self) -> Option<(Option<String>, u64, u64)> {
        self.inner.backend.key_handle_report()
    }

    /// The engine the store moves bytes with.
    pub fn engine(&self) -> &TransferEngine {
        self.inner.backend.engine()
    }

    /// The resolved configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.inner.cfg
    }

    /// Registers caller host memory through the engine, so ranged calls can read into and write
    /// from it (described by this registration, never by asking what a pointer is).
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must be host memory that stays valid until
    /// [`Store::deregister_buffer`] or [`Store::close`], and the caller must not read bytes a
    /// running get writes into, nor change bytes a running put reads.
    pub async unsafe fn register_buffer(&self, addr: u64, len: u64) -> Result<()> {
        // SAFETY: forwarded contract.
        let memory = unsafe { CallerMemory::new(addr, len, None) };
        self.inner.backend.register_buffer(memory).await
    }

    /// Deregisters the caller buffer that starts at `addr`. False if none does.
    pub async fn deregister_buffer(&self, addr: u64) -> Result<bool> {
        self.inner.backend.deregister_buffer(addr).await
    }

    /// Registers caller host memory that `owner` keeps alive, as [`Store::register_buffer`]
    /// does, but the store holds `owner` until the buffer is deregistered (or the store closed)
    /// *and* the last transfer using it has ended: a deregistration while a call still writes
    /// into the buffer returns [`StoreError::Engine`] with `InFlight` and the memory is released
    /// when that call's transfers end, never before. This is what language bindings use, where
    /// the caller cannot be trusted to keep memory alive.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must be host memory that stays valid while `owner` is alive, and the
    /// caller must not read bytes a running get writes into, nor change bytes a running put reads.
    pub async unsafe fn register_buffer_owned(
        &self,
        addr: u64,
        len: u64,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        let memory = unsafe { CallerMemory::new(addr, len, Some(owner)) };
        self.inner.backend.register_buffer(memory).await
    }

    /// True if `key` is in any tier. In standalone mode an unreachable server is an error, never
    /// a `false`.
    pub fn exists(&self, key: &str) -> Result<bool> {
        self.check_open()?;
        self.inner.backend.exists(key)
    }

    /// How many of `keys`, from the first, are stored: stops at the first miss (prefix matching).
    /// Resolves under one shared lock per tier. In standalone mode an unreachable server is an
    /// error, never a `0`.
    pub fn batch_exists_consecutive<K: AsRef<str>>(&self, keys: &[K]) -> Result<usize> {
        self.check_open()?;
        let keys: Vec<&str> = keys.iter().map(AsRef::as_ref).collect();
        self.inner.backend.batch_exists_consecutive(&keys)
    }

    /// Removes `key` from every tier (in distributed mode, from the directory too). False if it
    /// was in none. Both tiers drop the key under the DRAM lock, so no promotion or demotion can
    /// bring the removed version back; the SSD record is marked dead on disk before this returns.
    pub fn remove(&self, key: &str) -> Result<bool> {
        self.check_open()?;
        self.inner.backend.remove(key)
    }

    /// Puts whole objects from registered caller memory: `(key, addr, len, depth)` each.
    pub fn batch_put(&self, items: &[(&str, u64, u64, u32)]) -> Result<Vec<Result<()>>> {
        let ranges = whole_object_ranges(items);
        let puts = whole_object_puts(items, &ranges);
        self.batch_put_ranges(&puts)
    }

    /// Gets whole objects into registered caller buffers: `(key, addr, capacity)` each. Per key:
    /// the object's length, or its data error (`BufferTooSmall` when it does not fit). The size
    /// and the bytes come from one lookup, so a concurrent put never yields a truncated or mixed
    /// object. In distributed mode only this peer's tiers are read.
    pub fn batch_get(&self, items: &[(&str, u64, u64)]) -> Result<Vec<Result<u64>>> {
        self.check_open()?;
        self.inner.backend.batch_get(items)
    }

    /// The object lengths of `keys` (None where absent), under one shared lock per tier. In
    /// standalone mode an unreachable server is an error, never a row of `None`.
    pub fn object_lens<'a>(&self, keys: impl Iterator<Item = &'a str>) -> Result<Vec<Option<u64>>> {
        self.check_open()?;
        let keys: Vec<&str> = keys.collect();
        self.inner.backend.object_lens(&keys)
    }

    /// Puts one object from any memory (registered for the call if it is not already).
    ///
    /// The wait for the transfer, the tier I/O and (in standalone or distributed mode) the server
    /// or peers does not stall the runtime: on a multi-thread tokio runtime the worker hands its
    /// other tasks on for the duration. On a current-thread runtime the call blocks that thread.
    pub async fn put(&self, key: &str, data: &[u8], depth: u32) -> Result<()> {
        self.check_open()?;
        self.inner.backend.put(key, data, depth).await
    }

    /// Gets one whole object into a new vector. Waits as [`Store::put`] does: other tasks of a
    /// multi-thread runtime keep running.
    pub async fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.check_open()?;
        self.inner.backend.get(key).await
    }

    /// Runs compaction of the SSD log now (it also runs in the background): every sealed
    /// segment whose live fraction is below `UMBP_SSD_COMPACT_BELOW`, or with `force` every one
    /// with any dead byte. Returns the number of segments compacted.
    pub fn compact(&self, force: bool) -> Result<u64> {
        self.check_open()?;
        self.inner.backend.compact(force)
    }

    /// Makes every acknowledged put durable: objects only in DRAM are written to the SSD log
    /// (they stay in DRAM), then every segment and directory is fsynced. Without an SSD tier
    /// there is nothing to make durable.
    pub fn flush(&self) -> Result<()> {
        self.check_open()?;
        self.inner.backend.flush()
    }

    /// Flushes, releases caller registrations, and shuts the store's own engine down (in
    /// distributed mode, after leaving the cluster). Calls after this fail with
    /// [`StoreError::Closed`].
    pub async fn close(&self) -> Result<()> {
        self.inner.backend.close().await
    }

    /// Counters since open: the tiers', and the section of the mode in use. In standalone mode
    /// they are the server's, and an unreachable server is an error, never a zeroed report.
    pub fn stats(&self) -> Result<StoreStats> {
        self.check_open()?;
        self.inner.backend.stats()
    }

    /// Per-phase timings of ranged calls (`None` unless `UMBP_RANGED_CALL_DEBUG=1`).
    pub fn phase_report(&self) -> Result<Option<PhaseReport>> {
        self.check_open()?;
        self.inner.backend.phase_report()
    }

    /// Clears the phase timings.
    pub fn reset_phase_report(&self) -> Result<()> {
        self.check_open()?;
        self.inner.backend.reset_phase_report()
    }

    /// Reads ranges of many objects into registered caller buffers. Shape errors (a range that
    /// overlaps another of its key, falls outside its object, or points into unregistered memory;
    /// a bad key) fail the whole call before any byte moves. Per key: the bytes delivered, or its
    /// data error (missing, corrupt, I/O).
    ///
    /// Blocks the calling thread until every transfer and tier write is done (in standalone or
    /// distributed mode, until the server or the owning peers answer, bounded by the configured
    /// timeout): call it from a thread of your own, or from async code inside
    /// `tokio::task::block_in_place` or `spawn_blocking`.
    ///
    /// ```
    /// # #[tokio::main]
    /// # async fn main() -> umbp::Result<()> {
    /// use umbp::{Range, RangedGet, Store};
    /// let store = Store::builder().dram_capacity(16 << 20).ssd_dirs(vec![]).open().await?;
    /// // A page of three 1728-byte layers; layers 0 and 2 land in their own buffers.
    /// let page: Vec<u8> = (0..3 * 1728).map(|i| (i / 1728) as u8 + 1).collect();
    /// store.put("page-0", &page, 0).await?;
    /// let (mut l0, mut l2) = (vec![0u8; 1728], vec![0u8; 1728]);
    /// for b in [&mut l0, &mut l2] {
    ///     // SAFETY: the buffers outlive their registration (deregistered below).
    ///     unsafe { store.register_buffer(b.as_mut_ptr() as u64, b.len() as u64) }.await?;
    /// }
    /// let ranges = [
    ///     Range::new(0, 1728, l0.as_mut_ptr() as u64),
    ///     Range::new(2 * 1728, 1728, l2.as_mut_ptr() as u64),
    /// ];
    /// let got = store.batch_get_ranges(&[RangedGet { key: "page-0", ranges: &ranges }])?;
    /// assert_eq!(*got[0].as_ref().unwrap(), 2 * 1728);
    /// assert!(l0.iter().all(|&b| b == 1) && l2.iter().all(|&b| b == 3));
    /// // A missing key is that key's error, not the call's.
    /// let missing = store.batch_get_ranges(&[RangedGet { key: "page-9", ranges: &ranges[..1] }])?;
    /// assert!(matches!(missing[0], Err(umbp::StoreError::NotFound { .. })));
    /// for b in [&l0, &l2] {
    ///     store.deregister_buffer(b.as_ptr() as u64).await?;
    /// }
    /// store.close().await?;
    /// # Ok(()) }
    /// ```
    pub fn batch_get_ranges(&self, items: &[RangedGet<'_>]) -> Result<Vec<Result<u64>>> {
        self.check_open()?;
        self.inner.backend.batch_get_ranges(items, None)
    }

    /// Writes objects given as ranges of registered caller memory that tile each object exactly.
    /// Shape errors (bad or repeated key, zero length, ranges that overlap, fall outside the
    /// object or leave a gap, unregistered memory) fail the whole call before anything is
    /// written. Per key: `Ok` once the object is stored, or its data error (no space, a
    /// concurrent put of the same key, I/O).
    ///
    /// Blocks the calling thread until every transfer and tier write is done (in standalone or
    /// distributed mode, until the server or the owning peers answer, bounded by the configured
    /// timeout): call it from a thread of your own, or from async code inside
    /// `tokio::task::block_in_place` or `spawn_blocking`.
    ///
    /// ```
    /// # #[tokio::main]
    /// # async fn main() -> umbp::Result<()> {
    /// use umbp::{Range, RangedPut, Store};
    /// let store = Store::builder().dram_capacity(16 << 20).ssd_dirs(vec![]).open().await?;
    /// // Two layers of a page, each in its own layer buffer, become one object.
    /// let (mut l0, mut l1) = (vec![1u8; 1728], vec![2u8; 1728]);
    /// for b in [&mut l0, &mut l1] {
    ///     // SAFETY: the buffers outlive their registration (deregistered below).
    ///     unsafe { store.register_buffer(b.as_mut_ptr() as u64, b.len() as u64) }.await?;
    /// }
    /// let ranges = [
    ///     Range::new(0, 1728, l0.as_mut_ptr() as u64),
    ///     Range::new(1728, 1728, l1.as_mut_ptr() as u64),
    /// ];
    /// let put = RangedPut { key: "page-0", object_len: 2 * 1728, ranges: &ranges, depth: 0 };
    /// for r in store.batch_put_ranges(&[put])? {
    ///     r?;
    /// }
    /// let page = store.get("page-0").await?;
    /// assert_eq!((page[0], page[1728]), (1, 2));
    /// for b in [&l0, &l1] {
    ///     store.deregister_buffer(b.as_ptr() as u64).await?;
    /// }
    /// store.close().await?;
    /// # Ok(()) }
    /// ```
    pub fn batch_put_ranges(&self, items: &[RangedPut<'_>]) -> Result<Vec<Result<()>>> {
        self.check_open()?;
        self.inner.backend.batch_put_ranges(items)
    }

    /// Distributed mode: the peer this store's copy of the directory names as `key`'s owner
    /// (this peer's own name for its keys); `None` in the other modes or when unknown.
    #[cfg(feature = "cluster")]
    pub fn cluster_owner(&self, key: &str) -> Option<String> {
        self.inner.backend.cluster().and_then(|p| p.owner_of(key))
    }

    /// Distributed mode: the live members this store knows, with their control addresses.
    #[cfg(feature = "cluster")]
    pub fn cluster_members(&self) -> Vec<(String, std::net::SocketAddr)> {
        self.inner.backend.cluster().map_or_else(Vec::new, |p| p.members())
    }
}
