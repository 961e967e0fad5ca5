//! The store's counters exported through its engine's Prometheus endpoint: a scrape after known
//! hits, misses, demotions and SSD reads shows exactly those counts.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use te_core::config::MapEnv;
use te_core::TransferEngine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use umbp::{EvictionPolicy, Range, RangedGet, StoreError};

async fn scrape(engine: &TransferEngine) -> String {
    let mut s = tokio::net::TcpStream::connect(engine.metrics_addr().expect("endpoint"))
        .await
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 200 "), "{out}");
    out
}

/// The value of the sample `name` whose labels include `label` (`k="v"`, or "" for any).
fn value(body: &str, name: &str, label: &str) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            (n == name && rest.contains(label)).then(|| v.parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {name} {label} in {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_shows_the_stores_hits_misses_and_demotions() {
    let env = MapEnv::new([("TE_METRICS_LISTEN", "127.0.0.1:0")]);
    let engine = TransferEngine::builder()
        .segment_name("umbp-metrics")
        .transports(["local"])
        .env(Arc::new(env))
        .build()
        .await
        .unwrap();
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let store = with_ssd(256 << 10, dir.path())
        .high_watermark(0.75)
        .low_watermark(0.5)
        .eviction(EvictionPolicy::Lru)
        .open_on(engine.clone())
        .await
        .unwrap();
    let mut buf = Buf::new(&store, 64 << 10).await;
    let obj = 16u64 << 10;
    for i in 0..20 {
        put_layers(&store, &mut buf, &format!("k{i}"), i, 4, obj / 4, 0).unwrap();
    }
    // 20 hits (wherever each object lives now), then 3 misses.
    for i in 0..20 {
        get_layers(&store, &mut buf, &format!("k{i}"), i, 0, 4, obj / 4).unwrap();
    }
    for i in 0..3 {
        let ranges = [Range::new(0, 16, buf.addr())];
        let got = store
            .batch_get_ranges(&[RangedGet {
                key: &format!("absent{i}"),
                ranges: &ranges,
            }])
            .unwrap();
        assert!(matches!(got[0], Err(StoreError::NotFound { .. })));
    }
    let s = store.stats().unwrap();
    assert!(s.core.demoted > 0 && s.core.ssd_delivered_bytes > 0, "{s:?}");

    let body = scrape(&engine).await;
    assert_eq!(value(&body, "umbp_hits_total", "tier=\"local\""), 20.0);
    assert_eq!(value(&body, "umbp_misses_total", ""), 3.0);
    assert_eq!(value(&body, "umbp_puts_total", "outcome=\"ok\""), 20.0);
    assert_eq!(value(&body, "umbp_demotions_total", ""), s.core.demoted as f64);
    assert_eq!(
        value(&body, "umbp_evictions_total", ""),
        (s.core.demoted + s.core.dropped) as f64
    );
    assert_eq!(value(&body, "umbp_promotions_total", ""), s.core.promoted as f64);
    let dram = value(&body, "umbp_delivered_bytes_total", "tier=\"dram\"");
    let ssd = value(&body, "umbp_delivered_bytes_total", "tier=\"ssd\"");
    assert_eq!(dram + ssd, (20 * obj) as f64);
    assert_eq!(ssd, s.core.ssd_delivered_bytes as f64);
    assert_eq!(
        value(&body, "umbp_ssd_read_bytes_total", ""),
        s.core.ssd_read_bytes as f64
    );
    assert_eq!(
        value(&body, "umbp_capacity_bytes", "tier=\"dram\""),
        s.core.dram_capacity_bytes as f64
    );
    // The engine's own metrics are in the same answer.
    assert!(value(&body, "te_requests_total", "transport=\"local\"") > 0.0);
    buf.release(&store).await;
}
