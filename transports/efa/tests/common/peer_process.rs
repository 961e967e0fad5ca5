//! A `te-efa-peer serve` child process: the target of multi-process tests.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use te_base::SegmentDescriptor;

/// A running target process exporting one pattern-filled buffer.
pub struct PeerProcess {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub descriptor: SegmentDescriptor,
    pub descriptor_json: String,
}

impl PeerProcess {
    /// Starts `te-efa-peer serve bytes seed` with `provider`, optionally under a command prefix
    /// (e.g. `ip netns exec NS`).
    pub fn start(provider: &str, bytes: u64, seed: u64, prefix: &[&str]) -> PeerProcess {
        let mut cmd = peer_command(prefix);
        fabric_env(&mut cmd, provider);
        let mut child = cmd
            .args(["serve", &bytes.to_string(), &seed.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start te-efa-peer");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(
            !line.trim().is_empty(),
            "te-efa-peer exited before publishing its descriptor"
        );
        let descriptor = SegmentDescriptor::from_json(line.trim().as_bytes()).expect("peer descriptor");
        PeerProcess {
            child,
            stdin,
            stdout,
            descriptor,
            descriptor_json: line,
        }
    }

    /// The exported buffer's address.
    pub fn base(&self) -> u64 {
        self.descriptor.buffers[0].base
    }

    fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    /// Bytes of `[off, off+len)` that differ from pattern `seed` in the target's memory.
    pub fn mismatched(&mut self, off: u64, len: u64, seed: u64) -> u64 {
        let reply = self.ask(&format!("check {off} {len} {seed}"));
        reply
            .strip_prefix("mismatched ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected reply {reply:?}"))
    }

    /// Bytes of `[off, off+len)` that match neither pattern `a` nor pattern `b`.
    pub fn foreign(&mut self, off: u64, len: u64, a: u64, b: u64) -> u64 {
        let reply = self.ask(&format!("foreign {off} {len} {a} {b}"));
        reply
            .strip_prefix("foreign ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected reply {reply:?}"))
    }

    /// The target's report on its next received notification (`none` after `timeout_ms`).
    pub fn next_note(&mut self, timeout_ms: u64) -> String {
        self.ask(&format!("note {timeout_ms}"))
    }

    /// Kills the process at once (SIGKILL).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Freezes the process with SIGSTOP and returns once the kernel reports it stopped, which it
    /// does only when every thread has stopped (the signal is delivered asynchronously: a rail
    /// thread running when it is sent could still complete a write). Panics after 10 s.
    pub fn freeze(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: signalling our own child, not yet reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let mut status = 0;
            // SAFETY: waitpid on our own child; WUNTRACED reports a stop without reaping it.
            let rc = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED | libc::WNOHANG) };
            if rc == pid && libc::WIFSTOPPED(status) {
                return;
            }
            assert_eq!(rc, 0, "te-efa-peer {pid}: waitpid status {status:#x} instead of a stop");
            assert!(Instant::now() < until, "te-efa-peer {pid} did not stop within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for PeerProcess {
    /// Asks the process to exit and waits at most 10 s, then kills it: a test that failed while
    /// the peer was frozen must fail, not hang here. A frozen peer is resumed first.
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return; // already reaped
        }
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGCONT) };
        let _ = writeln!(self.stdin, "exit");
        let _ = self.stdin.flush();
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `te-efa-peer client-notify` (under `prefix`, e.g. `ip netns exec NS`) against `target`:
/// `count` notified writes of pattern `seed` over its first `bytes`. Then checks that the target
/// received each notification from the client, in the order the client handed them over (its
/// batches' completion order), with every byte of its slice in place at delivery, and nothing
/// more.
pub fn check_notified_writes(target: &mut PeerProcess, provider: &str, prefix: &[&str], bytes: u64, count: u64) {
    let seed = 9;
    let args = [
        "client-notify",
        &bytes.to_string(),
        &seed.to_string(),
        &count.to_string(),
    ];
    let stdout = run_initiator(target, provider, prefix, &args.map(String::from));
    let (from, order) = stdout
        .trim()
        .strip_prefix(&format!("notified {count} from "))
        .and_then(|rest| rest.split_once(" order "))
        .unwrap_or_else(|| panic!("{provider}: initiator said {stdout:?}"));
    let order: Vec<u64> = order.split(',').map(|k| k.parse().expect("slice number")).collect();
    assert_eq!(order.len() as u64, count, "{provider}: {stdout}");
    let slice = bytes / count;
    // In the order the batches completed (and their notifications were handed over).
    for (i, k) in order.iter().enumerate() {
        assert_eq!(
            target.next_note(10_000),
            format!("note {from} mismatched_at_delivery 0 {} {slice} {seed}", k * slice),
            "{provider}: notification {i} (slice {k}): in order, from the initiator, after its data"
        );
    }
    assert_eq!(target.next_note(100), "none", "{provider}: one notification per batch");
    assert_eq!(target.mismatched(0, slice * count, seed), 0, "{provider}: data");
}

/// Gives a peer process of `provider` the `TE_FABRIC_*` variables an install in this process
/// gets ([`super::install_env`]); the environment's others, which describe another provider's
/// run, are removed from what the child inherits.
pub fn fabric_env(cmd: &mut Command, provider: &str) {
    let env = super::install_env(provider, &[]).0;
    for (k, _) in std::env::vars() {
        if k.starts_with("TE_FABRIC_") && !env.contains_key(&k) {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env);
}

/// `te-efa-peer`, under a command prefix (e.g. `ip netns exec NS`) when one is given.
pub fn peer_command(prefix: &[&str]) -> Command {
    let exe = env!("CARGO_BIN_EXE_te-efa-peer");
    match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(exe);
            c
        }
        None => Command::new(exe),
    }
}

/// Runs an initiator subcommand of `te-efa-peer` (under `prefix`) with `target`'s descriptor on
/// its stdin; asserts it succeeded and returns its stdout.
pub fn run_initiator(target: &PeerProcess, provider: &str, prefix: &[&str], args: &[String]) -> String {
    let mut cmd = peer_command(prefix);
    fabric_env(&mut cmd, provider);
    let mut client = cmd
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the initiator");
    client
        .stdin
        .take()
        .unwrap()
        .write_all(target.descriptor_json.as_bytes())
        .unwrap();
    let out = client.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{provider}: initiator {args:?} failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
