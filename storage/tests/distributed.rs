//! Distributed mode across real processes: three `umbp-peer` processes in three network
//! namespaces (separate network stacks joined by a bridge), and a real etcd on the bridge. Every
//! get is checked byte for byte inside the reading peer (self-describing pattern: a torn or
//! foreign byte is reported as BAD).
//!
//! Needs root and iproute2 (skips otherwise; fails when TE_REQUIRE names netns) and Debian's
//! etcd-server (TE_REQUIRE=etcd makes its absence a failure).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use te_tests::etcd::EtcdServer;
use te_tests::netns::{network_or_skip, Network};
use te_tests::node::Node;
use te_tests::skip_or_fail;

const PEERS: usize = 3;
const CONTROL_PORT: u16 = 7100;
/// The bound of one control request or remote read in these tests (UMBP_CLUSTER_TIMEOUT_MS,
/// TE_TCP_TIMEOUT_MS).
const TIMEOUT_MS: u64 = 2000;

struct Cluster {
    net: Network,
    etcd: Option<EtcdServer>,
    dirs: Vec<tempfile::TempDir>,
}

/// How one peer is configured.
#[derive(Clone, Default)]
struct PeerOpts {
    dram: Option<&'static str>,
    ssd: bool,
    write_through: bool,
    key_file: Option<PathBuf>,
}

impl Cluster {
    fn start() -> Option<Cluster> {
        let net = network_or_skip(PEERS)?;
        let etcd = match EtcdServer::start(&net.bridge_ns(), &net.bridge_ip()) {
            Ok(e) => e,
            Err(e) => {
                skip_or_fail("etcd", &e);
                return None;
            }
        };
        let dirs = (0..PEERS).map(|_| tempfile::tempdir().expect("tempdir")).collect();
        Some(Cluster {
            net,
            etcd: Some(etcd),
            dirs,
        })
    }

    fn peer(&self, h: usize, o: &PeerOpts) -> Node {
        self.peer_as(h, &format!("peer-{h}"), CONTROL_PORT, o)
    }

    /// A peer in host `h`'s namespace under another name and control port (a fourth peer).
    fn peer_as(&self, h: usize, name: &str, port: u16, o: &PeerOpts) -> Node {
        let ip = self.net.host_ip(h);
        let mut c = Network::command_in(&self.net.host_ns(h), env!("CARGO_BIN_EXE_umbp-peer"));
        c.args(["--name", name])
            .env(
                "UMBP_CLUSTER",
                format!("etcd://{}:2379/umbp-test", self.net.bridge_ip()),
            )
            .env("UMBP_CLUSTER_LISTEN", format!("{ip}:{port}"))
            .env("UMBP_CLUSTER_LEASE_TTL_S", "3")
            .env("UMBP_CLUSTER_TIMEOUT_MS", TIMEOUT_MS.to_string())
            .env("TE_TCP_LISTEN", format!("{ip}:0"))
            .env("TE_TCP_TIMEOUT_MS", TIMEOUT_MS.to_string())
            .env("UMBP_DRAM_CAPACITY", o.dram.unwrap_or("64M"))
            .env("UMBP_SSD_STAGING_BYTES", "4M")
            .env_remove("TE_AUTH_KEY_FILE");
        if o.ssd {
            c.env("UMBP_SSD_DIRS", self.dirs[h].path());
            c.env("UMBP_SSD_CAPACITY", "256M");
        }
        if o.write_through {
            c.env("UMBP_SSD_WRITE_THROUGH", "1");
        }
        if let Some(k) = &o.key_file {
            c.env("TE_AUTH_KEY_FILE", k);
        }
        Node::start(c).unwrap_or_else(|e| panic!("{name}: {e}"))
    }
}

/// Whether the peers run the etcd directory (test.sh runs this suite in both designs).
fn etcd_directory() -> bool {
    std::env::var("UMBP_CLUSTER_DIRECTORY").is_ok_and(|d| d == "etcd")
}

/// Waits until `node` routes `key` to `owner`; returns the milliseconds it took.
fn wait_owner(node: &mut Node, key: &str, owner: &str) -> u64 {
    let a = node.ok(&format!("wait-owner {key} {owner} 10000"));
    a[3..].trim().parse().unwrap_or(0)
}

fn expect_seed(node: &mut Node, key: &str, spans: &str, seed: u64) {
    let a = node.ok(&format!("get {key} {spans}"));
    let want_bytes: u64 = spans
        .split(',')
        .map(|s| s.split_once(':').unwrap().1.parse::<u64>().unwrap())
        .sum();
    assert_eq!(a, format!("OK {want_bytes} {seed}"), "get {key} {spans}");
}

fn stat(node: &mut Node, field: &str) -> u64 {
    let s = node.ok("stats");
    let at = s
        .find(&format!("{field}: "))
        .unwrap_or_else(|| panic!("{field} in {s}"));
    s[at + field.len() + 2..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn three_peers_read_each_others_dram_and_ssd_keys_by_span() {
    let Some(cl) = Cluster::start() else { return };
    let dram = PeerOpts::default();
    let ssd_only = PeerOpts {
        dram: Some("0"),
        ssd: true,
        ..Default::default()
    };
    let mut p = [cl.peer(0, &dram), cl.peer(1, &dram), cl.peer(2, &ssd_only)];
    for n in p.iter_mut() {
        let deadline = Instant::now() + Duration::from_secs(10);
        while n.ok("members") != "OK peer-0,peer-1,peer-2" {
            assert!(Instant::now() < deadline, "membership did not converge");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    p[0].ok("put dram-key 1048576 7");
    p[2].ok("put ssd-key 262144 9");
    for reader in [1, 2] {
        wait_owner(&mut p[reader], "dram-key", "peer-0");
    }
    for reader in [0, 1] {
        wait_owner(&mut p[reader], "ssd-key", "peer-2");
    }
    let spans = "0:1728,37440:8448,524288:65536,1048568:8";
    expect_seed(&mut p[1], "dram-key", spans, 7);
    expect_seed(&mut p[2], "dram-key", spans, 7);
    expect_seed(&mut p[0], "ssd-key", "8:1720,131072:4096,262136:8", 9);
    expect_seed(&mut p[1], "ssd-key", "0:262144", 9);
    // The owner reads its own key locally.
    expect_seed(&mut p[0], "dram-key", "0:4096", 7);
    // Only the spans moved: the remote bytes are exactly what was asked for.
    assert_eq!(stat(&mut p[1], "remote_bytes"), (1728 + 8448 + 65536 + 8) + 262144);
    assert_eq!(stat(&mut p[1], "remote_hits"), 2);
    assert_eq!(stat(&mut p[0], "local_hits"), 1);
    // A key nobody holds, and a span past the end of a remote object.
    assert_eq!(p[1].cmd("get nobody 0:8").unwrap(), "MISS");
    let a = p[1].cmd("get dram-key 1048576:8").unwrap();
    assert!(a.starts_with("ERR") && a.contains("outside"), "{a}");
    // A removed key is a miss everywhere once the removal is seen.
    p[0].ok("remove dram-key");
    wait_owner(&mut p[1], "dram-key", "none");
    assert_eq!(p[1].cmd("get dram-key 0:8").unwrap(), "MISS");
}

#[test]
fn a_killed_owner_fails_only_its_keys_and_rejoins_with_its_ssd_keys() {
    let Some(cl) = Cluster::start() else { return };
    let durable = PeerOpts {
        ssd: true,
        write_through: true,
        ..Default::default()
    };
    let mut p0 = cl.peer(0, &durable);
    let mut p1 = cl.peer(1, &PeerOpts::default());
    let mut p2 = cl.peer(2, &PeerOpts::default());
    p0.ok("put doomed 2097152 3");
    p1.ok("put survivor 65536 4");
    wait_owner(&mut p2, "doomed", "peer-0");
    wait_owner(&mut p2, "survivor", "peer-1");
    expect_seed(&mut p2, "doomed", "0:2097152", 3);

    // peer-2 streams remote gets of peer-0's key while peer-0 is SIGKILLed.
    let reader = std::thread::spawn(move || {
        let a = p2.ok("stream doomed 400 0:1048576,1048576:1048576");
        (p2, a)
    });
    std::thread::sleep(Duration::from_millis(300));
    p0.signal("KILL");
    let (mut p2, a) = reader.join().expect("reader thread");
    drop(p0);
    assert_eq!(field(&a, "bad"), 0, "no wrong byte: {a}");
    assert!(field(&a, "ok") > 0, "some reads finished before the kill: {a}");
    assert!(
        field(&a, "err") + field(&a, "miss") > 0,
        "reads after the kill fail: {a}"
    );
    assert!(
        field(&a, "max_ms") < 3 * TIMEOUT_MS,
        "no get waited past the timeouts: {a}"
    );
    // The survivors keep serving each other.
    expect_seed(&mut p2, "survivor", "0:65536", 4);
    expect_seed(&mut p1, "survivor", "8:64", 4);

    // peer-0 restarts on the same SSD directory: once it is up (its SSD keys written to the
    // directory as it joined), the first get is served, through placements remembered from its
    // previous instance being dropped and resolved afresh.
    let mut p0 = cl.peer(0, &durable);
    wait_owner(&mut p2, "doomed", "peer-0");
    expect_seed(&mut p2, "doomed", "0:4096,2093056:4096", 3);
    expect_seed(&mut p0, "doomed", "0:8", 3);
}

#[test]
fn an_etcd_outage_degrades_to_local_only_and_recovers() {
    let Some(mut cl) = Cluster::start() else { return };
    let mut p0 = cl.peer(0, &PeerOpts::default());
    let mut p1 = cl.peer(1, &PeerOpts::default());
    p0.ok("put before 65536 1");
    p1.ok("put other 4096 6");
    wait_owner(&mut p1, "before", "peer-0");
    wait_owner(&mut p0, "other", "peer-1");
    expect_seed(&mut p1, "before", "0:65536", 1);
    expect_seed(&mut p0, "other", "0:4096", 6);

    drop(cl.etcd.take());
    // Calls go on, bounded: local keys are served, remote ones are misses, puts succeed locally.
    let t = Instant::now();
    expect_seed(&mut p0, "before", "0:8", 1);
    // Once a peer sees the outage (its remote keys turn into misses), a put does not wait for
    // etcd at all.
    let deadline = Instant::now() + Duration::from_secs(10);
    while p0.cmd("get other 0:8").unwrap() != "MISS" {
        assert!(Instant::now() < deadline, "p0 should go local-only");
        std::thread::sleep(Duration::from_millis(50));
    }
    let tp = Instant::now();
    p0.ok("put during 65536 2");
    assert!(
        tp.elapsed() < Duration::from_millis(TIMEOUT_MS / 2),
        "a put during the outage waited {:?}",
        tp.elapsed()
    );
    expect_seed(&mut p0, "during", "0:65536", 2);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let a = p1.cmd("get before 0:8").unwrap();
        assert!(!a.starts_with("BAD"), "{a}");
        if a == "MISS" {
            break;
        }
        assert!(Instant::now() < deadline, "p1 should go local-only: {a}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(t.elapsed() < Duration::from_secs(15), "no call hung: {:?}", t.elapsed());

    // etcd comes back (empty: everything is written again from the peers).
    cl.etcd = Some(EtcdServer::start(&cl.net.bridge_ns(), &cl.net.bridge_ip()).expect("etcd restart"));
    wait_owner(&mut p1, "during", "peer-0");
    wait_owner(&mut p1, "before", "peer-0");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match p1.cmd("get during 0:65536").unwrap().as_str() {
            "OK 65536 2" => break,
            other => assert!(Instant::now() < deadline && !other.starts_with("BAD"), "{other}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn eviction_racing_remote_reads_yields_whole_versions_or_misses() {
    let Some(cl) = Cluster::start() else { return };
    // A 2 MiB arena: each overwrite of the 512 KiB key lands in pages the previous versions used.
    let small = PeerOpts {
        dram: Some("2M"),
        ..Default::default()
    };
    let mut p0 = cl.peer(0, &small);
    let mut p1 = cl.peer(1, &PeerOpts::default());
    p0.ok("put hot 524288 1");
    wait_owner(&mut p1, "hot", "peer-0");
    let writer = std::thread::spawn(move || {
        let a = p0.ok("churn hot 524288 8000");
        (p0, a)
    });
    let a = p1.ok("stream hot 400 0:524288");
    let (_p0, w) = writer.join().expect("writer");
    assert_eq!(w, "OK failed=0");
    assert_eq!(field(&a, "bad"), 0, "a remote read returned torn bytes as data: {a}");
    assert!(field(&a, "ok") > 0, "reads succeeded: {a}");
    eprintln!("race: {a}; stale reads: {}", stat(&mut p1, "remote_stale"));
}

#[test]
fn peers_without_the_key_are_refused() {
    let Some(cl) = Cluster::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let key = |name: &str, bytes: &[u8]| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let _ = Command::new("chmod").arg("600").arg(&path).status();
        path
    };
    let good = PeerOpts {
        key_file: Some(key("good", b"0123456789abcdef0123456789abcdef")),
        ..Default::default()
    };
    let wrong = PeerOpts {
        key_file: Some(key("wrong", b"fedcba9876543210fedcba9876543210")),
        ..Default::default()
    };
    let mut p0 = cl.peer(0, &good);
    let mut p1 = cl.peer(1, &good);
    let mut p2 = cl.peer(2, &wrong);
    p0.ok("put secret 4096 5");
    wait_owner(&mut p1, "secret", "peer-0");
    expect_seed(&mut p1, "secret", "0:4096", 5);
    let a = p2.cmd("get secret 0:4096").unwrap();
    if etcd_directory() {
        // It reads the owner from etcd, and the owner refuses its RESOLVE.
        assert!(a.starts_with("ERR") && a.contains("peer-0"), "{a}");
    } else {
        // Every control listener refuses it: its directory lookups (and, were it to learn the
        // owner, its RESOLVE) get nothing, so the key is a miss to it.
        assert_eq!(a, "MISS");
        assert!(
            p2.cmd("owner secret").unwrap().contains("none"),
            "the wrong key learned the owner"
        );
    }
    // A client without credentials: its HELLO (head: magic "UC", version, opcode 1, empty body)
    // is answered REFUSED (opcode 9), never READY (4).
    let script = format!(
        "exec 3<>/dev/tcp/{}/{CONTROL_PORT} && printf 'UC\\x{:02x}\\x01\\x00\\x00\\x00\\x00' >&3 && head -c 8 <&3 | od -An -tu1",
        cl.net.host_ip(0),
        umbp::cluster::wire::VERSION
    );
    let out = Network::command_in(&cl.net.host_ns(2), "bash")
        .args(["-c", &script])
        .output()
        .expect("bash");
    let head: Vec<u32> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|b| b.parse().ok())
        .collect();
    assert_eq!(head.get(3), Some(&9), "answer head {head:?}");
}

#[test]
fn a_put_that_does_not_fit_goes_to_the_peer_with_the_most_free_dram() {
    let Some(cl) = Cluster::start() else { return };
    let tiny = PeerOpts {
        dram: Some("1M"),
        ..Default::default()
    };
    let mut p0 = cl.peer(0, &tiny);
    let mut p1 = cl.peer(1, &PeerOpts::default());
    let mut p2 = cl.peer(
        2,
        &PeerOpts {
            dram: Some("16M"),
            ..Default::default()
        },
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while p0.ok("members") != "OK peer-0,peer-1,peer-2" {
        assert!(Instant::now() < deadline, "membership did not converge");
        std::thread::sleep(Duration::from_millis(20));
    }
    // 4 MiB cannot live in peer-0's 1 MiB arena (and it has no SSD): peer-1 (64 MiB) takes it.
    p0.ok("put big 4194304 11");
    // The writer learns the owner from the directory's watch, as every peer does (its own remote
    // put does not write its view): under load that lags the COMMIT by milliseconds, so wait.
    wait_owner(&mut p0, "big", "peer-1");
    wait_owner(&mut p2, "big", "peer-1");
    expect_seed(&mut p2, "big", "0:4096,4190208:4096", 11);
    expect_seed(&mut p0, "big", "1048576:1048576", 11);
    expect_seed(&mut p1, "big", "0:4194304", 11);
    assert_eq!(stat(&mut p1, "local_hits"), 1);
    assert_eq!(stat(&mut p0, "puts_ok"), 1);
}

/// Keys the membership-change tests put (two writers, half each) and their reader sweeps; the
/// first read of each asks the directory (no remembered placement yet).
const SWEEP_KEYS: u64 = 16000;
const SWEEP_CHUNK: u64 = 100;
/// How long the reader keeps sweeping after a membership change: past the lease TTL (a killed
/// peer leaves the membership), the settling window (2 x the timeout) and the re-homing.
const AFTER_CHANGE: Duration = Duration::from_millis(3000 + 2 * TIMEOUT_MS + 1000);

/// Three peers and a fourth (`peer-3`, in host 2's namespace) that joins, leaves or is killed
/// while `peer-2` sweeps keys owned by `peer-0` and `peer-1` byte by byte. `fourth_first`:
/// the fourth peer is a member (and a directory peer of about half the keys) before the keys are
/// put; `change` returns it when it is still running.
fn membership_change(fourth_first: bool, change: impl FnOnce(Option<Node>, &Cluster) -> Option<Node>) {
    let Some(cl) = Cluster::start() else { return };
    let opts = PeerOpts::default();
    let mut p0 = cl.peer(0, &opts);
    let mut p1 = cl.peer(1, &opts);
    let p2 = cl.peer(2, &opts);
    let fourth = fourth_first.then(|| cl.peer_as(2, "peer-3", CONTROL_PORT + 1, &opts));
    let half = SWEEP_KEYS / 2;
    fill_all(&mut p0, 0, half);
    fill_all(&mut p1, half, half);

    // The reader sweeps in chunks and reports each with the time it finished, until told to stop:
    // it keeps going however fast the machine is (past the last key it starts over; those reads
    // go through the remembered placement, a first pass through the directory).
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, String)>();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader_stop = stop.clone();
    let reader = std::thread::spawn(move || {
        let mut p2 = p2;
        for c in (0..SWEEP_KEYS / SWEEP_CHUNK).cycle() {
            if reader_stop.load(std::sync::atomic::Ordering::Relaxed) {
                break;
            }
            let a = p2.ok(&format!("sweep k {} {SWEEP_CHUNK} 0:2048", c * SWEEP_CHUNK));
            if tx.send((Instant::now(), a)).is_err() {
                break;
            }
        }
        p2
    });
    let mut answers = vec![rx.recv().expect("the reader's first chunk")];
    let fourth = change(fourth, &cl);
    let changed = Instant::now();
    let mut covered = false;
    for (at, a) in rx.iter() {
        answers.push((at, a));
        if at >= changed + AFTER_CHANGE {
            covered = true;
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(rx);
    let mut p2 = reader.join().expect("reader thread");
    let after = answers.iter().filter(|(at, _)| *at > changed).count();
    eprintln!("{} chunks read, {after} after the change", answers.len());
    assert!(covered, "the reader stopped before the change had settled");
    for (_, a) in &answers {
        assert_eq!(
            field(a, "ok"),
            SWEEP_CHUNK,
            "every key of a live owner stays routable and whole: {a}"
        );
    }
    // After the change has settled, every key is still there for every peer.
    let (ok, a) = sweep_all(&mut p2, "0:8,2040:8");
    assert_eq!(ok, SWEEP_KEYS, "after the change: {a}");
    if let Some(mut f) = fourth {
        let (ok, a) = sweep_all(&mut f, "0:8");
        assert_eq!(ok, SWEEP_KEYS, "the fourth peer reads every key: {a}");
        assert!(
            stat(&mut f, "directory_entries") > 0,
            "the fourth peer indexes its share"
        );
    }
    let entries: u64 = [&mut p0, &mut p1, &mut p2]
        .into_iter()
        .map(|p| stat(p, "directory_entries"))
        .sum();
    eprintln!("directory entries on peers 0-2 after the change: {entries}");
}

/// The number after `name=` in a node's answer (`ok=12 err=0 ...`); a missing or malformed field
/// fails the test, naming the answer.
fn field(answer: &str, name: &str) -> u64 {
    answer
        .split_whitespace()
        .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number {name}= in the answer {answer:?}"))
}

/// Commands per node in the membership-change tests carry at most this many keys: the node's
/// answer timeout then bounds each command as a hang guard, not thousands of puts or reads at
/// once (8,000 puts in one command ran past it on a loaded machine).
const KEYS_PER_COMMAND: u64 = 1000;

/// Puts keys `first..first + count` of the membership-change tests (2 KiB each), every one
/// acknowledged.
fn fill_all(node: &mut Node, first: u64, count: u64) {
    for at in (first..first + count).step_by(KEYS_PER_COMMAND as usize) {
        let n = KEYS_PER_COMMAND.min(first + count - at);
        assert_eq!(
            node.ok(&format!("fill k {at} {n} 2048")),
            "OK failed=0",
            "keys {at}..{}",
            at + n
        );
    }
}

/// Reads every key of the membership-change tests once. Returns the keys read whole and the
/// first answer that was short (else the last answer).
fn sweep_all(node: &mut Node, ranges: &str) -> (u64, String) {
    let (mut ok, mut short, mut last) = (0, None, String::new());
    for first in (0..SWEEP_KEYS).step_by(KEYS_PER_COMMAND as usize) {
        let a = node.ok(&format!("sweep k {first} {KEYS_PER_COMMAND} {ranges}"));
        let whole = field(&a, "ok");
        ok += whole;
        if whole != KEYS_PER_COMMAND && short.is_none() {
            short = Some(a.clone());
        }
        last = a;
    }
    (ok, short.unwrap_or(last))
}

#[test]
fn a_joining_peer_takes_its_share_of_the_directory_while_a_reader_runs() {
    membership_change(false, |none, cl| {
        assert!(none.is_none());
        Some(cl.peer_as(2, "peer-3", CONTROL_PORT + 1, &PeerOpts::default()))
    });
}

#[test]
fn a_peer_leaving_cleanly_loses_no_routable_key_while_a_reader_runs() {
    membership_change(true, |fourth, _| {
        let mut f = fourth.expect("the fourth peer");
        assert!(stat(&mut f, "directory_entries") > 0, "the leaver indexed keys");
        f.send("quit").expect("quit");
        None
    });
}

#[test]
fn a_killed_directory_peer_loses_no_routable_key_while_a_reader_runs() {
    membership_change(true, |fourth, _| {
        let f = fourth.expect("the fourth peer");
        f.signal("KILL");
        None
    });
}
