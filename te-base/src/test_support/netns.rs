//! Network namespaces joined by veth pairs to a bridge: separate "hosts" on one machine.
//!
//! Layout (every name and address lives inside namespaces this harness creates; the machine's own
//! network is not touched):
//! ```text
//!   ns <tag>-h0: eth0 10.213.0.1/24 ─┐
//!   ns <tag>-h1: eth0 10.213.0.2/24 ─┼─ ns <tag>-br: bridge br0 10.213.0.254/24
//!   ns <tag>-h2: eth0 10.213.0.3/24 ─┘
//! ```
//! The namespaces are removed on drop, also when the test fails.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Subnet of every harness network (private to its namespaces).
pub const SUBNET: &str = "10.213.0";

/// A set of namespaces joined by a bridge.
pub struct Network {
    tag: String,
    hosts: usize,
    created: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
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

impl Network {
    /// Creates `hosts` namespaces and the bridge namespace. `Err` says why it could not (no root,
    /// no `ip`, no netns support); the caller decides whether that skips or fails.
    pub fn create(hosts: usize) -> Result<Network, String> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let tag = format!("te{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
        let mut net = Network {
            tag,
            hosts,
            created: Vec::new(),
        };
        net.build()?;
        Ok(net)
    }

    fn add_ns(&mut self, name: String) -> Result<(), String> {
        ip(&["netns", "add", &name])?;
        self.created.push(name.clone());
        ip(&["-n", &name, "link", "set", "lo", "up"])
    }

    fn build(&mut self) -> Result<(), String> {
        let br = self.bridge_ns();
        self.add_ns(br.clone())?;
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        ip(&[
            "-n",
            &br,
            "addr",
            "add",
            &format!("{}/24", self.bridge_ip()),
            "dev",
            "br0",
        ])?;
        ip(&["-n", &br, "link", "set", "br0", "up"])?;
        for h in 0..self.hosts {
            let ns = self.host_ns(h);
            self.add_ns(ns.clone())?;
            let port = format!("v{h}");
            ip(&[
                "-n", &br, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["-n", &br, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &br, "link", "set", &port, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", self.host_ip(h)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        Ok(())
    }

    /// Name of the namespace of host `h`.
    pub fn host_ns(&self, h: usize) -> String {
        format!("{}-h{h}", self.tag)
    }

    /// Name of the bridge's namespace (where shared services such as etcd run).
    pub fn bridge_ns(&self) -> String {
        format!("{}-br", self.tag)
    }

    /// Address of host `h`.
    pub fn host_ip(&self, h: usize) -> String {
        format!("{SUBNET}.{}", h + 1)
    }

    /// Address of the bridge.
    pub fn bridge_ip(&self) -> String {
        format!("{SUBNET}.254")
    }

    /// A command that runs `program` inside namespace `ns`.
    pub fn command_in(ns: &str, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, program]);
        c
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for ns in self.created.drain(..).rev() {
            if let Err(e) = ip(&["netns", "del", &ns]) {
                eprintln!("netns cleanup: {e}");
            }
        }
    }
}

/// Creates a network, or returns `None` after printing why (panics instead when `TE_REQUIRE`
/// names netns).
pub fn network_or_skip(hosts: usize) -> Option<Network> {
    match Network::create(hosts) {
        Ok(n) => Some(n),
        Err(e) => {
            super::skip_or_fail("netns", &format!("{e} (needs root and iproute2)"));
            None
        }
    }
}
