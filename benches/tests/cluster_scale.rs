//! Smoke test of `te-bench umbp --cluster-scale`, both directory designs in one run: four light
//! peers (an observer and three writers) against an etcd started for each design, a few hundred
//! keys. Checks that each row carries every figure and that the figures tell the designs apart
//! the way they must: the etcd directory writes every key to etcd and delivers it to every
//! peer's watch and copy, sends no directory messages; the sharded directory keeps keys out of
//! etcd (watch events per put far below), holds each key's entry at its index peers only, and
//! publishes over the control connections. Every miss is byte-verified. Nothing here is timed.

use std::process::Command;

const PEERS: f64 = 4.0;
const KEYS: f64 = 320.0;

#[test]
fn a_small_cluster_scale_run_measures_both_directory_designs() {
    if !std::path::Path::new(&te_base::test_support::etcd::etcd_bin()).exists() {
        te_base::test_support::skip_or_fail("etcd", "no etcd binary (Debian etcd-server)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_te-bench"))
        .args(["umbp", "--cluster-scale", "--scale-peers", "4", "--scale-keys", "320"])
        .args(["--scale-batch", "16", "--scale-samples", "20", "--json"])
        .args(["--scale-directory", "etcd,sharded"])
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
    assert_eq!(rows.len(), 2, "one row per design");
    let f = |r: &serde_json::Value, name: &str| {
        r[name]
            .as_f64()
            .unwrap_or_else(|| panic!("{name} missing or not a number in {r}"))
    };
    for r in &rows {
        assert_eq!(r["bench"], "umbp-cluster-scale");
        assert_eq!(f(r, "peers"), PEERS);
        assert_eq!(f(r, "keys"), KEYS);
        assert!(f(r, "puts_per_s") > 0.0);
        // 320 keys in calls of 16 between three writers (107, 107, 106 keys): 7 calls each.
        assert_eq!(f(r, "put_calls"), 21.0);
        for p in [
            "put_call_ms",
            "commit_to_visible_ms",
            "commit_to_visible_under_stream_ms",
            "miss_ms",
        ] {
            let (p50, p99) = (f(r, &format!("{p}_p50")), f(r, &format!("{p}_p99")));
            assert!(p50.is_finite() && p50 <= p99, "{p}: p50 {p50} p99 {p99}");
        }
        assert!(f(r, "put_call_ms_p50") > 0.0 && f(r, "miss_ms_p50") > 0.0);
        assert_eq!(f(r, "commit_to_visible_samples"), 20.0);
        // Three writers, all tracked: every put call's visibility is bracketed.
        assert_eq!(f(r, "commit_to_visible_under_stream_samples"), 21.0);
        assert_eq!(f(r, "commit_to_visible_under_stream_writers_tracked"), 3.0);
        let (b50, b99) = (
            f(r, "commit_to_visible_under_stream_bracket_ms_p50"),
            f(r, "commit_to_visible_under_stream_bracket_ms_p99"),
        );
        assert!(b50 > 0.0 && b50 <= b99, "bracket p50 {b50} p99 {b99}");
        // At least one poll per writer (galloping may find several calls per poll).
        assert!(f(r, "observer_polls_under_stream") >= 3.0, "{r}");
        assert!(f(r, "observer_poll_under_stream_ms_p50") <= f(r, "observer_poll_under_stream_ms_p99"));
        assert_eq!(f(r, "miss_samples"), 20.0);
        assert_eq!(f(r, "mismatched_bytes"), 0.0, "{r}");
        assert!(f(r, "etcd_db_bytes") > 0.0 && f(r, "etcd_db_bytes_compacted") > 0.0);
        assert!(f(r, "etcd_db_in_use_bytes_compacted") <= f(r, "etcd_db_bytes_compacted"));
        let rate = f(r, "etcd_requests_per_s");
        assert!(rate.is_finite() && rate >= 0.0, "{r}");
        assert!(r["directory_bytes_per_peer"].is_u64());
        for name in [
            "directory_entries_observer",
            "directory_entries_writer_median",
            "directory_entries_total",
            "directory_messages_writers",
            "observer_directory_messages_during_stream",
        ] {
            assert!(r[name].is_u64(), "{name} missing in {r}");
        }
    }
    let (etcd, sharded) = (&rows[0], &rows[1]);
    assert_eq!(etcd["design"], "etcd directory (baseline)");
    assert_eq!(sharded["design"], "sharded directory");

    // The etcd directory: one transaction per put call, every key delivered to each of the four
    // watchers and held in each peer's copy, no directory messages.
    assert!(f(etcd, "etcd_txns_per_put_call") >= 1.0, "{etcd}");
    assert!(f(etcd, "etcd_requests_per_put_call") >= 1.0, "{etcd}");
    assert!(f(etcd, "etcd_mvcc_puts_per_key") >= 1.0, "{etcd}");
    assert!(f(etcd, "watch_events_per_key") >= PEERS, "{etcd}");
    assert!(f(etcd, "directory_entries_observer") >= KEYS, "{etcd}");
    assert!(f(etcd, "directory_entries_writer_median") >= KEYS, "{etcd}");
    assert!(f(etcd, "directory_entries_total") >= PEERS * KEYS, "{etcd}");
    assert_eq!(f(etcd, "directory_messages_writers"), 0.0, "{etcd}");
    assert_eq!(f(etcd, "observer_directory_messages_during_stream"), 0.0, "{etcd}");

    // The sharded directory: keys stay out of etcd, so etcd's watchers see far less per put (only
    // membership and lease traffic), and nothing like a transaction per put call.
    assert!(
        f(sharded, "watch_events_per_key") * 10.0 < f(etcd, "watch_events_per_key"),
        "watch events per put: sharded {} etcd {}",
        f(sharded, "watch_events_per_key"),
        f(etcd, "watch_events_per_key")
    );
    assert!(
        f(sharded, "watch_events_per_put_call") * 10.0 < f(etcd, "watch_events_per_put_call"),
        "{sharded}"
    );
    assert!(
        f(sharded, "etcd_mvcc_puts_per_key") * 10.0 < f(etcd, "etcd_mvcc_puts_per_key"),
        "{sharded}"
    );
    assert!(f(sharded, "etcd_txns_per_put_call") < 0.5, "{sharded}");
    // Each key's entry at its three index peers: 3 x keys entries in all, so no peer holds every
    // key (four peers, 320 keys: about 240 each).
    assert_eq!(f(sharded, "directory_entries_total"), 3.0 * KEYS, "{sharded}");
    assert!(f(sharded, "directory_entries_observer") < KEYS, "{sharded}");
    assert!(f(sharded, "directory_entries_writer_median") < KEYS, "{sharded}");
    // Each put call publishes to at least one other peer: a key's three index peers are distinct,
    // so at least one of them is not the writer.
    assert!(f(sharded, "directory_messages_per_put_call") >= 1.0, "{sharded}");
    // The observer routed every key during the stream: by LOOKUP unless it indexes it.
    assert!(
        f(sharded, "observer_directory_messages_during_stream") > 0.0,
        "{sharded}"
    );
}
