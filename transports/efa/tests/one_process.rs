//! Two transports in one process, talking over real libfabric providers (tcp;ofi_rxm and shm):
//! writes and reads from 1 B to 64 MiB, unaligned offsets, large batches, splitting and striping,
//! byte verification, bad input and deregistration while in flight (forged requests against
//! unexported memory: `forged_requests.rs`).

mod common;

use common::*;
use te_base::{Error, TransferOp};

fn each_provider(f: impl Fn(&str)) {
    for p in providers() {
        if provider_present(p) {
            eprintln!("-- provider {p}");
            f(p);
        }
    }
}

#[test]
fn writes_and_reads_land_byte_for_byte() {
    each_provider(|p| {
        let a = install(p, &[]);
        let b = install(p, &[]);
        let len = 64 << 20;
        let src = Side::new(&a, 1, len, false, 11);
        let dst = Side::new(&b, 1, len, true, 22);
        let peer = block_on(a.connect(&descriptor("b", &b, &[&dst]))).unwrap();
        // Sizes from 1 B to 64 MiB at unaligned offsets, one request each.
        let mut reqs = Vec::new();
        let mut off = 0u64;
        for (i, size) in [1u64, 7, 4096, 65_537, 1 << 20, 3 << 20].into_iter().enumerate() {
            off += 13;
            reqs.push(request(
                i as u32,
                TransferOp::Write,
                &src,
                off,
                0,
                dst.addr() + off,
                size,
            ));
            off += size;
        }
        let r = run(&peer, reqs).unwrap();
        assert_eq!(r.requests, 6);
        // Every written range now holds the source's pattern; the gaps still hold the target's.
        let d = dst.bytes();
        let mut off = 0u64;
        for size in [1u64, 7, 4096, 65_537, 1 << 20, 3 << 20] {
            assert_eq!(pattern::mismatches(&d[off as usize..(off + 13) as usize], 22, off), 0);
            off += 13;
            assert_eq!(
                pattern::mismatches(&d[off as usize..(off + size) as usize], 11, off),
                0,
                "{p}: {size} B"
            );
            off += size;
        }
        // The whole 64 MiB in one request, then read it back into a fresh local buffer.
        run(
            &peer,
            vec![request(0, TransferOp::Write, &src, 0, 0, dst.addr(), len as u64)],
        )
        .unwrap();
        assert_eq!(pattern::mismatches(dst.bytes(), 11, 0), 0, "{p}: 64 MiB write");
        let back = Side::new(&a, 2, len, false, 33);
        run(
            &peer,
            vec![request(0, TransferOp::Read, &back, 0, 0, dst.addr(), len as u64)],
        )
        .unwrap();
        assert_eq!(pattern::mismatches(back.bytes(), 11, 0), 0, "{p}: 64 MiB read");
    });
}

#[test]
fn ten_thousand_requests_and_concurrent_batches() {
    each_provider(|p| {
        let a = install(p, &[]);
        let b = install(p, &[]);
        let n = 10_000usize;
        let frag = 1728u64; // DeepSeek-V4-Pro's smallest KV fragment
        let len = n * frag as usize;
        let src = Side::new(&a, 1, len, false, 5);
        let dst = Side::new(&b, 1, len, true, 6);
        let peer = block_on(a.connect(&descriptor("b", &b, &[&dst]))).unwrap();
        // Reverse order so requests do not arrive as one contiguous run.
        let reqs = (0..n)
            .map(|i| {
                let off = (n - 1 - i) as u64 * frag;
                request(i as u32, TransferOp::Write, &src, off, 0, dst.addr() + off, frag)
            })
            .collect();
        assert_eq!(run(&peer, reqs).unwrap().requests, n);
        assert_eq!(pattern::mismatches(dst.bytes(), 5, 0), 0, "{p}");
        // Four batches in flight at once, reading disjoint quarters back.
        let back = Side::new(&a, 2, len, false, 7);
        let q = (len / 4) as u64;
        let batches: Vec<_> = (0..4u64)
            .map(|k| {
                submit(
                    &peer,
                    vec![request(0, TransferOp::Read, &back, k * q, 0, dst.addr() + k * q, q)],
                )
            })
            .collect();
        for bt in batches {
            bt.wait_blocking(Some(std::time::Duration::from_secs(60)))
                .unwrap()
                .unwrap();
        }
        assert_eq!(pattern::mismatches(back.bytes(), 5, 0), 0, "{p}");
    });
}

#[test]
fn requests_are_split_and_striped() {
    each_provider(|p| {
        // Every domain of the provider becomes a rail (tcp: loopback and each interface), so large
        // requests are striped across rails; 64 KiB operations force every stripe to be split too.
        let domains = te_transport_efa::provider_domains(p).join(",");
        eprintln!("{p}: rails on {domains}");
        let rails = [("TE_FABRIC_DOMAINS", domains.as_str())];
        let a = install(
            p,
            &[
                rails[0],
                ("TE_FABRIC_MAX_FRAGMENT_BYTES", "64K"),
                ("TE_FABRIC_STRIPE_BYTES", "128K"),
            ],
        );
        let b = install(p, &rails);
        let len = 8 << 20;
        let src = Side::new(&a, 1, len, false, 41);
        let dst = Side::new(&b, 1, len, true, 42);
        let peer = block_on(a.connect(&descriptor("b", &b, &[&dst]))).unwrap();
        run(
            &peer,
            vec![request(
                0,
                TransferOp::Write,
                &src,
                5,
                0,
                dst.addr() + 5,
                len as u64 - 10,
            )],
        )
        .unwrap();
        assert_eq!(pattern::mismatches(&dst.bytes()[5..len - 5], 41, 5), 0);
        assert_eq!(pattern::mismatches(&dst.bytes()[..5], 42, 0), 0);
        assert_eq!(pattern::mismatches(&dst.bytes()[len - 5..], 42, len as u64 - 5), 0);
        // And back: a striped, split read into zeroed memory.
        let back = Side::new(&a, 2, len, false, 0);
        back.zero();
        run(
            &peer,
            vec![request(0, TransferOp::Read, &back, 0, 0, dst.addr(), len as u64)],
        )
        .unwrap();
        assert_eq!(pattern::mismatches(&back.bytes()[5..len - 5], 41, 5), 0);
    });
}

#[test]
fn bad_requests_fail_alone_with_typed_errors() {
    each_provider(|p| {
        let a = install(p, &[]);
        let b = install(p, &[]);
        let src = Side::new(&a, 1, 1 << 16, false, 1);
        let dst = Side::new(&b, 1, 1 << 16, true, 2);
        let peer = block_on(a.connect(&descriptor("b", &b, &[&dst]))).unwrap();
        let mut bad_local = request(1, TransferOp::Write, &src, 0, 0, dst.addr(), 16);
        bad_local.local_region = te_base::RegionId(999);
        let reqs = vec![
            request(0, TransferOp::Write, &src, 0, 0, dst.addr(), 4096),
            bad_local,
            request(2, TransferOp::Write, &src, 0, 0, dst.addr() + (1 << 16) - 8, 16),
            request(3, TransferOp::Write, &src, 0, 7, dst.addr(), 16),
        ];
        let err = run(&peer, reqs).unwrap_err();
        assert_eq!(err.progress.done, 1);
        let kinds: Vec<_> = err.failures.iter().map(|(i, e)| (*i, e.clone())).collect();
        assert!(matches!(kinds[0], (1, Error::Unregistered { .. })), "{kinds:?}");
        assert!(matches!(kinds[1], (2, Error::OutOfBounds { .. })), "{kinds:?}");
        assert!(matches!(kinds[2], (3, Error::OutOfBounds { .. })), "{kinds:?}");
        assert_eq!(pattern::mismatches(&dst.bytes()[..4096], 1, 0), 0);
    });
}

#[test]
fn deregistering_memory_in_flight_is_refused() {
    each_provider(|p| {
        let a = install(p, &[]);
        let b = install(p, &[]);
        let len = 32 << 20;
        let src = Side::new(&a, 1, len, false, 1);
        let dst = Side::new(&b, 1, len, true, 2);
        let peer = block_on(a.connect(&descriptor("b", &b, &[&dst]))).unwrap();
        // Many small requests keep the batch in flight while we try to deregister.
        let reqs = (0..(len / 4096))
            .map(|i| {
                request(
                    i as u32,
                    TransferOp::Write,
                    &src,
                    i as u64 * 4096,
                    0,
                    dst.addr() + i as u64 * 4096,
                    4096,
                )
            })
            .collect();
        let batch = submit(&peer, reqs);
        let refused = block_on(a.deregister(std::slice::from_ref(&src.region)));
        let settled_before = batch.is_complete();
        batch
            .wait_blocking(Some(std::time::Duration::from_secs(60)))
            .unwrap()
            .unwrap();
        if !settled_before {
            assert!(matches!(refused, Err(Error::InFlight { .. })), "{p}: {refused:?}");
        }
        assert_eq!(pattern::mismatches(dst.bytes(), 1, 0), 0);
        // Once settled, deregistration succeeds.
        block_on(a.deregister(std::slice::from_ref(&src.region))).unwrap();
    });
}

#[test]
fn shutdown_settles_every_outstanding_request() {
    each_provider(|p| {
        let a = install(p, &[]);
        let b = install(p, &[]);
        let len = 16 << 20;
        let src = Side::new(&a, 1, len, false, 1);
        let dst = Side::new(&b, 1, len, true, 2);
        let peer = block_on(a.connect(&descriptor("b", &b, &[&dst]))).unwrap();
        let n = (len / 4096) as u64;
        let reqs = (0..n)
            .map(|i| {
                request(
                    i as u32,
                    TransferOp::Write,
                    &src,
                    i * 4096,
                    0,
                    dst.addr() + i * 4096,
                    4096,
                )
            })
            .collect();
        let batch = submit(&peer, reqs);
        block_on(a.shutdown());
        let outcome = batch
            .wait_blocking(Some(std::time::Duration::from_secs(30)))
            .expect("shutdown must settle every request");
        // Whatever failed failed as Closed; every request reported done has its bytes in place
        // (posted writes are let finish, not cut off mid-way and reported done).
        let failed: std::collections::HashSet<usize> = match &outcome {
            Ok(_) => Default::default(),
            Err(e) => {
                assert!(
                    e.failures.iter().all(|(_, e)| matches!(e, Error::Closed(_))),
                    "{p}: {e}"
                );
                e.failures.iter().map(|(i, _)| *i).collect()
            }
        };
        for i in (0..n as usize).filter(|i| !failed.contains(i)) {
            let at = i * 4096;
            let bad = pattern::mismatches(&dst.bytes()[at..at + 4096], 1, at as u64);
            assert_eq!(bad, 0, "{p}: request {i} reported done without its bytes");
        }
        // After shutdown nothing new starts.
        let again = te_base::BatchState::new(vec![4096].into());
        let r = peer.submit(
            vec![request(0, TransferOp::Write, &src, 0, 0, dst.addr(), 4096)],
            &again,
            &Default::default(),
        );
        assert!(matches!(r, Err(Error::Closed(_))), "{p}: {r:?}");
        assert!(matches!(
            block_on(a.connect(&descriptor("b", &b, &[&dst]))).err(),
            Some(Error::Closed(_))
        ));
    });
}
