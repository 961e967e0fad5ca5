//! Per-key linearizability under concurrency: threads put, overwrite, remove and read (whole and
//! ranged) a few keys on a tiny DRAM tier over SSD, so objects are demoted and promoted all the
//! time, while compaction rewrites SSD records under them. Every call is recorded with a start
//! and an end tick of one global counter; afterwards every get is checked against the history of
//! its key:
//!
//! - it returns a version whose put started before the get ended and was not overwritten by a
//!   write (put or remove) that started after the put ended and ended before the get started;
//!   NotFound likewise needs such a remove (or no completed put at all);
//! - a get that starts after another get ended never returns an older version than it (a version
//!   whose put ended before the other's put started);
//! - the bytes are exactly that version's, whole (a whole get has the version's length), never a
//!   mix of versions.

mod common;
mod history;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use history::{check_key, tag_at, Log, Op};
use umbp::{EvictionPolicy, Range, RangedGet, RangedPut, StoreError};

const KEYS: usize = 10;
const LAYER: u64 = 3000;
const MAX_LAYERS: u64 = 10;
const THREADS: usize = 4;
/// The run goes on at least this long, and then until what it must exercise was seen (see
/// [`exercised`]): how fast the machine is changes how long it takes, not the verdict.
const RUN: Duration = Duration::from_secs(3);
/// A hang guard only: a run that has not exercised the tiers by then fails.
const HANG_GUARD: Duration = Duration::from_secs(300);
const MAX_OPS_PER_THREAD: usize = 20_000;

/// Layers of version `v` (2..=10), so versions differ in length and truncation shows.
fn layers_of(v: u32) -> u64 {
    2 + (v as u64 * 7) % (MAX_LAYERS - 1)
}

/// Byte `o` of version `v` of key `k`: each layer starts with a tag (version, layer, key), the
/// rest is a position- and version-dependent pattern.
fn content(k: usize, v: u32, o: u64) -> u8 {
    history::content(LAYER, k, v, o)
}

fn key(k: usize) -> String {
    format!("key-{k}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gets_are_linearizable_under_puts_removes_promotion_and_demotion() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let builder = with_ssd(160 << 10, dir.path())
        .high_watermark(0.75)
        .low_watermark(0.5)
        .eviction(EvictionPolicy::Lru)
        .staging_slots(4)
        .ssd_segment_bytes(256 << 10);
    let store = builder.clone().open().await.unwrap();
    let log = Arc::new(Log {
        per_key: (0..KEYS).map(|_| Mutex::new(Vec::new())).collect(),
        tick: AtomicU64::new(1),
    });
    let versions = Arc::new(AtomicU32::new(1));
    let mut bufs = Vec::new();
    for _ in 0..THREADS {
        // Source object, whole-get target, ranged-get target.
        bufs.push(Buf::new(&store, (3 * MAX_LAYERS * LAYER) as usize).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let gets_done = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = bufs
        .into_iter()
        .enumerate()
        .map(|(t, mut buf)| {
            let (store, log, versions) = (store.clone(), log.clone(), versions.clone());
            let (stop, gets_done) = (stop.clone(), gets_done.clone());
            std::thread::spawn(move || {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ ((t as u64 + 1) * 0x2545_F491_4F6C_DD1D);
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                let base = buf.addr();
                let src = 0u64;
                let whole_at = MAX_LAYERS * LAYER;
                let ranged_at = 2 * MAX_LAYERS * LAYER;
                let mut problems = Vec::new();
                for _ in 0..MAX_OPS_PER_THREAD {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let k = (next() % KEYS as u64) as usize;
                    let name = key(k);
                    let dice = next() % 100;
                    if dice < 35 {
                        let v = versions.fetch_add(1, Ordering::Relaxed);
                        let len = layers_of(v) * LAYER;
                        for o in 0..len {
                            buf.data[(src + o) as usize] = content(k, v, o);
                        }
                        // A few ranges per layer, as a connector offloads a page.
                        let ranges: Vec<Range> = (0..len / LAYER)
                            .flat_map(|l| {
                                [
                                    Range::new(l * LAYER, 1000, base + src + l * LAYER),
                                    Range::new(l * LAYER + 1000, LAYER - 1000, base + src + l * LAYER + 1000),
                                ]
                            })
                            .collect();
                        let (start, r, end) = log.timed(|| {
                            store
                                .batch_put_ranges(&[RangedPut {
                                    key: &name,
                                    object_len: len,
                                    ranges: &ranges,
                                    depth: v % 4,
                                }])
                                .unwrap()
                                .remove(0)
                        });
                        match r {
                            Ok(()) => log.push(k, Op::Put { version: v }, start, end),
                            Err(e) => problems.push(format!("put {name} v{v}: {e}")),
                        }
                    } else if dice < 45 {
                        let (start, r, end) = log.timed(|| store.remove(&name));
                        match r {
                            Ok(_) => log.push(k, Op::Remove, start, end),
                            Err(e) => problems.push(format!("remove {name}: {e}")),
                        }
                    } else if dice < 75 {
                        let cap = MAX_LAYERS * LAYER;
                        buf.data[whole_at as usize..(whole_at + cap) as usize].fill(0xEE);
                        let (start, r, end) =
                            log.timed(|| store.batch_get(&[(&name, base + whole_at, cap)]).unwrap().remove(0));
                        let saw = match r {
                            Ok(n) => {
                                let got = &buf.data[whole_at as usize..(whole_at + n) as usize];
                                let (v, _, kk) = tag_at(got);
                                if kk as usize != k || n != layers_of(v) * LAYER {
                                    problems.push(format!(
                                        "whole get {name}: {n} bytes, tag says v{v} of key {kk} (truncated or foreign)"
                                    ));
                                    continue;
                                }
                                if let Some(o) = (0..n).find(|&o| got[o as usize] != content(k, v, o)) {
                                    problems.push(format!("whole get {name} v{v}: wrong byte at {o} (mixed versions)"));
                                    continue;
                                }
                                Some(v)
                            }
                            Err(StoreError::NotFound { .. }) => None,
                            Err(e) => {
                                problems.push(format!("whole get {name}: {e}"));
                                continue;
                            }
                        };
                        log.push(k, Op::Get { saw }, start, end);
                        gets_done.fetch_add(1, Ordering::Relaxed);
                    } else {
                        // Layers 1 and 0 (every version has both) into separate places, plus a
                        // range that crosses from layer 0 into layer 1.
                        let ranges = [
                            Range::new(LAYER, LAYER, base + ranged_at),
                            Range::new(0, 100, base + ranged_at + LAYER),
                            Range::new(LAYER - 50, 40, base + ranged_at + LAYER + 200),
                        ];
                        buf.data[ranged_at as usize..(ranged_at + 2 * LAYER) as usize].fill(0xEE);
                        let (start, r, end) = log.timed(|| {
                            store
                                .batch_get_ranges(&[RangedGet {
                                    key: &name,
                                    ranges: &ranges,
                                }])
                                .unwrap()
                                .remove(0)
                        });
                        let saw = match r {
                            Ok(n) => {
                                assert_eq!(n, LAYER + 140);
                                let d = &buf.data[ranged_at as usize..];
                                let (v1, l1, k1) = tag_at(&d[..12]);
                                let (v0, l0, k0) = tag_at(&d[LAYER as usize..LAYER as usize + 12]);
                                if (v0, l0, k0 as usize, l1, k1 as usize) != (v1, 0, k, 1, k) {
                                    problems.push(format!("ranged get {name}: layer tags v{v1}/{l1} and v{v0}/{l0}"));
                                    continue;
                                }
                                let v = v0;
                                let ok = (0..LAYER).all(|o| d[o as usize] == content(k, v, LAYER + o))
                                    && (0..100).all(|o| d[(LAYER + o) as usize] == content(k, v, o))
                                    && (0..40).all(|o| d[(LAYER + 200 + o) as usize] == content(k, v, LAYER - 50 + o));
                                if !ok {
                                    problems.push(format!("ranged get {name} v{v}: wrong bytes"));
                                    continue;
                                }
                                Some(v)
                            }
                            Err(StoreError::NotFound { .. }) => None,
                            Err(e) => {
                                problems.push(format!("ranged get {name}: {e}"));
                                continue;
                            }
                        };
                        log.push(k, Op::Get { saw }, start, end);
                        gets_done.fetch_add(1, Ordering::Relaxed);
                    }
                }
                problems
            })
        })
        .collect();
    // Compaction runs all the time too, moving records while they are read, replaced, removed.
    let compactor = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut runs = 0u32;
            while !stop.load(Ordering::Acquire) && runs < 100_000 {
                store.compact(true).unwrap();
                runs += 1;
                std::thread::yield_now();
            }
        })
    };
    // Stop once the run lasted RUN and the tiers were exercised, or every thread ran its ops.
    let started = Instant::now();
    while started.elapsed() < HANG_GUARD && !threads.iter().all(|t| t.is_finished()) {
        if started.elapsed() >= RUN && exercised(&store.stats().unwrap(), gets_done.load(Ordering::Relaxed)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Release);
    let mut problems = Vec::new();
    for t in threads {
        problems.extend(t.join().unwrap());
    }
    compactor.join().unwrap();
    let stats = store.stats().unwrap();
    // Close (which writes DRAM-only objects to the log) and reopen: every key reads a version no
    // later write overwrote, or NotFound after a remove; nothing removed or replaced comes back.
    store.close().await.unwrap();
    drop(store);
    let store = builder.open().await.unwrap();
    let buf = Buf::new(&store, (MAX_LAYERS * LAYER) as usize).await;
    for k in 0..KEYS {
        let name = key(k);
        let (start, r, end) = log.timed(|| {
            store
                .batch_get(&[(&name, buf.addr(), MAX_LAYERS * LAYER)])
                .unwrap()
                .remove(0)
        });
        let saw = match r {
            Ok(n) => {
                let (v, _, _) = tag_at(&buf.data);
                assert_eq!(n, layers_of(v) * LAYER, "{name} after reopen");
                assert!(
                    (0..n).all(|o| buf.data[o as usize] == content(k, v, o)),
                    "{name} after reopen"
                );
                Some(v)
            }
            Err(StoreError::NotFound { .. }) => None,
            Err(e) => panic!("{name} after reopen: {e}"),
        };
        log.push(k, Op::Get { saw }, start, end);
    }
    let mut gets = 0usize;
    let mut stale = Vec::new();
    for (k, events) in log.per_key.iter().enumerate() {
        let events = events.lock().unwrap().clone();
        gets += events.iter().filter(|e| matches!(e.op, Op::Get { .. })).count();
        stale.extend(check_key(k, &events));
    }
    println!(
        "{gets} gets checked; stats: demoted {}, promoted {}, demotion failed {}, puts ok {}, segments compacted {}",
        stats.core.demoted,
        stats.core.promoted,
        stats.core.demotion_failed,
        stats.core.puts_ok,
        stats.core.ssd_segments_compacted
    );
    assert!(
        stats.core.demoted > 0 && stats.core.promoted > 0 && stats.core.ssd_segments_compacted > 0,
        "the run must move objects between tiers and compact: {stats:?}"
    );
    assert!(gets > 100, "only {gets} gets ran");
    history::assert_clean(&problems, &stale);
}

/// What the run must have exercised before it may stop: objects demoted and promoted, SSD
/// segments compacted, and more than 100 gets (the final assertions).
fn exercised(stats: &umbp::StoreStats, gets: usize) -> bool {
    stats.core.demoted > 0 && stats.core.promoted > 0 && stats.core.ssd_segments_compacted > 0 && gets > 100
}
