//! Smoke tests of `te-bench transfer --scheme`: each scheme over tcp on loopback with three
//! peers, byte-verified, prints one JSON row whose per-peer entries and aggregate agree with each
//! other; bad peer counts are refused with a message. Tiny sizes; nothing here is timed.

use std::process::{Command, Output};

fn te_bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_te-bench"))
        .args(args)
        .output()
        .expect("running te-bench")
}

fn scheme_row(scheme: &str, op: &str) -> serde_json::Value {
    let out = te_bench(&[
        "transfer",
        "--transport",
        "tcp",
        "--scheme",
        scheme,
        "--peers",
        "3",
        "--op",
        op,
        "--block-bytes",
        "64K",
        "--total-bytes",
        "256K",
        "--repeat",
        "2",
        "--latency-samples",
        "4",
        "--verify",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "te-bench --scheme {scheme}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON row: {stdout}");
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("not a JSON row {:?}: {e}", lines[0]))
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn check(scheme: &str, op: &str, processes: (u64, u64)) {
    let row = scheme_row(scheme, op);
    assert_eq!(row["bench"], "transfer-scheme");
    assert_eq!(row["scheme"], scheme);
    assert_eq!(row["op"], op);
    assert_eq!(row["peers"], 3);
    assert_eq!(row["initiator_processes"], processes.0);
    assert_eq!(row["target_processes"], processes.1);
    assert_eq!(row["verified"], true);
    assert_eq!(row["mismatched_bytes"], 0);
    let peers = row["per_peer"].as_array().expect("per_peer entries");
    assert_eq!(peers.len(), 3);
    for (i, p) in peers.iter().enumerate() {
        assert_eq!(p["peer"], i as u64);
        assert_eq!(p["mismatched_bytes"], 0, "peer {i}: {p}");
        assert_eq!(p["bytes_per_run"], 262_144);
        assert!(f(&p["gbps"]) > 0.0);
        assert!(f(&p["p50_us"]) > 0.0 && f(&p["p99_us"]) >= f(&p["p50_us"]));
        assert_eq!(p["gbps_runs"].as_array().unwrap().len(), 2);
    }
    let targets: std::collections::BTreeSet<&str> = peers.iter().map(|p| p["target"].as_str().unwrap()).collect();
    let offsets: Vec<u64> = peers.iter().map(|p| p["remote_offset"].as_u64().unwrap()).collect();
    if scheme == "many-to-one" {
        assert_eq!(targets.len(), 1, "one target");
        assert_eq!(offsets, vec![0, 262_144, 524_288], "disjoint ranges");
    } else {
        assert_eq!(targets.len(), 3, "a target each");
        assert_eq!(offsets, vec![0, 0, 0]);
    }
    let jain = f(&row["jain_index"]);
    assert!(jain > 0.0 && jain <= 1.0 + 1e-12, "Jain's index {jain}");
    let total: u64 = peers.iter().map(|p| p["bytes_per_run"].as_u64().unwrap()).sum();
    assert_eq!(row["bytes_per_run"], total);
    let walls = row["wall_s_runs"].as_array().unwrap();
    let aggregates = row["aggregate_gbps_runs"].as_array().unwrap();
    assert_eq!(walls.len(), 2);
    for (r, (wall, agg)) in walls.iter().zip(aggregates).enumerate() {
        let (wall, agg) = (f(wall), f(agg));
        // The aggregate is every peer's bytes over the run's span ...
        let expected = total as f64 / wall / 1e9;
        assert!(
            (agg - expected).abs() <= 1e-9 * expected,
            "run {r}: {agg} vs {expected}"
        );
        // ... which holds every peer's own elapsed time, so it is at most their sum.
        let mut sum = 0.0;
        for p in peers {
            let elapsed = f(&p["elapsed_s_runs"][r]);
            assert!(
                elapsed <= wall * (1.0 + 1e-9),
                "run {r}: a peer took {elapsed} s of {wall} s"
            );
            sum += f(&p["gbps_runs"][r]);
        }
        assert!(
            agg <= sum * (1.0 + 1e-9),
            "run {r}: aggregate {agg} above the peers' sum {sum}"
        );
        // How far apart the barrier let them start is reported (not bounded here: on a loaded
        // machine waking a process can take longer than these tiny runs).
        assert!(f(&row["start_spread_us_runs"][r]) >= 0.0);
    }
    let min = f(&row["per_peer_gbps_min"]);
    let max = f(&row["per_peer_gbps_max"]);
    assert!(min <= max);
    for p in peers {
        assert!((min..=max).contains(&f(&p["gbps"])));
    }
}

#[test]
fn pairwise_writes_between_three_pairs_verified() {
    check("pairwise", "write", (3, 3));
}

#[test]
fn many_to_one_writes_three_disjoint_ranges_verified() {
    check("many-to-one", "write", (3, 1));
}

#[test]
fn many_to_one_reads_each_range_from_its_own_position() {
    check("many-to-one", "read", (3, 1));
}

#[test]
fn one_to_many_writes_to_three_targets_verified() {
    check("one-to-many", "write", (1, 3));
}

#[test]
fn one_to_many_reads_each_target_pattern() {
    check("one-to-many", "read", (1, 3));
}

#[test]
fn bad_peer_counts_are_refused_by_name() {
    for (args, says) in [
        (vec!["--scheme", "pairwise", "--peers", "0"], "--peers 0"),
        (
            vec!["--scheme", "many-to-one", "--peers", "1"],
            "needs --peers 2 or more",
        ),
        (
            vec!["--scheme", "one-to-many", "--peers", "1"],
            "needs --peers 2 or more",
        ),
        (vec!["--scheme", "pairwise", "--peers", "65"], "at most 64"),
    ] {
        let out = te_bench(&[&["transfer", "--total-bytes", "64K", "--block-bytes", "64K"], &args[..]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // --peers means nothing without --scheme, and a scheme cannot talk to one remote --peer.
    assert!(!te_bench(&["transfer", "--peers", "3"]).status.success());
    assert!(!te_bench(&[
        "transfer",
        "--scheme",
        "pairwise",
        "--peers",
        "2",
        "--peer",
        "127.0.0.1:1"
    ])
    .status
    .success());
}
