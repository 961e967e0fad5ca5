//! Metrics export through the public API: scraping the engine's Prometheus endpoint over HTTP
//! after known batches (bytes, requests, failures by kind, latency histogram count, per transport
//! and peer), the endpoint's limits and authentication, the peer-label cap, and an embedder's own
//! recorder.

use std::sync::Arc;
use std::time::Duration;

use te_core::config::MapEnv;
use te_core::{HostBufferOptions, TransferEngine, TransferRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[allow(dead_code)] // the manual transport's helpers this file does not call
mod common;
use common::ManualTransport;

fn env(vars: &[(&str, &str)]) -> Arc<MapEnv> {
    Arc::new(MapEnv(
        vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
    ))
}

/// An engine on `transports` (or the manual one) with its endpoint on a free loopback port.
async fn engine(name: &str, vars: &[(&str, &str)], manual: Option<&Arc<ManualTransport>>) -> TransferEngine {
    let mut all = vec![("TE_METRICS_LISTEN", "127.0.0.1:0")];
    all.extend_from_slice(vars);
    let b = TransferEngine::builder().segment_name(name).env(env(&all));
    let b = match manual {
        Some(m) => b.transports(Vec::<String>::new()).with_transport(m.clone()),
        None => b.transports(["tcp"]),
    };
    b.build().await.expect("engine")
}

/// Sends `request` raw and returns the whole answer (the endpoint closes after one).
async fn raw(engine: &TransferEngine, request: &[u8]) -> String {
    let mut s = TcpStream::connect(engine.metrics_addr().expect("endpoint"))
        .await
        .unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("the endpoint answers and closes")
        .unwrap();
    String::from_utf8(out).unwrap()
}

/// `GET /metrics` and the body of its 200 answer.
async fn scrape(engine: &TransferEngine) -> String {
    let answer = raw(engine, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    answer.split_once("\r\n\r\n").unwrap().1.to_string()
}

/// The value of the sample `name` whose labels include every pair of `labels`.
fn value(body: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, v) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        let ok = n == name && labels.iter().all(|(k, val)| rest.contains(&format!("{k}=\"{val}\"")));
        ok.then(|| v.parse().unwrap())
    })
}

fn opts() -> HostBufferOptions {
    HostBufferOptions::default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_reports_a_known_tcp_batch() {
    let a = engine("m-tcp-a", &[], None).await;
    let b = TransferEngine::builder()
        .segment_name("m-tcp-b")
        .transports(["tcp"])
        .env(env(&[]))
        .build()
        .await
        .unwrap();
    let src = a.allocate(64 << 10, opts()).await.unwrap();
    let dst = b.allocate(64 << 10, opts()).await.unwrap();
    let seg = a.open_segment("m-tcp-b").await.unwrap();
    let reqs: Vec<TransferRequest> = (0..10u64)
        .map(|i| TransferRequest::write(src.addr() + i * 4096, seg.id(), dst.addr() + i * 4096, 4096))
        .collect();
    a.transfer(&reqs).await.unwrap();
    a.transfer(&reqs[..3]).await.unwrap();

    let body = scrape(&a).await;
    let peer = [("transport", "tcp"), ("peer", "m-tcp-b")];
    assert_eq!(value(&body, "te_requests_total", &peer), Some(13.0), "{body}");
    assert_eq!(value(&body, "te_bytes_total", &peer), Some(13.0 * 4096.0));
    assert_eq!(value(&body, "te_batches_total", &peer), Some(2.0));
    assert_eq!(value(&body, "te_batch_latency_seconds_count", &peer), Some(2.0));
    assert!(value(&body, "te_batch_latency_seconds_sum", &peer).unwrap() > 0.0);
    assert_eq!(
        value(
            &body,
            "te_failed_requests_total",
            &[("peer", "m-tcp-b"), ("kind", "transport")]
        ),
        Some(0.0)
    );
    assert_eq!(value(&body, "te_open_connections", &peer), Some(1.0));
    assert_eq!(value(&body, "te_open_segments", &[]), Some(1.0));
    assert_eq!(
        value(&body, "te_registered_regions_total", &[("transport", "tcp")]),
        Some(1.0)
    );
    assert_eq!(
        value(&body, "te_registration_seconds_count", &[("transport", "tcp")]),
        Some(1.0)
    );
    assert!(body.contains("# HELP te_bytes_total"), "{body}");
    // Nothing secret: no address of the peer, no key material.
    assert!(!body.contains("127.0.0.1"), "{body}");
}

#[tokio::test]
async fn failures_are_counted_by_kind_under_the_peer_that_failed() {
    let manual = ManualTransport::new();
    let a = engine("m-fail-a", &[], Some(&manual)).await;
    // A second segment in this process: the manual transport reaches it too.
    // A second engine on the same manual transport, without metrics: a peer segment here.
    let other = common::manual_engine("m-fail-b", &manual).await;
    let src = a.allocate(16 << 10, opts()).await.unwrap();
    let dst_a = a.allocate(16 << 10, opts()).await.unwrap();
    let dst_b = other.allocate(16 << 10, opts()).await.unwrap();
    let sa = a.open_segment("m-fail-a").await.unwrap();
    let sb = a.open_segment("m-fail-b").await.unwrap();
    // Indices 0, 1 to a; 2, 3 to b; index 3 fails.
    let reqs = [
        TransferRequest::write(src.addr(), sa.id(), dst_a.addr(), 1024),
        TransferRequest::write(src.addr() + 1024, sa.id(), dst_a.addr() + 1024, 1024),
        TransferRequest::write(src.addr() + 2048, sb.id(), dst_b.addr(), 512),
        TransferRequest::write(src.addr() + 4096, sb.id(), dst_b.addr() + 512, 512),
    ];
    let batch = a.submit(&reqs).unwrap();
    manual.fail_index(3);
    manual.complete_all();
    assert_eq!(batch.wait().await.unwrap_err().failures.len(), 1);
    // A group the transport refuses at submit: both its requests fail under b.
    manual.refuse_submissions();
    assert!(a.transfer(&reqs[2..]).await.is_err());

    let body = scrape(&a).await;
    let pa = [("transport", "manual"), ("peer", "m-fail-a")];
    let pb = [("transport", "manual"), ("peer", "m-fail-b")];
    let failed = |p: &[(&str, &str)], kind: &str| {
        let mut l = p.to_vec();
        l.push(("kind", kind));
        value(&body, "te_failed_requests_total", &l)
    };
    assert_eq!(failed(&pa, "transport"), Some(0.0), "{body}");
    assert_eq!(failed(&pb, "transport"), Some(3.0), "{body}");
    assert_eq!(value(&body, "te_requests_total", &pa), Some(2.0));
    assert_eq!(value(&body, "te_requests_total", &pb), Some(4.0));
    assert_eq!(value(&body, "te_bytes_total", &pa), Some(2048.0));
    assert_eq!(value(&body, "te_bytes_total", &pb), Some(2048.0));
    assert_eq!(value(&body, "te_batch_latency_seconds_count", &pa), Some(1.0));
    assert_eq!(value(&body, "te_batch_latency_seconds_count", &pb), Some(2.0));
    assert_eq!(value(&body, "te_open_segments", &[]), Some(2.0));
}

#[tokio::test]
async fn peers_past_the_cap_share_one_label() {
    let manual = ManualTransport::new();
    let a = engine("m-cap-a", &[("TE_METRICS_MAX_PEERS", "1")], Some(&manual)).await;
    let b = common::manual_engine("m-cap-b", &manual).await;
    manual.complete_all_later();
    let src = a.allocate(4096, opts()).await.unwrap();
    let da = a.allocate(4096, opts()).await.unwrap();
    let db = b.allocate(4096, opts()).await.unwrap();
    let sa = a.open_segment("m-cap-a").await.unwrap();
    let sb = a.open_segment("m-cap-b").await.unwrap();
    a.transfer(&[TransferRequest::write(src.addr(), sa.id(), da.addr(), 100)])
        .await
        .unwrap();
    a.transfer(&[TransferRequest::write(src.addr(), sb.id(), db.addr(), 200)])
        .await
        .unwrap();
    let body = scrape(&a).await;
    assert_eq!(
        value(&body, "te_bytes_total", &[("peer", "m-cap-a")]),
        Some(100.0),
        "{body}"
    );
    assert_eq!(
        value(&body, "te_bytes_total", &[("peer", "_other")]),
        Some(200.0),
        "{body}"
    );
    assert!(!body.contains("m-cap-b"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_bounds_request_size_time_and_connections() {
    let a = engine(
        "m-limits",
        &[
            ("TE_METRICS_MAX_CONNECTIONS", "1"),
            // Long enough that a loaded host cannot time the silent client out before the second
            // connects.
            ("TE_METRICS_HANDSHAKE_TIMEOUT_MS", "1500"),
            // The whole-scrape limit is far longer: the head timeout alone must close a silent client.
            ("TE_METRICS_TIMEOUT_MS", "30000"),
        ],
        Some(&ManualTransport::new()),
    )
    .await;
    // Methods and paths.
    assert!(raw(&a, b"POST /metrics HTTP/1.1\r\n\r\n")
        .await
        .starts_with("HTTP/1.1 405 "));
    assert!(raw(&a, b"GET /other HTTP/1.1\r\n\r\n")
        .await
        .starts_with("HTTP/1.1 404 "));
    assert!(raw(&a, b"garbage\r\n\r\n").await.starts_with("HTTP/1.1 400 "));
    // A head past the limit is refused without waiting for its end.
    let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    big.resize(te_core::metrics::MAX_REQUEST_HEAD + 100, b'a');
    assert!(raw(&a, &big).await.starts_with("HTTP/1.1 431 "));
    // A client that sends nothing holds the only place until the head timeout closes it.
    let addr = a.metrics_addr().unwrap();
    // The listener admits in arrival order, and the last request's place was freed before its
    // socket closed: the silent client takes the place, the second finds it held.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut second = TcpStream::connect(addr).await.unwrap();
    second.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.ok();
    let mut out = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), second.read_to_end(&mut out)).await;
    assert!(
        matches!(n, Ok(Ok(0)) | Ok(Err(_))),
        "a connection over the cap was served: {:?}",
        String::from_utf8_lossy(&out)
    );
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(Duration::from_secs(3), silent.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "a silent client was not closed"
    );
    // Its place is free again.
    scrape(&a).await;
}

#[tokio::test]
async fn with_a_key_a_scrape_needs_the_derived_token() {
    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("key");
    std::fs::write(&key_path, [9u8; 32]).unwrap();
    let key_path = key_path.to_str().unwrap().to_string();
    let a = engine(
        "m-auth",
        &[("TE_AUTH_KEY_FILE", &key_path)],
        Some(&ManualTransport::new()),
    )
    .await;
    let key = te_core::auth::AuthKey::from_bytes(&[9u8; 32]).unwrap();
    let token = te_core::metrics::scrape_token(&key);
    let unauth = raw(&a, b"GET /metrics HTTP/1.1\r\n\r\n").await;
    assert!(unauth.starts_with("HTTP/1.1 401 "), "{unauth}");
    assert!(!unauth.contains("te_"), "{unauth}");
    let wrong = raw(
        &a,
        format!(
            "GET /metrics HTTP/1.1\r\nAuthorization: Bearer {}\r\n\r\n",
            "ab".repeat(32)
        )
        .as_bytes(),
    )
    .await;
    assert!(wrong.starts_with("HTTP/1.1 401 "), "{wrong}");
    let ok = raw(
        &a,
        format!("GET /metrics HTTP/1.1\r\nAuthorization: Bearer {token}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(ok.starts_with("HTTP/1.1 200 "), "{ok}");
    assert!(!ok.contains(&token));
}

#[tokio::test]
async fn an_embedders_recorder_receives_the_metrics() {
    let recorder = Arc::new(metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder());
    let handle = recorder.handle();
    let a = TransferEngine::builder()
        .segment_name("m-embed")
        .transports(["local"])
        .env(env(&[]))
        .metrics_recorder(recorder.clone())
        .build()
        .await
        .unwrap();
    assert!(a.metrics_addr().is_none());
    let src = a.allocate(8192, opts()).await.unwrap();
    let dst = a.allocate(8192, opts()).await.unwrap();
    let me = a.open_segment("m-embed").await.unwrap();
    a.transfer(&[TransferRequest::write(src.addr(), me.id(), dst.addr(), 8192)])
        .await
        .unwrap();
    a.collect_metrics();
    let body = handle.render();
    let peer = [("transport", "local"), ("peer", "m-embed")];
    assert_eq!(value(&body, "te_bytes_total", &peer), Some(8192.0), "{body}");
    assert_eq!(value(&body, "te_open_segments", &[]), Some(1.0), "{body}");

    // Both a recorder and the variable: refused, naming the variable.
    let e = TransferEngine::builder()
        .segment_name("m-embed-2")
        .transports(["local"])
        .env(env(&[("TE_METRICS_LISTEN", "127.0.0.1:0")]))
        .metrics_recorder(recorder)
        .build()
        .await
        .unwrap_err();
    assert!(e.to_string().contains("TE_METRICS_LISTEN"), "{e}");
}

#[tokio::test]
async fn off_by_default_and_malformed_settings_are_refused() {
    let a = TransferEngine::builder()
        .segment_name("m-off")
        .transports(["local"])
        .env(env(&[]))
        .build()
        .await
        .unwrap();
    assert!(a.metrics_addr().is_none() && a.metrics_registrar().is_none());
    for (var, bad) in [("TE_METRICS_LISTEN", "nowhere"), ("TE_METRICS_TIMEOUT_MS", "0")] {
        let e = TransferEngine::builder()
            .segment_name("m-bad")
            .transports(["local"])
            .env(env(&[(var, bad)]))
            .build()
            .await
            .unwrap_err();
        assert!(e.to_string().contains(var), "{var}: {e}");
    }
}

#[tokio::test]
async fn shutdown_closes_the_endpoint() {
    let e = engine("m-shutdown", &[], None).await;
    let addr = e.metrics_addr().expect("endpoint");
    assert!(!scrape(&e).await.is_empty());
    e.shutdown().await.unwrap();
    // The listener task is aborted at shutdown; within a bound, nothing accepts any more.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match TcpStream::connect(addr).await {
            Err(_) => break,
            Ok(_) if std::time::Instant::now() > deadline => panic!("the endpoint still accepts after shutdown"),
            Ok(_) => tokio::task::yield_now().await,
        }
    }
}
