//! The baselines `te-bench transfer --baseline` runs in the same invocation, moving the same
//! bytes with the same block size between the same two buffers or over the same loopback:
//! iperf3, ucx_perftest, fi_pingpong and a process_vm_writev/readv copy.

use std::process::{Command, Stdio};
use std::time::Duration;

use te_core::TransferOp;
use te_testkit::free_port;

use super::cma;
use super::Args;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Baseline {
    /// iperf3 over loopback with as many streams as lanes (`-P`).
    Iperf3,
    /// ucx_perftest -t ucp_put_bw with UCX_TLS=tcp, same block size.
    Ucx,
    /// fi_pingpong on provider tcp (rdm endpoints), same block size: latency and rate.
    FiPingpong,
    /// process_vm_writev/readv of the same bytes between the same two buffers (loopback target,
    /// Linux): the single copy a shared-memory provider makes.
    Cma,
    /// A memcpy loop of the same blocks between the initiator's buffer and a second buffer in
    /// its own process: what a transport that maps the peer's memory could at best reach.
    Memcpy,
}

pub(super) struct BaselineResult {
    pub tool: &'static str,
    pub command: String,
    pub gbps: Option<f64>,
    /// Every run's GB/s, in the order they ran (each right after one of ours).
    pub gbps_runs: Vec<f64>,
    pub requests_per_s: Option<f64>,
    pub latency_us: Option<f64>,
}

pub(super) fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs a server command and a client command against it; retries the client while the server
/// is still starting. Returns the client's stdout.
fn server_client(server: &mut Command, client: &mut Command, ok: fn(&str) -> bool) -> Result<String, String> {
    let mut srv = server
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {server:?}: {e}"))?;
    let mut last = String::new();
    for _ in 0..50 {
        let out = client.output().map_err(|e| format!("running {client:?}: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && ok(&stdout) {
            let _ = srv.kill();
            let _ = srv.wait();
            return Ok(stdout);
        }
        last = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = srv.kill();
    let _ = srv.wait();
    Err(format!("{client:?} kept failing: {last}"))
}

/// One run of the baseline tool.
pub(super) struct BaselineSample {
    gbps: f64,
    requests_per_s: Option<f64>,
    latency_us: Option<f64>,
}

impl BaselineSample {
    pub(super) fn gbps(&self) -> f64 {
        self.gbps
    }
}

impl BaselineResult {
    pub(super) fn from_samples(b: Baseline, args: &Args, samples: Vec<BaselineSample>) -> BaselineResult {
        let (tool, command) = baseline_command(b, args);
        let opt_median = |v: Vec<Option<f64>>| -> Option<f64> {
            let v: Vec<f64> = v.into_iter().flatten().collect();
            (!v.is_empty()).then(|| median_f64(v))
        };
        BaselineResult {
            tool,
            command,
            gbps: Some(median_f64(samples.iter().map(|s| s.gbps).collect())),
            gbps_runs: samples.iter().map(|s| s.gbps).collect(),
            requests_per_s: opt_median(samples.iter().map(|s| s.requests_per_s).collect()),
            latency_us: opt_median(samples.iter().map(|s| s.latency_us).collect()),
        }
    }
}

/// ucx_perftest's iteration count: at least 2,000 so its connection set-up and warm-up do not
/// dominate (at 100 x 1 MiB it reports about a fifth of its steady rate here, which would
/// flatter us).
fn ucx_iterations(args: &Args) -> u64 {
    (args.total_bytes / args.block_bytes).max(2000)
}

/// The bytes iperf3 sends: what one of our timed runs moves (`--batches` times `--total-bytes`),
/// so both sides stream the same amount.
fn iperf3_bytes(args: &Args) -> u64 {
    args.total_bytes * u64::from(args.batches)
}

/// The provider fi_pingpong runs on: the core of `--provider` (`tcp;ofi_rxm` -> `tcp`, `shm`),
/// tcp when none is given, so the baseline is libfabric's own figure for the same provider.
fn pingpong_provider(args: &Args) -> &str {
    match args.provider.as_deref() {
        Some(p) => p.split(';').next().unwrap_or(p),
        None => "tcp",
    }
}

fn baseline_command(b: Baseline, args: &Args) -> (&'static str, String) {
    let size = args.block_bytes;
    match b {
        Baseline::Iperf3 => (
            "iperf3",
            format!(
                "iperf3 -c 127.0.0.1 -n {} -l {} -J -P {}",
                iperf3_bytes(args),
                args.block_bytes,
                args.lanes
            ),
        ),
        Baseline::Ucx => (
            "ucx_perftest ucp_put_bw (UCX_TLS=tcp)",
            format!(
                "UCX_TLS=tcp ucx_perftest 127.0.0.1 -t ucp_put_bw -s {size} -n {}",
                ucx_iterations(args)
            ),
        ),
        Baseline::Cma => (
            "kernel cross-memory copy",
            format!(
                "process_vm_{}v of the same {} bytes in {size} B calls, {} time(s)",
                if args.op == TransferOp::Write { "write" } else { "read" },
                args.total_bytes,
                args.batches
            ),
        ),
        Baseline::Memcpy => (
            "memcpy loop",
            format!(
                "memcpy of the same {} bytes in {size} B pieces between two buffers of this process, {} time(s)",
                args.total_bytes, args.batches
            ),
        ),
        Baseline::FiPingpong => (
            "fi_pingpong (rdm)",
            format!(
                "fi_pingpong -p {} -e rdm -S {size} -I {} 127.0.0.1",
                pingpong_provider(args),
                args.latency_samples.max(100)
            ),
        ),
    }
}

/// Runs the baseline once: a tool's server and client on loopback, or (`cma`) the kernel's copy
/// between the measured buffers.
pub(super) fn run_baseline_once(
    b: Baseline,
    args: &Args,
    cma_pair: Option<cma::CmaPair>,
) -> Result<BaselineSample, String> {
    let size = args.block_bytes.to_string();
    // Only the tools' servers need a port; the copy baselines run without one.
    let port = || free_port().map(|p| p.to_string());
    match b {
        Baseline::Cma => {
            let pair = cma_pair.ok_or("--baseline cma needs the loopback target process")?;
            Ok(BaselineSample {
                gbps: cma::run(pair, args.op, args.block_bytes, args.total_bytes, args.batches)?,
                requests_per_s: None,
                latency_us: None,
            })
        }
        Baseline::Memcpy => {
            let pair = cma_pair.ok_or("--baseline memcpy needs the loopback target process")?;
            Ok(BaselineSample {
                gbps: cma::memcpy_run(pair, args.op, args.block_bytes, args.total_bytes, args.batches)?,
                requests_per_s: None,
                latency_us: None,
            })
        }
        Baseline::Iperf3 => {
            let port = port()?;
            let mut srv = Command::new("iperf3");
            srv.args(["-s", "-1", "-B", "127.0.0.1", "-p", &port]);
            let mut cli = Command::new("iperf3");
            let total = iperf3_bytes(args).to_string();
            // `-l`: iperf3 writes in blocks of our block size, not its default 128 KiB, so both
            // sides move the same bytes in the same write size.
            let block = args.block_bytes.to_string();
            cli.args([
                "-c",
                "127.0.0.1",
                "-p",
                &port,
                "-n",
                &total,
                "-l",
                &block,
                "-J",
                "-P",
                &args.lanes.to_string(),
            ]);
            // iperf3 -J exits 0 even when it could not connect yet; its JSON then has "error".
            let out = server_client(&mut srv, &mut cli, |o| !o.contains("\"error\""))?;
            let v: serde_json::Value = serde_json::from_str(&out).map_err(|e| format!("iperf3 JSON: {e}"))?;
            let bps = v["end"]["sum_received"]["bits_per_second"]
                .as_f64()
                .ok_or_else(|| format!("iperf3 reported no end.sum_received.bits_per_second: {}", v["error"]))?;
            Ok(BaselineSample {
                gbps: bps / 8e9,
                requests_per_s: None,
                latency_us: None,
            })
        }
        Baseline::Ucx => {
            let iters = ucx_iterations(args).to_string();
            let port = port()?;
            let mut srv = Command::new("ucx_perftest");
            srv.env("UCX_TLS", "tcp").args(["-p", &port]);
            let mut cli = Command::new("ucx_perftest");
            cli.env("UCX_TLS", "tcp")
                .args(["127.0.0.1", "-p", &port, "-t", "ucp_put_bw", "-s", &size, "-n", &iters]);
            let out = server_client(&mut srv, &mut cli, |_| true)?;
            // "Final: iters 50%ile avg overall bw_avg(MB/s) bw_overall msgrate_avg msgrate_overall"
            let f: Vec<f64> = out
                .lines()
                .find(|l| l.trim_start().starts_with("Final:"))
                .ok_or("ucx_perftest printed no Final line")?
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            if f.len() < 8 {
                return Err(format!("unexpected ucx_perftest Final line: {f:?}"));
            }
            Ok(BaselineSample {
                gbps: f[5] * 1_048_576.0 / 1e9,
                requests_per_s: Some(f[7]),
                latency_us: None,
            })
        }
        Baseline::FiPingpong => {
            let iters = args.latency_samples.max(100).to_string();
            let port = port()?;
            let mut srv = Command::new("fi_pingpong");
            let provider = pingpong_provider(args);
            srv.args(["-p", provider, "-e", "rdm", "-B", &port, "-S", &size, "-I", &iters]);
            let mut cli = Command::new("fi_pingpong");
            cli.args([
                "-p",
                provider,
                "-e",
                "rdm",
                "-P",
                &port,
                "-S",
                &size,
                "-I",
                &iters,
                "127.0.0.1",
            ]);
            let out = server_client(&mut srv, &mut cli, |_| true)?;
            // "bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec"
            let line = out
                .lines()
                .rev()
                .find(|l| l.split_whitespace().count() >= 8 && !l.starts_with("bytes"))
                .ok_or("fi_pingpong printed no result line")?;
            let cols: Vec<&str> = line.split_whitespace().collect();
            let mbps: f64 = cols[5].parse().map_err(|_| format!("fi_pingpong line {line:?}"))?;
            let usec: f64 = cols[6].parse().map_err(|_| format!("fi_pingpong line {line:?}"))?;
            Ok(BaselineSample {
                gbps: mbps * 1e6 / 1e9,
                requests_per_s: Some(1e6 / usec),
                latency_us: Some(usec),
            })
        }
    }
}
