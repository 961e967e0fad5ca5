//! The whole engine choosing its route to a same-host peer: shm first when it is permitted, tcp
//! when cross-memory attach is not (a refused permission probe, a restrictive Yama setting),
//! with the reason reported.

use std::sync::Arc;

use te_base::config::MapEnv;
use te_core::metadata::InProcessStore;
use te_core::{HostBufferOptions, TransferEngine, TransferRequest, UnreachedRoute};

async fn engine(name: &str, store: &Arc<InProcessStore>, extra: &[(&str, &str)]) -> TransferEngine {
    let mut env = MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")]);
    for (k, v) in extra {
        env.0.insert(k.to_string(), v.to_string());
    }
    TransferEngine::builder()
        .segment_name(name)
        .metadata(store.clone())
        .env(Arc::new(env))
        .transports(["shm", "tcp"])
        .build()
        .await
        .unwrap()
}

/// Opens the target from the initiator, writes 1 MiB verified, returns the route names and the
/// transports that refused to connect, with why.
async fn routes_and_transfer(
    target: &TransferEngine,
    initiator: &TransferEngine,
) -> (Vec<&'static str>, Vec<UnreachedRoute>) {
    let dst = target.allocate(1 << 20, HostBufferOptions::default()).await.unwrap();
    let src = initiator.allocate(1 << 20, HostBufferOptions::default()).await.unwrap();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7 + 3) as u8).collect();
    src.write_at(0, &data).unwrap();
    let seg = initiator.open_segment(target.segment_name()).await.unwrap();
    let remote = seg.buffers().iter().find(|b| b.base == dst.addr()).unwrap().base;
    initiator
        .transfer(&[TransferRequest::write(src.addr(), seg.id(), remote, 1 << 20)])
        .await
        .unwrap();
    let mut back = vec![0u8; 1 << 20];
    dst.read_at(0, &mut back).unwrap();
    assert!(back == data, "the bytes arrived");
    let routes = initiator.routes(&seg).unwrap().iter().map(|r| r.transport).collect();
    (routes, initiator.unreached_routes(&seg).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_is_chosen_before_tcp_on_one_host() {
    let store = Arc::new(InProcessStore::new());
    let target = engine("shm-fallback-target-a", &store, &[]).await;
    let initiator = engine("shm-fallback-initiator-a", &store, &[]).await;
    let (routes, unreached) = routes_and_transfer(&target, &initiator).await;
    assert_eq!(routes.first(), Some(&"shm"), "{routes:?}");
    assert!(unreached.is_empty(), "{unreached:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_permission_probe_falls_back_to_tcp() {
    let store = Arc::new(InProcessStore::new());
    let target = engine("shm-fallback-target-b", &store, &[]).await;
    let initiator = engine("shm-fallback-initiator-b", &store, &[("TE_SHM_FAULT_PROBE_ERRNO", "1")]).await;
    let (routes, unreached) = routes_and_transfer(&target, &initiator).await;
    assert_eq!(routes, vec!["tcp"]);
    // The route list says why shm is not one of them.
    assert_eq!(unreached.len(), 1, "{unreached:?}");
    assert_eq!(unreached[0].transport, "shm");
    assert!(
        unreached[0].reason.contains("process_vm_readv") && unreached[0].reason.contains("refused"),
        "{unreached:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restrictive_ptrace_scope_falls_back_to_tcp_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let scope = dir.path().join("ptrace_scope");
    std::fs::write(&scope, "3\n").unwrap();
    let store = Arc::new(InProcessStore::new());
    let target = engine("shm-fallback-target-c", &store, &[]).await;
    let initiator = engine(
        "shm-fallback-initiator-c",
        &store,
        &[("TE_SHM_PTRACE_SCOPE_FILE", scope.to_str().unwrap())],
    )
    .await;
    let shm = initiator.transports().iter().find(|t| t.name == "shm").unwrap();
    let why = shm.unavailable.as_deref().expect("shm is reported unusable");
    assert!(why.contains("ptrace_scope is 3"), "{why}");
    let (routes, _) = routes_and_transfer(&target, &initiator).await;
    assert_eq!(routes, vec!["tcp"]);
}

/// `allocate` backs host memory with a sealed memfd when the shm transport runs (peers map it);
/// `TE_SHM_MEMFD=0`, or an engine without shm, allocates anonymous memory; an explicit backing
/// is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_allocates_memfds_for_shm_unless_turned_off() {
    use te_base::shared_memory::memfd_of;
    let store = Arc::new(InProcessStore::new());
    let on = engine("shm-memfd-on", &store, &[]).await;
    let off = engine("shm-memfd-off", &store, &[("TE_SHM_MEMFD", "0")]).await;
    let tcp_only = TransferEngine::builder()
        .segment_name("shm-memfd-tcp-only")
        .metadata(store.clone())
        .env(Arc::new(MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")])))
        .transports(["tcp"])
        .build()
        .await
        .unwrap();
    let shared = |e: &TransferEngine, opts: HostBufferOptions| {
        let e = e.clone();
        async move {
            let r = e.allocate(1 << 20, opts).await.unwrap();
            memfd_of(r.addr(), 1 << 20).is_some()
        }
    };
    assert!(shared(&on, HostBufferOptions::default()).await);
    assert!(!shared(&off, HostBufferOptions::default()).await);
    assert!(!shared(&tcp_only, HostBufferOptions::default()).await);
    let anon = HostBufferOptions {
        backing: te_core::HostBacking::Anonymous,
        ..Default::default()
    };
    assert!(!shared(&on, anon).await, "an explicit backing is kept");
    let memfd = HostBufferOptions {
        backing: te_core::HostBacking::Memfd,
        ..Default::default()
    };
    assert!(shared(&off, memfd).await);
    // Transparent huge pages asked for (a DRAM arena): a memfd only where the kernel gives shared
    // memory huge pages, anonymous memory otherwise (a memfd's 4 KiB pages made first writes 6-9x
    // slower).
    let thp = HostBufferOptions {
        huge_pages: te_core::HugePages::Transparent,
        ..Default::default()
    };
    assert_eq!(
        shared(&on, thp).await,
        te_base::host_buffer::shmem_takes_huge_pages(),
        "transparent huge pages with shmem_enabled {:?}",
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()
    );
    // A malformed setting is the engine's configuration error, not a silent default.
    let bad = TransferEngine::builder()
        .segment_name("shm-memfd-bad")
        .metadata(store.clone())
        .env(Arc::new(MapEnv::new([("TE_SHM_MEMFD", "sometimes")])))
        .transports(["shm"])
        .build()
        .await;
    assert!(bad.is_err());
}
