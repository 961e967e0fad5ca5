//! `te-bench register --views N`: a framework registering N tensors that are views of one pool
//! (issue 27), through the engine's `register_raw`, with the registration cache off and on in
//! the same run.
//!
//! - off: each tensor is registered on its own (the pool is not registered), N transport
//!   registrations, as an engine without the cache must do;
//! - on: the pool is registered once, then each tensor, which the cache serves as a view of it.
//!
//! Both register the same N ranges of the same prefaulted pool, alternating off/on in every
//! repetition; the median of the repetitions is reported. Releases are not timed.
//!
//! With `--transport sim` the engine's only transport is a bench-only one that registers through
//! the simulated provider (`te_testkit::SimProvider`: measured p5.48xlarge costs replayed as CPU
//! work, `--location cuda` for the device-memory model although the engine sees host buffers):
//! its figures are SIMULATED node seconds (the modelled provider time, plus the engine's own time
//! as measured). The other transports are the real ones, timed on the wall clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use te_base::registration::RegistrationProvider;
use te_base::{Capabilities, Error, MemoryKinds, MemoryLocation, Peer, RegionInfo, SegmentDescriptor, Transport};
use te_core::{HostBuffer, HostBufferOptions, RawRegion, RegisterOptions, TransferEngine, TransferRequest};
use te_testkit::{SimConfig, SimHandle, SimProvider};

use super::spec::{LocationChoice, SimSpec, TransportChoice};

/// What the scenario needs from the command line.
pub struct ViewsSpec {
    pub views: usize,
    pub pool_bytes: u64,
    pub transport: TransportChoice,
    pub location: LocationChoice,
    pub domains: usize,
    pub repeat: usize,
    pub sim: SimSpec,
    pub verify: bool,
    pub json: bool,
}

/// One mode's measurements.
struct Mode {
    name: &'static str,
    /// Seconds per repetition (node seconds for sim).
    runs_s: Vec<f64>,
    /// Transport registrations one repetition made.
    transport_registrations: u64,
    /// Registrations the cache served in one repetition.
    cache_hits: u64,
}

/// Runs the scenario and prints its table (and JSON lines).
pub fn run(spec: ViewsSpec) -> Result<(), String> {
    if spec.views == 0 {
        return Err("--views must be at least 1".into());
    }
    let page = te_base::host_buffer::page_size() as u64;
    let view_bytes = spec.pool_bytes / spec.views as u64 / page * page;
    if view_bytes == 0 {
        return Err(format!(
            "--pool-size {} is too small for {} page-aligned views",
            spec.pool_bytes, spec.views
        ));
    }
    let simulated = spec.transport == TransportChoice::Sim;
    if !simulated && spec.location != LocationChoice::Host {
        return Err("--views with a real transport registers host memory only (--location host)".into());
    }
    let rt = crate::util::runtime()?;
    let sim = if simulated {
        let mut config: SimConfig = spec.sim.config(spec.domains)?;
        config.node_load = None;
        Some(Arc::new(SimProvider::new(config).map_err(|e| e.to_string())?))
    } else {
        None
    };
    let registered = Arc::new(AtomicU64::new(0));
    let engine = rt.block_on(build_engine(&spec, sim.clone(), registered.clone()))?;
    let pool = HostBuffer::allocate(
        spec.pool_bytes as usize,
        HostBufferOptions {
            prefault: true,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let views: Vec<RawRegion> = (0..spec.views as u64)
        .map(|i| RawRegion {
            addr: pool.addr() + i * view_bytes,
            len: view_bytes,
            location: MemoryLocation::HOST,
        })
        .collect();
    let whole = RawRegion {
        addr: pool.addr(),
        len: spec.pool_bytes,
        location: MemoryLocation::HOST,
    };
    let mut off = Mode {
        name: "off",
        runs_s: Vec::new(),
        transport_registrations: 0,
        cache_hits: 0,
    };
    let mut on = Mode {
        name: "on",
        runs_s: Vec::new(),
        transport_registrations: 0,
        cache_hits: 0,
    };
    for _ in 0..spec.repeat {
        for (mode, cached) in [(&mut off, false), (&mut on, true)] {
            let work_before = sim.as_ref().map_or(0.0, |p| p.work_node_s());
            let hits_before = engine.metrics().registration_cache_hits;
            let regs_before = registered.load(Ordering::Relaxed);
            let start = Instant::now();
            let handles = rt.block_on(register(&engine, whole, &views, cached))?;
            let wall = start.elapsed().as_secs_f64();
            let modelled = sim.as_ref().map_or(0.0, |p| p.work_node_s()) - work_before;
            // The provider's burn ran at `scale`; the engine's own time did not.
            let seconds = if simulated {
                (wall - modelled * spec.sim.scale).max(0.0) + modelled
            } else {
                wall
            };
            mode.runs_s.push(seconds);
            mode.cache_hits = engine.metrics().registration_cache_hits - hits_before;
            // Counted by the sim transport; for a real one, what the engine did not serve from
            // the cache went to it.
            mode.transport_registrations = match &sim {
                Some(_) => registered.load(Ordering::Relaxed) - regs_before,
                None => (spec.views as u64 + u64::from(cached)) - mode.cache_hits,
            };
            if spec.verify && !simulated {
                rt.block_on(verify(&engine, &pool, &views))?;
            }
            rt.block_on(release(handles))?;
        }
    }
    rt.block_on(engine.shutdown()).map_err(|e| e.to_string())?;
    drop(pool);
    report(&spec, view_bytes, &[off, on]);
    Ok(())
}

async fn build_engine(
    spec: &ViewsSpec,
    sim: Option<Arc<SimProvider>>,
    registered: Arc<AtomicU64>,
) -> Result<TransferEngine, String> {
    let name = format!("te-bench-register-views-{}", std::process::id());
    let builder = TransferEngine::builder()
        .segment_name(name)
        .env(Arc::new(te_base::config::ProcessEnv));
    let engine = match sim {
        Some(provider) => {
            let transport = SimRegistering {
                provider,
                device: spec.location == LocationChoice::Cuda,
                handles: Mutex::new(HashMap::new()),
                registered,
            };
            builder
                .transports(Vec::<String>::new())
                .with_transport(Arc::new(transport))
                .build()
                .await
        }
        None => builder.transports([spec.transport.name()]).build().await,
    }
    .map_err(|e| e.to_string())?;
    let name = spec.transport.name();
    crate::util::require_transport(&engine, name)?;
    Ok(engine)
}

/// Registers the N views: each on its own (cache off), or the pool and then each as a view.
async fn register(
    engine: &TransferEngine,
    whole: RawRegion,
    views: &[RawRegion],
    cached: bool,
) -> Result<Vec<te_core::Registration>, String> {
    let mut handles = Vec::with_capacity(views.len() + 1);
    let reg = if cached {
        RegisterOptions::default()
    } else {
        RegisterOptions::default().without_cache()
    };
    if cached {
        // SAFETY: the pool is a HostBuffer that outlives every registration of it: `run` releases
        // them all (and shuts the engine down) before dropping it.
        let pool = unsafe { engine.register_raw(whole.addr, whole.len, whole.location, reg) }.await;
        handles.push(pool.map_err(|e| e.to_string())?);
    }
    for v in views {
        // SAFETY: as above; every view lies inside the pool.
        let h = unsafe { engine.register_raw(v.addr, v.len, v.location, reg) }.await;
        let h = h.map_err(|e| e.to_string())?;
        if h.is_view() != cached {
            return Err(format!(
                "view at {:#x}: expected {} registration",
                v.addr,
                if cached { "a shared" } else { "an own" }
            ));
        }
        handles.push(h);
    }
    Ok(handles)
}

async fn release(handles: Vec<te_core::Registration>) -> Result<(), String> {
    for h in handles {
        h.deregister().await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Reads every view through the engine's own segment into a second buffer and checks each byte
/// against the position-dependent pattern written into the pool.
async fn verify(engine: &TransferEngine, pool: &HostBuffer, views: &[RawRegion]) -> Result<(), String> {
    let total: u64 = views.iter().map(|v| v.len).sum();
    let pattern = te_base::pattern::pattern_bytes(0, 0, total as usize);
    // SAFETY: the pool is host memory of at least `total` bytes that nothing else uses now (no
    // transfer is in flight between repetitions).
    unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), pool.as_ptr(), pattern.len()) };
    let into = engine
        .allocate(total as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let me = engine
        .open_segment(engine.segment_name())
        .await
        .map_err(|e| e.to_string())?;
    let reads: Vec<TransferRequest> = views
        .iter()
        .map(|v| TransferRequest::read(into.addr() + (v.addr - pool.addr()), me.id(), v.addr, v.len))
        .collect();
    engine.transfer(&reads).await.map_err(|e| e.to_string())?;
    let mut back = vec![0u8; total as usize];
    into.read_at(0, &mut back).map_err(|e| e.to_string())?;
    if let Some(at) = back.iter().zip(&pattern).position(|(a, b)| a != b) {
        return Err(format!("--verify: byte {at} differs after reading the views"));
    }
    into.deregister().await.map_err(|e| e.to_string())?;
    // An open segment follows every descriptor change, which would slow the next repetition's
    // registrations (each republishes): close it so every repetition starts alike.
    engine.close_segment(me.id()).await.map_err(|e| e.to_string())
}

fn report(spec: &ViewsSpec, view_bytes: u64, modes: &[Mode]) {
    let simulated = spec.transport == TransportChoice::Sim;
    let medians: Vec<f64> = modes.iter().map(|m| median(&m.runs_s)).collect();
    let label = if simulated {
        format!(
            "SIMULATED (sim provider, {} cost model, {} domain(s), scale {}; node seconds)",
            match spec.location {
                LocationChoice::Host => "host",
                LocationChoice::Cuda => "cuda",
            },
            spec.domains,
            spec.sim.scale
        )
    } else {
        format!("transport {} (measured)", spec.transport.name())
    };
    let mut out = format!(
        "te-bench register --views {}: {} views of {} B in one {} B pool, {label}, median of {}\n",
        spec.views, spec.views, view_bytes, spec.pool_bytes, spec.repeat
    );
    out.push_str("cache  median_s    per_view_us  transport_regs  cache_hits  runs_s\n");
    for (m, med) in modes.iter().zip(&medians) {
        let runs: Vec<String> = m.runs_s.iter().map(|s| format!("{s:.4}")).collect();
        out.push_str(&format!(
            "{:<6} {:<11.6} {:<12.2} {:<15} {:<11} {}\n",
            m.name,
            med,
            med / spec.views as f64 * 1e6,
            m.transport_registrations,
            m.cache_hits,
            runs.join(",")
        ));
    }
    let speedup = medians[0] / medians[1];
    out.push_str(&format!("off/on: {speedup:.1}x\n"));
    if spec.json {
        for (m, med) in modes.iter().zip(&medians) {
            crate::util::print_json(&serde_json::json!({
                "bench": "register-views",
                "transport": spec.transport.name(),
                "simulated": simulated,
                "location_model": match spec.location {
                    LocationChoice::Host => "host",
                    LocationChoice::Cuda => "cuda",
                },
                "domains": if simulated { spec.domains } else { 0 },
                "views": spec.views,
                "view_bytes": view_bytes,
                "pool_bytes": spec.pool_bytes,
                "cache": m.name,
                "runs_s": m.runs_s,
                "median_s": med,
                "transport_registrations": m.transport_registrations,
                "cache_hits": m.cache_hits,
            }));
        }
        eprint!("{out}");
    } else {
        print!("{out}");
    }
}

fn median(runs: &[f64]) -> f64 {
    let mut v = runs.to_vec();
    v.sort_unstable_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The bench's simulated transport: registers every region on every domain of the simulated
/// provider (serially, as one engine call does per region on one NIC after another), and moves
/// no bytes (it reaches no peer). Only this scenario uses it, and everything it reports is
/// labelled SIMULATED.
struct SimRegistering {
    provider: Arc<SimProvider>,
    /// Charge the device-memory model (the engine's buffers are host memory).
    device: bool,
    /// Live provider handles by region base.
    handles: Mutex<HashMap<u64, Vec<SimHandle>>>,
    /// Regions registered so far.
    registered: Arc<AtomicU64>,
}

impl SimRegistering {
    /// The region as the cost model sees it.
    fn modelled(&self, r: &RegionInfo) -> RegionInfo {
        let mut m = r.clone();
        if self.device {
            m.location = MemoryLocation::Cuda { device: 0 };
        }
        m
    }

    fn handles(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Vec<SimHandle>>> {
        self.handles.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl Transport for SimRegistering {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: MemoryKinds::HOST,
            remote: MemoryKinds::HOST,
        }
    }
    fn endpoint(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    fn can_reach(&self, _peer: &SegmentDescriptor) -> bool {
        false
    }
    async fn register(&self, regions: &[RegionInfo]) -> te_base::Result<Vec<serde_json::Value>> {
        for r in regions {
            let modelled = self.modelled(r);
            let mut hs = Vec::with_capacity(self.provider.domain_count());
            for d in 0..self.provider.domain_count() {
                hs.push(self.provider.register(d, &modelled)?);
            }
            self.handles().insert(r.base, hs);
        }
        self.registered.fetch_add(regions.len() as u64, Ordering::Relaxed);
        Ok(vec![serde_json::Value::Null; regions.len()])
    }
    async fn deregister(&self, regions: &[RegionInfo]) -> te_base::Result<()> {
        for r in regions {
            let found = self.handles().remove(&r.base);
            let Some(hs) = found else {
                return Err(Error::transport(
                    "sim",
                    format!("region {:#x} is not registered", r.base),
                ));
            };
            let modelled = self.modelled(r);
            for h in hs {
                self.provider.deregister(h.domain, &modelled, h)?;
            }
        }
        Ok(())
    }
    async fn connect(&self, peer: &SegmentDescriptor) -> te_base::Result<Arc<dyn Peer>> {
        Err(Error::not_available(
            "sim",
            format!(
                "the simulated registration transport moves no bytes (peer {})",
                peer.name
            ),
        ))
    }
}
