//! The live members as this peer last saw them (from the membership watch, `directory.rs`),
//! in the shape both key directories ask of it: by name, sorted for rendezvous weighing.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::rendezvous::Member;

/// The live members as this peer last saw them.
pub(crate) struct Membership {
    /// Members sorted by name.
    pub(crate) members: Vec<Member>,
    /// Name to control address and lease (a new lease is a new instance: a restart).
    peers: HashMap<Arc<str>, (SocketAddr, i64)>,
    /// When this view took effect.
    pub(crate) since: Instant,
}

impl Membership {
    pub(crate) fn new(peers: impl IntoIterator<Item = (Arc<str>, SocketAddr, i64)>) -> Membership {
        let peers: HashMap<Arc<str>, (SocketAddr, i64)> = peers.into_iter().map(|(n, a, l)| (n, (a, l))).collect();
        let mut members: Vec<Member> = peers.keys().map(|n| Member::new(n.clone())).collect();
        members.sort_by(|a, b| a.name.cmp(&b.name));
        Membership {
            members,
            peers,
            since: Instant::now(),
        }
    }

    /// Whether both views hold the same members, each the same instance.
    pub(crate) fn same_as(&self, other: &Membership) -> bool {
        self.peers == other.peers
    }

    /// `name`'s shared copy, while it is a member.
    pub(crate) fn name(&self, name: &str) -> Option<Arc<str>> {
        self.peers.get_key_value(name).map(|(n, _)| n.clone())
    }

    pub(crate) fn addr(&self, name: &str) -> Option<(Arc<str>, SocketAddr)> {
        self.peers.get_key_value(name).map(|(n, &(a, _))| (n.clone(), a))
    }

    /// Whether `name` is the same instance in both views.
    pub(crate) fn unchanged(&self, other: &Membership, name: &str) -> bool {
        self.peers.get(name).is_some_and(|p| other.peers.get(name) == Some(p))
    }
}
