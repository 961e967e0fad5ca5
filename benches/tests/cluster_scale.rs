//! Smoke test of `te-bench umbp --cluster-scale`: three light peers (an observer and two
//! writers) against an etcd started for the run, a few hundred keys. Checks that the row carries
//! every figure and that the figures are consistent with today's directory (every put call is at
//! least one etcd request, every key reaches every peer's watch). Nothing here is timed.

use std::process::Command;

#[test]
fn a_small_cluster_scale_run_reports_sane_figures() {
    if !std::path::Path::new(&te_base::test_support::etcd::etcd_bin()).exists() {
        te_base::test_support::skip_or_fail("etcd", "no etcd binary (Debian etcd-server)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_te-bench"))
        .args(["umbp", "--cluster-scale", "--scale-peers", "3", "--scale-keys", "320"])
        .args(["--scale-batch", "16", "--scale-samples", "20", "--json"])
        .output()
        .expect("running te-bench");
    assert!(
        out.status.success(),
        "te-bench: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON row {l:?}: {e}")))
        .collect();
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    let f = |name: &str| {
        r[name]
            .as_f64()
            .unwrap_or_else(|| panic!("{name} missing or not a number in {r}"))
    };
    assert_eq!(r["bench"], "umbp-cluster-scale");
    assert_eq!(f("peers"), 3.0);
    assert_eq!(f("keys"), 320.0);
    assert!(f("puts_per_s") > 0.0);
    // 320 keys in calls of 16 between two writers: 20 calls.
    assert_eq!(f("put_calls"), 20.0);
    // Today's design: one transaction per put call, plus the peers' own traffic.
    assert!(f("etcd_txns_per_put_call") >= 1.0, "{r}");
    assert!(f("etcd_requests_per_put_call") >= 1.0, "{r}");
    assert!(f("etcd_mvcc_puts_per_key") >= 1.0, "{r}");
    // Every key is delivered to each of the three watchers.
    assert!(f("watch_events_per_key") >= 3.0, "{r}");
    for p in [
        "put_call_ms",
        "commit_to_visible_ms",
        "commit_to_visible_under_stream_ms",
        "miss_ms",
    ] {
        let (p50, p99) = (f(&format!("{p}_p50")), f(&format!("{p}_p99")));
        assert!(p50.is_finite() && p50 <= p99, "{p}: p50 {p50} p99 {p99}");
    }
    assert!(f("put_call_ms_p50") > 0.0 && f("miss_ms_p50") > 0.0);
    assert_eq!(f("commit_to_visible_samples"), 20.0);
    assert_eq!(f("miss_samples"), 20.0);
    assert_eq!(f("mismatched_bytes"), 0.0);
    assert!(f("etcd_db_bytes") > 0.0 && f("etcd_db_bytes_compacted") > 0.0);
    assert!(f("etcd_db_in_use_bytes_compacted") <= f("etcd_db_bytes_compacted"));
    assert!(r["directory_bytes_per_peer"].is_u64());
}
