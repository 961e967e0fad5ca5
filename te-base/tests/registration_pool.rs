//! The registration pool: the cap bounds what runs at once, every item is attempted, results keep
//! the caller's order, failed batches roll back, and sizes 0, 1 and 10,000 work.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use te_base::registration::{deregister_regions, register_regions, RegOrder, RegistrationPool, RegistrationProvider};
use te_base::{Error, MemoryLocation, RegionId, RegionInfo, Result};
use te_testkit::{SimConfig, SimProvider};

fn regions(sizes: &[u64]) -> Vec<RegionInfo> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| RegionInfo {
            id: RegionId(i as u64 + 1),
            base: (i as u64 + 1) << 32,
            len,
            location: MemoryLocation::HOST,
            exported: true,
        })
        .collect()
}

/// Counts items in flight and remembers the most seen at once.
#[derive(Default)]
struct InFlight {
    now: AtomicUsize,
    max: AtomicUsize,
}

impl InFlight {
    fn enter(&self) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
    }
    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Lets the first `n` arrivals through only together (a deadlock guard turns a pool that cannot
/// reach `n` concurrent items into a failure instead of a hang).
struct Gate {
    arrived: Mutex<usize>,
    all_in: Condvar,
    n: usize,
}

impl Gate {
    fn new(n: usize) -> Self {
        Gate {
            arrived: Mutex::new(0),
            all_in: Condvar::new(),
            n,
        }
    }
    fn pass(&self) -> Result<()> {
        let mut arrived = self.arrived.lock();
        *arrived += 1;
        if *arrived > self.n {
            return Ok(());
        }
        if *arrived == self.n {
            self.all_in.notify_all();
            return Ok(());
        }
        while *arrived < self.n {
            if self.all_in.wait_for(&mut arrived, Duration::from_secs(60)).timed_out() {
                return Err(Error::transport(
                    "test",
                    "the pool never ran the cap's worth of items at once",
                ));
            }
        }
        Ok(())
    }
}

#[test]
fn never_runs_more_than_the_cap_and_reaches_it() {
    for cap in [1usize, 2, 3, 8] {
        let pool = RegistrationPool::new(cap);
        let flight = Arc::new(InFlight::default());
        let gate = Arc::new(Gate::new(cap));
        let (f, g) = (flight.clone(), gate.clone());
        let out = pool
            .register_batch(
                regions(&vec![4096; 300]),
                move |r| {
                    f.enter();
                    let passed = g.pass();
                    std::thread::yield_now();
                    f.leave();
                    passed.map(|_| r.id.0)
                },
                |_, _| Ok(()),
            )
            .unwrap();
        assert_eq!(out.len(), 300);
        assert_eq!(flight.max.load(Ordering::SeqCst), cap, "cap {cap}");
    }
}

#[test]
fn concurrent_batches_share_the_cap() {
    let pool = Arc::new(RegistrationPool::new(2));
    let flight = Arc::new(InFlight::default());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (pool, flight) = (pool.clone(), flight.clone());
            std::thread::spawn(move || {
                let f = flight.clone();
                pool.try_each(regions(&vec![4096; 100]), move |_| {
                    f.enter();
                    std::thread::yield_now();
                    f.leave();
                    Ok(())
                })
                .into_iter()
                .filter(|r| r.is_ok())
                .count()
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), 100);
    }
    assert!(flight.max.load(Ordering::SeqCst) <= 2);
}

#[test]
fn results_come_back_in_the_callers_order_whatever_the_dispatch_order() {
    let sizes: Vec<u64> = (0..500u64).map(|i| (i * 7919) % 997 + 1).collect();
    for order in RegOrder::ALL {
        for cap in [0usize, 1, 4] {
            let pool = RegistrationPool::new(cap).with_order(order);
            let out = pool
                .register_batch(regions(&sizes), |r| Ok(r.len), |_, _| Ok(()))
                .unwrap();
            assert_eq!(out, sizes, "order {order} cap {cap}");
        }
    }
}

#[test]
fn dispatch_follows_the_order_under_a_cap_of_one() {
    let sizes = [50u64, 10, 40, 10, 30];
    for (order, expected) in [
        (RegOrder::Given, vec![50, 10, 40, 10, 30]),
        (RegOrder::Ascending, vec![10, 10, 30, 40, 50]),
        (RegOrder::Descending, vec![50, 40, 30, 10, 10]),
    ] {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let pool = RegistrationPool::new(1).with_order(order);
        pool.register_batch(
            regions(&sizes),
            move |r| {
                s.lock().push(r.len);
                Ok(())
            },
            |_, _| Ok(()),
        )
        .unwrap();
        assert_eq!(*seen.lock(), expected, "{order}");
    }
    assert_eq!(RegistrationPool::new(4).order(), RegOrder::Ascending);
    assert_eq!(RegistrationPool::new(0).order(), RegOrder::Given);
}

#[test]
fn a_failed_batch_attempts_everything_lists_every_failure_and_releases_the_rest() {
    for cap in [0usize, 1, 3] {
        let pool = RegistrationPool::new(cap);
        let attempts = Arc::new(AtomicUsize::new(0));
        let live = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
        let (a, l, l2) = (attempts.clone(), live.clone(), live.clone());
        let sizes: Vec<u64> = (1..=100).map(|i| i * 4096).collect();
        let err = pool
            .register_batch(
                regions(&sizes),
                move |r| {
                    a.fetch_add(1, Ordering::SeqCst);
                    if r.id.0 % 7 == 3 {
                        return Err(Error::transport("test", format!("refused {}", r.id.0)));
                    }
                    l.lock().insert(r.id.0);
                    Ok(r.id.0)
                },
                move |r, key| {
                    assert_eq!(r.id.0, key);
                    l2.lock().remove(&key);
                    Ok(())
                },
            )
            .unwrap_err();
        assert_eq!(attempts.load(Ordering::SeqCst), 100);
        assert!(live.lock().is_empty(), "left registered: {:?}", live.lock());
        let Error::RegistrationFailed { failures } = err else {
            panic!("unexpected error {err}");
        };
        let failed: Vec<usize> = failures.iter().map(|f| f.index).collect();
        let expected: Vec<usize> = (0..100).filter(|i| (i + 1) % 7 == 3).collect();
        assert_eq!(failed, expected);
        for f in &failures {
            assert_eq!(f.len, (f.index as u64 + 1) * 4096);
            assert_eq!(f.location, "host");
            assert!(f.cause.to_string().contains("refused"));
        }
    }
}

#[test]
fn a_failed_release_is_reported_too() {
    let pool = RegistrationPool::new(2);
    let err = pool
        .register_batch(
            regions(&[10, 20, 30]),
            |r| {
                if r.len == 20 {
                    Err(Error::transport("test", "no"))
                } else {
                    Ok(r.len)
                }
            },
            |_, key| {
                if key == 30 {
                    Err(Error::transport("test", "stuck"))
                } else {
                    Ok(())
                }
            },
        )
        .unwrap_err();
    let Error::RegistrationFailed { failures } = err else {
        panic!("unexpected error {err}");
    };
    assert_eq!(failures.iter().map(|f| f.index).collect::<Vec<_>>(), vec![1, 2]);
    assert!(failures[1].cause.to_string().contains("stuck"));
}

#[test]
fn a_panicking_item_is_a_failure_not_a_hang() {
    let pool = RegistrationPool::new(2);
    let err = pool
        .register_batch(
            regions(&[1, 2, 3, 4]),
            |r| {
                if r.len == 3 {
                    panic!("provider blew up");
                }
                Ok(())
            },
            |_, _| Ok(()),
        )
        .unwrap_err();
    assert!(err.to_string().contains("provider blew up"), "{err}");
    // The pool still works afterwards.
    assert_eq!(
        pool.register_batch(regions(&[1, 2]), |r| Ok(r.len), |_, _| Ok(()))
            .unwrap(),
        vec![1, 2]
    );
}

#[test]
fn handles_zero_one_and_ten_thousand_items() {
    for cap in [0usize, 1, 4] {
        let pool = RegistrationPool::new(cap);
        let none: Vec<u64> = pool.register_batch(regions(&[]), |r| Ok(r.len), |_, _| Ok(())).unwrap();
        assert!(none.is_empty());
        assert_eq!(
            pool.register_batch(regions(&[7]), |r| Ok(r.len), |_, _| Ok(()))
                .unwrap(),
            vec![7]
        );
        let sizes: Vec<u64> = (0..10_000u64).map(|i| 10_000 - i).collect();
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        let out = pool
            .register_batch(
                regions(&sizes),
                move |r| {
                    c.fetch_add(1, Ordering::Relaxed);
                    Ok(r.len)
                },
                |_, _| Ok(()),
            )
            .unwrap();
        assert_eq!(out, sizes);
        assert_eq!(count.load(Ordering::Relaxed), 10_000);
        pool.deregister_batch(regions(&sizes), |_| Ok(())).unwrap();
    }
}

#[test]
fn workers_persist_across_batches_and_never_exceed_the_cap() {
    let pool = RegistrationPool::new(3);
    pool.register_batch(regions(&[1; 50]), |_| Ok(()), |_, _| Ok(()))
        .unwrap();
    let after_first = pool.worker_count();
    assert!(
        after_first <= 2,
        "{after_first} workers for a cap of 3 (the caller is the third)"
    );
    for _ in 0..20 {
        pool.register_batch(regions(&[1; 50]), |_| Ok(()), |_, _| Ok(()))
            .unwrap();
    }
    assert_eq!(pool.worker_count(), after_first);
    let unbounded = RegistrationPool::new(0);
    unbounded.warm_up(16);
    assert_eq!(unbounded.worker_count(), 15);
    unbounded
        .register_batch(regions(&[1; 16]), |_| Ok(()), |_, _| Ok(()))
        .unwrap();
    assert_eq!(unbounded.worker_count(), 15);
}

#[test]
fn a_nested_batch_runs_inline_instead_of_deadlocking() {
    let pool = Arc::new(RegistrationPool::new(2));
    let inner = pool.clone();
    let out = pool
        .register_batch(
            regions(&[1, 2, 3]),
            move |r| {
                let nested = inner.register_batch(regions(&[r.len, r.len]), |x| Ok(x.len), |_, _| Ok(()))?;
                Ok(nested.iter().sum::<u64>())
            },
            |_, _| Ok(()),
        )
        .unwrap();
    assert_eq!(out, vec![2, 4, 6]);
}

#[test]
fn deregistration_attempts_every_item_and_reports_each_failure() {
    let pool = RegistrationPool::new(2);
    let attempts = Arc::new(AtomicUsize::new(0));
    let a = attempts.clone();
    let err = pool
        .deregister_batch(regions(&[1, 2, 3, 4, 5]), move |r| {
            a.fetch_add(1, Ordering::SeqCst);
            if r.len % 2 == 0 {
                Err(Error::transport("test", "busy"))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
    assert_eq!(attempts.load(Ordering::SeqCst), 5);
    let Error::RegistrationFailed { failures } = err else {
        panic!("unexpected error {err}");
    };
    assert_eq!(failures.iter().map(|f| f.index).collect::<Vec<_>>(), vec![1, 3]);
}

/// A provider with a fixed number of domains that refuses one (region, domain) pair and tracks
/// what is registered.
struct Picky {
    domains: usize,
    refuse: (u64, usize),
    live: Mutex<std::collections::BTreeSet<(u64, usize)>>,
}

impl RegistrationProvider for Picky {
    type Handle = (u64, usize);
    fn name(&self) -> &str {
        "picky"
    }
    fn domain_count(&self) -> usize {
        self.domains
    }
    fn register(&self, domain: usize, region: &RegionInfo) -> Result<(u64, usize)> {
        if (region.id.0, domain) == self.refuse {
            return Err(Error::transport("picky", "domain full"));
        }
        self.live.lock().insert((region.id.0, domain));
        Ok((region.id.0, domain))
    }
    fn deregister(&self, domain: usize, region: &RegionInfo, handle: (u64, usize)) -> Result<()> {
        assert_eq!(handle, (region.id.0, domain));
        assert!(self.live.lock().remove(&handle));
        Ok(())
    }
}

#[test]
fn provider_batches_land_on_every_domain_and_leave_nothing_behind_on_failure() {
    let pool = RegistrationPool::new(2);
    let ok = Arc::new(Picky {
        domains: 4,
        refuse: (0, 0),
        live: Mutex::new(Default::default()),
    });
    let regs = regions(&[100, 200, 300]);
    let handles = register_regions(&pool, &ok, regs.clone()).unwrap();
    assert_eq!(ok.live.lock().len(), 12);
    assert!(handles.iter().all(|h| h.iter().map(|(d, _)| *d).eq(0..4)));
    deregister_regions(&pool, &ok, regs.clone().into_iter().zip(handles).collect()).unwrap();
    assert!(ok.live.lock().is_empty());

    // Region 2 fails on its third domain: its first two and every other region are released.
    let failing = Arc::new(Picky {
        domains: 4,
        refuse: (2, 2),
        live: Mutex::new(Default::default()),
    });
    let err = register_regions(&pool, &failing, regs).unwrap_err();
    assert!(failing.live.lock().is_empty(), "left: {:?}", failing.live.lock());
    let Error::RegistrationFailed { failures } = err else {
        panic!("unexpected error {err}");
    };
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0].index, 1);
    assert!(failures[0].cause.to_string().contains("domain 2"));
}

#[test]
fn the_simulated_provider_registers_through_the_pool() {
    let pool = RegistrationPool::new(2);
    let sim = Arc::new(
        SimProvider::new(SimConfig {
            domains: 3,
            scale: 1e-4,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let mut regs = regions(&[1 << 20, 2 << 20, 4 << 20]);
    for r in &mut regs {
        r.location = MemoryLocation::Cuda { device: 0 };
    }
    let handles = register_regions(&pool, &sim, regs.clone()).unwrap();
    for d in 0..3 {
        assert_eq!(sim.device_bytes(d), 7 << 20);
    }
    assert!(sim.work_node_s() > 0.0);
    deregister_regions(&pool, &sim, regs.into_iter().zip(handles).collect()).unwrap();
    assert_eq!(sim.device_bytes(0), 0);
}
