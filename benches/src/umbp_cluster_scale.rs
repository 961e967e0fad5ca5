//! `te-bench umbp --cluster-scale`: the cluster directory under a put stream, measured from etcd
//! itself and from the peers' own counters, for both directory designs in one run (issue 26).
//!
//! The designs (`--scale-directory etcd,sharded`, passed to every peer as
//! `UMBP_CLUSTER_DIRECTORY`):
//! - `etcd` ("etcd directory (baseline)"): every put call writes its keys to etcd in one
//!   transaction before it returns; every peer watches the whole key range and keeps a copy of
//!   every key.
//! - `sharded` ("sharded directory"): etcd holds only membership and leases; each key's index
//!   entry lives at the key's top rendezvous-hash peers over the live membership, published by
//!   the owner over the control connections (PUBLISH) before the put returns; a peer that does
//!   not hold a key's entry asks for it (LOOKUP).
//!
//! For each peer count N of `--scale-peers`, and for each design in the order given (so rows
//! interleave: N=4 etcd, N=4 sharded, N=16 etcd, ...), a fresh etcd is started on loopback and N
//! light peers are started as child processes (`te-bench umbp-scale-peer`, this binary): each a
//! umbp cluster peer with a small DRAM arena and no SSD tier, driven by lines on its stdin and
//! answering on its stdout (no sleeps for synchronisation). Each peer reports the design it
//! opened with, and the run refuses a peer whose design is not the row's. Peer 0 is the
//! observer: it puts nothing, so its RSS growth over the stream is the directory state a peer
//! keeps for other peers' keys (the full copy in the etcd design, its shard in the sharded one);
//! peers 1..N are the writers.
//!
//! - Stream: the writers put `--scale-keys` keys between them (`--scale-value-bytes` each,
//!   `--scale-batch` keys per `batch_put` call, paced to `--scale-rate` keys/s across the
//!   cluster, 0 = as fast as they go). `puts_per_s` = keys / wall time of the stream (until the
//!   last writer's last put call returned); the put calls' own latencies (each returns after its
//!   etcd transaction, or after its PUBLISH messages are answered) are pooled for p50/p99.
//! - etcd, from its `/metrics` before the stream, when the last writer is done (for
//!   `etcd_requests_per_s`, over the stream's wall time) and after every peer can route every
//!   key (the per-put figures): `etcd_requests` = unary gRPC requests handled
//!   (`grpc_server_handled_total`, `grpc_type="unary"`, every code) plus lease keep-alive
//!   messages received (`grpc_server_msg_received_total{grpc_method="LeaseKeepAlive"}`);
//!   `etcd_txns` = the `Txn` method's share; watch events = `etcd_debugging_mvcc_events_total`
//!   (events sent to watchers). Background keep-alives and announcements are included.
//! - Directory entries: each peer's `ClusterStats::directory_entries` after every key is routable
//!   (the observer's, the writers' median, and the sum over peers: N x keys for the etcd
//!   design's full copies, replicas x keys for the sharded one).
//! - Directory messages: `ClusterStats::directory_messages` (PUBLISH, UNPUBLISH and LOOKUP sent to
//!   other peers; 0 in the etcd design), after minus before the stream. The headline per put call
//!   and per key is the writers' sum (what putting costs); the observer's own messages are
//!   reported apart (`observer_directory_messages_during_stream`), since in the sharded design
//!   its commit-to-visible polling below is itself a LOOKUP stream, and the sum over all peers is
//!   given as well.
//! - Directory memory: the observer's RSS (`VmRSS`) after minus before the stream, per key.
//! - etcd database: `etcd_mvcc_db_total_size_in_bytes` (and `..._in_use_...`) after the stream,
//!   then again after a compaction at the current revision and a defragment, both through
//!   etcd's JSON gateway (`/v3/kv/compaction`, `/v3/maintenance/defragment`). The cluster's own
//!   periodic compaction (`UMBP_CLUSTER_COMPACT_S`, taken from the run's environment like every
//!   `UMBP_CLUSTER_*` setting but the cluster and the listener; `cluster_compact_s` in the row)
//!   may also run during a long stream.
//! - Commit to visible, under the stream: every writer notes the wall clock at each put call's
//!   return; the observer polls `cluster_owner` (the store's `owner_of`) every 50 us during the
//!   stream and notes when each call of writers 1..=4 (`TRACKED_WRITERS`; every writer at N<=5)
//!   became routable. A writer's calls become routable in call order (each starts after the
//!   previous one returned; in the etcd design a call is one transaction, delivered in one watch
//!   response; in the sharded one every key is published before the call returns), so a call
//!   counts as routable when its last key is, and per writer the observer polls only its
//!   frontier (the first call not yet seen); when the frontier is routable, a galloping search
//!   finds how far the routable calls reach, and each of them is noted as seen at the first poll
//!   that found it (or a later call) routable. Each call's visibility is thus bracketed between
//!   the frontier's last failed poll and that poll; the bracket's width is reported
//!   (`commit_to_visible_under_stream_bracket_ms_*`: the figure's own resolution). Idle: after
//!   the stream, writer 1 puts a fresh key and reports the wall clock when the put has returned;
//!   the observer, told beforehand, polls and reports when the key is routable. Same host, same
//!   clock; a negative value means the observer could route the key before the put's reply
//!   reached the writer. In the etcd design a poll reads the local copy; in the sharded design
//!   it is a LOOKUP round trip to the key's index peer (local when the observer is one), so with
//!   the same 50 us polling interval a pass over the tracked writers costs up to one round trip
//!   each (more while galloping), the bracket is about a pass wide, and the observer's LOOKUPs
//!   share the machine with the stream (`observer_directory_messages_during_stream`; each poll's
//!   own duration: `observer_poll_under_stream_ms_*`, a local read or a LOOKUP round trip under
//!   the stream's load). Polling
//!   every key in turn, as the baseline measurement did, falls seconds behind a sharded stream
//!   on two cores (measured: 2.4-6 s p50 at N=4..64), and polling every writer's frontier
//!   widens the bracket to N-1 round trips, hence the frontier, the galloping and the four
//!   writers.
//! - After the stream, every key must be routable: in the etcd design at every peer (every key,
//!   local reads); in the sharded design every key once, key `i` from peer `i mod N`, so the
//!   check costs one LOOKUP per key (or none, where the peer indexes it), not N.
//!   `visible_everywhere_s` (stream start until that check is done) is thus the etcd design's
//!   propagation to every copy, but in the sharded design mostly the check's own LOOKUPs.
//! - Miss resolution: the observer reads keys that live only at writer 1 with
//!   `batch_get_ranges` (directory lookup, RESOLVE, transfer, VALIDATE), one key per call, each
//!   key once (no remembered placement), after one warm-up read; every byte is checked.

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use te_base::config::{Env, ProcessEnv};
use umbp::{ClusterConfig, DirectoryMode, Range, RangedGet, Store};

use crate::umbp::Args;
use crate::util::{parse_list, print_json, runtime};

/// DRAM arena allocation unit (the store's default `UMBP_DRAM_PAGE_BYTES`).
const ARENA_PAGE: u64 = 4096;
/// Writers whose every put call the observer follows during the stream (writers 1..=4).
const TRACKED_WRITERS: usize = 4;
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

/// A directory design the scale run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Design {
    Etcd,
    Sharded,
}

impl Design {
    /// The value of `UMBP_CLUSTER_DIRECTORY` (and of `--scale-directory`).
    fn var(self) -> &'static str {
        match self {
            Design::Etcd => "etcd",
            Design::Sharded => "sharded",
        }
    }

    /// The row's `design`.
    fn label(self) -> &'static str {
        match self {
            Design::Etcd => "etcd directory (baseline)",
            Design::Sharded => "sharded directory",
        }
    }
}

/// `--scale-directory`: a comma list of `etcd` and `sharded`, each at most once.
fn parse_designs(s: &str) -> Result<Vec<Design>, String> {
    let mut v = Vec::new();
    for x in s.split(',').map(str::trim) {
        let d = match x {
            "etcd" => Design::Etcd,
            "sharded" => Design::Sharded,
            _ => return Err(format!("--scale-directory: {x:?} is neither etcd nor sharded")),
        };
        if v.contains(&d) {
            return Err(format!("--scale-directory: {x} named twice"));
        }
        v.push(d);
    }
    Ok(v)
}

/// A peer's environment: `UMBP_CLUSTER` is the run's cluster, `UMBP_CLUSTER_LISTEN` keeps its
/// default (N peers on one host cannot share a port), everything else is the process's: the
/// directory design the run sets (`UMBP_CLUSTER_DIRECTORY`), the auth key, and whatever else of
/// `UMBP_CLUSTER_*` the operator set for the run.
struct PeerEnv<'a> {
    cluster: &'a str,
}

impl Env for PeerEnv<'_> {
    fn get(&self, var: &str) -> Option<String> {
        match var {
            "UMBP_CLUSTER" => Some(self.cluster.to_string()),
            "UMBP_CLUSTER_LISTEN" => None,
            v => ProcessEnv.get(v),
        }
    }
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

/// One light peer: opens a cluster store (its directory design from `UMBP_CLUSTER_DIRECTORY`),
/// prints `READY <rss> <design> <etcd compaction period, s, 0 = none>`, then answers commands
/// line by line.
pub fn peer(a: PeerArgs) -> Result<(), String> {
    let rt = runtime()?;
    let cc = ClusterConfig::from_env(&PeerEnv { cluster: &a.cluster })
        .map_err(|e| e.to_string())?
        .ok_or("no cluster")?;
    let design = match cc.directory {
        DirectoryMode::Etcd => Design::Etcd,
        DirectoryMode::Sharded => Design::Sharded,
    };
    let compact_s = cc.compact_every.map_or(0, |d| d.as_secs());
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
    out(format!("READY {} {} {compact_s}", rss_bytes(), design.var()));
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
            Some("stats") => match store.stats().map(|s| s.cluster) {
                Ok(Some(c)) => format!("STATS {} {}", c.directory_entries, c.directory_messages),
                Ok(None) => "ERR no cluster stats".to_string(),
                Err(e) => format!("ERR stats: {e}"),
            },
            Some("put") => put_stream(&store, &mut buf, vb, num(1), num(2), num(3) as usize, num(4)),
            Some("settle") => {
                // Keys `first, first + stride, ...` below `total` of the stream routable here.
                let (total, t0) = (num(1), Instant::now());
                let stride = num(3).max(1);
                let mut next = num(2);
                let done = wait_until(ANSWER_LIMIT, || {
                    while next < total && store.cluster_owner(&key_name(next)).is_some() {
                        next += stride;
                    }
                    next >= total
                });
                match done {
                    Some(()) => format!("SETTLED {}", t0.elapsed().as_nanos()),
                    None => format!("ERR {} not routable (of {total} keys)", key_name(next)),
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

/// Follows a stream while it runs: `shares` is `first:count,...` (one per tracked writer, put in
/// calls of `batch` keys). A writer's calls become routable in call order (each starts after the
/// previous one returned), so per share it keeps a frontier, the first call not yet seen
/// routable, and polls (every 50 us) `cluster_owner` for the frontier call's last key. When that
/// is routable, a galloping search (doubling, then bisection) finds the last routable call, and
/// every call from the frontier to there is recorded as seen at the first poll that found it or
/// a later call routable; each also gets the start of the frontier's last failed poll, before
/// which it was not routable. Answers `TRACKED <elapsed_ns> <seen, ns> <not routable before, ns>
/// <poll p50, ms> <poll p99, ms> <polls>` (wall clocks per call, in share and call order) once
/// every call is routable.
fn track(store: &Store, batch: u64, shares: &str) -> String {
    let shares: Vec<(u64, u64)> = shares
        .split(',')
        .filter_map(|s| {
            let (f, c) = s.split_once(':')?;
            Some((f.parse().ok()?, c.parse().ok()?))
        })
        .collect();
    let batch = batch.max(1);
    // Per share: (seen, not routable before) per call seen so far (its length is the frontier),
    // and the start of the frontier's last failed poll.
    let mut seen: Vec<Vec<(i64, i64)>> = shares
        .iter()
        .map(|s| Vec::with_capacity(s.1.div_ceil(batch) as usize))
        .collect();
    let mut failed_at = vec![now_ns(); shares.len()];
    // Every poll's own duration (a local read in the etcd design, a LOOKUP round trip where the
    // observer does not index the key in the sharded one).
    let mut poll_ns: Vec<i64> = Vec::with_capacity(1 << 16);
    let t0 = Instant::now();
    let done = wait_until(ANSWER_LIMIT, || {
        let mut all = true;
        for (s, &(first, count)) in shares.iter().enumerate() {
            let calls = count.div_ceil(batch) as usize;
            // Whether call `c`'s last key is routable, and the wall clock at the poll's start and
            // end.
            let poll = |c: usize| {
                let last = (first + (c as u64 + 1) * batch).min(first + count) - 1;
                let start = now_ns();
                let routable = store.cluster_owner(&key_name(last)).is_some();
                let end = now_ns();
                poll_ns.push(end - start);
                (routable, start, end)
            };
            advance(calls, poll, &mut seen[s], &mut failed_at[s]);
            all &= seen[s].len() == calls;
        }
        all
    });
    if done.is_none() {
        return format!("ERR the stream's calls were not all routable within {ANSWER_LIMIT:?}");
    }
    let (at, before): (Vec<String>, Vec<String>) = seen
        .iter()
        .flatten()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .unzip();
    let polls = poll_ns.len();
    let (p50, p99) = p50_p99_ms(&mut poll_ns);
    format!(
        "TRACKED {} {} {} {p50} {p99} {polls}",
        t0.elapsed().as_nanos(),
        at.join(","),
        before.join(",")
    )
}

/// One poll of one share for `track`: `seen` holds (seen, not routable before) per call seen so
/// far, `failed_at` the start of the frontier's last failed poll; `poll(c)` answers whether call
/// `c` is routable and the wall clock at the poll's start and end.
fn advance(
    calls: usize,
    mut poll: impl FnMut(usize) -> (bool, i64, i64),
    seen: &mut Vec<(i64, i64)>,
    failed_at: &mut i64,
) {
    let frontier = seen.len();
    if frontier >= calls {
        return;
    }
    let (routable, start, end) = poll(frontier);
    if !routable {
        *failed_at = start;
        return;
    }
    let before = *failed_at;
    let mut record = |upto: usize, at: i64| {
        while seen.len() <= upto {
            seen.push((at, before));
        }
    };
    record(frontier, end);
    // Gallop from the frontier: `lo` routable, `hi` (call, poll start) not.
    let (mut lo, mut hi, mut step) = (frontier, None, 1);
    while hi.is_none() && lo + 1 < calls {
        let c = (lo + step).min(calls - 1);
        match poll(c) {
            (true, _, end) => {
                lo = c;
                record(lo, end);
                step *= 2;
            }
            (false, start, _) => hi = Some((c, start)),
        }
    }
    // Bisect down to the first call not routable, the new frontier.
    while let Some((h, h_at)) = hi {
        if h == lo + 1 {
            *failed_at = h_at;
            break;
        }
        let c = lo + (h - lo) / 2;
        match poll(c) {
            (true, _, end) => {
                lo = c;
                record(lo, end);
            }
            (false, start, _) => hi = Some((c, start)),
        }
    }
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

fn spawn_peer(url: &str, design: Design, name: &str, arena: u64, vb: u64, batch: usize) -> Result<PeerProc, String> {
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mut child = Command::new(exe)
        .arg("umbp-scale-peer")
        .args(["--cluster", url, "--name", name])
        .args(["--arena", &arena.to_string(), "--value-bytes", &vb.to_string()])
        .args(["--batch", &batch.to_string()])
        .env("TE_TRANSPORTS", "local,tcp")
        .env("UMBP_CLUSTER_DIRECTORY", design.var())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting {name}: {e}"))?;
    let stdout = child.stdout.take().ok_or("peer stdout")?;
    let stdin = child.stdin.take().ok_or("peer stdin")?;
    let lines = crate::util::stdout_lines(stdout);
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
    let designs = parse_designs(&args.scale_directory)?;
    for n in counts {
        for &design in &designs {
            let v = run_one(&args, n, design).map_err(|e| format!("N={n}, {}: {e}", design.label()))?;
            if args.json {
                print_json(&v);
            } else {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            }
        }
    }
    Ok(())
}

/// Sends `cmd` to every peer, then collects each one's `tag` answer in peer order.
fn ask_all(peers: &mut [PeerProc], cmd: &str, tag: &str) -> Result<Vec<Vec<String>>, String> {
    for p in peers.iter_mut() {
        p.send(cmd)?;
    }
    peers.iter().map(|p| p.expect(tag)).collect()
}

/// Every peer's `(directory_entries, directory_messages)`.
fn directory_stats(peers: &mut [PeerProc]) -> Result<Vec<(u64, u64)>, String> {
    ask_all(peers, "stats", "STATS")?
        .iter()
        .map(|w| match (w.first().map(|x| x.parse()), w.get(1).map(|x| x.parse())) {
            (Some(Ok(e)), Some(Ok(m))) => Ok((e, m)),
            _ => Err(format!("bad STATS answer {w:?}")),
        })
        .collect()
}

fn run_one(args: &Args, n: usize, design: Design) -> Result<serde_json::Value, String> {
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
        peers.push(spawn_peer(&url, design, &name, arena, vb, batch)?);
    }
    let mut rss0 = Vec::with_capacity(n);
    let mut compact_s = 0;
    for p in &peers {
        let w = p.expect("READY")?;
        if w.get(1).map(String::as_str) != Some(design.var()) {
            return Err(format!(
                "{} opened with directory {:?}, not {}",
                p.name,
                w.get(1),
                design.var()
            ));
        }
        rss0.push(w[0].parse::<u64>().unwrap_or(0));
        compact_s = w.get(2).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
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
    let dir0 = directory_stats(&mut peers)?;

    // The stream: each writer its contiguous share.
    let m0 = metrics(&host_port)?;
    let rate_per_writer = args.scale_rate.div_ceil(writers);
    let shares: Vec<(u64, u64)> = (1..n as u64)
        .map(|w| {
            let first = (w - 1) * per_writer;
            (first, per_writer.min(keys.saturating_sub(first)))
        })
        .collect();
    let tracked_writers = shares.len().min(TRACKED_WRITERS);
    let list: Vec<String> = shares[..tracked_writers]
        .iter()
        .map(|(f, c)| format!("{f}:{c}"))
        .collect();
    peers[0].send(&format!("track {batch} {}", list.join(",")))?;
    peers[0].expect("TRACKING")?;
    let t0 = Instant::now();
    for (p, (first, count)) in peers[1..].iter_mut().zip(&shares) {
        p.send(&format!("put {first} {count} {batch} {rate_per_writer}"))?;
    }
    let mut call_lat = Vec::new();
    let mut returned = Vec::new();
    for (i, p) in peers[1..].iter().enumerate() {
        let w = p.expect("DONE")?;
        call_lat.extend(nums(&w, 2)?);
        if i < tracked_writers {
            returned.extend(nums(&w, 3)?);
        }
    }
    let stream_s = t0.elapsed().as_secs_f64();
    let m_stream = metrics(&host_port)?;
    let tracked = peers[0].expect("TRACKED")?;
    let (seen, unseen_before) = (nums(&tracked, 1)?, nums(&tracked, 2)?);
    let tracked_figure = |i: usize| tracked.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(f64::NAN);
    let (poll_p50, poll_p99) = (tracked_figure(3), tracked_figure(4));
    let polls = tracked.get(5).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    if seen.len() != returned.len() || unseen_before.len() != returned.len() {
        return Err(format!(
            "observer saw {} put calls, tracked writers made {}",
            seen.len(),
            returned.len()
        ));
    }
    let mut loaded_visible: Vec<i64> = seen.iter().zip(&returned).map(|(s, r)| s - r).collect();
    // How precisely each call's visibility is known: seen minus not routable before.
    let mut brackets: Vec<i64> = seen.iter().zip(&unseen_before).map(|(s, b)| s - b).collect();
    let put_calls = call_lat.len() as u64;
    let dir1 = directory_stats(&mut peers)?;
    // Every key routable before etcd's counters are read again: in the etcd design at every peer
    // (each copy holds every key); in the sharded design every key once, from peer `i mod N`.
    for (i, p) in peers.iter_mut().enumerate() {
        p.send(&match design {
            Design::Etcd => format!("settle {keys} 0 1"),
            Design::Sharded => format!("settle {keys} {i} {n}"),
        })?;
    }
    let mut settle_ns = Vec::with_capacity(n);
    for p in &peers {
        settle_ns.push(p.expect("SETTLED")?[0].parse::<u64>().unwrap_or(0));
    }
    let visible_everywhere_s = t0.elapsed().as_secs_f64();
    let m1 = metrics(&host_port)?;
    let dir2 = directory_stats(&mut peers)?;
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

    // Commit to visible: writer 1 puts, the observer polls `cluster_owner`.
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
    let (bracket_p50, bracket_p99) = p50_p99_ms(&mut brackets);
    let (miss_p50, miss_p99) = p50_p99_ms(&mut miss_lat);
    let requests = (m1.unary - m0.unary) + (m1.keep_alives - m0.keep_alives);
    let stream_requests = (m_stream.unary - m0.unary) + (m_stream.keep_alives - m0.keep_alives);
    // Directory messages sent during the stream: the writers' (putting) and the observer's
    // (its polling; LOOKUPs in the sharded design).
    let sent: Vec<u64> = dir1.iter().zip(&dir0).map(|(a, b)| a.1.saturating_sub(b.1)).collect();
    let writer_messages: u64 = sent[1..].iter().sum();
    let all_messages = writer_messages + sent[0];
    let entries: Vec<u64> = dir2.iter().map(|d| d.0).collect();
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
        "design": design.label(),
        "directory": design.var(),
        "peers": n,
        "writers": writers,
        "keys": keys,
        "value_bytes": vb,
        "keys_per_put_call": batch,
        "target_rate_keys_per_s": args.scale_rate,
        "cluster_compact_s": compact_s,
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
        "etcd_requests_during_stream": stream_requests,
        "etcd_requests_per_s": stream_requests / stream_s,
        "etcd_txns_per_put_call": (m1.txns - m0.txns) / put_calls.max(1) as f64,
        "etcd_mvcc_puts_per_key": (m1.mvcc_puts - m0.mvcc_puts) / keys as f64,
        "watch_events": m1.events - m0.events,
        "watch_events_per_key": (m1.events - m0.events) / keys as f64,
        "watch_events_per_put_call": (m1.events - m0.events) / put_calls.max(1) as f64,
        "directory_entries_observer": entries[0],
        "directory_entries_writer_median": median_u64(entries[1..].to_vec()),
        "directory_entries_total": entries.iter().sum::<u64>(),
        "directory_entries_observer_per_key": entries[0] as f64 / keys as f64,
        "directory_messages_writers": writer_messages,
        "directory_messages_per_put_call": writer_messages as f64 / put_calls.max(1) as f64,
        "directory_messages_per_key": writer_messages as f64 / keys as f64,
        "observer_directory_messages_during_stream": sent[0],
        "directory_messages_per_put_call_all_peers": all_messages as f64 / put_calls.max(1) as f64,
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
        "commit_to_visible_under_stream_samples": loaded_visible.len(),
        "commit_to_visible_under_stream_writers_tracked": tracked_writers,
        "commit_to_visible_under_stream_bracket_ms_p50": bracket_p50,
        "commit_to_visible_under_stream_bracket_ms_p99": bracket_p99,
        "observer_poll_under_stream_ms_p50": poll_p50,
        "observer_poll_under_stream_ms_p99": poll_p99,
        "observer_polls_under_stream": polls,
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

    #[test]
    fn tracking_gallops_to_the_frontier_and_brackets_each_call() {
        // Calls below `visible` are routable; the clock advances by 1 per poll.
        let run = |calls: usize, visible: usize, seen: &mut Vec<(i64, i64)>, failed: &mut i64, clock: &mut i64| {
            let mut polls = 0;
            advance(
                calls,
                |c| {
                    polls += 1;
                    *clock += 1;
                    (c < visible, *clock - 1, *clock)
                },
                seen,
                failed,
            );
            polls
        };
        let (mut seen, mut failed, mut clock) = (Vec::new(), 0, 100);
        assert_eq!(run(1000, 0, &mut seen, &mut failed, &mut clock), 1);
        assert!(seen.is_empty());
        assert_eq!(failed, 100);
        // 700 calls became routable since: found in a logarithmic number of polls, each recorded
        // once, not routable before the failed poll, seen no later than a poll that found it.
        let polls = run(1000, 700, &mut seen, &mut failed, &mut clock);
        assert!(polls <= 2 * 11, "{polls} polls");
        assert_eq!(seen.len(), 700);
        assert!(seen
            .iter()
            .all(|&(at, before)| before == 100 && at > 101 && at <= clock));
        assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0));
        // The new frontier's failed poll is the next bracket's start; then the rest.
        let (f, at) = (failed, clock);
        assert!(f > 101 && f < at);
        run(1000, 1000, &mut seen, &mut failed, &mut clock);
        assert_eq!(seen.len(), 1000);
        assert!(seen[700..].iter().all(|&(_, before)| before == f));
        assert_eq!(run(1000, 1000, &mut seen, &mut failed, &mut clock), 0);
    }

    #[test]
    fn directory_lists_name_each_design_once() {
        assert_eq!(parse_designs("etcd,sharded"), Ok(vec![Design::Etcd, Design::Sharded]));
        assert_eq!(parse_designs("sharded"), Ok(vec![Design::Sharded]));
        assert!(parse_designs("etcd,etcd").is_err());
        assert!(parse_designs("central").is_err());
        assert_eq!(Design::Sharded.label(), "sharded directory");
        let env = PeerEnv {
            cluster: "etcd://h:1/p",
        };
        assert_eq!(env.get("UMBP_CLUSTER").as_deref(), Some("etcd://h:1/p"));
        assert_eq!(env.get("UMBP_CLUSTER_LISTEN"), None);
        assert_eq!(env.get("UMBP_CLUSTER_NO_SUCH_VARIABLE"), None);
    }
}
