//! `te-bench transfer`: bandwidth, request rate and latency of a network transport between two
//! processes (one host, over loopback) or two hosts.
//!
//! Without `--peer` it re-executes itself with `--serve` as the target process on loopback, so one
//! command measures. With `--peer HOST:PORT` it talks to `te-bench transfer --serve` on another
//! host. Engines find each other through the peer-to-peer metadata store: the target prints the
//! address its store listens on, the initiator opens that address as the segment.
//!
//! Each repetition moves `--total-bytes` in `--block-bytes` requests as one batch (bandwidth and
//! requests per second, medians over `--repeat`); then single-request round trips give p50/p99
//! latency. `--verify` checks every byte against a position-dependent pattern. `--baseline` runs
//! iperf3, ucx_perftest (ucp_put_bw over tcp), fi_pingpong, or the kernel's cross-memory copy of
//! the same buffers ([`cma`]) in the same run and reports the ratio.
//!
//! `--scheme pairwise|many-to-one|one-to-many --peers N` moves bytes between many processes at
//! once instead ([`scheme`]).

mod baseline;
mod cma;
mod metrics_ab;
mod scheme;
mod sweep;

pub use baseline::Baseline;
use baseline::{median_f64, run_baseline_once, BaselineResult};

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use te_core::config::{Env, ProcessEnv};
use te_core::metadata::p2p::{P2pConfig, P2pStore};
use te_core::{HostBufferOptions, Registration, SegmentId, TransferEngine, TransferOp, TransferRequest};

use crate::util::{median, pattern, print_json, runtime};

/// Seed of the pattern the target's buffer holds (what reads must find).
const TARGET_SEED: u64 = 0x5EED;
/// Seed of the pattern the initiator writes.
const WRITE_SEED: u64 = 0xC0FFEE;
/// Verification works through this many bytes at a time.
const CHUNK: usize = 1 << 20;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Transport to measure (tcp, efa, rdma).
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// libfabric provider (sets TE_FABRIC_PROVIDER in both processes).
    #[arg(long)]
    provider: Option<String>,
    /// write or read.
    #[arg(long, default_value = "write")]
    op: TransferOp,
    /// Bytes per request (K/M/G suffixes).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    block_bytes: u64,
    /// Bytes moved per repetition (a multiple of the block size).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    total_bytes: u64,
    /// Connections per peer (TE_TCP_LANES).
    #[arg(long, default_value_t = 1)]
    lanes: usize,
    /// The target's metadata address (printed by `te-bench transfer --serve`); default: start a
    /// target process on loopback.
    #[arg(long)]
    peer: Option<String>,
    /// Be the target: export a buffer of --total-bytes and serve until killed.
    #[arg(long)]
    serve: bool,
    /// Where the target's metadata listener binds (with --serve).
    #[arg(long, default_value = "0.0.0.0:0")]
    listen: String,
    /// Internal: the target exits when its standard input closes (set for the spawned target).
    #[arg(long, hide = true)]
    until_stdin_closes: bool,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// Check every byte against the position-dependent pattern.
    #[arg(long)]
    verify: bool,
    /// Timed repetitions; medians are reported.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Batches per timed repetition, each waited for before the next is submitted. With a small
    /// --total-bytes this streams one cache-resident buffer many times, as fi_pingpong does.
    #[arg(long, default_value_t = 1)]
    batches: u32,
    /// Single-request round trips timed for p50/p99.
    #[arg(long, default_value_t = 1000)]
    latency_samples: usize,
    /// A baseline tool run in the same invocation.
    #[arg(long, value_enum)]
    baseline: Option<Baseline>,
    /// A second baseline, run right after the first after each of our runs (e.g. `--baseline
    /// cma --also-baseline memcpy`: the kernel's copy loop and a memcpy loop in one run); the
    /// row adds `baseline_also`, `ratio_gbps_best` (ours / the better of the two) and the
    /// per-request nanoseconds of each.
    #[arg(long, value_enum, requires = "baseline")]
    also_baseline: Option<Baseline>,
    /// Block i goes to a remote slot a fixed permutation names instead of slot i, so no
    /// neighbouring blocks are adjacent remotely and nothing can coalesce them (KV fragments);
    /// the cma and memcpy baselines use the same slots.
    #[arg(long)]
    scatter: bool,
    /// Instead of one engine: two initiator engines to the same target, one exporting metrics
    /// (TE_METRICS_LISTEN on loopback) and one not, repetitions interleaved; reports the ratio.
    #[arg(long)]
    metrics_ab: bool,
    /// With --metrics-ab: neither engine exports metrics (the A/A noise floor).
    #[arg(long, requires = "metrics_ab")]
    metrics_ab_control: bool,
    /// A block-size sweep instead of one --block-bytes: comma-separated sizes (K/M/G suffixes,
    /// `4K` = 4,096), each moving the same --total-bytes, its --baseline runs interleaved with
    /// ours; one row per size.
    #[arg(long, value_parser = sweep::parse_block_sizes, conflicts_with_all = ["block_bytes", "serve", "metrics_ab"])]
    block_sizes: Option<sweep::BlockSizes>,
    /// With --block-sizes: draw GB/s against block size (ours, the baseline, their ratio) into
    /// this SVG file.
    #[arg(long, requires = "block_sizes")]
    plot: Option<PathBuf>,
    /// Many processes at once instead of one pair: N initiator/target pairs (pairwise), N
    /// initiators into one target (many-to-one), or one initiator driving N targets
    /// (one-to-many), on loopback; per-peer and aggregate GB/s, per-peer latency, Jain's index.
    #[arg(long, value_enum, requires = "peers", conflicts_with_all = ["peer", "serve", "baseline", "metrics_ab", "block_sizes"])]
    scheme: Option<scheme::Scheme>,
    /// With --scheme: how many peers (pairs, initiators or targets; see --scheme).
    #[arg(long, requires = "scheme")]
    peers: Option<usize>,
    /// Internal: be one initiator process of a --scheme run (barrier on stdin, results on stdout).
    #[arg(long, hide = true, requires = "peer")]
    scheme_worker: bool,
    /// Internal: this initiator's index among the scheme's peers (its verify pattern's seed).
    #[arg(long, hide = true, default_value_t = 0)]
    peer_index: u64,
    /// Internal: where in the target's buffer this initiator's range starts.
    #[arg(long, hide = true, default_value_t = 0)]
    remote_offset: u64,
    /// Internal: the seed of the pattern the target's buffer holds (--serve fills it; reads
    /// check it).
    #[arg(long, hide = true, default_value_t = TARGET_SEED)]
    target_seed: u64,
}

fn parse_size(s: &str) -> Result<u64, String> {
    te_core::config::parse_byte_size(s)
}

/// The process environment with the bench's settings laid over it.
struct Overlay {
    vars: Vec<(String, String)>,
}

impl Env for Overlay {
    fn get(&self, var: &str) -> Option<String> {
        self.vars
            .iter()
            .find(|(k, _)| k == var)
            .map(|(_, v)| v.clone())
            .or_else(|| ProcessEnv.get(var))
    }
}

fn overlay_vars(args: &Args) -> Vec<(String, String)> {
    let mut vars = vec![("TE_TCP_LANES".to_string(), args.lanes.to_string())];
    if let Some(p) = &args.provider {
        vars.push(("TE_FABRIC_PROVIDER".into(), p.clone()));
    }
    vars
}

fn overlay(args: &Args) -> Arc<dyn Env> {
    Arc::new(Overlay {
        vars: overlay_vars(args),
    })
}

pub fn run(mut args: Args) -> Result<(), String> {
    if let Some(sizes) = &args.block_sizes {
        sizes.check_total(args.total_bytes).map_err(|e| e.to_string())?;
        // The target process and the checks below see one of the swept sizes.
        args.block_bytes = sizes.first();
    }
    if args.total_bytes == 0 || args.total_bytes.checked_rem(args.block_bytes) != Some(0) {
        return Err(format!(
            "--total-bytes ({}) must be a non-zero multiple of --block-bytes ({})",
            args.total_bytes, args.block_bytes
        ));
    }
    if args.repeat == 0 || args.lanes == 0 || args.batches == 0 {
        return Err("--repeat, --lanes and --batches must be at least 1".into());
    }
    let rt = runtime()?;
    if args.serve {
        return rt.block_on(serve(&args));
    }
    if args.scheme_worker {
        return rt.block_on(scheme::worker::run(&args));
    }
    if let Some(s) = args.scheme {
        return scheme::run(&args, s, &rt);
    }
    rt.block_on(measure(&args))
}

async fn engine(args: &Args, store: Arc<P2pStore>, role: &str) -> Result<TransferEngine, String> {
    TransferEngine::builder()
        .segment_name(format!("te-bench-{role}-{}", std::process::id()))
        .metadata(store)
        .env(overlay(args))
        .transports([args.transport.clone()])
        .build()
        .await
        .map_err(|e| format!("starting the engine with transport {}: {e}", args.transport))
}

fn fill(r: &Registration, seed: u64) -> Result<(), String> {
    let mut chunk = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < r.len() {
        let n = (r.len() - off).min(CHUNK as u64) as usize;
        for (i, b) in chunk[..n].iter_mut().enumerate() {
            *b = pattern(seed, off + i as u64);
        }
        r.write_at(off, &chunk[..n]).map_err(|e| e.to_string())?;
        off += n as u64;
    }
    Ok(())
}

/// Bytes of `r` that differ from pattern `seed` at positions `first_pos` onwards.
fn mismatches(r: &Registration, seed: u64, first_pos: u64) -> Result<u64, String> {
    let mut chunk = vec![0u8; CHUNK];
    let mut off = 0u64;
    let mut bad = 0u64;
    while off < r.len() {
        let n = (r.len() - off).min(CHUNK as u64) as usize;
        r.read_at(off, &mut chunk[..n]).map_err(|e| e.to_string())?;
        bad += chunk[..n]
            .iter()
            .enumerate()
            .filter(|(i, b)| **b != pattern(seed, first_pos + off + *i as u64))
            .count() as u64;
        off += n as u64;
    }
    Ok(bad)
}

/// The p2p metadata store, authenticated with `TE_AUTH_KEY_FILE` when it is set (as the
/// engine's transports are).
async fn p2p_store(listen: std::net::SocketAddr) -> Result<Arc<P2pStore>, String> {
    let auth = te_core::auth::AuthKey::from_env(&te_core::config::ProcessEnv).map_err(|e| e.to_string())?;
    let config = P2pConfig {
        auth,
        ..P2pConfig::new(listen, Duration::from_secs(5))
    };
    Ok(Arc::new(P2pStore::start(config).await.map_err(|e| e.to_string())?))
}

async fn serve(args: &Args) -> Result<(), String> {
    let listen = args
        .listen
        .parse()
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    let store = p2p_store(listen).await?;
    let engine = engine(args, store.clone(), "target").await?;
    let buf = engine
        .allocate(args.total_bytes as usize, HostBufferOptions::default())
        .await
        .map_err(|e| format!("allocating the target buffer: {e}"))?;
    fill(&buf, args.target_seed)?;
    // The parent (or the operator) reads this line to find the target.
    println!("READY {}", store.local_addr());
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    if args.until_stdin_closes {
        tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin().read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                sink.clear();
            }
        })
        .await
        .map_err(|e| e.to_string())?;
    } else {
        std::future::pending::<()>().await;
    }
    drop(buf);
    engine.shutdown().await.map_err(|e| e.to_string())
}

/// The spawned target: killed when dropped.
struct Target {
    child: Child,
    addr: String,
}

impl Drop for Target {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        if self.child.wait().is_err() {
            let _ = self.child.kill();
        }
    }
}

fn spawn_target(args: &Args) -> Result<Target, String> {
    let exe = std::env::current_exe().map_err(|e| format!("locating te-bench: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.args(["transfer", "--serve", "--until-stdin-closes", "--listen", "127.0.0.1:0"])
        .args(["--transport", &args.transport])
        .args(["--total-bytes", &args.total_bytes.to_string()])
        .args(["--block-bytes", &args.block_bytes.to_string()])
        .args(["--lanes", &args.lanes.to_string()])
        .args(["--target-seed", &args.target_seed.to_string()])
        .env("TE_TCP_LISTEN", "127.0.0.1:0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if let Some(p) = &args.provider {
        cmd.args(["--provider", p]);
    }
    let mut child = cmd.spawn().map_err(|e| format!("starting the target process: {e}"))?;
    let stdout = child.stdout.take().ok_or("target has no stdout")?;
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| format!("reading the target's address: {e}"))?;
    let addr = line
        .trim()
        .strip_prefix("READY ")
        .ok_or_else(|| format!("the target process failed to start (said {line:?})"))?
        .to_string();
    Ok(Target { child, addr })
}

struct Measured {
    gbps_runs: Vec<f64>,
    /// With a baseline: the median over repetitions of ours / the baseline run right after it
    /// (pairs share the machine's state, so this drifts less on a loaded machine than the
    /// ratio of the two medians).
    ratio_paired: Option<f64>,
    requests_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    mismatched_bytes: Option<u64>,
    /// The first `open_segment`: the metadata fetch, then the transport's connection set-up
    /// (with `TE_AUTH_KEY_FILE` set, its authentication handshake).
    open_us: f64,
    /// `--also-baseline`'s runs, one after each of ours.
    also: Option<BaselineResult>,
}

/// The initiator's buffer of `--total-bytes`, registered with `engine`; filled for writes.
async fn local_buffer(args: &Args, engine: &TransferEngine) -> Result<Registration, String> {
    let local = engine
        .allocate(args.total_bytes as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    // Always written, not only for --verify: an untouched anonymous buffer reads as the kernel's
    // shared zero page, which is always cache-hot and would flatter every write.
    if args.op == TransferOp::Write {
        fill(&local, WRITE_SEED)?;
    }
    Ok(local)
}

/// `--total-bytes` in `--block-bytes` requests of `--op` between `local` and the remote buffer at
/// `remote_base`.
fn block_requests(args: &Args, local: &Registration, seg: SegmentId, remote_base: u64) -> Vec<TransferRequest> {
    let blocks = args.total_bytes / args.block_bytes;
    (0..blocks)
        .map(|i| {
            let off = i * args.block_bytes;
            let roff = cma::slot(i, blocks, args.scatter) * args.block_bytes;
            let (l, r) = (local.addr() + off, remote_base + roff);
            match args.op {
                TransferOp::Write => TransferRequest::write(l, seg, r, args.block_bytes),
                TransferOp::Read => TransferRequest::read(l, seg, r, args.block_bytes),
            }
        })
        .collect()
}

/// Mismatched bytes after `requests` ran through `engine`: a read's `local` against the target's
/// pattern (`--target-seed`, from position `--remote-offset` on); a write's target buffer, read
/// back into a second buffer, against `written_seed`, the pattern `local` held.
async fn verify_transfer(
    args: &Args,
    engine: &TransferEngine,
    local: &Registration,
    requests: &[TransferRequest],
    written_seed: u64,
) -> Result<u64, String> {
    Ok(match args.op {
        TransferOp::Read if args.scatter => {
            let blocks = args.total_bytes / args.block_bytes;
            let mut chunk = vec![0u8; args.block_bytes as usize];
            let mut bad = 0u64;
            for i in 0..blocks {
                local
                    .read_at(i * args.block_bytes, &mut chunk)
                    .map_err(|e| e.to_string())?;
                let first = args.remote_offset + cma::slot(i, blocks, true) * args.block_bytes;
                bad += chunk
                    .iter()
                    .enumerate()
                    .filter(|(j, b)| **b != pattern(args.target_seed, first + *j as u64))
                    .count() as u64;
            }
            bad
        }
        TransferOp::Read => mismatches(local, args.target_seed, args.remote_offset)?,
        TransferOp::Write => {
            // Read the target's buffer back into a second buffer and check it.
            let back = engine
                .allocate(args.total_bytes as usize, HostBufferOptions::default())
                .await
                .map_err(|e| e.to_string())?;
            let reads: Vec<TransferRequest> = requests
                .iter()
                .map(|r| {
                    TransferRequest::read(
                        back.addr() + (r.local_addr - local.addr()),
                        r.segment,
                        r.remote_addr,
                        r.len,
                    )
                })
                .collect();
            engine.transfer(&reads).await.map_err(|e| e.to_string())?;
            mismatches(&back, written_seed, 0)?
        }
    })
}

/// Checks one more untimed run of `requests` whose bytes nothing else could have put there:
/// `local` is first filled with pattern `seed`, which no earlier run wrote (a write must carry it
/// to the target; a read must overwrite it with the target's pattern). The timed runs cannot
/// show this themselves: the cma baseline copies the same bytes between the same buffers, and
/// an earlier run or block size leaves them in place.
async fn verify_fresh(args: &Args, s: &Session, requests: &[TransferRequest], seed: u64) -> Result<u64, String> {
    fill(&s.local, seed)?;
    s.engine.transfer(requests).await.map_err(|e| e.to_string())?;
    verify_transfer(args, &s.engine, &s.local, requests, seed).await
}

/// An initiator engine connected to the target, with its buffer: what every measured block size
/// shares.
struct Session {
    engine: TransferEngine,
    local: Registration,
    seg: SegmentId,
    remote_base: u64,
    /// The buffers and process of the cma baseline (loopback target only).
    cma_pair: Option<cma::CmaPair>,
    /// The memcpy baseline's second buffer (kept alive for `cma_pair.memcpy_dst`).
    _memcpy_dst: Option<Registration>,
    open_us: f64,
}

async fn connect(args: &Args, peer_addr: &str, target: Option<&Target>) -> Result<Session, String> {
    let store = p2p_store("127.0.0.1:0".parse().expect("valid address")).await?;
    let engine = engine(args, store, "initiator").await?;
    attach(args, engine, peer_addr, target).await
}

/// Opens the target at `peer_addr` through `engine` and gives the engine a buffer for it: the
/// session's range is `--total-bytes` from `--remote-offset` into the target's buffer.
async fn attach(
    args: &Args,
    engine: TransferEngine,
    peer_addr: &str,
    target: Option<&Target>,
) -> Result<Session, String> {
    let opened = Instant::now();
    let seg = engine
        .open_segment(peer_addr)
        .await
        .map_err(|e| format!("opening the target at {peer_addr}: {e}"))?;
    let open_us = opened.elapsed().as_secs_f64() * 1e6;
    let remote = seg
        .buffers()
        .first()
        .cloned()
        .ok_or_else(|| format!("the target at {peer_addr} exports no buffer"))?;
    if args
        .remote_offset
        .checked_add(args.total_bytes)
        .is_none_or(|end| remote.len < end)
    {
        return Err(format!(
            "the target exports {} bytes, fewer than --remote-offset {} + --total-bytes {}",
            remote.len, args.remote_offset, args.total_bytes
        ));
    }
    let local = local_buffer(args, &engine).await?;
    let memcpy_dst = if [args.baseline, args.also_baseline].contains(&Some(Baseline::Memcpy)) {
        let dst = engine
            .allocate(args.total_bytes as usize, HostBufferOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        // Touched, as the target's buffer is, so neither side copies into the zero page.
        fill(&dst, TARGET_SEED)?;
        Some(dst)
    } else {
        None
    };
    let cma_pair = target.map(|t| cma::CmaPair {
        pid: t.child.id(),
        local: local.addr(),
        remote: remote.base,
        memcpy_dst: memcpy_dst.as_ref().map_or(0, |d| d.addr()),
        scatter: args.scatter,
    });
    Ok(Session {
        engine,
        local,
        seg: seg.id(),
        remote_base: remote.base + args.remote_offset,
        cma_pair,
        _memcpy_dst: memcpy_dst,
        open_us,
    })
}

async fn measure(args: &Args) -> Result<(), String> {
    let local_only = [Some(Baseline::Cma), Some(Baseline::Memcpy)];
    if (local_only.contains(&args.baseline) || local_only.contains(&args.also_baseline)) && args.peer.is_some() {
        return Err(
            "--baseline cma/memcpy copy into the loopback target process or this one; they cannot be used with --peer"
                .into(),
        );
    }
    let (target, peer_addr) = match &args.peer {
        Some(p) => (None, p.clone()),
        None => {
            let t = spawn_target(args)?;
            let addr = t.addr.clone();
            (Some(t), addr)
        }
    };
    if args.metrics_ab {
        let out = metrics_ab::run(args, &peer_addr).await;
        drop(target);
        return out;
    }
    let session = connect(args, &peer_addr, target.as_ref()).await?;
    if let Some(sizes) = &args.block_sizes {
        let out = sweep::run(args, &peer_addr, &session, sizes).await;
        drop(session);
        drop(target);
        return out;
    }
    let (m, baseline) = measure_point(args, &session, WRITE_SEED + 1).await?;
    drop(session);
    drop(target);
    report(args, &peer_addr, &m, baseline.as_ref());
    if m.mismatched_bytes.unwrap_or(0) > 0 {
        return Err(format!("{} mismatched bytes", m.mismatched_bytes.unwrap_or(0)));
    }
    Ok(())
}

/// One block size (`args.block_bytes`): a warm-up, `--repeat` timed runs each followed by one
/// run of the baseline, the latency round trips, and with `--verify` a check of a fresh pattern
/// (`verify_seed`, see [`verify_fresh`]).
async fn measure_point(
    args: &Args,
    s: &Session,
    verify_seed: u64,
) -> Result<(Measured, Option<BaselineResult>), String> {
    let engine = &s.engine;
    let blocks = args.total_bytes / args.block_bytes;
    let requests = block_requests(args, &s.local, s.seg, s.remote_base);
    // Warm-up: connections, page faults.
    engine.transfer(&requests).await.map_err(|e| e.to_string())?;
    // Our runs and the baseline's alternate, so both see the same machine conditions.
    let mut times = Vec::with_capacity(args.repeat);
    let mut base_samples = Vec::new();
    let mut also_samples = Vec::new();
    for _ in 0..args.repeat {
        let t0 = Instant::now();
        for _ in 0..args.batches {
            engine.transfer(&requests).await.map_err(|e| e.to_string())?;
        }
        times.push(t0.elapsed());
        if let Some(b) = args.baseline {
            base_samples.push(run_baseline_once(b, args, s.cma_pair)?);
        }
        if let Some(b) = args.also_baseline {
            also_samples.push(run_baseline_once(b, args, s.cma_pair)?);
        }
    }
    let also = args
        .also_baseline
        .map(|b| BaselineResult::from_samples(b, args, also_samples));
    let per_run = args.total_bytes as f64 * args.batches as f64;
    let gbps_runs: Vec<f64> = times.iter().map(|t| per_run / t.as_secs_f64() / 1e9).collect();
    let ratio_paired = (!base_samples.is_empty()).then(|| {
        let pairs = gbps_runs.iter().zip(&base_samples);
        median_f64(pairs.map(|(ours, b)| ours / b.gbps()).collect())
    });
    let med = median(&mut times);
    let requests_per_s = (blocks * args.batches as u64) as f64 / med.as_secs_f64();

    let (p50_us, p99_us) = round_trips(args, engine, &requests).await?;

    let mismatched_bytes = if args.verify {
        Some(verify_fresh(args, s, &requests, verify_seed).await?)
    } else {
        None
    };
    let m = Measured {
        requests_per_s,
        p50_us,
        p99_us,
        mismatched_bytes,
        gbps_runs,
        ratio_paired,
        open_us: s.open_us,
        also,
    };
    let baseline = args
        .baseline
        .map(|b| BaselineResult::from_samples(b, args, base_samples));
    Ok((m, baseline))
}

/// Single-request round trips (`--latency-samples`, at most one per request of `requests`, in
/// turn): their p50 and p99 in microseconds.
async fn round_trips(args: &Args, engine: &TransferEngine, requests: &[TransferRequest]) -> Result<(f64, f64), String> {
    let samples = args.latency_samples.min(requests.len()).max(1);
    let mut lat = Vec::with_capacity(samples);
    for r in requests.iter().cycle().take(samples) {
        let t0 = Instant::now();
        engine
            .transfer(std::slice::from_ref(r))
            .await
            .map_err(|e| e.to_string())?;
        lat.push(t0.elapsed());
    }
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)].as_secs_f64() * 1e6;
    Ok((pct(0.50), pct(0.99)))
}

/// One measured block size as the JSON row `--json` prints (the sweep prints one per size).
fn row(args: &Args, peer: &str, m: &Measured, baseline: Option<&BaselineResult>) -> serde_json::Value {
    let gbps = median_f64(m.gbps_runs.clone());
    let mut v = serde_json::json!({
        "bench": "transfer",
        "transport": args.transport,
        "provider": args.provider,
        "op": args.op.to_string(),
        "block_bytes": args.block_bytes,
        "total_bytes": args.total_bytes,
        "lanes": args.lanes,
        "repeat": args.repeat,
        "batches": args.batches,
        "peer": if args.peer.is_some() { peer.to_string() } else { format!("loopback process at {peer}") },
        "gbps": gbps,
        "gbps_runs": m.gbps_runs,
        "requests_per_s": m.requests_per_s,
        "p50_us": m.p50_us,
        "p99_us": m.p99_us,
        "latency_samples": args.latency_samples.min((args.total_bytes / args.block_bytes) as usize).max(1),
        "verified": m.mismatched_bytes.is_some(),
        "mismatched_bytes": m.mismatched_bytes.unwrap_or(0),
        "open_us": m.open_us,
        "scatter": args.scatter,
        "authenticated": std::env::var_os(te_core::auth::KEY_FILE_VAR).is_some(),
    });
    if let Some(b) = baseline {
        v["baseline"] = serde_json::json!({
            "tool": b.tool,
            "command": b.command,
            "gbps": b.gbps,
            "gbps_runs": b.gbps_runs,
            "requests_per_s": b.requests_per_s,
            "latency_us": b.latency_us,
        });
        if let Some(bg) = b.gbps {
            v["ratio_gbps"] = serde_json::json!(gbps / bg);
        }
        if let Some(p) = m.ratio_paired {
            v["ratio_gbps_paired"] = serde_json::json!(p);
        }
        // Nanoseconds per request: ours from the median run, each baseline's from its GB/s.
        let ns = |g: f64| args.block_bytes as f64 / g;
        v["ns_per_request"] = serde_json::json!(ns(gbps));
        if let Some(bg) = b.gbps {
            v["baseline"]["ns_per_request"] = serde_json::json!(ns(bg));
        }
        if let Some(a) = &m.also {
            v["baseline_also"] = serde_json::json!({
                "tool": a.tool,
                "command": a.command,
                "gbps": a.gbps,
                "gbps_runs": a.gbps_runs,
                "ns_per_request": a.gbps.map(ns),
            });
            if let (Some(bg), Some(ag)) = (b.gbps, a.gbps) {
                let best = bg.max(ag);
                v["ratio_gbps_best"] = serde_json::json!(gbps / best);
                v["overhead_ns_per_request_vs_best"] = serde_json::json!(ns(gbps) - ns(best));
            }
        }
        if let Some(br) = b.requests_per_s {
            v["ratio_requests_per_s"] = serde_json::json!(m.requests_per_s / br);
        }
        if let Some(bl) = b.latency_us {
            v["ratio_p50_latency"] = serde_json::json!(m.p50_us / bl);
        }
    }
    v
}

/// Prints one measured block size: its JSON row, or two lines of text.
fn report(args: &Args, peer: &str, m: &Measured, baseline: Option<&BaselineResult>) {
    let v = row(args, peer, m, baseline);
    let gbps = median_f64(m.gbps_runs.clone());
    if args.json {
        print_json(&v);
        return;
    }
    println!(
        "{} {} {} B blocks x {} lanes: {:.3} GB/s (median of {}), {:.0} requests/s, latency p50 {:.1} us p99 {:.1} us{}",
        args.transport,
        args.op,
        args.block_bytes,
        args.lanes,
        gbps,
        args.repeat,
        m.requests_per_s,
        m.p50_us,
        m.p99_us,
        match m.mismatched_bytes {
            Some(n) => format!(", verify: {n} mismatched bytes"),
            None => String::new(),
        }
    );
    if let Some(b) = baseline {
        println!(
            "baseline {}: {} -> ratio {}",
            b.tool,
            [
                b.gbps.map(|g| format!("{g:.3} GB/s")),
                b.requests_per_s.map(|r| format!("{r:.0} requests/s")),
                b.latency_us.map(|l| format!("{l:.1} us")),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", "),
            [
                v.get("ratio_gbps")
                    .map(|r| format!("{:.2}x bandwidth", r.as_f64().unwrap_or(0.0))),
                v.get("ratio_gbps_paired")
                    .map(|r| format!("{:.2}x paired per run", r.as_f64().unwrap_or(0.0))),
                v.get("ratio_p50_latency")
                    .map(|r| format!("{:.2}x latency", r.as_f64().unwrap_or(0.0))),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", ")
        );
    }
    if let Some(a) = &m.also {
        println!(
            "also baseline {}: {} -> ours / the better baseline {}, {} ns per request more than it",
            a.tool,
            a.gbps.map_or_else(|| "-".into(), |g| format!("{g:.3} GB/s")),
            v.get("ratio_gbps_best")
                .map_or_else(|| "-".into(), |r| format!("{:.2}x", r.as_f64().unwrap_or(0.0))),
            v.get("overhead_ns_per_request_vs_best")
                .map_or_else(|| "-".into(), |r| format!("{:.0}", r.as_f64().unwrap_or(0.0))),
        );
    }
}
