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
//!
//! The run is split into [`setup`] (geometry, store, rank memory, offload), [`ranks`] (the rank
//! loop, in threads or worker processes) and [`report`] (the figures of each rank count).

mod ranks;
mod report;
mod setup;

use std::path::PathBuf;
use std::time::Instant;

use umbp::Store;

pub(crate) use ranks::{compute, rank_loop, Sample};
pub(crate) use report::{ms, us};
pub(crate) use setup::{groups, key, parse_pools, put_rank, rank_mem, Pool, PutTally};
use setup::{RankMem, Shape};

use crate::umbp_standalone;
use crate::util::runtime;

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
    /// Calls per layer group: `pool` (one `batch_get_ranges` per pool with layers in the group,
    /// the connector's shape) or `one` (the group's keys of every pool in one call: fewer round
    /// trips in standalone mode; the smallest pool's own load is then not measured).
    #[arg(long, default_value = "pool", value_parser = ["pool", "one"])]
    pub(crate) calls_per_group: String,
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
    /// Cluster scale (issue 26): a fresh etcd and N light peer processes per count of
    /// `--scale-peers` and per directory design of `--scale-directory`, a put stream, etcd's own
    /// counters, directory entries, memory and messages, commit-to-visible and miss-resolution
    /// latency (see `umbp_cluster_scale`).
    #[arg(long)]
    pub(crate) cluster_scale: bool,
    /// With `--cluster-scale`: peer counts (each: one observer plus N-1 writers), comma-separated.
    #[arg(long, default_value = "4,16,64")]
    pub(crate) scale_peers: String,
    /// With `--cluster-scale`: the directory designs to measure, comma-separated (`etcd`: every
    /// key in etcd, every peer watches all; `sharded`: each key's entry at its top rendezvous
    /// peers), passed to every peer as `UMBP_CLUSTER_DIRECTORY`; per peer count, one row each, in
    /// this order.
    #[arg(long, default_value = "etcd,sharded")]
    pub(crate) scale_directory: String,
    /// With `--cluster-scale`: keys the writers put between them.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) scale_keys: u64,
    /// With `--cluster-scale`: keys per put call (etcd directory: one etcd transaction of up to
    /// 128 keys each).
    #[arg(long, default_value_t = 16)]
    pub(crate) scale_batch: usize,
    /// With `--cluster-scale`: target put rate in keys/s across the cluster (0: as fast as the
    /// writers go).
    #[arg(long, default_value_t = 0)]
    pub(crate) scale_rate: u64,
    /// With `--cluster-scale`: bytes per value.
    #[arg(long, default_value_t = 256)]
    pub(crate) scale_value_bytes: u64,
    /// With `--cluster-scale`: commit-to-visible probes and miss reads per peer count.
    #[arg(long, default_value_t = 200)]
    pub(crate) scale_samples: usize,
}

pub fn run(args: Args) -> Result<(), String> {
    if let Some(r) = args.worker_rank {
        return ranks::worker(&args, r);
    }
    if args.distributed {
        return crate::umbp_distributed::run(args);
    }
    if args.cluster_scale {
        return crate::umbp_cluster_scale::run(args);
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
    let shape = Shape::new(args, standalone)?;
    let pools = &shape.pools;
    let rt = runtime()?;
    let (store, socket, _server) = setup::open_store(args, &shape, standalone, &rt)?;

    // Memory per rank: KV buffers registered with the store, mirrors for the baseline.
    let mut mems: Vec<RankMem> = Vec::new();
    // Standalone: each worker process allocates, loads and reads its own rank.
    for r in 0..if standalone { 0 } else { shape.max_ranks } {
        mems.push(rank_mem(&store, &rt, r, pools, args.pages)?);
    }

    // Offload: one ranged put per rank and pool, every page, ranges tiling each object.
    let t0 = Instant::now();
    let mut put = PutTally::default();
    for (r, mem) in mems.iter().enumerate() {
        put_rank(&store, r, mem, pools, args.pages, &mut put)?;
    }
    let put_time = t0.elapsed();
    let groups = groups(pools, args.layer_group);
    let smallest = (0..pools.len()).min_by_key(|&i| pools[i].layer_bytes).expect("pools");
    let mut info = report::RunInfo {
        args,
        standalone,
        ssd: shape.ssd,
        pools,
        smallest,
        fragments: pools.iter().map(|p| p.layers.len() as u64).sum::<u64>() * args.pages as u64,
        smallest_fragments: pools[smallest].layers.len() as u64 * args.pages as u64,
        compute_layers: groups.iter().map(|g| g.0).sum(),
        page_bytes: shape.page_bytes,
        put_gbps: put.bytes as f64 / put_time.as_secs_f64() / 1e9,
        put_bytes: put.bytes,
        put_failures: put.failures,
        layer_read_ratio: None,
    };
    report::put_line(&info);
    if let Some(e) = put.first_failure {
        return Err(format!("{} put(s) failed; first: {e}", put.failures));
    }

    // The SSD target: one logical layer of one page read alone, against that layer's bytes.
    if shape.ssd && !standalone {
        info.layer_read_ratio = Some(ranks::ssd_layer_ratio(&store, pools, &mems[0], args.pages, 30)?);
    }

    for &ranks in &shape.ranks_list {
        store.reset_phase_report().map_err(|e| e.to_string())?;
        let before = store.stats().map_err(|e| e.to_string())?;
        let samples = ranks::run_ranks(&store, socket.as_deref(), ranks, &mems, pools, &groups, smallest, args)?;
        let after = store.stats().map_err(|e| e.to_string())?;
        report::rank_count(
            &info,
            ranks,
            &samples,
            &before,
            &after,
            store.phase_report().map_err(|e| e.to_string())?,
        );
    }
    close(&store, &rt, mems)?;
    if shape.ssd && args.ssd_dir.is_none() {
        let _ = std::fs::remove_dir_all(setup::temp_ssd_dir());
    }
    Ok(())
}

/// Frees every rank's buffers and closes the store.
fn close(store: &Store, rt: &tokio::runtime::Runtime, mems: Vec<RankMem>) -> Result<(), String> {
    for m in mems {
        for b in m.kv {
            rt.block_on(store.free_buffer(b.0)).map_err(|e| format!("free: {e}"))?;
        }
    }
    rt.block_on(store.close()).map_err(|e| format!("close: {e}"))
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
