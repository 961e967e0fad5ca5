//! `te-bench transfer --metrics-ab`: two initiator engines in this process move the same batches
//! to the same target, one exporting metrics (`TE_METRICS_LISTEN` on loopback) and one not;
//! repetitions and latency round trips alternate between them (the order alternating too) so
//! both see the same machine and connection state. Reports each one's median and the ratios (of
//! the medians, and the median of each pair's ratio). `--metrics-ab-control` runs both engines
//! without metrics: the A/A noise floor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use te_core::config::{Env, ProcessEnv};
use te_core::{Registration, TransferEngine, TransferRequest};

use super::{block_requests, local_buffer, overlay_vars, p2p_store, verify_transfer, Args, Overlay, WRITE_SEED};
use crate::util::{median, paired_ratio, print_json};

struct Side {
    engine: TransferEngine,
    local: Registration,
    requests: Vec<TransferRequest>,
    times: Vec<Duration>,
    latency: Vec<Duration>,
}

async fn side(args: &Args, peer_addr: &str, metrics: bool) -> Result<Side, String> {
    let mut vars = overlay_vars(args);
    if metrics && !args.metrics_ab_control {
        vars.push((te_core::metrics::LISTEN_VAR.into(), "127.0.0.1:0".into()));
    }
    let role = if metrics { "metrics-on" } else { "metrics-off" };
    let store = p2p_store("127.0.0.1:0".parse().expect("valid address")).await?;
    let engine = TransferEngine::builder()
        .segment_name(format!("te-bench-{role}-{}", std::process::id()))
        .metadata(store)
        .env(Arc::new(Overlay { vars }))
        .transports([args.transport.clone()])
        .build()
        .await
        .map_err(|e| format!("starting the {role} engine: {e}"))?;
    let seg = engine
        .open_segment(peer_addr)
        .await
        .map_err(|e| format!("opening the target at {peer_addr}: {e}"))?;
    let remote = seg
        .buffers()
        .first()
        .cloned()
        .filter(|b| b.len >= args.total_bytes)
        .ok_or_else(|| format!("the target at {peer_addr} exports no buffer of --total-bytes"))?;
    let local = local_buffer(args, &engine).await?;
    let requests = block_requests(args, &local, seg.id(), remote.base);
    // Warm-up: connections, page faults.
    engine.transfer(&requests).await.map_err(|e| e.to_string())?;
    Ok(Side {
        engine,
        local,
        requests,
        times: Vec::new(),
        latency: Vec::new(),
    })
}

async fn timed(side: &mut Side, batches: u32) -> Result<(), String> {
    let t0 = Instant::now();
    for _ in 0..batches {
        side.engine.transfer(&side.requests).await.map_err(|e| e.to_string())?;
    }
    side.times.push(t0.elapsed());
    Ok(())
}

async fn round_trip(side: &mut Side, i: usize) -> Result<(), String> {
    let r = &side.requests[i % side.requests.len()];
    let t0 = Instant::now();
    side.engine
        .transfer(std::slice::from_ref(r))
        .await
        .map_err(|e| e.to_string())?;
    side.latency.push(t0.elapsed());
    Ok(())
}

pub(super) async fn run(args: &Args, peer_addr: &str) -> Result<(), String> {
    if ProcessEnv.get(te_core::metrics::LISTEN_VAR).is_some() {
        return Err("--metrics-ab sets TE_METRICS_LISTEN for one engine itself; unset it".into());
    }
    let mut sides = [side(args, peer_addr, false).await?, side(args, peer_addr, true).await?];
    for rep in 0..args.repeat {
        let first = rep % 2;
        timed(&mut sides[first], args.batches).await?;
        timed(&mut sides[1 - first], args.batches).await?;
    }
    for i in 0..args.latency_samples.max(1) {
        let first = i % 2;
        round_trip(&mut sides[first], i).await?;
        round_trip(&mut sides[1 - first], i).await?;
    }
    let mut mismatched = None;
    if args.verify {
        let mut bad = 0;
        for s in &sides {
            s.engine.transfer(&s.requests).await.map_err(|e| e.to_string())?;
            bad += verify_transfer(args, &s.engine, &s.local, &s.requests, WRITE_SEED).await?;
        }
        mismatched = Some(bad);
    }
    let paired_time = paired_ratio(&sides[0].times, &sides[1].times);
    let paired_latency = paired_ratio(&sides[0].latency, &sides[1].latency);
    let per_run = args.total_bytes as f64 * args.batches as f64;
    let [off, on] = sides.each_mut().map(|s| {
        let gbps = per_run / median(&mut s.times).as_secs_f64() / 1e9;
        let p50 = median(&mut s.latency).as_secs_f64() * 1e6;
        (gbps, p50)
    });
    let row = serde_json::json!({
        "bench": "transfer-metrics-ab",
        "transport": args.transport,
        "op": args.op.to_string(),
        "block_bytes": args.block_bytes,
        "total_bytes": args.total_bytes,
        "batches": args.batches,
        "repeat": args.repeat,
        "latency_samples": args.latency_samples.max(1),
        "off_gbps": off.0,
        "on_gbps": on.0,
        "ratio_gbps_on_vs_off": on.0 / off.0,
        "off_p50_us": off.1,
        "on_p50_us": on.1,
        "ratio_p50_on_vs_off": on.1 / off.1,
        "paired_time_ratio_median": paired_time,
        "paired_latency_ratio_median": paired_latency,
        "control": args.metrics_ab_control,
        "exporting": sides.each_ref().map(|s| s.engine.metrics_addr().is_some()),
        "verified": args.verify,
        "mismatched_bytes": mismatched.unwrap_or(0),
    });
    if args.json {
        print_json(&row);
    } else {
        println!(
            "{} {} {} B blocks, metrics off vs on (interleaved, median of {}): {:.3} vs {:.3} GB/s (time ratio, paired {:.3}); single-request p50 {:.1} vs {:.1} us (ratio {:.3}, paired {:.3})",
            args.transport,
            args.op,
            args.block_bytes,
            args.repeat,
            off.0,
            on.0,
            paired_time,
            off.1,
            on.1,
            on.1 / off.1,
            paired_latency
        );
    }
    match mismatched {
        Some(n) if n > 0 => Err(format!("{n} mismatched bytes")),
        _ => Ok(()),
    }
}
