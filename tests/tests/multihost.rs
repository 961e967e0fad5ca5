//! Three engines in three network namespaces (separate processes, separate network stacks, joined
//! by veth pairs to a bridge) find each other through etcd (listening on the bridge address) and
//! through peer-to-peer metadata, move data in every direction (verified byte for byte on both
//! sides), then survive one of them being killed mid-transfer and restarted: the initiator's
//! outstanding requests fail with the peer named, everyone reconnects to the new instance.
//!
//! Needs root and iproute2 (skips otherwise; fails when TE_REQUIRE names netns), and for the etcd
//! variant Debian's etcd-server (TE_REQUIRE=etcd makes its absence a failure).

use std::process::Command;

use te_tests::etcd::EtcdServer;
use te_tests::netns::{network_or_skip, Network};
use te_tests::node::Node;
use te_tests::skip_or_fail;

const HOSTS: usize = 3;
const SLOT: u64 = 1 << 20;
const P2P_PORT: u16 = 7000;

#[derive(Clone, Copy, PartialEq)]
enum Meta {
    P2p,
    Etcd,
}

struct Cluster<'a> {
    net: &'a Network,
    meta: Meta,
    etcd: Option<String>,
}

impl Cluster<'_> {
    fn command(&self, h: usize) -> Command {
        let mut c = Network::command_in(&self.net.host_ns(h), env!("CARGO_BIN_EXE_te-node"));
        c.args(["--name", &format!("node-{h}"), "--ip", &self.net.host_ip(h)])
            .args(["--p2p-port", &P2P_PORT.to_string(), "--slot-bytes", &SLOT.to_string()])
            .args(["--slots", &HOSTS.to_string()]);
        match self.meta {
            Meta::P2p => {
                c.args(["--metadata", "p2p"]);
            }
            Meta::Etcd => {
                c.args(["--metadata", "etcd", "--etcd", self.etcd.as_deref().unwrap_or_default()]);
            }
        }
        c
    }

    fn start(&self, h: usize) -> Node {
        Node::start(self.command(h)).unwrap_or_else(|e| panic!("node-{h}: {e}"))
    }

    /// How node `from` names node `to`: its segment name (etcd) or its p2p address.
    fn peer(&self, to: usize) -> String {
        match self.meta {
            Meta::Etcd => format!("node-{to}"),
            Meta::P2p => format!("{}:{P2P_PORT}", self.net.host_ip(to)),
        }
    }
}

fn seed(from: usize, to: usize, round: u64) -> u64 {
    (round << 16) | ((from as u64) << 8) | to as u64
}

/// Every node writes its slot on every other node, checks it by reading back, the target checks
/// its own memory, and a third read pulls it again.
fn all_directions(c: &Cluster, nodes: &mut [Node], round: u64) {
    for from in 0..HOSTS {
        for to in 0..HOSTS {
            if from == to {
                continue;
            }
            let (s, peer) = (seed(from, to, round), c.peer(to));
            nodes[from].ok(&format!("push {peer} {from} {s}"));
            nodes[to].ok(&format!("check {from} {s}"));
            let other = (0..HOSTS).find(|&o| o != from && o != to).unwrap_or(from);
            nodes[other].ok(&format!("pull {peer} {from} {s}"));
        }
    }
}

fn scenario(meta: Meta) {
    let Some(net) = network_or_skip(HOSTS) else { return };
    let _etcd = match meta {
        Meta::P2p => None,
        Meta::Etcd => match EtcdServer::start(&net.bridge_ns(), &net.bridge_ip()) {
            Ok(e) => Some(e),
            Err(e) => {
                skip_or_fail("etcd", &e);
                return;
            }
        },
    };
    let cluster = Cluster {
        net: &net,
        meta,
        etcd: _etcd.as_ref().map(|e| e.endpoint.clone()),
    };
    let mut nodes: Vec<Node> = (0..HOSTS).map(|h| cluster.start(h)).collect();
    all_directions(&cluster, &mut nodes, 1);

    // Node 2 freezes (SIGSTOP) so node 0's large batch to it cannot finish, then dies (SIGKILL).
    let victim = cluster.peer(2);
    nodes[0].ok(&format!("open {victim}"));
    nodes[2].signal("STOP");
    nodes[0].ok(&format!("flood {victim} 256"));
    let dead = nodes.remove(2);
    dead.signal("KILL");
    dead.kill();
    let answer = nodes[0].cmd("wait").unwrap();
    assert!(
        answer.starts_with("ERR"),
        "the flood to a killed peer must fail: {answer}"
    );
    assert!(answer.contains("node-2") && answer.contains("went away"), "{answer}");

    // The others keep serving each other meanwhile.
    let p1 = cluster.peer(1);
    nodes[0].ok(&format!("push {p1} 0 {}", seed(0, 1, 2)));
    nodes[1].ok(&format!("check 0 {}", seed(0, 1, 2)));

    // Node 2 restarts (new instance, new TCP port; same name and p2p address), and everybody
    // reconnects to it.
    nodes.push(cluster.start(2));
    all_directions(&cluster, &mut nodes, 3);
}

#[test]
fn three_hosts_over_p2p_metadata() {
    scenario(Meta::P2p);
}

#[test]
fn three_hosts_over_etcd() {
    scenario(Meta::Etcd);
}

/// A notified write crossing network namespaces (tcp): node 1 waits for notifications while
/// node 0 pipelines notified writes into its slot; each must find its data in place, in order.
/// Then node 1's inbox is full and node 0 gets the typed refusal across the namespaces.
#[test]
fn notifications_cross_namespaces() {
    let Some(net) = network_or_skip(2) else { return };
    let cluster = Cluster {
        net: &net,
        meta: Meta::P2p,
        etcd: None,
    };
    let mut n0 = cluster.start(0);
    let mut n1 = cluster.start(1);
    let recv = "nrecv 0 51 32 node-0 1";
    n1.send(recv).unwrap();
    n0.ok(&format!("npush {} 0 51 32", cluster.peer(1)));
    n1.expect_ok(recv);
    let answer = n0.ok(&format!("nbare {} 1025", cluster.peer(1)));
    assert!(
        answer.starts_with("OK accepted=1024 refused=NotificationQueueFull"),
        "{answer}"
    );
    n1.ok("ntake 1024 node-0");
}
