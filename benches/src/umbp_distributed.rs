//! `te-bench umbp --distributed`: the layer-wise restore of `te-bench umbp`, with the pages on
//! another peer process, next to a raw engine transfer of the same spans between the same two
//! processes, timed in the same run.
//!
//! - An etcd is started on loopback for the run (unless `--cluster` names one), and an owner
//!   process (`te-bench umbp-owner`, this binary) opens a cluster store, puts rank 0's pages
//!   (`--pools`, `--pages`) and exports a page-major mirror of them for the raw transfer.
//! - This process opens its own cluster store and restores the prefix group by group with the
//!   very loop of the local bench: every key misses locally and is read from the owner, exactly
//!   the requested spans, over `--transport` (the only transport besides local the owner's
//!   engine installs, `TE_TRANSPORTS`, so the only one that reaches it).
//! - Raw transfer: the same requests (same sizes, same destinations, one engine batch per
//!   (group, pool) call, or per group with `--calls-per-group one`, as the restore's calls)
//!   straight at the owner's mirror, without RESOLVE or VALIDATE, timed like
//!   the restore's load, with the restore's simulated compute between groups (not timed), so the
//!   transport idles between groups as it does in the restore. `vs_raw_transfer` = raw time /
//!   restore load time (restore throughput over raw throughput); `vs_raw_back_to_back` is the
//!   same against the batches run without the gaps.
//! - `wire_bytes_per_delivered_byte` = (remote payload + control frames + 80 B of TCP transport
//!   frame headers per request) / bytes delivered; `whole_object_bytes_per_delivered_byte` is what
//!   fetching whole objects would move instead.
//! - `commit_to_visible_ms`: the owner puts a new key and reports the wall-clock time just before
//!   the put; this process spins on its directory copy until the key is routable (same host, same
//!   clock).
//! - The local figure next to it: rank 1's pages put in this process and restored locally by the
//!   same loop (`local_ns_per_fragment`, over the memcpy loop, as `te-bench umbp` reports).

use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::Barrier;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use te_core::{MemoryLocation, RegisterOptions, TransferRequest};
use umbp::{ClusterConfig, Store};

use crate::umbp::{
    compute, groups, key, ms, parse_pools, put_rank, rank_loop, rank_mem, us, Args, Pool, PutTally, Sample,
};
use crate::util::{median, print_json, runtime};

const OWNER: &str = "bench-owner";
const READER: &str = "bench-reader";

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn store_bytes(pools: &[Pool], pages: usize, ranks: u64) -> u64 {
    let data: u64 = pools.iter().map(Pool::object_bytes).sum::<u64>() * pages as u64 * ranks;
    (data + data / 4 + (64 << 20)).next_multiple_of(4096)
}

fn cluster_config(url: &str) -> Result<ClusterConfig, String> {
    let mut cc = ClusterConfig::parse(url).map_err(|e| e.to_string())?;
    cc.auth = te_core::auth::AuthKey::from_env(&te_base::config::ProcessEnv).map_err(|e| e.to_string())?;
    Ok(cc)
}

/// The owner process: puts rank 0's pages, exports their page-major mirror, answers probes.
pub fn owner(args: Args) -> Result<(), String> {
    let pools = parse_pools(&args.pools)?;
    let url = args.cluster.clone().ok_or("umbp-owner needs --cluster")?;
    let rt = runtime()?;
    let store = Store::builder()
        .cluster(cluster_config(&url)?)
        .segment_name(OWNER.into())
        .dram_capacity(store_bytes(&pools, args.pages, 1))
        .ssd_dirs(vec![])
        .open();
    let store = rt.block_on(store).map_err(|e| format!("owner store: {e}"))?;
    let mem = rank_mem(&store, &rt, 0, &pools, args.pages)?;
    let t0 = Instant::now();
    let mut put = PutTally::default();
    put_rank(&store, 0, &mem, &pools, args.pages, &mut put)?;
    let put_s = t0.elapsed().as_secs_f64();
    if let Some(e) = put.first_failure {
        return Err(format!("{} put(s) failed; first: {e}", put.failures));
    }
    // The raw transfer's source: the same bytes, exported, page-major like the objects.
    let mut exported = Vec::new();
    let mut addrs = Vec::new();
    for m in &mem.mirror {
        // SAFETY: the mirror is never reallocated and outlives the registration (dropped first).
        let reg = unsafe {
            store.engine().register_raw(
                m.as_ptr() as u64,
                m.len() as u64,
                MemoryLocation::HOST,
                RegisterOptions::default(),
            )
        };
        exported.push(rt.block_on(reg).map_err(|e| format!("export mirror: {e}"))?);
        addrs.push((m.as_ptr() as u64).to_string());
    }
    // A registered 4 KiB page for the probes' puts.
    let probe = vec![7u8; 4096];
    // SAFETY: `probe` outlives the store's use of it (the store is closed before it is dropped).
    rt.block_on(unsafe { store.register_buffer(probe.as_ptr() as u64, probe.len() as u64) })
        .map_err(|e| format!("register: {e}"))?;
    println!("READY {} {:.3}", addrs.join(","), put.bytes as f64 / put_s / 1e9);
    let _ = std::io::stdout().flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let answer = match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["probe", i] => {
                let k = format!("probe/{i}");
                let t = now_ns();
                match store.batch_put(&[(&k, probe.as_ptr() as u64, 4096, 0)]) {
                    Ok(r) if r.iter().all(|x| x.is_ok()) => format!("OK {t}"),
                    other => format!("ERR {other:?}"),
                }
            }
            ["quit"] => break,
            _ => format!("ERR {line:?}"),
        };
        println!("{answer}");
        let _ = std::io::stdout().flush();
    }
    drop(exported);
    rt.block_on(store.close()).map_err(|e| format!("close: {e}"))?;
    Ok(())
}

/// The owner process as seen from here.
struct OwnerProc {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl OwnerProc {
    fn line(&self, limit: Duration) -> Result<String, String> {
        self.lines
            .recv_timeout(limit)
            .map_err(|_| format!("the owner process did not answer within {limit:?}"))
    }

    fn send(&mut self, cmd: &str) -> Result<(), String> {
        writeln!(self.stdin, "{cmd}")
            .and_then(|_| self.stdin.flush())
            .map_err(|e| format!("owner: {e}"))
    }
}

impl Drop for OwnerProc {
    fn drop(&mut self) {
        crate::util::quit_child(&mut self.child, &mut self.stdin);
    }
}

fn spawn_owner(args: &Args, url: &str) -> Result<(OwnerProc, Vec<u64>, f64), String> {
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mut child = Command::new(exe)
        .arg("umbp-owner")
        .args(["--pools", &args.pools, "--pages", &args.pages.to_string()])
        .args(["--cluster", url])
        .env("TE_TRANSPORTS", format!("local,{}", args.transport))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the owner: {e}"))?;
    let stdout = child.stdout.take().ok_or("owner stdout")?;
    let stdin = child.stdin.take().ok_or("owner stdin")?;
    let lines = crate::util::stdout_lines(stdout);
    let owner = OwnerProc { child, stdin, lines };
    let ready = owner.line(Duration::from_secs(300))?;
    let mut w = ready.split_whitespace();
    if w.next() != Some("READY") {
        return Err(format!("owner: {ready}"));
    }
    let addrs = w
        .next()
        .unwrap_or_default()
        .split(',')
        .map(|a| a.parse::<u64>().map_err(|_| format!("owner: {ready}")))
        .collect::<Result<Vec<_>, _>>()?;
    let put_gbps = w.next().and_then(|g| g.parse().ok()).unwrap_or(0.0);
    Ok((owner, addrs, put_gbps))
}

fn pick(v: &[Sample], f: impl Fn(&Sample) -> Duration) -> Duration {
    let mut d: Vec<Duration> = v.iter().map(f).collect();
    median(&mut d)
}

pub fn run(args: Args) -> Result<(), String> {
    if args.tier != "dram" {
        return Err("--distributed restores from the owner's DRAM tier (--tier dram)".into());
    }
    let pools = parse_pools(&args.pools)?;
    let _etcd;
    let url = match &args.cluster {
        Some(u) => u.clone(),
        None => {
            _etcd = te_base::test_support::etcd::EtcdServer::start_on_loopback()
                .ok_or("no etcd (Debian etcd-server) to start; pass --cluster etcd://host:port")?;
            format!(
                "{}/te-bench-{}",
                _etcd.endpoint.replace("http://", "etcd://"),
                std::process::id()
            )
        }
    };
    let (mut owner, mirror, owner_put_gbps) = spawn_owner(&args, &url)?;
    let rt = runtime()?;
    let store = Store::builder()
        .cluster(cluster_config(&url)?)
        .segment_name(READER.into())
        .dram_capacity(store_bytes(&pools, args.pages, 1))
        .ssd_dirs(vec![])
        .ranged_call_debug(args.phases)
        .open();
    let store = rt.block_on(store).map_err(|e| format!("reader store: {e}"))?;
    let mem = rank_mem(&store, &rt, 0, &pools, args.pages)?;

    // Every page is routable here before the restores start.
    let keys: Vec<String> = pools
        .iter()
        .flat_map(|p| (0..args.pages).map(move |pg| key(0, pg, p)))
        .collect();
    let end = Instant::now() + Duration::from_secs(30);
    while keys.iter().any(|k| store.cluster_owner(k).is_none()) {
        if Instant::now() > end {
            return Err("the owner's keys did not become visible within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }

    // Commit to visible: 21 probes, median.
    let mut visible: Vec<Duration> = Vec::new();
    for i in 0..21 {
        let k = format!("probe/{i}");
        owner.send(&format!("probe {i}"))?;
        let end = Instant::now() + Duration::from_secs(10);
        while store.cluster_owner(&k).is_none() {
            if Instant::now() > end {
                return Err(format!("{k} not visible within 10 s"));
            }
            std::hint::spin_loop();
        }
        let seen = now_ns();
        let a = owner.line(Duration::from_secs(10))?;
        let t0: u64 = a
            .strip_prefix("OK ")
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| format!("probe: {a}"))?;
        visible.push(Duration::from_nanos(seen.saturating_sub(t0)));
    }
    let commit_to_visible = median(&mut visible);

    // The remote restore, by the local bench's loop.
    let groups = groups(&pools, args.layer_group);
    let smallest = (0..pools.len()).min_by_key(|&i| pools[i].layer_bytes).expect("pools");
    let barrier = Barrier::new(1);
    let s0 = cluster_stats(&store)?;
    store.reset_phase_report().map_err(|e| e.to_string())?;
    let remote = rank_loop(&store, &barrier, 0, &mem, &pools, &groups, smallest, &args)?;
    let s1 = cluster_stats(&store)?;
    let phases = store.phase_report().map_err(|e| e.to_string())?.map(|p| {
        let mut m = serde_json::Map::new();
        for ph in te_base::Phase::ALL {
            m.insert(ph.name().into(), serde_json::json!(p.us_per_call(ph)));
        }
        m.insert("calls".into(), serde_json::json!(p.calls));
        serde_json::Value::Object(m)
    });

    // The raw transfer: the same requests at the owner's exported mirror.
    let seg = rt
        .block_on(store.engine().open_segment(OWNER))
        .map_err(|e| format!("open {OWNER}: {e}"))?
        .id();
    let pages = args.pages;
    // Per group, its calls' requests: the same sizes, destinations and order as the restore's.
    let calls: Vec<(u32, Vec<Vec<TransferRequest>>)> = groups
        .iter()
        .map(|(layers, gc)| {
            let reqs = gc
                .iter()
                .map(|c| {
                    let p = &pools[c.pool];
                    let base = mem.kv[c.pool].addr();
                    let mut v = Vec::with_capacity(pages * c.pool_layers.len());
                    for pg in 0..pages {
                        for &l in &c.pool_layers {
                            let lb = p.layer_bytes;
                            let src = mirror[c.pool] + pg as u64 * p.object_bytes() + l as u64 * lb;
                            v.push(TransferRequest::read(base + (l * pages + pg) as u64 * lb, seg, src, lb));
                        }
                    }
                    v
                })
                .collect::<Vec<_>>();
            // The restore's batch shape: with `--calls-per-group one`, one batch for the group.
            let reqs = if args.calls_per_group == "one" {
                vec![reqs.into_iter().flatten().collect()]
            } else {
                reqs
            };
            (*layers, reqs)
        })
        .collect();
    // Timed like the restore's load: batches only. With `gaps`, the restore's simulated compute
    // runs between groups (not timed), so the transport idles between groups as it does there.
    let raw_run = |gaps: bool| -> Result<Duration, String> {
        let mut raw: Vec<Duration> = Vec::new();
        for _ in 0..args.requests + 1 {
            let mut total = Duration::ZERO;
            for (layers, reqs) in &calls {
                let t = Instant::now();
                for r in reqs {
                    let b = store.engine().submit(r).map_err(|e| format!("raw submit: {e}"))?;
                    match b.wait_blocking(Some(Duration::from_secs(60))) {
                        Some(Ok(_)) => {}
                        other => return Err(format!("raw transfer failed: {other:?}")),
                    }
                }
                total += t.elapsed();
                if gaps {
                    compute(Duration::from_micros(args.compute_us_per_layer * *layers as u64));
                }
            }
            raw.push(total);
        }
        raw.remove(0);
        Ok(median(&mut raw))
    };
    let raw_t = raw_run(true)?;
    let raw_b2b = raw_run(false)?;

    // The local figure, in this process: rank 1's pages put here and restored by the same loop.
    let mem1 = rank_mem(&store, &rt, 1, &pools, args.pages)?;
    let mut put = PutTally::default();
    put_rank(&store, 1, &mem1, &pools, args.pages, &mut put)?;
    let local = rank_loop(&store, &barrier, 1, &mem1, &pools, &groups, smallest, &args)?;

    let fragments: u64 = pools.iter().map(|p| p.layers.len() as u64).sum::<u64>() * pages as u64;
    let bytes: u64 = pools.iter().map(Pool::object_bytes).sum::<u64>() * pages as u64;
    let load = pick(&remote, |s| s.load);
    let delivered = (s1.remote_bytes - s0.remote_bytes).max(1);
    let requests = s1.remote_requests - s0.remote_requests;
    let control = s1.remote_control_bytes - s0.remote_control_bytes;
    let wire = delivered + control + 80 * requests;
    let restores = (args.requests + 1) as u64;
    let mismatched: u64 = remote.iter().chain(&local).map(|s| s.mismatched).sum();
    // Signed: the engine's copy can beat the plain memcpy loop.
    let mut local_over: Vec<f64> = local
        .iter()
        .map(|s| s.load.as_nanos() as f64 - s.memcpy.as_nanos() as f64)
        .collect();
    local_over.sort_by(f64::total_cmp);
    let local_ns_per_fragment = local_over[local_over.len() / 2] / fragments as f64;
    // What fetching whole objects (the anchor's main branch) would move for the first group,
    // the one TTFL waits for, over the spans it needs.
    let (g0_whole, g0_spans) = groups[0].1.iter().fold((0u64, 0u64), |(w, sp), c| {
        let p = &pools[c.pool];
        let n = pages as u64;
        (
            w + n * p.object_bytes(),
            sp + n * c.pool_layers.len() as u64 * p.layer_bytes,
        )
    });
    let v = serde_json::json!({
        "bench": "umbp-distributed",
        "transport": args.transport,
        "pages": pages,
        "layer_group": args.layer_group,
        "requests": args.requests,
        "restore_ms_p50": ms(pick(&remote, |s| s.restore)),
        "ttfl_us_p50": us(pick(&remote, |s| s.ttfl)),
        "load_ms_p50": ms(load),
        "load_gbps": bytes as f64 / load.as_secs_f64() / 1e9,
        "raw_transfer_ms_p50": ms(raw_t),
        "raw_transfer_gbps": bytes as f64 / raw_t.as_secs_f64() / 1e9,
        "vs_raw_transfer": raw_t.as_secs_f64() / load.as_secs_f64(),
        "raw_back_to_back_ms_p50": ms(raw_b2b),
        "vs_raw_back_to_back": raw_b2b.as_secs_f64() / load.as_secs_f64(),
        "wire_bytes_per_delivered_byte": wire as f64 / delivered as f64,
        "whole_object_bytes_per_delivered_byte": (bytes * restores) as f64 / delivered as f64,
        "first_group_whole_object_over_spans": g0_whole as f64 / g0_spans.max(1) as f64,
        "control_bytes_per_restore": control / restores,
        "remote_requests_per_restore": requests / restores,
        "commit_to_visible_ms": ms(commit_to_visible),
        "fragments": fragments,
        "bytes": bytes,
        "ns_per_fragment_over_raw": (load.as_nanos() as f64 - raw_t.as_nanos() as f64) / fragments as f64,
        "load_us_per_fragment": load.as_secs_f64() * 1e6 / fragments as f64,
        "local_load_us_per_fragment": pick(&local, |s| s.load).as_secs_f64() * 1e6 / fragments as f64,
        "local_restore_ms_p50": ms(pick(&local, |s| s.restore)),
        "local_ttfl_us_p50": us(pick(&local, |s| s.ttfl)),
        "local_load_ms_p50": ms(pick(&local, |s| s.load)),
        "local_ns_per_fragment": local_ns_per_fragment,
        "local_load_over_memcpy": pick(&local, |s| s.load).as_secs_f64() / pick(&local, |s| s.memcpy).as_secs_f64(),
        "remote_stale": s1.remote_stale - s0.remote_stale,
        "remote_errors": s1.remote_errors - s0.remote_errors,
        "mismatched_bytes": mismatched,
        "verified": args.verify,
        "owner_put_gbps": owner_put_gbps,
        "phases_us_per_call": phases,
    });
    if args.json {
        print_json(&v);
    } else {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    }
    drop(owner);
    rt.block_on(store.close()).map_err(|e| format!("close: {e}"))?;
    drop((mem, mem1));
    Ok(())
}

/// The store's distributed-path counters (it runs in distributed mode here).
fn cluster_stats(store: &umbp::Store) -> Result<umbp::ClusterStats, String> {
    let s = store.stats().map_err(|e| e.to_string())?;
    s.cluster
        .ok_or_else(|| "the store is not in distributed mode".to_string())
}
