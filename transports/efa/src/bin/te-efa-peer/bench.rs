//! `te-efa-peer bench`: write (or read) bandwidth of the efa transport between two processes on
//! this host, with same-run baselines from libfabric's `fi_pingpong` and UCX's `ucx_perftest`.
//!
//! The target is this binary's `serve` mode, started as a child. Each run moves `--total` bytes
//! in `--block`-byte requests as one batch and is verified byte for byte by the target afterwards
//! (writes) or locally (reads). Runs of ours and of the baselines alternate so they share the
//! machine's noise; medians are reported, one JSON object per line.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use te_base::TransferOp;

use crate::client::Client;

struct Options {
    provider: String,
    total: u64,
    block: u64,
    runs: usize,
    op: TransferOp,
    baselines: bool,
}

fn parse(args: &[&str]) -> Result<Options, String> {
    let mut o = Options {
        provider: "tcp;ofi_rxm".into(),
        total: 64 << 20,
        block: 1 << 20,
        runs: 5,
        op: TransferOp::Write,
        baselines: true,
    };
    let mut it = args.iter();
    while let Some(&a) = it.next() {
        let mut val = || it.next().copied().ok_or(format!("{a} needs a value"));
        match a {
            "--provider" => o.provider = val()?.to_string(),
            "--total" => o.total = te_base::config::parse_byte_size(val()?)?,
            "--block" => o.block = te_base::config::parse_byte_size(val()?)?,
            "--runs" => o.runs = val()?.parse().map_err(|e| format!("--runs: {e}"))?,
            "--op" => o.op = val()?.parse()?,
            "--no-baselines" => o.baselines = false,
            _ => return Err(format!("unknown option {a:?}")),
        }
    }
    if o.total == 0 || o.block == 0 || o.runs == 0 {
        return Err("--total, --block and --runs must be positive".into());
    }
    Ok(o)
}

/// The target child and its command pipes.
struct Target {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Target {
    fn start(provider: &str, bytes: u64) -> Result<(Target, String), String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["serve", &bytes.to_string(), "1"])
            .env("TE_FABRIC_PROVIDER", provider)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the target: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line).map_err(|e| e.to_string())?;
        if line.trim().is_empty() {
            return Err("the target exited before publishing its descriptor".into());
        }
        Ok((Target { child, stdin, stdout }, line))
    }

    fn ask(&mut self, command: &str) -> Result<String, String> {
        writeln!(self.stdin, "{command}").map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        let mut line = String::new();
        self.stdout.read_line(&mut line).map_err(|e| e.to_string())?;
        Ok(line.trim().to_string())
    }

    fn mismatched(&mut self, total: u64, seed: u64) -> Result<u64, String> {
        let reply = self.ask(&format!("check 0 {total} {seed}"))?;
        reply
            .strip_prefix("mismatched ")
            .and_then(|n| n.parse().ok())
            .ok_or(format!("unexpected target reply {reply:?}"))
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "exit");
        let _ = self.child.wait();
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs a server and a client of an external tool; returns the client's stdout.
fn server_client(server: &mut Command, client: &mut Command) -> Result<String, String> {
    let mut srv = server
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{server:?}: {e}"))?;
    // The server needs a moment to listen; retry the client a few times instead of guessing.
    let mut last = String::new();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(200));
        let out = client.output().map_err(|e| format!("{client:?}: {e}"))?;
        if out.status.success() {
            let _ = srv.wait();
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        last = String::from_utf8_lossy(&out.stderr).into_owned();
    }
    let _ = srv.kill();
    let _ = srv.wait();
    Err(format!("{client:?} failed: {last}"))
}

/// `fi_pingpong -p P -e rdm -S block`: libfabric's own figure, bytes per second.
fn fi_pingpong(provider: &str, block: u64) -> Result<f64, String> {
    let core = provider.split(';').next().unwrap_or(provider);
    let args = ["-p", core, "-e", "rdm", "-S", &block.to_string(), "-I", "100"];
    let out = server_client(
        Command::new("fi_pingpong").args(args),
        Command::new("fi_pingpong").args(args).arg("127.0.0.1"),
    )?;
    // Data line: bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
    let line = out
        .lines()
        .find(|l| l.split_whitespace().count() == 8 && !l.starts_with("bytes"))
        .ok_or(format!("no result line in fi_pingpong output {out:?}"))?;
    let mbps: f64 = line
        .split_whitespace()
        .nth(5)
        .and_then(|v| v.parse().ok())
        .ok_or("bad MB/sec")?;
    Ok(mbps * 1e6)
}

/// `ucx_perftest -t ucp_put_bw -s block` over UCX_TLS=tcp, bytes per second.
fn ucx_put_bw(block: u64) -> Result<f64, String> {
    let out = server_client(
        Command::new("ucx_perftest").env("UCX_TLS", "tcp"),
        Command::new("ucx_perftest").env("UCX_TLS", "tcp").args([
            "127.0.0.1",
            "-t",
            "ucp_put_bw",
            "-s",
            &block.to_string(),
            "-n",
            "1000",
        ]),
    )?;
    // Final: iters typ_lat avg_lat overall_lat avg_bw overall_bw avg_rate overall_rate (MB/s = MiB/s)
    let line = out
        .lines()
        .find(|l| l.starts_with("Final:"))
        .ok_or(format!("no Final line in ucx_perftest output {out:?}"))?;
    let mibps: f64 = line
        .split_whitespace()
        .nth(6)
        .and_then(|v| v.parse().ok())
        .ok_or("bad bandwidth")?;
    Ok(mibps * (1u64 << 20) as f64)
}

/// Runs the benchmark.
pub fn run(args: &[&str]) -> Result<(), String> {
    let o = parse(args)?;
    // The client reads its provider from the process environment, like the engine does.
    std::env::set_var("TE_FABRIC_PROVIDER", &o.provider);
    let (mut target, descriptor) = Target::start(&o.provider, o.total)?;
    let client = Client::connect(&descriptor, o.total as usize)?;
    // Warm-up pass (connection setup, page faults).
    client.fill(0);
    client.transfer(o.op, o.block, o.total)?;
    let (mut ours, mut pingpong, mut ucx) = (Vec::new(), Vec::new(), Vec::new());
    let mut mismatched = 0u64;
    for run in 0..o.runs {
        let seed = 100 + run as u64;
        let elapsed = match o.op {
            TransferOp::Write => {
                client.fill(seed);
                let t = client.transfer(o.op, o.block, o.total)?;
                mismatched += target.mismatched(o.total, seed)?;
                t
            }
            TransferOp::Read => {
                target.ask(&format!("fill {seed}"))?;
                client.zero_local();
                let t = client.transfer(o.op, o.block, o.total)?;
                mismatched += client.mismatches(seed, o.total as usize);
                t
            }
        };
        ours.push(o.total as f64 / elapsed.as_secs_f64());
        if o.baselines {
            match fi_pingpong(&o.provider, o.block) {
                Ok(v) => pingpong.push(v),
                Err(e) => eprintln!("fi_pingpong baseline failed: {e}"),
            }
            if o.provider.starts_with("tcp") {
                match ucx_put_bw(o.block) {
                    Ok(v) => ucx.push(v),
                    Err(e) => eprintln!("ucx_perftest baseline failed: {e}"),
                }
            }
        }
    }
    client.close();
    drop(target);
    let gbps = median(&mut ours) / 1e9;
    let opt = |v: &mut Vec<f64>| (!v.is_empty()).then(|| median(v) / 1e9);
    let pp = opt(&mut pingpong);
    let ux = opt(&mut ucx);
    let line = serde_json::json!({
        "transport": "efa",
        "provider": o.provider,
        "op": o.op.to_string(),
        "block_bytes": o.block,
        "total_bytes": o.total,
        "runs": o.runs,
        "gbps": gbps,
        "fi_pingpong_gbps": pp,
        "ucx_tcp_put_bw_gbps": ux,
        "ratio_vs_fi_pingpong": pp.map(|b| gbps / b),
        "ratio_vs_ucx_tcp": ux.map(|b| gbps / b),
        "mismatched_bytes": mismatched,
    });
    println!("{line}");
    if mismatched != 0 {
        return Err(format!("{mismatched} mismatched bytes"));
    }
    Ok(())
}
