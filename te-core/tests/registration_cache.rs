//! The registration cache (issue 27): a range inside a registered region gets a handle of its own
//! that shares the covering registration; the covering registration is released to the
//! transports only when its last handle goes.

use std::collections::BTreeSet;
use std::sync::Arc;

use te_core::config::MapEnv;
use te_core::{
    Error, HostBufferOptions, MemoryLocation, RegisterOptions, Registration, RequestStatus, TransferEngine,
    TransferRequest,
};

#[allow(dead_code)] // the shared test transport's other controls serve other test files
mod common;
use common::{local_engine, manual_engine, ManualTransport};

fn opts() -> HostBufferOptions {
    HostBufferOptions::default()
}

/// Registers `[addr, addr + len)` of memory the test keeps alive past the engine's use of it.
async fn view(e: &TransferEngine, addr: u64, len: u64, reg: RegisterOptions) -> te_core::Result<Registration> {
    // SAFETY: every caller passes a range inside a buffer (an engine allocation or a Vec) that
    // lives until the end of its test, after every handle of it was released.
    unsafe { e.register_raw(addr, len, MemoryLocation::HOST, reg) }.await
}

#[tokio::test]
async fn views_of_a_registered_pool_share_its_registration() {
    let manual = ManualTransport::new();
    let e = manual_engine("cache-views", &manual).await;
    let pool = e.allocate(1 << 20, opts()).await.unwrap();
    assert_eq!(manual.registered_total(), 1);
    let descriptor_before = e.descriptor();
    let mut views = Vec::new();
    for i in 0..64u64 {
        let v = view(&e, pool.addr() + i * 16384, 16384, RegisterOptions::default())
            .await
            .unwrap();
        assert!(v.is_view());
        assert_eq!((v.addr(), v.len()), (pool.addr() + i * 16384, 16384));
        assert_eq!(v.covering(), (pool.addr(), 1 << 20));
        assert_eq!(v.id(), pool.id());
        views.push(v);
    }
    assert!(!pool.is_view());
    // No transport registration and no descriptor change for the views.
    assert_eq!(manual.registered_total(), 1);
    assert_eq!(manual.registered(), BTreeSet::from([pool.addr()]));
    let after = e.descriptor();
    assert_eq!(after.buffers.len(), 1);
    assert_eq!(after.buffers[0].base, descriptor_before.buffers[0].base);
    assert_eq!(after.buffers[0].len, descriptor_before.buffers[0].len);
    assert_eq!(e.metrics().registration_cache_hits, 64);
    // A view's handle validates against the view's own range, not the pool's.
    let v = &views[3];
    v.write_at(16384 - 8, &[1u8; 8]).unwrap();
    let err = v.write_at(16384 - 8, &[1u8; 9]).unwrap_err();
    assert!(
        matches!(err, Error::PartlyRegistered { region_base, region_len, .. }
            if region_base == v.addr() && region_len == 16384),
        "{err}"
    );
    // The same range twice is two handles of one registration.
    let again = view(&e, views[0].addr(), 16384, RegisterOptions::default())
        .await
        .unwrap();
    assert!(again.is_view());
    assert_eq!(manual.registered_total(), 1);
}

#[tokio::test]
async fn the_covering_registration_lives_until_its_last_handle_goes() {
    let manual = ManualTransport::new();
    manual.complete_all_later();
    let e = manual_engine("cache-last", &manual).await;
    let pool = e.allocate(1 << 16, opts()).await.unwrap();
    let pool_addr = pool.addr();
    let a = view(&e, pool_addr, 4096, RegisterOptions::default()).await.unwrap();
    let b = view(&e, pool_addr + 8192, 4096, RegisterOptions::default())
        .await
        .unwrap();
    // Deregistering the pool's own handle while views live releases that handle only.
    pool.deregister().await.unwrap();
    assert_eq!(manual.registered(), BTreeSet::from([pool_addr]));
    assert_eq!(e.descriptor().buffers.len(), 1);
    let me = e.open_segment("cache-last").await.unwrap();
    a.write_at(0, &[9u8; 4096]).unwrap();
    e.transfer(&[TransferRequest::write(a.addr(), me.id(), b.addr(), 4096)])
        .await
        .unwrap();
    let mut out = [0u8; 4096];
    b.read_at(0, &mut out).unwrap();
    assert_eq!(out, [9u8; 4096], "the views' memory stayed registered and valid");
    a.deregister().await.unwrap();
    assert_eq!(manual.registered(), BTreeSet::from([pool_addr]));
    // The last handle releases the covering registration, from the transports and the descriptor.
    b.deregister().await.unwrap();
    assert!(manual.registered().is_empty());
    assert!(e.descriptor().buffers.is_empty());
    let err = e
        .submit(&[TransferRequest::write(pool_addr, me.id(), pool_addr + 4096, 64)])
        .unwrap_err();
    assert!(matches!(err, Error::Unregistered { .. }), "{err}");
}

#[tokio::test]
async fn a_view_cannot_differ_from_its_covering_region() {
    let e = local_engine("cache-mismatch", &[]).await;
    let pool = e.allocate(1 << 16, opts()).await.unwrap();
    let err = view(&e, pool.addr() + 4096, 4096, RegisterOptions::local_only())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::RegistrationMismatch { what: "export", region_base, .. } if *region_base == pool.addr()),
        "{err}"
    );
    assert!(err.to_string().contains("export differs"), "{err}");
    // SAFETY: refused before the memory is used (the location differs from the pool's).
    let err = unsafe {
        e.register_raw(
            pool.addr(),
            4096,
            MemoryLocation::Cuda { device: 0 },
            RegisterOptions::default(),
        )
    }
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::RegistrationMismatch { what: "location", .. }),
        "{err}"
    );

    // Host NUMA nodes: two named nodes must agree; an unnamed one matches.
    let mut mem = vec![0u8; 1 << 16];
    let base = mem.as_mut_ptr() as u64;
    // SAFETY: `mem` outlives every handle of it (all dropped before it, at the end of the test).
    let numa0 = unsafe {
        e.register_raw(
            base,
            1 << 16,
            MemoryLocation::Host { numa: Some(0) },
            RegisterOptions::local_only(),
        )
    }
    .await
    .unwrap();
    // SAFETY: as above.
    let err = unsafe {
        e.register_raw(
            base + 64,
            64,
            MemoryLocation::Host { numa: Some(1) },
            RegisterOptions::local_only(),
        )
    }
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::RegistrationMismatch { what: "location", .. }),
        "{err}"
    );
    let unnamed = view(&e, base + 64, 64, RegisterOptions::local_only()).await.unwrap();
    assert_eq!(unnamed.location(), MemoryLocation::Host { numa: Some(0) });
    assert_eq!(e.metrics().registration_cache_hits, 1);
    drop((unnamed, numa0, pool));
}

#[tokio::test]
async fn a_range_overlapping_a_region_without_lying_inside_it_names_that_region() {
    let e = local_engine("cache-overlap", &[]).await;
    let pool = e.allocate(8192, opts()).await.unwrap();
    let err = view(&e, pool.addr() + 4096, 8192, RegisterOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::AlreadyRegistered { region_base, region_len: 8192, .. } if region_base == pool.addr()),
        "{err}"
    );
    // A range containing the region is no merge either.
    let mut mem = vec![0u8; 3 << 12];
    let base = mem.as_mut_ptr() as u64;
    let inner = view(&e, base + 4096, 4096, RegisterOptions::default()).await.unwrap();
    let err = view(&e, base, 3 << 12, RegisterOptions::default()).await.unwrap_err();
    assert!(
        matches!(err, Error::AlreadyRegistered { region_base, .. } if region_base == base + 4096),
        "{err}"
    );
    // Within one batch: nested items share, crossing ones are refused.
    let err = {
        let items = [
            te_core::RawRegion {
                addr: base + 8192,
                len: 2048,
                location: MemoryLocation::HOST,
            },
            te_core::RawRegion {
                addr: base + 9216,
                len: 2048,
                location: MemoryLocation::HOST,
            },
        ];
        // SAFETY: `mem` outlives the attempt, which is refused.
        unsafe { e.register_raw_batch(&items, RegisterOptions::default()) }
            .await
            .unwrap_err()
    };
    assert!(
        matches!(err, Error::AlreadyRegistered { region_base, region_len: 2048, .. } if region_base == base + 8192),
        "{err}"
    );
    drop(inner);
    drop(mem);
}

#[tokio::test]
async fn a_batch_holding_a_pool_and_its_views_registers_the_pool_once() {
    let manual = ManualTransport::new();
    let e = manual_engine("cache-batch", &manual).await;
    let mut mem = vec![0u8; 1 << 16];
    let base = mem.as_mut_ptr() as u64;
    let region = |off: u64, len: u64| te_core::RawRegion {
        addr: base + off,
        len,
        location: MemoryLocation::HOST,
    };
    // Views before and after their pool in the list; the answer keeps the caller's order.
    let items = [
        region(4096, 4096),
        region(0, 1 << 16),
        region(0, 128),
        region(60000, 5536),
    ];
    // SAFETY: `mem` outlives every handle (dropped below, before it).
    let regs = unsafe { e.register_raw_batch(&items, RegisterOptions::default()) }
        .await
        .unwrap();
    assert_eq!(manual.registered_total(), 1);
    assert_eq!(manual.registered(), BTreeSet::from([base]));
    let shape: Vec<(u64, u64, bool)> = regs.iter().map(|r| (r.addr(), r.len(), r.is_view())).collect();
    assert_eq!(
        shape,
        vec![
            (base + 4096, 4096, true),
            (base, 1 << 16, false),
            (base, 128, true),
            (base + 60000, 5536, true)
        ]
    );
    assert_eq!(e.metrics().registration_cache_hits, 3);
    for r in regs {
        r.deregister().await.unwrap();
    }
    assert!(manual.registered().is_empty());
    drop(mem);
}

#[tokio::test]
async fn the_cache_can_be_turned_off_per_call_and_per_engine() {
    let e = local_engine("cache-off-call", &[]).await;
    let pool = e.allocate(8192, opts()).await.unwrap();
    let err = view(&e, pool.addr(), 4096, RegisterOptions::default().without_cache())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::AlreadyRegistered { .. }), "{err}");

    let off = local_engine("cache-off-env", &[("TE_REGISTRATION_CACHE", "0")]).await;
    let pool2 = off.allocate(8192, opts()).await.unwrap();
    let err = view(&off, pool2.addr(), 4096, RegisterOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::AlreadyRegistered { .. }), "{err}");
    assert_eq!(off.metrics().registration_cache_hits, 0);

    let env = MapEnv(
        [("TE_REGISTRATION_CACHE".to_string(), "maybe".to_string())]
            .into_iter()
            .collect(),
    );
    let err = TransferEngine::builder()
        .segment_name("cache-bad-env")
        .transports(["local"])
        .env(Arc::new(env))
        .build()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("TE_REGISTRATION_CACHE"), "{err}");
}

/// A batch pins the covering region: releasing the last handle while it runs is refused (and, as
/// the handle is consumed, deferred), and the transports let go only after it completes.
#[tokio::test]
async fn the_last_handle_of_a_region_in_flight_defers_its_release() {
    let manual = ManualTransport::new();
    let e = manual_engine("cache-inflight", &manual).await;
    let pool = e.allocate(1 << 16, opts()).await.unwrap();
    let pool_addr = pool.addr();
    let v = view(&e, pool_addr + 4096, 4096, RegisterOptions::default())
        .await
        .unwrap();
    let w = view(&e, pool_addr + 8192, 4096, RegisterOptions::default())
        .await
        .unwrap();
    v.write_at(0, &[5u8; 64]).unwrap();
    let me = e.open_segment("cache-inflight").await.unwrap();
    let batch = e
        .submit(&[TransferRequest::write(v.addr(), me.id(), w.addr(), 64)])
        .unwrap();
    // Not the last handle: released at once although the region is in flight.
    pool.deregister().await.unwrap();
    w.deregister().await.unwrap();
    // The last one: refused while in flight, and consumed, so its drop defers the release.
    assert!(matches!(v.deregister().await, Err(Error::InFlight { .. })));
    assert!(manual.registered().contains(&pool_addr), "released while in flight");
    assert!(!e.descriptor().buffers.iter().any(|b| b.base == pool_addr));
    manual.complete_all();
    batch.wait().await.unwrap();
    assert!(matches!(batch.status(0), Some(RequestStatus::Done { bytes: 64 })));
    // The release runs on the engine's runtime once the batch let go: wait for it, bounded.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while manual.registered().contains(&pool_addr) && std::time::Instant::now() < end {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert!(
        manual.registered().is_empty(),
        "still registered after the batch completed"
    );
    // A new registration of the range is a fresh one (the old region is gone).
    let mut mem = vec![0u8; 4096];
    let fresh = view(&e, mem.as_mut_ptr() as u64, 4096, RegisterOptions::default())
        .await
        .unwrap();
    assert!(!fresh.is_view());
    drop(fresh);
    drop(mem);
}

/// A peer reads a view's bytes through the exported pool's single descriptor entry, also after the
/// pool's own handle was released; once the last view goes the peer can no longer reach them.
#[tokio::test]
async fn a_peer_reads_a_views_bytes_through_the_exported_pool() {
    let owner = local_engine("cache-peer-owner", &[]).await;
    let reader = local_engine("cache-peer-reader", &[]).await;
    let pool = owner.allocate(1 << 20, opts()).await.unwrap();
    let v = view(&owner, pool.addr() + 65536, 65536, RegisterOptions::default())
        .await
        .unwrap();
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 13 % 251) as u8).collect();
    v.write_at(0, &data).unwrap();
    let into = reader.allocate(65536, opts()).await.unwrap();
    let seg = reader.open_segment("cache-peer-owner").await.unwrap();
    assert_eq!(seg.buffers().len(), 1, "views add no descriptor entry");
    let read = |addr: u64| TransferRequest::read(into.addr(), seg.id(), addr, 65536);
    reader.transfer(&[read(v.addr())]).await.unwrap();
    let mut out = vec![0u8; 65536];
    into.read_at(0, &mut out).unwrap();
    assert_eq!(out, data);

    pool.deregister().await.unwrap();
    into.write_at(0, &[0u8; 65536]).unwrap();
    let seg = reader.open_segment("cache-peer-owner").await.unwrap();
    assert_eq!(seg.buffers().len(), 1, "the view keeps the pool exported");
    reader.transfer(&[read(v.addr())]).await.unwrap();
    into.read_at(0, &mut out).unwrap();
    assert_eq!(out, data);

    let view_addr = v.addr();
    v.deregister().await.unwrap();
    let seg = reader.open_segment("cache-peer-owner").await.unwrap();
    assert!(seg.buffers().is_empty());
    let gone = reader.submit(&[read(view_addr)]);
    assert!(gone.is_err() || gone.unwrap().wait().await.is_err());
}

/// A small xorshift generator: the test is reproducible from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const POOLS: usize = 4;
const POOL_LEN: u64 = 1 << 20;

/// One task of phase 1: registers views of random pools and deregisters (or drops) random ones it
/// holds; returns what it still holds and how many views it registered.
async fn churn(e: TransferEngine, bases: Arc<Vec<u64>>, seed: u64, ops: usize) -> (Vec<(usize, Registration)>, u64) {
    let mut rng = Rng(seed | 1);
    let mut held: Vec<(usize, Registration)> = Vec::new();
    let mut registered = 0;
    for _ in 0..ops {
        if held.is_empty() || rng.below(10) < 6 {
            let p = rng.below(POOLS as u64) as usize;
            let len = 1 + rng.below(65536);
            let off = rng.below(POOL_LEN - len + 1);
            let v = view(&e, bases[p] + off, len, RegisterOptions::default()).await.unwrap();
            assert!(v.is_view(), "a range inside a live pool registered on its own");
            held.push((p, v));
            registered += 1;
        } else {
            let (_, v) = held.swap_remove(rng.below(held.len() as u64) as usize);
            if rng.below(2) == 0 {
                v.deregister().await.unwrap();
            } else {
                drop(v);
            }
        }
        if rng.below(4) == 0 {
            tokio::task::yield_now().await;
        }
    }
    (held, registered)
}

/// Concurrent register/deregister of views against a model of the live handles: after every
/// phase the transport holds exactly the pools the model says have a live handle, views never
/// reach the transport, and concurrent releases of a pool's last handles release it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_views_leave_the_transport_registrations_the_model_predicts() {
    let manual = ManualTransport::new();
    let e = manual_engine("cache-concurrent", &manual).await;
    let mut mem: Vec<Vec<u8>> = (0..POOLS).map(|_| vec![0u8; POOL_LEN as usize]).collect();
    let bases: Arc<Vec<u64>> = Arc::new(mem.iter_mut().map(|m| m.as_mut_ptr() as u64).collect());
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut views_registered = 0u64;
    for round in 0..8u64 {
        // Every pool is registered afresh, then views churn concurrently on all of them.
        let mut handles: Vec<Vec<Registration>> = Vec::new();
        for &b in bases.iter() {
            let pool = view(&e, b, POOL_LEN, RegisterOptions::default()).await.unwrap();
            assert!(!pool.is_view());
            handles.push(vec![pool]);
        }
        assert_eq!(manual.registered_total(), (round + 1) * POOLS as u64);
        let tasks: Vec<_> = (0..8)
            .map(|_| tokio::spawn(churn(e.clone(), bases.clone(), rng.next(), 40)))
            .collect();
        for t in tasks {
            let (held, n) = t.await.unwrap();
            views_registered += n;
            for (p, v) in held {
                handles[p].push(v);
            }
        }
        assert_eq!(manual.registered(), bases.iter().copied().collect::<BTreeSet<_>>());
        assert_eq!(
            manual.registered_total(),
            (round + 1) * POOLS as u64,
            "a view reached the transport"
        );
        assert_eq!(e.metrics().registration_cache_hits, views_registered);

        // Some pools lose every handle at once, from several tasks (the pool's own handle among
        // them, in any order) while views of the other pools are registered alongside.
        let release: Vec<bool> = (0..POOLS).map(|_| rng.below(2) == 0).collect();
        let mut tasks = Vec::new();
        for (p, hs) in handles.iter_mut().enumerate() {
            if !release[p] {
                continue;
            }
            let mut all = std::mem::take(hs);
            while !all.is_empty() {
                let take = (1 + rng.below(4) as usize).min(all.len());
                let part: Vec<Registration> = all.drain(..take).collect();
                tasks.push(tokio::spawn(async move {
                    for r in part {
                        r.deregister().await.unwrap();
                    }
                }));
            }
        }
        let keep: Arc<Vec<u64>> = Arc::new((0..POOLS).filter(|&p| !release[p]).map(|p| bases[p]).collect());
        let adders: Vec<_> = if keep.is_empty() {
            Vec::new()
        } else {
            (0..2)
                .map(|_| {
                    let (e, keep, seed) = (e.clone(), keep.clone(), rng.next());
                    tokio::spawn(async move {
                        let mut rng = Rng(seed | 1);
                        let mut held = Vec::new();
                        for _ in 0..20 {
                            let b = keep[rng.below(keep.len() as u64) as usize];
                            let v = view(&e, b + rng.below(POOL_LEN - 64), 64, RegisterOptions::default())
                                .await
                                .unwrap();
                            assert!(v.is_view());
                            held.push((b, v));
                        }
                        held
                    })
                })
                .collect()
        };
        for t in tasks {
            t.await.unwrap();
        }
        for t in adders {
            for (b, v) in t.await.unwrap() {
                views_registered += 1;
                let p = bases.iter().position(|&x| x == b).unwrap();
                handles[p].push(v);
            }
        }
        let live: BTreeSet<u64> = (0..POOLS)
            .filter(|&p| !handles[p].is_empty())
            .map(|p| bases[p])
            .collect();
        assert_eq!(
            manual.registered(),
            live,
            "round {round}: transport registrations differ from the model"
        );
        assert_eq!(e.metrics().registration_cache_hits, views_registered);
        // The rest goes too, for the next round.
        for hs in handles {
            for r in hs {
                r.deregister().await.unwrap();
            }
        }
        assert!(manual.registered().is_empty());
    }
    drop(mem);
}
