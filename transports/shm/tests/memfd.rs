//! The mapped path: the target's engine-allocated memory is a sealed memfd, sent once over the
//! control socket and mapped by the initiator, which copies with the local transport's kernels.
//! Target in a `te-shm-peer` child (`TE_SHM_MEMFD=1`), bytes checked by the process that
//! received them; the route taken is read from the initiator's route counters, not timed.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::*;
use te_base::config::MapEnv;
use te_base::{
    Error, HostBacking, HostBuffer, HostBufferOptions, MemoryLocation, NotifyInbox, NotifyLimits, RegionId, RegionInfo,
    RequestStatus, TransferOp, Transport,
};
use te_transport_shm::{ShmConfig, ShmTransport};

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

const MEMFD: &[(&str, &str)] = &[("TE_SHM_MEMFD", "1")];

/// Mappings of the engine's memfds (`memfd:te-host`) in this process right now.
fn memfd_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:te-host"))
        .count()
}

fn dyn_t(t: &Arc<ShmTransport>) -> Arc<dyn Transport> {
    t.clone()
}

#[test]
fn engine_allocated_memory_is_mapped_and_copied_byte_for_byte() {
    let _t = turn();
    let len = 64u64 << 20;
    let mut target = PeerProcess::start(len, 1, MEMFD);
    let a = shm_initiator(&[]);
    let local = Local::new(&dyn_t(&a), 1, len as usize, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    let base = target.base();
    assert_eq!(
        a.route_counters().mapped_regions,
        1,
        "the target's memfd is mapped at connect"
    );
    let cases = [
        (3u64, 1u64),
        (5000, 4097),
        (1 << 20, 65_537),
        ((8 << 20) + 1, (3 << 20) + 5),
    ];
    let reqs = cases
        .iter()
        .enumerate()
        .map(|(i, &(off, n))| request(i as u32, TransferOp::Write, &local, off, base + off, n))
        .collect();
    assert!(all_done(&run(&peer, reqs)));
    for &(off, n) in &cases {
        assert_eq!(target.mismatched(off, n, 2), 0, "{n} B at {off}");
    }
    assert_eq!(target.mismatched(0, 3, 1), 0, "bytes around the writes are untouched");
    assert_eq!(target.mismatched(4, 4996, 1), 0);
    // 10,000 KV-sized fragments, scattered on the remote side.
    let frag = 1728u64;
    let n = 10_000u64;
    let reqs = (0..n)
        .map(|i| {
            let slot = (i * 7919) % n;
            request(i as u32, TransferOp::Write, &local, i * frag, base + slot * frag, frag)
        })
        .collect();
    assert!(all_done(&run(&peer, reqs)));
    for i in 0..n {
        let slot = (i * 7919) % n;
        assert_eq!(
            target.mismatched_from(slot * frag, frag, 2, i * frag),
            0,
            "fragment {i}"
        );
    }
    // The whole buffer in 1 MiB writes (shared by the copy threads), then read back.
    target.ask("fill 1");
    let whole = |op| {
        (0..64u64)
            .map(|i| request(i as u32, op, &local, i << 20, base + (i << 20), 1 << 20))
            .collect()
    };
    assert!(all_done(&run(&peer, whole(TransferOp::Write))));
    assert_eq!(target.mismatched(0, len, 2), 0);
    target.ask("fill 3");
    assert!(all_done(&run(&peer, whole(TransferOp::Read))));
    assert_eq!(local.mismatched(0, len, 3, 0), 0);
    let c = a.route_counters();
    let moved: u64 = cases.iter().map(|c| c.1).sum::<u64>() + n * frag + 2 * len;
    assert_eq!(c.mapped_bytes, moved, "every byte went through the mapping: {c:?}");
    assert_eq!(c.cma_bytes, 0, "{c:?}");
    assert_eq!(c.fds_refused, 0);
}

#[test]
fn anonymous_memory_and_a_memfd_off_initiator_go_by_cross_memory_attach() {
    let _t = turn();
    let len = 1u64 << 20;
    // The target allocates anonymous memory: nothing to map.
    let mut anon = PeerProcess::start(len, 1, &[("TE_SHM_MEMFD", "0")]);
    let a = shm_initiator(&[]);
    let local = Local::new(&dyn_t(&a), 1, len as usize, 2);
    let peer = block_on(a.connect(&anon.descriptor)).unwrap();
    assert!(all_done(&run(
        &peer,
        vec![request(0, TransferOp::Write, &local, 0, anon.base(), len)]
    )));
    assert_eq!(anon.mismatched(0, len, 2), 0);
    let c = a.route_counters();
    assert_eq!((c.mapped_bytes, c.cma_bytes, c.mapped_regions), (0, len, 0), "{c:?}");
    // An initiator with TE_SHM_MEMFD=0 maps nothing, even from a target that sends its memfd.
    let mut shared = PeerProcess::start(len, 1, MEMFD);
    let b = shm_initiator(&[("TE_SHM_MEMFD", "0")]);
    let local_b = Local::new(&dyn_t(&b), 1, len as usize, 4);
    let peer = block_on(b.connect(&shared.descriptor)).unwrap();
    assert!(all_done(&run(
        &peer,
        vec![request(0, TransferOp::Write, &local_b, 0, shared.base(), len)]
    )));
    assert_eq!(shared.mismatched(0, len, 4), 0);
    let c = b.route_counters();
    assert_eq!((c.mapped_bytes, c.cma_bytes, c.mapped_regions), (0, len, 0), "{c:?}");
}

#[test]
fn a_deregistered_mapped_region_is_unmapped_and_never_touched_again() {
    let _t = turn();
    let len = 1u64 << 20;
    let mut target = PeerProcess::start(len, 1, MEMFD);
    let a = shm_initiator(&[]);
    let local = Local::new(&dyn_t(&a), 1, len as usize, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    let base = target.base();
    assert!(all_done(&run(
        &peer,
        vec![request(0, TransferOp::Write, &local, 0, base, 4096)]
    )));
    assert_eq!(a.route_counters().mapped_regions, 1);
    assert_eq!(memfd_mappings(), 1, "our one mapping of the target's memfd");
    // Returns once this initiator confirmed, which it does after unmapping.
    assert_eq!(target.ask("deregister"), "ok");
    assert_eq!(a.route_counters().mapped_regions, 0);
    assert_eq!(memfd_mappings(), 0, "the mapping is gone from this process");
    target.ask("fill 5");
    for op in [TransferOp::Write, TransferOp::Read] {
        let s = run(&peer, vec![request(0, op, &local, 0, base, len)]);
        assert!(
            matches!(&s[0], RequestStatus::Failed(Error::Refused { .. })),
            "{op}: {:?}",
            s[0]
        );
    }
    assert_eq!(target.mismatched(0, len, 5), 0, "no byte of the revoked buffer changed");
    assert!(peer.is_healthy(), "a refusal does not cut the connection");
    assert_eq!(a.route_counters().mapped_bytes, 4096);
}

/// 64 GiB in 64 KiB writes over a 64 MiB target: still running when the event below comes.
fn long_batch(peer: &Arc<dyn te_base::Peer>, local: &Local, base: u64, len: u64) -> te_base::Batch {
    let n: u32 = 1 << 20;
    let reqs = (0..n)
        .map(|i| {
            let off = (u64::from(i) * 65_536) % len;
            request(i, TransferOp::Write, local, off, base + off, 65_536)
        })
        .collect();
    let batch = submit(peer, reqs);
    let started = Instant::now();
    while batch.poll().done == 0 {
        assert_eq!(batch.poll().failed, 0, "failures before the event");
        assert!(started.elapsed() < HANG_GUARD, "no progress");
        std::thread::yield_now();
    }
    batch
}

#[test]
fn a_revocation_during_a_long_mapped_batch_is_confirmed_and_stops_it() {
    let _t = turn();
    let len = 64u64 << 20;
    let mut target = PeerProcess::start(len, 1, MEMFD);
    let a = shm_initiator(&[]);
    let local = Local::new(&dyn_t(&a), 1, len as usize, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    let batch = long_batch(&peer, &local, target.base(), len);
    assert_eq!(target.ask("deregister"), "ok");
    assert_eq!(target.ask("connections"), "1", "confirmed in time, not cut");
    assert_eq!(memfd_mappings(), 0, "unmapped when confirmed");
    target.ask("fill 9");
    let _ = batch.wait_blocking(Some(HANG_GUARD)).expect("the batch settles");
    let last = batch.status((1 << 20) - 1);
    assert!(
        matches!(&last, Some(RequestStatus::Failed(Error::Refused { .. }))),
        "{last:?}"
    );
    assert_eq!(
        target.mismatched(0, len, 9),
        0,
        "no byte written after the revocation returned"
    );
    assert!(a.route_counters().mapped_bytes > 0);
    assert!(peer.is_healthy());
}

#[test]
fn a_target_killed_mid_mapped_batch_fails_the_batch_and_nothing_hangs() {
    let _t = turn();
    let len = 64u64 << 20;
    let mut target = PeerProcess::start(len, 1, MEMFD);
    let a = shm_initiator(&[]);
    let local = Local::new(&dyn_t(&a), 1, len as usize, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    let base = target.base();
    let batch = long_batch(&peer, &local, base, len);
    target.kill();
    let report = batch
        .wait_blocking(Some(HANG_GUARD))
        .expect("the batch settles after the kill");
    report.expect_err("a batch whose target died cannot succeed");
    let last = batch.status((1 << 20) - 1);
    assert!(
        matches!(&last, Some(RequestStatus::Failed(Error::PeerGone { .. }))),
        "{last:?}"
    );
    assert!(!peer.is_healthy());
    let after = run(&peer, vec![request(0, TransferOp::Write, &local, 0, base, 16)]);
    assert!(
        matches!(&after[0], RequestStatus::Failed(Error::PeerGone { .. })),
        "{after:?}"
    );
    assert!(a.route_counters().mapped_bytes > 0, "the batch ran on the mapping");
    // The mapping of a dead target's memfd stays valid memory (sealed: no SIGBUS); dropping the
    // connection unmaps it.
    drop(peer);
}

/// One batch over two target regions, one a memfd and one anonymous: each request goes by its
/// region's route (two transports of this process, as in the conformance test).
#[test]
fn the_route_is_chosen_per_region_within_one_batch() {
    let _t = turn();
    let start = || {
        let config = ShmConfig::from_env(&MapEnv::default()).unwrap();
        Arc::new(ShmTransport::start(config, None, NotifyInbox::new(NotifyLimits::default())).unwrap())
    };
    let (a, t) = (start(), start());
    let len = 1usize << 20;
    let alloc = |backing| {
        HostBuffer::allocate(
            len,
            HostBufferOptions {
                backing,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let (shared, anon) = (alloc(HostBacking::Memfd), alloc(HostBacking::Anonymous));
    let info = |id, b: &HostBuffer| RegionInfo {
        id: RegionId(id),
        base: b.addr(),
        len: len as u64,
        location: MemoryLocation::HOST,
        exported: true,
    };
    let regions = [info(1, &shared), info(2, &anon)];
    block_on(t.register(&regions)).unwrap();
    let mut d = te_base::SegmentDescriptor::new("per-region", 7);
    d.transports.push(te_base::TransportEndpoint {
        transport: "shm".into(),
        info: t.endpoint(),
    });
    d.buffers.push(te_base::ExportedBuffer::of_region(&regions[0]));
    d.buffers.push(te_base::ExportedBuffer::of_region(&regions[1]));
    let local = Local::new(&dyn_t(&a), 10, 2 * len, 6);
    let peer = block_on(a.connect(&d)).unwrap();
    // Interleaved 64 KiB writes: even ones to the memfd region, odd ones to the anonymous one.
    let reqs = (0..32u32)
        .map(|i| {
            let (buf, remote) = if i % 2 == 0 {
                (0, shared.addr())
            } else {
                (1, anon.addr())
            };
            let off = u64::from(i / 2) * 65_536;
            let mut r = request(
                i,
                TransferOp::Write,
                &local,
                u64::from(i) * 65_536,
                remote + off,
                65_536,
            );
            r.remote_buffer = buf;
            r
        })
        .collect();
    assert!(all_done(&run(&peer, reqs)));
    for i in 0..32u64 {
        let b = if i % 2 == 0 { &shared } else { &anon };
        // SAFETY: read after the batch completed; the buffers are live.
        let got = unsafe { std::slice::from_raw_parts(b.as_ptr().add((i / 2 * 65_536) as usize), 65_536) };
        let bad = got
            .iter()
            .enumerate()
            .filter(|(k, v)| **v != te_base::pattern::pattern(6, i * 65_536 + *k as u64))
            .count();
        assert_eq!(bad, 0, "request {i}");
    }
    let c = a.route_counters();
    assert_eq!((c.mapped_bytes, c.cma_bytes), (16 * 65_536, 16 * 65_536), "{c:?}");
    assert_eq!(c.mapped_regions, 1);
}
