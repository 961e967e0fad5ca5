//! Two network namespaces joined by a veth pair, one engine (process) in each, tcp provider:
//! writes and reads over the veth verified byte for byte. The harness creates and removes the
//! namespaces; it needs root and iproute2 (skips with a message otherwise, fails when TE_REQUIRE
//! contains `netns`).

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::peer_process::PeerProcess;
use common::*;

const PROVIDER: &str = "tcp;ofi_rxm";

/// Two namespaces and a veth pair; removed on drop.
struct Namespaces {
    a: String,
    b: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Namespaces {
    fn create() -> Result<Namespaces, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not running as root".into());
        }
        let id = std::process::id() % 100_000;
        let ns = Namespaces {
            a: format!("te-efa-a{id}"),
            b: format!("te-efa-b{id}"),
        };
        let (va, vb) = (format!("tea{id}"), format!("teb{id}"));
        let subnet = format!("10.{}.{}", 200 + (id % 50), (id / 50) % 250);
        let (a, b) = (ns.a.as_str(), ns.b.as_str());
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", a])?;
        ip(&["link", "set", &vb, "netns", b])?;
        ip(&["-n", a, "addr", "add", &format!("{subnet}.1/24"), "dev", &va])?;
        ip(&["-n", b, "addr", "add", &format!("{subnet}.2/24"), "dev", &vb])?;
        for (n, v) in [(a, &va), (b, &vb)] {
            ip(&["-n", n, "link", "set", "lo", "up"])?;
            ip(&["-n", n, "link", "set", v, "up"])?;
        }
        Ok(ns)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        // Deleting a namespace removes the veth end inside it (and so the pair).
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

#[test]
fn engines_in_two_namespaces_move_data_over_veth() {
    if !provider_present(PROVIDER) {
        return;
    }
    let ns = match Namespaces::create() {
        Ok(ns) => ns,
        Err(e) => {
            if required("netns") {
                panic!("TE_REQUIRE contains netns but network namespaces are unavailable: {e}");
            }
            eprintln!("SKIP: network namespaces unavailable: {e}");
            return;
        }
    };
    let len = 64u64 << 20;
    let mut target = PeerProcess::start(PROVIDER, len, 1, &["ip", "netns", "exec", &ns.b]);
    // The target's only rail is its veth (loopback domains are left out when another exists).
    let rails = &target.descriptor.transports[0].info["rails"];
    assert_eq!(rails.as_array().map(Vec::len), Some(1), "{rails}");
    assert!(rails[0]["domain"].as_str().unwrap().starts_with("teb"), "{rails}");

    // The initiator runs in the other namespace: it writes pattern 5 over the whole buffer in
    // 1 MiB requests, reads it back into zeroed memory and reports mismatches.
    let exe = env!("CARGO_BIN_EXE_te-efa-peer");
    let mut client = Command::new("ip")
        .args(["netns", "exec", &ns.a, exe, "client", &len.to_string(), "5"])
        .env("TE_FABRIC_PROVIDER", PROVIDER)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the initiator in namespace a");
    client
        .stdin
        .take()
        .unwrap()
        .write_all(target.descriptor_json.as_bytes())
        .unwrap();
    let out = client.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "initiator failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.trim(), "read_mismatched 0", "bytes read back over the veth");
    assert_eq!(target.mismatched(0, len, 5), 0, "bytes written over the veth");
}
