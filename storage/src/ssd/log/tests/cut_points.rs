//! A crash at every cut point of compaction and of the open scan's clean-up: a child process
//! puts, replaces and removes keys, compacts, and SIGKILLs itself when the log reaches the chosen
//! [`Step`]; the parent reopens the directory and checks every acknowledged key (version and
//! bytes). Several rounds run on one directory, since a wrong mark left by one crash loses data
//! only after a later compaction.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicU32;

use super::*;

// Not a UMBP_ name: the config test holds every UMBP_ variable in the sources to known_vars().
const CHILD_VAR: &str = "TE_TEST_UMBP_CUT_POINT_CHILD";
const KEYS: usize = 12;
const LEN: usize = 8000;

fn index_of(step: Step) -> usize {
    Step::ALL
        .iter()
        .position(|&s| s == step)
        .expect("every step is in Step::ALL")
}

/// The child: opens the log with a hook that kills the process at the `nth` arrival at `step`,
/// then runs one round of puts, replacements, removes and a forced compaction, printing each
/// acknowledged operation (`@put KEY SEQ`, `@rm KEY`) and `@done` if it was not killed.
#[test]
fn cut_point_child() {
    let Ok(spec) = std::env::var(CHILD_VAR) else { return };
    let mut parts = spec.splitn(4, ':');
    let step = Step::ALL[parts.next().unwrap().parse::<usize>().unwrap()];
    let nth: u32 = parts.next().unwrap().parse().unwrap();
    let round: usize = parts.next().unwrap().parse().unwrap();
    let dir = PathBuf::from(parts.next().unwrap());
    let arrivals = Arc::new(AtomicU32::new(0));
    let mut o = opts(&[&dir], 64 << 20, 64 << 10);
    // No background compaction: the cut lands in the explicit compaction below (or the open),
    // after every put and remove of the round was acknowledged.
    o.compact_below = 0.0;
    o.step_hook = StepHook::new(move |s| {
        if s == step && arrivals.fetch_add(1, Ordering::SeqCst) + 1 == nth {
            // SAFETY: kill(2) on our own pid; no memory is involved.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
    });
    let log = SsdLog::open(o).unwrap();
    let mut out = std::io::stdout().lock();
    let mut ack = |line: String| {
        writeln!(out, "@{line}").unwrap();
        out.flush().unwrap();
    };
    // Every key (re)written, then every other key replaced and every third one removed, so each
    // sealed segment holds dead bytes.
    let all: Vec<usize> = (0..KEYS).collect();
    let replaced: Vec<usize> = (round % 2..KEYS).step_by(2).collect();
    for batch in [&all, &replaced] {
        for &k in batch {
            let key = format!("key-{k}");
            let seq = log.next_seq();
            append_one(&log, &key, seq, &pattern(&key, LEN, seq as u8)).unwrap();
            ack(format!("put {key} {seq}"));
        }
    }
    for k in (round % 3..KEYS).step_by(3) {
        let key = format!("key-{k}");
        log.remove(&key).unwrap();
        ack(format!("rm {key}"));
    }
    log.compact(true).unwrap();
    ack("done".into());
}

/// Runs one child round; returns the acknowledged operations folded into `model`, and whether
/// the child finished without reaching its cut point.
fn round(step: Step, nth: u32, round: usize, dir: &Path, model: &mut HashMap<String, Option<u64>>) -> bool {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--exact", "ssd::log::tests::cut_points::cut_point_child", "--nocapture"])
        .args(["--test-threads=1"])
        .env(CHILD_VAR, format!("{}:{nth}:{round}:{}", index_of(step), dir.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut done = false;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        let Some(at) = line.find('@') else { continue };
        let words: Vec<&str> = line[at + 1..].split_whitespace().collect();
        match words.as_slice() {
            ["put", key, seq] => {
                model.insert(key.to_string(), Some(seq.parse().unwrap()));
            }
            ["rm", key] => {
                model.insert(key.to_string(), None);
            }
            ["done"] => done = true,
            _ => {}
        }
    }
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert!(
        done || status.signal() == Some(libc::SIGKILL),
        "{step:?}: child neither finished nor was cut: {status:?}"
    );
    done
}

/// Reopens `dir` and checks every key of `model`: acknowledged version and bytes, or absent.
fn check(dir: &Path, model: &HashMap<String, Option<u64>>, context: &str) {
    let log = SsdLog::open(opts(&[dir], 64 << 20, 64 << 10)).unwrap();
    for (key, want) in model {
        let got = log.index().get(key.as_str()).map(|e| e.seq());
        assert_eq!(
            got, *want,
            "{context}: {key} has version {got:?}, acknowledged {want:?}"
        );
        if let Some(seq) = want {
            let bytes = read_all(&log, key).unwrap().unwrap();
            assert!(bytes == pattern(key, LEN, *seq as u8), "{context}: {key} bytes differ");
        }
    }
}

/// Each step in turn: rounds on one directory, killed at the first or second arrival there. The
/// open scan marks only what an earlier cut left (the surplus copies of a cut at
/// `CopiesWritten`), so its rounds follow such a cut with no checking open between.
#[test]
fn a_kill_at_any_step_of_compaction_loses_nothing() {
    for step in Step::ALL {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let mut model = HashMap::new();
        // (cut at, arrival, check after the round)
        let schedule: Vec<(Step, u32, bool)> = match step {
            Step::OpenMarked => vec![
                (Step::CopiesWritten, 1, false),
                (Step::OpenMarked, 1, true),
                (Step::CopiesWritten, 2, false),
                (Step::OpenMarked, 2, true),
                (Step::CopiesWritten, 1, false),
                (Step::OpenMarked, 1, true),
            ],
            s => vec![(s, 1, true), (s, 1, true), (s, 2, true), (s, 1, true), (s, 2, true)],
        };
        let mut cut = 0;
        for (r, &(at, nth, check_after)) in schedule.iter().enumerate() {
            let finished = round(at, nth, r, dir.path(), &mut model);
            if at == step && !finished {
                cut += 1;
            }
            if check_after {
                let context = format!("{step:?} round {r} (cut at {at:?} #{nth})");
                check(dir.path(), &model, &context);
            }
        }
        assert!(cut >= 2, "{step:?}: only {cut} rounds reached the cut point");
    }
}
