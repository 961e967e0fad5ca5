//! `te-bench umbp`: a layer-wise prefix restore from the UMBP store, the way a KV-cache connector
//! does it, with a plain memcpy loop over the same fragments timed in the same run.
//!
//! Each rank (a thread) owns `--pages` pages. A page is one object per pool holding that pool's
//! layers back to back. The rank's KV buffers are one registered buffer per pool, laid out
//! `[pool layer][page]`. A restore walks the logical layers in groups of `--layer-group`; for each
//! group and each pool with layers in it, one `batch_get_ranges` call asks, for every page, the
//! ranges of that pool's layers in the group. TTFL is the time to the first group; compute is
//! simulated after each group for `--compute-us-per-layer` per logical layer (sleeping, as a
//! thread waiting on a GPU would, then spinning the last 80 us).

use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use umbp::{KvBuffer, Range, RangedGet, RangedPut, Store};

use crate::umbp_standalone;
use crate::util::{median, parse_list, print_json, runtime};

const DEEPSEEK_V4_PRO: &str = "c4:30:37440:2/2;c4_indexer:30:8448:2/2;c128:31:1728:0,1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31,33,35,37,39,41,43,45,47,49,51,53,55,57,59";

#[derive(clap::Args)]
pub struct Args {
    /// Pools: `name:count:layer_bytes[:first/stride | :l1,l2,...]`, `;`-separated. The optional
    /// part gives each pool layer's logical layer number (default 0..count-1).
    #[arg(long, default_value = DEEPSEEK_V4_PRO)]
    pub(crate) pools: String,
    /// Logical layers per layer group.
    #[arg(long, default_value_t = 8)]
    pub(crate) layer_group: u32,
    /// Pages per rank (one object per page and pool).
    #[arg(long, default_value_t = 32)]
    pub(crate) pages: usize,
    /// Timed restores per rank count; medians and p95 are reported.
    #[arg(long, default_value_t = 9)]
    pub(crate) requests: usize,
    /// Rank counts to run (concurrent readers, one thread each), comma-separated.
    #[arg(long, default_value = "1,2")]
    pub(crate) ranks: String,
    /// Simulated forward compute per logical layer, in microseconds.
    #[arg(long, default_value_t = 150)]
    pub(crate) compute_us_per_layer: u64,
    /// Tier the pages are stored in: dram or ssd.
    #[arg(long, default_value = "dram")]
    pub(crate) tier: String,
    /// SSD directory for `--tier ssd` (default: a fresh directory under /tmp, removed after).
    #[arg(long)]
    pub(crate) ssd_dir: Option<PathBuf>,
    /// Record per-phase timings of the store's ranged calls (as UMBP_RANGED_CALL_DEBUG=1).
    #[arg(long)]
    pub(crate) phases: bool,
    /// Recompute every restored byte from its position-dependent seed.
    #[arg(long)]
    pub(crate) verify: bool,
    /// One JSON object per rank count.
    #[arg(long)]
    pub(crate) json: bool,
    /// Standalone mode: the store in an `umbp-server` process (started here unless `--socket`),
    /// ranks as worker processes.
    #[arg(long)]
    pub(crate) standalone: bool,
    /// Standalone mode: a running server's socket.
    #[arg(long)]
    pub(crate) socket: Option<PathBuf>,
    /// With `--standalone`: also run the same shape in local mode (rows carry `mode`).
    #[arg(long)]
    pub(crate) compare_local: bool,
    /// Chunked-reader shape (standalone): keys per pass.
    #[arg(long)]
    pub(crate) keys: Option<usize>,
    /// Chunked-reader shape: keys per call.
    #[arg(long, default_value_t = 1024)]
    pub(crate) chunk: usize,
    /// Chunked-reader shape: ranges per key.
    #[arg(long, default_value_t = 1)]
    pub(crate) ranges_per_key: usize,
    /// Chunked-reader shape: bytes per range.
    #[arg(long, default_value_t = 64)]
    pub(crate) range_bytes: u64,
    /// Chunked-reader shape: bytes per key (the seed's keys are ~128 B).
    #[arg(long, default_value_t = 128)]
    pub(crate) key_bytes: usize,
    /// Chunked-reader shape: reader threads (one connection each).
    #[arg(long, default_value_t = 1)]
    pub(crate) threads: usize,
    /// Chunked-reader shape: timed passes per measurement (after one warm-up pass).
    #[arg(long, default_value_t = 3)]
    pub(crate) passes: usize,
    /// Chunked-reader shape: measurements per arm, arms alternated; medians reported.
    #[arg(long, default_value_t = 5)]
    pub(crate) reps: usize,
    /// Chunked-reader shape: key-handle arms, alternated in one run (`on`, `off`).
    #[arg(long, default_value = "on,off")]
    pub(crate) key_handles: String,
    /// Internal: run as worker process `r` of a standalone run.
    #[arg(long, hide = true)]
    pub(crate) worker_rank: Option<usize>,
    /// Distributed mode: put the pages on one peer process and restore them from another over
    /// `--transport`, next to a raw engine transfer of the same spans between the same two
    /// processes (see `umbp_distributed`).
    #[arg(long)]
    pub(crate) distributed: bool,
    /// With `--distributed`: an existing cluster (`etcd://host:port[/prefix]`); default: an etcd
    /// started on loopback for the run.
    #[arg(long)]
    pub(crate) cluster: Option<String>,
    /// With `--distributed`: the transport between the peers (besides local).
    #[arg(long, default_value = "tcp")]
    pub(crate) transport: String,
}

#[derive(Debug, Clone)]
pub(crate) struct Pool {
    pub(crate) name: String,
    pub(crate) layer_bytes: u64,
    /// Logical layer number of each pool layer.
    pub(crate) layers: Vec<u32>,
}

impl Pool {
    pub(crate) fn object_bytes(&self) -> u64 {
        self.layers.len() as u64 * self.layer_bytes
    }
}

pub(crate) fn parse_pools(spec: &str) -> Result<Vec<Pool>, String> {
    let mut pools = Vec::new();
    for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let fields: Vec<&str> = part.splitn(4, ':').collect();
        if fields.len() < 3 {
            return Err(format!("pool {part:?}: expected name:count:layer_bytes[:layers]"));
        }
        let count: usize = fields[1]
            .parse()
            .map_err(|_| format!("pool {part:?}: bad layer count {:?}", fields[1]))?;
        let layer_bytes: u64 = fields[2]
            .parse()
            .map_err(|_| format!("pool {part:?}: bad layer bytes {:?}", fields[2]))?;
        if count == 0 || layer_bytes == 0 {
            return Err(format!("pool {part:?}: count and layer bytes must be positive"));
        }
        let layers: Vec<u32> = match fields.get(3) {
            None => (0..count as u32).collect(),
            Some(l) if l.contains('/') => {
                let (first, stride) = l.split_once('/').expect("checked");
                let first: u32 = first
                    .parse()
                    .map_err(|_| format!("pool {part:?}: bad first {first:?}"))?;
                let stride: u32 = stride
                    .parse()
                    .map_err(|_| format!("pool {part:?}: bad stride {stride:?}"))?;
                if stride == 0 {
                    return Err(format!("pool {part:?}: stride must be positive"));
                }
                (0..count as u32).map(|i| first + i * stride).collect()
            }
            Some(l) => {
                let v: Vec<u32> = parse_list(l).map_err(|e| format!("pool {part:?}: {e}"))?;
                if v.len() != count {
                    return Err(format!("pool {part:?}: {} layer numbers for {count} layers", v.len()));
                }
                v
            }
        };
        pools.push(Pool {
            name: fields[0].to_string(),
            layer_bytes,
            layers,
        });
    }
    if pools.is_empty() {
        return Err("no pools given".into());
    }
    Ok(pools)
}

/// One (layer group, pool) call: pool-layer indices in the group.
pub(crate) struct GroupCall {
    pub(crate) pool: usize,
    pub(crate) pool_layers: Vec<usize>,
}

pub(crate) fn groups(pools: &[Pool], layer_group: u32) -> Vec<(u32, Vec<GroupCall>)> {
    let max = pools.iter().flat_map(|p| p.layers.iter()).copied().max().unwrap_or(0);
    let mut out = Vec::new();
    let mut g0 = 0;
    while g0 <= max {
        let g1 = g0 + layer_group;
        let calls: Vec<GroupCall> = pools
            .iter()
            .enumerate()
            .filter_map(|(pi, p)| {
                let pool_layers: Vec<usize> = (0..p.layers.len())
                    .filter(|&i| p.layers[i] >= g0 && p.layers[i] < g1)
                    .collect();
                (!pool_layers.is_empty()).then_some(GroupCall { pool: pi, pool_layers })
            })
            .collect();
        out.push((g1.min(max + 1) - g0, calls));
        g0 = g1;
    }
    out
}

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The position-dependent content of one layer of one page: every byte depends on where it is.
fn fill(seed: u64, out: &mut [u8]) {
    for (w, chunk) in out.chunks_mut(8).enumerate() {
        let v = mix(seed ^ (w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn seed(rank: usize, pool: usize, page: usize, layer: usize) -> u64 {
    mix(((rank as u64) << 48) ^ ((pool as u64) << 40) ^ ((page as u64) << 20) ^ layer as u64)
}

/// Memory the store writes into behind Rust's back (it is registered): a buffer from
/// `Store::alloc_buffer` (a sealed memfd in both modes, so the modes compare the same memory),
/// only ever accessed by one rank at a time.
pub(crate) struct RawBuf(KvBuffer);

impl RawBuf {
    pub(crate) fn addr(&self) -> u64 {
        self.0.addr()
    }

    /// The bytes. Only while no store call writes into them.
    fn bytes(&self) -> &[u8] {
        // SAFETY: each rank's buffers are used by that rank only, one phase (restore, verify,
        // memcpy) at a time.
        unsafe { self.0.bytes() }
    }

    fn zero(&self) {
        // SAFETY: as above; no call is running on this rank's buffers between restores.
        unsafe { self.0.bytes_mut().fill(0) };
    }
}

/// A rank's memory: per pool, the registered KV buffer `[pool layer][page]` and a mirror laid
/// out like the store's objects (page-major) for the memcpy baseline.
pub(crate) struct RankMem {
    pub(crate) kv: Vec<RawBuf>,
    pub(crate) mirror: Vec<Vec<u8>>,
}

pub(crate) fn key(rank: usize, page: usize, pool: &Pool) -> String {
    format!("r{rank}/p{page}/{}", pool.name)
}

pub(crate) struct Sample {
    pub(crate) restore: Duration,
    pub(crate) ttfl: Duration,
    pub(crate) load: Duration,
    pub(crate) memcpy: Duration,
    pub(crate) smallest_load: Duration,
    pub(crate) smallest_memcpy: Duration,
    pub(crate) mismatched: u64,
}

pub fn run(args: Args) -> Result<(), String> {
    if let Some(r) = args.worker_rank {
        return worker(&args, r);
    }
    if args.distributed {
        return crate::umbp_distributed::run(args);
    }
    if let Some(keys) = args.keys {
        if !args.standalone {
            return Err("--keys (the chunked-reader shape) runs with --standalone".into());
        }
        let arms = args
            .key_handles
            .split(',')
            .map(|a| match a.trim() {
                "on" => Ok(true),
                "off" => Ok(false),
                other => Err(format!("--key-handles {other:?}: expected on or off")),
            })
            .collect::<Result<Vec<bool>, String>>()?;
        let shape = umbp_standalone::ReaderShape {
            keys,
            chunk: args.chunk,
            ranges_per_key: args.ranges_per_key,
            range_bytes: args.range_bytes,
            key_bytes: args.key_bytes,
            threads: args.threads,
            passes: args.passes,
            reps: args.reps,
            arms,
            verify: args.verify,
            json: args.json,
        };
        return umbp_standalone::run_reader(shape, &args.socket);
    }
    if args.compare_local && !args.standalone {
        return Err("--compare-local goes with --standalone".into());
    }
    if args.standalone {
        run_restore(&args, true)?;
        if args.compare_local {
            run_restore(&args, false)?;
        }
        return Ok(());
    }
    run_restore(&args, false)
}

/// The layer-wise restore, in local mode or (with `standalone`) against an `umbp-server` with
/// each rank a worker process.
fn run_restore(args: &Args, standalone: bool) -> Result<(), String> {
    let pools = parse_pools(&args.pools)?;
    let ranks_list: Vec<usize> = parse_list(&args.ranks)?;
    if ranks_list.contains(&0) || args.pages == 0 || args.requests == 0 || args.layer_group == 0 {
        return Err("--ranks, --pages, --requests and --layer-group must be positive".into());
    }
    let ssd = match args.tier.as_str() {
        "dram" => false,
        "ssd" if !standalone => true,
        "ssd" => return Err("--standalone runs --tier dram (the server's SSD tier is not wired here)".into()),
        t => return Err(format!("--tier {t:?}: expected dram or ssd")),
    };
    let max_ranks = *ranks_list.iter().max().expect("non-empty");
    let page_bytes: u64 = pools.iter().map(Pool::object_bytes).sum();
    let data_bytes = page_bytes * args.pages as u64 * max_ranks as u64;
    let rt = runtime()?;
    let temp_dir;
    let mut builder = Store::builder()
        .ranged_call_debug(args.phases || std::env::var_os("UMBP_RANGED_CALL_DEBUG").is_some_and(|v| v == "1"));
    let largest_call: u64 = pools
        .iter()
        .map(|p| p.layer_bytes * args.layer_group as u64 * args.pages as u64 + 2 * 4096 * args.pages as u64)
        .max()
        .unwrap_or(0);
    if ssd {
        let dir = match &args.ssd_dir {
            Some(d) => d.clone(),
            None => {
                temp_dir = std::env::temp_dir().join(format!("umbp-bench-{}", std::process::id()));
                temp_dir.clone()
            }
        };
        let staging = (largest_call.max(page_bytes) + (1 << 20)).next_multiple_of(4096);
        builder = builder
            .dram_capacity(0)
            .ssd_dirs(vec![dir])
            .ssd_capacity((data_bytes * 2).max(1 << 30))
            .staging_bytes(staging)
            .staging_slots(max_ranks + 1);
    } else {
        builder = builder
            .dram_capacity((data_bytes + data_bytes / 4 + (64 << 20)).next_multiple_of(4096))
            .ssd_dirs(vec![]);
    }
    let (socket, _server) = if standalone {
        let dram = (data_bytes + data_bytes / 4 + (64 << 20)).next_multiple_of(4096);
        let (s, own) = umbp_standalone::server(&args.socket, &["--dram".into(), dram.to_string()])?;
        builder = Store::builder().connect(&s);
        (Some(s), own)
    } else {
        (None, None)
    };
    let store = rt.block_on(builder.open()).map_err(|e| format!("open store: {e}"))?;

    // Memory per rank: KV buffers registered with the store, mirrors for the baseline.
    let mut mems: Vec<RankMem> = Vec::new();
    // Standalone: each worker process allocates, loads and reads its own rank.
    for r in 0..if standalone { 0 } else { max_ranks } {
        mems.push(rank_mem(&store, &rt, r, &pools, args.pages)?);
    }

    // Offload: one ranged put per rank and pool, every page, ranges tiling each object.
    let t0 = Instant::now();
    let mut put = PutTally::default();
    for (r, mem) in mems.iter().enumerate() {
        put_rank(&store, r, mem, &pools, args.pages, &mut put)?;
    }
    let put_time = t0.elapsed();
    let PutTally {
        bytes: put_bytes,
        failures: put_failures,
        first_failure,
    } = put;
    let put_gbps = put_bytes as f64 / put_time.as_secs_f64() / 1e9;
    if !args.json {
        println!(
            "umbp tier={} pools={} pages/rank={} layer-group={} page={} B; put {:.2} GB/s ({} B ok, {} failed)",
            args.tier,
            pools.len(),
            args.pages,
            args.layer_group,
            page_bytes,
            put_gbps,
            put_bytes,
            put_failures
        );
    }
    if let Some(e) = first_failure {
        return Err(format!("{put_failures} put(s) failed; first: {e}"));
    }

    // The SSD target: one logical layer of one page read alone, against that layer's bytes.
    let layer_read_ratio = if ssd && !standalone {
        Some(ssd_layer_ratio(&store, &pools, &mems[0], args.pages, 30)?)
    } else {
        None
    };

    let groups = groups(&pools, args.layer_group);
    let smallest = (0..pools.len()).min_by_key(|&i| pools[i].layer_bytes).expect("pools");
    let fragments: u64 = pools.iter().map(|p| p.layers.len() as u64).sum::<u64>() * args.pages as u64;
    let smallest_fragments = pools[smallest].layers.len() as u64 * args.pages as u64;
    let compute_layers: u32 = groups.iter().map(|g| g.0).sum();

    for &ranks in &ranks_list {
        store.reset_phase_report();
        let stats0 = store.stats();
        let barrier = Arc::new(Barrier::new(ranks));
        let samples: Vec<Vec<Sample>> = if let Some(socket) = &socket {
            let outs = umbp_standalone::run_workers(socket, ranks, &worker_args(args))?;
            outs.iter().map(|o| parse_samples(o)).collect::<Result<_, String>>()?
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..ranks)
                    .map(|r| {
                        let (store, barrier, mem, pools, groups) = (&store, barrier.clone(), &mems[r], &pools, &groups);
                        s.spawn(move || rank_loop(store, &barrier, r, mem, pools, groups, smallest, args))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("rank thread"))
                    .collect::<Result<_, String>>()
            })?
        };
        let stats1 = store.stats();
        let all: Vec<&Sample> = samples.iter().flatten().collect();
        let pick = |f: &dyn Fn(&Sample) -> Duration, q: f64| {
            let mut v: Vec<Duration> = all.iter().map(|s| f(s)).collect();
            v.sort_unstable();
            v[((v.len() - 1) as f64 * q).round() as usize]
        };
        let restore = pick(&|s| s.restore, 0.5);
        let restore95 = pick(&|s| s.restore, 0.95);
        let ttfl = pick(&|s| s.ttfl, 0.5);
        let ttfl95 = pick(&|s| s.ttfl, 0.95);
        let load = pick(&|s| s.load, 0.5);
        let memcpy = pick(&|s| s.memcpy, 0.5);
        let mut small_over: Vec<Duration> = all
            .iter()
            .map(|s| s.smallest_load.saturating_sub(s.smallest_memcpy))
            .collect();
        let small_over = median(&mut small_over);
        let mut over: Vec<Duration> = all.iter().map(|s| s.load.saturating_sub(s.memcpy)).collect();
        let over = median(&mut over);
        let mismatched: u64 = all.iter().map(|s| s.mismatched).sum();
        let bytes_per_restore = page_bytes * args.pages as u64;
        let gbps = bytes_per_restore as f64 / load.as_secs_f64() / 1e9;
        let ns_per_fragment = over.as_nanos() as f64 / fragments as f64;
        let ns_per_fragment_smallest = small_over.as_nanos() as f64 / smallest_fragments as f64;
        let ssd_read = stats1.ssd_read_bytes - stats0.ssd_read_bytes;
        let delivered = (stats1.ssd_delivered_bytes - stats0.ssd_delivered_bytes).max(1);
        let phases = store.phase_report().map(|p| {
            let mut m = serde_json::Map::new();
            for ph in te_base::Phase::ALL {
                m.insert(ph.name().into(), serde_json::json!(p.us_per_call(ph)));
            }
            m.insert("calls".into(), serde_json::json!(p.calls));
            m.insert(
                "items_per_call".into(),
                serde_json::json!(p.items as f64 / p.calls.max(1) as f64),
            );
            serde_json::Value::Object(m)
        });
        if args.json {
            print_json(&serde_json::json!({
                "bench": "umbp",
                "mode": if standalone { "standalone" } else { "local" },
                "tier": args.tier,
                "ranks": ranks,
                "pages": args.pages,
                "layer_group": args.layer_group,
                "requests": args.requests,
                "compute_ms": compute_layers as f64 * args.compute_us_per_layer as f64 / 1e3,
                "restore_ms_p50": ms(restore),
                "restore_ms_p95": ms(restore95),
                "ttfl_us_p50": us(ttfl),
                "ttfl_us_p95": us(ttfl95),
                "load_ms_p50": ms(load),
                "load_gbps": gbps,
                "memcpy_loop_ms": ms(memcpy),
                "load_over_memcpy": load.as_secs_f64() / memcpy.as_secs_f64(),
                "fragments": fragments,
                "bytes": bytes_per_restore,
                "ns_per_fragment": ns_per_fragment,
                "smallest_pool": pools[smallest].name,
                "smallest_layer_bytes": pools[smallest].layer_bytes,
                "ns_per_fragment_smallest": ns_per_fragment_smallest,
                "mismatched_bytes": mismatched,
                "verified": args.verify,
                "put_gbps": put_gbps,
                "put_failures": put_failures,
                "ssd_read_bytes": ssd_read,
                "ssd_read_over_delivered": if ssd { Some(ssd_read as f64 / delivered as f64) } else { None },
                "ssd_layer_read_ratio": layer_read_ratio,
                "ssd_io_engine": stats1.ssd_io_engine,
                "ssd_direct_io": stats1.ssd_direct_io,
                "phases_us_per_call": phases,
            }));
        } else {
            println!(
                "{}ranks={ranks}: restore {:.2} ms (p95 {:.2}), TTFL {:.0} us (p95 {:.0}), load {:.2} ms = {:.2} GB/s, memcpy loop {:.2} ms (load/memcpy {:.2}x), overhead {:.0} ns/fragment ({:.0} ns at {} B), mismatched {}{}",
                if standalone { "standalone " } else { "" },
                ms(restore),
                ms(restore95),
                us(ttfl),
                us(ttfl95),
                ms(load),
                gbps,
                ms(memcpy),
                load.as_secs_f64() / memcpy.as_secs_f64(),
                ns_per_fragment,
                ns_per_fragment_smallest,
                pools[smallest].layer_bytes,
                if args.verify { mismatched.to_string() } else { "(not verified)".into() },
                if ssd {
                    format!(
                        ", SSD ({}, O_DIRECT {}) read {:.2}x delivered, one layer alone {:.2}x its bytes",
                        stats1.ssd_io_engine,
                        stats1.ssd_direct_io,
                        ssd_read as f64 / delivered as f64,
                        layer_read_ratio.unwrap_or(0.0)
                    )
                } else {
                    String::new()
                }
            );
            if let Some(p) = store.phase_report() {
                let parts: Vec<String> = te_base::Phase::ALL
                    .iter()
                    .map(|&ph| format!("{} {:.1}", ph.name(), p.us_per_call(ph)))
                    .collect();
                println!(
                    "  phases (us/call over {} calls, {:.0} ranges/call): {}",
                    p.calls,
                    p.items as f64 / p.calls.max(1) as f64,
                    parts.join(", ")
                );
            }
        }
    }
    for m in mems {
        for b in m.kv {
            rt.block_on(store.free_buffer(b.0)).map_err(|e| format!("free: {e}"))?;
        }
    }
    rt.block_on(store.close()).map_err(|e| format!("close: {e}"))?;
    if ssd && args.ssd_dir.is_none() {
        let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("umbp-bench-{}", std::process::id())));
    }
    Ok(())
}

/// Allocates, fills and registers rank `r`'s KV buffers, and builds its mirror.
pub(crate) fn rank_mem(
    store: &Store,
    rt: &tokio::runtime::Runtime,
    r: usize,
    pools: &[Pool],
    pages: usize,
) -> Result<RankMem, String> {
    let mut kv = Vec::new();
    let mut mirror = Vec::new();
    for (pi, p) in pools.iter().enumerate() {
        let len = (p.object_bytes() * pages as u64) as usize;
        let buf = RawBuf(store.alloc_buffer(len).map_err(|e| format!("alloc: {e}"))?);
        let mut m = vec![0u8; len];
        {
            // SAFETY: the buffer is not registered yet; nothing else sees it.
            let b = unsafe { buf.0.bytes_mut() };
            for page in 0..pages {
                for l in 0..p.layers.len() {
                    let lb = p.layer_bytes as usize;
                    let at_kv = (l * pages + page) * lb;
                    fill(seed(r, pi, page, l), &mut b[at_kv..at_kv + lb]);
                    let at_obj = page * p.object_bytes() as usize + l * lb;
                    m[at_obj..at_obj + lb].copy_from_slice(&b[at_kv..at_kv + lb]);
                }
            }
        }
        // SAFETY: the buffer outlives the store's use of it (freed after close).
        let registering = unsafe { store.register_buffer(buf.addr(), len as u64) };
        rt.block_on(registering).map_err(|e| format!("register: {e}"))?;
        kv.push(buf);
        mirror.push(m);
    }
    Ok(RankMem { kv, mirror })
}

#[derive(Default)]
pub(crate) struct PutTally {
    pub(crate) bytes: u64,
    pub(crate) failures: u64,
    pub(crate) first_failure: Option<String>,
}

/// One ranged put per pool of rank `r`: every page, ranges tiling each object.
pub(crate) fn put_rank(
    store: &Store,
    r: usize,
    mem: &RankMem,
    pools: &[Pool],
    pages: usize,
    t: &mut PutTally,
) -> Result<(), String> {
    for (pi, p) in pools.iter().enumerate() {
        let base = mem.kv[pi].addr();
        let keys: Vec<String> = (0..pages).map(|page| key(r, page, p)).collect();
        let ranges: Vec<Vec<Range>> = (0..pages)
            .map(|page| {
                (0..p.layers.len())
                    .map(|l| {
                        let lb = p.layer_bytes;
                        Range::new(l as u64 * lb, lb, base + (l * pages + page) as u64 * lb)
                    })
                    .collect()
            })
            .collect();
        let puts: Vec<RangedPut<'_>> = keys
            .iter()
            .zip(&ranges)
            .enumerate()
            .map(|(page, (k, rs))| RangedPut {
                key: k,
                object_len: p.object_bytes(),
                ranges: rs,
                depth: page as u32,
            })
            .collect();
        for res in store.batch_put_ranges(&puts).map_err(|e| format!("put: {e}"))? {
            match res {
                Ok(()) => t.bytes += p.object_bytes(),
                Err(e) => {
                    t.failures += 1;
                    t.first_failure.get_or_insert(e.to_string());
                }
            }
        }
    }
    Ok(())
}

/// The arguments a worker process needs to build the same shape.
fn worker_args(args: &Args) -> Vec<String> {
    let mut v = vec![
        format!("--pools={}", args.pools),
        format!("--layer-group={}", args.layer_group),
        format!("--pages={}", args.pages),
        format!("--requests={}", args.requests),
        format!("--compute-us-per-layer={}", args.compute_us_per_layer),
    ];
    if args.verify {
        v.push("--verify".into());
    }
    v
}

/// A worker process of a standalone restore: loads its rank, waits for the parent's go, runs the
/// restores and prints one sample per line (nanoseconds, then mismatched bytes).
fn worker(args: &Args, r: usize) -> Result<(), String> {
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

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
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
fn ssd_layer_ratio(store: &Store, pools: &[Pool], mem: &RankMem, pages: usize, layer: u32) -> Result<f64, String> {
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
    let before = store.stats().ssd_read_bytes;
    for r in store.batch_get_ranges(&gets).map_err(|e| e.to_string())? {
        r.map_err(|e| e.to_string())?;
    }
    Ok((store.stats().ssd_read_bytes - before) as f64 / bytes as f64)
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
    let gets: Vec<Vec<(usize, Vec<RangedGet<'_>>)>> = calls
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_deepseek_geometry() {
        let p = parse_pools(DEEPSEEK_V4_PRO).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p[0].layers[..3], [2, 4, 6]);
        assert_eq!(p[2].layers[..3], [0, 1, 3]);
        assert_eq!(*p[2].layers.last().unwrap(), 59);
        let g = groups(&p, 8);
        assert_eq!(g.len(), 8);
        assert_eq!(g.iter().map(|x| x.0).sum::<u32>(), 61);
        // Group 0 (layers 0..8): c4 holds 2,4,6; c128 holds 0,1,3,5,7.
        assert_eq!(
            g[0].1.iter().map(|c| c.pool_layers.len()).collect::<Vec<_>>(),
            [3, 3, 5]
        );
        for bad in ["", "x:0:10", "x:2:10:1,2,3", "x:2:10:1/0", "x:a:10"] {
            assert!(parse_pools(bad).is_err(), "{bad}");
        }
    }
}
