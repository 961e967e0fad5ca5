//! `te-bench local-copy`: scattered fragments copied through the engine's local transport, with
//! two baselines timed in the same run: a plain loop of memcpy over the same fragments, and one
//! contiguous memcpy of the same total bytes. `--location cuda|hip` moves the fragments between
//! host and device memory (or device and device) instead, against the runtime's own copies; see
//! [`device`].

mod device;
mod metrics_ab;
mod plot;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use te_core::config::MapEnv;
use te_core::{HostBufferOptions, MemoryLocation, RegisterOptions, Registration, TransferEngine, TransferRequest};

use crate::util::{median, parse_sizes, pattern, print_json, runtime};

/// Where the copied memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Location {
    /// Host memory to host memory.
    Host,
    /// CUDA device memory (needs the NVIDIA driver at run time).
    Cuda,
    /// ROCm device memory through HIP (needs the HIP runtime at run time).
    Hip,
}

#[derive(clap::Args)]
pub struct Args {
    /// Fragment sizes to measure, comma-separated (K/M suffixes, `4K` = 4,096).
    #[arg(long, default_value = "1728,8448,37440")]
    fragment_bytes: String,
    /// Draw GB/s against fragment size (the engine, the memcpy loop, one contiguous memcpy, and
    /// the engine / loop ratio) into this SVG file.
    #[arg(long, conflicts_with = "metrics_ab")]
    plot: Option<PathBuf>,
    /// Fragments per batch. Default: enough for 64 MiB per buffer (at least 2,048), twice this
    /// machine's last-level cache, so the copy runs from DRAM as a KV-cache restore does. Pass
    /// `--fragments 2048` for the cache-resident case.
    #[arg(long)]
    fragments: Option<usize>,
    /// Copy workers including the submitting thread (TE_COPY_THREADS); default: the engine's.
    #[arg(long)]
    threads: Option<usize>,
    /// Timed repetitions per size; medians are reported.
    #[arg(long, default_value_t = 15)]
    repeat: usize,
    /// Check every copied byte against the position-dependent pattern.
    #[arg(long)]
    verify: bool,
    /// One JSON object per size.
    #[arg(long)]
    json: bool,
    /// Where the memory lives: host, or device memory of --device (cuda, hip).
    #[arg(long, value_enum, default_value = "host")]
    location: Location,
    /// Device copies to measure: h2d, d2h, d2d or all (cuda and hip only).
    #[arg(long, default_value = "all")]
    direction: String,
    /// Device ordinal for --location cuda|hip.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// CUDA: one driver call per fragment instead of one cuMemcpyBatchAsync per batch.
    #[arg(long)]
    no_batch_memcpy: bool,
    /// Instead of the baselines: the same copy through an engine exporting metrics
    /// (TE_METRICS_LISTEN on loopback) and one not, interleaved, and the ratio (host only).
    #[arg(long)]
    metrics_ab: bool,
    /// With --metrics-ab: neither engine exports metrics (the A/A noise floor).
    #[arg(long, requires = "metrics_ab")]
    metrics_ab_control: bool,
}

/// The medians of one (direction, fragment size) measurement.
struct Measured {
    fragments: usize,
    total: u64,
    engine: Duration,
    memcpy_loop: Duration,
    contiguous: Duration,
    /// Mismatched bytes, with --verify.
    mismatched: Option<u64>,
    /// What the per-fragment baseline calls.
    baseline: &'static str,
    /// CUDA: whether batches went through cuMemcpyBatchAsync.
    batch_memcpy: Option<bool>,
    /// Engine nanoseconds per fragment by phase over the timed runs, with `TE_PHASE_TIMING=1`.
    phases: Option<serde_json::Value>,
}

struct Setup {
    src: Registration,
    /// Two destinations for the engine and the memcpy loop, swapped every repetition together
    /// with which of the two runs first (see `measure_host`), so neither path is favoured by the
    /// other's cache state or by where its buffer happens to sit in physical memory (cache-set
    /// conflicts moved single invocations by ±5% with fixed buffers).
    dsts: [Registration; 2],
    /// The contiguous baseline's destination.
    contiguous_dst: Registration,
    /// (source offset, destination offset) per fragment.
    slots: Vec<(u64, u64)>,
}

/// Fragment i is read from slot i of the source and written to a permuted slot of the
/// destination, so neither the engine nor the baseline sees one contiguous run.
fn slots(n: usize, frag: u64) -> Vec<(u64, u64)> {
    let stride = frag + 64;
    // A multiplier coprime with n gives a permutation with no adjacent pairs preserved.
    let mut mult = (n / 2 + 1) | 1;
    while gcd(mult, n) != 1 {
        mult += 2;
    }
    (0..n)
        .map(|i| (i as u64 * stride, ((i * mult) % n) as u64 * stride))
        .collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

pub fn run(args: Args) -> Result<(), String> {
    let sizes = parse_sizes(&args.fragment_bytes).map_err(|e| format!("--fragment-bytes: {e}"))?;
    if sizes.contains(&0) || args.fragments == Some(0) || args.repeat == 0 {
        return Err("fragment sizes, --fragments and --repeat must be positive".into());
    }
    let directions = match args.location {
        Location::Host if args.direction != "all" => {
            return Err("--direction applies to --location cuda or hip".into());
        }
        Location::Host => Vec::new(),
        _ => device::directions(&args.direction)?,
    };
    // Fails with "cuda: not available: <reason>" before anything else is set up.
    let runtime_dev = match args.location {
        Location::Host => None,
        location => Some(device::Runtime::load(location, !args.no_batch_memcpy)?),
    };
    let rt = runtime()?;
    let mut vars: Vec<(String, String)> = std::env::vars().filter(|(k, _)| k.starts_with("TE_")).collect();
    if let Some(t) = args.threads {
        vars.retain(|(k, _)| k != "TE_COPY_THREADS");
        vars.push(("TE_COPY_THREADS".into(), t.to_string()));
    }
    if args.metrics_ab && args.location != Location::Host {
        return Err("--metrics-ab measures host memory only".into());
    }
    let vars: std::collections::HashMap<String, String> = vars.into_iter().collect();
    let mut env = MapEnv(vars.clone());
    env.0.remove(te_core::metrics::LISTEN_VAR);
    let engine = rt
        .block_on(
            TransferEngine::builder()
                .segment_name(format!("te-bench-local-{}", std::process::id()))
                .env(Arc::new(env))
                .transports(["local"])
                .build(),
        )
        .map_err(|e| e.to_string())?;
    let fragments_for = |frag: u64| {
        args.fragments
            .unwrap_or_else(|| ((64u64 << 20) / frag).max(2048) as usize)
    };
    if args.metrics_ab {
        let mut on_vars = MapEnv(vars);
        if !args.metrics_ab_control {
            on_vars
                .0
                .insert(te_core::metrics::LISTEN_VAR.into(), "127.0.0.1:0".into());
        }
        let on = rt
            .block_on(
                TransferEngine::builder()
                    .segment_name(format!("te-bench-local-metrics-{}", std::process::id()))
                    .env(Arc::new(on_vars))
                    .transports(["local"])
                    .build(),
            )
            .map_err(|e| e.to_string())?;
        let bar = if args.json {
            ProgressBar::hidden()
        } else {
            ProgressBar::new((sizes.len() * args.repeat) as u64)
        };
        return metrics_ab::run([&engine, &on], &rt, &sizes, fragments_for, &args, &bar);
    }
    let rows = sizes.len() * directions.len().max(1);
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new((rows * args.repeat) as u64)
    };
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}").map_err(|e| e.to_string())?);
    let location_name = match args.location {
        Location::Host => "host".to_string(),
        Location::Cuda => format!("cuda:{}", args.device),
        Location::Hip => format!("rocm:{}", args.device),
    };
    if !args.json {
        println!(
            "local copy through the engine ({location_name}, median of {} runs): scattered fragments vs a plain memcpy loop over the same fragments",
            args.repeat
        );
        println!(
            "  x_loop = loop time / engine time (>1: the engine is faster); overhead_ns = (engine - loop) per fragment; contig = one memcpy of all bytes"
        );
        println!(
            "{:>5} {:>9} {:>9} {:>12} {:>12} {:>9} {:>10} {:>11} {:>8} {:>10}",
            "dir",
            "frag_B",
            "frags",
            "ns/frag",
            "overhead_ns",
            "GB/s",
            "loop_GB/s",
            "contig_GB/s",
            "x_loop",
            "mismatch"
        );
    }
    let mut drawn = Vec::new();
    match &runtime_dev {
        None => {
            for &frag in &sizes {
                bar.set_message(format!("{frag} B"));
                let m = measure_host(&engine, &rt, frag, fragments_for(frag), &args, &bar)?;
                report(&args, &bar, &location_name, "h2h", frag, &m)?;
                drawn.push(plot::Row::new("h2h", frag, &m));
            }
        }
        Some(runtime_dev) => {
            let location = match args.location {
                Location::Hip => MemoryLocation::Rocm { device: args.device },
                _ => MemoryLocation::Cuda { device: args.device },
            };
            for &direction in &directions {
                for &frag in &sizes {
                    let dir = device::short(direction);
                    bar.set_message(format!("{dir} {frag} B"));
                    let params = device::Params {
                        engine: &engine,
                        rt: &rt,
                        runtime: runtime_dev,
                        location,
                        device: args.device,
                        direction,
                        frag,
                        fragments: fragments_for(frag),
                        repeat: args.repeat,
                        verify: args.verify,
                    };
                    let m = device::measure(&params)?;
                    bar.inc(args.repeat as u64);
                    report(&args, &bar, &location_name, dir, frag, &m)?;
                    drawn.push(plot::Row::new(dir, frag, &m));
                }
            }
        }
    }
    bar.finish_and_clear();
    if let Some(path) = &args.plot {
        let title = format!(
            "te-bench local-copy ({location_name}), {}, median of {}",
            match args.fragments {
                Some(n) => format!("{n} fragments"),
                None => "64 MiB per batch".to_string(),
            },
            args.repeat
        );
        crate::size_plot::draw(path, &plot::figure(&title, &drawn)).map_err(|e| e.to_string())?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}

/// Prints one row (table or JSON); a --verify mismatch is an error after the row is out.
fn report(args: &Args, bar: &ProgressBar, location: &str, dir: &str, frag: u64, m: &Measured) -> Result<(), String> {
    let (e, l, c, n, total) = (m.engine, m.memcpy_loop, m.contiguous, m.fragments, m.total);
    let gbps = |d: Duration, b: u64| b as f64 / d.as_secs_f64() / 1e9;
    let ns_per = e.as_nanos() as f64 / n as f64;
    let overhead = (e.as_nanos() as f64 - l.as_nanos() as f64) / n as f64;
    let row = serde_json::json!({
        "bench": "local-copy",
        "location": location,
        "direction": dir,
        "fragment_bytes": frag,
        "fragments": n,
        "threads": args.threads,
        "repeat": args.repeat,
        "ns_per_fragment": ns_per,
        "overhead_ns_per_fragment": overhead,
        "gbps": gbps(e, total),
        "memcpy_loop_gbps": gbps(l, total),
        "contiguous_gbps": gbps(c, total),
        "ratio_vs_memcpy_loop": l.as_secs_f64() / e.as_secs_f64(),
        "ratio_vs_contiguous": c.as_secs_f64() / e.as_secs_f64(),
        "baseline": m.baseline,
        "batch_memcpy": m.batch_memcpy,
        "mismatched_bytes": m.mismatched,
        "phase_ns_per_fragment": m.phases,
    });
    if args.json {
        print_json(&row);
    } else {
        bar.suspend(|| {
            println!(
                "{:>5} {:>9} {:>9} {:>12.1} {:>12.1} {:>9.2} {:>10.2} {:>11.2} {:>8.2} {:>10}",
                dir,
                frag,
                n,
                ns_per,
                overhead,
                gbps(e, total),
                gbps(l, total),
                gbps(c, total),
                l.as_secs_f64() / e.as_secs_f64(),
                m.mismatched.map_or_else(|| "-".into(), |b| b.to_string())
            )
        });
    }
    match m.mismatched {
        Some(bad) if bad > 0 => Err(format!(
            "--verify: {bad} mismatched bytes at {frag} B fragments ({location}, {dir})"
        )),
        _ => Ok(()),
    }
}

/// Buffers for `n` fragments of `frag` bytes registered with `engine`, the source filled, and
/// the requests writing the fragments into each of the two destinations.
fn host_setup(
    engine: &TransferEngine,
    rt: &tokio::runtime::Runtime,
    frag: u64,
    n: usize,
) -> Result<(Setup, Vec<Vec<TransferRequest>>), String> {
    let slots = slots(n, frag);
    let span = (n as u64) * (frag + 64);
    let setup = rt
        .block_on(async {
            let src = engine
                .allocate_with(span as usize, prefault(), RegisterOptions::local_only())
                .await?;
            let dsts = [
                engine.allocate(span as usize, prefault()).await?,
                engine.allocate(span as usize, prefault()).await?,
            ];
            let contiguous_dst = engine
                .allocate_with(span as usize, prefault(), RegisterOptions::local_only())
                .await?;
            Ok::<_, te_core::Error>(Setup {
                src,
                dsts,
                contiguous_dst,
                slots,
            })
        })
        .map_err(|e| e.to_string())?;
    fill(&setup.src, 11);
    // Opened after the allocation so the descriptor lists the destination.
    let me = rt
        .block_on(engine.open_segment(engine.segment_name()))
        .map_err(|e| e.to_string())?;
    let reqs: Vec<Vec<TransferRequest>> = setup
        .dsts
        .iter()
        .map(|dst| {
            setup
                .slots
                .iter()
                .map(|&(s, d)| TransferRequest::write(setup.src.addr() + s, me.id(), dst.addr() + d, frag))
                .collect()
        })
        .collect();
    Ok((setup, reqs))
}

/// Host to host at one fragment size.
fn measure_host(
    engine: &TransferEngine,
    rt: &tokio::runtime::Runtime,
    frag: u64,
    n: usize,
    args: &Args,
    bar: &ProgressBar,
) -> Result<Measured, String> {
    let (setup, reqs) = host_setup(engine, rt, frag, n)?;
    let total = frag * n as u64;
    let (mut eng, mut lp, mut contig) = (Vec::new(), Vec::new(), Vec::new());
    let mut mismatched = 0u64;
    // One untimed warm-up of each path into each destination so first-touch faults are not
    // measured.
    for (e, b) in [(0, 1), (1, 0)] {
        run_engine(engine, &reqs[e])?;
        memcpy_loop(&setup, &setup.dsts[b], frag);
    }
    contiguous(&setup, total);
    if args.verify {
        for (e, dst) in setup.dsts.iter().enumerate() {
            zero(dst);
            run_engine(engine, &reqs[e])?;
            mismatched += verify(&setup, dst, frag);
        }
    }
    engine.reset_phase_report();
    // Even repetitions: engine into the first buffer, then the loop into the second; odd ones:
    // the loop into the first, then the engine into the second. Each timed copy then writes a
    // buffer last written three copies earlier, whichever path it is.
    for rep in 0..args.repeat {
        if rep % 2 == 0 {
            eng.push(run_engine(engine, &reqs[0])?);
            lp.push(memcpy_loop(&setup, &setup.dsts[1], frag));
        } else {
            lp.push(memcpy_loop(&setup, &setup.dsts[0], frag));
            eng.push(run_engine(engine, &reqs[1])?);
        }
        contig.push(contiguous(&setup, total));
        bar.inc(1);
    }
    Ok(Measured {
        fragments: n,
        total,
        engine: median(&mut eng),
        memcpy_loop: median(&mut lp),
        contiguous: median(&mut contig),
        mismatched: args.verify.then_some(mismatched),
        baseline: "memcpy per fragment",
        batch_memcpy: None,
        phases: engine.phase_report().map(|p| phases_per_fragment(&p)),
    })
}

/// Nanoseconds per fragment of each engine phase (mean over the timed calls).
pub(crate) fn phases_per_fragment(p: &te_core::PhaseReport) -> serde_json::Value {
    let items = p.items.max(1) as f64;
    let m: serde_json::Map<String, serde_json::Value> = te_core::Phase::ALL
        .iter()
        .map(|&ph| {
            (
                ph.name().to_string(),
                serde_json::json!(p.nanos[ph as usize] as f64 / items),
            )
        })
        .collect();
    serde_json::Value::Object(m)
}

fn prefault() -> HostBufferOptions {
    HostBufferOptions {
        prefault: true,
        ..Default::default()
    }
}

fn run_engine(engine: &TransferEngine, reqs: &[TransferRequest]) -> Result<Duration, String> {
    let t0 = Instant::now();
    let batch = engine.submit(reqs).map_err(|e| e.to_string())?;
    let outcome = batch.wait_blocking(None);
    // Releasing the batch (its pins and statuses) is part of the engine's cost.
    drop(batch);
    let elapsed = t0.elapsed();
    match outcome {
        Some(Ok(_)) => Ok(elapsed),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("batch did not complete".into()),
    }
}

fn memcpy_loop(s: &Setup, dst: &Registration, frag: u64) -> Duration {
    let (src, dst) = (s.src.as_ptr(), dst.as_ptr());
    let t0 = Instant::now();
    for &(so, d) in &s.slots {
        // SAFETY: both ranges lie inside their live registrations (slots were built to fit), and
        // source and destination are different buffers.
        unsafe { std::ptr::copy_nonoverlapping(src.add(so as usize), dst.add(d as usize), frag as usize) };
    }
    std::hint::black_box(dst);
    t0.elapsed()
}

fn contiguous(s: &Setup, total: u64) -> Duration {
    let dst = &s.contiguous_dst;
    let t0 = Instant::now();
    // SAFETY: `total` <= the span of both buffers; they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(s.src.as_ptr(), dst.as_ptr(), total as usize) };
    std::hint::black_box(dst.as_ptr());
    t0.elapsed()
}

fn fill(r: &Registration, seed: u64) {
    let data: Vec<u8> = (0..r.len()).map(|i| pattern(seed, i)).collect();
    r.write_at(0, &data).expect("fill within the registration");
}

fn zero(r: &Registration) {
    r.write_at(0, &vec![0u8; r.len() as usize])
        .expect("zero within the registration");
}

fn verify(s: &Setup, written: &Registration, frag: u64) -> u64 {
    let mut dst = vec![0u8; written.len() as usize];
    written.read_at(0, &mut dst).expect("read back within the registration");
    let mut bad = 0u64;
    for &(so, d) in &s.slots {
        for k in 0..frag {
            if dst[(d + k) as usize] != pattern(11, so + k) {
                bad += 1;
            }
        }
    }
    bad
}
