//! The store end to end through the transfer engine: DRAM and SSD tiers, ranged reads and writes,
//! every shape and data error, watermarks, demotion, promotion, eviction order, concurrency.

mod common;

use common::*;
use umbp::{EvictionPolicy, Range, RangedGet, RangedPut, StoreError};

const LAYER: u64 = 1728;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dram_ranged_round_trip_across_pages() {
    let store = dram_only(16 << 20).open().await.unwrap();
    let mut src = Buf::new(&store, (61 * LAYER) as usize).await;
    for p in 0..8 {
        put_layers(&store, &mut src, &format!("page-{p}"), 1, 61, LAYER, p).unwrap();
    }
    // One call for a layer group over every page: 8 layers of 8 pages, one buffer per layer,
    // page p's layer at offset p * LAYER of that layer's buffer.
    let mut layers = Vec::new();
    for _ in 0..8 {
        layers.push(Buf::new(&store, (8 * LAYER) as usize).await);
    }
    let keys: Vec<String> = (0..8).map(|p| format!("page-{p}")).collect();
    let ranges: Vec<Vec<Range>> = (0..8u64)
        .map(|p| {
            (0..8u64)
                .map(|l| Range::new((16 + l) * LAYER, LAYER, layers[l as usize].addr() + p * LAYER))
                .collect()
        })
        .collect();
    let gets: Vec<RangedGet<'_>> = keys
        .iter()
        .zip(&ranges)
        .map(|(k, r)| RangedGet { key: k, ranges: r })
        .collect();
    let got = store.batch_get_ranges(&gets).unwrap();
    assert!(got.iter().all(|r| *r.as_ref().unwrap() == 8 * LAYER));
    for (l, buf) in layers.iter().enumerate() {
        for (p, key) in keys.iter().enumerate() {
            for b in 0..LAYER {
                let want = byte(key, 1, (16 + l as u64) * LAYER + b);
                assert_eq!(buf.data[(p as u64 * LAYER + b) as usize], want);
            }
        }
    }
    assert_eq!(store.stats().unwrap().core.dram_read_bytes, 64 * LAYER);
    assert_eq!(
        store
            .batch_exists_consecutive(&["page-0", "page-1", "nope", "page-2"])
            .unwrap(),
        2
    );
    assert!(store.exists("page-7").unwrap());
    assert!(store.remove("page-7").unwrap());
    assert!(!store.exists("page-7").unwrap());
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shape_error_fails_the_whole_call() {
    let store = dram_only(4 << 20).open().await.unwrap();
    let mut buf = Buf::new(&store, 64 << 10).await;
    put_layers(&store, &mut buf, "a", 0, 4, 1000, 0).unwrap();
    let a = buf.addr();
    let unregistered = vec![0u8; 4096];
    let u = unregistered.as_ptr() as u64;
    let get = |ranges: &[Range]| {
        let good = [Range::new(0, 10, a)];
        store.batch_get_ranges(&[
            RangedGet {
                key: "a",
                ranges: &good,
            },
            RangedGet { key: "a", ranges },
        ])
    };
    assert!(matches!(
        get(&[Range::new(3990, 20, a)]),
        Err(StoreError::RangeOutsideObject {
            key_index: 1,
            object_len: 4000,
            ..
        })
    ));
    assert!(matches!(
        get(&[Range::new(0, 100, a), Range::new(50, 100, a + 200)]),
        Err(StoreError::RangesOverlap { key_index: 1, .. })
    ));
    assert!(matches!(
        get(&[Range::new(0, 0, a)]),
        Err(StoreError::ZeroLength { .. })
    ));
    assert!(matches!(
        get(&[Range::new(0, 10, u)]),
        Err(StoreError::Unregistered {
            key_index: 1,
            range_index: 0,
            ..
        })
    ));
    // A range that starts in registered memory and runs past it is not registered either.
    assert!(matches!(
        get(&[Range::new(0, 100, a + (64 << 10) - 50)]),
        Err(StoreError::Unregistered { .. })
    ));
    let long = "k".repeat(2000);
    assert!(matches!(
        store.batch_get_ranges(&[RangedGet {
            key: &long,
            ranges: &[Range::new(0, 1, a)]
        }]),
        Err(StoreError::BadKey { .. })
    ));
    let put = |key: &'static str, object_len: u64, ranges: &[Range]| {
        store.batch_put_ranges(&[RangedPut {
            key,
            object_len,
            ranges,
            depth: 0,
        }])
    };
    assert!(matches!(
        put("b", 100, &[Range::new(0, 50, a), Range::new(60, 40, a)]),
        Err(StoreError::RangesDoNotTile {
            gap_start: 50,
            gap_end: 60,
            ..
        })
    ));
    assert!(matches!(
        put("b", 100, &[Range::new(0, 60, a), Range::new(50, 50, a)]),
        Err(StoreError::RangesOverlap { .. })
    ));
    assert!(matches!(
        put("b", 100, &[Range::new(0, 120, a)]),
        Err(StoreError::RangeOutsideObject { .. })
    ));
    assert!(matches!(
        put("b", 100, &[Range::new(0, 100, u)]),
        Err(StoreError::Unregistered { .. })
    ));
    assert!(matches!(
        put("", 100, &[Range::new(0, 100, a)]),
        Err(StoreError::BadKey { .. })
    ));
    assert!(matches!(put("b", 0, &[]), Err(StoreError::ZeroLength { .. })));
    let r = [Range::new(0, 10, a)];
    assert!(matches!(
        store.batch_put_ranges(&[
            RangedPut {
                key: "b",
                object_len: 10,
                ranges: &r,
                depth: 0
            },
            RangedPut {
                key: "b",
                object_len: 10,
                ranges: &r,
                depth: 0
            },
        ]),
        Err(StoreError::DuplicateKey {
            key_index: 1,
            first_index: 0
        })
    ));
    // Nothing of a refused put was stored.
    assert!(!store.exists("b").unwrap());
    drop(unregistered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_errors_are_per_key() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let store = with_ssd(0, dir.path()).open().await.unwrap();
    let mut buf = Buf::new(&store, 1 << 20).await;
    put_layers(&store, &mut buf, "good", 0, 10, 4096, 0).unwrap();
    put_layers(&store, &mut buf, "bad", 0, 10, 4096, 0).unwrap();
    // Corrupt the middle of "bad" on disk.
    {
        use std::os::unix::fs::FileExt;
        let seg = std::fs::read_dir(dir.path()).unwrap().next().unwrap().unwrap().path();
        let f = std::fs::OpenOptions::new().write(true).open(seg).unwrap();
        // "bad" is the second record: header block + 10 payload blocks after the first record.
        f.write_all_at(&[0x5A; 64], 11 * 4096 + 4096 + 5 * 4096 + 100).unwrap();
    }
    let r1 = [Range::new(0, 40960, buf.addr())];
    let r2 = [Range::new(0, 40960, buf.addr() + 40960)];
    let r3 = [Range::new(0, 10, buf.addr() + 81920)];
    let got = store
        .batch_get_ranges(&[
            RangedGet {
                key: "good",
                ranges: &r1,
            },
            RangedGet {
                key: "bad",
                ranges: &r2,
            },
            RangedGet {
                key: "missing",
                ranges: &r3,
            },
        ])
        .unwrap();
    assert_eq!(*got[0].as_ref().unwrap(), 40960);
    assert!(matches!(got[1], Err(StoreError::Corrupt { .. })), "{:?}", got[1]);
    assert!(matches!(got[2], Err(StoreError::NotFound { .. })));
    assert_eq!(buf.data[..40960], object("good", 0, 40960)[..]);
    // Nothing of the corrupt object reached the caller.
    assert!(buf.data[40960..81920].iter().all(|&b| b == 0) || buf.data[40960..81920] != object("bad", 0, 40960)[..]);
    // The blocks of "bad" before the damage still read fine on their own.
    assert!(get_layers(&store, &mut buf, "bad", 0, 0, 4, 4096).is_ok());
    // A buffer too small for a whole get is that key's error.
    let got = store
        .batch_get(&[("good", buf.addr(), 100), ("good", buf.addr() + 4096, 40960)])
        .unwrap();
    assert!(matches!(
        got[0],
        Err(StoreError::BufferTooSmall {
            need: 40960,
            have: 100,
            ..
        })
    ));
    assert_eq!(*got[1].as_ref().unwrap(), 40960);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssd_ranged_read_reads_only_the_blocks_it_needs() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let store = with_ssd(0, dir.path()).open().await.unwrap();
    let layer = 37_440u64;
    let mut buf = Buf::new(&store, (61 * layer) as usize).await;
    put_layers(&store, &mut buf, "p", 3, 61, layer, 0).unwrap();
    let before = store.stats().unwrap().core.ssd_read_bytes;
    assert_eq!(get_layers(&store, &mut buf, "p", 3, 30, 1, layer).unwrap(), layer);
    let read = store.stats().unwrap().core.ssd_read_bytes - before;
    assert!(read <= 2 * layer, "{read} bytes read for one {layer}-byte layer");
    assert_eq!(get_layers(&store, &mut buf, "p", 3, 0, 61, layer).unwrap(), 61 * layer);
    let s = store.stats().unwrap();
    assert!(!s.core.ssd_io_engine.is_empty());
    // The simple API round-trips too.
    store.put("simple", b"hello world", 0).await.unwrap();
    assert_eq!(store.get("simple").await.unwrap(), b"hello world");
    assert!(matches!(store.get("nope").await, Err(StoreError::NotFound { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watermarks_demote_to_ssd_and_reads_promote() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let store = with_ssd(256 << 10, dir.path())
        .high_watermark(0.75)
        .low_watermark(0.5)
        .eviction(EvictionPolicy::Lru)
        .open()
        .await
        .unwrap();
    let cap = store.stats().unwrap().core.dram_capacity_bytes;
    let mut buf = Buf::new(&store, 64 << 10).await;
    let obj = 16 << 10;
    for i in 0..20 {
        put_layers(&store, &mut buf, &format!("k{i}"), i, 4, obj / 4, 0).unwrap();
        let s = store.stats().unwrap();
        assert!(
            s.core.dram_used_bytes <= cap * 3 / 4,
            "after put {i}: {} of {cap}",
            s.core.dram_used_bytes
        );
    }
    let s = store.stats().unwrap();
    assert!(s.core.demoted > 0 && s.core.dropped == 0, "{s:?}");
    assert_eq!(s.core.dram_objects + s.core.ssd_objects, 20, "{s:?}");
    // Every object is readable, wherever it lives now.
    for i in 0..20 {
        get_layers(&store, &mut buf, &format!("k{i}"), i, 0, 4, obj / 4).unwrap();
    }
    // k0 was demoted first (LRU) and read whole just now: it was promoted if it fit.
    assert!(store.stats().unwrap().core.promoted > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_aware_eviction_keeps_shared_prefixes() {
    // DRAM only: evicted objects are dropped, so what remains shows the order.
    let store = dram_only(64 << 10)
        .dram_page_bytes(4096)
        .high_watermark(1.0)
        .low_watermark(1.0)
        .eviction(EvictionPolicy::PrefixAware { window: 16 })
        .open()
        .await
        .unwrap();
    let mut buf = Buf::new(&store, 8192).await;
    // A 16-page prefix fills the arena; the 17th page must push one out: the deepest.
    for d in 0..16u32 {
        put_layers(&store, &mut buf, &format!("p{d}"), 0, 1, 4096, d).unwrap();
    }
    put_layers(&store, &mut buf, "other", 0, 1, 4096, 0).unwrap();
    assert!(!store.exists("p15").unwrap(), "the deepest page goes first");
    assert!((0..15).all(|d| store.exists(&format!("p{d}")).unwrap()));

    let lru = dram_only(64 << 10)
        .high_watermark(1.0)
        .low_watermark(1.0)
        .eviction(EvictionPolicy::Lru)
        .open()
        .await
        .unwrap();
    let mut buf = Buf::new(&lru, 8192).await;
    for d in 0..16u32 {
        put_layers(&lru, &mut buf, &format!("p{d}"), 0, 1, 4096, d).unwrap();
    }
    get_layers(&lru, &mut buf, "p0", 0, 0, 1, 4096).unwrap();
    put_layers(&lru, &mut buf, "other", 0, 1, 4096, 0).unwrap();
    assert!(lru.exists("p0").unwrap(), "read recently");
    assert!(!lru.exists("p1").unwrap(), "least recently used");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_survives_reopen() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    {
        let store = with_ssd(1 << 20, dir.path()).write_through(true).open().await.unwrap();
        let mut buf = Buf::new(&store, 1 << 16).await;
        for i in 0..5 {
            put_layers(&store, &mut buf, &format!("w{i}"), i, 3, 5000, 0).unwrap();
        }
        assert_eq!(store.stats().unwrap().core.ssd_objects, 5);
        store.close().await.unwrap();
        assert!(matches!(store.remove("w0"), Err(StoreError::Closed)));
    }
    let store = with_ssd(1 << 20, dir.path()).open().await.unwrap();
    let mut buf = Buf::new(&store, 1 << 16).await;
    for i in 0..5 {
        get_layers(&store, &mut buf, &format!("w{i}"), i, 0, 3, 5000).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_readers_and_writers_on_overlapping_keys() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    // Small DRAM so objects move between tiers while the threads run.
    let store = with_ssd(192 << 10, dir.path()).open().await.unwrap();
    let layer = 4096u64;
    let mut bufs = Vec::new();
    for _ in 0..4 {
        bufs.push(Buf::new(&store, (8 * layer) as usize).await);
    }
    let threads: Vec<_> = bufs
        .into_iter()
        .enumerate()
        .map(|(t, mut buf)| {
            let store = store.clone();
            std::thread::spawn(move || {
                for round in 0..60u32 {
                    let key = format!("shared-{}", round % 6);
                    if t % 2 == 0 {
                        // Each round writes a new version: a reader must see one whole version.
                        match put_layers(&store, &mut buf, &key, round, 8, layer, round % 3) {
                            Ok(()) | Err(StoreError::WriteConflict { .. }) => {}
                            Err(e) => panic!("put {key}: {e}"),
                        }
                    } else {
                        let ranges: Vec<Range> = (0..8)
                            .map(|l| Range::new(l * layer, layer, buf.addr() + l * layer))
                            .collect();
                        let got = store
                            .batch_get_ranges(&[RangedGet {
                                key: &key,
                                ranges: &ranges,
                            }])
                            .unwrap();
                        match &got[0] {
                            Ok(n) => {
                                assert_eq!(*n, 8 * layer);
                                let v = (0..60u32)
                                    .find(|&v| (0..64).all(|o| buf.data[o as usize] == byte(&key, v, o)))
                                    .unwrap_or_else(|| panic!("{key}: no version matches"));
                                assert!(
                                    buf.data[..(8 * layer) as usize] == object(&key, v, 8 * layer)[..],
                                    "{key}: torn read"
                                );
                            }
                            Err(StoreError::NotFound { .. }) => {}
                            Err(e) => panic!("get {key}: {e}"),
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = store.stats().unwrap();
    assert!(s.core.puts_ok > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phase_timings_only_when_switched_on() {
    let off = dram_only(1 << 20).ranged_call_debug(false).open().await.unwrap();
    assert!(off.phase_report().unwrap().is_none());
    let on = dram_only(1 << 20).ranged_call_debug(true).open().await.unwrap();
    let mut buf = Buf::new(&on, 1 << 16).await;
    put_layers(&on, &mut buf, "x", 0, 4, 1000, 0).unwrap();
    on.reset_phase_report().unwrap();
    get_layers(&on, &mut buf, "x", 0, 1, 2, 1000).unwrap();
    let r = on.phase_report().unwrap().expect("timings are on");
    assert_eq!((r.calls, r.items), (1, 2));
    assert!(r.nanos[te_base::Phase::Submit as usize] > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_larger_than_a_staging_slot_are_a_per_key_error() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let store = with_ssd(0, dir.path()).staging_bytes(64 << 10).open().await.unwrap();
    let mut buf = Buf::new(&store, 256 << 10).await;
    assert!(matches!(
        put_layers(&store, &mut buf, "big", 0, 2, 100 << 10, 0),
        Err(StoreError::TooLarge { .. })
    ));
    put_layers(&store, &mut buf, "small", 0, 2, 1000, 0).unwrap();
    assert!(!store.exists("big").unwrap());
    assert_eq!(store.stats().unwrap().core.puts_failed, 1);
}

/// One flipped byte, in a payload or a header, of a sealed or the active segment, affects only
/// its key, which reads `Corrupt` (whole and ranged); every other key survives reopen intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bytes_affect_only_their_key() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    // 3 x 4000-byte layers: a 4 KiB header and 3 payload blocks, 16 KiB per record; 4 records
    // per 64 KiB segment, 12 records: segments 0 and 1 sealed, 2 active.
    let open = || {
        with_ssd(0, dir.path())
            .ssd_segment_bytes(64 << 10)
            .ssd_capacity(64 << 20)
            .open()
    };
    {
        let store = open().await.unwrap();
        let mut buf = Buf::new(&store, 1 << 16).await;
        for i in 0..12 {
            put_layers(&store, &mut buf, &format!("k{i:02}"), i, 3, 4000, 0).unwrap();
        }
        store.close().await.unwrap();
    }
    let rec = 16 << 10;
    let flip = |seg: u32, at: u64| {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.path().join(format!("seg-{seg:08}.log")))
            .unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x04], at).unwrap();
    };
    flip(0, rec + 4096 + 7); // k01: payload, near its start, sealed segment
    flip(1, 2 * rec + 36); // k06: header (depth field), sealed segment
    flip(2, 4096 + 3 * 4096 - 1); // k08: payload, last byte, active segment
    flip(2, rec + 55); // k09: header (its block CRC table), active segment
    let store = open().await.unwrap();
    assert_eq!(store.stats().unwrap().core.ssd_torn_dropped, 0);
    assert_eq!(store.stats().unwrap().core.ssd_corrupt_records, 4);
    let mut buf = Buf::new(&store, 1 << 16).await;
    for i in 0..12u32 {
        let key = format!("k{i:02}");
        let got = get_layers(&store, &mut buf, &key, i, 0, 3, 4000);
        if [1, 6, 8, 9].contains(&i) {
            assert!(matches!(got, Err(StoreError::Corrupt { .. })), "{key}: {got:?}");
            let whole = store.batch_get(&[(&key, buf.addr(), 1 << 16)]).unwrap().remove(0);
            assert!(matches!(whole, Err(StoreError::Corrupt { .. })), "{key}: {whole:?}");
        } else {
            assert_eq!(got.unwrap(), 12_000, "{key}");
        }
    }
    // A damaged key can be put again.
    put_layers(&store, &mut buf, "k06", 100, 3, 4000, 0).unwrap();
    get_layers(&store, &mut buf, "k06", 100, 0, 3, 4000).unwrap();
}

/// Ranges that continue each other become one engine request, but never across two caller
/// registrations: two halves of one allocation registered separately, read by one key's two
/// ranges that meet exactly at the boundary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_ranges_merge_only_inside_one_registration() {
    let store = dram_only(16 << 20).open().await.unwrap();
    let mut src = Buf::new(&store, 8192).await;
    for (i, b) in src.data.iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    store
        .batch_put_ranges(&[RangedPut {
            key: "k",
            object_len: 8192,
            ranges: &[Range::new(0, 8192, src.addr())],
            depth: 0,
        }])
        .unwrap()
        .remove(0)
        .unwrap();
    let mut dest = vec![0u8; 8192];
    let base = dest.as_mut_ptr() as u64;
    for half in [base, base + 4096] {
        // SAFETY: `dest` outlives both registrations (released below).
        unsafe { store.register_buffer(half, 4096) }.await.unwrap();
    }
    let ranges = [Range::new(0, 4096, base), Range::new(4096, 4096, base + 4096)];
    let got = store
        .batch_get_ranges(&[RangedGet {
            key: "k",
            ranges: &ranges,
        }])
        .unwrap();
    assert_eq!(*got[0].as_ref().unwrap(), 8192);
    assert_eq!(dest, src.data);
    for half in [base, base + 4096] {
        assert!(store.deregister_buffer(half).await.unwrap());
    }
    src.release(&store).await;
}
