//! The local store core: DRAM and SSD tiers behind one ranged API, moving bytes through the
//! transfer engine. It knows nothing of the modes built on it (standalone, distributed): what a
//! mode adds to a call comes in through the hooks of [`hooks`], and what a remote peer may ask of
//! this store's exported memory is a named operation of [`exported`].
//!
//! The core registers its DRAM arena and its SSD staging memory with a te-core engine, opens its
//! own segment, and serves every read and write as a batch of engine requests whose remote side is
//! that segment, so the local-copy transport plans them (adjacent fragments coalesce) and copies
//! them. Caller memory is registered through [`Core::register_buffer`] and described by that
//! registration.

mod callers;
pub mod config;
#[cfg(feature = "cluster")]
pub(crate) mod exported;
mod get;
pub(crate) mod hooks;
mod put;
mod staging;
pub mod stats;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use te_base::{PhaseReport, PhaseStats, PhaseTimer, SegmentId};
use te_core::{
    BatchError, HostBufferOptions, HugePages, MemoryLocation, RegisterOptions, TransferEngine, TransferRequest,
};

use crate::dram::tier::DramState;
use crate::error::{Result, StoreError};
use crate::eviction::EvictionPolicy;
use crate::range_map::Range;
use crate::ssd::log::SsdLog;
use crate::ssd::record::MAX_KEY_LEN;
use callers::{CallerRegion, CallerTable};
use config::CoreConfig;
pub(crate) use get::Resolved;
use staging::Staging;
use stats::{CoreStats, Counters};

/// One key of a ranged get: the object ranges to read and where each lands.
#[derive(Debug, Clone, Copy)]
pub struct RangedGet<'a> {
    /// The key.
    pub key: &'a str,
    /// Ranges of the object; each `addr` inside a registered caller buffer.
    pub ranges: &'a [Range],
}

/// One key of a ranged put: an object of `object_len` bytes given as ranges that tile it exactly.
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

/// Checks every key's length (the first bad one is the call's error).
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

/// The tiers of one store and the engine that moves their bytes.
pub(crate) struct Core {
    engine: TransferEngine,
    owns_engine: bool,
    own: SegmentId,
    cfg: CoreConfig,
    dram: Option<Dram>,
    ssd: Option<Ssd>,
    callers: RwLock<CallerTable>,
    clock: AtomicU64,
    /// Object versions when there is no SSD log (with one, its sequence numbers are used).
    versions: AtomicU64,
    timer: PhaseTimer,
    stats: Option<Arc<PhaseStats>>,
    counters: Counters,
    closed: AtomicBool,
}

impl Core {
    /// Opens the tiers of `cfg` on `engine`: the DRAM arena and the SSD staging memory are
    /// allocated there, and the engine's own segment is opened (every copy's remote side).
    /// `owns_engine`: the engine is shut down with the core.
    pub(crate) async fn open(cfg: CoreConfig, engine: TransferEngine, owns_engine: bool) -> Result<Core> {
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
        Ok(Core {
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
        })
    }

    /// The engine the core moves bytes with.
    pub(crate) fn engine(&self) -> &TransferEngine {
        &self.engine
    }

    /// Registers caller host memory through the engine (see `Store::register_buffer`). With an
    /// `owner`, the engine holds it until the region is deregistered and the last transfer using
    /// it has ended, so memory is never freed under a running get or put
    /// (`Store::register_buffer_owned`).
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must be host memory that stays valid until
    /// [`Core::deregister_buffer`] or [`Core::close`] (with an `owner`: while it is alive), and
    /// the caller must not read bytes a running get writes into, nor change bytes a running put
    /// reads.
    pub(crate) async unsafe fn register_buffer(
        &self,
        addr: u64,
        len: u64,
        owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<()> {
        self.check_open()?;
        // Without the engine's registration cache: the store keeps its caller buffers disjoint and
        // by base address, so a buffer registered twice (or inside another) is still refused.
        let opts = RegisterOptions::local_only().without_cache();
        let registration = match owner {
            Some(owner) => {
                // SAFETY: forwarded contract: the memory stays valid while `owner` lives, and the
                // engine keeps `owner` until the region is released and no transfer uses it.
                unsafe {
                    self.engine
                        .register_raw_owned(addr, len, MemoryLocation::HOST, opts, owner)
                }
                .await?
            }
            // SAFETY: forwarded contract: the caller keeps the memory valid while registered.
            None => unsafe { self.engine.register_raw(addr, len, MemoryLocation::HOST, opts) }.await?,
        };
        self.callers.write().insert(CallerRegion {
            base: addr,
            len,
            registration,
        });
        Ok(())
    }

    /// Deregisters the caller buffer that starts at `addr`. False if none does.
    pub(crate) async fn deregister_buffer(&self, addr: u64) -> Result<bool> {
        let Some(region) = self.callers.write().remove(addr) else {
            return Ok(false);
        };
        region.registration.deregister().await?;
        Ok(true)
    }

    /// Registers `[addr, addr + len)` for one call unless a registration already covers it;
    /// returns what [`Core::temp_release`] must release.
    pub(crate) async fn temp_register(&self, addr: u64, len: u64) -> Result<Option<u64>> {
        if self.callers.read().covers(addr, len) {
            return Ok(None);
        }
        // SAFETY: the callers (whole-object put and get) pass a live slice they borrow for the
        // whole call, and release the registration before the call returns.
        unsafe { self.register_buffer(addr, len, None) }.await?;
        Ok(Some(addr))
    }

    /// Releases what [`Core::temp_register`] registered.
    pub(crate) async fn temp_release(&self, temp: Option<u64>) -> Result<()> {
        if let Some(addr) = temp {
            self.deregister_buffer(addr).await?;
        }
        Ok(())
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(StoreError::Closed);
        }
        Ok(())
    }

    pub(crate) fn now(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// `n` new object versions, above every version stored (the SSD log's sequence numbers when
    /// there is one, so versions compare across tiers and restarts). One atomic add per batch.
    pub(crate) fn next_versions(&self, n: usize) -> std::ops::Range<u64> {
        let n = n as u64;
        match &self.ssd {
            Some(s) => s.log.next_seqs(n),
            None => {
                let first = self.versions.fetch_add(n, Ordering::Relaxed);
                first..first + n
            }
        }
    }

    /// True if `key` is in any tier.
    pub(crate) fn exists(&self, key: &str) -> Result<bool> {
        if let Some(d) = &self.dram {
            if d.state.read().get(key).is_some() {
                return Ok(true);
            }
        }
        Ok(self.ssd.as_ref().is_some_and(|s| s.log.contains(key)))
    }

    /// How many of `keys`, from the first, are stored: stops at the first miss. Resolves under
    /// one shared lock per tier.
    pub(crate) fn batch_exists_consecutive<K: AsRef<str>>(&self, keys: &[K]) -> Result<usize> {
        let dram = self.dram.as_ref().map(|d| d.state.read());
        let ssd = self.ssd.as_ref().map(|s| s.log.index());
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
    pub(crate) fn remove(&self, key: &str) -> Result<bool> {
        self.check_open()?;
        check_keys(std::iter::once(key))?;
        self.remove_unchecked(key)
    }

    fn remove_unchecked(&self, key: &str) -> Result<bool> {
        let mut dram = self.dram.as_ref().map(|d| d.state.write());
        let mut found = dram.as_mut().is_some_and(|st| st.remove(key));
        let old = self.ssd.as_ref().and_then(|s| s.log.unpublish(key));
        drop(dram);
        if let (Some(old), Some(s)) = (old, &self.ssd) {
            found = true;
            s.log.retire(&old)?;
        }
        Ok(found)
    }

    /// The object lengths of `keys` (None where absent), under one shared lock per tier.
    pub(crate) fn object_lens<'a>(&self, keys: impl Iterator<Item = &'a str>) -> Result<Vec<Option<u64>>> {
        let dram = self.dram.as_ref().map(|d| d.state.read());
        let ssd = self.ssd.as_ref().map(|s| s.log.index());
        Ok(keys
            .map(|k| {
                dram.as_ref()
                    .and_then(|d| d.get(k).map(|e| e.len))
                    .or_else(|| ssd.as_ref().and_then(|s| s.get(k).map(|e| e.payload_len)))
            })
            .collect())
    }

    /// Runs compaction of the SSD log now; returns the number of segments compacted.
    pub(crate) fn compact(&self, force: bool) -> Result<u64> {
        self.check_open()?;
        match &self.ssd {
            Some(s) => s.log.compact(force),
            None => Ok(0),
        }
    }

    /// Makes every acknowledged put durable: objects only in DRAM are written to the SSD log
    /// (they stay in DRAM), then every segment and directory is fsynced.
    pub(crate) fn flush(&self) -> Result<()> {
        let Some(s) = &self.ssd else { return Ok(()) };
        if let Some(d) = &self.dram {
            self.write_back(d)?;
        }
        s.log.sync()
    }

    /// Flushes, releases caller registrations, and shuts an owned engine down. Calls after this
    /// fail with [`StoreError::Closed`]. False when it was closed already.
    pub(crate) async fn close(&self) -> Result<bool> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        // Registrations are released and the engine shut down even when the flush fails.
        let flushed = self.flush();
        // A region a running call still uses is released (its owner with it) when that call's
        // transfers end: not an error of the close.
        let regions = self.callers.write().drain();
        for r in regions {
            match r.registration.deregister().await {
                Ok(()) | Err(te_core::Error::InFlight { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if self.owns_engine {
            self.engine.shutdown().await?;
        }
        flushed.map(|()| true)
    }

    /// Counters since open.
    pub(crate) fn stats(&self) -> CoreStats {
        let mut s = self.counters.snapshot();
        if let Some(d) = &self.dram {
            let st = d.state.read();
            s.dram_objects = st.len() as u64;
            s.dram_used_bytes = st.used();
            s.dram_capacity_bytes = st.capacity();
        }
        if let Some(ssd) = &self.ssd {
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
        s
    }

    /// Per-phase timings of ranged calls (`None` unless `UMBP_RANGED_CALL_DEBUG=1`).
    pub(crate) fn phase_report(&self) -> Option<PhaseReport> {
        self.stats.as_ref().map(|s| s.report())
    }

    /// Clears the phase timings.
    pub(crate) fn reset_phase_report(&self) {
        if let Some(s) = &self.stats {
            s.reset();
        }
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
        let timer = &self.timer;
        // With the phase report on, the engine and its transport record into the core's timer,
        // so resolve, plan and submit show the engine's own split (the seed's breakdown).
        let batch = if timer.is_on() {
            let opts = te_core::SubmitOptions {
                background: false,
                timer: Some(timer.clone()),
                ..Default::default()
            };
            self.engine.submit_with(requests, &opts)?
        } else {
            self.engine.submit(requests)?
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
}
