//! Crash safety while the SSD log compacts: a child process puts and removes objects over a small
//! key space with small segments (so the background compactor rewrites records all the time) and
//! is SIGKILLed after a random number of acknowledged operations. The parent reopens the same
//! directory and checks every key against the acknowledged history, then starts the next child on
//! the same directory: losses that show only after a later round (a record rewritten by one
//! round's compaction and lost in the next) are caught too.
//!
//! Run for SSD-only and DRAM+SSD write-through, io_uring and psync, O_DIRECT on and off.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use umbp::{DirectIo, IoBackend, StoreBuilder, StoreError};

const CHILD_VAR: &str = "UMBP_TEST_COMPACTION_CRASH_CHILD";
const KEYS: u32 = 48;
const ROUNDS: u32 = 60;

/// One store configuration the test runs under.
#[derive(Clone, Copy, Debug)]
struct Mode {
    dram: u64,
    io: IoBackend,
    direct: DirectIo,
}

const MODES: [Mode; 4] = [
    Mode {
        dram: 0,
        io: IoBackend::Uring,
        direct: DirectIo::On,
    },
    Mode {
        dram: 0,
        io: IoBackend::Psync,
        direct: DirectIo::Off,
    },
    Mode {
        dram: 8 << 20,
        io: IoBackend::Psync,
        direct: DirectIo::On,
    },
    Mode {
        dram: 8 << 20,
        io: IoBackend::Uring,
        direct: DirectIo::Off,
    },
];

fn builder(mode: Mode, dir: &Path) -> StoreBuilder {
    // 64 KiB segments (the smallest allowed) hold a few records each, so overwrites and removes
    // leave sealed segments below the compaction threshold after a handful of operations.
    with_ssd(mode.dram, dir)
        .ssd_segment_bytes(64 << 10)
        .ssd_io(mode.io)
        .ssd_direct(mode.direct)
        .write_through(mode.dram > 0)
        .compact_below(0.5)
}

fn len_of(version: u32) -> u64 {
    // Under a block to several blocks, never a block multiple.
    700 + (version as u64 * 7919) % 20_000
}

/// The child: operations forever on keys `k0..k{KEYS}`, each announced before it starts
/// (`@b put KEY VERSION` / `@b rm KEY`) and confirmed once acknowledged (`@a`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_crash_child() {
    let Ok(spec) = std::env::var(CHILD_VAR) else { return };
    let mut parts = spec.splitn(3, ':');
    let mode: usize = parts.next().unwrap().parse().unwrap();
    let round: u32 = parts.next().unwrap().parse().unwrap();
    let dir = parts.next().unwrap();
    let store = builder(MODES[mode], Path::new(dir)).open().await.unwrap();
    let mut buf = Buf::new(&store, 64 << 10).await;
    let mut rng = fastrand::Rng::with_seed(0xC0FFEE ^ (round as u64) << 8 ^ mode as u64);
    let mut out = std::io::stdout().lock();
    for op in 0u32.. {
        let key = format!("k{}", rng.u32(0..KEYS));
        if rng.u32(0..4) == 0 {
            writeln!(out, "@b rm {key}").unwrap();
            out.flush().unwrap();
            store.remove(&key).unwrap();
        } else {
            let version = round * 1_000_000 + op;
            writeln!(out, "@b put {key} {version}").unwrap();
            out.flush().unwrap();
            put_layers(&store, &mut buf, &key, version, 1, len_of(version), 0).unwrap();
        }
        writeln!(out, "@a").unwrap();
        out.flush().unwrap();
    }
}

/// What a key holds: `None` when removed or never put.
type State = Option<u32>;

/// Runs one child for `acks` acknowledged operations, SIGKILLs it, and folds what it printed
/// into `acked`; returns the operation that had begun without being acknowledged, if any.
fn run_round(
    mode: usize,
    round: u32,
    dir: &Path,
    acks: u32,
    acked: &mut HashMap<String, State>,
) -> Option<(String, State)> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "compaction_crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, format!("{mode}:{round}:{}", dir.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut pending: Option<(String, State)> = None;
    let mut seen = 0u32;
    let mut fold = |line: &str, pending: &mut Option<(String, State)>| -> bool {
        // The harness may print on the same line before ours: read from the marker on.
        let Some(at) = line.find('@') else { return false };
        let words: Vec<&str> = line[at + 1..].split_whitespace().collect();
        match words.as_slice() {
            ["b", "put", key, v] => *pending = Some((key.to_string(), Some(v.parse().unwrap()))),
            ["b", "rm", key] => *pending = Some((key.to_string(), None)),
            ["a"] => {
                let (k, s) = pending.take().expect("an acknowledgement follows an announcement");
                acked.insert(k, s);
                return true;
            }
            _ => {} // the test harness's own lines
        }
        false
    };
    while seen < acks {
        let line = lines.next().expect("child ended early").unwrap();
        if fold(&line, &mut pending) {
            seen += 1;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    for line in lines.map_while(|l| l.ok()) {
        fold(&line, &mut pending);
    }
    pending
}

/// What `key` reads as after the reopen: the allowed version whose bytes it holds, or `None`
/// when absent. Holding anything else fails the test.
async fn read_state(store: &umbp::Store, key: &str, candidates: &[State]) -> State {
    let bytes = match store.get(key).await {
        Ok(b) => b,
        Err(StoreError::NotFound { .. }) => return None,
        Err(e) => panic!("{key}: unreadable: {e}"),
    };
    let held = candidates
        .iter()
        .flatten()
        .copied()
        .find(|&v| bytes == object(key, v, len_of(v)));
    assert!(
        held.is_some(),
        "{key}: holds {} bytes, none of the allowed states {candidates:?}",
        bytes.len()
    );
    held
}

async fn rounds_on_one_directory(mode: usize) {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let mut acked: HashMap<String, State> = HashMap::new();
    let mut rng = fastrand::Rng::with_seed(7 + mode as u64);
    let mut lost = Vec::new();
    for round in 1..=ROUNDS {
        let acks = rng.u32(40..400);
        let pending = run_round(mode, round, dir.path(), acks, &mut acked);
        let store = builder(MODES[mode], dir.path()).open().await.unwrap();
        for k in 0..KEYS {
            let key = format!("k{k}");
            let want = acked.get(&key).copied().flatten();
            let mut allowed = vec![want];
            if let Some((pk, ps)) = &pending {
                if *pk == key {
                    allowed.push(*ps);
                }
            }
            let got = read_state(&store, &key, &allowed).await;
            if !allowed.contains(&got) {
                lost.push(format!("round {round}: {key} reads {got:?}, acknowledged {want:?}"));
            }
            // The model follows what the reopened store holds (an unacknowledged op may have landed).
            acked.insert(key, got);
        }
        store.close().await.unwrap();
    }
    assert!(
        lost.is_empty(),
        "mode {:?}: acknowledged state lost:\n{}",
        MODES[mode],
        lost.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_crash_ssd_only_uring_direct() {
    rounds_on_one_directory(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_crash_ssd_only_psync_buffered() {
    rounds_on_one_directory(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_crash_write_through_psync_direct() {
    rounds_on_one_directory(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_crash_write_through_uring_buffered() {
    rounds_on_one_directory(3).await;
}
