//! `te-bench umbp --standalone`: the store behind an `umbp-server` process.
//!
//! Two shapes:
//! - The seed's chunked reader (`--keys`, `--chunk`, `--ranges-per-key`, `--threads`): every pass
//!   asks for `keys` keys in calls of `chunk` keys, each key with `ranges-per-key` ranges, walking
//!   the chunks in the same order (a cycle of key sets). `--key-handles on,off` alternates the
//!   arms in one run, `--reps` times (median reported): "on" is a client with the default cache,
//!   "off" one with `UMBP_KEY_HANDLE_SLOTS=0`, both on the same server.
//! - The pool geometry of `te-bench umbp` with `--ranks` worker *processes*; with
//!   `--compare-local` the same shape runs in local mode in the same invocation.
//!
//! The server is started here (the `umbp-server` next to this binary, or `UMBP_SERVER_BIN`)
//! unless `--socket` names a running one.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use umbp::{KvBuffer, Range, RangedGet, RangedPut, Store};

use crate::util::{median, print_json, runtime};

/// A server this bench started; killed on drop.
pub struct OwnServer {
    child: Child,
    dir: PathBuf,
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The socket to use: `socket` if given, else a server started here with `args`.
pub fn server(socket: &Option<PathBuf>, args: &[String]) -> Result<(PathBuf, Option<OwnServer>), String> {
    if let Some(s) = socket {
        return Ok((s.clone(), None));
    }
    let bin = match std::env::var_os("UMBP_SERVER_BIN") {
        Some(b) => PathBuf::from(b),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("umbp-server"),
    };
    if !bin.exists() {
        return Err(format!(
            "{} not found: build it (cargo build --release -p umbp --bin umbp-server), set UMBP_SERVER_BIN, or pass --socket",
            bin.display()
        ));
    }
    let dir = std::env::temp_dir().join(format!("umbp-bench-server-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let socket = dir.join("umbp.sock");
    let child = Command::new(&bin)
        .arg("--socket")
        .arg(&socket)
        .args(args)
        .env_remove("UMBP_STANDALONE_SOCKET")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {}: {e}", bin.display()))?;
    let own = OwnServer { child, dir };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if Instant::now() > deadline {
            return Err("umbp-server did not start listening within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok((socket, Some(own)))
}

/// The chunked-reader shape.
pub struct ReaderShape {
    pub keys: usize,
    pub chunk: usize,
    pub ranges_per_key: usize,
    pub range_bytes: u64,
    pub key_bytes: usize,
    pub threads: usize,
    pub passes: usize,
    pub reps: usize,
    pub arms: Vec<bool>,
    pub verify: bool,
    pub json: bool,
}

fn reader_key(i: usize, len: usize) -> String {
    let mut k = format!("reader/layer-group/{i:08}/");
    while k.len() < len {
        k.push(char::from(b'a' + (k.len() % 26) as u8));
    }
    k.truncate(len.max(20));
    k
}

/// One arm's measurement.
struct ArmSample {
    call_us_p50: f64,
    pass_ms: f64,
    hit_rate: f64,
    bytes_per_call: f64,
    mismatched: u64,
}

pub fn run_reader(shape: ReaderShape, socket: &Option<PathBuf>) -> Result<(), String> {
    if shape.keys == 0 || shape.chunk == 0 || shape.ranges_per_key == 0 || shape.threads == 0 || shape.reps == 0 {
        return Err("--keys, --chunk, --ranges-per-key, --threads and --reps must be positive".into());
    }
    let object = shape.ranges_per_key as u64 * shape.range_bytes;
    let data = object * shape.keys as u64;
    let dram = (data + data / 2 + (64 << 20)).next_multiple_of(4096);
    let (socket, _own) = server(socket, &["--dram".into(), dram.to_string()])?;
    let rt = runtime()?;
    let keys: Vec<String> = (0..shape.keys).map(|i| reader_key(i, shape.key_bytes)).collect();
    // One client per arm, on the same server: "on" with the default cache, "off" with none.
    let mut stores = Vec::new();
    for &on in &shape.arms {
        let b = Store::builder().connect(&socket).key_handle_slots(if on {
            umbp::standalone::key_handles::DEFAULT_SLOTS
        } else {
            0
        });
        stores.push(rt.block_on(b.open()).map_err(|e| format!("connect: {e}"))?);
    }
    // Fill: objects of ranges_per_key ranges, pattern-filled, through a client of its own (so
    // neither arm's client is the one that wrote).
    let writer = &rt
        .block_on(Store::builder().connect(&socket).key_handle_slots(0).open())
        .map_err(|e| format!("connect: {e}"))?;
    let staging = writer
        .alloc_buffer((object as usize * 256).max(4096))
        .map_err(|e| e.to_string())?;
    // SAFETY: freed after the puts.
    rt.block_on(unsafe { writer.register_buffer(staging.addr(), staging.len() as u64) })
        .map_err(|e| e.to_string())?;
    for batch in keys.chunks(256) {
        // SAFETY: no call uses the staging buffer now.
        let b = unsafe { staging.bytes_mut() };
        for (i, k) in batch.iter().enumerate() {
            for (j, x) in b[i * object as usize..(i + 1) * object as usize].iter_mut().enumerate() {
                *x = crate::util::pattern(seed_of(k), j as u64);
            }
        }
        let ranges: Vec<[Range; 1]> = (0..batch.len())
            .map(|i| [Range::new(0, object, staging.addr() + i as u64 * object)])
            .collect();
        let puts: Vec<RangedPut<'_>> = batch
            .iter()
            .zip(&ranges)
            .map(|(k, r)| RangedPut {
                key: k,
                object_len: object,
                ranges: r,
                depth: 0,
            })
            .collect();
        for r in writer.batch_put_ranges(&puts).map_err(|e| e.to_string())? {
            r.map_err(|e| format!("put: {e}"))?;
        }
    }
    rt.block_on(writer.free_buffer(staging)).map_err(|e| e.to_string())?;
    rt.block_on(writer.close()).map_err(|e| e.to_string())?;

    // Per arm and thread: a destination buffer of one chunk's ranges.
    let dest_len = shape.chunk * shape.ranges_per_key * shape.range_bytes as usize;
    let mut dests: Vec<Vec<KvBuffer>> = Vec::new();
    for s in &stores {
        let mut v = Vec::new();
        for _ in 0..shape.threads {
            let b = s.alloc_buffer(dest_len).map_err(|e| e.to_string())?;
            // SAFETY: freed at the end.
            rt.block_on(unsafe { s.register_buffer(b.addr(), b.len() as u64) })
                .map_err(|e| e.to_string())?;
            v.push(b);
        }
        dests.push(v);
    }
    let mut samples: Vec<Vec<ArmSample>> = (0..shape.arms.len()).map(|_| Vec::new()).collect();
    // Arms alternate, and their order flips every repetition: whichever arm runs first in a
    // repetition measured slower here, whatever it was.
    for rep in 0..shape.reps {
        let mut order: Vec<usize> = (0..stores.len()).collect();
        if rep % 2 == 1 {
            order.reverse();
        }
        for a in order {
            samples[a].push(measure_arm(&stores[a], &dests[a], &keys, &shape)?);
        }
    }
    for (a, &on) in shape.arms.iter().enumerate() {
        let v = &mut samples[a];
        let med = |f: &dyn Fn(&ArmSample) -> f64| {
            let mut x: Vec<f64> = v.iter().map(f).collect();
            x.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
            x[x.len() / 2]
        };
        let row = serde_json::json!({
            "bench": "umbp",
            "mode": "standalone",
            "shape": "reader",
            "key_handles": if on { "on" } else { "off" },
            "keys": shape.keys,
            "chunk": shape.chunk,
            "ranges_per_key": shape.ranges_per_key,
            "range_bytes": shape.range_bytes,
            "key_bytes": keys[0].len(),
            "threads": shape.threads,
            "reps": shape.reps,
            "call_us_p50": med(&|s| s.call_us_p50),
            "pass_ms_p50": med(&|s| s.pass_ms),
            "key_handle_hit_rate": med(&|s| s.hit_rate),
            "bytes_on_socket_per_call": med(&|s| s.bytes_per_call),
            "ranges_bytes_per_call": (shape.chunk * shape.ranges_per_key * wire_range_bytes()) as f64,
            "mismatched_bytes": v.iter().map(|s| s.mismatched).sum::<u64>(),
            "verified": shape.verify,
        });
        if shape.json {
            print_json(&row);
        } else {
            println!("{row}");
        }
    }
    for (s, d) in stores.iter().zip(dests) {
        for b in d {
            rt.block_on(s.free_buffer(b)).map_err(|e| e.to_string())?;
        }
        // With UMBP_KEY_HANDLE_DEBUG=1 the client prints its reuse-distance line at close.
        rt.block_on(s.close()).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn wire_range_bytes() -> usize {
    umbp::standalone::wire::RANGE_BYTES
}

fn seed_of(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Per reader thread: call times, mean pass time, mismatched bytes.
type ThreadResult = (Vec<Duration>, Duration, u64);

/// One pass per thread over every chunk (after a warm-up pass), timing each call.
fn measure_arm(store: &Store, dests: &[KvBuffer], keys: &[String], shape: &ReaderShape) -> Result<ArmSample, String> {
    let st0 = standalone_stats(store)?;
    let (b0, c0) = store.key_handle_report().map_or((0, 0), |r| (r.1, r.2));
    let barrier = Arc::new(Barrier::new(shape.threads));
    let rb = shape.range_bytes;
    let rpk = shape.ranges_per_key as u64;
    let results: Vec<Result<ThreadResult, String>> = std::thread::scope(|sc| {
        let handles: Vec<_> = dests
            .iter()
            .map(|dest| {
                let barrier = barrier.clone();
                sc.spawn(move || {
                    let mut calls = Vec::new();
                    let mut pass_time = Duration::ZERO;
                    let mut bad = 0u64;
                    // Ranges of key i of a chunk: range j is the object's j-th slice, landing at
                    // (i * rpk + j) * rb in the destination; the same for every chunk.
                    let ranges: Vec<Vec<Range>> = (0..shape.chunk as u64)
                        .map(|i| {
                            (0..rpk)
                                .map(|j| Range::new(j * rb, rb, dest.addr() + (i * rpk + j) * rb))
                                .collect()
                        })
                        .collect();
                    for pass in 0..shape.passes + 1 {
                        barrier.wait();
                        let t0 = Instant::now();
                        for chunk in keys.chunks(shape.chunk) {
                            let gets: Vec<RangedGet<'_>> = chunk
                                .iter()
                                .zip(&ranges)
                                .map(|(k, r)| RangedGet { key: k, ranges: r })
                                .collect();
                            let tc = Instant::now();
                            for r in store.batch_get_ranges(&gets).map_err(|e| format!("get: {e}"))? {
                                r.map_err(|e| format!("get: {e}"))?;
                            }
                            if pass > 0 {
                                calls.push(tc.elapsed());
                            }
                            if shape.verify && pass == shape.passes {
                                // SAFETY: the call has returned; this thread owns `dest`.
                                let b = unsafe { dest.bytes() };
                                for (i, k) in chunk.iter().enumerate() {
                                    let s = seed_of(k);
                                    let at = i * (rpk * rb) as usize;
                                    for x in 0..(rpk * rb) as usize {
                                        if b[at + x] != crate::util::pattern(s, x as u64) {
                                            bad += 1;
                                        }
                                    }
                                }
                            }
                        }
                        if pass > 0 {
                            pass_time += t0.elapsed();
                        }
                    }
                    Ok((calls, pass_time / shape.passes.max(1) as u32, bad))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("reader thread")).collect()
    });
    let mut calls = Vec::new();
    let mut pass = Vec::new();
    let mut bad = 0;
    for r in results {
        let (c, p, b) = r?;
        calls.extend(c);
        pass.push(p);
        bad += b;
    }
    let st1 = standalone_stats(store)?;
    let (b1, c1) = store.key_handle_report().map_or((0, 0), |r| (r.1, r.2));
    let hits = st1.key_handle_hits - st0.key_handle_hits;
    let total = hits + st1.key_handle_misses - st0.key_handle_misses;
    Ok(ArmSample {
        call_us_p50: median(&mut calls).as_secs_f64() * 1e6,
        pass_ms: median(&mut pass).as_secs_f64() * 1e3,
        hit_rate: hits as f64 / total.max(1) as f64,
        bytes_per_call: (b1 - b0) as f64 / (c1 - c0).max(1) as f64,
        mismatched: bad,
    })
}

/// Runs `ranks` copies of this bench as worker processes (`--worker-rank r`), starts them
/// together once all have loaded their pages, and returns what each printed.
pub fn run_workers(socket: &Path, ranks: usize, forward: &[String]) -> Result<Vec<String>, String> {
    use std::io::{BufRead, BufReader, Write};
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Vec::new();
    for r in 0..ranks {
        let child = Command::new(&exe)
            .arg("umbp")
            .args(forward)
            .arg("--socket")
            .arg(socket)
            .arg("--worker-rank")
            .arg(r.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawning a worker: {e}"))?;
        children.push(child);
    }
    let mut outs = Vec::new();
    for c in &mut children {
        let mut lines = BufReader::new(c.stdout.take().expect("piped"));
        let mut line = String::new();
        lines.read_line(&mut line).map_err(|e| e.to_string())?;
        if line.trim() != "ready" {
            return Err(format!("worker failed before loading: {line:?}"));
        }
        outs.push(lines);
    }
    for c in &mut children {
        c.stdin
            .as_mut()
            .expect("piped")
            .write_all(b"go\n")
            .map_err(|e| e.to_string())?;
    }
    let mut results = Vec::new();
    for (mut out, c) in outs.into_iter().zip(children.iter_mut()) {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut out, &mut s).map_err(|e| e.to_string())?;
        let st = c.wait().map_err(|e| e.to_string())?;
        if !st.success() {
            return Err(format!("worker exited with {st}: {s}"));
        }
        results.push(s);
    }
    Ok(results)
}

/// In a worker process: tells the parent the pages are loaded and waits for its go.
pub fn worker_ready_then_wait() -> Result<(), String> {
    use std::io::{BufRead, Write};
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The store's standalone counters (it is a standalone client here).
fn standalone_stats(store: &Store) -> Result<umbp::StandaloneStats, String> {
    let s = store.stats().map_err(|e| e.to_string())?;
    s.standalone
        .ok_or_else(|| "the store is not a standalone client".to_string())
}
