//! The rank loop: each rank restores its pages layer group by layer group, then copies the same
//! fragments with a plain loop; the ranks run as threads (local) or worker processes
//! (standalone), and each restore yields one sample.

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use umbp::{Range, RangedGet, Store};

use super::setup::{fill, groups, key, parse_pools, put_rank, rank_mem, seed, GroupCall, Pool, PutTally, RankMem};
use super::Args;
use crate::umbp_standalone;
use crate::util::runtime;

pub(crate) struct Sample {
    pub(crate) restore: Duration,
    pub(crate) ttfl: Duration,
    pub(crate) load: Duration,
    pub(crate) memcpy: Duration,
    pub(crate) smallest_load: Duration,
    pub(crate) smallest_memcpy: Duration,
    pub(crate) mismatched: u64,
}

/// Runs `ranks` ranks at once over the prepared `mems` (threads), or as worker processes of the
/// server at `socket`; returns every rank's samples.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_ranks(
    store: &Store,
    socket: Option<&Path>,
    ranks: usize,
    mems: &[RankMem],
    pools: &[Pool],
    groups: &[(u32, Vec<GroupCall>)],
    smallest: usize,
    args: &Args,
) -> Result<Vec<Vec<Sample>>, String> {
    if let Some(socket) = socket {
        let outs = umbp_standalone::run_workers(socket, ranks, &worker_args(args))?;
        return outs.iter().map(|o| parse_samples(o)).collect();
    }
    let barrier = Arc::new(Barrier::new(ranks));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let (barrier, mem) = (barrier.clone(), &mems[r]);
                s.spawn(move || rank_loop(store, &barrier, r, mem, pools, groups, smallest, args))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect::<Result<_, String>>()
    })
}

/// The arguments a worker process needs to build the same shape.
fn worker_args(args: &Args) -> Vec<String> {
    let mut v = vec![
        format!("--pools={}", args.pools),
        format!("--layer-group={}", args.layer_group),
        format!("--pages={}", args.pages),
        format!("--requests={}", args.requests),
        format!("--compute-us-per-layer={}", args.compute_us_per_layer),
        format!("--calls-per-group={}", args.calls_per_group),
    ];
    if args.verify {
        v.push("--verify".into());
    }
    v
}

/// A worker process of a standalone restore: loads its rank, waits for the parent's go, runs the
/// restores and prints one sample per line (nanoseconds, then mismatched bytes).
pub(super) fn worker(args: &Args, r: usize) -> Result<(), String> {
    let socket = args.socket.as_ref().ok_or("--worker-rank needs --socket")?;
    let pools = parse_pools(&args.pools)?;
    let rt = runtime()?;
    let store = rt
        .block_on(Store::builder().connect(socket).open())
        .map_err(|e| format!("connect: {e}"))?;
    let mem = rank_mem(&store, &rt, r, &pools, args.pages)?;
    let mut put = PutTally::default();
    put_rank(&store, r, &mem, &pools, args.pages, &mut put)?;
    if let Some(e) = put.first_failure {
        return Err(format!("worker {r}: {} put(s) failed; first: {e}", put.failures));
    }
    umbp_standalone::worker_ready_then_wait()?;
    let groups = groups(&pools, args.layer_group);
    let smallest = (0..pools.len()).min_by_key(|&i| pools[i].layer_bytes).expect("pools");
    let samples = rank_loop(&store, &Barrier::new(1), r, &mem, &pools, &groups, smallest, args)?;
    for s in samples {
        let n = |d: Duration| d.as_nanos() as u64;
        println!(
            "{} {} {} {} {} {} {}",
            n(s.restore),
            n(s.ttfl),
            n(s.load),
            n(s.memcpy),
            n(s.smallest_load),
            n(s.smallest_memcpy),
            s.mismatched
        );
    }
    for b in mem.kv {
        rt.block_on(store.free_buffer(b.0)).map_err(|e| format!("free: {e}"))?;
    }
    rt.block_on(store.close()).map_err(|e| format!("close: {e}"))
}

fn parse_samples(out: &str) -> Result<Vec<Sample>, String> {
    out.lines()
        .map(|l| {
            let v: Vec<u64> = l
                .split(' ')
                .map(|x| x.parse::<u64>().map_err(|_| format!("bad worker line {l:?}")))
                .collect::<Result<_, _>>()?;
            if v.len() != 7 {
                return Err(format!("bad worker line {l:?}"));
            }
            let d = Duration::from_nanos;
            Ok(Sample {
                restore: d(v[0]),
                ttfl: d(v[1]),
                load: d(v[2]),
                memcpy: d(v[3]),
                smallest_load: d(v[4]),
                smallest_memcpy: d(v[5]),
                mismatched: v[6],
            })
        })
        .collect()
}

/// Simulated forward compute. On a GPU node the reading thread blocks while the device computes,
/// so this sleeps (leaving the core to other ranks) and spins only the last stretch, where sleep
/// would overshoot.
pub(crate) fn compute(d: Duration) {
    const SPIN: Duration = Duration::from_micros(80);
    let t = Instant::now();
    if d > SPIN {
        std::thread::sleep(d - SPIN);
    }
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Reads logical layer `layer` of page 0 alone (every pool holding it) and returns the SSD bytes
/// read over the layer's bytes.
pub(super) fn ssd_layer_ratio(
    store: &Store,
    pools: &[Pool],
    mem: &RankMem,
    pages: usize,
    layer: u32,
) -> Result<f64, String> {
    let keys: Vec<String> = pools.iter().map(|p| key(0, 0, p)).collect();
    let mut ranges: Vec<Vec<Range>> = Vec::new();
    let mut bytes = 0;
    for (pi, p) in pools.iter().enumerate() {
        let base = mem.kv[pi].addr();
        let r: Vec<Range> = (0..p.layers.len())
            .filter(|&l| p.layers[l] == layer)
            .map(|l| {
                Range::new(
                    l as u64 * p.layer_bytes,
                    p.layer_bytes,
                    base + (l * pages) as u64 * p.layer_bytes,
                )
            })
            .collect();
        bytes += r.iter().map(|x| x.len).sum::<u64>();
        ranges.push(r);
    }
    let gets: Vec<RangedGet<'_>> = keys
        .iter()
        .zip(&ranges)
        .filter(|(_, r)| !r.is_empty())
        .map(|(k, r)| RangedGet { key: k, ranges: r })
        .collect();
    if bytes == 0 {
        return Err(format!("no pool holds logical layer {layer}"));
    }
    let before = store.stats().map_err(|e| e.to_string())?.core.ssd_read_bytes;
    for r in store.batch_get_ranges(&gets).map_err(|e| e.to_string())? {
        r.map_err(|e| e.to_string())?;
    }
    Ok((store.stats().map_err(|e| e.to_string())?.core.ssd_read_bytes - before) as f64 / bytes as f64)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn rank_loop(
    store: &Store,
    barrier: &Barrier,
    rank: usize,
    mem: &RankMem,
    pools: &[Pool],
    groups: &[(u32, Vec<GroupCall>)],
    smallest: usize,
    args: &Args,
) -> Result<Vec<Sample>, String> {
    let pages = args.pages;
    // Every call of a restore, prepared once: (pool, keys, ranges per key).
    let keys: Vec<Vec<String>> = pools
        .iter()
        .map(|p| (0..pages).map(|pg| key(rank, pg, p)).collect())
        .collect();
    let calls: Vec<Vec<(usize, Vec<Vec<Range>>)>> = groups
        .iter()
        .map(|(_, gc)| {
            gc.iter()
                .map(|c| {
                    let p = &pools[c.pool];
                    let base = mem.kv[c.pool].addr();
                    let per_key = (0..pages)
                        .map(|pg| {
                            c.pool_layers
                                .iter()
                                .map(|&l| {
                                    Range::new(
                                        l as u64 * p.layer_bytes,
                                        p.layer_bytes,
                                        base + (l * pages + pg) as u64 * p.layer_bytes,
                                    )
                                })
                                .collect()
                        })
                        .collect();
                    (c.pool, per_key)
                })
                .collect()
        })
        .collect();
    let mut gets: Vec<Vec<(usize, Vec<RangedGet<'_>>)>> = calls
        .iter()
        .map(|g| {
            g.iter()
                .map(|(pool, per_key)| {
                    let v = keys[*pool]
                        .iter()
                        .zip(per_key)
                        .map(|(k, r)| RangedGet { key: k, ranges: r })
                        .collect();
                    (*pool, v)
                })
                .collect()
        })
        .collect();
    if args.calls_per_group == "one" {
        // One call per group with every pool's keys; `usize::MAX`: no single pool's time.
        for g in &mut gets {
            let all: Vec<RangedGet<'_>> = g.drain(..).flat_map(|(_, v)| v).collect();
            g.push((usize::MAX, all));
        }
    }
    let mut out = Vec::with_capacity(args.requests);
    for _ in 0..args.requests + 1 {
        if args.verify {
            for b in &mem.kv {
                b.zero();
            }
        }
        barrier.wait();
        let t0 = Instant::now();
        let mut load = Duration::ZERO;
        let mut smallest_load = Duration::ZERO;
        let mut ttfl = Duration::ZERO;
        for (g, (group_layers, _)) in groups.iter().enumerate() {
            let tg = Instant::now();
            for (pool, call) in &gets[g] {
                let tc = Instant::now();
                for r in store.batch_get_ranges(call).map_err(|e| format!("get: {e}"))? {
                    r.map_err(|e| format!("get: {e}"))?;
                }
                if *pool == smallest {
                    smallest_load += tc.elapsed();
                }
            }
            let lg = tg.elapsed();
            load += lg;
            if g == 0 {
                ttfl = t0.elapsed();
            }
            compute(Duration::from_micros(args.compute_us_per_layer * *group_layers as u64));
        }
        let restore = t0.elapsed();
        let mismatched = if args.verify {
            verify(rank, mem, pools, pages)
        } else {
            0
        };
        // The same fragments, same order, copied by a plain loop from object-shaped memory.
        barrier.wait();
        let tm = Instant::now();
        let mut smallest_memcpy = Duration::ZERO;
        for (g, _) in groups.iter().enumerate() {
            for (pool, per_key) in &calls[g] {
                let tc = Instant::now();
                let p = &pools[*pool];
                let src = mem.mirror[*pool].as_ptr();
                for (pg, ranges) in per_key.iter().enumerate() {
                    for r in ranges {
                        // SAFETY: the source lies inside the mirror (page pg's object) and the
                        // destination inside this rank's KV buffer, as built above.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                src.add(pg * p.object_bytes() as usize + r.offset as usize),
                                r.addr as *mut u8,
                                r.len as usize,
                            )
                        };
                    }
                }
                if *pool == smallest {
                    smallest_memcpy += tc.elapsed();
                }
            }
        }
        let memcpy = tm.elapsed();
        out.push(Sample {
            restore,
            ttfl,
            load,
            memcpy,
            smallest_load,
            smallest_memcpy,
            mismatched,
        });
    }
    // The first request warms caches and page tables; it is not reported.
    out.remove(0);
    Ok(out)
}

/// Counts bytes of the rank's KV buffers that differ from the pattern.
fn verify(rank: usize, mem: &RankMem, pools: &[Pool], pages: usize) -> u64 {
    let mut bad = 0u64;
    let mut want = Vec::new();
    for (pi, p) in pools.iter().enumerate() {
        let lb = p.layer_bytes as usize;
        want.resize(lb, 0);
        for l in 0..p.layers.len() {
            for pg in 0..pages {
                fill(seed(rank, pi, pg, l), &mut want);
                let at = (l * pages + pg) * lb;
                bad += mem.kv[pi].bytes()[at..at + lb]
                    .iter()
                    .zip(&want)
                    .filter(|(a, b)| a != b)
                    .count() as u64;
            }
        }
    }
    bad
}
