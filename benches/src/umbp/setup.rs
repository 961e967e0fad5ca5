//! Setting up a restore run: the pool geometry and layer groups, the store (local, on SSD, or an
//! `umbp-server`), each rank's filled and registered KV buffers, and the offload that puts every
//! page.

use std::path::PathBuf;

use umbp::{KvBuffer, Range, RangedPut, Store};

use super::Args;
use crate::umbp_standalone::{self, OwnServer};
use crate::util::parse_list;

/// What one restore run is: the geometry from the arguments and what follows from it.
pub(super) struct Shape {
    pub(super) pools: Vec<Pool>,
    /// Rank counts to run.
    pub(super) ranks_list: Vec<usize>,
    /// Pages live on the SSD tier (`--tier ssd`).
    pub(super) ssd: bool,
    pub(super) max_ranks: usize,
    /// Bytes of one page over all pools.
    pub(super) page_bytes: u64,
    /// Bytes of every rank's pages.
    pub(super) data_bytes: u64,
}

impl Shape {
    pub(super) fn new(args: &Args, standalone: bool) -> Result<Shape, String> {
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
        Ok(Shape {
            pools,
            ranks_list,
            ssd,
            max_ranks,
            page_bytes,
            data_bytes,
        })
    }
}

/// The SSD directory a run without `--ssd-dir` uses (removed after the run).
pub(super) fn temp_ssd_dir() -> PathBuf {
    std::env::temp_dir().join(format!("umbp-bench-{}", std::process::id()))
}

/// Opens the store the run reads from: in this process (DRAM, or SSD with DRAM off), or with
/// `standalone` a client of an `umbp-server` (started here unless `--socket`), whose socket and
/// own server are returned too.
pub(super) fn open_store(
    args: &Args,
    shape: &Shape,
    standalone: bool,
    rt: &tokio::runtime::Runtime,
) -> Result<(Store, Option<PathBuf>, Option<OwnServer>), String> {
    let (pools, data_bytes) = (&shape.pools, shape.data_bytes);
    let mut builder = Store::builder()
        .ranged_call_debug(args.phases || std::env::var_os("UMBP_RANGED_CALL_DEBUG").is_some_and(|v| v == "1"));
    let largest_call: u64 = pools
        .iter()
        .map(|p| p.layer_bytes * args.layer_group as u64 * args.pages as u64 + 2 * 4096 * args.pages as u64)
        .max()
        .unwrap_or(0);
    if shape.ssd {
        let dir = args.ssd_dir.clone().unwrap_or_else(temp_ssd_dir);
        let staging = (largest_call.max(shape.page_bytes) + (1 << 20)).next_multiple_of(4096);
        builder = builder
            .dram_capacity(0)
            .ssd_dirs(vec![dir])
            .ssd_capacity((data_bytes * 2).max(1 << 30))
            .staging_bytes(staging)
            .staging_slots(shape.max_ranks + 1);
    } else {
        builder = builder
            .dram_capacity((data_bytes + data_bytes / 4 + (64 << 20)).next_multiple_of(4096))
            .ssd_dirs(vec![]);
    }
    let (socket, server) = if standalone {
        let dram = (data_bytes + data_bytes / 4 + (64 << 20)).next_multiple_of(4096);
        let (s, own) = umbp_standalone::server(&args.socket, &["--dram".into(), dram.to_string()])?;
        builder = Store::builder().connect(&s);
        (Some(s), own)
    } else {
        (None, None)
    };
    let store = rt.block_on(builder.open()).map_err(|e| format!("open store: {e}"))?;
    Ok((store, socket, server))
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
pub(crate) fn fill(seed: u64, out: &mut [u8]) {
    for (w, chunk) in out.chunks_mut(8).enumerate() {
        let v = mix(seed ^ (w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

pub(crate) fn seed(rank: usize, pool: usize, page: usize, layer: usize) -> u64 {
    mix(((rank as u64) << 48) ^ ((pool as u64) << 40) ^ ((page as u64) << 20) ^ layer as u64)
}

/// Memory the store writes into behind Rust's back (it is registered): a buffer from
/// `Store::alloc_buffer` (a sealed memfd in both modes, so the modes compare the same memory),
/// only ever accessed by one rank at a time.
pub(crate) struct RawBuf(pub(crate) KvBuffer);

impl RawBuf {
    pub(crate) fn addr(&self) -> u64 {
        self.0.addr()
    }

    /// The bytes. Only while no store call writes into them.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: each rank's buffers are used by that rank only, one phase (restore, verify,
        // memcpy) at a time.
        unsafe { self.0.bytes() }
    }

    pub(crate) fn zero(&self) {
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
