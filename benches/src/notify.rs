//! `te-bench notify`: notification latency. Two engines in this process (their transports still
//! talk over real sockets for tcp), so one clock times both ends:
//!
//! - **notified**: from `submit_notified` of one `--block-bytes` write to the moment the target's
//!   `notifications().recv()` returns it (the target can use the data);
//! - **plain**: from `submit` of the same write to its completion at the initiator (the baseline:
//!   what an initiator knows without a notification).
//!
//! Samples alternate (plain, notified, plain, ...) so both see the same conditions; each run
//! reports p50 and p99 of each, and the command prints the median over `--repeat` runs and the
//! ratio notified / plain. `--verify` checks the target's bytes each time a notification arrives.

use std::time::{Duration, Instant};

use te_core::{HostBufferOptions, SubmitOptions, TransferEngine, TransferRequest};

use crate::util::{in_process_engine, median, pattern, percentiles, print_json, runtime};

#[derive(clap::Args)]
pub struct Args {
    /// Transport to measure (tcp, local, efa with the `efa` feature).
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// libfabric provider for `--transport efa` (sets TE_FABRIC_PROVIDER), e.g. `tcp;ofi_rxm`, `shm`.
    /// Other `TE_FABRIC_*` variables (e.g. `TE_FABRIC_IDLE`) are taken from the environment.
    #[arg(long)]
    provider: Option<String>,
    /// Bytes of the write that carries the notification.
    #[arg(long, default_value = "4K", value_parser = te_core::config::parse_byte_size)]
    block_bytes: u64,
    /// Notification payload bytes.
    #[arg(long, default_value_t = 64)]
    payload_bytes: usize,
    /// Samples of each kind per run.
    #[arg(long, default_value_t = 2000)]
    samples: usize,
    /// Runs; medians of their percentiles are reported.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// Check the target's bytes when each notification arrives.
    #[arg(long)]
    verify: bool,
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

async fn engine(name: &str, transport: &str, provider: Option<&str>) -> Result<TransferEngine, String> {
    in_process_engine(name, &[transport], provider, &[]).await
}

pub fn run(args: Args) -> Result<(), String> {
    if args.samples == 0 || args.repeat == 0 || args.block_bytes == 0 {
        return Err("--samples, --repeat and --block-bytes must be at least 1".into());
    }
    runtime()?.block_on(measure(&args))
}

async fn measure(args: &Args) -> Result<(), String> {
    let provider = args.provider.as_deref();
    let a = engine("te-bench-notify-initiator", &args.transport, provider).await?;
    let b = engine("te-bench-notify-target", &args.transport, provider).await?;
    let n = args.block_bytes;
    let src = a
        .allocate(n as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let dst = b
        .allocate(2 * n as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let seg = a.open_segment(b.segment_name()).await.map_err(|e| e.to_string())?;
    let inbox = b.notifications();
    let payload = vec![0x5au8; args.payload_bytes];
    let (plain_w, notified_w) = (
        TransferRequest::write(src.addr(), seg.id(), dst.addr(), n),
        TransferRequest::write(src.addr(), seg.id(), dst.addr() + n, n),
    );
    let mut runs = Vec::with_capacity(args.repeat);
    let mut check = vec![0u8; n as usize];
    for run in 0..args.repeat {
        let mut plain = Vec::with_capacity(args.samples);
        let mut notified = Vec::with_capacity(args.samples);
        for i in 0..args.samples {
            let seed = (run * args.samples + i) as u64;
            if args.verify {
                let data: Vec<u8> = (0..n).map(|p| pattern(seed, p)).collect();
                src.write_at(0, &data).map_err(|e| e.to_string())?;
            }
            let t0 = Instant::now();
            a.transfer(&[plain_w]).await.map_err(|e| format!("plain write: {e}"))?;
            plain.push(t0.elapsed());

            let t0 = Instant::now();
            let nb = a
                .submit_notified(&[notified_w], payload.clone(), &SubmitOptions::default())
                .map_err(|e| format!("notified write: {e}"))?;
            let got = tokio::time::timeout(Duration::from_secs(30), inbox.recv())
                .await
                .map_err(|_| "no notification within 30 s".to_string())?
                .ok_or("the target engine closed")?;
            notified.push(t0.elapsed());
            if got.payload.len() != payload.len() {
                return Err("notification payload changed in flight".into());
            }
            if args.verify {
                dst.read_at(n, &mut check).map_err(|e| e.to_string())?;
                if let Some(p) = check
                    .iter()
                    .enumerate()
                    .position(|(j, b)| *b != pattern(seed, j as u64))
                {
                    return Err(format!(
                        "sample {i}: byte {p} not in place when its notification arrived"
                    ));
                }
            }
            nb.wait().await.map_err(|e| format!("notified write: {e}"))?;
        }
        let (p50p, p99p) = percentiles(&mut plain);
        let (p50n, p99n) = percentiles(&mut notified);
        if args.json {
            print_json(&serde_json::json!({
                "bench": "notify", "transport": args.transport, "provider": args.provider, "run": run, "block_bytes": n,
                "payload_bytes": args.payload_bytes, "samples": args.samples,
                "plain_p50_us": micros(p50p), "plain_p99_us": micros(p99p),
                "notified_p50_us": micros(p50n), "notified_p99_us": micros(p99n),
            }));
        } else {
            println!(
                "run {run}: plain write p50 {:.1} us p99 {:.1} us | write+notification to receipt p50 {:.1} us p99 {:.1} us",
                micros(p50p), micros(p99p), micros(p50n), micros(p99n)
            );
        }
        runs.push([p50p, p99p, p50n, p99n]);
    }
    let med = |k: usize| median(&mut runs.iter().map(|r| r[k]).collect::<Vec<_>>());
    let (p50p, p99p, p50n, p99n) = (med(0), med(1), med(2), med(3));
    let ratio = |x: Duration, y: Duration| x.as_secs_f64() / y.as_secs_f64();
    if args.json {
        print_json(&serde_json::json!({
            "bench": "notify", "transport": args.transport, "provider": args.provider, "summary": true, "runs": args.repeat,
            "block_bytes": n, "verified": args.verify,
            "plain_p50_us": micros(p50p), "plain_p99_us": micros(p99p),
            "notified_p50_us": micros(p50n), "notified_p99_us": micros(p99n),
            "ratio_p50": ratio(p50n, p50p), "ratio_p99": ratio(p99n, p99p),
        }));
    } else {
        println!(
            "median of {} runs ({} B write, {} B payload{}): plain p50 {:.1} us p99 {:.1} us; notified p50 {:.1} us p99 {:.1} us; ratio p50 {:.2} p99 {:.2}",
            args.repeat,
            n,
            args.payload_bytes,
            if args.verify { ", verified" } else { "" },
            micros(p50p), micros(p99p), micros(p50n), micros(p99n),
            ratio(p50n, p50p), ratio(p99n, p99p)
        );
    }
    a.shutdown().await.map_err(|e| e.to_string())?;
    b.shutdown().await.map_err(|e| e.to_string())?;
    Ok(())
}
