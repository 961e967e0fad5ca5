//! The target side of the handshake: accepts connection requests, creates and connects the
//! target's QPs, and answers with their numbers, PSNs and the negotiated MTU.
//!
//! Facing whoever reaches the listener: connections are capped in total and per source address,
//! the opening (authentication when a key is configured) has the handshake deadline and each
//! message the frame deadline, accept errors back off, and a peer that proved nothing reads at
//! most [`MAX_AUTH_MESSAGE_BYTES`] and hears only "unauthenticated". QPs are bound to the
//! (segment name, instance) that created them and to its claim (see [`judge_claim`]), and each
//! source address holds at most `TE_RDMA_MAX_QPS_PER_SOURCE` of them.
//!
//! When this side takes notifications, each connection's slot-0 QP also gets a receive ring
//! ([`super::notify::NoteRing`]); its completions come here from the progress thread
//! ([`on_ring_completion`]).

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::Weak;
use std::time::Duration;

use te_base::auth::{self as auth, AuthKey};
use te_base::listener::{accept_admitted, deadline, AcceptBackoff, ConnectionGate, ListenerLimits};
use te_base::{Error, Result};
use tokio::net::{TcpListener, TcpStream};

use super::handshake_io::{handshake_error, read_body, write_message, AuthFrames};
use super::notify::NoteRing;
use super::rails::RailSet;
use super::Shared;
use crate::protocol::handshake::{
    decode, decode_opening, mtu_offer, negotiate_mtu, parse_hex32, AuthMessage, ConnectRequest, ConnectResponse,
    Opening, QpOffer, AUTH_CONTEXT, MAX_AUTH_MESSAGE_BYTES, MAX_MESSAGE_BYTES,
};
use crate::protocol::qp_state::QpTransition;
use crate::protocol::qp_state::{connect_transitions, LocalQpEnd, QpMachine, RemoteQpEnd};
use crate::verbs::{Completion, QpCaps, Verbs};

/// Most QPs the target side keeps for peers (every peer's slots together).
pub(crate) const MAX_ACCEPTED_QPS: usize = 1 << 16;

/// A QP this side created for a peer's slot.
pub(crate) struct AcceptedQp<V: Verbs> {
    qp: V::Qp,
    qpn: u32,
    source: IpAddr,
    /// The notification receive ring (slot 0, when this side takes notifications), with the rail
    /// whose CQ room it reserved.
    ring: Option<(NoteRing<V>, usize)>,
}

/// CQ entries a ring may have outstanding: its receives and up to twice as many answers.
fn ring_cq_room() -> u32 {
    3 * super::notify::NOTIFY_CREDITS
}

impl<V: Verbs> AcceptedQp<V> {
    pub(crate) fn destroy(self, rails: &RailSet<V>) {
        let verbs = &*rails.verbs;
        if let Err(e) = verbs.destroy_qp(self.qp) {
            tracing::warn!("rdma: destroying an accepted QP: {e}");
        }
        if let Some((mut ring, rail)) = self.ring {
            // After the QP: nothing writes into the ring any more.
            ring.release(verbs);
            rails.rails[rail].release_cq(ring_cq_room());
        }
    }
}

/// Who holds a (segment name, instance): the claim its first request presented and where from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) secret: [u8; 32],
    pub(crate) source: IpAddr,
}

/// The target side's QPs: by (initiator segment, instance, slot), and the claims binding each
/// (segment, instance) to its initiator.
pub(crate) struct Accepted<V: Verbs> {
    pub(crate) qps: HashMap<(String, u64, u32), AcceptedQp<V>>,
    pub(crate) claims: HashMap<(String, u64), Claim>,
    /// Keys of the QPs with a notification ring, by QP number.
    rings: HashMap<u32, (String, u64, u32)>,
}

impl<V: Verbs> Default for Accepted<V> {
    fn default() -> Self {
        Accepted {
            qps: HashMap::new(),
            claims: HashMap::new(),
            rings: HashMap::new(),
        }
    }
}

impl<V: Verbs> Accepted<V> {
    /// Destroys every QP (transport teardown).
    pub(crate) fn destroy_all(&mut self, rails: &RailSet<V>) {
        for (_, a) in self.qps.drain() {
            a.destroy(rails);
        }
        self.claims.clear();
        self.rings.clear();
    }

    fn remove(&mut self, key: &(String, u64, u32), rails: &RailSet<V>) {
        if let Some(a) = self.qps.remove(key) {
            self.rings.remove(&a.qpn);
            a.destroy(rails);
        }
    }

    /// Destroys the QPs of (segment, instance) and forgets its claim.
    fn retire(&mut self, segment: &str, instance: u64, rails: &RailSet<V>) {
        self.claims.remove(&(segment.to_string(), instance));
        let keys: Vec<_> = self
            .qps
            .keys()
            .filter(|(s, i, _)| s == segment && *i == instance)
            .cloned()
            .collect();
        for k in keys {
            self.remove(&k, rails);
        }
    }
}

/// A completion of a QP no connection of ours owns: a notification ring's receive or answer.
/// A ring that breaks (the provider refused a post, the sender ignores its credits) has its QP
/// moved to ERROR; the sender then re-establishes it and gets a fresh ring.
pub(crate) fn on_ring_completion<V: Verbs>(shared: &Shared<V>, c: &Completion) {
    let Some(inbox) = shared.inbox.read().clone() else {
        return;
    };
    let mut accepted = shared.accepted.lock();
    let Some(key) = accepted.rings.get(&c.qp_num).cloned() else {
        return;
    };
    let Some(a) = accepted.qps.get_mut(&key) else { return };
    let Some((ring, _)) = a.ring.as_mut() else { return };
    if let Err(why) = ring.on_completion(&*shared.verbs, &a.qp, c, &inbox) {
        tracing::debug!(peer = %key.0, "rdma: notification ring cut: {why}");
        let _ = shared.verbs.modify_qp(&a.qp, &QpTransition::ToError);
    }
}

/// What to do with a request's claim on (segment, instance).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Another initiator holds the pair: refuse, touch nothing.
    Taken,
    /// Go ahead; then retire these older instances of the same segment (restarts seen from the
    /// same source address).
    Proceed { retire: Vec<u64> },
}

fn same_secret(a: &[u8; 32], b: &[u8; 32]) -> bool {
    // Constant time: the difference is folded over every byte.
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The claim rule, pure. A (segment, instance) belongs to the claim its first request presented:
/// a request with another claim is refused (anyone can read a name and an instance from a
/// descriptor; only the initiator knows its claim). A new instance of a segment replaces the
/// older instances' QPs only when it comes from the address those came from (the engine
/// restarted on its host); from elsewhere it gets its own QPs beside them, and the per-source
/// quota bounds what either can hold.
pub(crate) fn judge_claim(
    claims: &HashMap<(String, u64), Claim>,
    segment: &str,
    instance: u64,
    claim: &Claim,
) -> Verdict {
    if let Some(held) = claims.get(&(segment.to_string(), instance)) {
        if !same_secret(&held.secret, &claim.secret) {
            return Verdict::Taken;
        }
    }
    let retire = claims
        .iter()
        .filter(|((s, i), c)| s == segment && *i != instance && c.source == claim.source)
        .map(|((_, i), _)| *i)
        .collect();
    Verdict::Proceed { retire }
}

/// Accepts handshake connections until the transport goes away.
pub(crate) async fn serve<V: Verbs>(shared: Weak<Shared<V>>, listener: TcpListener, limits: ListenerLimits) {
    let gate = ConnectionGate::new(&limits);
    let mut backoff = AcceptBackoff::default();
    loop {
        let (stream, from, permit) = accept_admitted(
            &listener,
            &gate,
            &mut backoff,
            "rdma handshake listener",
            limits.frame_timeout,
        )
        .await;
        if shared.strong_count() == 0 {
            return;
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            let _permit = permit;
            handle(shared, stream, from.ip(), limits).await;
        });
    }
}

/// Runs `work` within `limit`; running out of time is an I/O `TimedOut` error naming `what`.
async fn within<T>(limit: Duration, what: &str, work: impl Future<Output = Result<T>>) -> Result<T> {
    deadline(limit, what, async { Ok(work.await) })
        .await
        .map_err(|e| Error::io("rdma handshake", e))?
}

/// The target's side of the authentication exchange, after the initiator's `Hello`.
async fn authenticate(stream: &mut TcpStream, key: &AuthKey, hello: AuthMessage, peer: &str) -> Result<()> {
    let AuthMessage::Hello { nonce } = hello else {
        return Err(Error::Unauthenticated {
            peer: peer.into(),
            reason: "no hello".into(),
        });
    };
    let nonce_i = parse_hex32(&nonce, "nonce")?;
    auth::respond(&mut AuthFrames { stream, peer }, key, AUTH_CONTEXT, &nonce_i, peer)
        .await
        .map_err(handshake_error)
}

/// Reads the request of one connection: after authentication when `auth` is set. `Err` carries
/// the answer to give instead (if any).
async fn opening(
    stream: &mut TcpStream,
    auth: Option<&AuthKey>,
    source: IpAddr,
    limits: &ListenerLimits,
) -> std::result::Result<ConnectRequest, Option<ConnectResponse>> {
    let peer = source.to_string();
    let first_max = if auth.is_some() {
        MAX_AUTH_MESSAGE_BYTES
    } else {
        MAX_MESSAGE_BYTES
    };
    let first = within(
        limits.handshake_timeout,
        "rdma handshake opening",
        read_body(stream, first_max),
    )
    .await
    .and_then(|body| decode_opening(&body));
    match (auth, first) {
        (Some(key), Ok(Opening::Auth(hello))) => {
            let proved = within(
                limits.handshake_timeout,
                "rdma handshake authentication",
                authenticate(stream, key, hello, &peer),
            )
            .await;
            if let Err(e) = proved {
                te_base::listener::log_refusal("rdma handshake", &peer, &format_args!("it did not authenticate: {e}"));
                return Err(Some(ConnectResponse::Unauthenticated));
            }
            let body = within(
                limits.frame_timeout,
                "rdma handshake request",
                read_body(stream, MAX_MESSAGE_BYTES),
            )
            .await
            .map_err(|_| None)?;
            decode::<ConnectRequest>(&body).map_err(|e| {
                tracing::debug!("rdma handshake: unreadable request from {peer}: {e}");
                Some(ConnectResponse::Refused { reason: e.to_string() })
            })
        }
        (Some(_), other) => {
            match other {
                Err(e) => {
                    te_base::listener::log_refusal("rdma handshake", &peer, &format_args!("unreadable opening: {e}"))
                }
                Ok(_) => te_base::listener::log_refusal("rdma handshake", &peer, &"it did not offer the shared key"),
            }
            Err(Some(ConnectResponse::Unauthenticated))
        }
        (None, Ok(Opening::Connect(r))) => Ok(r),
        (None, Ok(Opening::Auth(_))) => Err(Some(ConnectResponse::Refused {
            reason: "this target has no shared key configured (TE_AUTH_KEY_FILE)".into(),
        })),
        (None, Err(e)) => {
            tracing::debug!("rdma handshake: unreadable request from {peer}: {e}");
            Err(None)
        }
    }
}

async fn handle<V: Verbs>(shared: Weak<Shared<V>>, mut stream: TcpStream, source: IpAddr, limits: ListenerLimits) {
    let auth = match shared.upgrade() {
        Some(s) => s.auth.clone(),
        None => return,
    };
    let response = match opening(&mut stream, auth.as_ref(), source, &limits).await {
        Ok(request) => {
            let Some(shared) = shared.upgrade() else { return };
            match accept(&shared, &request, source) {
                Ok(qps) => ConnectResponse::Accepted { qps },
                Err(e) => ConnectResponse::Refused { reason: e.to_string() },
            }
        }
        Err(Some(answer)) => answer,
        Err(None) => return,
    };
    let written = within(
        limits.frame_timeout,
        "rdma handshake answer",
        write_message(&mut stream, &response),
    )
    .await;
    if let Err(e) = written {
        tracing::debug!("rdma handshake: answering {source}: {e}");
    }
}

/// Creates, connects and records a QP for every requested slot (replacing the QP a slot had, which
/// is how one failed QP is re-established). All or nothing.
fn accept<V: Verbs>(shared: &Shared<V>, req: &ConnectRequest, source: IpAddr) -> Result<Vec<QpOffer>> {
    let rails = &shared.rails().rails;
    req.validate(rails.len())?;
    if req.to_instance != shared.instance {
        return Err(Error::Refused {
            peer: shared.segment_name.clone(),
            reason: "the request is for another instance of this segment (stale descriptor: it restarted)".into(),
        });
    }
    let claim = Claim {
        secret: parse_hex32(&req.from_claim, "the initiator's claim")?,
        source,
    };
    let taken = || Error::Refused {
        peer: shared.segment_name.clone(),
        reason: format!(
            "segment '{}' is connected here by another initiator with the same instance",
            req.from_segment
        ),
    };
    {
        // Bound what anyone who can reach the listener may make us allocate.
        let accepted = shared.accepted.lock();
        if judge_claim(&accepted.claims, &req.from_segment, req.from_instance, &claim) == Verdict::Taken {
            return Err(taken());
        }
        let key = |slot: u32| (req.from_segment.clone(), req.from_instance, slot);
        let replaced: Vec<&AcceptedQp<V>> = req.qps.iter().filter_map(|q| accepted.qps.get(&key(q.slot))).collect();
        let total = accepted.qps.len() + req.qps.len() - replaced.len();
        if total > MAX_ACCEPTED_QPS {
            return Err(Error::Refused {
                peer: shared.segment_name.clone(),
                reason: format!("already serving {} QPs (limit {MAX_ACCEPTED_QPS})", accepted.qps.len()),
            });
        }
        let from_source = accepted.qps.values().filter(|a| a.source == source).count();
        let replaced_here = replaced.iter().filter(|a| a.source == source).count();
        if from_source + req.qps.len() - replaced_here > shared.config.max_qps_per_source {
            return Err(Error::Refused {
                peer: shared.segment_name.clone(),
                reason: format!(
                    "this source address holds {from_source} QPs here (TE_RDMA_MAX_QPS_PER_SOURCE={})",
                    shared.config.max_qps_per_source
                ),
            });
        }
    }
    let notify = shared.inbox.read().as_deref().map(super::notify::params);
    let mut created: Vec<Created<V>> = Vec::with_capacity(req.qps.len());
    let mut answers = Vec::with_capacity(req.qps.len());
    let result = (|| -> Result<()> {
        for offer in &req.qps {
            let target_rail = usize::from(offer.target_rail);
            let rail = &rails[target_rail];
            let remote_rail = &req.rails[usize::from(offer.initiator_rail)];
            // Slot 0 carries the connection's notifications.
            let params = notify.filter(|_| offer.slot == 0);
            let credits = params.map_or(0, |p| p.credits);
            let (qp, qpn) = shared.verbs.create_qp(
                rail.pd(),
                rail.cq(),
                QpCaps {
                    // Answers: up to twice the credits in flight (see NoteRing).
                    max_send_wr: (2 * credits).max(1),
                    max_send_sge: 1,
                    max_recv_wr: credits,
                },
            )?;
            created.push(Created {
                slot: offer.slot,
                qp,
                qpn,
                ring: None,
            });
            if let Some(p) = params {
                rail.reserve_cq(ring_cq_room())?;
                match NoteRing::new(&*shared.verbs, rail.pd(), p) {
                    Ok(ring) => created.last_mut().expect("just pushed").ring = Some((ring, target_rail)),
                    Err(e) => {
                        rail.release_cq(ring_cq_room());
                        return Err(e);
                    }
                }
            }
            let mine = mtu_offer(rail.port_attrs.active_mtu, shared.config.connect.mtu_cap);
            let mtu = negotiate_mtu(offer.mtu, mine);
            let psn = shared.next_psn();
            let local = LocalQpEnd {
                port: rail.port,
                link_layer: rail.port_attrs.link_layer,
                gid_index: rail.gid_index,
                psn,
                device_max_rd_atomic: rail.attrs.max_qp_rd_atom,
            };
            let remote = RemoteQpEnd {
                qpn: offer.qpn,
                psn: offer.psn,
                lid: remote_rail.lid,
                gid: remote_rail.gid()?,
                link_layer: remote_rail.link_layer,
            };
            let mut machine = QpMachine::default();
            let last = created.last().expect("just pushed");
            for t in connect_transitions(&local, &remote, mtu, &shared.config.connect)? {
                shared.verbs.modify_qp(&last.qp, &t)?;
                machine.apply(&t)?;
            }
            if let Some((ring, _)) = &last.ring {
                // Before the answer: the sender may send as soon as it has it.
                ring.post_all(&*shared.verbs, &last.qp)?;
            }
            answers.push(QpOffer {
                qpn,
                psn,
                mtu,
                ..*offer
            });
        }
        Ok(())
    })();
    let set = shared.rails();
    let into_accepted = |c: Created<V>| {
        (
            c.slot,
            AcceptedQp {
                qp: c.qp,
                qpn: c.qpn,
                source,
                ring: c.ring,
            },
        )
    };
    if let Err(e) = result {
        for c in created {
            into_accepted(c).1.destroy(set);
        }
        return Err(e);
    }
    let mut accepted = shared.accepted.lock();
    // Judged again: another request for the pair may have won while the QPs were created.
    let retire = match judge_claim(&accepted.claims, &req.from_segment, req.from_instance, &claim) {
        Verdict::Taken => {
            for c in created {
                into_accepted(c).1.destroy(set);
            }
            return Err(taken());
        }
        Verdict::Proceed { retire } => retire,
    };
    // QPs of an earlier instance of the same peer, from its host, are dead weight now.
    for old in retire {
        accepted.retire(&req.from_segment, old, set);
    }
    accepted
        .claims
        .entry((req.from_segment.clone(), req.from_instance))
        .or_insert(claim);
    for c in created {
        let (slot, a) = into_accepted(c);
        let key = (req.from_segment.clone(), req.from_instance, slot);
        accepted.remove(&key, set);
        if a.ring.is_some() {
            accepted.rings.insert(a.qpn, key.clone());
        }
        accepted.qps.insert(key, a);
    }
    Ok(answers)
}

/// A QP created for a request, before it is recorded.
struct Created<V: Verbs> {
    slot: u32,
    qp: V::Qp,
    qpn: u32,
    ring: Option<(NoteRing<V>, usize)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn claims_bind_a_name_and_instance_to_their_first_initiator() {
        let mut claims = HashMap::new();
        let owner = Claim {
            secret: [1; 32],
            source: ip(1),
        };
        assert_eq!(
            judge_claim(&claims, "a", 7, &owner),
            Verdict::Proceed { retire: vec![] }
        );
        claims.insert(("a".to_string(), 7), owner);
        // The owner again (re-establishing a QP, adding slots): fine.
        assert_eq!(
            judge_claim(&claims, "a", 7, &owner),
            Verdict::Proceed { retire: vec![] }
        );
        // Same name and instance, another claim, from anywhere: refused.
        for source in [ip(1), ip(2)] {
            let thief = Claim {
                secret: [2; 32],
                source,
            };
            assert_eq!(judge_claim(&claims, "a", 7, &thief), Verdict::Taken);
        }
        // A new instance from the owner's address (a restart there) retires the old one.
        let restarted = Claim {
            secret: [3; 32],
            source: ip(1),
        };
        assert_eq!(
            judge_claim(&claims, "a", 8, &restarted),
            Verdict::Proceed { retire: vec![7] }
        );
        // A new instance from elsewhere gets its own QPs and retires nothing.
        let elsewhere = Claim {
            secret: [4; 32],
            source: ip(9),
        };
        assert_eq!(
            judge_claim(&claims, "a", 9, &elsewhere),
            Verdict::Proceed { retire: vec![] }
        );
        // Other names are not affected.
        assert_eq!(
            judge_claim(&claims, "b", 7, &elsewhere),
            Verdict::Proceed { retire: vec![] }
        );
    }
}
