//! Smoke tests of `te-bench warm-up` (tcp) and `te-bench failover` (efa over libfabric's
//! `tcp;ofi_rxm`, built with the efa feature): each prints one JSON row per measurement whose
//! fields agree with each other. Tiny sizes; nothing here is judged by its speed. The failover
//! run needs libfabric (`TE_REQUIRE=libfabric` turns its absence into a failure) and the kernel's
//! socket destroy (`ss -K`, root).

use std::process::{Command, Output};

use te_base::test_support::skip_or_fail;

fn te_bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_te-bench"))
        .args(args)
        .output()
        .expect("running te-bench")
}

fn rows(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn f(row: &serde_json::Value, key: &str) -> f64 {
    row[key].as_f64().unwrap_or_else(|| panic!("no number {key} in {row}"))
}

#[test]
fn warm_up_reports_cold_and_warmed_first_writes_and_many_peers() {
    let out = te_bench(&[
        "warm-up",
        "--transports",
        "tcp",
        "--samples",
        "3",
        "--peers",
        "1,3",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows = rows(&out);
    assert_eq!(rows.len(), 3, "one summary and one row per peer count: {rows:?}");
    let s = &rows[0];
    assert_eq!(s["bench"], "warm-up");
    for k in ["first_cold_us", "first_warmed_us", "warm_up_us"] {
        assert!(
            f(s, &format!("{k}_p50")) > 0.0 && f(s, &format!("{k}_p50")) <= f(s, &format!("{k}_p99")),
            "{k}: {s}"
        );
    }
    for (row, n) in rows[1..].iter().zip([1, 3]) {
        assert_eq!(row["bench"], "warm-up-peers");
        assert_eq!(row["peers"], n);
        assert!(f(row, "warm_up_ms") > 0.0 && f(row, "open_ms") > 0.0, "{row}");
    }
}

#[test]
fn warm_up_refuses_zero_peers_by_name() {
    let out = te_bench(&["warm-up", "--peers", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--peers"));
}

#[test]
fn failover_moves_a_killed_batch_to_tcp_and_verifies_it() {
    let out = te_bench(&[
        "failover",
        "--total-bytes",
        "64M",
        "--rounds",
        "3",
        "--small-requests",
        "64",
        "--verify",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if err.contains("not compiled") {
            eprintln!("skipping: this te-bench was built without the efa feature");
            return;
        }
        if err.contains("not available") {
            skip_or_fail("libfabric", &err);
            return;
        }
        if err.contains("socket destroy") || err.contains("ss -K") {
            eprintln!("skipping: the kernel's socket destroy is not available: {err}");
            return;
        }
        panic!("te-bench failover: {err}");
    }
    let row = &rows(&out)[0];
    assert_eq!(row["bench"], "failover");
    assert_eq!(row["verified"], true);
    assert_eq!(row["requests"], 256);
    // te-bench itself fails when no kill landed mid-batch; here some requests must have moved.
    assert!(row["failed_over_p50"].as_u64().unwrap() >= 1, "{row}");
    assert!(f(row, "recovery_ms_p50") <= f(row, "recovery_ms_p99"), "{row}");
    assert!(
        f(row, "recovery_ms_p50") > 0.0 && f(row, "tracking_ratio") > 0.0,
        "{row}"
    );
}
