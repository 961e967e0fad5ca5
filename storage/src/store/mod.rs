//! The store: DRAM and SSD tiers behind one API, moving bytes through the transfer engine.
//!
//! The store registers its DRAM arena and its SSD staging memory with a te-core engine, opens its
//! own segment, and serves every read and write as a batch of engine requests whose remote side is
//! that segment, so the local-copy transport plans them (adjacent fragments coalesce) and copies
//! them. Caller memory is registered through [`Store::register_buffer`] and described by that
//! registration.

mod blocking;
mod callers;
mod get;
mod put;
mod staging;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use te_base::{PhaseReport, PhaseStats, PhaseTimer, SegmentId};
use te_core::{
    BatchError, HostBufferOptions, HugePages, MemoryLocation, RegisterOptions, TransferEngine, TransferRequest,
};

use crate::config::{StoreBuilder, StoreConfig};
use crate::dram::tier::DramState;
use crate::error::{Result, StoreError};
use crate::eviction::EvictionPolicy;
use crate::range_map::Range;
use crate::ssd::log::SsdLog;
use crate::ssd::record::MAX_KEY_LEN;
use callers::{CallerRegion, CallerTable};
pub(crate) use get::Resolved;
use staging::Staging;

/// One key of [`Store::batch_get_ranges`]: the object ranges to read and where each lands.
#[derive(Debug, Clone, Copy)]
pub struct RangedGet<'a> {
    /// The key.
    pub key: &'a str,
    /// Ranges of the object; each `addr` inside a registered caller buffer.
    pub ranges: &'a [Range],
}

/// One key of [`Store::batch_put_ranges`]: an object of `object_len` bytes given as ranges that
/// tile it exactly.
#[derive(Debug, Clone, Copy)]
pub struct RangedPut<'a> {
    /// The key.
    pub key: &'a str,
    /// Size of the object.
    pub object_len: u64,
    /// Ranges covering `[0, object_len)` exactly; each `addr` inside a registered caller buffer.
    pub ranges: &'a [Range],
    /// Depth hint: the page's position in its prefix (deeper pages are evicted first by the
    /// prefix-aware policy).
    pub depth: u32,
}

/// A whole object `(key, addr, len, depth)` as the single range that tiles it.
pub(crate) fn whole_object_ranges(objs: &[(&str, u64, u64, u32)]) -> Vec<[Range; 1]> {
    objs.iter()
        .map(|&(_, addr, len, _)| [Range::new(0, len, addr)])
        .collect()
}

/// The ranged puts of whole objects, borrowing the ranges from [`whole_object_ranges`].
pub(crate) fn whole_object_puts<'a>(objs: &[(&'a str, u64, u64, u32)], ranges: &'a [[Range; 1]]) -> Vec<RangedPut<'a>> {
    objs.iter()
        .zip(ranges)
        .map(|(&(key, _, len, depth), r)| RangedPut {
            key,
            object_len: len,
            ranges: r,
            depth,
        })
        .collect()
}

/// Counters of the store since open (tier byte counters are updated once per call).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Objects in DRAM.
    pub dram_objects: u64,
    /// Bytes of DRAM allocated.
    pub dram_used_bytes: u64,
    /// Bytes the DRAM arena holds.
    pub dram_capacity_bytes: u64,
    /// Bytes delivered to callers from DRAM.
    pub dram_read_bytes: u64,
    /// Objects in the SSD log.
    pub ssd_objects: u64,
    /// Bytes read from SSD files (whole blocks).
    pub ssd_read_bytes: u64,
    /// Bytes written to SSD files.
    pub ssd_written_bytes: u64,
    /// Bytes delivered to callers from SSD.
    pub ssd_delivered_bytes: u64,
    /// Objects demoted from DRAM to SSD.
    pub demoted: u64,
    /// Objects evicted from DRAM without an SSD copy (no SSD tier).
    pub dropped: u64,
    /// Demotions that failed (the object stayed in DRAM).
    pub demotion_failed: u64,
    /// Objects promoted from SSD to DRAM.
    pub promoted: u64,
    /// Keys put successfully.
    pub puts_ok: u64,
    /// Keys whose put failed.
    pub puts_failed: u64,
    /// Torn tails truncated at open.
    pub ssd_torn_dropped: u64,
    /// Damaged records found at open (their keys read `Corrupt`).
    pub ssd_corrupt_records: u64,
    /// Bytes of SSD segment files.
    pub ssd_file_bytes: u64,
    /// Bytes the SSD tier may use.
    pub ssd_capacity_bytes: u64,
    /// Segments compacted and deleted.
    pub ssd_segments_compacted: u64,
    /// Bytes rewritten by compaction.
    pub ssd_compaction_written_bytes: u64,
    /// Segment bytes deleted by compaction.
    pub ssd_compaction_freed_bytes: u64,
    /// The SSD I/O engine (`uring`, `psync`), empty without SSD.
    pub ssd_io_engine: String,
    /// True when the SSD files use O_DIRECT.
    pub ssd_direct_io: bool,

    // Standalone mode (all zero in local mode); see `crate::standalone`.
    /// Client: ranged gets that named their keys by a key handle the server accepted.
    pub key_handle_hits: u64,
    /// Client: ranged gets that sent their keys.
    pub key_handle_misses: u64,
    /// Client: handles received for key sets sent.
    pub key_handle_mints: u64,
    /// Client: mints of a key set minted before.
    pub key_handle_remints: u64,
    /// Server: handles resolved.
    pub server_key_handle_hits: u64,
    /// Server: handles not known.
    pub server_key_handle_misses: u64,
    /// Server: handles minted.
    pub server_key_handle_mints: u64,
    /// Server: key sets held now.
    pub server_key_handle_held: u64,
    /// Server: heap bytes the held key sets take.
    pub server_key_handle_bytes: u64,
    /// Server: worker sessions connected.
    pub server_sessions: u64,
    /// Server: worker buffers mapped.
    pub server_mapped_buffers: u64,
    /// Ranged calls that reused a key handle's last resolution (no key hashed or looked up).
    pub resolve_reused: u64,

    // Distributed mode (local hits and misses are counted in every mode).
    /// Keys of ranged/whole gets served by this store's own tiers.
    pub local_hits: u64,
    /// Keys of gets served by no tier and no peer.
    pub misses: u64,
    /// Keys read from another peer.
    pub remote_hits: u64,
    /// Bytes delivered from other peers (exactly the requested spans).
    pub remote_bytes: u64,
    /// Engine requests issued to other peers.
    pub remote_requests: u64,
    /// Control-protocol bytes sent and received (RESOLVE, PLACES, VALIDATE, VERDICTS).
    pub remote_control_bytes: u64,
    /// Remote keys whose placement changed while they were read (returned as misses).
    pub remote_stale: u64,
    /// Remote keys whose owner failed them (`StoreError::Remote`).
    pub remote_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    dram_read_bytes: AtomicU64,
    ssd_delivered_bytes: AtomicU64,
    demoted: AtomicU64,
    dropped: AtomicU64,
    demotion_failed: AtomicU64,
    promoted: AtomicU64,
    puts_ok: AtomicU64,
    puts_failed: AtomicU64,
    local_hits: AtomicU64,
    misses: AtomicU64,
    resolve_reused: AtomicU64,
}

pub(crate) struct Dram {
    /// Keeps the arena registered (and exported to the store's own segment) for the store's life.
    _arena: te_core::Registration,
    pub(crate) state: RwLock<DramState>,
    pub(crate) high: u64,
    pub(crate) low: u64,
    pub(crate) policy: EvictionPolicy,
}

pub(crate) struct Ssd {
    pub(crate) log: SsdLog,
    pub(crate) staging: Staging,
}

pub(crate) struct Inner {
    pub(crate) engine: TransferEngine,
    owns_engine: bool,
    pub(crate) own: SegmentId,
    pub(crate) cfg: StoreConfig,
    pub(crate) dram: Option<Dram>,
    pub(crate) ssd: Option<Ssd>,
    callers: RwLock<CallerTable>,
    clock: AtomicU64,
    /// Object versions when there is no SSD log (with one, its sequence numbers are used).
    versions: AtomicU64,
    pub(crate) timer: PhaseTimer,
    stats: Option<Arc<PhaseStats>>,
    counters: Counters,
    closed: AtomicBool,
    /// Standalone mode: every public call goes to the server through this client.
    pub(crate) remote: Option<Arc<crate::standalone::client::Client>>,

    /// Distributed mode: set once at open.
    #[cfg(feature = "cluster")]
    pub(crate) cluster: std::sync::OnceLock<Arc<crate::cluster::Cluster>>,
}

/// The UMBP store. Cheap to clone; clones share one store. Data calls are blocking and may run
/// on many threads at once; registration and opening are async.
#[derive(Clone)]
pub struct Store {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("config", &self.inner.cfg).finish()
    }
}

static STORE_COUNTER: AtomicU64 = AtomicU64::new(0);

impl StoreBuilder {
    /// Opens a store with its own engine (segment name from the builder, else
    /// `umbp-<pid>-<n>`). Must run inside a tokio runtime (the engine's requirement).
    pub async fn open(self) -> Result<Store> {
        let cfg = self.config()?;
        if cfg.standalone_socket.is_some() {
            return Store::open_remote(cfg).await;
        }
        let name = cfg.segment_name.clone().unwrap_or_else(|| {
            format!(
                "umbp-{}-{}",
                std::process::id(),
                STORE_COUNTER.fetch_add(1, Ordering::Relaxed)
            )
        });
        #[cfg(feature = "cluster")]
        if let Some(cc) = cfg.cluster.clone() {
            let engine = crate::cluster::engine(&cc, &name).await?;
            let store = Store::open_with(cfg, engine, true).await?;
            crate::cluster::join(&store, cc, &name).await?;
            return Ok(store);
        }
        // A local store only moves bytes inside this process: the local-copy transport is all
        // it needs. Installing the others would open network listeners nobody uses and, with
        // efa compiled in, load libfabric, whose shm provider installs its own SIGTERM handler.
        let engine = TransferEngine::builder()
            .segment_name(name)
            .transports(["local"])
            .build()
            .await?;
        Store::open_with(cfg, engine, true).await
    }

    /// Opens a store on an existing engine (the store registers its memory there and opens the
    /// engine's own segment).
    pub async fn open_on(self, engine: TransferEngine) -> Result<Store> {
        let cfg = self.config()?;
        Store::open_with(cfg, engine, false).await
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

    async fn open_with(cfg: StoreConfig, engine: TransferEngine, owns_engine: bool) -> Result<Store> {
        let dram = if cfg.dram_capacity > 0 {
            let opts = HostBufferOptions {
                huge_pages: HugePages::Transparent,
                ..Default::default()
            };
            let arena = engine.allocate(cfg.dram_capacity as usize, opts).await?;
            let state = DramState::new(arena.addr(), cfg.dram_capacity, cfg.dram_page_bytes);
            let cap = state.capacity();
            Some(Dram {
                _arena: arena,
                state: RwLock::new(state),
                high: (cap as f64 * cfg.dram_high_watermark) as u64,
                low: (cap as f64 * cfg.dram_low_watermark) as u64,
                policy: cfg.eviction,
            })
        } else {
            None
        };
        let ssd = match &cfg.ssd {
            None => None,
            Some(opts) => {
                let log = SsdLog::open(opts.clone())?;
                let total = cfg.ssd_staging_bytes * cfg.ssd_staging_slots as u64;
                let region = engine.allocate(total as usize, HostBufferOptions::default()).await?;
                Some(Ssd {
                    log,
                    staging: Staging::new(region, cfg.ssd_staging_bytes, cfg.ssd_staging_slots),
                })
            }
        };
        let own = engine.open_segment(engine.segment_name()).await?.id();
        let stats = cfg.ranged_call_debug.then(|| Arc::new(PhaseStats::default()));
        let timer = stats.clone().map(PhaseTimer::on).unwrap_or_default();
        Ok(crate::metrics::exported(Store {
            inner: Arc::new(Inner {
                engine,
                owns_engine,
                own,
                cfg,
                dram,
                ssd,
                callers: RwLock::new(CallerTable::default()),
                clock: AtomicU64::new(1),
                versions: AtomicU64::new(1),
                timer,
                stats,
                counters: Counters::default(),
                closed: AtomicBool::new(false),
                remote: None,

                #[cfg(feature = "cluster")]
                cluster: std::sync::OnceLock::new(),
            }),
        }))
    }

    /// Standalone mode: a store whose calls go to the server at `cfg.standalone_socket`. It has no
    /// tiers of its own; its engine (local transport only) is what `engine()` returns.
    async fn open_remote(cfg: StoreConfig) -> Result<Store> {
        let socket = cfg.standalone_socket.clone().expect("checked by the caller");
        let opts = crate::standalone::client::ClientOptions {
            socket,
            slots: cfg.key_handle_slots,
            debug: cfg.key_handle_debug,
            timeout: cfg.standalone_timeout,
            spin: cfg.standalone_spin,
            auth: cfg.standalone_auth.clone(),
        };
        let client = tokio::task::spawn_blocking(move || crate::standalone::client::Client::connect(opts))
            .await
            .map_err(|e| StoreError::Server { detail: e.to_string() })??;
        let name = format!(
            "umbp-client-{}-{}",
            std::process::id(),
            STORE_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let engine = TransferEngine::builder()
            .segment_name(name)
            .transports(["local"])
            .build()
            .await?;
        let own = engine.open_segment(engine.segment_name()).await?.id();
        Ok(crate::metrics::exported(Store {
            inner: Arc::new(Inner {
                engine,
                owns_engine: true,
                own,
                cfg,
                dram: None,
                ssd: None,
                callers: RwLock::new(CallerTable::default()),
                clock: AtomicU64::new(1),
                versions: AtomicU64::new(1),
                timer: PhaseTimer::default(),
                stats: None,
                counters: Counters::default(),
                closed: AtomicBool::new(false),
                remote: Some(Arc::new(client)),
                #[cfg(feature = "cluster")]
                cluster: std::sync::OnceLock::new(),
            }),
        }))
    }

    /// The standalone client, in standalone mode.
    #[inline]
    pub(crate) fn remote(&self) -> Option<&crate::standalone::client::Client> {
        self.inner.remote.as_deref()
    }

    /// True in standalone mode.
    pub fn is_standalone(&self) -> bool {
        self.inner.remote.is_some()
    }

    /// Allocates a KV buffer of `len` bytes as a sealed memfd mapped shared: in standalone mode
    /// the only memory the server can map; in local mode an ordinary buffer. Register it with
    /// [`Store::register_buffer`] and release it with [`Store::free_buffer`].
    pub fn alloc_buffer(&self, len: usize) -> Result<crate::KvBuffer> {
        self.check_open()?;
        match self.remote() {
            Some(c) => c.alloc(len),
            None => crate::KvBuffer::new(len),
        }
    }

    /// Deregisters (if registered) and releases a buffer from [`Store::alloc_buffer`].
    pub async fn free_buffer(&self, buf: crate::KvBuffer) -> Result<()> {
        if let Some(c) = self.remote() {
            return c.free(buf);
        }
        self.deregister_buffer(buf.addr()).await?;
        Ok(())
    }

    /// Standalone mode: the client's reuse-distance line (`UMBP_KEY_HANDLE_DEBUG=1`), and the
    /// request bytes and count of its ranged gets.
    pub fn key_handle_report(&self) -> Option<(Option<String>, u64, u64)> {
        self.remote().map(|c| {
            let (bytes, calls) = c.get_request_bytes();
            (c.key_handle_report(), bytes, calls)
        })
    }

    /// The engine the store moves bytes with.
    pub fn engine(&self) -> &TransferEngine {
        &self.inner.engine
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
        self.check_open()?;
        if let Some(c) = self.remote() {
            return c.register(addr, len);
        }
        // SAFETY: forwarded contract: the caller keeps the memory valid while registered.
        let registration = unsafe {
            self.inner
                .engine
                .register_raw(addr, len, MemoryLocation::HOST, RegisterOptions::local_only())
        }
        .await?;
        self.inner.callers.write().insert(CallerRegion {
            base: addr,
            len,
            registration,
        });
        Ok(())
    }

    /// Deregisters the caller buffer that starts at `addr`. False if none does.
    pub async fn deregister_buffer(&self, addr: u64) -> Result<bool> {
        if let Some(c) = self.remote() {
            return c.deregister(addr);
        }
        let Some(region) = self.inner.callers.write().remove(addr) else {
            return Ok(false);
        };
        region.registration.deregister().await?;
        Ok(true)
    }

    fn check_open(&self) -> Result<()> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(StoreError::Closed);
        }
        Ok(())
    }

    pub(crate) fn now(&self) -> u64 {
        self.inner.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// `n` new object versions, above every version stored (the SSD log's sequence numbers when
    /// there is one, so versions compare across tiers and restarts). One atomic add per batch.
    pub(crate) fn next_versions(&self, n: usize) -> std::ops::Range<u64> {
        let n = n as u64;
        match &self.inner.ssd {
            Some(s) => s.log.next_seqs(n),
            None => {
                let first = self.inner.versions.fetch_add(n, Ordering::Relaxed);
                first..first + n
            }
        }
    }

    /// True if `key` is in any tier. In standalone mode an unreachable server is an error, never
    /// a `false`.
    pub fn exists(&self, key: &str) -> Result<bool> {
        if let Some(c) = self.remote() {
            return c.exists(key);
        }
        if let Some(d) = &self.inner.dram {
            if d.state.read().get(key).is_some() {
                return Ok(true);
            }
        }
        Ok(self.inner.ssd.as_ref().is_some_and(|s| s.log.contains(key)))
    }

    /// How many of `keys`, from the first, are stored: stops at the first miss (prefix matching).
    /// Resolves under one shared lock per tier. In standalone mode an unreachable server is an
    /// error, never a `0`.
    pub fn batch_exists_consecutive<K: AsRef<str>>(&self, keys: &[K]) -> Result<usize> {
        if let Some(c) = self.remote() {
            let keys: Vec<&str> = keys.iter().map(AsRef::as_ref).collect();
            return c.exists_consecutive(&keys);
        }
        let dram = self.inner.dram.as_ref().map(|d| d.state.read());
        let ssd = self.inner.ssd.as_ref().map(|s| s.log.index());
        Ok(keys
            .iter()
            .take_while(|k| {
                let k = k.as_ref();
                dram.as_ref().is_some_and(|d| d.get(k).is_some()) || ssd.as_ref().is_some_and(|s| s.contains_key(k))
            })
            .count())
    }

    /// Removes `key` from every tier. False if it was in none. Both tiers drop the key under
    /// the DRAM lock, so no promotion or demotion can bring the removed version back; the SSD
    /// record is marked dead on disk before this returns.
    pub fn remove(&self, key: &str) -> Result<bool> {
        self.check_open()?;
        Self::check_keys(std::iter::once(key))?;
        if let Some(c) = self.remote() {
            return c.remove(key);
        }
        let found = self.remove_local(key)?;
        #[cfg(feature = "cluster")]
        if let (true, Some(c)) = (found, self.inner.cluster.get()) {
            c.unpublish(key);
        }
        Ok(found)
    }

    /// Removes `key` from this store's tiers (not from a cluster's directory).
    pub(crate) fn remove_local(&self, key: &str) -> Result<bool> {
        let mut dram = self.inner.dram.as_ref().map(|d| d.state.write());
        let mut found = dram.as_mut().is_some_and(|st| st.remove(key));
        let old = self.inner.ssd.as_ref().and_then(|s| s.log.unpublish(key));
        drop(dram);
        if let (Some(old), Some(s)) = (old, &self.inner.ssd) {
            found = true;
            s.log.retire(&old)?;
        }
        Ok(found)
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
    /// object.
    pub fn batch_get(&self, items: &[(&str, u64, u64)]) -> Result<Vec<Result<u64>>> {
        if let Some(c) = self.remote() {
            self.check_open()?;
            Self::check_keys(items.iter().map(|i| i.0))?;
            return c.get_whole(items);
        }
        self.get_objects(get::Wants::Whole(items), None)
    }

    /// The object lengths of `keys` (None where absent), under one shared lock per tier. In
    /// standalone mode an unreachable server is an error, never a row of `None`.
    pub fn object_lens<'a>(&self, keys: impl Iterator<Item = &'a str>) -> Result<Vec<Option<u64>>> {
        if let Some(c) = self.remote() {
            let keys: Vec<&str> = keys.collect();
            return c.object_lens(&keys);
        }
        let dram = self.inner.dram.as_ref().map(|d| d.state.read());
        let ssd = self.inner.ssd.as_ref().map(|s| s.log.index());
        Ok(keys
            .map(|k| {
                dram.as_ref()
                    .and_then(|d| d.get(k).map(|e| e.len))
                    .or_else(|| ssd.as_ref().and_then(|s| s.get(k).map(|e| e.payload_len)))
            })
            .collect())
    }

    /// Puts one object from any memory (registered for the call if it is not already).
    ///
    /// The wait for the transfer, the tier I/O and (in standalone or distributed mode) the server
    /// or peers does not stall the runtime: on a multi-thread tokio runtime the worker hands its
    /// other tasks on for the duration. On a current-thread runtime the call blocks that thread.
    pub async fn put(&self, key: &str, data: &[u8], depth: u32) -> Result<()> {
        if let Some(c) = self.remote() {
            self.check_open()?;
            Self::check_keys(std::iter::once(key))?;
            return blocking::off_worker(|| c.put_bytes(key, data, depth));
        }
        let addr = data.as_ptr() as u64;
        let len = data.len() as u64;
        if len == 0 {
            return Err(StoreError::ZeroLength {
                key_index: 0,
                range_index: 0,
            });
        }
        let temp = self.temp_register(addr, len).await?;
        let out = blocking::off_worker(|| self.batch_put(&[(key, addr, len, depth)]));
        self.temp_release(temp).await?;
        out?.remove(0)
    }

    /// Gets one whole object into a new vector. Waits as [`Store::put`] does: other tasks of a
    /// multi-thread runtime keep running.
    pub async fn get(&self, key: &str) -> Result<Vec<u8>> {
        if let Some(c) = self.remote() {
            self.check_open()?;
            Self::check_keys(std::iter::once(key))?;
            return blocking::off_worker(|| c.get_bytes(key));
        }
        let Some(mut len) = self.object_lens(std::iter::once(key))?[0] else {
            return Err(StoreError::NotFound { key: key.to_owned() });
        };
        // The object may be replaced by a larger one between the size lookup and the read: retry
        // with the new size a bounded number of times.
        for _ in 0..8 {
            let mut out = vec![0u8; len.max(1) as usize];
            let addr = out.as_mut_ptr() as u64;
            let temp = self.temp_register(addr, out.len() as u64).await?;
            let got = blocking::off_worker(|| self.batch_get(&[(key, addr, out.len() as u64)]));
            self.temp_release(temp).await?;
            match got?.remove(0) {
                Ok(n) => {
                    out.truncate(n as usize);
                    return Ok(out);
                }
                Err(StoreError::BufferTooSmall { need, .. }) => len = need,
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::WriteConflict { key: key.to_owned() })
    }

    /// Runs compaction of the SSD log now (it also runs in the background): every sealed
    /// segment whose live fraction is below `UMBP_SSD_COMPACT_BELOW`, or with `force` every one
    /// with any dead byte. Returns the number of segments compacted.
    pub fn compact(&self, force: bool) -> Result<u64> {
        self.check_open()?;
        if let Some(c) = self.remote() {
            return c.compact(force);
        }
        match &self.inner.ssd {
            Some(s) => s.log.compact(force),
            None => Ok(0),
        }
    }

    async fn temp_register(&self, addr: u64, len: u64) -> Result<Option<u64>> {
        if self.inner.callers.read().covers(addr, len) {
            return Ok(None);
        }
        // SAFETY: the memory is a live slice borrowed by the caller for the whole call, and the
        // registration is released before the call returns.
        unsafe { self.register_buffer(addr, len) }.await?;
        Ok(Some(addr))
    }

    async fn temp_release(&self, temp: Option<u64>) -> Result<()> {
        if let Some(addr) = temp {
            self.deregister_buffer(addr).await?;
        }
        Ok(())
    }

    /// Makes every acknowledged put durable: objects only in DRAM are written to the SSD log
    /// (they stay in DRAM), then every segment and directory is fsynced. Without an SSD tier
    /// there is nothing to make durable.
    pub fn flush(&self) -> Result<()> {
        if let Some(c) = self.remote() {
            return c.flush();
        }
        let Some(s) = &self.inner.ssd else { return Ok(()) };
        if let Some(d) = &self.inner.dram {
            self.write_back(d)?;
        }
        s.log.sync()
    }

    /// Flushes, releases caller registrations, and shuts the store's own engine down. Calls
    /// after this fail with [`StoreError::Closed`].
    pub async fn close(&self) -> Result<()> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        if let Some(c) = self.remote() {
            c.close();
            self.inner.engine.shutdown().await?;
            return Ok(());
        }
        // Registrations are released and the engine shut down even when the flush fails.
        let flushed = self.flush();
        #[cfg(feature = "cluster")]
        if let Some(c) = self.inner.cluster.get() {
            c.leave();
        }
        let regions = self.inner.callers.write().drain();
        for r in regions {
            r.registration.deregister().await?;
        }
        if self.inner.owns_engine {
            self.inner.engine.shutdown().await?;
        }
        flushed
    }

    /// Counters since open. In standalone mode they are the server's, and an unreachable server
    /// is an error, never a zeroed report.
    pub fn stats(&self) -> Result<StoreStats> {
        if let Some(c) = self.remote() {
            return c.stats();
        }
        let c = &self.inner.counters;
        let mut s = StoreStats {
            dram_read_bytes: c.dram_read_bytes.load(Ordering::Relaxed),
            ssd_delivered_bytes: c.ssd_delivered_bytes.load(Ordering::Relaxed),
            demoted: c.demoted.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            demotion_failed: c.demotion_failed.load(Ordering::Relaxed),
            promoted: c.promoted.load(Ordering::Relaxed),
            puts_ok: c.puts_ok.load(Ordering::Relaxed),
            puts_failed: c.puts_failed.load(Ordering::Relaxed),
            local_hits: c.local_hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            resolve_reused: c.resolve_reused.load(Ordering::Relaxed),
            ..Default::default()
        };
        #[cfg(feature = "cluster")]
        if let Some(cl) = self.inner.cluster.get() {
            cl.counters.fill(&mut s);
        }
        if let Some(d) = &self.inner.dram {
            let st = d.state.read();
            s.dram_objects = st.len() as u64;
            s.dram_used_bytes = st.used();
            s.dram_capacity_bytes = st.capacity();
        }
        if let Some(ssd) = &self.inner.ssd {
            let k = ssd.log.counters();
            s.ssd_objects = ssd.log.len() as u64;
            s.ssd_read_bytes = k.bytes_read.load(Ordering::Relaxed);
            s.ssd_written_bytes = k.bytes_written.load(Ordering::Relaxed);
            s.ssd_torn_dropped = k.torn_dropped.load(Ordering::Relaxed);
            s.ssd_corrupt_records = k.corrupt_records.load(Ordering::Relaxed);
            s.ssd_file_bytes = ssd.log.file_bytes();
            s.ssd_capacity_bytes = ssd.log.capacity();
            s.ssd_segments_compacted = k.segments_compacted.load(Ordering::Relaxed);
            s.ssd_compaction_written_bytes = k.compaction_written.load(Ordering::Relaxed);
            s.ssd_compaction_freed_bytes = k.compaction_freed.load(Ordering::Relaxed);
            s.ssd_io_engine = ssd.log.io_engine().to_owned();
            s.ssd_direct_io = ssd.log.direct_io();
        }
        Ok(s)
    }

    /// Per-phase timings of ranged calls (`None` unless `UMBP_RANGED_CALL_DEBUG=1`).
    pub fn phase_report(&self) -> Result<Option<PhaseReport>> {
        if let Some(c) = self.remote() {
            return c.phase_report();
        }
        Ok(self.inner.stats.as_ref().map(|s| s.report()))
    }

    /// Clears the phase timings.
    pub fn reset_phase_report(&self) -> Result<()> {
        if let Some(c) = self.remote() {
            return c.reset_phase_report();
        }
        if let Some(s) = &self.inner.stats {
            s.reset();
        }
        Ok(())
    }

    /// Submits `requests` and waits; on failure maps each failed request to its key through
    /// `owner` (the key index of each request) and records the first error of each key.
    pub(crate) fn run_batch(
        &self,
        requests: &[TransferRequest],
        owner: &[u32],
        errors: &mut [Option<StoreError>],
    ) -> Result<()> {
        if requests.is_empty() {
            return Ok(());
        }
        let timer = &self.inner.timer;
        // With the phase report on, the engine and its transport record into the store's timer,
        // so resolve, plan and submit show the engine's own split (the seed's breakdown).
        let batch = if timer.is_on() {
            let opts = te_core::SubmitOptions {
                background: false,
                timer: Some(timer.clone()),
                ..Default::default()
            };
            self.inner.engine.submit_with(requests, &opts)?
        } else {
            self.inner.engine.submit(requests)?
        };
        let t1 = timer.start();
        let outcome = batch.wait_blocking(None).expect("no timeout");
        timer.lap(te_base::Phase::Wait, t1);
        if let Err(BatchError { failures, .. }) = outcome {
            for (i, e) in failures {
                let k = owner[i] as usize;
                if errors[k].is_none() {
                    errors[k] = Some(StoreError::Engine(e));
                }
            }
        }
        Ok(())
    }

    pub(crate) fn check_keys<'a>(keys: impl Iterator<Item = &'a str>) -> Result<()> {
        for (i, k) in keys.enumerate() {
            if k.is_empty() || k.len() > MAX_KEY_LEN {
                return Err(StoreError::BadKey {
                    key_index: i,
                    len: k.len(),
                    max: MAX_KEY_LEN,
                });
            }
        }
        Ok(())
    }
}
