//! What peers exchange to connect RC queue pairs, and how the path MTU is negotiated.
//!
//! Two parts, both carried by the metadata layer's reach:
//! - Static, in the segment descriptor (`TransportEndpoint { transport: "rdma", info }`):
//!   [`EndpointInfo`] lists the segment's rails (device, port, link layer, LID, GID, active MTU)
//!   and the address of its handshake listener.
//! - Per connection, over the handshake listener: the initiator creates its QPs and sends a
//!   [`ConnectRequest`] (its rails, and per QP slot: rail pair, QPN, PSN, MTU offer); the target
//!   creates (or, for a slot it already has, resets) its QPs, moves them to RTS and answers a
//!   [`ConnectResponse`] with its QPNs, PSNs and the negotiated MTU. Re-establishing one failed QP
//!   is the same exchange for one slot.
//!
//! MTU: each side offers the smaller of its port's active MTU and its `TE_RDMA_MTU` cap; the
//! target answers the smaller of both offers and both sides program exactly that value (RC
//! connections with mismatched MTUs fail, which Mooncake hit in production).
//!
//! Messages travel as a 4-byte big-endian length and JSON; every field is validated on receipt.
//!
//! Trust (docs/rdma.md, "Who may connect"): with a shared key, a handshake connection opens with
//! [`AuthMessage`]s (`Hello` -> `Challenge` -> `Proof`, te-base's mutual HMAC challenge-response
//! with context `"rdma"`) before the [`ConnectRequest`]; a target answers anything else with
//! [`ConnectResponse::Unauthenticated`] and closes. Whatever the key, a request carries the
//! initiator's `from_claim`, a secret drawn per transport start and never published: the first
//! request of a (segment name, instance) binds that pair to its claim, and a later request for the
//! pair with another claim is refused, so claiming a peer's name does not replace its QPs.

use serde::{Deserialize, Serialize};
use te_base::{Error, Result};

use super::values::{Gid, LinkLayer, Mtu};

/// Version of the endpoint info and handshake messages (2: rails carry their rail number; 3:
/// requests carry a claim, connections may open with authentication).
pub const PROTOCOL_VERSION: u32 = 3;
/// Largest message of the authentication exchange (and the largest first message a target with a
/// key reads from a peer that has not proved anything yet).
pub const MAX_AUTH_MESSAGE_BYTES: usize = 1024;
/// The context of the handshake's proofs.
pub const AUTH_CONTEXT: &str = "rdma";
/// Largest handshake message accepted.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Most rails a segment may advertise.
pub const MAX_RAILS: usize = 64;
/// Largest rail number accepted (rail numbers are NIC positions on a host, or just past them).
pub const MAX_RAIL_NUMBER: u32 = 1023;
/// Most QP slots one request may carry.
pub const MAX_SLOTS: usize = 4096;

const MASK_24: u32 = 0x00ff_ffff;

/// One rail (device port) of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RailInfo {
    /// Rail number: the NIC's position in PCI bus-id order on its host (te-base's topology), so
    /// rail `i` here pairs with the peer's rail `i` (the same switch rail in rail-optimized
    /// fabrics) whatever position each side's transport holds it at. Buffer keys list these.
    pub rail: u32,
    /// Device name (`mlx5_0`).
    pub device: String,
    /// Port number.
    pub port: u8,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
    /// LID (InfiniBand).
    pub lid: u16,
    /// GID in hex (32 digits).
    pub gid: String,
    /// Active MTU of the port.
    pub mtu: Mtu,
    /// Link rate in Mbit/s (0 when unknown), for rate-proportional striping.
    #[serde(default)]
    pub rate_mbps: u64,
}

impl RailInfo {
    /// The GID as bytes.
    pub fn gid(&self) -> Result<Gid> {
        parse_gid(&self.gid)
    }
}

/// The `info` of the segment descriptor's `rdma` endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointInfo {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// `ip:port` of the handshake listener.
    pub handshake: String,
    /// Random per transport start; a handshake naming another instance is refused (the target
    /// restarted and its QPs and keys are gone).
    pub instance: u64,
    /// Rails in rail-index order.
    pub rails: Vec<RailInfo>,
    /// The notification receive ring each connection gets; absent when the target takes none
    /// (then `Peer::notify` says notifications are not available).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<crate::protocol::notify_wire::NotifyParams>,
}

/// One QP slot of a connection: which rails it joins and one side's QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpOffer {
    /// Slot number within the connection (stable across re-establishment).
    pub slot: u32,
    /// Initiator's rail index.
    pub initiator_rail: u16,
    /// Target's rail index.
    pub target_rail: u16,
    /// This side's QP number (24 bits).
    pub qpn: u32,
    /// This side's first send PSN (24 bits).
    pub psn: u32,
    /// This side's MTU offer (request) or the negotiated MTU (response).
    pub mtu: Mtu,
}

/// Initiator -> target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectRequest {
    /// [`PROTOCOL_VERSION`].
    pub version: u32,
    /// Initiator's segment name.
    pub from_segment: String,
    /// Initiator's instance (QPs of an older instance from the same source address are released).
    pub from_instance: u64,
    /// The initiator's claim on (`from_segment`, `from_instance`): 64 hex digits drawn per
    /// transport start, never published. Requests for the pair with another claim are refused.
    pub from_claim: String,
    /// Target transport instance the initiator read from the endpoint info; a restarted target
    /// refuses.
    pub to_instance: u64,
    /// Initiator's rails, so the target can address them without fetching a descriptor.
    pub rails: Vec<RailInfo>,
    /// QP slots to connect (or re-establish).
    pub qps: Vec<QpOffer>,
}

/// Target -> initiator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConnectResponse {
    /// Connected: the target's QPs, in request order, with the negotiated MTU.
    Accepted {
        /// One per requested slot.
        qps: Vec<QpOffer>,
    },
    /// Refused, with why (stale instance, no such rail, resources).
    Refused {
        /// Why.
        reason: String,
    },
    /// The target requires the shared key and the connection did not prove it. Says nothing else.
    Unauthenticated,
}

/// The authentication exchange that opens a connection when a key is configured. Nonces and
/// proofs are 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AuthMessage {
    /// Initiator -> target: the initiator's nonce.
    Hello {
        /// Initiator nonce.
        nonce: String,
    },
    /// Target -> initiator: the target's nonce and proof.
    Challenge {
        /// Target nonce.
        nonce: String,
        /// Target proof.
        proof: String,
    },
    /// Initiator -> target: the initiator's proof.
    Proof {
        /// Initiator proof.
        proof: String,
    },
}

/// The first message on a handshake connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opening {
    /// An authentication message.
    Auth(AuthMessage),
    /// A connection request (no authentication).
    Connect(ConnectRequest),
}

/// Decodes the first message of a connection: authentication or a request.
pub fn decode_opening(body: &[u8]) -> Result<Opening> {
    if let Ok(a) = serde_json::from_slice::<AuthMessage>(body) {
        return Ok(Opening::Auth(a));
    }
    decode::<ConnectRequest>(body).map(Opening::Connect)
}

/// Lowercase hex of `bytes`.
fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Exactly `2 * N` hex digits as `N` bytes.
fn from_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// 32 bytes as 64 lowercase hex digits.
pub fn hex32(bytes: &[u8; 32]) -> String {
    to_hex(bytes)
}

/// Parses 64 hex digits; `what` names the field in the error.
pub fn parse_hex32(text: &str, what: &str) -> Result<[u8; 32]> {
    from_hex(text).ok_or_else(|| invalid(format!("{what} is not 64 hex digits")))
}

/// The path MTU both sides program: the smaller of the two offers.
pub fn negotiate_mtu(initiator_offer: Mtu, target_offer: Mtu) -> Mtu {
    initiator_offer.min(target_offer)
}

/// One side's offer: its port's active MTU, capped by `TE_RDMA_MTU`.
pub fn mtu_offer(active: Mtu, cap: Option<Mtu>) -> Mtu {
    cap.map_or(active, |c| c.min(active))
}

/// A random 24-bit PSN from `seed` bits (the caller supplies entropy, keeping this pure).
pub fn psn_from(seed: u64) -> u32 {
    (seed ^ (seed >> 24) ^ (seed >> 48)) as u32 & MASK_24
}

/// Formats a GID as 32 hex digits.
pub fn gid_hex(gid: &Gid) -> String {
    to_hex(&gid.0)
}

/// Parses 32 hex digits.
pub fn parse_gid(text: &str) -> Result<Gid> {
    from_hex(text)
        .map(Gid)
        .ok_or_else(|| Error::InvalidDescriptor(format!("rdma: GID {text:?} is not 32 hex digits")))
}

fn invalid(what: String) -> Error {
    Error::InvalidDescriptor(format!("rdma: {what}"))
}

fn validate_rails(rails: &[RailInfo]) -> Result<()> {
    if rails.is_empty() || rails.len() > MAX_RAILS {
        return Err(invalid(format!("{} rails (must be 1..={MAX_RAILS})", rails.len())));
    }
    for (i, r) in rails.iter().enumerate() {
        if r.rail > MAX_RAIL_NUMBER {
            return Err(invalid(format!(
                "rail {i} has rail number {} (at most {MAX_RAIL_NUMBER})",
                r.rail
            )));
        }
        if rails[..i].iter().any(|o| o.rail == r.rail) {
            return Err(invalid(format!("rail number {} is listed twice", r.rail)));
        }
        if r.device.is_empty() || r.device.len() > 64 {
            return Err(invalid(format!("rail {i} has a bad device name")));
        }
        let gid = r.gid()?;
        match r.link_layer {
            LinkLayer::Ethernet if gid.is_zero() => return Err(invalid(format!("RoCE rail {i} has no GID"))),
            LinkLayer::Infiniband if r.lid == 0 => return Err(invalid(format!("InfiniBand rail {i} has LID 0"))),
            _ => {}
        }
    }
    Ok(())
}

impl EndpointInfo {
    /// Parses and validates the endpoint info of a peer's descriptor.
    pub fn from_value(value: &serde_json::Value) -> Result<Self> {
        let info: EndpointInfo =
            serde_json::from_value(value.clone()).map_err(|e| invalid(format!("malformed endpoint info: {e}")))?;
        if info.version != PROTOCOL_VERSION {
            return Err(invalid(format!(
                "endpoint version {} (this build speaks {PROTOCOL_VERSION})",
                info.version
            )));
        }
        info.handshake
            .parse::<std::net::SocketAddr>()
            .map_err(|_| invalid(format!("handshake address {:?} is not ip:port", info.handshake)))?;
        validate_rails(&info.rails)?;
        Ok(info)
    }

    /// As descriptor JSON.
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("endpoint info serializes")
    }
}

fn validate_offers(qps: &[QpOffer], initiator_rails: usize, target_rails: usize) -> Result<()> {
    if qps.is_empty() || qps.len() > MAX_SLOTS {
        return Err(invalid(format!("{} QP slots (must be 1..={MAX_SLOTS})", qps.len())));
    }
    for q in qps {
        if q.qpn & !MASK_24 != 0 || q.qpn == 0 {
            return Err(invalid(format!(
                "QPN {:#x} of slot {} is not a 24-bit QP number",
                q.qpn, q.slot
            )));
        }
        if q.psn & !MASK_24 != 0 {
            return Err(invalid(format!("PSN {:#x} of slot {} exceeds 24 bits", q.psn, q.slot)));
        }
        if usize::from(q.initiator_rail) >= initiator_rails || usize::from(q.target_rail) >= target_rails {
            return Err(invalid(format!("slot {} names a rail that does not exist", q.slot)));
        }
    }
    Ok(())
}

impl ConnectRequest {
    /// Validates a request received by the target, which has `target_rails` rails.
    pub fn validate(&self, target_rails: usize) -> Result<()> {
        if self.version != PROTOCOL_VERSION {
            return Err(invalid(format!("handshake version {}", self.version)));
        }
        if self.from_segment.is_empty() || self.from_segment.len() > 1024 {
            return Err(invalid("bad initiator segment name".into()));
        }
        parse_hex32(&self.from_claim, "the initiator's claim")?;
        validate_rails(&self.rails)?;
        validate_offers(&self.qps, self.rails.len(), target_rails)
    }
}

impl ConnectResponse {
    /// Validates an `Accepted` answer against the request it answers; returns the target's QPs.
    pub fn accepted_for(&self, request: &ConnectRequest, target_rails: usize) -> Result<&[QpOffer]> {
        let qps = match self {
            ConnectResponse::Accepted { qps } => qps,
            ConnectResponse::Refused { reason } => {
                return Err(Error::Refused {
                    peer: "rdma handshake".into(),
                    reason: reason.clone(),
                })
            }
            ConnectResponse::Unauthenticated => {
                return Err(Error::Unauthenticated {
                    peer: "rdma handshake".into(),
                    reason: "the target requires the shared key (TE_AUTH_KEY_FILE)".into(),
                })
            }
        };
        validate_offers(qps, request.rails.len(), target_rails)?;
        if qps.len() != request.qps.len() {
            return Err(invalid(format!(
                "{} QPs answered for {} requested",
                qps.len(),
                request.qps.len()
            )));
        }
        for (mine, theirs) in request.qps.iter().zip(qps) {
            let same_slot = mine.slot == theirs.slot
                && mine.initiator_rail == theirs.initiator_rail
                && mine.target_rail == theirs.target_rail;
            if !same_slot {
                return Err(invalid(format!(
                    "answer for slot {} does not match the request",
                    theirs.slot
                )));
            }
            if theirs.mtu > mine.mtu {
                return Err(invalid(format!(
                    "target chose MTU {} above our offer {} on slot {}",
                    theirs.mtu.bytes(),
                    mine.mtu.bytes(),
                    mine.slot
                )));
            }
        }
        Ok(qps)
    }
}

/// Frames a message: 4-byte big-endian length, then JSON.
pub fn encode<T: Serialize>(message: &T) -> Vec<u8> {
    let body = serde_json::to_vec(message).expect("handshake messages serialize");
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// The body length announced by a frame header; refuses oversized frames before reading them.
pub fn frame_len(header: [u8; 4]) -> Result<usize> {
    let n = u32::from_be_bytes(header) as usize;
    if n == 0 || n > MAX_MESSAGE_BYTES {
        return Err(invalid(format!(
            "handshake frame of {n} bytes (max {MAX_MESSAGE_BYTES})"
        )));
    }
    Ok(n)
}

/// Parses a frame body.
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T> {
    serde_json::from_slice(body).map_err(|e| invalid(format!("malformed handshake message: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn rail(device: &str, mtu: Mtu) -> RailInfo {
        RailInfo {
            rail: device.rsplit('_').next().and_then(|n| n.parse().ok()).unwrap_or(0),
            device: device.into(),
            port: 1,
            link_layer: LinkLayer::Ethernet,
            lid: 0,
            gid: "00000000000000000000ffff0a000001".into(),
            mtu,
            rate_mbps: 0,
        }
    }

    fn request() -> ConnectRequest {
        ConnectRequest {
            version: PROTOCOL_VERSION,
            from_segment: "a".into(),
            from_instance: 1,
            from_claim: "ab".repeat(32),
            to_instance: 2,
            rails: vec![rail("mlx5_0", Mtu::M4096)],
            qps: vec![QpOffer {
                slot: 0,
                initiator_rail: 0,
                target_rail: 0,
                qpn: 0x99,
                psn: 0x1234,
                mtu: Mtu::M4096,
            }],
        }
    }

    #[test]
    fn mtu_is_the_smaller_of_both_offers() {
        // A 4096 RoCE port against a 1024 one (a switch profile Mooncake met): both program 1024.
        assert_eq!(negotiate_mtu(Mtu::M4096, Mtu::M1024), Mtu::M1024);
        assert_eq!(negotiate_mtu(Mtu::M1024, Mtu::M4096), Mtu::M1024);
        assert_eq!(mtu_offer(Mtu::M4096, Some(Mtu::M2048)), Mtu::M2048);
        assert_eq!(mtu_offer(Mtu::M1024, Some(Mtu::M4096)), Mtu::M1024);
        assert_eq!(mtu_offer(Mtu::M4096, None), Mtu::M4096);
    }

    #[test]
    fn gids_round_trip_and_garbage_is_refused() {
        let g = parse_gid("fe800000000000000000000000000001").unwrap();
        assert_eq!(g.0[0], 0xfe);
        assert_eq!(gid_hex(&g), "fe800000000000000000000000000001");
        for bad in [
            "",
            "fe80",
            "zz800000000000000000000000000001",
            "fe8000000000000000000000000000011",
        ] {
            assert!(parse_gid(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn psns_are_24_bits() {
        for seed in [0u64, u64::MAX, 0xdead_beef_cafe_f00d] {
            assert!(psn_from(seed) <= MASK_24);
        }
    }

    #[test]
    fn endpoint_info_round_trips_and_is_validated() {
        let info = EndpointInfo {
            version: PROTOCOL_VERSION,
            handshake: "10.0.0.1:4791".into(),
            instance: 7,
            rails: vec![rail("mlx5_0", Mtu::M4096), rail("mlx5_1", Mtu::M1024)],
            notify: None,
        };
        assert_eq!(EndpointInfo::from_value(&info.to_value()).unwrap(), info);
        let with_notify = EndpointInfo {
            notify: Some(crate::protocol::notify_wire::NotifyParams {
                version: 1,
                credits: 16,
                max_bytes: 4096,
            }),
            ..info.clone()
        };
        assert_eq!(EndpointInfo::from_value(&with_notify.to_value()).unwrap(), with_notify);
        let mut bad = info.clone();
        bad.handshake = "nowhere".into();
        assert!(EndpointInfo::from_value(&bad.to_value()).is_err());
        let mut bad = info.clone();
        bad.rails.clear();
        assert!(EndpointInfo::from_value(&bad.to_value()).is_err());
        let mut bad = info.clone();
        bad.rails[0].gid = "0".repeat(32);
        assert!(
            EndpointInfo::from_value(&bad.to_value()).is_err(),
            "RoCE rail without GID"
        );
        let mut bad = info.clone();
        bad.rails[1].rail = 0;
        assert!(EndpointInfo::from_value(&bad.to_value()).is_err(), "rail number twice");
        let mut bad = info.clone();
        bad.rails[1].rail = MAX_RAIL_NUMBER + 1;
        assert!(
            EndpointInfo::from_value(&bad.to_value()).is_err(),
            "rail number out of range"
        );
        let mut bad = info.to_value();
        bad["rails"][0]["mtu"] = serde_json::json!(1500);
        assert!(EndpointInfo::from_value(&bad).is_err(), "MTU 1500 is not an IB MTU");
        assert!(EndpointInfo::from_value(&serde_json::json!("x")).is_err());
    }

    #[test]
    fn requests_are_validated_against_the_target() {
        let r = request();
        r.validate(1).unwrap();
        let mut bad = r.clone();
        bad.qps[0].qpn = 1 << 24;
        assert!(bad.validate(1).is_err());
        let mut bad = r.clone();
        bad.qps[0].psn = 1 << 24;
        assert!(bad.validate(1).is_err());
        let mut bad = r.clone();
        bad.qps[0].target_rail = 1;
        assert!(bad.validate(1).is_err(), "target has one rail");
        let mut bad = r.clone();
        bad.qps[0].initiator_rail = 3;
        assert!(bad.validate(1).is_err());
        let mut bad = r.clone();
        bad.version = 9;
        assert!(bad.validate(1).is_err());
        let mut bad = r;
        bad.qps.clear();
        assert!(bad.validate(1).is_err());
    }

    #[test]
    fn responses_must_match_the_request_and_not_raise_the_mtu() {
        let req = request();
        let mut answer = req.qps[0];
        answer.qpn = 0x55;
        answer.mtu = Mtu::M1024;
        let ok = ConnectResponse::Accepted { qps: vec![answer] };
        assert_eq!(ok.accepted_for(&req, 1).unwrap()[0].mtu, Mtu::M1024);

        let mut req_small = req.clone();
        req_small.qps[0].mtu = Mtu::M512;
        assert!(ok.accepted_for(&req_small, 1).is_err(), "target above our offer");
        let mut other_slot = answer;
        other_slot.slot = 5;
        assert!(ConnectResponse::Accepted { qps: vec![other_slot] }
            .accepted_for(&req, 1)
            .is_err());
        assert!(ConnectResponse::Accepted { qps: vec![] }.accepted_for(&req, 1).is_err());
        let refused = ConnectResponse::Refused {
            reason: "stale instance".into(),
        };
        assert!(matches!(refused.accepted_for(&req, 1), Err(Error::Refused { .. })));
    }

    proptest::proptest! {
        /// Arbitrary bytes from the network never panic the decoder or the validator.
        #[test]
        fn hostile_bytes_are_errors_not_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            if let Ok(r) = decode::<ConnectRequest>(&bytes) {
                let _ = r.validate(4);
            }
            let _ = decode::<ConnectResponse>(&bytes);
            if bytes.len() >= 4 {
                let _ = frame_len([bytes[0], bytes[1], bytes[2], bytes[3]]);
            }
        }

        #[test]
        fn mutated_requests_are_errors_not_panics(qpn in 0u32..u32::MAX, psn in 0u32..u32::MAX, rail in 0u16..8, mtu in 0u32..5000) {
            let mut v = serde_json::to_value(request()).unwrap();
            v["qps"][0]["qpn"] = qpn.into();
            v["qps"][0]["psn"] = psn.into();
            v["qps"][0]["target_rail"] = rail.into();
            v["qps"][0]["mtu"] = mtu.into();
            if let Ok(r) = serde_json::from_value::<ConnectRequest>(v) {
                let ok = r.validate(2).is_ok();
                proptest::prop_assert_eq!(ok, qpn != 0 && qpn < 1 << 24 && psn < 1 << 24 && rail < 2);
            }
        }
    }

    fn rail_strategy() -> impl proptest::strategy::Strategy<Value = RailInfo> {
        use proptest::prelude::*;
        (
            0u32..2000,
            "[a-z0-9_]{0,70}",
            any::<u8>(),
            any::<bool>(),
            any::<u16>(),
            any::<[u8; 16]>(),
            prop_oneof![Just(Mtu::M256), Just(Mtu::M1024), Just(Mtu::M4096)],
            any::<u64>(),
        )
            .prop_map(|(rail, device, port, ib, lid, gid, mtu, rate_mbps)| RailInfo {
                rail,
                device,
                port,
                link_layer: if ib { LinkLayer::Infiniband } else { LinkLayer::Ethernet },
                lid,
                gid: gid_hex(&Gid(gid)),
                mtu,
                rate_mbps,
            })
    }

    fn request_strategy() -> impl proptest::strategy::Strategy<Value = ConnectRequest> {
        use proptest::prelude::*;
        let offer = (any::<u32>(), any::<u16>(), any::<u16>(), any::<u32>(), any::<u32>()).prop_map(
            |(slot, initiator_rail, target_rail, qpn, psn)| QpOffer {
                slot,
                initiator_rail,
                target_rail,
                qpn,
                psn,
                mtu: Mtu::M2048,
            },
        );
        (
            any::<u32>(),
            "\\PC{0,40}",
            any::<u64>(),
            any::<[u8; 32]>(),
            any::<u64>(),
            proptest::collection::vec(rail_strategy(), 0..4),
            proptest::collection::vec(offer, 0..6),
        )
            .prop_map(
                |(version, from_segment, from_instance, claim, to_instance, rails, qps)| ConnectRequest {
                    version,
                    from_segment,
                    from_instance,
                    from_claim: hex32(&claim),
                    to_instance,
                    rails,
                    qps,
                },
            )
    }

    proptest::proptest! {
        /// Whatever a request holds, it survives the frame intact (validation is a separate step).
        #[test]
        fn requests_round_trip_through_frames(req in request_strategy()) {
            let framed = encode(&req);
            let n = frame_len(framed[..4].try_into().unwrap()).unwrap();
            proptest::prop_assert_eq!(n, framed.len() - 4);
            proptest::prop_assert_eq!(decode::<ConnectRequest>(&framed[4..]).unwrap(), req.clone());
            proptest::prop_assert_eq!(decode_opening(&framed[4..]).unwrap(), Opening::Connect(req.clone()));
            let _ = req.validate(4);
        }

        #[test]
        fn auth_messages_round_trip(a in proptest::prelude::any::<[u8; 32]>(), b in proptest::prelude::any::<[u8; 32]>()) {
            for m in [
                AuthMessage::Hello { nonce: hex32(&a) },
                AuthMessage::Challenge { nonce: hex32(&a), proof: hex32(&b) },
                AuthMessage::Proof { proof: hex32(&b) },
            ] {
                let framed = encode(&m);
                proptest::prop_assert_eq!(decode_opening(&framed[4..]).unwrap(), Opening::Auth(m));
            }
            proptest::prop_assert_eq!(parse_hex32(&hex32(&a), "x").unwrap(), a);
        }

        /// Arbitrary bytes never panic the opening decoder, the hex parser or the answer check.
        #[test]
        fn hostile_openings_are_errors_not_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512), text in "\\PC{0,80}") {
            let _ = decode_opening(&bytes);
            let _ = parse_hex32(&text, "x");
            let _ = parse_hex32(&String::from_utf8_lossy(&bytes), "x");
            if let Ok(resp) = decode::<ConnectResponse>(&bytes) {
                let _ = resp.accepted_for(&request(), 2);
            }
        }
    }

    #[test]
    fn claims_and_auth_fields_are_validated() {
        let mut bad = request();
        bad.from_claim = "zz".repeat(32);
        assert!(bad.validate(1).is_err());
        bad.from_claim = "ab".repeat(31);
        assert!(bad.validate(1).is_err());
        // Multi-byte characters whose byte length is 64 are refused, not sliced mid-character.
        assert!(parse_hex32(&"é".repeat(32), "x").is_err());
        assert!(matches!(
            ConnectResponse::Unauthenticated.accepted_for(&request(), 1),
            Err(Error::Unauthenticated { .. })
        ));
    }

    #[test]
    fn frames_round_trip_and_hostile_frames_are_refused() {
        let framed = encode(&request());
        let n = frame_len(framed[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, framed.len() - 4);
        assert_eq!(decode::<ConnectRequest>(&framed[4..]).unwrap(), request());
        assert!(frame_len([0, 0, 0, 0]).is_err());
        assert!(frame_len([0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(
            decode::<ConnectRequest>(&framed[4..framed.len() - 1]).is_err(),
            "truncated"
        );
        assert!(decode::<ConnectRequest>(b"{\"version\":1}").is_err());
    }
}
