//! Two engines in two processes on a real RDMA device, through the engine's public API: the
//! target is this test binary re-run as a child (`serve_as_child`), found through peer-to-peer
//! metadata. Runs where `TE_TEST_RDMA_DEVICE` names a device (the soft-RoCE guest of
//! `scripts/rdma-vm.sh` runs it on rxe0); skips otherwise, and fails instead when `TE_REQUIRE`
//! names `rdma`.
//!
//! What the fake verbs layer cannot show, shown here on the kernel's verbs stack:
//! - a stopped target process still serves its memory (the responder is the NIC, or the kernel
//!   for soft-RoCE), so `SIGSTOP` alone stalls nothing;
//! - a deadline against a target that answers nothing on the wire (killed: its QPs are gone) fails
//!   the batch as a timeout, and only once the device flushed: the source can be deregistered at
//!   once; the target's restarted instance is then reconnected to and served;
//! - the documented GID rule picks the entry sysfs says it should, and `TE_RDMA_GID_INDEX`
//!   forces another.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::config::MapEnv;
use te_base::notify::NotifyLimits;
use te_core::metadata::p2p::{P2pConfig, P2pStore};
use te_core::{
    HostBufferOptions, Registration, SegmentEvent, SegmentHandle, SubmitOptions, TransferEngine, TransferRequest,
};

const LEN: usize = 16 << 20;
const PIECE: u64 = 64 << 10;

/// These tests time bounded behaviour with child processes on an emulated machine: they take
/// turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Prints a step of a test with the time since the process started, so a guest log shows where a
/// run spent its time (or stopped).
fn step(what: &str) {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let t = START.get_or_init(Instant::now).elapsed();
    eprintln!("[{:8.3} s] {what}", t.as_secs_f64());
}

fn pattern(seed: u8, off: usize) -> u8 {
    (off as u8).wrapping_mul(31) ^ (off >> 12) as u8 ^ seed.wrapping_mul(97)
}

fn fill(r: &Registration, seed: u8) {
    let bytes: Vec<u8> = (0..r.len() as usize).map(|i| pattern(seed, i)).collect();
    r.write_at(0, &bytes).expect("filling a registration");
}

fn mismatched(r: &Registration, seed: u8) -> usize {
    let mut bytes = vec![0u8; r.len() as usize];
    r.read_at(0, &mut bytes).expect("reading a registration");
    bytes
        .iter()
        .enumerate()
        .filter(|(i, b)| **b != pattern(seed, *i))
        .count()
}

fn context(device: &str, segment: &str, extra: &[(&str, &str)]) -> te_base::InstallContext {
    common::context(device, segment, extra, NotifyLimits::default())
}

/// An engine whose only transport is rdma on `device`, with peer-to-peer metadata on `listen`.
async fn engine(device: &str, name: &str, listen: SocketAddr) -> (TransferEngine, Arc<P2pStore>) {
    let store = Arc::new(
        P2pStore::start(P2pConfig::new(listen, Duration::from_secs(5)))
            .await
            .expect("p2p metadata store"),
    );
    let rdma = te_transport_rdma::install(&context(device, name, &[]))
        .await
        .unwrap_or_else(|e| panic!("rdma on {device}: {e}"));
    let engine = TransferEngine::builder()
        .segment_name(name)
        .transports(Vec::<String>::new())
        .with_transport(rdma)
        .metadata(store.clone())
        .env(Arc::new(MapEnv::default()))
        .build()
        .await
        .expect("engine");
    (engine, store)
}

/// The target side, when this binary is run as a child by [`Target::start`]: one exported
/// buffer of `LEN` holding `pattern(seed)`, its metadata address printed as `READY <addr>`,
/// served until stdin closes.
#[test]
#[ignore = "the target process of the tests below; they run it"]
fn serve_as_child() {
    let (Ok(device), Ok(listen), Ok(seed)) = (
        std::env::var("TE_TEST_RDMA_DEVICE"),
        std::env::var("TE_TEST_CHILD_LISTEN"),
        std::env::var("TE_TEST_CHILD_SEED"),
    ) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (engine, store) = engine(&device, "rdma-two-process-target", listen.parse().unwrap()).await;
        let buf = engine.allocate(LEN, HostBufferOptions::default()).await.unwrap();
        fill(&buf, seed.parse().unwrap());
        // On a line of its own: libtest has already printed "test serve_as_child ... ".
        println!("\nREADY {}", store.local_addr());
        std::io::stdout().flush().unwrap();
        tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin().read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                sink.clear();
            }
        })
        .await
        .unwrap();
        drop(buf);
        engine.shutdown().await.unwrap();
    });
}

/// A target process; killed when dropped.
struct Target {
    child: Child,
    addr: SocketAddr,
}

impl Target {
    fn start(device: &str, listen: &str, seed: u8) -> Target {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "serve_as_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TE_TEST_RDMA_DEVICE", device)
            .env("TE_TEST_CHILD_LISTEN", listen)
            .env("TE_TEST_CHILD_SEED", seed.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the target process");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(at) = line.find("READY ") {
                        break line[at + 6..].trim().parse().unwrap();
                    }
                }
                _ => panic!("the target process exited before READY: {:?}", child.wait()),
            }
        };
        Target { child, addr }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid, which it keeps until we wait on it.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(
            rc,
            0,
            "kill({}, {sig}): {}",
            self.child.id(),
            std::io::Error::last_os_error()
        );
    }

    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn requests(write: bool, local: &Registration, seg: &SegmentHandle) -> Vec<TransferRequest> {
    requests_at(write, local, seg, seg.buffers()[0].base)
}

fn requests_at(write: bool, local: &Registration, seg: &SegmentHandle, remote: u64) -> Vec<TransferRequest> {
    (0..LEN as u64 / PIECE)
        .map(|i| {
            let (l, r) = (local.addr() + i * PIECE, remote + i * PIECE);
            if write {
                TransferRequest::write(l, seg.id(), r, PIECE)
            } else {
                TransferRequest::read(l, seg.id(), r, PIECE)
            }
        })
        .collect()
}

fn within(secs: u64) -> SubmitOptions {
    SubmitOptions {
        deadline: Some(Duration::from_secs(secs)),
        ..SubmitOptions::default()
    }
}

/// Reads the whole remote buffer into a fresh registration and counts bytes that are not
/// `pattern(seed)`.
async fn remote_mismatches(engine: &TransferEngine, seg: &SegmentHandle, seed: u8) -> usize {
    let back = engine.allocate(LEN, HostBufferOptions::default()).await.unwrap();
    engine
        .submit_with(&requests(false, &back, seg), &within(60))
        .unwrap()
        .wait()
        .await
        .expect("reading the target back");
    mismatched(&back, seed)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn writes_and_reads_land_in_a_stopped_process() {
    let Some(dev) = common::device() else { return };
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    runtime().block_on(async {
        step("starting the target");
        let target = Target::start(&dev, "127.0.0.1:0", 1);
        let (a, _store) = engine(&dev, "rdma-two-process-initiator", "127.0.0.1:0".parse().unwrap()).await;
        let seg = a.open_segment(&target.addr.to_string()).await.unwrap();
        let src = a.allocate(LEN, HostBufferOptions::default()).await.unwrap();
        step("reading from the running target");
        a.submit_with(&requests(false, &src, &seg), &within(60))
            .unwrap()
            .wait()
            .await
            .expect("read from the running target");
        assert_eq!(mismatched(&src, 1), 0, "the target's own bytes, read");
        step("stopping the target; writing to it");
        target.signal(libc::SIGSTOP);
        fill(&src, 2);
        a.submit_with(&requests(true, &src, &seg), &within(60))
            .unwrap()
            .wait()
            .await
            .expect("a stopped process's memory is still served by its device");
        assert_eq!(
            remote_mismatches(&a, &seg, 2).await,
            0,
            "writes into the stopped process"
        );
        target.signal(libc::SIGCONT);
        eprintln!(
            "{dev}: {} MiB written to and read from a SIGSTOPped process, every byte checked",
            LEN >> 20
        );
    });
}

/// The target killed before the batch: its QPs are gone, so the device drops what reaches them and
/// answers nothing, and only the deadline ends the batch (its device's retries run longer: ~0.5 s
/// at the default `TE_RDMA_TIMEOUT`, and on rxe nothing came back within 30 s). The batch must
/// settle as timed out once the flush is done, its source free at once; the instance restarted
/// at the same metadata address is then found (a restart event) and served.
#[test]
fn a_deadline_ends_a_batch_to_a_killed_target_and_its_restarted_instance_is_served() {
    let Some(dev) = common::device() else { return };
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    runtime().block_on(async {
        step("starting the target");
        let mut target = Target::start(&dev, "127.0.0.1:0", 1);
        let addr = target.addr;
        let (a, _store) = engine(&dev, "rdma-two-process-initiator", "127.0.0.1:0".parse().unwrap()).await;
        let seg = a.open_segment(&addr.to_string()).await.unwrap();
        let mut events = seg.events();
        let src = a.allocate(LEN, HostBufferOptions::default()).await.unwrap();
        fill(&src, 3);
        step("writing to the running target");
        a.submit_with(&requests(true, &src, &seg), &within(60))
            .unwrap()
            .wait()
            .await
            .expect("the running target is written");

        step("killing the target; writing to it with a 300 ms deadline");
        target.kill();
        let deadline = Duration::from_millis(300);
        let opts = SubmitOptions {
            deadline: Some(deadline),
            ..SubmitOptions::default()
        };
        let started = Instant::now();
        let batch = a.submit_with(&requests(true, &src, &seg), &opts).unwrap();
        let err = tokio::time::timeout(Duration::from_secs(60), batch.wait())
            .await
            .expect("the batch stayed in progress long past its deadline")
            .expect_err("nothing can complete against a killed target");
        let settled = started.elapsed();
        assert_eq!(err.failures.len() as u64, LEN as u64 / PIECE, "every request failed");
        for (i, e) in &err.failures {
            assert!(e.is_timeout(), "request {i}: {e}");
        }
        step("settled; deregistering the source");
        // The batch settled only once the device flushed: nothing pins the source now.
        src.deregister().await.expect("a settled batch still pins its source");
        eprintln!(
            "{dev}: a {} ms deadline against a killed target settled after {} ms ({} requests, all timed out)",
            deadline.as_millis(),
            settled.as_millis(),
            err.failures.len()
        );

        step("restarting the target at the same address");
        let _restarted = Target::start(&dev, &addr.to_string(), 7);
        let local = a.allocate(LEN, HostBufferOptions::default()).await.unwrap();
        // The first submit finds the connection lost and starts the reconnect, which fetches the
        // new descriptor and reports the restart; its buffer has a new address.
        let until = Instant::now() + Duration::from_secs(90);
        let mut base = None;
        let mut failed = 0;
        loop {
            while let Ok(ev) = events.try_recv() {
                if let SegmentEvent::Restarted(d) = ev {
                    base = Some(d.buffers[0].base);
                }
            }
            let reqs = requests_at(false, &local, &seg, base.unwrap_or(seg.buffers()[0].base));
            let outcome = match a.submit_with(&reqs, &within(20)) {
                Ok(batch) => batch.wait().await.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match outcome {
                Ok(()) if base.is_some() => break,
                Ok(()) => panic!("a read of the old instance's address succeeded before any restart was seen"),
                Err(e) => {
                    step(&format!("read from the restarted target failed: {e}"));
                    failed += 1;
                    assert!(
                        Instant::now() < until,
                        "the restarted target was not reached in 90 s: {e}"
                    );
                    // A poll interval, not a wait for an outcome: the loop ends on a transfer.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        assert_eq!(mismatched(&local, 7), 0, "the restarted instance's bytes");
        eprintln!(
            "{dev}: the restarted target was served after {failed} failed read(s); {} MiB verified",
            LEN >> 20
        );
    });
}

/// 32 hex digits of a sysfs GID (`fe80:0000:...`).
fn sysfs_gid(dev: &str, index: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/gids/{index}")).ok()?;
    Some(text.trim().replace(':', ""))
}

fn sysfs_gid_type(dev: &str, index: u32) -> Option<String> {
    let path = format!("/sys/class/infiniband/{dev}/ports/1/gid_attrs/types/{index}");
    std::fs::read_to_string(path).ok().map(|t| t.trim().to_string())
}

fn gid_sent_from(endpoint: &serde_json::Value) -> String {
    endpoint["rails"][0]["gid"].as_str().expect("a rail's GID").to_string()
}

#[test]
fn the_gid_rule_picks_the_first_ipv4_mapped_roce_v2_entry_and_the_variable_overrides_it() {
    let Some(dev) = common::device() else { return };
    let link_layer =
        std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/link_layer")).unwrap_or_default();
    if link_layer.trim() != "Ethernet" {
        eprintln!("skipped: {dev} is not RoCE (link layer {link_layer:?}); the rule checked here is RoCE's");
        return;
    }
    let table: Vec<(u32, String, Option<String>)> = (0..256)
        .filter_map(|i| sysfs_gid(&dev, i).map(|g| (i, g, sysfs_gid_type(&dev, i))))
        .filter(|(_, g, _)| g.chars().any(|c| c != '0'))
        .collect();
    for (i, g, t) in &table {
        eprintln!("{dev} GID {i}: {g} ({})", t.as_deref().unwrap_or("no type"));
    }
    let mapped = |g: &str| g.starts_with("00000000000000000000ffff");
    let expected = table
        .iter()
        .find(|(_, g, t)| t.as_deref() == Some("RoCE v2") && mapped(g))
        .expect("rxe on an IPv4 interface has an IPv4-mapped RoCE v2 GID");
    let rt = runtime();
    rt.block_on(async {
        let t = te_transport_rdma::install(&context(&dev, "gid-rule", &[]))
            .await
            .unwrap();
        assert_eq!(
            gid_sent_from(&t.endpoint()),
            expected.1,
            "the automatic choice, index {}",
            expected.0
        );
        t.shutdown().await;
        // Any other non-empty entry, forced.
        if let Some(other) = table.iter().find(|(i, _, _)| *i != expected.0) {
            let index = other.0.to_string();
            let t = te_transport_rdma::install(&context(&dev, "gid-rule", &[("TE_RDMA_GID_INDEX", &index)]))
                .await
                .unwrap();
            assert_eq!(gid_sent_from(&t.endpoint()), other.1, "TE_RDMA_GID_INDEX={index}");
            t.shutdown().await;
        }
        // An empty entry is refused by name.
        let empty = (0..255u32)
            .find(|i| sysfs_gid(&dev, *i).is_none_or(|g| g.chars().all(|c| c == '0')))
            .unwrap();
        let Err(err) =
            te_transport_rdma::install(&context(&dev, "gid-rule", &[("TE_RDMA_GID_INDEX", &empty.to_string())])).await
        else {
            panic!("GID {empty} of {dev} is empty, yet the transport sends from it");
        };
        assert!(err.to_string().contains("TE_RDMA_GID_INDEX"), "{err}");
        eprintln!(
            "{dev}: automatic GID index {} as the rule says; forcing and refusing checked",
            expected.0
        );
    });
}
