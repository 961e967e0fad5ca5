//! What every peer of a `--scheme` run reports, and what the run reports from them: per-peer and
//! aggregate GB/s, Jain's fairness index, latency, verification; as text or one JSON row.

use serde::{Deserialize, Serialize};

use super::super::median_f64;
use super::{Args, Scheme};
use crate::util::print_json;

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process on the host (and every network
/// namespace), so peers' starts and ends compare.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    debug_assert_eq!(rc, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One timed repetition of one peer.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct PeerRun {
    pub start_ns: u64,
    pub end_ns: u64,
}

impl PeerRun {
    fn elapsed_s(&self) -> f64 {
        self.end_ns.saturating_sub(self.start_ns).max(1) as f64 / 1e9
    }
}

/// One peer's measurements (an initiator process sends it as one JSON line).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerResult {
    pub peer: u64,
    /// The initiator's process.
    pub pid: u32,
    /// The target's metadata address.
    pub target: String,
    pub remote_offset: u64,
    /// Bytes the peer moves in each repetition.
    pub bytes_per_run: u64,
    pub runs: Vec<PeerRun>,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mismatched_bytes: Option<u64>,
    pub open_us: f64,
}

/// Jain's fairness index of `x`: (sum x)^2 / (n sum x^2); 1 when all are equal, 1/n when one
/// gets everything. NaN for an empty or all-zero `x`.
pub fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    sum * sum / (x.len() as f64 * squares)
}

/// The run, computed from its peers.
pub struct Summary {
    peers: Vec<PeerResult>,
    /// Per peer, per repetition: its bytes over its own elapsed time.
    peer_gbps_runs: Vec<Vec<f64>>,
    /// Per peer: the median of its runs.
    peer_gbps: Vec<f64>,
    /// Per repetition: first start to last end over all peers.
    wall_s_runs: Vec<f64>,
    /// Per repetition: all peers' bytes over that span.
    aggregate_gbps_runs: Vec<f64>,
    /// Per repetition: the last peer's start after the first's (how well the barrier held).
    start_spread_us_runs: Vec<f64>,
}

impl Summary {
    pub fn new(peers: &[PeerResult]) -> Result<Summary, String> {
        let repeat = peers.first().map(|p| p.runs.len()).ok_or("no peer reported")?;
        if repeat == 0 || peers.iter().any(|p| p.runs.len() != repeat) {
            return Err("the peers reported different numbers of repetitions".into());
        }
        let peer_gbps_runs: Vec<Vec<f64>> = peers
            .iter()
            .map(|p| {
                p.runs
                    .iter()
                    .map(|r| p.bytes_per_run as f64 / r.elapsed_s() / 1e9)
                    .collect()
            })
            .collect();
        let peer_gbps = peer_gbps_runs.iter().map(|r| median_f64(r.clone())).collect();
        let total: u64 = peers.iter().map(|p| p.bytes_per_run).sum();
        let wall_s_runs: Vec<f64> = (0..repeat)
            .map(|i| {
                let start = peers.iter().map(|p| p.runs[i].start_ns).min().unwrap_or(0);
                let end = peers.iter().map(|p| p.runs[i].end_ns).max().unwrap_or(0);
                PeerRun {
                    start_ns: start,
                    end_ns: end,
                }
                .elapsed_s()
            })
            .collect();
        let aggregate_gbps_runs = wall_s_runs.iter().map(|w| total as f64 / w / 1e9).collect();
        let start_spread_us_runs = (0..repeat)
            .map(|i| {
                let starts = peers.iter().map(|p| p.runs[i].start_ns);
                let spread = starts.clone().max().unwrap_or(0) - starts.min().unwrap_or(0);
                spread as f64 / 1e3
            })
            .collect();
        Ok(Summary {
            peers: peers.to_vec(),
            peer_gbps_runs,
            peer_gbps,
            wall_s_runs,
            aggregate_gbps_runs,
            start_spread_us_runs,
        })
    }

    pub fn aggregate_gbps(&self) -> f64 {
        median_f64(self.aggregate_gbps_runs.clone())
    }

    pub fn jain(&self) -> f64 {
        jain(&self.peer_gbps)
    }

    fn min_max(&self) -> (f64, f64) {
        let min = self.peer_gbps.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self.peer_gbps.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (min, max)
    }

    /// Summed over the peers; None without `--verify`.
    pub fn mismatched_bytes(&self) -> Option<u64> {
        self.peers.iter().map(|p| p.mismatched_bytes).sum::<Option<u64>>()
    }

    /// The `--json` row.
    pub fn row(&self, args: &Args, scheme: Scheme) -> serde_json::Value {
        let (initiators, targets) = scheme.processes(self.peers.len());
        let (min, max) = self.min_max();
        let per_peer: Vec<serde_json::Value> = self
            .peers
            .iter()
            .zip(self.peer_gbps.iter().zip(&self.peer_gbps_runs))
            .map(|(p, (gbps, runs))| {
                serde_json::json!({
                    "peer": p.peer,
                    "pid": p.pid,
                    "target": p.target,
                    "remote_offset": p.remote_offset,
                    "bytes_per_run": p.bytes_per_run,
                    "gbps": gbps,
                    "gbps_runs": runs,
                    "elapsed_s_runs": p.runs.iter().map(PeerRun::elapsed_s).collect::<Vec<_>>(),
                    "p50_us": p.p50_us,
                    "p99_us": p.p99_us,
                    "mismatched_bytes": p.mismatched_bytes.unwrap_or(0),
                    "open_us": p.open_us,
                })
            })
            .collect();
        serde_json::json!({
            "bench": "transfer-scheme",
            "scheme": scheme.name(),
            "peers": self.peers.len(),
            "initiator_processes": initiators,
            "target_processes": targets,
            "transport": args.transport,
            "provider": args.provider,
            "op": args.op.to_string(),
            "block_bytes": args.block_bytes,
            "total_bytes": args.total_bytes,
            "lanes": args.lanes,
            "repeat": args.repeat,
            "batches": args.batches,
            "bytes_per_run": self.peers.iter().map(|p| p.bytes_per_run).sum::<u64>(),
            "aggregate_gbps": self.aggregate_gbps(),
            "aggregate_gbps_runs": self.aggregate_gbps_runs,
            "wall_s_runs": self.wall_s_runs,
            "start_spread_us_runs": self.start_spread_us_runs,
            "per_peer_gbps_min": min,
            "per_peer_gbps_max": max,
            "jain_index": self.jain(),
            "latency": "concurrent",
            "latency_samples": args.latency_samples.min((args.total_bytes / args.block_bytes) as usize).max(1),
            "verified": self.mismatched_bytes().is_some(),
            "mismatched_bytes": self.mismatched_bytes().unwrap_or(0),
            "per_peer": per_peer,
        })
    }

    /// Prints the run: its JSON row, or a line per peer and a summary line.
    pub fn report(&self, args: &Args, scheme: Scheme) {
        if args.json {
            print_json(&self.row(args, scheme));
            return;
        }
        let (initiators, targets) = scheme.processes(self.peers.len());
        println!(
            "{} {} {} x {} peers ({initiators} initiator, {targets} target processes), {} B blocks, {} B per peer per run:",
            scheme.name(),
            args.transport,
            args.op,
            self.peers.len(),
            args.block_bytes,
            args.total_bytes * u64::from(args.batches),
        );
        for (p, gbps) in self.peers.iter().zip(&self.peer_gbps) {
            println!(
                "  peer {} (pid {}, target {} at {}): {gbps:.3} GB/s, latency p50 {:.1} us p99 {:.1} us{}",
                p.peer,
                p.pid,
                p.target,
                p.remote_offset,
                p.p50_us,
                p.p99_us,
                match p.mismatched_bytes {
                    Some(n) => format!(", verify: {n} mismatched bytes"),
                    None => String::new(),
                }
            );
        }
        let (min, max) = self.min_max();
        println!(
            "aggregate {:.3} GB/s (median of {}; first start to last end, starts within {:.0} us), per peer {min:.3}-{max:.3} GB/s, Jain's index {:.3}; latency measured with every peer's round trips concurrent{}",
            self.aggregate_gbps(),
            args.repeat,
            self.start_spread_us_runs.iter().copied().fold(0.0, f64::max),
            self.jain(),
            match self.mismatched_bytes() {
                Some(n) => format!(", verify: {n} mismatched bytes"),
                None => String::new(),
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(i: u64, runs: &[(u64, u64)]) -> PeerResult {
        PeerResult {
            peer: i,
            pid: 1,
            target: "t".into(),
            remote_offset: 0,
            bytes_per_run: 1_000_000_000,
            runs: runs
                .iter()
                .map(|&(start_ns, end_ns)| PeerRun { start_ns, end_ns })
                .collect(),
            p50_us: 1.0,
            p99_us: 2.0,
            mismatched_bytes: Some(0),
            open_us: 0.0,
        }
    }

    #[test]
    fn jain_is_one_when_fair_and_one_over_n_when_one_gets_all() {
        assert!((jain(&[2.0, 2.0, 2.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[3.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        // (1 + 3)^2 / (2 (1 + 9)) = 0.8
        assert!((jain(&[1.0, 3.0]) - 0.8).abs() < 1e-12);
        assert!(jain(&[]).is_nan());
    }

    #[test]
    fn the_aggregate_spans_first_start_to_last_end() {
        // 1 GB each; peer 0 takes 1 s, peer 1 takes 2 s starting 0.5 s later: the span is 2.5 s.
        let s = Summary::new(&[peer(0, &[(0, 1_000_000_000)]), peer(1, &[(500_000_000, 2_500_000_000)])]).unwrap();
        assert_eq!(s.peer_gbps, vec![1.0, 0.5]);
        assert!((s.aggregate_gbps() - 2.0 / 2.5).abs() < 1e-12);
        assert!((s.jain() - 1.5 * 1.5 / (2.0 * 1.25)).abs() < 1e-12);
        assert_eq!(s.mismatched_bytes(), Some(0));
        assert_eq!(s.start_spread_us_runs, vec![500_000.0]);
    }

    #[test]
    fn peers_must_agree_on_repetitions() {
        assert!(Summary::new(&[peer(0, &[(0, 1)]), peer(1, &[(0, 1), (1, 2)])]).is_err());
        assert!(Summary::new(&[]).is_err());
    }
}
