//! Failover from efa (libfabric's tcp;ofi_rxm provider, real sockets) to tcp between two engines
//! in this process, and warm-up of the efa rails: the efa connection is killed mid-batch by
//! aborting its sockets (`ss -K`, the kernel's socket destroy), and every byte must land anyway,
//! on tcp. Skips, naming what is missing, without libfabric's tcp provider or socket destroy
//! (`TE_REQUIRE=libfabric` turns the first into a failure).
#![cfg(all(feature = "efa", feature = "tcp"))]

use std::sync::Arc;
use std::time::Duration;

use te_base::test_support::{skip_or_fail, socket_destroy};
use te_core::config::MapEnv;
use te_core::metadata::InProcessStore;
use te_core::{HostBufferOptions, Registration, SegmentHandle, TransferEngine, TransferRequest};

const PROVIDER: &str = "tcp;ofi_rxm";
const LEN: u64 = 128 << 20;
const BLOCK: u64 = 256 << 10;

async fn engine(name: &str, store: &InProcessStore) -> Option<TransferEngine> {
    let env = MapEnv::new([
        ("TE_TRANSPORTS", "efa,tcp"),
        ("TE_FABRIC_PROVIDER", PROVIDER),
        ("TE_TCP_LISTEN", "127.0.0.1:0"),
    ]);
    let e = TransferEngine::builder()
        .segment_name(name)
        .metadata(Arc::new(store.clone()))
        .env(Arc::new(env))
        .build()
        .await
        .expect("engine");
    let efa = e
        .transports()
        .iter()
        .find(|t| t.name == "efa")
        .expect("efa compiled in");
    if let Some(why) = &efa.unavailable {
        skip_or_fail("libfabric", &format!("efa over {PROVIDER}: {why}"));
        return None;
    }
    Some(e)
}

/// The port of the target's first efa rail (the tcp provider's address is a `sockaddr_in`).
fn efa_port(desc: &te_core::SegmentDescriptor) -> u16 {
    let ep = desc.endpoint("efa").expect("the target advertises efa");
    let hex = ep["rails"][0]["addr"].as_str().expect("a rail address");
    socket_destroy::sockaddr_in_port(hex).unwrap_or_else(|| panic!("not an IPv4 sockaddr: {hex}"))
}

struct Pair {
    a: TransferEngine,
    _b: TransferEngine,
    src: Registration,
    dst: Registration,
    seg: SegmentHandle,
}

async fn pair() -> Option<Pair> {
    let store = InProcessStore::new();
    let a = engine("efo-a", &store).await?;
    let b = engine("efo-b", &store).await?;
    let dst = b.allocate(LEN as usize, HostBufferOptions::default()).await.unwrap();
    let src = a.allocate(LEN as usize, HostBufferOptions::default()).await.unwrap();
    let seg = a.open_segment("efo-b").await.unwrap();
    Some(Pair {
        a,
        _b: b,
        src,
        dst,
        seg,
    })
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 16) as u8)
        .collect()
}

fn writes(p: &Pair) -> Vec<TransferRequest> {
    let remote = p.seg.buffers()[0].base;
    (0..LEN / BLOCK)
        .map(|k| TransferRequest::write(p.src.addr() + k * BLOCK, p.seg.id(), remote + k * BLOCK, BLOCK))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_up_connects_every_efa_rail_and_the_tcp_route() {
    let Some(p) = pair().await else { return };
    let report = p.a.warm_up(&p.seg).await.expect("warm-up");
    let names: Vec<&str> = report.routes.iter().map(|r| r.transport).collect();
    assert_eq!(names, ["efa", "tcp"], "{report:?}");
    let efa = &report.routes[0];
    assert!(efa.reads >= 1 && efa.unprobed.is_none(), "{efa:?}");
    assert_eq!(report.routes[1].reads, 1, "tcp connects its lanes at open: one read");
    // Nothing of the user's memory moved, and the engine still transfers.
    p.src.write_at(0, &[7u8; 4096]).unwrap();
    let remote = p.seg.buffers()[0].base;
    p.a.transfer(&[TransferRequest::write(p.src.addr(), p.seg.id(), remote, 4096)])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_efa_connection_killed_mid_batch_fails_over_to_tcp_byte_for_byte() {
    if let Err(why) = socket_destroy::available() {
        skip_or_fail("socket-destroy", &why);
        return;
    }
    let Some(p) = pair().await else { return };
    p.a.warm_up(&p.seg).await.expect("warm-up");
    let port = efa_port(p.seg.descriptor());
    let mut failed_over = false;
    // The kill races the batch; a few rounds make sure at least one lands mid-batch.
    for round in 0..5u8 {
        let data = pattern(round);
        p.src.write_at(0, &data).unwrap();
        p.dst.write_at(0, &vec![0u8; LEN as usize]).unwrap();
        let before = p.a.metrics().failovers;
        let batch = p.a.submit(&writes(&p)).unwrap();
        socket_destroy::destroy_port(port).expect("ss -K");
        tokio::time::timeout(Duration::from_secs(60), batch.wait())
            .await
            .expect("bounded")
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let mut got = vec![0u8; LEN as usize];
        p.dst.read_at(0, &mut got).unwrap();
        assert!(got == data, "round {round}: the target's bytes differ");
        failed_over |= p.a.metrics().failovers > before;
        if failed_over {
            break;
        }
    }
    assert!(failed_over, "no kill landed mid-batch in five rounds");
}
