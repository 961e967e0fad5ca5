//! The cluster compacts etcd's revision history itself (UMBP_CLUSTER_COMPACT_S): with a
//! one-second period, etcd's compacted revision rises past the puts' revisions and stays below
//! the current one (one period of history is kept for watchers that fell behind).
//!
//! Needs Debian's etcd-server (skips otherwise; TE_REQUIRE=etcd makes its absence a failure).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use te_base::test_support::etcd::EtcdServer;
use umbp::{ClusterConfig, DirectoryMode, Store};

/// The value of an unlabelled sample in etcd's `/metrics`.
fn metric(host_port: &str, name: &str) -> Option<f64> {
    let mut s = std::net::TcpStream::connect(host_port).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {host_port}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_compacts_etcds_history_itself() {
    let Some(etcd) = EtcdServer::start_on_loopback() else {
        return;
    };
    let host = etcd.endpoint.trim_start_matches("http://").to_string();
    let mut cc = ClusterConfig::parse(&format!("etcd://{host}/compaction")).unwrap();
    cc.lease_ttl_s = 3;
    cc.timeout = Duration::from_secs(2);
    cc.compact_every = Some(Duration::from_secs(1));
    // The etcd directory writes a revision per put call: history to compact.
    cc.directory = DirectoryMode::Etcd;
    let store = Store::builder()
        .segment_name("compactor".into())
        .dram_capacity(8 << 20)
        .ssd_dirs(vec![])
        .cluster(cc)
        .open()
        .await
        .unwrap();
    for i in 0..50 {
        store.put(&format!("k{i}"), &[i as u8; 64], 0).await.unwrap();
    }
    let written = metric(&host, "etcd_debugging_mvcc_current_revision").expect("etcd's current revision");
    // -1: never compacted; a compaction keeps at least one period, so none reached the puts yet.
    let before = metric(&host, "etcd_debugging_mvcc_compact_revision").expect("etcd's compacted revision");
    assert!(
        before < written,
        "compacted to {before} before the puts' revision {written}"
    );
    // Waits for the event (a compaction past the puts), bounded; the keep-alive period is 1 s.
    let end = Instant::now() + Duration::from_secs(30);
    let compacted = loop {
        let c = metric(&host, "etcd_debugging_mvcc_compact_revision").unwrap_or(0.0);
        if c >= written {
            break c;
        }
        assert!(
            Instant::now() < end,
            "no compaction past revision {written} within 30 s (at {c})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let current = metric(&host, "etcd_debugging_mvcc_current_revision").unwrap();
    assert!(
        compacted < current,
        "one period of history is kept: compacted {compacted}, current {current}"
    );
    store.close().await.unwrap();
}
