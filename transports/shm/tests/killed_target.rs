//! A target process SIGKILLed in the middle of a batch, through the whole engine (routes shm and
//! tcp): the batch fails with the shm route's "the process exited" once the kernel detached the
//! process's memory, without failing over to tcp and without waiting for a socket to hang up.
//! The kernel closes a killed process's sockets only after tearing its whole address space down;
//! here a process forked from the target before the kill inherits every socket of it (the shm
//! control connection, the tcp listener and connections, the metadata listener), so no hang-up
//! ever comes, and the batch must fail anyway. Both routes: cross-memory attach (anonymous target
//! memory) and the mapped memfd, where the copies never make a system call that could fail.
//!
//! The target is this test binary again, started with [`ROLE`] set (`killed_target_role`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::config::MapEnv;
use te_core::metadata::p2p::{P2pConfig, P2pStore};
use te_core::{Error, HostBacking, HostBufferOptions, RequestStatus, TransferEngine, TransferRequest};

/// Set in the child: the bytes the target exports.
const ROLE: &str = "TE_SHM_TEST_KILLED_TARGET_BYTES";
/// Set in the child to `memfd` or `anonymous`: the target buffer's backing, which picks the route
/// (a memfd is mapped by the initiator and copied with memcpy; anonymous memory goes by
/// cross-memory attach).
const BACKING: &str = "TE_SHM_TEST_KILLED_TARGET_BACKING";
/// Hang guard of every wait: generous, never what the test measures.
const HANG_GUARD: Duration = Duration::from_secs(120);
const BLOCK: u64 = 1 << 20;

/// An engine with routes shm and tcp, its descriptors served on a metadata listener of its own
/// (whose address it returns).
async fn engine(name: &str) -> (TransferEngine, std::net::SocketAddr) {
    let store = P2pStore::start(P2pConfig::new("127.0.0.1:0".parse().unwrap(), Duration::from_secs(10)))
        .await
        .unwrap();
    let at = store.local_addr();
    let e = TransferEngine::builder()
        .segment_name(name)
        .metadata(Arc::new(store))
        .env(Arc::new(MapEnv::new([
            ("TE_TCP_LISTEN", "127.0.0.1:0"),
            ("TE_SHM_MEMFD", "1"),
        ])))
        .transports(["shm", "tcp"])
        .build()
        .await
        .unwrap();
    (e, at)
}

fn backed(backing: HostBacking) -> HostBufferOptions {
    HostBufferOptions {
        backing,
        ..Default::default()
    }
}

/// The target's side (in the child process only): exports a touched buffer, prints
/// `TARGET <segment> <address>`; on `hold` forks the process that keeps its sockets open and
/// prints `HOLDER <pid>`; then waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_target_role() {
    let Ok(bytes) = std::env::var(ROLE) else {
        return; // Not the child: nothing to do.
    };
    let name = format!("shm-killed-target-{}", std::process::id());
    let (e, at) = engine(&name).await;
    let backing = match std::env::var(BACKING).as_deref() {
        Ok("memfd") => HostBacking::Memfd,
        _ => HostBacking::Anonymous,
    };
    let buf = e.allocate(bytes.parse().unwrap(), backed(backing)).await.unwrap();
    buf.write_at(0, &vec![1u8; buf.len() as usize]).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "TARGET {name}@{at} {}", buf.addr()).unwrap();
    out.flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "hold");
    // SAFETY: fork has no memory preconditions; the child only calls read and _exit (both
    // async-signal-safe), so the other threads it lacks cannot leave it a lock to wait on.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mut b = 0u8;
        // SAFETY: one byte of our stack; it lives until the child exits. The child holds every
        // descriptor of the target until its standard input (the test's pipe) closes.
        while unsafe { libc::read(0, (&mut b as *mut u8).cast(), 1) } > 0 {}
        // SAFETY: ends the child at once (no destructors, no atexit handlers of the parent's).
        unsafe { libc::_exit(0) };
    }
    assert!(pid > 0, "fork: {}", std::io::Error::last_os_error());
    writeln!(out, "HOLDER {pid}").unwrap();
    out.flush().unwrap();
    drop(out);
    std::io::stdin().read_line(&mut line).unwrap();
    drop(buf);
}

/// The target child and the process holding its sockets; both are killed when dropped.
struct Target {
    child: Child,
    /// Kept open until the drop (`Child::wait` would close it): the holder lives until then.
    stdin: std::process::ChildStdin,
    out: BufReader<std::process::ChildStdout>,
    holder: Option<i32>,
}

impl Target {
    fn start(bytes: u64, backing: &str) -> Target {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "killed_target_role", "--nocapture", "--test-threads=1"])
            .env(ROLE, bytes.to_string())
            .env(BACKING, backing)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the target");
        let out = BufReader::new(child.stdout.take().unwrap());
        Target {
            stdin: child.stdin.take().unwrap(),
            child,
            out,
            holder: None,
        }
    }

    /// What follows `tag` on the next line of ours that has it (the test harness prints its own
    /// lines too).
    fn line(&mut self, tag: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                self.out.read_line(&mut line).unwrap() > 0,
                "the target ended before {tag}"
            );
            // The harness starts its "test ... " line before ours, without a line break.
            if let Some(at) = line.find(&format!("{tag} ")) {
                return line[at + tag.len()..].trim().to_string();
            }
        }
    }

    fn say(&mut self, what: &str) {
        writeln!(self.stdin, "{what}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The holder runs (not a zombie: nobody may reap it once the target is gone).
    fn holder_alive(&self) -> bool {
        self.holder.is_some_and(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                s.rsplit_once(") ")
                    .is_some_and(|(_, rest)| !rest.starts_with(['Z', 'X']))
            })
        })
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(p) = self.holder {
            // SAFETY: `p` is the holder the target forked, alive until its standard input (ours)
            // closes after this, so its pid cannot have been given to another process.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_target_fails_the_batch_before_its_sockets_close() {
    killed_target_fails_the_batch("anonymous").await;
}

/// The same on the mapped route: the initiator copies into its own mapping of the target's
/// memfd, which outlives the target, so only the target's pidfd tells the copies to stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_target_fails_the_batch_on_the_mapped_route_too() {
    killed_target_fails_the_batch("memfd").await;
}

async fn killed_target_fails_the_batch(backing: &str) {
    let len = 64u64 << 20;
    if backing == "memfd" {
        // Only the pidfd tells a mapped copy that the target died (kernel 5.3 and later).
        // SAFETY: pidfd_open of our own pid with no flags; the descriptor is closed at once.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) };
        if fd < 0 {
            let why = std::io::Error::last_os_error();
            te_base::test_support::skip_or_fail("pidfd", &format!("pidfd_open: {why}"));
            return;
        }
        // SAFETY: `fd` is the descriptor pidfd_open just returned, owned by nothing else.
        unsafe { libc::close(fd as i32) };
    }
    let mut target = Target::start(len, backing);
    let info = target.line("TARGET");
    let (segment, addr) = info.split_once(' ').unwrap();
    let addr: u64 = addr.parse().unwrap();
    let (e, _) = engine(&format!("shm-killed-initiator-{backing}-{}", std::process::id())).await;
    let src = e.allocate(len as usize, backed(HostBacking::Anonymous)).await.unwrap();
    let seg = e.open_segment(segment).await.unwrap();
    e.transfer(&[TransferRequest::write(src.addr(), seg.id(), addr, 4096)])
        .await
        .unwrap();
    let routes: Vec<_> = e.routes(&seg).unwrap().iter().map(|r| r.transport).collect();
    assert_eq!(routes, ["shm", "tcp"], "shm carries it, tcp could take over");
    if backing == "memfd" {
        // The target's memfd is mapped here (our own buffer is anonymous): the mapped route.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(
            maps.lines()
                .any(|l| l.contains("memfd:te-host") && mapping_len(l) == len),
            "the target's {len}-byte memfd is not mapped in the initiator"
        );
    }
    target.say("hold");
    target.holder = Some(target.line("HOLDER").parse().unwrap());
    // 16 GiB in 1 MiB writes over the target's buffer: far more than can finish before the kill
    // below, whatever the machine's speed.
    let n = 16 * 1024;
    let reqs: Vec<TransferRequest> = (0..n)
        .map(|i| {
            let off = (i * BLOCK) % len;
            TransferRequest::write(src.addr() + off, seg.id(), addr + off, BLOCK)
        })
        .collect();
    let batch = e.submit(&reqs).unwrap();
    // Wait for the event "copies are landing", then kill the process that owns the memory.
    let started = Instant::now();
    while batch.poll().done == 0 {
        assert_eq!(batch.poll().failed, 0, "failures before the kill");
        assert!(started.elapsed() < HANG_GUARD, "no progress before the kill");
        std::thread::yield_now();
    }
    target.child.kill().unwrap();
    target.child.wait().unwrap();
    let report = tokio::time::timeout(HANG_GUARD, batch.wait())
        .await
        .expect("the batch settles with the target's sockets still open");
    report.expect_err("a batch whose target died cannot succeed");
    assert!(
        target.holder_alive(),
        "the target's sockets stayed open until the batch returned"
    );
    let failed: Vec<Error> = (0..n as usize)
        .filter_map(|i| match batch.status(i) {
            Some(RequestStatus::Failed(e)) => Some(e),
            _ => None,
        })
        .collect();
    assert!(!failed.is_empty());
    let mut other: Vec<(String, usize)> = Vec::new();
    for err in &failed {
        if !matches!(err, Error::PeerGone { reason, .. } if reason.contains("the process exited")) {
            match other.iter_mut().find(|(m, _)| *m == err.to_string()) {
                Some((_, k)) => *k += 1,
                None => other.push((err.to_string(), 1)),
            }
        }
    }
    assert!(
        other.is_empty(),
        "every request fails naming the exit, none by another route; of {} failures: {other:?}",
        failed.len()
    );
    // The holder goes first, so the engine's shutdown finds the target's sockets closed.
    drop(target);
}

/// The length of one `/proc/self/maps` line's mapping.
fn mapping_len(line: &str) -> u64 {
    let range = line.split_whitespace().next().unwrap_or("");
    let (lo, hi) = range.split_once('-').unwrap_or(("0", "0"));
    u64::from_str_radix(hi, 16)
        .unwrap_or(0)
        .saturating_sub(u64::from_str_radix(lo, 16).unwrap_or(0))
}
