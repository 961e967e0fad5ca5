//! Crash safety: a child process putting objects is killed with SIGKILL mid-stream; the store
//! reopened on the same directories returns every put that reported Ok, intact, and never
//! returns corrupt bytes (a torn tail is dropped at open).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use umbp::StoreError;

const CHILD_VAR: &str = "UMBP_TEST_CRASH_CHILD_DIR";
const FLUSH_CHILD_VAR: &str = "UMBP_TEST_CRASH_FLUSH_CHILD_DIR";

/// Runs the child test `name` on `dir` (passed in `var`), handing each line it prints to
/// `on_line` until that returns true; then SIGKILLs it while it keeps putting, and hands
/// `on_line` what the child printed before it died but was not read yet.
fn run_then_kill(name: &str, var: &str, dir: &Path, mut on_line: impl FnMut(&str) -> bool) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(var, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while !on_line(&lines.next().expect("child ended early").unwrap()) {}
    child.kill().unwrap();
    child.wait().unwrap();
    for line in lines.map_while(|l| l.ok()) {
        on_line(&line);
    }
}

fn len_of(i: u32) -> u64 {
    // Sizes from under a block to several blocks, not block multiples.
    1000 + (i as u64 * 7919) % 60_000
}

/// The child's body: put objects forever, printing each key that returned Ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_VAR) else { return };
    let store = with_ssd(0, Path::new(&dir)).open().await.unwrap();
    let mut buf = Buf::new(&store, 64 << 10).await;
    let mut out = std::io::stdout().lock();
    for i in 0u32.. {
        let key = format!("obj-{i}");
        let len = len_of(i);
        put_layers(&store, &mut buf, &key, i, 1, len, 0).unwrap();
        writeln!(out, "ok {i}").unwrap();
        out.flush().unwrap();
    }
}

/// The child of the flush test: puts into a small DRAM tier over SSD (most objects only in DRAM),
/// calling `flush` every 25 puts and printing the last put it covered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_flush_child() {
    let Ok(dir) = std::env::var(FLUSH_CHILD_VAR) else {
        return;
    };
    let store = with_ssd(4 << 20, Path::new(&dir)).open().await.unwrap();
    let mut buf = Buf::new(&store, 64 << 10).await;
    let mut out = std::io::stdout().lock();
    for i in 0u32.. {
        put_layers(&store, &mut buf, &format!("obj-{i}"), i, 1, len_of(i), 0).unwrap();
        if i % 25 == 24 {
            store.flush().unwrap();
            writeln!(out, "flushed {i}").unwrap();
            out.flush().unwrap();
        }
    }
}

/// Killed after flushes with a DRAM tier: every put before the last flush that reported is on
/// disk, intact; later puts are intact or absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_makes_dram_puts_durable() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let mut flushed = 0u32;
    run_then_kill("crash_flush_child", FLUSH_CHILD_VAR, dir.path(), |line| {
        if let Some(i) = line.strip_prefix("flushed ") {
            flushed = flushed.max(i.parse().unwrap());
        }
        flushed >= 200
    });
    let store = with_ssd(0, dir.path()).open().await.unwrap();
    let mut buf = Buf::new(&store, 64 << 10).await;
    for i in 0..=flushed {
        let got = get_layers(&store, &mut buf, &format!("obj-{i}"), i, 0, 1, len_of(i));
        assert_eq!(got.unwrap(), len_of(i), "flushed put obj-{i} lost");
    }
    for i in flushed + 1..flushed + 50 {
        match get_layers(&store, &mut buf, &format!("obj-{i}"), i, 0, 1, len_of(i)) {
            Ok(n) => assert_eq!(n, len_of(i)),
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => panic!("obj-{i}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_puts_keeps_every_acknowledged_put() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let mut acked = Vec::new();
    run_then_kill("crash_child", CHILD_VAR, dir.path(), |line| {
        if let Some(i) = line.strip_prefix("ok ") {
            acked.push(i.parse::<u32>().unwrap());
        }
        acked.len() >= 300
    });
    // Also tear the tail by hand, as a power cut in the middle of a record would.
    let seg = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
        let end = f.metadata().unwrap().len();
        let mut torn = vec![0u8; 3 * 4096];
        torn[..8].copy_from_slice(b"UMBPREC\x01");
        f.write_all_at(&torn, end).unwrap();
    }

    let store = with_ssd(0, dir.path()).open().await.unwrap();
    assert!(store.stats().unwrap().core.ssd_torn_dropped >= 1);
    let mut buf = Buf::new(&store, 64 << 10).await;
    let last = *acked.iter().max().unwrap();
    for &i in &acked {
        let got = get_layers(&store, &mut buf, &format!("obj-{i}"), i, 0, 1, len_of(i));
        assert_eq!(got.unwrap(), len_of(i), "acknowledged put obj-{i} lost");
    }
    // Puts in flight at the kill are either whole or absent, never corrupt.
    for i in last + 1..last + 50 {
        match get_layers(&store, &mut buf, &format!("obj-{i}"), i, 0, 1, len_of(i)) {
            Ok(n) => assert_eq!(n, len_of(i)),
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => panic!("obj-{i}: {e}"),
        }
    }
}
