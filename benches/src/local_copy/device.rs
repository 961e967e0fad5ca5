//! `te-bench local-copy --location cuda|hip`: scattered fragments between host and device memory
//! (or device and device) through the engine's local transport, against the runtime's own copies
//! timed in the same run: one plain copy per fragment (`cuMemcpy*`, what `cudaMemcpy` does, then a
//! context synchronize; for HIP the plugin's synchronous copy) and one contiguous copy of the same
//! total bytes.

// Built without any device plugin, `Runtime` has no value and the code that uses one is dead.
#![cfg_attr(
    not(any(feature = "cuda", feature = "hip")),
    allow(unreachable_code, unused_variables)
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use te_core::device::{CopyDirection, CopyFragment, DeviceBuffer, DevicePlugin};
use te_core::{MemoryLocation, RegisterOptions, Registration, TransferEngine, TransferRequest};

use super::{prefault, run_engine, slots, Location, Measured};
use crate::util::{median, pattern};

/// Seed of the source pattern.
const SEED: u64 = 11;

/// A device runtime with the baseline copies it offers.
pub(super) enum Runtime {
    #[cfg(feature = "cuda")]
    Cuda(Arc<te_plugin_cuda::CudaPlugin>),
    #[cfg(feature = "hip")]
    Hip(Arc<dyn DevicePlugin>),
    /// Built without any device plugin: no value exists.
    #[cfg(not(any(feature = "cuda", feature = "hip")))]
    #[allow(dead_code)]
    None(std::convert::Infallible),
}

impl Runtime {
    /// Loads the runtime of `location`, or says why it is not available here.
    pub fn load(location: Location, batch_memcpy: bool) -> Result<Runtime, String> {
        let _ = batch_memcpy; // CUDA only
        match location {
            Location::Host => Err("host memory needs no device runtime".into()),
            #[cfg(feature = "cuda")]
            Location::Cuda => {
                let cuda = te_plugin_cuda::load_cuda().map_err(|e| e.to_string())?;
                if !batch_memcpy {
                    cuda.set_batch_memcpy(false).map_err(|e| e.to_string())?;
                }
                Ok(Runtime::Cuda(cuda))
            }
            #[cfg(not(feature = "cuda"))]
            Location::Cuda => Err("cuda: not available: te-bench was built without its cuda feature".into()),
            #[cfg(feature = "hip")]
            Location::Hip => te_plugin_hip::load().map(Runtime::Hip).map_err(|e| e.to_string()),
            #[cfg(not(feature = "hip"))]
            Location::Hip => Err("hip: not available: te-bench was built without its hip feature".into()),
        }
    }

    fn plugin(&self) -> Arc<dyn DevicePlugin> {
        match self {
            #[cfg(feature = "cuda")]
            Runtime::Cuda(c) => c.clone(),
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => h.clone(),
            #[cfg(not(any(feature = "cuda", feature = "hip")))]
            Runtime::None(n) => match *n {},
        }
    }

    /// What the per-fragment baseline calls.
    fn baseline_name(&self) -> &'static str {
        match self {
            #[cfg(feature = "cuda")]
            Runtime::Cuda(_) => "cuMemcpy{HtoD,DtoH,DtoD} per fragment + cuCtxSynchronize",
            #[cfg(feature = "hip")]
            Runtime::Hip(_) => "plugin copy (hipMemcpyAsync + sync) per fragment",
            #[cfg(not(any(feature = "cuda", feature = "hip")))]
            Runtime::None(n) => match *n {},
        }
    }

    /// True when multi-fragment batches use one driver call (`cuMemcpyBatchAsync`).
    fn batch_memcpy(&self) -> Option<bool> {
        match self {
            #[cfg(feature = "cuda")]
            Runtime::Cuda(c) => Some(c.batch_memcpy()),
            #[cfg(feature = "hip")]
            Runtime::Hip(_) => None,
            #[cfg(not(any(feature = "cuda", feature = "hip")))]
            Runtime::None(n) => match *n {},
        }
    }

    /// One baseline copy (may return before the bytes land; see [`Runtime::finish`]).
    ///
    /// # Safety
    /// As for `DevicePlugin::copy`.
    unsafe fn one(&self, device: u32, direction: CopyDirection, f: CopyFragment) -> Result<(), String> {
        let copied: te_core::Result<()> = match self {
            // SAFETY: forwarded from the caller.
            #[cfg(feature = "cuda")]
            Runtime::Cuda(c) => unsafe { c.plain_memcpy(device, direction, f) },
            // SAFETY: forwarded from the caller.
            #[cfg(feature = "hip")]
            Runtime::Hip(h) => unsafe { h.copy(device, direction, f) },
            #[cfg(not(any(feature = "cuda", feature = "hip")))]
            Runtime::None(n) => match *n {},
        };
        copied.map_err(|e| e.to_string())
    }

    /// Waits until every baseline copy has landed.
    fn finish(&self, device: u32) -> Result<(), String> {
        match self {
            #[cfg(feature = "cuda")]
            Runtime::Cuda(c) => c.synchronize(device).map_err(|e| e.to_string()),
            #[cfg(feature = "hip")]
            Runtime::Hip(_) => {
                let _ = device;
                Ok(())
            }
            #[cfg(not(any(feature = "cuda", feature = "hip")))]
            Runtime::None(n) => match *n {},
        }
    }
}

/// The directions `--direction` names.
pub(super) fn directions(arg: &str) -> Result<Vec<CopyDirection>, String> {
    Ok(match arg {
        "h2d" => vec![CopyDirection::HostToDevice],
        "d2h" => vec![CopyDirection::DeviceToHost],
        "d2d" => vec![CopyDirection::DeviceToDevice],
        "all" => vec![
            CopyDirection::HostToDevice,
            CopyDirection::DeviceToHost,
            CopyDirection::DeviceToDevice,
        ],
        other => return Err(format!("--direction {other:?}: expected h2d, d2h, d2d or all")),
    })
}

/// Short name of a direction for rows.
pub(super) fn short(direction: CopyDirection) -> &'static str {
    match direction {
        CopyDirection::HostToDevice => "h2d",
        CopyDirection::DeviceToHost => "d2h",
        CopyDirection::DeviceToDevice => "d2d",
    }
}

/// One side of the copy: registered host memory, or device memory (registered or not).
enum Side {
    Host(Registration),
    /// The registration (when registered) is dropped before the buffer it covers.
    Device(Option<Registration>, DeviceBuffer),
}

impl Side {
    fn addr(&self) -> u64 {
        match self {
            Side::Host(r) => r.addr(),
            Side::Device(_, b) => b.addr(),
        }
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        if let Side::Device(reg, _) = self {
            // Deregister before the memory is freed.
            drop(reg.take());
        }
    }
}

/// Everything one (direction, fragment size) measurement uses.
struct Setup {
    src: Side,
    dst: Side,
    /// The baselines' own destination, so neither path inherits the other's cache state.
    baseline_dst: Side,
    slots: Vec<(u64, u64)>,
    span: u64,
}

/// Parameters of one measurement.
pub(super) struct Params<'a> {
    pub engine: &'a TransferEngine,
    pub rt: &'a tokio::runtime::Runtime,
    pub runtime: &'a Runtime,
    pub location: MemoryLocation,
    pub device: u32,
    pub direction: CopyDirection,
    pub frag: u64,
    pub fragments: usize,
    pub repeat: usize,
    pub verify: bool,
}

/// Measures one direction at one fragment size.
pub(super) fn measure(p: &Params<'_>) -> Result<Measured, String> {
    let n = p.fragments;
    let span = n as u64 * (p.frag + 64);
    let setup = allocate(p, span, slots(n, p.frag))?;
    fill(p, &setup)?;
    // Opened after the allocation so the descriptor lists the destination.
    let me =
        p.rt.block_on(p.engine.open_segment(p.engine.segment_name()))
            .map_err(|e| e.to_string())?;
    let (src, dst) = (setup.src.addr(), setup.dst.addr());
    let reqs: Vec<TransferRequest> = setup
        .slots
        .iter()
        .map(|&(s, d)| TransferRequest::write(src + s, me.id(), dst + d, p.frag))
        .collect();
    let total = p.frag * n as u64;
    // One untimed warm-up of each path: first use of streams, contexts and page mappings.
    run_engine(p.engine, &reqs)?;
    loop_baseline(p, &setup)?;
    contiguous(p, &setup, total)?;
    let mut mismatched = 0u64;
    if p.verify {
        zero(p, &setup.dst, span)?;
        run_engine(p.engine, &reqs)?;
        mismatched = verify(p, &setup)?;
    }
    let (mut eng, mut lp, mut contig) = (Vec::new(), Vec::new(), Vec::new());
    p.engine.reset_phase_report();
    for _ in 0..p.repeat {
        eng.push(run_engine(p.engine, &reqs)?);
        lp.push(loop_baseline(p, &setup)?);
        contig.push(contiguous(p, &setup, total)?);
    }
    Ok(Measured {
        fragments: n,
        total,
        engine: median(&mut eng),
        memcpy_loop: median(&mut lp),
        contiguous: median(&mut contig),
        mismatched: p.verify.then_some(mismatched),
        baseline: p.runtime.baseline_name(),
        batch_memcpy: p.runtime.batch_memcpy(),
        phases: p.engine.phase_report().map(|r| super::phases_per_fragment(&r)),
    })
}

fn allocate(p: &Params<'_>, span: u64, slots: Vec<(u64, u64)>) -> Result<Setup, String> {
    let plugin = p.runtime.plugin();
    let host = |export: bool| -> Result<Side, String> {
        let opts = if export {
            RegisterOptions::default()
        } else {
            RegisterOptions::local_only()
        };
        p.rt.block_on(p.engine.allocate_with(span as usize, prefault(), opts))
            .map(Side::Host)
            .map_err(|e| e.to_string())
    };
    let device = |register: Option<RegisterOptions>| -> Result<Side, String> {
        let buf = DeviceBuffer::allocate(&plugin, p.device, span).map_err(|e| e.to_string())?;
        let reg = match register {
            None => None,
            // SAFETY: the buffer is device memory of `location`, and `Side`'s drop deregisters it
            // before the buffer is freed; no transfer is in flight by then (every batch is waited
            // on).
            Some(opts) => Some(
                p.rt.block_on(unsafe { p.engine.register_raw(buf.addr(), span, p.location, opts) })
                    .map_err(|e| e.to_string())?,
            ),
        };
        Ok(Side::Device(reg, buf))
    };
    let (src_on_device, dst_on_device) = match p.direction {
        CopyDirection::HostToDevice => (false, true),
        CopyDirection::DeviceToHost => (true, false),
        CopyDirection::DeviceToDevice => (true, true),
    };
    let src = if src_on_device {
        device(Some(RegisterOptions::local_only()))?
    } else {
        host(false)?
    };
    let (dst, baseline_dst) = if dst_on_device {
        (device(Some(RegisterOptions::default()))?, device(None)?)
    } else {
        (host(true)?, host(false)?)
    };
    Ok(Setup {
        src,
        dst,
        baseline_dst,
        slots,
        span,
    })
}

/// Writes the pattern over the whole source.
fn fill(p: &Params<'_>, s: &Setup) -> Result<(), String> {
    let data: Vec<u8> = (0..s.span).map(|i| pattern(SEED, i)).collect();
    put(p, &s.src, &data)
}

fn zero(p: &Params<'_>, side: &Side, span: u64) -> Result<(), String> {
    put(p, side, &vec![0u8; span as usize])
}

/// Copies `data` to the start of `side` (through the runtime for device memory).
fn put(p: &Params<'_>, side: &Side, data: &[u8]) -> Result<(), String> {
    match side {
        Side::Host(r) => r.write_at(0, data).map_err(|e| e.to_string()),
        Side::Device(_, buf) => {
            let f = CopyFragment {
                dst: buf.addr(),
                src: data.as_ptr() as u64,
                len: data.len() as u64,
            };
            // SAFETY: `data` is live host memory and the buffer holds at least `data.len()` bytes
            // (both are the span); the copy returns when the bytes have landed.
            unsafe { buf.plugin().copy(p.device, CopyDirection::HostToDevice, f) }.map_err(|e| e.to_string())
        }
    }
}

/// Reads `side` back to host memory.
fn get(p: &Params<'_>, side: &Side, span: u64) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; span as usize];
    match side {
        Side::Host(r) => r.read_at(0, &mut out).map_err(|e| e.to_string())?,
        Side::Device(_, buf) => {
            let f = CopyFragment {
                dst: out.as_mut_ptr() as u64,
                src: buf.addr(),
                len: span,
            };
            // SAFETY: `out` is live host memory of `span` bytes, the buffer holds `span` bytes, and
            // the copy returns when the bytes have landed.
            unsafe { buf.plugin().copy(p.device, CopyDirection::DeviceToHost, f) }.map_err(|e| e.to_string())?;
        }
    }
    Ok(out)
}

/// Bytes of the engine's destination that differ from the pattern its fragment should carry.
fn verify(p: &Params<'_>, s: &Setup) -> Result<u64, String> {
    let dst = get(p, &s.dst, s.span)?;
    let mut bad = 0u64;
    for &(so, d) in &s.slots {
        for k in 0..p.frag {
            if dst[(d + k) as usize] != pattern(SEED, so + k) {
                bad += 1;
            }
        }
    }
    Ok(bad)
}

fn loop_baseline(p: &Params<'_>, s: &Setup) -> Result<Duration, String> {
    let (src, dst) = (s.src.addr(), s.baseline_dst.addr());
    let t0 = Instant::now();
    for &(so, d) in &s.slots {
        let f = CopyFragment {
            dst: dst + d,
            src: src + so,
            len: p.frag,
        };
        // SAFETY: both ranges lie inside their live buffers (slots were built to fit the span) and
        // are different buffers of the kinds the direction names.
        unsafe { p.runtime.one(p.device, p.direction, f) }?;
    }
    p.runtime.finish(p.device)?;
    Ok(t0.elapsed())
}

fn contiguous(p: &Params<'_>, s: &Setup, total: u64) -> Result<Duration, String> {
    let f = CopyFragment {
        dst: s.baseline_dst.addr(),
        src: s.src.addr(),
        len: total,
    };
    let t0 = Instant::now();
    // SAFETY: `total` <= the span of both buffers, which are different buffers of the kinds the
    // direction names.
    unsafe { p.runtime.one(p.device, p.direction, f) }?;
    p.runtime.finish(p.device)?;
    Ok(t0.elapsed())
}
