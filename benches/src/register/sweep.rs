//! The parent side: starts the rank processes of one cell, releases them together, and collects
//! what each measured. The cell's time is the slowest rank's, since nothing serves until every
//! rank has registered.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use super::spec::{RankResult, RankSpec};

struct RankProcess {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl RankProcess {
    fn start(exe: &Path, spec: &RankSpec) -> Result<Self, String> {
        let mut child = Command::new(exe)
            .args(["register", "--rank-worker"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting rank {}: {e}", spec.rank))?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(format!("rank {}: no pipes", spec.rank));
        };
        let line = serde_json::to_string(spec).map_err(|e| e.to_string())?;
        writeln!(stdin, "{line}").map_err(|e| format!("rank {}: sending the spec: {e}", spec.rank))?;
        Ok(RankProcess {
            child,
            stdin,
            stdout: BufReader::new(stdout),
        })
    }

    fn read_line(&mut self, what: &str) -> Result<String, String> {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(self.failure(what));
        }
        Ok(line.trim().to_string())
    }

    /// What went wrong with a rank that stopped talking: its exit status and stderr.
    fn failure(&mut self, what: &str) -> String {
        let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        format!("rank exited ({status}) before {what}: {}", err.trim())
    }
}

impl Drop for RankProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Runs one cell: every rank set up, then released at once. Returns each rank's result.
pub fn run_cell(exe: &Path, specs: &[RankSpec]) -> Result<Vec<RankResult>, String> {
    let mut ranks = specs
        .iter()
        .map(|s| RankProcess::start(exe, s))
        .collect::<Result<Vec<_>, _>>()?;
    for r in &mut ranks {
        let line = r.read_line("getting ready")?;
        if line != "ready" {
            return Err(format!("rank said {line:?} instead of ready"));
        }
    }
    for r in &mut ranks {
        writeln!(r.stdin, "go")
            .and_then(|_| r.stdin.flush())
            .map_err(|e| format!("releasing a rank: {e}"))?;
    }
    let mut results = Vec::with_capacity(ranks.len());
    for r in &mut ranks {
        let line = r.read_line("reporting")?;
        let result: RankResult = serde_json::from_str(&line).map_err(|e| format!("bad rank result {line:?}: {e}"))?;
        let status = r.child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(r.failure("exiting cleanly"));
        }
        results.push(result);
    }
    Ok(results)
}
