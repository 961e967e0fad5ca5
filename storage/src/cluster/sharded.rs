//! The sharded directory: each key's index entry lives at its rendezvous top peers over the live
//! membership (`rendezvous.rs`), not in etcd; etcd holds only membership and leases.
//!
//! - A put's owner sends its keys, grouped per directory peer (one PUBLISH per peer per call,
//!   all peers at once), and returns once they answered: a committed put is routable at once.
//!   Each key carries the version its writer minted; a directory peer keeps the newest, and has
//!   the owner of an entry it superseded retire that copy before it answers (docs/umbp.md,
//!   "the last acknowledged write wins").
//! - A put is acknowledged once a write quorum of the key's directory peers took it, and a miss
//!   asks a read quorum of them (itself first when it is one, without a message; the next one
//!   when one is unreachable, or answers "unknown" while it is still settling after a membership
//!   change) and believes the newest entry: every lookup meets every acknowledged put.
//! - A membership change (join, clean leave, lease expiry, a restart under a new lease) makes
//!   every owner send the keys whose top set gained a peer to that peer, and every directory
//!   peer drop what it no longer indexes or whose owner left. With three directory peers per key,
//!   two of them survive a single change, so no routable key is lost meanwhile.
//!
//! All I/O here is blocking on pooled control connections (`conn.rs`), bounded per frame.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use super::conn::{ConnPool, Request};
use super::guard::Guard;
use super::key_directory::{DirectoryCounters, KeyDirectory, Refused};
use super::membership::Membership;
use super::owner::Owner;
use super::rendezvous::{self, Member};
use super::request_error::RequestError;
use super::shard::{Shard, BLOCKED, CAPPED, TAKEN};
use super::wire::{self, Op};
use crate::error::ClusterError;

/// Most keys in one PUBLISH (a rebalance sends in rounds of one message per peer).
const KEYS_PER_MESSAGE: usize = 8192;

/// What a deadline carried in PUBLISH or RETIRE leaves for the answer to travel back: the
/// receiver refuses the request this long before the sender stops waiting.
pub(crate) const ANSWER_MARGIN_MS: u64 = 5;

pub(crate) struct Sharded {
    me: Arc<str>,
    pub(crate) shard: Shard,
    pool: Arc<ConnPool>,
    membership: RwLock<Arc<Membership>>,
    /// Woken whenever the membership changes (a request from a member this view does not show
    /// yet waits for this, not for a polling step).
    membership_changed: tokio::sync::Notify,
    /// Peers that failed a request lately (the pool's suspects) are asked last and not waited
    /// for until they leave, come back under a new lease, or this period passes.
    suspect_for: Duration,
    /// The bound of one directory call (`UMBP_CLUSTER_TIMEOUT_MS`).
    timeout: Duration,
    settle: Duration,
    /// Directory messages sent to other peers.
    pub(crate) messages: AtomicU64,
    /// What other members may do to this peer's shard.
    pub(crate) guard: Guard,
    /// This peer's owner side: its copies are retired through it.
    owner: Weak<Owner>,
}

impl Sharded {
    /// `settle`: how long after a membership change an "unknown" answer is not trusted (owners
    /// are still re-publishing); `suspect_for`: how long a failed peer is passed over.
    pub(crate) fn new(
        me: Arc<str>,
        pool: Arc<ConnPool>,
        settle: Duration,
        suspect_for: Duration,
        timeout: Duration,
        guard: Guard,
        owner: Weak<Owner>,
    ) -> Sharded {
        Sharded {
            me,
            shard: Shard::new(settle),
            pool,
            membership: RwLock::new(Arc::new(Membership::new([]))),
            membership_changed: tokio::sync::Notify::new(),
            suspect_for,
            timeout,
            settle,
            messages: AtomicU64::new(0),
            guard,
            owner,
        }
    }

    /// This peer's owner side, while the store is open.
    pub(crate) fn owner_side(&self) -> Option<Arc<Owner>> {
        self.owner.upgrade()
    }

    /// Whether `name` is a current member.
    pub(crate) fn is_member(&self, name: &str) -> bool {
        self.membership.read().name(name).is_some()
    }

    /// Whether `name` is a member, waiting until `until` for the watch to show it (a member that
    /// just joined may reach this peer first): woken by each membership change, no polling.
    pub(crate) async fn is_member_by(&self, name: &str, until: tokio::time::Instant) -> bool {
        loop {
            // Registered before the check, so a change between the two is not missed.
            let changed = self.membership_changed.notified();
            if self.is_member(name) {
                return true;
            }
            if tokio::time::timeout_at(until, changed).await.is_err() {
                return self.is_member(name);
            }
        }
    }

    /// The IP of the control address `name` announced, while it is a member.
    pub(crate) fn announced_ip(&self, name: &str) -> Option<std::net::IpAddr> {
        self.membership.read().addr(name).map(|(_, a)| a.ip())
    }

    /// The name a directory request from `name` is accounted under: the member's own, shared,
    /// or `""` for every non-member.
    pub(crate) fn source(&self, name: Option<&str>) -> (Arc<str>, usize) {
        let m = self.membership.read();
        let n = name.and_then(|n| m.name(n)).unwrap_or_else(|| Arc::from(""));
        (n, m.members.len())
    }

    pub(crate) fn membership(&self) -> Arc<Membership> {
        self.membership.read().clone()
    }

    /// Installs a new view; returns the previous one when the members changed (the caller then
    /// re-homes entries off the watch task).
    fn install_membership(&self, m: Membership) -> Option<Arc<Membership>> {
        let mut cur = self.membership.write();
        if cur.same_as(&m) {
            return None;
        }
        let m = Arc::new(m);
        // A peer that left or came back as a new instance: its pooled connections (to the old
        // instance) and its suspicion go.
        self.pool.retain_peers(|n| cur.unchanged(&m, n));
        let old = std::mem::replace(&mut *cur, m);
        drop(cur);
        self.membership_changed.notify_waiters();
        Some(old)
    }

    /// The peers passed over now (one lock per call, not per key).
    fn suspects(&self) -> Vec<Arc<str>> {
        self.pool.suspects(self.suspect_for)
    }

    fn suspect(&self, name: &Arc<str>) {
        self.pool.suspect(name);
    }

    /// After a membership change from `old`: drops what this peer no longer indexes, then sends
    /// each of `local_keys` to the directory peers it gained.
    fn rehome(&self, old: &Membership, local_keys: &[String]) -> Result<(), ClusterError> {
        let now = self.membership();
        self.shard.membership_changed(&now.members, &self.me);
        let versions = self
            .owner
            .upgrade()
            .map_or_else(|| vec![0; local_keys.len()], |o| o.versions.recorded(local_keys));
        let (mut newer, mut unreached) = (Vec::new(), Vec::new());
        let r = self.publish_since(
            local_keys,
            &versions,
            Some(old),
            None,
            false,
            &mut newer,
            &mut unreached,
        );
        self.settle_newer(local_keys, &versions, false, newer, self.deadline());
        r
    }

    /// Indexes `keys` (with the versions this peer minted for them) as owned here at every
    /// directory peer, all of it by `end`; returns the indices of the keys not acknowledged:
    /// with `fresh`, those fewer than a write quorum of their directory peers took
    /// ([`rendezvous::write_quorum`]), otherwise those none took. The caller does not
    /// acknowledge a fresh write of those keys and this peer drops its copies (a copy it kept
    /// would be read here after a write acknowledged later elsewhere, which no directory entry
    /// tells it about). A directory peer that holds a newer version of a key keeps it; one
    /// whose entry this supersedes has the older owner retire its copy before it answers.
    ///
    /// `fresh`: the keys were just written here, so where a directory peer holds a newer version
    /// (another peer's write, or a clock behind another peer's) this peer's clock moves past it
    /// and the keys are published again under new versions, within `end`: a write acknowledged
    /// later gets the higher version. Otherwise (a re-publication of held copies) such a copy is
    /// retired: a newer write elsewhere superseded it.
    pub(crate) fn publish_versioned(&self, keys: &[String], versions: &[u64], fresh: bool, end: Instant) -> Vec<usize> {
        let (mut newer, mut unreached) = (Vec::new(), Vec::new());
        let _ = self.publish_since(keys, versions, None, Some(end), fresh, &mut newer, &mut unreached);
        // A key some directory peer held newer: a fresh write's verdict is that of its last
        // publication; a re-published copy is retired (superseded), not unreached.
        if !newer.is_empty() {
            let again: std::collections::HashSet<usize> = newer.iter().map(|&(i, _)| i).collect();
            unreached.retain(|i| !again.contains(i));
        }
        let settled = self.settle_newer(keys, versions, fresh, newer, end);
        if fresh {
            unreached.extend(settled);
            unreached.sort_unstable();
            unreached.dedup();
        }
        if fresh && !unreached.is_empty() {
            // Not acknowledged: this peer stops serving the copy (unless written again since),
            // so it can never be read after a write acknowledged later.
            let lost: Vec<(String, u64)> = unreached.iter().map(|&i| (keys[i].clone(), versions[i])).collect();
            self.retire_here(&lost);
        }
        unreached
    }

    /// Handles the keys a directory peer holds newer versions of (`(index, version)`): a fresh
    /// write is published again above them (at most three rounds, by `end`), anything else is
    /// retired here. Returns the indices of the fresh keys that end not acknowledged (their
    /// copies retired here too).
    fn settle_newer(
        &self,
        keys: &[String],
        versions: &[u64],
        fresh: bool,
        newer: Vec<(usize, u64)>,
        end: Instant,
    ) -> Vec<usize> {
        let mut failed = Vec::new();
        if newer.is_empty() {
            return failed;
        }
        let Some(owner) = self.owner.upgrade() else {
            return newer.into_iter().map(|(i, _)| i).collect();
        };
        // `orig[j]`: the index in `keys` of the round's key j.
        let mut orig: Vec<usize> = (0..keys.len()).collect();
        let (mut keys, mut versions, mut newer) = (keys.to_vec(), versions.to_vec(), newer);
        for round in 0.. {
            if newer.is_empty() {
                break;
            }
            if !fresh || round == 3 || Instant::now() >= end {
                let lost: Vec<(String, u64)> = newer.iter().map(|&(i, _)| (keys[i].clone(), versions[i])).collect();
                self.retire_here(&lost);
                failed.extend(newer.iter().map(|&(i, _)| orig[i]));
                break;
            }
            owner.versions.observe(newer.iter().map(|&(_, v)| v).max().unwrap_or(0));
            let again: Vec<String> = newer.iter().map(|&(i, _)| keys[i].clone()).collect();
            let next_orig: Vec<usize> = newer.iter().map(|&(i, _)| orig[i]).collect();
            let vs = owner.versions.stamp(&again, None);
            let (mut still, mut unreached) = (Vec::new(), Vec::new());
            let _ = self.publish_since(&again, &vs, None, Some(end), true, &mut still, &mut unreached);
            // Keys that came back newer again go round once more; the rest have their verdict,
            // and a copy not acknowledged is dropped here at the version it now has.
            let retry: std::collections::HashSet<usize> = still.iter().map(|&(i, _)| i).collect();
            let lost: Vec<usize> = unreached.iter().copied().filter(|i| !retry.contains(i)).collect();
            if !lost.is_empty() {
                self.retire_here(&lost.iter().map(|&i| (again[i].clone(), vs[i])).collect::<Vec<_>>());
            }
            failed.extend(lost.iter().map(|&i| next_orig[i]));
            (keys, versions, newer, orig) = (again, vs, still, next_orig);
        }
        failed
    }

    /// Has each owner of a superseded entry drop its copy of that version (this peer's own
    /// without a message), all owners at once, by `end`. Returns the entries whose owners did not
    /// confirm it in time (frozen, cut off, gone, refusing): the caller puts those entries back
    /// and does not take the newer write, so no write is acknowledged while a copy it
    /// superseded can still be read (by a reader that remembered its placement, or by its owner
    /// locally). Suspects are asked too, within the same bound. A RETIRE carries `end` as a
    /// wall-clock deadline, so an owner that reads it later (it was frozen) ignores it: the
    /// entry it would have emptied was put back.
    pub(crate) fn retire(
        &self,
        superseded: Vec<(String, Arc<str>, u64)>,
        end: Instant,
    ) -> Vec<(String, Arc<str>, u64)> {
        if superseded.is_empty() {
            return Vec::new();
        }
        let m = self.membership();
        let mut groups: HashMap<Arc<str>, Vec<(String, u64)>> = HashMap::new();
        for (k, o, v) in superseded {
            groups.entry(o).or_default().push((k, v));
        }
        if let Some(mine) = groups.remove(&self.me) {
            self.retire_here(&mine);
        }
        let mut failed = Vec::new();
        let deadline = wire::wall_deadline(end).saturating_sub(ANSWER_MARGIN_MS).max(1);
        let mut reqs: Vec<Request> = Vec::with_capacity(groups.len());
        let mut sent: Vec<Vec<(String, u64)>> = Vec::with_capacity(groups.len());
        for (p, ks) in groups {
            match m.addr(&p) {
                Some((peer, addr)) => {
                    reqs.push(Request {
                        peer,
                        addr,
                        op: Op::Retire,
                        body: wire::encode_validate(deadline, ks.iter().map(|(k, v)| (k.as_str(), *v))),
                    });
                    sent.push(ks);
                }
                // Not a member in this view: nobody can tell it to drop its copy.
                None => failed.extend(ks.into_iter().map(|(k, v)| (k, p.clone(), v))),
            }
        }
        if reqs.is_empty() {
            return failed;
        }
        self.messages.fetch_add(reqs.len() as u64, Ordering::Relaxed);
        for ((req, ks), answer) in reqs.iter().zip(sent).zip(self.pool.exchange(&reqs, end)) {
            match answer {
                Ok((Op::Verdicts, _)) => {}
                other => {
                    let why = match other {
                        Err(e) => e.to_string(),
                        Ok((op, body)) => format!("{op:?} {}", String::from_utf8_lossy(&body[..body.len().min(200)])),
                    };
                    tracing::debug!(
                        "umbp cluster: retiring {} superseded copies at {}: {why}; their entries are put back",
                        ks.len(),
                        req.peer
                    );
                    failed.extend(ks.into_iter().map(|(k, v)| (k, req.peer.clone(), v)));
                }
            }
        }
        failed
    }

    /// Drops this peer's copies of `keys` still at these versions.
    fn retire_here(&self, keys: &[(String, u64)]) {
        if let Some(owner) = self.owner.upgrade() {
            if let Some(core) = owner.core() {
                owner.retire(&core, keys);
            }
        }
    }

    /// The end of a directory call started now.
    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// As [`Sharded::publish_versioned`], skipping directory peers that already indexed a key under `old`.
    /// A membership change while it runs sends again to the directory peers the new view added
    /// (by the same `end`; `None`: each round of messages within the timeout, for a rebalance's
    /// many rounds), and the verdict is taken under the last view: the peers that took a key and
    /// are still its directory peers count, whichever view they were asked under.
    /// `quorum`: a key is reached when a write quorum of its directory peers took it (a fresh
    /// write); otherwise when any it was sent to did (a re-publication).
    #[allow(clippy::too_many_arguments)]
    fn publish_since(
        &self,
        keys: &[String],
        versions: &[u64],
        old: Option<&Membership>,
        end: Option<Instant>,
        quorum: bool,
        newer: &mut Vec<(usize, u64)>,
        unreached: &mut Vec<usize>,
    ) -> Result<(), ClusterError> {
        unreached.clear();
        let mut takers: Vec<Takers> = vec![Takers::default(); keys.len()];
        let mut asked = vec![false; keys.len()];
        let mut m = self.membership();
        let mut prev: Option<Arc<Membership>> = None;
        for round in 0..4 {
            let since = if round == 0 { old } else { prev.as_deref() };
            self.publish_under(&m, keys, versions, since, end, newer, &mut asked, &mut takers);
            let now = self.membership();
            if Arc::ptr_eq(&now, &m) || round == 3 {
                break;
            }
            prev = Some(std::mem::replace(&mut m, now));
        }
        for (i, k) in keys.iter().enumerate() {
            if !asked[i] {
                continue;
            }
            let top = rendezvous::top(rendezvous::stable_hash(k.as_bytes()), &m.members);
            let n = top.iter().flatten().count();
            let need = if quorum { rendezvous::write_quorum(n) } else { 1 };
            if top.iter().flatten().filter(|p| takers[i].has(&p.name)).count() < need {
                unreached.push(i);
            }
        }
        if newer.len() > 1 {
            // One entry per key (a key can come back newer under two views): the highest.
            newer.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            newer.dedup_by_key(|e| e.0);
        }
        if unreached.is_empty() {
            Ok(())
        } else {
            Err(ClusterError::Unplaced { keys: unreached.len() })
        }
    }

    /// One publication under view `m`: sends each key to its directory peers (but those that
    /// already had it under `old`), marking it `asked` and recording who took it in `takers`.
    #[allow(clippy::too_many_arguments)]
    fn publish_under(
        &self,
        m: &Membership,
        keys: &[String],
        versions: &[u64],
        old: Option<&Membership>,
        end: Option<Instant>,
        newer: &mut Vec<(usize, u64)>,
        asked: &mut [bool],
        takers: &mut [Takers],
    ) {
        if keys.is_empty() || m.members.is_empty() {
            return;
        }
        let mut local: Vec<usize> = Vec::new();
        let mut groups: HashMap<Arc<str>, Vec<usize>> = HashMap::new();
        let mut suspects = self.suspects();
        for (i, k) in keys.iter().enumerate() {
            let h = rendezvous::stable_hash(k.as_bytes());
            let before = old.map(|o| (o, rendezvous::top(h, &o.members)));
            for p in rendezvous::top(h, &m.members).into_iter().flatten() {
                let had = before
                    .as_ref()
                    .is_some_and(|(o, t)| t.iter().flatten().any(|q| q.name == p.name) && o.unchanged(m, &p.name));
                if had {
                    continue;
                }
                asked[i] = true;
                if p.name == self.me {
                    local.push(i);
                } else if !suspects.contains(&p.name) {
                    groups.entry(p.name.clone()).or_default().push(i);
                }
            }
        }
        // Keys a directory peer holds a newer version of go to `newer`.
        let here = self.shard.publish(
            &self.me,
            local.iter().map(|&i| (keys[i].as_str(), versions[i])),
            usize::MAX,
        );
        for (&i, &v) in local.iter().zip(&here.taken) {
            match v {
                TAKEN => takers[i].add(&self.me),
                CAPPED => {}
                v => newer.push((i, v)),
            }
        }
        let round_end = end.unwrap_or_else(|| self.deadline());
        // As at any directory peer: a superseded copy that could not be retired keeps its
        // entry, and this write is not taken here.
        let retire_end = round_end.min(Instant::now() + self.timeout / 4);
        let at: HashMap<&str, usize> = here
            .superseded_at
            .iter()
            .map(|&j| (keys[local[j]].as_str(), local[j]))
            .collect();
        let failed = self.retire(here.superseded, retire_end);
        if !failed.is_empty() {
            self.shard
                .revert(&self.me, |k| at.get(k).map_or(0, |&i| versions[i]), &failed);
            for (k, _, _) in &failed {
                if let Some(&i) = at.get(k.as_str()) {
                    takers[i].remove(&self.me);
                }
            }
        }
        let deadline = end.map_or(0, |e| wire::wall_deadline(e).saturating_sub(ANSWER_MARGIN_MS).max(1));
        // Rounds of at most one message per peer.
        let mut groups: Vec<(Arc<str>, SocketAddr, Vec<usize>)> = groups
            .into_iter()
            .filter_map(|(p, ks)| m.addr(&p).map(|(n, a)| (n, a, ks)))
            .collect();
        while !groups.is_empty() {
            let mut sent: Vec<Vec<usize>> = Vec::with_capacity(groups.len());
            let reqs: Vec<Request> = groups
                .iter_mut()
                .map(|(p, a, ks)| {
                    let chunk: Vec<usize> = ks.drain(..ks.len().min(KEYS_PER_MESSAGE)).collect();
                    let body = wire::encode_publish_by(
                        &self.me,
                        deadline,
                        chunk.iter().map(|&i| (keys[i].as_str(), versions[i])),
                    );
                    sent.push(chunk);
                    Request {
                        peer: p.clone(),
                        addr: *a,
                        op: Op::Publish,
                        body,
                    }
                })
                .collect();
            self.messages.fetch_add(reqs.len() as u64, Ordering::Relaxed);
            let round_end = end.unwrap_or_else(|| self.deadline());
            for ((req, chunk), answer) in reqs.iter().zip(sent).zip(self.pool.exchange(&reqs, round_end)) {
                match answer {
                    Ok((Op::Versions, body)) => {
                        let held = wire::decode_versions(&body).unwrap_or_default();
                        for (j, i) in chunk.into_iter().enumerate() {
                            match held.get(j) {
                                Some(&TAKEN) => takers[i].add(&req.peer),
                                // Not taken there: a copy it would supersede is still readable,
                                // or the sender's entries there are capped.
                                Some(&BLOCKED) | Some(&CAPPED) | None => {}
                                // A newer version is indexed there.
                                Some(&v) => newer.push((i, v)),
                            }
                        }
                    }
                    Ok((Op::Refused, why)) => {
                        tracing::warn!(
                            "umbp cluster: {} refused PUBLISH: {}",
                            req.peer,
                            String::from_utf8_lossy(&why[..why.len().min(200)])
                        );
                        // The refusal closed the connection: the rest of this call goes without it.
                        suspects.push(req.peer.clone());
                    }
                    Ok((op, _)) => tracing::warn!("umbp cluster: {} answered PUBLISH with {op:?}", req.peer),
                    Err(e) => {
                        tracing::debug!("umbp cluster: publishing to {}: {e}", req.peer);
                        self.suspect(&req.peer);
                        suspects.push(req.peer.clone());
                    }
                }
            }
            groups.retain(|(p, _, ks)| !ks.is_empty() && !suspects.contains(p));
            if end.is_some_and(|e| Instant::now() >= e) {
                break;
            }
        }
    }

    /// Forgets `keys` (as owned here) at their directory peers; best effort: a leftover entry
    /// makes a reader's RESOLVE answer "missing", never wrong data.
    fn unpublish_keys(&self, keys: &[String], end: Instant) {
        let m = self.membership();
        let mut groups: HashMap<Arc<str>, Vec<&str>> = HashMap::new();
        let suspects = self.suspects();
        let mut local: Vec<&str> = Vec::new();
        for k in keys {
            let h = rendezvous::stable_hash(k.as_bytes());
            for p in rendezvous::top(h, &m.members).into_iter().flatten() {
                if p.name == self.me {
                    local.push(k);
                } else if !suspects.contains(&p.name) {
                    groups.entry(p.name.clone()).or_default().push(k);
                }
            }
        }
        self.shard.unpublish(&self.me, local);
        let reqs: Vec<Request> = groups
            .into_iter()
            .filter_map(|(p, ks)| {
                let (peer, addr) = m.addr(&p)?;
                Some(Request {
                    peer,
                    addr,
                    op: Op::Unpublish,
                    body: wire::encode_owned_keys(&self.me, ks.into_iter()),
                })
            })
            .collect();
        self.messages.fetch_add(reqs.len() as u64, Ordering::Relaxed);
        for (req, answer) in reqs.iter().zip(self.pool.exchange(&reqs, end)) {
            if answer.is_err() {
                self.suspect(&req.peer);
            }
        }
    }

    /// The owner of each key and its control address; `None`: unknown, owned here, or its owner
    /// is not a live member.
    fn owners_at(&self, keys: &[&str], end: Instant) -> Vec<Option<(Arc<str>, SocketAddr)>> {
        let m = self.membership();
        self.lookup(keys, end)
            .into_iter()
            .map(|o| o.filter(|o| *o != self.me).and_then(|o| m.addr(&o)))
            .collect()
    }

    /// The owner of each key as a read quorum of its directory peers says (this peer included,
    /// without a message): the newest entry among their answers ([`rendezvous::read_quorum`]:
    /// every read quorum meets every write quorum, so the newest acknowledged put is among
    /// them). `None`: unknown, fewer than a read quorum answered, or its owner is not a live
    /// member. An "unknown" from a peer still settling after a membership change is not an
    /// answer. Rounds of one LOOKUP per directory peer, all of it by `end`: a round after which
    /// a key still has a directory peer left to ask ends by half of what is left, so silent
    /// directory peers leave the rest of the budget to the others (and are marked suspect: the
    /// next calls ask them last).
    pub(crate) fn lookup(&self, keys: &[&str], end: Instant) -> Vec<Option<Arc<str>>> {
        let m = self.membership();
        let view_settled = m.since.elapsed() >= self.settle;
        let suspects = self.suspects();
        let mut st: Vec<Quorum> = keys
            .iter()
            .map(|k| {
                let mut cands: Vec<&Member> = rendezvous::top(rendezvous::stable_hash(k.as_bytes()), &m.members)
                    .into_iter()
                    .flatten()
                    .collect();
                // This peer first (no message), suspects last.
                cands.sort_by_key(|p| (p.name != self.me, suspects.contains(&p.name)));
                Quorum {
                    need: if cands.is_empty() {
                        0
                    } else {
                        rendezvous::read_quorum(cands.len())
                    },
                    cands: cands.into_iter().map(|p| p.name.clone()).collect(),
                    next: 0,
                    best: None,
                }
            })
            .collect();
        // This peer's own share: one read lock, no message.
        let local: Vec<usize> = (0..keys.len())
            .filter(|&i| st[i].cands.first().is_some_and(|c| *c == self.me))
            .collect();
        let settled = view_settled && self.shard.settled();
        for (&i, o) in local.iter().zip(self.shard.lookup(local.iter().map(|&i| keys[i]))) {
            st[i].next = 1;
            st[i].heard(o, settled);
        }
        loop {
            // Each key asks as many more of its directory peers as it still needs answers from.
            let mut groups: HashMap<Arc<str>, Vec<usize>> = HashMap::new();
            for (i, q) in st.iter_mut().enumerate() {
                let take = q.need.min(q.cands.len() - q.next);
                for c in &q.cands[q.next..q.next + take] {
                    groups.entry(c.clone()).or_default().push(i);
                }
                q.next += take;
            }
            if groups.is_empty() {
                break;
            }
            let more_after = groups.values().flatten().any(|&i| st[i].next < st[i].cands.len());
            let reqs: Vec<(Request, Vec<usize>)> = groups
                .into_iter()
                .filter_map(|(p, ks)| {
                    let (peer, addr) = m.addr(&p)?;
                    let body = wire::encode_lookup(ks.iter().map(|&i| keys[i]));
                    Some((
                        Request {
                            peer,
                            addr,
                            op: Op::Lookup,
                            body,
                        },
                        ks,
                    ))
                })
                .collect();
            let (reqs, asked): (Vec<Request>, Vec<Vec<usize>>) = reqs.into_iter().unzip();
            self.messages.fetch_add(reqs.len() as u64, Ordering::Relaxed);
            let now = Instant::now();
            let round_end = if more_after {
                now + end.saturating_duration_since(now) / 2
            } else {
                end
            };
            let answers = if reqs.is_empty() {
                Vec::new()
            } else {
                self.pool.exchange(&reqs, round_end)
            };
            for ((req, ks), answer) in reqs.iter().zip(asked).zip(answers) {
                let decoded = match answer {
                    Ok((Op::Owners, body)) => wire::decode_owners(&body).map_err(|source| RequestError::Malformed {
                        answer: "OWNERS",
                        source,
                    }),
                    Ok((Op::Refused, why)) => {
                        tracing::debug!(
                            "umbp cluster: {} refused LOOKUP: {}",
                            req.peer,
                            String::from_utf8_lossy(&why[..why.len().min(200)])
                        );
                        continue;
                    }
                    Ok((got, _)) => Err(RequestError::Unexpected { request: "LOOKUP", got }),
                    Err(e) => Err(e),
                };
                match decoded {
                    Ok((settled, owners)) if owners.len() == ks.len() => {
                        for (i, o) in ks.into_iter().zip(owners) {
                            // A member's name is the view's (no allocation); a departed owner's
                            // entry still counts: a newer entry of a gone owner is not to be
                            // passed over for an older one of a live owner.
                            let o = o.map(|(n, v)| (m.addr(&n).map_or_else(|| Arc::from(n), |(n, _)| n), v));
                            st[i].heard(o, settled && view_settled);
                        }
                    }
                    Ok(_) => {
                        tracing::warn!(
                            "umbp cluster: {} answered LOOKUP with the wrong number of keys",
                            req.peer
                        );
                        self.suspect(&req.peer);
                    }
                    Err(e) => {
                        tracing::debug!("umbp cluster: looking up at {}: {e}", req.peer);
                        self.suspect(&req.peer);
                    }
                }
            }
            if Instant::now() >= end {
                break;
            }
        }
        st.into_iter()
            .map(|q| match (q.need, q.best) {
                (0, Some((_, o))) => m.addr(&o).map(|(n, _)| n),
                _ => None,
            })
            .collect()
    }
}

/// The directory peers that took one key's publication, under any view it was sent under (a
/// reference count each; inline up to two views' worth, so no allocation per key).
#[derive(Clone, Default)]
struct Takers(smallvec::SmallVec<[Arc<str>; 2 * rendezvous::REPLICAS]>);

impl Takers {
    fn add(&mut self, name: &Arc<str>) {
        if !self.has(name) {
            self.0.push(name.clone());
        }
    }

    fn remove(&mut self, name: &str) {
        self.0.retain(|n| &**n != name);
    }

    fn has(&self, name: &str) -> bool {
        self.0.iter().any(|n| &**n == name)
    }
}

/// One key's lookup: its directory peers in the order to ask them, the next to ask, how many
/// more answers it needs, and the newest entry heard (version, owner).
struct Quorum {
    cands: Vec<Arc<str>>,
    next: usize,
    need: usize,
    best: Option<(u64, Arc<str>)>,
}

impl Quorum {
    /// One directory peer's answer: an entry, or "not indexed here" (an answer only from a
    /// peer that has `settled`).
    fn heard(&mut self, entry: Option<(Arc<str>, u64)>, settled: bool) {
        match entry {
            Some((o, v)) => {
                self.need = self.need.saturating_sub(1);
                if self
                    .best
                    .as_ref()
                    .is_none_or(|(w, b)| super::shard::newer(v, &o, *w, b))
                {
                    self.best = Some((v, o));
                }
            }
            None if settled => self.need = self.need.saturating_sub(1),
            None => {}
        }
    }
}

impl KeyDirectory for Sharded {
    fn lives_in_etcd(&self) -> bool {
        false
    }

    fn set_membership(&self, m: Membership) -> Option<Arc<Membership>> {
        self.install_membership(m)
    }

    fn rebalance(&self, old: &Membership, local_keys: &[String]) -> Result<(), ClusterError> {
        self.rehome(old, local_keys)
    }

    /// A fresh write gets a new version per key (recorded, so a re-publication after an etcd
    /// outage carries it); a re-publication keeps the one recorded. Keys too few directory peers
    /// took: a fresh write's (fewer than a majority) are refused and their copies dropped; held
    /// ones (none took them) are an error, and are published again within a lease period.
    fn publish(&self, keys: &[String], fresh: bool, end: Instant) -> Result<Refused, ClusterError> {
        let versions = match self.owner_side() {
            Some(o) if fresh => o.versions.stamp(keys, o.core().as_deref()),
            Some(o) => o.versions.recorded(keys),
            None => vec![0; keys.len()],
        };
        let unreached = self.publish_versioned(keys, &versions, fresh, end);
        if unreached.is_empty() {
            return Ok(Vec::new());
        }
        if !fresh {
            return Err(ClusterError::Unplaced { keys: unreached.len() });
        }
        let why = format!(
            "fewer than a majority of its directory peers took it within {} ms",
            self.timeout.as_millis()
        );
        tracing::warn!(
            "umbp cluster: {} keys were not taken by a majority of their directory peers within {} ms; not acknowledged",
            unreached.len(),
            self.timeout.as_millis()
        );
        Ok(unreached.into_iter().map(|i| (i, why.clone())).collect())
    }

    fn unpublish(&self, keys: &[String], end: Instant) {
        self.unpublish_keys(keys, end)
    }

    fn owners(&self, keys: &[&str], end: Instant) -> Vec<Option<(Arc<str>, SocketAddr)>> {
        self.owners_at(keys, end)
    }

    fn owner_of(&self, key: &str, end: Instant) -> Option<Arc<str>> {
        self.lookup(&[key], end).pop().flatten()
    }

    fn counters(&self) -> DirectoryCounters {
        let c = &self.guard.counters;
        DirectoryCounters {
            entries: self.shard.len() as u64,
            messages: self.messages.load(Ordering::Relaxed),
            refused_identity: c.refused_identity.load(Ordering::Relaxed),
            refused_capped: c.refused_capped.load(Ordering::Relaxed),
            lookups_throttled: c.lookups_throttled.load(Ordering::Relaxed),
        }
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}
