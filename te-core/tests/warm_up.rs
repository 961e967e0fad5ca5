//! Warm-up over tcp between two engines in this process: the explicit call, the builder option
//! and `TE_WARM_UP` warming at open, a segment with nothing to read, a closed segment, a bad
//! value. (efa's rails: `failover_efa.rs`.)

use std::sync::Arc;

use te_core::config::MapEnv;
use te_core::metadata::InProcessStore;
use te_core::{Error, HostBufferOptions, TransferEngine};

async fn engine(name: &str, store: &InProcessStore, warm: Option<bool>, vars: &[(&str, &str)]) -> TransferEngine {
    let mut env = MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")]);
    for (k, v) in vars {
        env.0.insert(k.to_string(), v.to_string());
    }
    let mut b = TransferEngine::builder()
        .segment_name(name)
        .transports(["tcp"])
        .metadata(Arc::new(store.clone()))
        .env(Arc::new(env));
    if let Some(w) = warm {
        b = b.warm_up_segments(w);
    }
    b.build().await.expect("engine")
}

const PATTERN: [u8; 4096] = {
    let mut p = [0u8; 4096];
    let mut i = 0;
    while i < p.len() {
        p[i] = (i * 7 + 3) as u8;
        i += 1;
    }
    p
};

#[tokio::test]
async fn an_explicit_warm_up_reads_once_per_route_and_changes_nothing() {
    let store = InProcessStore::new();
    let a = engine("wu-a", &store, None, &[]).await;
    let b = engine("wu-b", &store, None, &[]).await;
    let dst = b.allocate(1 << 20, HostBufferOptions::default()).await.unwrap();
    dst.write_at(0, &PATTERN).unwrap();
    let seg = a.open_segment("wu-b").await.unwrap();
    assert_eq!(a.metrics().warmed_routes, 0, "off by default");
    let report = a.warm_up(&seg).await.unwrap();
    assert_eq!(report.routes.len(), 1, "{report:?}");
    let tcp = &report.routes[0];
    assert_eq!((tcp.transport, tcp.reads, tcp.unprobed.as_deref()), ("tcp", 1, None));
    assert!(report.elapsed >= tcp.elapsed);
    assert_eq!(a.metrics().warmed_routes, 1);
    assert_eq!(a.metrics().requests, 0, "the probe is not a caller's request");
    let mut back = [0u8; 4096];
    dst.read_at(0, &mut back).unwrap();
    assert_eq!(back, PATTERN, "a warm-up only reads");
}

#[tokio::test]
async fn the_builder_option_and_the_variable_warm_at_open() {
    let store = InProcessStore::new();
    let b = engine("wu-target", &store, None, &[]).await;
    let _dst = b.allocate(1 << 16, HostBufferOptions::default()).await.unwrap();
    let by_builder = engine("wu-builder", &store, Some(true), &[]).await;
    by_builder.open_segment("wu-target").await.unwrap();
    assert_eq!(by_builder.metrics().warmed_routes, 1);
    let by_env = engine("wu-env", &store, None, &[("TE_WARM_UP", "1")]).await;
    by_env.open_segment("wu-target").await.unwrap();
    assert_eq!(by_env.metrics().warmed_routes, 1);
    // The builder's choice wins over the variable.
    let off = engine("wu-off", &store, Some(false), &[("TE_WARM_UP", "1")]).await;
    off.open_segment("wu-target").await.unwrap();
    assert_eq!(off.metrics().warmed_routes, 0);
}

#[tokio::test]
async fn nothing_exported_is_reported_unprobed_and_a_closed_segment_refused() {
    let store = InProcessStore::new();
    let a = engine("wu-a2", &store, None, &[]).await;
    let _b = engine("wu-empty", &store, None, &[]).await;
    let seg = a.open_segment("wu-empty").await.unwrap();
    let report = a.warm_up(&seg).await.unwrap();
    assert_eq!(report.routes[0].reads, 0);
    let why = report.routes[0].unprobed.as_deref().expect("unprobed");
    assert!(why.contains("exports no buffer"), "{why}");
    assert_eq!(a.metrics().warmed_routes, 0);
    a.close_segment(seg.id()).await.unwrap();
    let err = a.warm_up(&seg).await.unwrap_err();
    assert!(matches!(err, Error::SegmentClosed(_)), "{err}");
}

#[tokio::test]
async fn a_bad_value_names_the_variable() {
    let err = TransferEngine::builder()
        .segment_name("wu-bad")
        .transports(["tcp"])
        .metadata(Arc::new(InProcessStore::new()))
        .env(Arc::new(MapEnv::new([("TE_WARM_UP", "sometimes")])))
        .build()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("TE_WARM_UP"), "{err}");
}
