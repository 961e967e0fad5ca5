//! `te-bench failover`: how long a batch takes to finish after its route dies under it. Two
//! engines in this process, each with efa (libfabric, `--provider`, default `tcp;ofi_rxm`) and
//! tcp; the initiator writes `--total-bytes` in `--block-bytes` requests on efa, and right after
//! the submit the efa connection's sockets are destroyed (`ss -K`, the kernel's socket destroy:
//! root and CONFIG_INET_DIAG_DESTROY). The failed requests fail over to tcp.
//!
//! Per round, in this order, the same bytes and request shape:
//! - **efa**: the batch on efa, nothing killed;
//! - **tcp**: the batch on tcp alone (a third engine with tcp only, to the same target);
//! - **failover**: the batch on efa with the kill; timed from the kill's return to the batch's
//!   completion (`recovery`), and from the submit (`total`); and from the kill to the first
//!   request resubmitted on tcp (`first failover`: the failure seen and acted on).
//!
//! - **tracking cost**: `--small-requests` 4 KiB writes on efa in one batch, with failover on
//!   (the batch carries its failure hook and a copy of its requests) and with
//!   `SubmitOptions::no_failover`, back to back; the median of the paired ratios is reported.
//!
//! Each round fails the efa route once, and three failures within ten seconds pause it: the
//! initiator's first cooldown is 1 ms (`TE_ROUTE_PAUSE_MS`), and every batch waits until the
//! probe brought efa back, so each starts on efa.
//!
//! A round in which the batch finished before the kill landed (no request failed over) is counted
//! as missed and left out. Reports p50 and p99 over the rounds (with few rounds p99 is the
//! maximum), and with `--verify` checks the target's bytes after every batch.

use std::time::{Duration, Instant};

use te_core::{
    HostBufferOptions, Registration, RouteState, SegmentHandle, SubmitOptions, TransferEngine, TransferRequest,
};

use te_base::test_support::socket_destroy;

use crate::util::{in_process_engine, paired_ratio, pattern, percentiles, print_json, require_transport, runtime};

#[derive(clap::Args)]
pub struct Args {
    /// libfabric provider of the efa route (TE_FABRIC_PROVIDER).
    #[arg(long, default_value = "tcp;ofi_rxm")]
    provider: String,
    /// Bytes per batch (K/M/G suffixes).
    #[arg(long, default_value = "64M", value_parser = te_core::config::parse_byte_size)]
    total_bytes: u64,
    /// Bytes per request.
    #[arg(long, default_value = "256K", value_parser = te_core::config::parse_byte_size)]
    block_bytes: u64,
    /// 4 KiB requests of the batch that measures what failover's tracking costs a batch.
    #[arg(long, default_value_t = 4096)]
    small_requests: u64,
    /// Rounds (each: efa, tcp, failover).
    #[arg(long, default_value_t = 21)]
    rounds: usize,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// Check the target's bytes after every batch.
    #[arg(long)]
    verify: bool,
}

pub fn run(args: Args) -> Result<(), String> {
    if args.rounds == 0 || args.block_bytes == 0 || args.total_bytes < args.block_bytes {
        return Err("--rounds must be at least 1 and --total-bytes at least --block-bytes (non-zero)".into());
    }
    if !args.total_bytes.is_multiple_of(args.block_bytes) {
        return Err("--total-bytes must be a multiple of --block-bytes".into());
    }
    runtime()?.block_on(measure(&args))
}

/// One initiator's view of the target.
struct Side {
    engine: TransferEngine,
    src: Registration,
    seg: SegmentHandle,
}

impl Side {
    async fn open(engine: TransferEngine, target: &str, len: u64) -> Result<Side, String> {
        let src = engine
            .allocate(len as usize, HostBufferOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        let seg = engine.open_segment(target).await.map_err(|e| e.to_string())?;
        engine.warm_up(&seg).await.map_err(|e| format!("warm-up: {e}"))?;
        Ok(Side { engine, src, seg })
    }

    fn writes(&self, block: u64, total: u64) -> Vec<TransferRequest> {
        let remote = self.seg.buffers()[0].base;
        (0..total / block)
            .map(|k| TransferRequest::write(self.src.addr() + k * block, self.seg.id(), remote + k * block, block))
            .collect()
    }
}

async fn measure(args: &Args) -> Result<(), String> {
    let provider = Some(args.provider.as_str());
    // Every round fails the efa route once; three within ten seconds pause it. A 1 ms first
    // cooldown lets its probe bring it back at once, and each round waits for that, so every
    // round starts on efa.
    let a = in_process_engine(
        "te-bench-failover-a",
        &["efa", "tcp"],
        provider,
        &[("TE_ROUTE_PAUSE_MS", "1")],
    )
    .await?;
    require_transport(&a, "efa")?;
    let b = in_process_engine("te-bench-failover-b", &["efa", "tcp"], provider, &[]).await?;
    let c = in_process_engine("te-bench-failover-tcp", &["tcp"], None, &[]).await?;
    let len = args.total_bytes;
    let dst = b
        .allocate(len as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let a = Side::open(a, b.segment_name(), len).await?;
    let c = Side::open(c, b.segment_name(), len).await?;
    let port = efa_port(a.seg.descriptor())?;
    socket_destroy::available().map_err(|e| format!("socket destroy is not available: {e}"))?;

    let (mut efa, mut tcp, mut recovery, mut total) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut missed, mut moved) = (0usize, Vec::new());
    let (mut tracked, mut untracked) = (Vec::new(), Vec::new());
    let mut detect = Vec::new();
    for round in 0..args.rounds {
        efa_active(&a).await?;
        for (k, (side, out)) in [(&a, &mut efa), (&c, &mut tcp)].into_iter().enumerate() {
            let seed = round as u64 * 3 + k as u64;
            prepare(side, &dst, seed, len, args.verify)?;
            let t0 = Instant::now();
            side.engine
                .transfer(&side.writes(args.block_bytes, len))
                .await
                .map_err(|e| e.to_string())?;
            out.push(t0.elapsed());
            check(&dst, seed, len, args.verify)?;
        }
        let small = a.writes(4096, (args.small_requests * 4096).min(len));
        let timed = |opts: SubmitOptions| {
            let t0 = Instant::now();
            let batch = a.engine.submit_with(&small, &opts).map_err(|e| e.to_string());
            async move {
                batch?.wait().await.map_err(|e| e.to_string())?;
                Ok::<Duration, String>(t0.elapsed())
            }
        };
        let off = SubmitOptions {
            no_failover: true,
            ..SubmitOptions::default()
        };
        // Alternate which goes first, so neither always finds the other's warm caches.
        if round % 2 == 0 {
            tracked.push(timed(SubmitOptions::default()).await?);
            untracked.push(timed(off).await?);
        } else {
            untracked.push(timed(off).await?);
            tracked.push(timed(SubmitOptions::default()).await?);
        }
        efa_active(&a).await?;
        let seed = round as u64 * 3 + 2;
        prepare(&a, &dst, seed, len, args.verify)?;
        let before = a.engine.metrics().failovers;
        let t0 = Instant::now();
        let batch = a
            .engine
            .submit(&a.writes(args.block_bytes, len))
            .map_err(|e| e.to_string())?;
        socket_destroy::destroy_port(port)?;
        let killed = Instant::now();
        // Until the first request moves (or the batch ends first): how soon a failure is seen
        // and acted on. A spin of a few milliseconds at most, on this thread only.
        let mut first_move = None;
        while !batch.is_complete() {
            if a.engine.metrics().failovers > before {
                first_move = Some(killed.elapsed());
                break;
            }
            tokio::task::yield_now().await;
        }
        tokio::time::timeout(Duration::from_secs(120), batch.wait())
            .await
            .map_err(|_| "the failover batch did not finish within 120 s".to_string())?
            .map_err(|e| format!("the failover batch failed: {e}"))?;
        let (done, n) = (Instant::now(), a.engine.metrics().failovers - before);
        check(&dst, seed, len, args.verify)?;
        if n == 0 {
            missed += 1;
            continue;
        }
        recovery.push(done - killed);
        detect.extend(first_move);
        total.push(done - t0);
        moved.push(n);
    }
    if recovery.is_empty() {
        return Err(format!(
            "no kill landed mid-batch in {} rounds: raise --total-bytes",
            args.rounds
        ));
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (efa50, _) = percentiles(&mut efa);
    let (tcp50, _) = percentiles(&mut tcp);
    let (rec50, rec99) = percentiles(&mut recovery);
    let (det50, det99) = if detect.is_empty() {
        (Duration::ZERO, Duration::ZERO)
    } else {
        percentiles(&mut detect)
    };
    let (tot50, tot99) = percentiles(&mut total);
    let tracking = paired_ratio(&untracked, &tracked);
    moved.sort_unstable();
    let moved50 = moved[moved.len() / 2];
    let requests = len / args.block_bytes;
    let small_n = (args.small_requests * 4096).min(len) / 4096;
    if args.json {
        print_json(&serde_json::json!({
            "bench": "failover", "provider": args.provider, "total_bytes": len,
            "block_bytes": args.block_bytes, "rounds": args.rounds, "missed": missed,
            "efa_ms_p50": ms(efa50), "tcp_ms_p50": ms(tcp50),
            "recovery_ms_p50": ms(rec50), "recovery_ms_p99": ms(rec99),
            "first_failover_ms_p50": ms(det50), "first_failover_ms_p99": ms(det99),
            "failover_batch_ms_p50": ms(tot50), "failover_batch_ms_p99": ms(tot99),
            "requests": requests, "failed_over_p50": moved50, "verified": args.verify,
            "small_requests": small_n, "tracking_ratio": tracking,
        }));
    } else {
        println!(
            "failover efa ({}) -> tcp, {} MiB in {} KiB writes ({requests} requests), {} rounds ({missed} missed):",
            args.provider,
            len >> 20,
            args.block_bytes >> 10,
            args.rounds
        );
        println!("  batch on efa, nothing killed   p50 {:.2} ms", ms(efa50));
        println!("  batch on tcp alone             p50 {:.2} ms", ms(tcp50));
        println!(
            "  kill -> first request on tcp   p50 {:.2} ms  p99 {:.2} ms",
            ms(det50),
            ms(det99)
        );
        println!(
            "  kill -> batch done (failover)  p50 {:.2} ms  p99 {:.2} ms  ({moved50} requests failed over, median)",
            ms(rec50),
            ms(rec99)
        );
        println!(
            "  submit -> done (failover)      p50 {:.2} ms  p99 {:.2} ms{}",
            ms(tot50),
            ms(tot99),
            if args.verify { "  (bytes verified)" } else { "" }
        );
        println!("  {small_n} x 4 KiB batch, failover on / off: {tracking:.3}x (median of paired rounds)");
    }
    Ok(())
}

/// Waits (at most 10 s) until the efa route to the target is active again after a pause.
async fn efa_active(side: &Side) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let routes = side.engine.routes(&side.seg).map_err(|e| e.to_string())?;
        if routes
            .first()
            .is_some_and(|r| r.transport == "efa" && r.state == RouteState::Active && r.connected)
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the efa route did not come back within 10 s: {routes:?}"));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn prepare(side: &Side, dst: &Registration, seed: u64, len: u64, verify: bool) -> Result<(), String> {
    if verify {
        let data: Vec<u8> = (0..len).map(|p| pattern(seed, p)).collect();
        side.src.write_at(0, &data).map_err(|e| e.to_string())?;
        dst.write_at(0, &vec![0u8; len as usize]).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn check(dst: &Registration, seed: u64, len: u64, verify: bool) -> Result<(), String> {
    if !verify {
        return Ok(());
    }
    let mut got = vec![0u8; len as usize];
    dst.read_at(0, &mut got).map_err(|e| e.to_string())?;
    match (0..len).find(|&p| got[p as usize] != pattern(seed, p)) {
        None => Ok(()),
        Some(p) => Err(format!("byte {p} of the target differs after the batch")),
    }
}

/// The port of the target's first efa rail (a socket provider's address is a `sockaddr_in`).
fn efa_port(desc: &te_core::SegmentDescriptor) -> Result<u16, String> {
    let ep = desc.endpoint("efa").ok_or("the target does not advertise efa")?;
    let hex = ep["rails"][0]["addr"].as_str().ok_or("no efa rail address")?;
    socket_destroy::sockaddr_in_port(hex).ok_or_else(|| {
        format!("the efa rail address {hex} is not an IPv4 sockaddr (a socket provider is needed to kill it)")
    })
}
