//! Smoke tests of the size sweeps: `te-bench transfer --block-sizes` over tcp on loopback and
//! `te-bench local-copy` over two fragment sizes, each byte-verified, print one JSON row per size
//! and write their `--plot`. Tiny sizes; nothing here is timed.

use std::process::Command;

fn te_bench(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_te-bench"))
        .args(args)
        .output()
        .expect("running te-bench");
    assert!(
        out.status.success(),
        "te-bench {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON row {l:?}: {e}")))
        .collect()
}

fn svg(path: &std::path::Path) -> String {
    let svg = std::fs::read_to_string(path).expect("the plot was written");
    assert!(svg.trim_start().starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    svg
}

#[test]
fn a_transfer_block_size_sweep_prints_a_verified_row_per_size_and_plots_them() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("transfer.svg");
    let rows = te_bench(&[
        "transfer",
        "--transport",
        "tcp",
        "--block-sizes",
        "4K,64K",
        "--total-bytes",
        "256K",
        "--repeat",
        "1",
        "--latency-samples",
        "2",
        "--verify",
        "--json",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let blocks: Vec<u64> = rows.iter().map(|r| r["block_bytes"].as_u64().unwrap()).collect();
    assert_eq!(blocks, vec![4096, 65_536]);
    for r in &rows {
        assert_eq!(r["total_bytes"], 262_144);
        assert_eq!(r["verified"], true);
        assert_eq!(r["mismatched_bytes"], 0);
    }
    assert!(svg(&plot).contains("te tcp"));
}

#[test]
fn a_local_copy_fragment_sweep_prints_a_verified_row_per_size_and_plots_them() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("local-copy.svg");
    let rows = te_bench(&[
        "local-copy",
        "--fragment-bytes",
        "1K,4K",
        "--fragments",
        "64",
        "--repeat",
        "1",
        "--verify",
        "--json",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let frags: Vec<u64> = rows.iter().map(|r| r["fragment_bytes"].as_u64().unwrap()).collect();
    assert_eq!(frags, vec![1024, 4096]);
    assert!(rows.iter().all(|r| r["mismatched_bytes"] == 0));
    let svg = svg(&plot);
    assert!(svg.contains("engine") && svg.contains("memcpy per fragment"));
}
