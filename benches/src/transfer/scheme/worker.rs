//! One initiator process of a `--scheme` run, and this process's handle on it.
//!
//! The parent starts `te-bench transfer --scheme-worker --peer ADDR ...`. The worker connects,
//! warms up and says `ready`. Then, `--repeat` times and once more for the latency round trips,
//! it waits for `go`, does the phase and answers `done`. At the last `go` it verifies (with
//! `--verify`), prints its [`PeerResult`] as one JSON line and exits. A standard input that
//! closes before a `go` (the parent died or gave up) ends it with an error.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use super::summary::{mono_ns, PeerResult, PeerRun};
use super::{write_seed, Plan};
use crate::transfer::{block_requests, connect, round_trips, verify_fresh, Args};

fn say(line: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|_| out.flush())
        .map_err(|e| format!("initiator: telling the parent {line:?}: {e}"))
}

fn wait_go() -> Result<(), String> {
    let mut line = String::new();
    match std::io::stdin().read_line(&mut line) {
        Ok(0) => Err("initiator: the parent went away (standard input closed)".into()),
        Ok(_) if line.trim() == "go" => Ok(()),
        Ok(_) => Err(format!("initiator: expected go, got {line:?}")),
        Err(e) => Err(format!("initiator: waiting for go: {e}")),
    }
}

/// The worker process (`--scheme-worker`): `--peer` is its target, `--remote-offset` its range
/// there, `--peer-index` its place among the peers.
pub async fn run(args: &Args) -> Result<(), String> {
    let addr = args.peer.as_deref().ok_or("--scheme-worker needs --peer")?;
    let s = connect(args, addr, None).await?;
    let requests = block_requests(args, &s.local, s.seg, s.remote_base);
    // Warm-up: connections, page faults.
    s.engine.transfer(&requests).await.map_err(|e| e.to_string())?;
    say("ready")?;
    let mut runs = Vec::with_capacity(args.repeat);
    for _ in 0..args.repeat {
        wait_go()?;
        let start_ns = mono_ns();
        for _ in 0..args.batches {
            s.engine.transfer(&requests).await.map_err(|e| e.to_string())?;
        }
        runs.push(PeerRun {
            start_ns,
            end_ns: mono_ns(),
        });
        say("done")?;
    }
    wait_go()?;
    let (p50_us, p99_us) = round_trips(args, &s.engine, &requests).await?;
    say("done")?;
    wait_go()?;
    let mismatched_bytes = if args.verify {
        Some(verify_fresh(args, &s, &requests, write_seed(args.peer_index)).await?)
    } else {
        None
    };
    let result = PeerResult {
        peer: args.peer_index,
        pid: std::process::id(),
        target: addr.to_string(),
        remote_offset: args.remote_offset,
        bytes_per_run: args.total_bytes * u64::from(args.batches),
        runs,
        p50_us,
        p99_us,
        mismatched_bytes,
        open_us: s.open_us,
    };
    say(&serde_json::to_string(&result).map_err(|e| e.to_string())?)?;
    let engine = s.engine.clone();
    drop(s);
    engine.shutdown().await.map_err(|e| e.to_string())
}

/// A started worker process.
struct Worker {
    peer: u64,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    fn spawn(args: &Args, plan: &Plan) -> Result<Worker, String> {
        let a = plan.args(args);
        let exe = std::env::current_exe().map_err(|e| format!("locating te-bench: {e}"))?;
        let mut cmd = Command::new(exe);
        cmd.args(["transfer", "--scheme-worker", "--peer", &plan.addr])
            .args(["--peer-index", &a.peer_index.to_string()])
            .args(["--remote-offset", &a.remote_offset.to_string()])
            .args(["--target-seed", &a.target_seed.to_string()])
            .args(["--transport", &a.transport])
            .args(["--op", &a.op.to_string()])
            .args(["--block-bytes", &a.block_bytes.to_string()])
            .args(["--total-bytes", &a.total_bytes.to_string()])
            .args(["--lanes", &a.lanes.to_string()])
            .args(["--repeat", &a.repeat.to_string()])
            .args(["--batches", &a.batches.to_string()])
            .args(["--latency-samples", &a.latency_samples.to_string()])
            .env("TE_TCP_LISTEN", "127.0.0.1:0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(p) = &a.provider {
            cmd.args(["--provider", p]);
        }
        if a.verify {
            cmd.arg("--verify");
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting initiator {}: {e}", plan.peer))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().map(BufReader::new);
        match stdout {
            Some(stdout) => Ok(Worker {
                peer: plan.peer,
                child,
                stdin,
                stdout,
            }),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("initiator {} has no stdout", plan.peer))
            }
        }
    }

    fn line(&mut self, awaited: &str) -> Result<String, String> {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(0) => Err(format!(
                "initiator {} ended before its {awaited} (its error is above)",
                self.peer
            )),
            Ok(_) => Ok(line.trim().to_string()),
            Err(e) => Err(format!("reading initiator {}'s {awaited}: {e}", self.peer)),
        }
    }

    fn expect(&mut self, word: &str) -> Result<(), String> {
        match self.line(word)? {
            l if l == word => Ok(()),
            l => Err(format!("initiator {} said {l:?}, expected {word}", self.peer)),
        }
    }

    fn go(&mut self) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("initiator stdin closed")?;
        writeln!(stdin, "go")
            .and_then(|_| stdin.flush())
            .map_err(|e| format!("telling initiator {} go: {e}", self.peer))
    }

    fn result(&mut self) -> Result<PeerResult, String> {
        let line = self.line("result")?;
        serde_json::from_str(&line).map_err(|e| format!("initiator {}'s result {line:?}: {e}", self.peer))
    }
}

impl Drop for Worker {
    /// Closes its standard input: a worker that finished has exited or is exiting; one still
    /// waiting for `go` exits on it.
    fn drop(&mut self) {
        drop(self.stdin.take());
        if self.child.wait().is_err() {
            let _ = self.child.kill();
        }
    }
}

/// Starts one worker per plan, runs the phases in lock step and gathers their results (in plan
/// order). On any failure the workers are killed.
pub(super) fn drive(args: &Args, plans: &[Plan]) -> Result<Vec<PeerResult>, String> {
    let mut workers = Vec::with_capacity(plans.len());
    for p in plans {
        workers.push(Worker::spawn(args, p)?);
    }
    let out = phases(args, &mut workers);
    if out.is_err() {
        for w in &mut workers {
            let _ = w.child.kill();
        }
    }
    out
}

fn phases(args: &Args, workers: &mut [Worker]) -> Result<Vec<PeerResult>, String> {
    for w in workers.iter_mut() {
        w.expect("ready")?;
    }
    // The repetitions, then the latency round trips: all start together, and the next phase
    // waits for every worker.
    for _ in 0..=args.repeat {
        for w in workers.iter_mut() {
            w.go()?;
        }
        for w in workers.iter_mut() {
            w.expect("done")?;
        }
    }
    for w in workers.iter_mut() {
        w.go()?;
    }
    workers.iter_mut().map(Worker::result).collect()
}
