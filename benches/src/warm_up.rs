//! `te-bench warm-up`: what `TransferEngine::warm_up` saves the first transfer, and what warming
//! many peers costs. Engines in this process (their transports talk over real sockets and
//! libfabric providers), a fresh initiator and target per sample so nothing is pooled:
//!
//! - **first transfer, cold**: open the segment, then time the first `--block-bytes` write;
//! - **first transfer, warmed**: open the segment, warm it up (timed on its own), then time the
//!   first write; cold and warmed samples alternate;
//! - **steady**: the same write once more on the warmed pair, for reference;
//! - **peers**: for each N of `--peers`, one initiator opens N targets, then warms all N at once
//!   (one `warm_up` per segment, joined); the open and the warm-up are timed separately.
//!
//! Per transport of `--transports` (tcp; efa with `--provider`, default `tcp;ofi_rxm`). Reports
//! p50 and p99 over `--samples` (with few samples p99 is the maximum).

use std::time::{Duration, Instant};

use te_core::{HostBufferOptions, TransferEngine, TransferRequest};

use crate::util::{in_process_engine, parse_list, percentiles, print_json, require_transport, runtime};

#[derive(clap::Args)]
pub struct Args {
    /// Transports to measure, comma-separated (tcp, efa).
    #[arg(long, default_value = "tcp")]
    transports: String,
    /// libfabric provider for efa (TE_FABRIC_PROVIDER).
    #[arg(long, default_value = "tcp;ofi_rxm")]
    provider: String,
    /// Bytes of the timed write.
    #[arg(long, default_value = "4K", value_parser = te_core::config::parse_byte_size)]
    block_bytes: u64,
    /// Samples of each kind (cold, warmed).
    #[arg(long, default_value_t = 21)]
    samples: usize,
    /// Numbers of peers to warm at once, comma-separated.
    #[arg(long, default_value = "1,4,16")]
    peers: String,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<(), String> {
    let peers: Vec<usize> = parse_list(&args.peers)?;
    if args.samples == 0 || args.block_bytes == 0 || peers.contains(&0) {
        return Err("--samples, --block-bytes and every --peers entry must be at least 1".into());
    }
    let transports: Vec<String> = args.transports.split(',').map(|t| t.trim().to_string()).collect();
    let rt = runtime()?;
    for t in &transports {
        rt.block_on(measure(&args, t, &peers))?;
    }
    Ok(())
}

async fn engine(name: &str, transport: &str, provider: &str) -> Result<TransferEngine, String> {
    let e = in_process_engine(name, &[transport], Some(provider), &[]).await?;
    require_transport(&e, transport)?;
    Ok(e)
}

/// One sample: a fresh pair, opened, optionally warmed; the first write's time, the warm-up's
/// and a second write's.
async fn sample(
    transport: &str,
    provider: &str,
    block: u64,
    warm: bool,
    k: usize,
) -> Result<(Duration, Option<Duration>, Duration), String> {
    let a = engine(&format!("te-bench-warm-a{k}"), transport, provider).await?;
    let b = engine(&format!("te-bench-warm-b{k}"), transport, provider).await?;
    let dst = b
        .allocate(block as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let src = a
        .allocate(block as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let seg = a.open_segment(b.segment_name()).await.map_err(|e| e.to_string())?;
    let warm_up = if warm {
        let t0 = Instant::now();
        a.warm_up(&seg).await.map_err(|e| format!("warm-up: {e}"))?;
        Some(t0.elapsed())
    } else {
        None
    };
    let write = [TransferRequest::write(src.addr(), seg.id(), dst.addr(), block)];
    let t0 = Instant::now();
    a.transfer(&write).await.map_err(|e| e.to_string())?;
    let first = t0.elapsed();
    let t0 = Instant::now();
    a.transfer(&write).await.map_err(|e| e.to_string())?;
    Ok((first, warm_up, t0.elapsed()))
}

async fn measure(args: &Args, transport: &str, peers: &[usize]) -> Result<(), String> {
    let (mut cold, mut warmed, mut warm_ups, mut steady) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for k in 0..args.samples {
        let (first, _, _) = sample(transport, &args.provider, args.block_bytes, false, 2 * k).await?;
        cold.push(first);
        let (first, w, again) = sample(transport, &args.provider, args.block_bytes, true, 2 * k + 1).await?;
        warmed.push(first);
        warm_ups.extend(w);
        steady.push(again);
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let (c50, c99) = percentiles(&mut cold);
    let (w50, w99) = percentiles(&mut warmed);
    let (u50, u99) = percentiles(&mut warm_ups);
    let (s50, _) = percentiles(&mut steady);
    let label = if transport == "efa" {
        format!("efa ({})", args.provider)
    } else {
        transport.to_string()
    };
    if args.json {
        print_json(&serde_json::json!({
            "bench": "warm-up", "transport": transport, "provider": (transport == "efa").then_some(&args.provider),
            "block_bytes": args.block_bytes, "samples": args.samples,
            "first_cold_us_p50": us(c50), "first_cold_us_p99": us(c99),
            "first_warmed_us_p50": us(w50), "first_warmed_us_p99": us(w99),
            "warm_up_us_p50": us(u50), "warm_up_us_p99": us(u99), "steady_us_p50": us(s50),
        }));
    } else {
        println!(
            "warm-up {label}, first {} B write, {} samples each:",
            args.block_bytes, args.samples
        );
        println!(
            "  first transfer, cold     p50 {:>9.1} us  p99 {:>9.1} us",
            us(c50),
            us(c99)
        );
        println!(
            "  first transfer, warmed   p50 {:>9.1} us  p99 {:>9.1} us",
            us(w50),
            us(w99)
        );
        println!(
            "  warm_up itself           p50 {:>9.1} us  p99 {:>9.1} us",
            us(u50),
            us(u99)
        );
        println!("  steady (second write)    p50 {:>9.1} us", us(s50));
    }
    for &n in peers {
        let a = engine("te-bench-warm-many", transport, &args.provider).await?;
        let mut targets = Vec::with_capacity(n);
        for i in 0..n {
            let t = engine(&format!("te-bench-warm-t{i}"), transport, &args.provider).await?;
            let buf = t
                .allocate(args.block_bytes as usize, HostBufferOptions::default())
                .await
                .map_err(|e| e.to_string())?;
            targets.push((t, buf));
        }
        let t0 = Instant::now();
        let mut segs = Vec::with_capacity(n);
        for (t, _) in &targets {
            segs.push(a.open_segment(t.segment_name()).await.map_err(|e| e.to_string())?);
        }
        let opened = t0.elapsed();
        let t0 = Instant::now();
        let mut warming = tokio::task::JoinSet::new();
        for seg in segs {
            let a = a.clone();
            warming.spawn(async move { a.warm_up(&seg).await.map(|_| ()) });
        }
        while let Some(r) = warming.join_next().await {
            r.map_err(|e| e.to_string())?.map_err(|e| format!("warm-up: {e}"))?;
        }
        let warmed_all = t0.elapsed();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        if args.json {
            print_json(&serde_json::json!({
                "bench": "warm-up-peers", "transport": transport, "peers": n,
                "open_ms": ms(opened), "warm_up_ms": ms(warmed_all),
            }));
        } else {
            println!(
                "  {n:>3} peers: open {:>8.2} ms, warm all at once {:>8.2} ms",
                ms(opened),
                ms(warmed_all)
            );
        }
    }
    Ok(())
}
