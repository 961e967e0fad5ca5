//! A `te-efa-peer serve` child process: the target of multi-process tests.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

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
        let exe = env!("CARGO_BIN_EXE_te-efa-peer");
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .args(["serve", &bytes.to_string(), &seed.to_string()])
            .env("TE_FABRIC_PROVIDER", provider)
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

    /// Kills the process at once (SIGKILL).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "exit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}
