//! Drives a `te-node` engine process: one command line in, one answer line out.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

/// How long any one command may take before the test fails (not a performance assertion: a
/// bound so a broken node fails the test instead of hanging it).
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// A running engine process.
pub struct Node {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    /// What `te-node` printed in its READY line: its p2p metadata address.
    pub p2p_addr: String,
}

impl Node {
    /// Starts `cmd` (a `te-node` invocation) and waits for its READY line.
    pub fn start(mut cmd: Command) -> Result<Node, String> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting {cmd:?}: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        let mut node = Node {
            child,
            stdin,
            lines,
            p2p_addr: String::new(),
        };
        let ready = node.answer()?;
        node.p2p_addr = ready
            .strip_prefix("READY ")
            .ok_or_else(|| format!("node did not start: {ready:?}"))?
            .to_string();
        Ok(node)
    }

    fn answer(&mut self) -> Result<String, String> {
        self.lines
            .recv_timeout(ANSWER_TIMEOUT)
            .map_err(|e| format!("no answer from the node: {e}"))
    }

    /// Sends one command and returns the answer line.
    pub fn cmd(&mut self, line: &str) -> Result<String, String> {
        let stdin = self.stdin.as_mut().ok_or("stdin closed")?;
        writeln!(stdin, "{line}").map_err(|e| format!("sending {line:?}: {e}"))?;
        stdin.flush().map_err(|e| e.to_string())?;
        self.answer()
    }

    /// Sends one command without waiting for its answer (take it with [`Node::expect_ok`]), so
    /// another node can act meanwhile.
    pub fn send(&mut self, line: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("stdin closed")?;
        writeln!(stdin, "{line}").map_err(|e| format!("sending {line:?}: {e}"))?;
        stdin.flush().map_err(|e| e.to_string())
    }

    /// Takes the answer of a command sent with [`Node::send`]; it must be `OK...`.
    pub fn expect_ok(&mut self, what: &str) -> String {
        match self.answer() {
            Ok(a) if a.starts_with("OK") => a,
            Ok(a) => panic!("{what:?} answered {a:?}"),
            Err(e) => panic!("{what:?}: {e}"),
        }
    }

    /// Sends a command that must answer `OK...`.
    pub fn ok(&mut self, line: &str) -> String {
        match self.cmd(line) {
            Ok(a) if a.starts_with("OK") => a,
            Ok(a) => panic!("{line:?} answered {a:?}"),
            Err(e) => panic!("{line:?}: {e}"),
        }
    }

    /// Process id (for signals).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (`STOP`, `KILL`, `CONT`) with kill(1).
    /// Sends `sig` (`STOP`, `CONT`, `KILL` or `TERM`) to the process, through the system call
    /// rather than a `kill` binary, which a minimal system (Debian's minbase: no procps) lacks.
    pub fn signal(&self, sig: &str) {
        use rustix::process::{kill_process, Pid, Signal};
        let signal = match sig {
            "STOP" => Signal::STOP,
            "CONT" => Signal::CONT,
            "KILL" => Signal::KILL,
            "TERM" => Signal::TERM,
            other => panic!("Node::signal: unknown signal {other:?}"),
        };
        let pid = Pid::from_raw(self.pid() as i32).expect("a child's pid is positive");
        kill_process(pid, signal).unwrap_or_else(|e| panic!("kill -{sig} {}: {e}", self.pid()));
    }

    /// Freezes the process with SIGSTOP and returns once every one of its threads is stopped
    /// (the signal is delivered asynchronously; a thread that is running when it is sent may
    /// still finish what it was doing). Panics if that takes longer than [`ANSWER_TIMEOUT`].
    pub fn freeze(&self) {
        self.signal("STOP");
        let tasks = format!("/proc/{}/task", self.pid());
        let until = std::time::Instant::now() + ANSWER_TIMEOUT;
        let stopped = || {
            std::fs::read_dir(&tasks).ok().is_some_and(|dir| {
                dir.flatten().all(|t| {
                    // The state follows the parenthesized command name in /proc/PID/task/TID/stat.
                    std::fs::read_to_string(t.path().join("stat"))
                        .ok()
                        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
                        .unwrap_or(false)
                })
            })
        };
        while !stopped() {
            assert!(std::time::Instant::now() < until, "node {} did not stop", self.pid());
            std::thread::yield_now();
        }
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
