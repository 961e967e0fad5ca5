//! Kill to error, the whole engine: the target (this program, `target` mode, in a child process)
//! holds BYTES of touched anonymous memory (cross-memory attach, as a registered numpy buffer
//! is); the initiator writes it in 1 MiB requests, SIGKILLs the target once an eighth of the
//! batch landed, and times how long the batch takes to return its error. One JSON line per round.
//!
//! `kill_to_error [ROUNDS] [BYTES] [TRANSPORTS] [PAGES]` (defaults 1, 1 GiB, `shm,tcp`, `thp`:
//! both buffers ask for transparent huge pages, as numpy does for large arrays; `4k`: ordinary
//! pages, whose teardown after the kill takes far longer). `scripts/shm_kill_ab.sh` alternates
//! two builds of it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::config::MapEnv;
use te_core::{Error, HostBacking, HostBufferOptions, HugePages, RequestStatus, TransferEngine, TransferRequest};

const BLOCK: u64 = 1 << 20;

fn anonymous(pages: &str) -> HostBufferOptions {
    HostBufferOptions {
        backing: HostBacking::Anonymous,
        huge_pages: match pages {
            "thp" => HugePages::Transparent,
            "4k" => HugePages::None,
            other => panic!("PAGES: thp or 4k, not {other:?}"),
        },
        ..Default::default()
    }
}

async fn engine(name: &str, p2p: &str, transports: &str) -> TransferEngine {
    let env = MapEnv::new([
        ("TE_METADATA", "p2p"),
        ("TE_P2P_LISTEN", p2p),
        ("TE_TCP_LISTEN", "127.0.0.1:0"),
        ("TE_TCP_ADVERTISE", "127.0.0.1"),
    ]);
    TransferEngine::builder()
        .segment_name(name)
        .env(Arc::new(env))
        .transports(transports.split(','))
        .build()
        .await
        .expect("engine")
}

/// Fills `reg` with `byte`, 1 MiB at a time (every page touched).
fn fill(reg: &te_core::Registration, byte: u8) {
    let chunk = vec![byte; BLOCK as usize];
    let mut off = 0;
    while off < reg.len() {
        let n = (reg.len() - off).min(BLOCK) as usize;
        reg.write_at(off, &chunk[..n]).expect("fill");
        off += n as u64;
    }
}

/// The target: `name@127.0.0.1:port` (a fresh name and port unless given: a restart).
async fn target(bytes: usize, transports: &str, pages: &str, at: Option<(&str, u16)>) {
    let (name, port) = match at {
        Some((name, port)) => (name.to_string(), port),
        None => (
            format!("kill-target-{}", std::process::id()),
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port(),
        ),
    };
    let e = engine(&name, &format!("127.0.0.1:{port}"), transports).await;
    let buf = e.allocate(bytes, anonymous(pages)).await.expect("allocate");
    fill(&buf, 1);
    println!("{name}@127.0.0.1:{port} {}", buf.addr());
    std::io::stdout().flush().unwrap();
    // Until the initiator kills us (or closes our stdin).
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(buf);
}

/// Starts a target process; returns it with its segment and buffer address.
fn start_target(bytes: u64, transports: &str, pages: &str, at: &[&str]) -> (std::process::Child, String, u64) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["target", &bytes.to_string(), transports, pages])
        .args(at)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the target");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let (segment, addr) = line.trim().split_once(' ').expect("segment and address");
    (child, segment.to_string(), addr.parse().unwrap())
}

async fn round(round: u32, bytes: u64, transports: &str, pages: &str) {
    let (mut child, segment, addr) = start_target(bytes, transports, pages, &[]);
    let name = format!("kill-initiator-{}-{round}", std::process::id());
    let e = engine(&name, "127.0.0.1:0", transports).await;
    let src = e.allocate(bytes as usize, anonymous(pages)).await.unwrap();
    fill(&src, 7);
    let seg = e.open_segment(&segment).await.unwrap();
    // The connection exists before the big batch.
    e.transfer(&[TransferRequest::write(src.addr(), seg.id(), addr, 4096)])
        .await
        .unwrap();
    let route = e.routes(&seg).unwrap().first().map(|r| r.transport).unwrap_or("?");
    let n = bytes / BLOCK;
    let reqs: Vec<TransferRequest> = (0..n)
        .map(|i| TransferRequest::write(src.addr() + i * BLOCK, seg.id(), addr + i * BLOCK, BLOCK))
        .collect();
    let batch = e.submit(&reqs).unwrap();
    let guard = Instant::now() + Duration::from_secs(60);
    while batch.poll().done < (n / 8) as usize && !batch.is_complete() && Instant::now() < guard {
        std::thread::yield_now();
    }
    let done_at_kill = batch.poll().done;
    let killed = Instant::now();
    child.kill().unwrap();
    let reaper = std::thread::spawn(move || {
        child.wait().unwrap();
        Instant::now()
    });
    let out = batch.wait_blocking(Some(Duration::from_secs(60)));
    let returned = Instant::now();
    let reaped = reaper.join().unwrap();
    let (outcome, message) = match out {
        None => ("no return within 60 s".to_string(), String::new()),
        Some(Ok(_)) => ("success".to_string(), String::new()),
        Some(Err(err)) => {
            let first = (0..n as usize).find_map(|i| match batch.status(i) {
                Some(RequestStatus::Failed(e)) => Some(e),
                _ => None,
            });
            let kind = match &first {
                Some(Error::PeerGone { .. }) => "PeerGone",
                Some(_) => "other",
                None => "none",
            };
            (format!("error ({kind})"), err.to_string().chars().take(300).collect())
        }
    };
    // The target restarted at the same address, and 64 MiB to it through the same handle.
    let (name, port) = segment.split_once("@127.0.0.1:").unwrap();
    let (mut again, _, addr) = start_target(64 << 20, transports, pages, &[name, port]);
    // As long as the Python harness's restart takes (an interpreter and an engine started).
    tokio::time::sleep(Duration::from_millis(400)).await;
    let t0 = Instant::now();
    let write = |seg: te_core::SegmentId| {
        let req = TransferRequest::write(src.addr(), seg, addr, 64 << 20);
        let e = e.clone();
        async move {
            match tokio::time::timeout(Duration::from_secs(60), e.transfer(&[req])).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(err)) => Err(err.to_string().chars().take(160).collect::<String>()),
                Err(_) => Err("no return within 60 s".to_string()),
            }
        }
    };
    // The same handle (its descriptor may still name the old buffers), else the segment opened
    // again, as the Python harness tries them.
    let next = match write(seg.id()).await {
        Ok(()) => "ok (same handle)".to_string(),
        Err(first) => match e.open_segment(&segment).await {
            Ok(s) => match write(s.id()).await {
                Ok(()) => format!("ok after open_segment (same handle: {first})"),
                Err(err) => format!("same handle: {first}; after open_segment: {err}"),
            },
            Err(err) => format!("same handle: {first}; open_segment: {err}"),
        },
    };
    let next_ms = t0.elapsed().as_secs_f64() * 1e3;
    let _ = again.kill();
    let _ = again.wait();
    println!(
        "{{\"round\":{round},\"transports\":\"{transports}\",\"pages\":\"{pages}\",\"route\":\"{route}\",\"bytes\":{bytes},\"done_at_kill\":{done_at_kill},\"outcome\":\"{outcome}\",\"kill_to_error_s\":{:.6},\"kill_to_reaped_s\":{:.6},\"message\":{:?},\"next_transfer\":{next:?},\"next_ms\":{next_ms:.1}}}",
        (returned - killed).as_secs_f64(),
        (reaped - killed).as_secs_f64(),
        message
    );
    let _ = e.shutdown().await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("target") {
        let at = args.get(4).map(|name| (name.as_str(), args[5].parse().unwrap()));
        return target(args[1].parse().unwrap(), &args[2], &args[3], at).await;
    }
    let rounds: u32 = args.first().map_or(1, |s| s.parse().unwrap());
    let bytes: u64 = args.get(1).map_or(1 << 30, |s| s.parse().unwrap());
    let transports = args.get(2).map_or("shm,tcp", String::as_str);
    let pages = args.get(3).map_or("thp", String::as_str);
    for r in 0..rounds {
        round(r, bytes, transports, pages).await;
    }
}
