//! Key handles with the server's cached resolution, held to the per-key linearizability model
//! (`history`): reader threads ask for fixed key sets again and again (so their calls name the
//! keys by handle and the server reuses what it resolved for the set last time) while a writer
//! puts new versions, removes keys and, through a DRAM tier too small for them all, makes the
//! store demote and promote objects. Any stale, torn, foreign or resurrected value returned as
//! Ok is a failure; so is a run that never reused a resolution (the path under test).

mod history;
mod standalone_support;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use history::{tag_at, Log, Op};
use standalone_support::{sa, Server};
use umbp::{Range, RangedGet, RangedPut, Store, StoreError};

const KEYS: usize = 16;
const LAYER: u64 = 4096;
const LAYERS: u64 = 4;
const OBJECT: u64 = LAYER * LAYERS;
const READERS: usize = 2;
/// Keys per reader's key set (reader r asks for keys r*SET/2 .. r*SET/2 + SET, so sets overlap).
const SET: usize = 4;
const WRITES: usize = 600;
/// Reader calls that must complete between two writes, so resolutions get reused.
const CALLS_BETWEEN_WRITES: u64 = 3;
const BOUND: Duration = Duration::from_secs(60);

/// Byte `o` of version `v` of key `k`: each layer starts with its tag (version, layer, key), the
/// rest is a position- and version-dependent pattern.
fn content(k: usize, v: u32, o: u64) -> u8 {
    history::content(LAYER, k, v, o)
}

fn key(k: usize) -> String {
    format!("handles/key-{k}")
}

/// The ranges a reader asks of every key: layers 0, 2 and 3 (each starting with its tag), the
/// key's three landing back to back at `at` in the reader's buffer.
fn reader_ranges(at: u64) -> [Range; 3] {
    [
        Range::new(0, LAYER, at),
        Range::new(2 * LAYER, LAYER, at + LAYER),
        Range::new(3 * LAYER, LAYER, at + 2 * LAYER),
    ]
}

/// Checks one key's bytes of a reader call; the version they all carry, or what is wrong.
fn read_version(k: usize, got: &[u8]) -> Result<u32, String> {
    let (v, l, kk) = tag_at(got);
    if (l, kk as usize) != (0, k) {
        return Err(format!(
            "key {k}: layer 0 tag says layer {l} of key {kk} (foreign bytes)"
        ));
    }
    for (i, layer) in [0u64, 2, 3].into_iter().enumerate() {
        let part = &got[i * LAYER as usize..(i + 1) * LAYER as usize];
        if let Some(o) = (0..LAYER).find(|&o| part[o as usize] != content(k, v, layer * LAYER + o)) {
            return Err(format!(
                "key {k} v{v}: wrong byte at layer {layer} + {o} (torn or stale pages)"
            ));
        }
    }
    Ok(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handle_hits_are_linearizable_under_puts_removes_and_eviction() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir_all(&ssd).unwrap();
    // DRAM for about 13 of the 16 objects: puts demote others (reads may promote them back).
    let server = Server::start(
        dir.path(),
        &["--dram", "208K", "--ssd-dirs", ssd.to_str().unwrap()],
        &[],
    );
    let store = Store::builder().connect(&server.socket).open().await.unwrap();
    let log = Arc::new(Log::new(KEYS));
    let calls = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let versions = Arc::new(AtomicU32::new(1));
    let deadline = Instant::now() + BOUND;

    // Every key starts with a version.
    let src = store.alloc_buffer(OBJECT as usize).unwrap();
    // SAFETY: freed after the writer is done.
    unsafe { store.register_buffer(src.addr(), src.len() as u64) }
        .await
        .unwrap();
    let put = |k: usize| -> Result<(), String> {
        let v = versions.fetch_add(1, Ordering::Relaxed);
        // SAFETY: only the writer (this closure's caller) uses `src`, between calls.
        let b = unsafe { src.bytes_mut() };
        for o in 0..OBJECT {
            b[o as usize] = content(k, v, o);
        }
        let ranges = [Range::new(0, OBJECT, src.addr())];
        let name = key(k);
        let (start, r, end) = log.timed(|| {
            store.batch_put_ranges(&[RangedPut {
                key: &name,
                object_len: OBJECT,
                ranges: &ranges,
                depth: 0,
            }])
        });
        let r = r.map_err(|e| e.to_string())?.remove(0);
        r.map_err(|e| format!("put {name} v{v}: {e}"))?;
        log.push(k, Op::Put { version: v }, start, end);
        Ok(())
    };
    for k in 0..KEYS {
        put(k).unwrap();
    }

    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let (store, log, calls, stop) = (store.clone(), log.clone(), calls.clone(), stop.clone());
            let dest = store.alloc_buffer(SET * 3 * LAYER as usize).unwrap();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
                // SAFETY: freed at the end of this thread.
                rt.block_on(unsafe { store.register_buffer(dest.addr(), dest.len() as u64) })
                    .unwrap();
                let ks: Vec<usize> = (0..SET).map(|i| (r * SET / 2 + i) % KEYS).collect();
                let names: Vec<String> = ks.iter().map(|&k| key(k)).collect();
                let ranges: Vec<[Range; 3]> = (0..SET)
                    .map(|i| reader_ranges(dest.addr() + (i as u64) * 3 * LAYER))
                    .collect();
                let gets: Vec<RangedGet<'_>> = names
                    .iter()
                    .zip(&ranges)
                    .map(|(n, r)| RangedGet { key: n, ranges: r })
                    .collect();
                let mut problems = Vec::new();
                while !stop.load(Ordering::Acquire) && Instant::now() < deadline {
                    // SAFETY: no call is in flight on `dest`.
                    unsafe { dest.bytes_mut() }.fill(0xEE);
                    let (start, got, end) = log.timed(|| store.batch_get_ranges(&gets));
                    let got = match got {
                        Ok(g) => g,
                        Err(e) => {
                            problems.push(format!("reader {r}: call failed: {e}"));
                            break;
                        }
                    };
                    // SAFETY: the call has returned.
                    let bytes = unsafe { dest.bytes() };
                    for (i, res) in got.into_iter().enumerate() {
                        let k = ks[i];
                        let saw = match res {
                            Ok(_) => {
                                match read_version(k, &bytes[i * 3 * LAYER as usize..(i + 1) * 3 * LAYER as usize]) {
                                    Ok(v) => Some(v),
                                    Err(e) => {
                                        problems.push(e);
                                        continue;
                                    }
                                }
                            }
                            Err(StoreError::NotFound { .. }) => None,
                            Err(e) => {
                                problems.push(format!("key {k}: {e}"));
                                continue;
                            }
                        };
                        log.push(k, Op::Get { saw }, start, end);
                    }
                    calls.fetch_add(1, Ordering::Release);
                }
                rt.block_on(store.free_buffer(dest)).unwrap();
                problems
            })
        })
        .collect();

    // The writer: puts (70%) and removes (30%) of random keys, each after the readers made a
    // few calls since the last write (so some calls find the index unchanged and reuse).
    let mut problems = Vec::new();
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    for _ in 0..WRITES {
        let target = calls.load(Ordering::Acquire) + CALLS_BETWEEN_WRITES;
        while calls.load(Ordering::Acquire) < target && Instant::now() < deadline {
            std::thread::yield_now();
        }
        let k = rng.usize(..KEYS);
        if rng.u32(..100) < 70 {
            if let Err(e) = put(k) {
                problems.push(e);
            }
        } else {
            let name = key(k);
            let (start, r, end) = log.timed(|| store.remove(&name));
            match r {
                Ok(_) => log.push(k, Op::Remove, start, end),
                Err(e) => problems.push(format!("remove {name}: {e}")),
            }
        }
    }
    stop.store(true, Ordering::Release);
    for t in readers {
        problems.extend(t.join().unwrap());
    }
    assert!(Instant::now() < deadline, "the run did not finish within {BOUND:?}");
    let st = store.stats().unwrap();
    store.free_buffer(src).await.unwrap();
    store.close().await.unwrap();
    let (stale, gets) = log.check();
    println!(
        "{gets} gets checked; {} calls reused a resolution; handle hits {}; demoted {}, promoted {}",
        st.core.resolve_reused,
        sa(&st).server_key_handle_hits,
        st.core.demoted,
        st.core.promoted
    );
    history::assert_clean(&problems, &stale);
    assert!(
        st.core.resolve_reused > 50 && st.core.demoted > 0,
        "the run must reuse resolutions and demote objects: {st:?}"
    );
}
