//! A forged request never reads or writes memory the target did not export, on every provider and
//! libfabric version the tests run against (CI: Debian's 1.17 and the vendored 2.6).
//!
//! "Forged" means the initiator's descriptor lies: it stretches an exported buffer over memory
//! next to it, or keeps the key of a region the target has since deregistered. Our own bounds
//! check then passes and only the provider's key and range check stands between the request and
//! the target's memory. Each test asserts the invariant on the bytes (the target's private memory
//! is unchanged, and a read's destination never holds the private bytes), and that the initiator
//! sees what [`RefusalReport`] says for this provider and the loaded version.

mod common;

use common::*;
use te_base::{BatchError, BatchReport, HostBuffer, MemoryLocation, RegionId, RegionInfo, TransferOp};
use te_transport_efa::RefusalReport;

fn each_provider(f: impl Fn(&str, RefusalReport)) {
    let (major, minor) = te_transport_efa::libfabric_versions().1.unwrap_or((0, 0));
    for p in providers() {
        if provider_present(p) {
            let report = RefusalReport::of(p, (major, minor));
            eprintln!("-- provider {p}, libfabric {major}.{minor}: {report:?}");
            f(p, report);
        }
    }
}

/// Asserts that a refused request ended as `report` says.
fn assert_refusal_seen(p: &str, what: &str, outcome: &Result<BatchReport, BatchError>, report: RefusalReport) {
    match report {
        RefusalReport::SilentSuccess => {
            assert!(
                outcome.is_ok(),
                "{p} {what}: expected the provider's silent success, got {outcome:?}"
            )
        }
        RefusalReport::ErrorCompletion | RefusalReport::NoCompletion => {
            let err = outcome.as_ref().expect_err(what);
            assert!(
                err.failures[0].1.to_string().contains("'b'"),
                "{p} {what}: the error must name the peer: {err}"
            );
        }
        _ => eprintln!("{p} {what}: unmeasured provider, saw {outcome:?}"),
    }
}

/// Bytes of `got` equal to the private pattern `seed` at `start`: by chance about 1 in 256.
fn private_bytes_in(got: &[u8], seed: u64, start: u64) -> u64 {
    got.len() as u64 - pattern::mismatches(got, seed, start)
}

/// Two adjacent allocations, lower one first.
fn adjacent_pair(len: usize) -> (HostBuffer, HostBuffer) {
    let x = HostBuffer::allocate(len, Default::default()).unwrap();
    let y = HostBuffer::allocate(len, Default::default()).unwrap();
    if x.addr() < y.addr() {
        (x, y)
    } else {
        (y, x)
    }
}

#[test]
fn unexported_memory_is_unreachable_even_with_a_forged_descriptor() {
    each_provider(|p, report| {
        // shm 1.x never answers a refused request: a short stall timeout fails it (naming the peer).
        let a = install(p, &[("TE_FABRIC_TIMEOUT_MS", "1000")]);
        let b = install(p, &[]);
        let src = Side::new(&a, 1, 1 << 16, false, 1);
        // The private region lies above the exported one so that one forged buffer starting at the
        // exported region covers it in both address modes (virtual address and offset).
        let (low, high) = adjacent_pair(1 << 16);
        let exported = Side::from_buffer(&b, low, 1, true, 2);
        let private = Side::from_buffer(&b, high, 2, false, 3);
        assert!(private.keys.is_null(), "a local-only region must not hand out keys");
        // One forged buffer from the exported region to the end of the private one, carrying the
        // exported region's keys: our bounds check passes, the provider's must refuse.
        let mut d = descriptor("b", &b, &[&exported]);
        d.buffers[0].len = private.addr() + (1 << 16) - exported.addr();
        let target = private.addr() + 4096;
        let peer = block_on(a.connect(&d)).unwrap();
        let write = run(&peer, vec![request(0, TransferOp::Write, &src, 0, 0, target, 4096)]);
        // Reads of two sizes (shm 2.x moves 4 KiB and 64 KiB by different protocols).
        let mut reads = Vec::new();
        for (id, len) in [(2u64, 4096usize), (3, 1 << 16)] {
            let back = Side::new(&a, id, len, false, 9);
            let peer = block_on(a.connect(&d)).unwrap();
            let target = if len == 4096 { target } else { private.addr() };
            let read = run(
                &peer,
                vec![request(0, TransferOp::Read, &back, 0, 0, target, len as u64)],
            );
            let start = target - private.addr();
            let leaked = private_bytes_in(back.bytes(), 3, start);
            eprintln!(
                "{p}: forged read of {len} B -> {:?}; destination: {} B changed, {leaked} B equal to the private bytes",
                read.as_ref().map(|r| r.requests),
                pattern::mismatches(back.bytes(), 9, 0)
            );
            // Chance agreement is about len/256; the private bytes themselves would be len.
            assert!(
                leaked < len as u64 / 32,
                "{p}: private memory was read ({leaked} of {len} B)"
            );
            reads.push(read);
        }
        eprintln!("{p}: forged write -> {write:?}");
        assert_eq!(
            pattern::mismatches(private.bytes(), 3, 0),
            0,
            "{p}: private memory was written"
        );
        assert_eq!(
            pattern::mismatches(exported.bytes(), 2, 0),
            0,
            "{p}: exported memory was written"
        );
        assert_refusal_seen(p, "forged write", &write, report);
        for r in &reads {
            assert_refusal_seen(p, "forged read", r, report);
        }
        // The target keeps serving: a fresh initiator writes its exported region.
        let c = install(p, &[]);
        let src_c = Side::new(&c, 1, 4096, false, 4);
        let peer = block_on(c.connect(&descriptor("b", &b, &[&exported]))).unwrap();
        run(
            &peer,
            vec![request(0, TransferOp::Write, &src_c, 0, 0, exported.addr(), 4096)],
        )
        .unwrap();
        assert_eq!(pattern::mismatches(&exported.bytes()[..4096], 4, 0), 0);
    });
}

#[test]
fn a_registration_covers_exactly_the_exported_range() {
    each_provider(|p, report| {
        let a = install(p, &[("TE_FABRIC_TIMEOUT_MS", "1000")]);
        let b = install(p, &[]);
        // Export the middle page of three: the bytes right before and after it share its pages'
        // neighbours, so only an exact registration keeps them out of reach.
        let buf = HostBuffer::allocate(3 * 4096, Default::default()).unwrap();
        // SAFETY: only this test touches the buffer, and only between transfers it waited for.
        let all = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), buf.len()) };
        pattern::fill(all, 5, 0);
        let region = RegionInfo {
            id: RegionId(1),
            base: buf.addr() + 4096,
            len: 4096,
            location: MemoryLocation::HOST,
            exported: true,
        };
        let keys = block_on(b.register(std::slice::from_ref(&region))).unwrap().remove(0);
        // Forged descriptors: one wider past the end; one starting a byte early (only meaningful
        // where remote addresses are virtual; with offsets the early start just shifts them).
        let forged = |base: u64, len: u64| {
            let mut d = descriptor("b", &b, &[]);
            d.buffers.push(te_base::ExportedBuffer {
                base,
                len,
                location: MemoryLocation::HOST,
                keys: [("efa".to_string(), keys.clone())].into_iter().collect(),
            });
            d
        };
        let virt_addr = b.endpoint()["virt_addr"].as_bool().unwrap_or(false);
        let src = Side::new(&a, 1, 4096, false, 6);
        let back = Side::new(&a, 2, 4096, false, 7);
        let end = region.base + region.len;
        let mut cases = vec![
            ("write across the end", TransferOp::Write, &src, end - 1, 2),
            ("read across the end", TransferOp::Read, &back, end - 32, 64),
        ];
        if virt_addr {
            cases.push(("write across the start", TransferOp::Write, &src, region.base - 1, 2));
        }
        for (what, op, side, addr, len) in cases {
            let d = if addr < region.base {
                forged(region.base - 1, region.len + 1)
            } else {
                forged(region.base, region.len + 64)
            };
            let peer = block_on(a.connect(&d)).unwrap();
            let outcome = run(&peer, vec![request(0, op, side, 0, 0, addr, len)]);
            eprintln!("{p}: {what} -> {outcome:?}");
            assert_refusal_seen(p, what, &outcome, report);
        }
        // Nothing around the export (nor in it) changed, and the read did not deliver the bytes
        // after the end (by chance about 1 in 256 of them match).
        assert_eq!(
            pattern::mismatches(all, 5, 0),
            0,
            "{p}: memory around the export changed"
        );
        let leaked = private_bytes_in(&back.bytes()[32..64], 5, 2 * 4096);
        assert!(
            leaked < 8,
            "{p}: {leaked} of the 32 bytes after the exported range were read"
        );
        // In range still works, to the last byte (from a fresh initiator: shm 1.x leaves the
        // refused requests of `a` outstanding).
        let c = install(p, &[]);
        let back_c = Side::new(&c, 1, 4096, false, 7);
        let peer = block_on(c.connect(&forged(region.base, region.len))).unwrap();
        run(&peer, vec![request(0, TransferOp::Read, &back_c, 0, 0, end - 2, 2)]).unwrap();
        assert_eq!(&back_c.bytes()[..2], &all[2 * 4096 - 2..2 * 4096]);
    });
}

#[test]
fn a_key_from_before_deregistration_never_reaches_a_later_registration() {
    each_provider(|p, report| {
        let a = install(p, &[("TE_FABRIC_TIMEOUT_MS", "1000")]);
        let b = install(p, &[]);
        let src = Side::new(&a, 1, 4096, false, 1);
        let buf = HostBuffer::allocate(4096, Default::default()).unwrap();
        let old = Side::from_buffer(&b, buf, 7, true, 2);
        let stale = descriptor("b", &b, &[&old]);
        block_on(b.deregister(std::slice::from_ref(&old.region))).unwrap();
        // The same memory registered again, many times over: no registration gets the old key.
        let mut keys = vec![old.keys.clone()];
        let buf = old.buf;
        let mut region = old.region.clone();
        for id in 8..40u64 {
            region.id = RegionId(id);
            let k = block_on(b.register(std::slice::from_ref(&region))).unwrap().remove(0);
            assert!(!keys.contains(&k), "{p}: key {k} reused");
            keys.push(k);
            block_on(b.deregister(std::slice::from_ref(&region))).unwrap();
        }
        region.id = RegionId(99);
        block_on(b.register(std::slice::from_ref(&region))).unwrap();
        // SAFETY: only this test touches the buffer, between transfers it waited for.
        let now = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), buf.len()) };
        pattern::fill(now, 3, 0);
        let peer = block_on(a.connect(&stale)).unwrap();
        let outcome = run(&peer, vec![request(0, TransferOp::Write, &src, 0, 0, buf.addr(), 4096)]);
        eprintln!("{p}: write with a stale key -> {outcome:?}");
        assert_eq!(
            pattern::mismatches(now, 3, 0),
            0,
            "{p}: a stale key wrote a new registration"
        );
        assert_refusal_seen(p, "stale-key write", &outcome, report);
    });
}

#[test]
fn peers_sharing_an_address_connect_and_leave_in_any_order() {
    // libfabric 2.6's shm provider divided by zero (SIGFPE, the whole process) when one AV held
    // an address twice and both were removed before the next insert.
    each_provider(|p, _| {
        let a = install(p, &[]);
        let b = install(p, &[]);
        let src = Side::new(&a, 1, 4096, false, 1);
        let dst = Side::new(&b, 1, 4096, true, 2);
        let d = descriptor("b", &b, &[&dst]);
        for round in 0..3 {
            let first = block_on(a.connect(&d)).unwrap();
            let second = block_on(a.connect(&d)).unwrap();
            run(
                &second,
                vec![request(0, TransferOp::Write, &src, 0, 0, dst.addr(), 4096)],
            )
            .unwrap();
            if round % 2 == 0 {
                drop(first);
                drop(second);
            } else {
                drop(second);
                run(
                    &first,
                    vec![request(0, TransferOp::Write, &src, 0, 0, dst.addr(), 4096)],
                )
                .unwrap();
                drop(first);
            }
        }
        let again = block_on(a.connect(&d)).unwrap();
        run(
            &again,
            vec![request(0, TransferOp::Write, &src, 0, 0, dst.addr(), 4096)],
        )
        .unwrap();
        assert_eq!(pattern::mismatches(dst.bytes(), 1, 0), 0, "{p}");
    });
}
