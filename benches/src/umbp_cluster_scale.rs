//! `te-bench umbp --cluster-scale`: today's cluster directory under a put stream, measured from
//! etcd itself (issue 26, "measure first").
//!
//! For each peer count N of `--scale-peers`, a fresh etcd is started on loopback and N light
//! peers are started as child processes (`te-bench umbp-scale-peer`, this binary): each a umbp
//! cluster peer with a small DRAM arena and no SSD tier, driven by lines on its stdin and
//! answering on its stdout (no sleeps for synchronisation). Peer 0 is the observer: it puts
//! nothing, so its RSS growth over the stream is the directory copy every peer keeps; peers
//! 1..N are the writers.
//!
//! - Stream: the writers put `--scale-keys` keys between them (`--scale-value-bytes` each,
//!   `--scale-batch` keys per `batch_put` call, paced to `--scale-rate` keys/s across the
//!   cluster, 0 = as fast as they go). `puts_per_s` = keys / wall time of the stream; the put
//!   calls' own latencies (each returns after its etcd transaction) are pooled for p50/p99.
//! - etcd, from its `/metrics` before the stream and after every peer's directory holds every
//!   key: `etcd_requests` = unary gRPC requests handled (`grpc_server_handled_total`,
//!   `grpc_type="unary"`, every code) plus lease keep-alive messages received
//!   (`grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"}`); `etcd_txns`
//!   = the `Txn` method's share; watch events = `etcd_debugging_mvcc_events_total` (events sent
//!   to watchers). Background keep-alives and announcements during the stream are included.
//! - Directory memory: the observer's RSS (`VmRSS`) after minus before the stream, per key.
//! - etcd database: `etcd_mvcc_db_total_size_in_bytes` (and `..._in_use_...`) after the stream,
//!   then again after a compaction at the current revision and a defragment, both through
//!   etcd's JSON gateway (`/v3/kv/compaction`, `/v3/maintenance/defragment`).
//! - Commit to visible, under the stream: every writer notes the wall clock at each put call's
//!   return; the observer polls its directory copy (`cluster_owner`, every 50 us) during the
//!   stream and notes when each call's keys became routable. Idle: after the stream, writer 1
//!   puts a fresh key and reports the wall clock when the put has returned; the observer, told
//!   beforehand, polls and reports when the key is routable. Same host, same clock; a negative
//!   value means the watch delivered before the put's reply reached the writer.
//! - Miss resolution: the observer reads keys that live only at writer 1 with
//!   `batch_get_ranges` (directory lookup, RESOLVE, transfer, VALIDATE), one key per call, each
//!   key once (no remembered placement), after one warm-up read; every byte is checked.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use umbp::{ClusterConfig, Range, RangedGet, Store};

use crate::umbp::Args;
use crate::util::{parse_list, print_json, runtime};

/// DRAM arena allocation unit (the store's default `UMBP_DRAM_PAGE_BYTES`).
const ARENA_PAGE: u64 = 4096;
/// How long any one peer answer may take before the run is abandoned.
const ANSWER_LIMIT: Duration = Duration::from_secs(600);

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn key_name(i: u64) -> String {
    format!("scale/{i:010}")
}

/// The byte at `offset` of key `i`'s value.
fn pattern(i: u64, offset: u64) -> u8 {
    (i.wrapping_mul(31).wrapping_add(offset)) as u8
}

/// This process's resident set, from /proc/self/status.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Arguments of one light peer (`te-bench umbp-scale-peer`, started by the scale run).
#[derive(clap::Args)]
pub struct PeerArgs {
    /// The cluster, `etcd://host:port/prefix`.
    #[arg(long)]
    cluster: String,
    /// Peer (segment) name.
    #[arg(long)]
    name: String,
    /// DRAM arena bytes.
    #[arg(long)]
    arena: u64,
    /// Bytes per value.
    #[arg(long)]
    value_bytes: u64,
    /// Most keys per put call.
    #[arg(long)]
    batch: usize,
}

/// One light peer: opens a cluster store, prints `READY`, then answers commands line by line.
pub fn peer(a: PeerArgs) -> Result<(), String> {
    let rt = runtime()?;
    let mut cc = ClusterConfig::parse(&a.cluster).map_err(|e| e.to_string())?;
    cc.auth = te_core::auth::AuthKey::from_env(&te_base::config::ProcessEnv).map_err(|e| e.to_string())?;
    let store = Store::builder()
        .cluster(cc)
        .segment_name(a.name.clone())
        .dram_capacity(a.arena)
        .ssd_dirs(vec![])
        .open();
    let store = rt.block_on(store).map_err(|e| format!("{}: store: {e}", a.name))?;
    let vb = a.value_bytes;
    // One registered buffer: a put batch's values (writers) or a miss's destination (observer).
    let mut buf = vec![0u8; (vb as usize) * a.batch.max(1)];
    // SAFETY: `buf` is never reallocated and outlives the store's use of it (closed first).
    rt.block_on(unsafe { store.register_buffer(buf.as_ptr() as u64, buf.len() as u64) })
        .map_err(|e| format!("register: {e}"))?;
    let out = |s: String| {
        println!("{s}");
        let _ = std::io::stdout().flush();
    };
    out(format!("READY {}", rss_bytes()));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| w.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
        let answer = match w.first().copied() {
            Some("members") => {
                let want = num(1) as usize;
                wait_until(Duration::from_secs(60), || store.cluster_members().len() >= want)
                    .map(|_| "MEMBERS".to_string())
                    .unwrap_or_else(|| format!("ERR {} of {want} members", store.cluster_members().len()))
            }
            Some("rss") => format!("RSS {}", rss_bytes()),
            Some("put") => put_stream(&store, &mut buf, vb, num(1), num(2), num(3) as usize, num(4)),
            Some("settle") => {
                // Every key of the stream routable here.
                let (total, t0) = (num(1), Instant::now());
                let mut next = 0u64;
                let done = wait_until(ANSWER_LIMIT, || {
                    while next < total && store.cluster_owner(&key_name(next)).is_some() {
                        next += 1;
                    }
                    next == total
                });
                match done {
                    Some(()) => format!("SETTLED {}", t0.elapsed().as_nanos()),
                    None => format!("ERR {next} of {total} keys routable"),
                }
            }
            Some("visible") => {
                let k = w.get(1).copied().unwrap_or_default().to_string();
                out("WAITING".into());
                match wait_until(Duration::from_secs(30), || store.cluster_owner(&k).is_some()) {
                    Some(()) => format!("SEEN {}", now_ns()),
                    None => format!("ERR {k} not routable within 30 s"),
                }
            }
            Some("probe") => {
                let k = w.get(1).copied().unwrap_or_default();
                buf[..vb as usize].fill(7);
                match store.batch_put(&[(k, buf.as_ptr() as u64, vb, 0)]) {
                    Ok(r) if r.iter().all(|x| x.is_ok()) => format!("OK {}", now_ns()),
                    other => format!("ERR {other:?}"),
                }
            }
            Some("track") => {
                out("TRACKING".into());
                track(&store, num(1), w.get(2).copied().unwrap_or_default())
            }
            Some("misses") => misses(&store, &mut buf, vb, num(1), num(2)),
            Some("quit") => break,
            _ => format!("ERR {line:?}"),
        };
        out(answer);
    }
    rt.block_on(store.close()).map_err(|e| format!("close: {e}"))?;
    drop(buf);
    Ok(())
}

/// Polls `done` (every 50 us) until it holds or `limit` passes.
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> Option<()> {
    let end = Instant::now() + limit;
    loop {
        if done() {
            return Some(());
        }
        if Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Puts keys `first..first + count` in calls of `batch` keys, paced to `rate` keys/s (0: no
/// pacing). Answers `DONE <elapsed_ns> <failures> <call latencies in ns> <wall clock at each
/// call's return, ns>` (lists comma-separated).
fn put_stream(store: &Store, buf: &mut [u8], vb: u64, first: u64, count: u64, batch: usize, rate: u64) -> String {
    let batch = batch.max(1);
    let mut lat = Vec::with_capacity(count as usize / batch + 1);
    let mut returned = Vec::with_capacity(count as usize / batch + 1);
    let mut failures = 0u64;
    let mut first_failure = None;
    let t0 = Instant::now();
    let mut i = first;
    let end = first + count;
    while i < end {
        let n = ((end - i) as usize).min(batch);
        if rate > 0 {
            // Pacing: the stream's schedule, not synchronisation.
            let due = t0 + Duration::from_secs_f64((i - first) as f64 / rate as f64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        let names: Vec<String> = (i..i + n as u64).map(key_name).collect();
        for (j, k) in (i..i + n as u64).enumerate() {
            for (o, b) in buf[j * vb as usize..(j + 1) * vb as usize].iter_mut().enumerate() {
                *b = pattern(k, o as u64);
            }
        }
        let items: Vec<(&str, u64, u64, u32)> = names
            .iter()
            .enumerate()
            .map(|(j, k)| (k.as_str(), buf.as_ptr() as u64 + j as u64 * vb, vb, 0))
            .collect();
        let t = Instant::now();
        let r = store.batch_put(&items);
        lat.push(t.elapsed().as_nanos().to_string());
        returned.push(now_ns().to_string());
        match r {
            Ok(r) => {
                for e in r.into_iter().filter_map(|x| x.err()) {
                    failures += 1;
                    first_failure.get_or_insert(e.to_string());
                }
            }
            Err(e) => {
                failures += n as u64;
                first_failure.get_or_insert(e.to_string());
            }
        }
        i += n as u64;
    }
    if let Some(e) = first_failure {
        return format!("ERR {failures} put(s) failed; first: {e}");
    }
    format!(
        "DONE {} {failures} {} {}",
        t0.elapsed().as_nanos(),
        lat.join(","),
        returned.join(",")
    )
}

/// Follows a stream while it runs: `shares` is `first:count,...` (one per writer, put in calls of
/// `batch` keys); polls this peer's copy (every 50 us) and notes the wall clock at which each
/// call's keys became routable. Answers `TRACKED <elapsed_ns> <wall clock per call, ns, in share
/// and call order>` once every key is routable.
fn track(store: &Store, batch: u64, shares: &str) -> String {
    let shares: Vec<(u64, u64)> = shares
        .split(',')
        .filter_map(|s| {
            let (f, c) = s.split_once(':')?;
            Some((f.parse().ok()?, c.parse().ok()?))
        })
        .collect();
    let batch = batch.max(1);
    // Per share: the next key not yet seen, and the wall clock per call seen so far.
    let mut next: Vec<u64> = shares.iter().map(|s| s.0).collect();
    let mut seen: Vec<Vec<i64>> = shares
        .iter()
        .map(|s| Vec::with_capacity(s.1.div_ceil(batch) as usize))
        .collect();
    let t0 = Instant::now();
    let done = wait_until(ANSWER_LIMIT, || {
        let mut all = true;
        for (s, &(first, count)) in shares.iter().enumerate() {
            let end = first + count;
            let before = next[s];
            while next[s] < end && store.cluster_owner(&key_name(next[s])).is_some() {
                next[s] += 1;
            }
            if next[s] != before {
                let now = now_ns();
                // Calls whose last key is now behind the pointer.
                let calls_done = (next[s] - first).div_ceil(batch) as usize;
                let full = if next[s] == end {
                    calls_done
                } else {
                    ((next[s] - first) / batch) as usize
                };
                while seen[s].len() < full {
                    seen[s].push(now);
                }
            }
            all &= next[s] == end;
        }
        all
    });
    if done.is_none() {
        return format!("ERR the stream's keys were not all routable within {ANSWER_LIMIT:?}");
    }
    let list: Vec<String> = seen.iter().flatten().map(|t| t.to_string()).collect();
    format!("TRACKED {} {}", t0.elapsed().as_nanos(), list.join(","))
}

/// Reads keys `first..first + count` (owned by another peer) one per call, after one warm-up read
/// of `first - 1`. Answers `MISSES <mismatched bytes> <latencies in ns, comma-separated>`.
fn misses(store: &Store, buf: &mut [u8], vb: u64, first: u64, count: u64) -> String {
    let mut lat = Vec::with_capacity(count as usize);
    let mut mismatched = 0u64;
    for i in first.saturating_sub(1)..first + count {
        buf[..vb as usize].fill(0);
        let k = key_name(i);
        let ranges = [Range {
            offset: 0,
            len: vb,
            addr: buf.as_ptr() as u64,
        }];
        let t = Instant::now();
        let r = store.batch_get_ranges(&[RangedGet {
            key: &k,
            ranges: &ranges,
        }]);
        let took = t.elapsed();
        match r.map(|mut v| v.remove(0)) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) | Err(e) => return format!("ERR {k}: {e}"),
        }
        mismatched += buf[..vb as usize]
            .iter()
            .enumerate()
            .filter(|&(o, &b)| b != pattern(i, o as u64))
            .count() as u64;
        if i >= first {
            lat.push(took.as_nanos().to_string());
        }
    }
    format!("MISSES {mismatched} {}", lat.join(","))
}

/// A light peer as seen from the run.
struct PeerProc {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    name: String,
}

impl PeerProc {
    fn send(&mut self, cmd: &str) -> Result<(), String> {
        writeln!(self.stdin, "{cmd}")
            .and_then(|_| self.stdin.flush())
            .map_err(|e| format!("{}: {e}", self.name))
    }

    /// The next answer, which must start with `tag`; returns the words after it.
    fn expect(&self, tag: &str) -> Result<Vec<String>, String> {
        let l = self
            .lines
            .recv_timeout(ANSWER_LIMIT)
            .map_err(|_| format!("{} did not answer within {ANSWER_LIMIT:?}", self.name))?;
        let mut w = l.split_whitespace().map(str::to_string);
        if w.next().as_deref() != Some(tag) {
            return Err(format!("{}: expected {tag}, got {l:?}", self.name));
        }
        Ok(w.collect())
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        crate::util::quit_child(&mut self.child, &mut self.stdin);
    }
}

fn spawn_peer(url: &str, name: &str, arena: u64, vb: u64, batch: usize) -> Result<PeerProc, String> {
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mut child = Command::new(exe)
        .arg("umbp-scale-peer")
        .args(["--cluster", url, "--name", name])
        .args(["--arena", &arena.to_string(), "--value-bytes", &vb.to_string()])
        .args(["--batch", &batch.to_string()])
        .env("TE_TRANSPORTS", "local,tcp")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting {name}: {e}"))?;
    let stdout = child.stdout.take().ok_or("peer stdout")?;
    let stdin = child.stdin.take().ok_or("peer stdin")?;
    let (tx, lines) = channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    Ok(PeerProc {
        child,
        stdin,
        lines,
        name: name.to_string(),
    })
}

/// One HTTP/1.0 request to etcd's client port (metrics, JSON gateway); returns the body.
fn http(host_port: &str, method: &str, path: &str, body: &str) -> Result<String, String> {
    let mut s = TcpStream::connect(host_port).map_err(|e| format!("etcd {host_port}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {host_port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| format!("etcd {path}: {e}"))?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).map_err(|e| format!("etcd {path}: {e}"))?;
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("etcd {path}: no HTTP reply"))?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(format!("etcd {path}: {}", head.lines().next().unwrap_or_default()));
    }
    Ok(body.to_string())
}

/// The figures of etcd's `/metrics` this bench reads.
#[derive(Default, Clone, Copy)]
struct Metrics {
    unary: f64,
    keep_alives: f64,
    txns: f64,
    mvcc_puts: f64,
    events: f64,
    db_bytes: f64,
    db_in_use_bytes: f64,
    revision: f64,
    rss: f64,
}

fn metrics(host_port: &str) -> Result<Metrics, String> {
    let body = http(host_port, "GET", "/metrics", "")?;
    let mut m = Metrics::default();
    for l in body.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, v)) = l.rsplit_once(' ') else { continue };
        let Ok(v) = v.parse::<f64>() else { continue };
        if name.starts_with("grpc_server_handled_total{") && name.contains("grpc_type=\"unary\"") {
            m.unary += v;
            if name.contains("grpc_method=\"Txn\"") {
                m.txns += v;
            }
        } else if name.starts_with("grpc_server_msg_received_total{") && name.contains("grpc_method=\"LeaseKeepAlive\"")
        {
            m.keep_alives += v;
        } else {
            match name {
                "etcd_mvcc_put_total" => m.mvcc_puts = v,
                "etcd_debugging_mvcc_events_total" => m.events = v,
                "etcd_mvcc_db_total_size_in_bytes" => m.db_bytes = v,
                "etcd_mvcc_db_total_size_in_use_in_bytes" => m.db_in_use_bytes = v,
                "etcd_debugging_mvcc_current_revision" => m.revision = v,
                "process_resident_memory_bytes" => m.rss = v,
                _ => {}
            }
        }
    }
    Ok(m)
}

fn nums(w: &[String], from: usize) -> Result<Vec<i64>, String> {
    w.get(from)
        .map(|s| {
            s.split(',')
                .filter(|x| !x.is_empty())
                .map(|x| x.parse::<i64>())
                .collect()
        })
        .unwrap_or(Ok(Vec::new()))
        .map_err(|e| format!("peer answer: {e}"))
}

/// p50 and p99 (nearest rank) of `v`, in milliseconds.
fn p50_p99_ms(v: &mut [i64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    v.sort_unstable();
    let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1] as f64 / 1e6;
    (at(0.50), at(0.99))
}

fn median_u64(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// Runs the scale scenario for every peer count of `--scale-peers`, one JSON row each.
pub fn run(args: Args) -> Result<(), String> {
    if args.cluster.is_some() {
        return Err("--cluster-scale starts its own etcd per peer count (no --cluster)".into());
    }
    let counts: Vec<usize> = parse_list(&args.scale_peers)?;
    if counts.iter().any(|&n| n < 2) {
        return Err("--scale-peers: every count needs at least 2 peers (an observer and a writer)".into());
    }
    if args.scale_keys < args.scale_samples as u64 + 1 + counts.iter().max().copied().unwrap_or(2) as u64 {
        return Err("--scale-keys must exceed --scale-samples + 1 + the largest peer count".into());
    }
    if args.scale_value_bytes == 0 || args.scale_batch == 0 || args.scale_samples == 0 {
        return Err("--scale-value-bytes, --scale-batch and --scale-samples must be at least 1".into());
    }
    for n in counts {
        let v = run_one(&args, n)?;
        if args.json {
            print_json(&v);
        } else {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        }
    }
    Ok(())
}

fn run_one(args: &Args, n: usize) -> Result<serde_json::Value, String> {
    let etcd =
        te_base::test_support::etcd::EtcdServer::start_on_loopback().ok_or("no etcd (Debian etcd-server) to start")?;
    let host_port = etcd.endpoint.trim_start_matches("http://").to_string();
    let url = format!("etcd://{host_port}/scale");
    let keys = args.scale_keys;
    let vb = args.scale_value_bytes;
    let batch = args.scale_batch;
    let writers = (n - 1) as u64;
    let per_writer = keys.div_ceil(writers);
    let page = vb.next_multiple_of(ARENA_PAGE);
    let writer_arena = (per_writer + 2 * args.scale_samples as u64 + 16) * page * 5 / 4 + (8 << 20);
    let observer_arena = 8 << 20;

    // Start every peer, then wait for each to be ready (they start concurrently).
    let t_start = Instant::now();
    let mut peers = Vec::with_capacity(n);
    for i in 0..n {
        let (name, arena) = match i {
            0 => ("scale-observer".to_string(), observer_arena),
            _ => (format!("scale-writer-{i}"), writer_arena),
        };
        peers.push(spawn_peer(&url, &name, arena, vb, batch)?);
    }
    let mut rss0 = Vec::with_capacity(n);
    for p in &peers {
        rss0.push(p.expect("READY")?[0].parse::<u64>().unwrap_or(0));
    }
    for p in &mut peers {
        p.send(&format!("members {n}"))?;
    }
    for p in &peers {
        p.expect("MEMBERS")?;
    }
    let startup_s = t_start.elapsed().as_secs_f64();
    for p in &mut peers {
        p.send("rss")?;
    }
    let mut rss_before = Vec::with_capacity(n);
    for p in &peers {
        rss_before.push(p.expect("RSS")?[0].parse::<u64>().unwrap_or(0));
    }

    // The stream: each writer its contiguous share.
    let m0 = metrics(&host_port)?;
    let rate_per_writer = args.scale_rate.div_ceil(writers);
    let shares: Vec<(u64, u64)> = (1..n as u64)
        .map(|w| {
            let first = (w - 1) * per_writer;
            (first, per_writer.min(keys.saturating_sub(first)))
        })
        .collect();
    let list: Vec<String> = shares.iter().map(|(f, c)| format!("{f}:{c}")).collect();
    peers[0].send(&format!("track {batch} {}", list.join(",")))?;
    peers[0].expect("TRACKING")?;
    let t0 = Instant::now();
    for (p, (first, count)) in peers[1..].iter_mut().zip(&shares) {
        p.send(&format!("put {first} {count} {batch} {rate_per_writer}"))?;
    }
    let mut call_lat = Vec::new();
    let mut returned = Vec::new();
    for p in &peers[1..] {
        let w = p.expect("DONE")?;
        call_lat.extend(nums(&w, 2)?);
        returned.extend(nums(&w, 3)?);
    }
    let stream_s = t0.elapsed().as_secs_f64();
    let tracked = peers[0].expect("TRACKED")?;
    let seen = nums(&tracked, 1)?;
    if seen.len() != returned.len() {
        return Err(format!(
            "observer saw {} put calls, writers made {}",
            seen.len(),
            returned.len()
        ));
    }
    let mut loaded_visible: Vec<i64> = seen.iter().zip(&returned).map(|(s, r)| s - r).collect();
    let put_calls = call_lat.len() as u64;
    // Every peer's copy holds every key before etcd's counters are read again.
    for p in &mut peers {
        p.send(&format!("settle {keys}"))?;
    }
    let mut settle_ns = Vec::with_capacity(n);
    for p in &peers {
        settle_ns.push(p.expect("SETTLED")?[0].parse::<u64>().unwrap_or(0));
    }
    let visible_everywhere_s = t0.elapsed().as_secs_f64();
    let m1 = metrics(&host_port)?;
    for p in &mut peers {
        p.send("rss")?;
    }
    let mut rss_after = Vec::with_capacity(n);
    for p in &peers {
        rss_after.push(p.expect("RSS")?[0].parse::<u64>().unwrap_or(0));
    }

    // etcd's database, then after a compaction at the current revision and a defragment.
    let revision = m1.revision as u64;
    http(
        &host_port,
        "POST",
        "/v3/kv/compaction",
        &format!("{{\"revision\":\"{revision}\",\"physical\":true}}"),
    )?;
    http(&host_port, "POST", "/v3/maintenance/defragment", "{}")?;
    let m2 = metrics(&host_port)?;

    // Commit to visible: writer 1 puts, the observer watches its copy.
    let mut visible = Vec::with_capacity(args.scale_samples);
    for s in 0..args.scale_samples {
        let k = format!("probe/{s}");
        peers[0].send(&format!("visible {k}"))?;
        peers[0].expect("WAITING")?;
        peers[1].send(&format!("probe {k}"))?;
        let put_at: i64 = peers[1].expect("OK")?[0].parse().map_err(|_| "probe answer")?;
        let seen_at: i64 = peers[0].expect("SEEN")?[0].parse().map_err(|_| "visible answer")?;
        visible.push(seen_at - put_at);
    }

    // Miss resolution at the observer, of writer 1's keys (after one warm-up read).
    let (w1_first, w1_count) = shares[0];
    let samples = (args.scale_samples as u64).min(w1_count.saturating_sub(1));
    peers[0].send(&format!("misses {} {samples}", w1_first + 1))?;
    let mw = peers[0].expect("MISSES")?;
    let mismatched: u64 = mw[0].parse().unwrap_or(u64::MAX);
    let mut miss_lat = nums(&mw, 1)?;
    drop(peers);
    drop(etcd);

    let (put_p50, put_p99) = p50_p99_ms(&mut call_lat);
    let (vis_p50, vis_p99) = p50_p99_ms(&mut visible);
    let (loaded_p50, loaded_p99) = p50_p99_ms(&mut loaded_visible);
    let (miss_p50, miss_p99) = p50_p99_ms(&mut miss_lat);
    let requests = (m1.unary - m0.unary) + (m1.keep_alives - m0.keep_alives);
    let dir_bytes = rss_after[0].saturating_sub(rss_before[0]);
    let writer_growth = median_u64(
        rss_after[1..]
            .iter()
            .zip(&rss_before[1..])
            .map(|(a, b)| a.saturating_sub(*b))
            .collect(),
    );
    let mut row = serde_json::json!({
        "bench": "umbp-cluster-scale",
        "design": "baseline: every peer watches <prefix>/umbp/ and keeps every key",
        "peers": n,
        "writers": writers,
        "keys": keys,
        "value_bytes": vb,
        "keys_per_put_call": batch,
        "target_rate_keys_per_s": args.scale_rate,
        "startup_s": startup_s,
        "stream_s": stream_s,
        "puts_per_s": keys as f64 / stream_s,
        "put_calls": put_calls,
        "put_calls_per_s": put_calls as f64 / stream_s,
        "put_call_ms_p50": put_p50,
        "put_call_ms_p99": put_p99,
        "visible_everywhere_s": visible_everywhere_s,
        "observer_settle_s": settle_ns[0] as f64 / 1e9,
    });
    let etcd_figures = serde_json::json!({
        "etcd_requests": requests,
        "etcd_requests_per_put_call": requests / put_calls.max(1) as f64,
        "etcd_requests_per_key": requests / keys as f64,
        "etcd_txns_per_put_call": (m1.txns - m0.txns) / put_calls.max(1) as f64,
        "etcd_mvcc_puts_per_key": (m1.mvcc_puts - m0.mvcc_puts) / keys as f64,
        "watch_events": m1.events - m0.events,
        "watch_events_per_key": (m1.events - m0.events) / keys as f64,
        "watch_events_per_put_call": (m1.events - m0.events) / put_calls.max(1) as f64,
        "directory_bytes_per_peer": dir_bytes,
        "directory_bytes_per_key": dir_bytes as f64 / keys as f64,
        "directory_measure": "observer VmRSS after minus before the stream (it holds no keys of its own)",
        "observer_rss_bytes": rss_after[0],
        "writer_rss_growth_bytes_median": writer_growth,
        "peer_rss_at_ready_bytes_median": median_u64(rss0),
        "etcd_rss_bytes": m1.rss,
        "etcd_db_bytes": m1.db_bytes,
        "etcd_db_in_use_bytes": m1.db_in_use_bytes,
        "etcd_db_bytes_compacted": m2.db_bytes,
        "etcd_db_in_use_bytes_compacted": m2.db_in_use_bytes,
        "etcd_revision": revision,
    });
    let latencies = serde_json::json!({
        "commit_to_visible_ms_p50": vis_p50,
        "commit_to_visible_ms_p99": vis_p99,
        "commit_to_visible_samples": visible.len(),
        "commit_to_visible_under_stream_ms_p50": loaded_p50,
        "commit_to_visible_under_stream_ms_p99": loaded_p99,
        "miss_ms_p50": miss_p50,
        "miss_ms_p99": miss_p99,
        "miss_samples": miss_lat.len(),
        "mismatched_bytes": mismatched,
    });
    for part in [etcd_figures, latencies] {
        if let (Some(row), serde_json::Value::Object(part)) = (row.as_object_mut(), part) {
            row.extend(part);
        }
    }
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let mut v: Vec<i64> = (1..=100).map(|x| x * 1_000_000).collect();
        assert_eq!(p50_p99_ms(&mut v), (50.0, 99.0));
        let mut one = vec![3_000_000];
        assert_eq!(p50_p99_ms(&mut one), (3.0, 3.0));
        assert!(p50_p99_ms(&mut []).0.is_nan());
    }

    #[test]
    fn values_differ_by_key_and_offset() {
        assert_ne!(pattern(1, 0), pattern(2, 0));
        assert_ne!(pattern(1, 0), pattern(1, 1));
        assert_eq!(key_name(42), "scale/0000000042");
    }
}
