//! One metadata test suite (`pub async fn`s taking `&dyn MetadataStore`, with backend differences
//! passed as flags) run against every backend: in-process, peer-to-peer and etcd (a real
//! etcd-server started on a loopback port in a temporary directory).

use std::sync::Arc;
use std::time::Duration;

use te_base::{Error, ExportedBuffer, MemoryLocation, MetadataStore, SegmentDescriptor, TransportEndpoint};
use te_core::metadata::p2p::P2pStore;
use te_core::metadata::InProcessStore;

/// What differs between backends.
#[derive(Debug, Clone, Copy)]
pub struct Flags {
    /// Whether a store sees descriptors published through another store of the same cluster
    /// by their plain name (etcd: yes; in-process: only clones of one store; p2p: no, those are
    /// fetched by address).
    pub shared_by_name: bool,
}

fn descriptor(name: &str, instance: u64, buffers: u64) -> SegmentDescriptor {
    let mut d = SegmentDescriptor::new(name, instance);
    d.transports.push(TransportEndpoint {
        transport: "tcp".into(),
        info: serde_json::json!({"addrs": ["127.0.0.1:9"], "token": instance}),
    });
    for i in 0..buffers {
        d.buffers.push(ExportedBuffer {
            base: 0x10000 + i * 0x2000,
            len: 0x1000,
            location: MemoryLocation::HOST,
            keys: Default::default(),
        });
    }
    d
}

/// Publish, fetch, replace, remove.
pub async fn round_trip(store: &dyn MetadataStore, prefix: &str) {
    let name = format!("{prefix}-rt");
    let d = descriptor(&name, 1, 3);
    store.publish(&d).await.unwrap();
    assert_eq!(store.fetch(&name).await.unwrap(), d, "{}", store.name());
    let d2 = descriptor(&name, 2, 5);
    store.publish(&d2).await.unwrap();
    assert_eq!(store.fetch(&name).await.unwrap(), d2, "{}: replaced", store.name());
    store.remove(&name).await.unwrap();
    assert!(matches!(store.fetch(&name).await, Err(Error::UnknownSegment(n)) if n == name));
    // Removing again is not an error.
    store.remove(&name).await.unwrap();
}

/// Unknown names are `UnknownSegment`.
pub async fn unknown_segment(store: &dyn MetadataStore, prefix: &str) {
    let name = format!("{prefix}-nobody");
    assert!(matches!(store.fetch(&name).await, Err(Error::UnknownSegment(n)) if n == name));
}

/// Invalid descriptors are refused on publish and nothing is stored.
pub async fn invalid_descriptors_are_refused(store: &dyn MetadataStore, prefix: &str) {
    let name = format!("{prefix}-bad");
    let mut d = descriptor(&name, 1, 2);
    d.buffers[1].base = d.buffers[0].base; // overlapping buffers
    assert!(matches!(store.publish(&d).await, Err(Error::InvalidDescriptor(_))));
    let mut d = descriptor(&name, 1, 1);
    d.version = 999;
    assert!(matches!(store.publish(&d).await, Err(Error::InvalidDescriptor(_))));
    assert!(matches!(store.fetch(&name).await, Err(Error::UnknownSegment(_))));
}

/// Many segments side by side; each is fetched as published.
pub async fn many_segments(store: &dyn MetadataStore, prefix: &str) {
    let names: Vec<String> = (0..20).map(|i| format!("{prefix}-many-{i}")).collect();
    for (i, n) in names.iter().enumerate() {
        store
            .publish(&descriptor(n, i as u64 + 100, i as u64 % 4))
            .await
            .unwrap();
    }
    for (i, n) in names.iter().enumerate() {
        assert_eq!(store.fetch(n).await.unwrap().instance, i as u64 + 100);
    }
    for n in &names {
        store.remove(n).await.unwrap();
    }
}

/// A large descriptor (10k buffers) survives the trip intact.
pub async fn large_descriptor(store: &dyn MetadataStore, prefix: &str) {
    let name = format!("{prefix}-large");
    let d = descriptor(&name, 7, 10_000);
    store.publish(&d).await.unwrap();
    assert_eq!(store.fetch(&name).await.unwrap(), d);
    store.remove(&name).await.unwrap();
}

/// A second store of the same cluster sees what the first published (and its replacement).
pub async fn visible_across_stores(a: &dyn MetadataStore, b: &dyn MetadataStore, prefix: &str, flags: Flags) {
    if !flags.shared_by_name {
        return;
    }
    let name = format!("{prefix}-shared");
    a.publish(&descriptor(&name, 1, 1)).await.unwrap();
    assert_eq!(b.fetch(&name).await.unwrap().instance, 1);
    a.remove(&name).await.unwrap();
    assert!(matches!(b.fetch(&name).await, Err(Error::UnknownSegment(_))));
}

/// Every check against one store (and a second store of the same cluster).
pub async fn run_all(a: &dyn MetadataStore, b: &dyn MetadataStore, prefix: &str, flags: Flags) {
    round_trip(a, prefix).await;
    unknown_segment(a, prefix).await;
    invalid_descriptors_are_refused(a, prefix).await;
    many_segments(a, prefix).await;
    large_descriptor(a, prefix).await;
    visible_across_stores(a, b, prefix, flags).await;
}

// ---------------------------------------------------------------------------------------------
// In-process

#[tokio::test]
async fn in_process_passes_the_suite() {
    let a = InProcessStore::new();
    let b = a.clone();
    run_all(&a, &b, "inproc", Flags { shared_by_name: true }).await;
}

// ---------------------------------------------------------------------------------------------
// Peer-to-peer

async fn p2p() -> P2pStore {
    P2pStore::bind("127.0.0.1:0".parse().unwrap(), Duration::from_secs(5))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_passes_the_suite() {
    let a = p2p().await;
    let b = p2p().await;
    run_all(&a, &b, "p2p", Flags { shared_by_name: false }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_fetches_directly_from_the_peer_by_address() {
    let a = p2p().await;
    let b = p2p().await;
    let addr = a.local_addr().to_string();
    // Nothing published yet.
    assert!(matches!(b.fetch(&addr).await, Err(Error::UnknownSegment(_))));
    let d = descriptor("node-a", 1, 2);
    a.publish(&d).await.unwrap();
    a.publish(&descriptor("node-a-2", 5, 1)).await.unwrap();
    // "host:port" is the peer's primary (first published) segment; "name@host:port" any other.
    assert_eq!(b.fetch(&addr).await.unwrap(), d);
    assert_eq!(b.fetch(&format!("node-a-2@{addr}")).await.unwrap().instance, 5);
    assert!(matches!(
        b.fetch(&format!("ghost@{addr}")).await,
        Err(Error::UnknownSegment(_))
    ));
    // The peer republishes (a new instance): the next fetch sees it.
    a.publish(&descriptor("node-a", 2, 2)).await.unwrap();
    assert_eq!(b.fetch(&addr).await.unwrap().instance, 2);
    // The peer goes away: fetching by its address is an error naming it.
    drop(a);
    let err = b.fetch(&addr).await.unwrap_err();
    assert!(err.to_string().contains(&addr), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_rejects_hostile_answers() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let b = p2p().await;
    // A fake peer that answers with a malformed descriptor, then one announcing a huge payload,
    // then one that does not speak the protocol.
    let answers: Vec<Vec<u8>> = vec![
        {
            let body = br#"{"version":1,"name":"x","instance":1,"transports":[],"buffers":[{"base":0,"len":0,"location":{"kind":"host","numa":null}}]}"#;
            let mut v = b"TEmd\x01\x00".to_vec();
            v.extend_from_slice(&(body.len() as u32).to_le_bytes());
            v.extend_from_slice(body);
            v
        },
        {
            let mut v = b"TEmd\x01\x00".to_vec();
            v.extend_from_slice(&u32::MAX.to_le_bytes());
            v
        },
        b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(),
    ];
    for answer in answers {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 8];
            let _ = s.read_exact(&mut req).await;
            let _ = s.write_all(&answer).await;
        });
        let err = b.fetch(&addr).await.unwrap_err();
        assert!(matches!(err, Error::InvalidDescriptor(_) | Error::Metadata(_)), "{err}");
        server.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2p_configuration_is_strict() {
    use te_base::config::MapEnv;
    let err = P2pStore::from_env(&MapEnv::new([("TE_P2P_LISTEN", "nowhere")]))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("TE_P2P_LISTEN"));
    let err = P2pStore::from_env(&MapEnv::new([("TE_P2P_TIMEOUT_MS", "0")]))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("TE_P2P_TIMEOUT_MS"));
    let ok = P2pStore::from_env(&MapEnv::new([("TE_P2P_LISTEN", "127.0.0.1:0")]))
        .await
        .unwrap();
    assert!(ok.local_addr().ip().is_loopback());
}

// ---------------------------------------------------------------------------------------------
// etcd

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use te_base::test_support::etcd::EtcdServer;
    use te_core::metadata::etcd::{EtcdConfig, EtcdStore, SegmentEvent};

    async fn store(server: &EtcdServer, prefix: &str, ttl: i64) -> EtcdStore {
        let mut c = EtcdConfig::new(vec![server.endpoint.clone()]);
        c.prefix = prefix.into();
        c.lease_ttl_s = ttl;
        EtcdStore::connect(c).await.unwrap()
    }

    async fn next_event(rx: &mut tokio::sync::broadcast::Receiver<SegmentEvent>, want: &SegmentEvent) {
        let found = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match rx.recv().await {
                    Ok(ev) if &ev == want => return,
                    Ok(_) => continue,
                    Err(e) => panic!("watch channel: {e}"),
                }
            }
        })
        .await;
        assert!(found.is_ok(), "no {want:?} within 30 s");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_passes_the_suite_and_sees_restarts_and_deaths() {
        let Some(server) = EtcdServer::start_on_loopback() else {
            return;
        };
        let a = store(&server, "/te-test/cluster-1", 10).await;
        let b = store(&server, "/te-test/cluster-1", 10).await;
        run_all(&a, &b, "etcd", Flags { shared_by_name: true }).await;

        // Another cluster id does not see cluster-1's segments.
        let other = store(&server, "/te-test/cluster-2", 10).await;
        a.publish(&descriptor("seg-iso", 1, 1)).await.unwrap();
        assert!(matches!(other.fetch("seg-iso").await, Err(Error::UnknownSegment(_))));

        // A restarted peer (new instance) is picked up through the watch.
        let mut events = b.subscribe();
        let first = store(&server, "/te-test/cluster-1", 10).await;
        first.publish(&descriptor("node-x", 1, 1)).await.unwrap();
        next_event(
            &mut events,
            &SegmentEvent::Published {
                name: "node-x".into(),
                instance: 1,
            },
        )
        .await;
        assert_eq!(b.fetch("node-x").await.unwrap().instance, 1);
        first.close().await.unwrap();
        next_event(&mut events, &SegmentEvent::Removed { name: "node-x".into() }).await;
        let second = store(&server, "/te-test/cluster-1", 10).await;
        second.publish(&descriptor("node-x", 2, 1)).await.unwrap();
        next_event(
            &mut events,
            &SegmentEvent::Published {
                name: "node-x".into(),
                instance: 2,
            },
        )
        .await;
        assert_eq!(b.cached("node-x").unwrap().instance, 2);
        assert_eq!(b.fetch("node-x").await.unwrap().instance, 2);

        // An engine that dies without closing: its lease runs out and its segment disappears.
        let dying = store(&server, "/te-test/cluster-1", 2).await;
        dying.publish(&descriptor("node-dying", 9, 1)).await.unwrap();
        next_event(
            &mut events,
            &SegmentEvent::Published {
                name: "node-dying".into(),
                instance: 9,
            },
        )
        .await;
        drop(dying);
        next_event(
            &mut events,
            &SegmentEvent::Removed {
                name: "node-dying".into(),
            },
        )
        .await;
        assert!(b.cached("node-dying").is_none());
        assert!(matches!(b.fetch("node-dying").await, Err(Error::UnknownSegment(_))));

        // A hostile value written straight into etcd is an error for that segment only.
        let mut raw = etcd_client::Client::connect([&server.endpoint], None).await.unwrap();
        raw.put("/te-test/cluster-1/segments/evil", "{\"version\":1", None)
            .await
            .unwrap();
        let fresh = store(&server, "/te-test/cluster-1", 10).await;
        assert!(matches!(fresh.fetch("evil").await, Err(Error::InvalidDescriptor(_))));
        assert_eq!(fresh.fetch("node-x").await.unwrap().instance, 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreachable_etcd_is_an_error_not_a_hang() {
        let mut c = EtcdConfig::new(vec![format!(
            "http://127.0.0.1:{}",
            te_base::test_support::free_port().unwrap()
        )]);
        c.timeout = Duration::from_millis(500);
        let err = EtcdStore::connect(c).await.unwrap_err();
        assert!(matches!(err, Error::Metadata(_) | Error::Timeout { .. }), "{err}");
    }
}

#[allow(dead_code)]
fn _assert_object_safe(_: Arc<dyn MetadataStore>) {}

#[test]
fn p2p_outside_a_runtime_is_an_error_not_a_panic() {
    let fut = P2pStore::bind("127.0.0.1:0".parse().unwrap(), Duration::from_secs(1));
    let err = futures::executor::block_on(fut).unwrap_err();
    assert!(err.to_string().contains("tokio runtime"), "{err}");
}
