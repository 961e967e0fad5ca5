//! `te-bench local-copy`: scattered fragments copied through the engine's local transport, with
//! two baselines timed in the same run: a plain loop of memcpy over the same fragments, and one
//! contiguous memcpy of the same total bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use te_core::config::MapEnv;
use te_core::{HostBufferOptions, RegisterOptions, Registration, TransferEngine, TransferRequest};

use crate::util::{median, parse_list, pattern, print_json, runtime};

#[derive(clap::Args)]
pub struct Args {
    /// Fragment sizes to measure, comma-separated.
    #[arg(long, default_value = "1728,8448,37440")]
    fragment_bytes: String,
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
}

struct Setup {
    src: Registration,
    dst: Registration,
    /// The baselines' own destination, so neither path inherits the other's cache state.
    baseline_dst: Registration,
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
    let sizes: Vec<u64> = parse_list(&args.fragment_bytes)?;
    if sizes.contains(&0) || args.fragments == Some(0) || args.repeat == 0 {
        return Err("fragment sizes, --fragments and --repeat must be positive".into());
    }
    let rt = runtime()?;
    let mut vars: Vec<(String, String)> = std::env::vars().filter(|(k, _)| k.starts_with("TE_")).collect();
    if let Some(t) = args.threads {
        vars.retain(|(k, _)| k != "TE_COPY_THREADS");
        vars.push(("TE_COPY_THREADS".into(), t.to_string()));
    }
    let env = MapEnv(vars.into_iter().collect());
    let engine = rt
        .block_on(
            TransferEngine::builder()
                .segment_name(format!("te-bench-local-{}", std::process::id()))
                .env(Arc::new(env))
                .transports(["local"])
                .build(),
        )
        .map_err(|e| e.to_string())?;
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new((sizes.len() * args.repeat) as u64)
    };
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}").map_err(|e| e.to_string())?);
    if !args.json {
        println!(
            "{:>9} {:>9} {:>12} {:>12} {:>9} {:>10} {:>11} {:>8} {:>10}",
            "frag_B", "frags", "ns/frag", "overhead_ns", "GB/s", "loop_GB/s", "contig_GB/s", "x_loop", "mismatch"
        );
    }
    for &frag in &sizes {
        bar.set_message(format!("{frag} B"));
        let n = args
            .fragments
            .unwrap_or_else(|| ((64u64 << 20) / frag).max(2048) as usize);
        let slots = slots(n, frag);
        let span = (n as u64) * (frag + 64);
        let setup = rt
            .block_on(async {
                let src = engine
                    .allocate_with(span as usize, prefault(), RegisterOptions::local_only())
                    .await?;
                let dst = engine.allocate(span as usize, prefault()).await?;
                let baseline_dst = engine
                    .allocate_with(span as usize, prefault(), RegisterOptions::local_only())
                    .await?;
                Ok::<_, te_core::Error>(Setup {
                    src,
                    dst,
                    baseline_dst,
                    slots,
                })
            })
            .map_err(|e| e.to_string())?;
        fill(&setup.src, 11);
        // Opened after the allocation so the descriptor lists the destination.
        let me = rt
            .block_on(engine.open_segment(engine.segment_name()))
            .map_err(|e| e.to_string())?;
        let reqs: Vec<TransferRequest> = setup
            .slots
            .iter()
            .map(|&(s, d)| TransferRequest::write(setup.src.addr() + s, me.id(), setup.dst.addr() + d, frag))
            .collect();
        let total = frag * n as u64;
        let (mut eng, mut lp, mut contig) = (Vec::new(), Vec::new(), Vec::new());
        let mut mismatched = 0u64;
        // One untimed warm-up of each path so first-touch faults are not measured.
        run_engine(&engine, &reqs)?;
        memcpy_loop(&setup, frag);
        contiguous(&setup, total);
        for rep in 0..args.repeat {
            if args.verify && rep == 0 {
                zero(&setup.dst);
                run_engine(&engine, &reqs)?;
                mismatched += verify(&setup, frag);
            }
            eng.push(run_engine(&engine, &reqs)?);
            lp.push(memcpy_loop(&setup, frag));
            contig.push(contiguous(&setup, total));
            bar.inc(1);
        }
        let (e, l, c) = (median(&mut eng), median(&mut lp), median(&mut contig));
        let gbps = |d: Duration, b: u64| b as f64 / d.as_secs_f64() / 1e9;
        let ns_per = e.as_nanos() as f64 / n as f64;
        let overhead = (e.as_nanos() as f64 - l.as_nanos() as f64) / n as f64;
        let row = serde_json::json!({
            "bench": "local-copy",
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
            "mismatched_bytes": if args.verify { Some(mismatched) } else { None },
        });
        if args.json {
            print_json(&row);
        } else {
            bar.suspend(|| {
                println!(
                    "{:>9} {:>9} {:>12.1} {:>12.1} {:>9.2} {:>10.2} {:>11.2} {:>8.2} {:>10}",
                    frag,
                    n,
                    ns_per,
                    overhead,
                    gbps(e, total),
                    gbps(l, total),
                    gbps(c, total),
                    l.as_secs_f64() / e.as_secs_f64(),
                    if args.verify {
                        mismatched.to_string()
                    } else {
                        "-".into()
                    }
                )
            });
        }
        if args.verify && mismatched > 0 {
            return Err(format!("--verify: {mismatched} mismatched bytes at {frag} B fragments"));
        }
    }
    bar.finish_and_clear();
    Ok(())
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
    match batch.wait_blocking(None) {
        Some(Ok(_)) => Ok(t0.elapsed()),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("batch did not complete".into()),
    }
}

fn memcpy_loop(s: &Setup, frag: u64) -> Duration {
    let (src, dst) = (s.src.as_ptr(), s.baseline_dst.as_ptr());
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
    let t0 = Instant::now();
    // SAFETY: `total` <= the span of both buffers; they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(s.src.as_ptr(), s.baseline_dst.as_ptr(), total as usize) };
    std::hint::black_box(s.baseline_dst.as_ptr());
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

fn verify(s: &Setup, frag: u64) -> u64 {
    let mut dst = vec![0u8; s.dst.len() as usize];
    s.dst.read_at(0, &mut dst).expect("read back within the registration");
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
