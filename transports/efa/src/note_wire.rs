//! The messages that carry notifications over libfabric (version 1), their strict decoder and the
//! MAC that authenticates them when the engine has a key.
//!
//! Every message starts with a 20-byte header (little endian):
//!
//! | bytes | field |
//! | --- | --- |
//! | 0 | version (1) |
//! | 1 | kind: 1 NOTIFY, 2 ANSWER |
//! | 2 | ANSWER: outcome ([`Outcome`]); NOTIFY: 0 |
//! | 3 | flags: bit 0 = a 32-byte MAC ends the message; other bits 0 |
//! | 4..12 | sequence number (an ANSWER echoes its NOTIFY's) |
//! | 12..16 | ANSWER `TooLarge`: the target's largest payload; else 0 |
//! | 16..18 | length of the reply address (NOTIFY: 1..=[`MAX_REPLY_ADDR`]; ANSWER: 0) |
//! | 18..20 | 0 |
//!
//! then the reply address (the sender's endpoint name, where the answer goes), the body
//! (`te_base::notify::encode_body`: sender name and payload; NOTIFY only) and the MAC when flagged:
//! HMAC-SHA256 under the engine's key (`te_base::auth`) of the SHA-256 of everything before it,
//! with the handshake's initiator label for a NOTIFY and its responder label for an ANSWER, so one
//! cannot pass for the other.
//!
//! Why a MAC per message and not te-base's handshake (`te_base::auth::initiate`/`respond`, which
//! the listeners of the other transports run): there is no connection to run it on. A NOTIFY and
//! its ANSWER are single datagrams between reliable-datagram endpoints, any peer's message
//! lands in any posted receive buffer, and the target keeps no per-sender state; a handshake would
//! add a session per sender and a round trip before a peer's first notification. The message is
//! written with te-base's wire kit (`te_base::wire::Writer`, in place in the send buffer) and read
//! with it (`te_base::wire::Reader`), bounds-checked field by field.

use sha2::{Digest, Sha256};
use te_base::auth::{AuthKey, Role, PROOF_LEN};
pub use te_base::notify::Outcome;
use te_base::wire::{Reader, WireError, Writer};

/// Wire version this build speaks.
pub const VERSION: u8 = 1;
/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 20;
/// Longest reply address accepted (every provider's endpoint name fits: efa 32, tcp 16-28 bytes).
pub const MAX_REPLY_ADDR: usize = 256;
/// Bytes of the MAC trailer.
pub const MAC_LEN: usize = PROOF_LEN;
/// Length of every ANSWER with a MAC (the longest ANSWER).
pub const ANSWER_LEN: usize = HEADER_LEN + MAC_LEN;
/// MAC context: binds the proof to this protocol.
const MAC_CONTEXT: &str = "te-efa-notify-v1";
const FLAG_MAC: u8 = 1;
const KIND_NOTIFY: u8 = 1;
const KIND_ANSWER: u8 = 2;

/// A decoded message, borrowing the receive buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message<'a> {
    /// A notification: answer it at `reply`.
    Notify { seq: u64, reply: &'a [u8], body: &'a [u8] },
    /// The target's answer to notification `seq`.
    Answer { seq: u64, outcome: Outcome, max: u32 },
}

/// A message that does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// Shorter than its header (or than the lengths it declares).
    Truncated,
    /// A version this build does not speak.
    Version(u8),
    /// Unknown kind, outcome or flag bits, or non-zero reserved bytes.
    Malformed,
    /// The MAC is missing (a key is configured) or does not verify.
    Unauthenticated,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Truncated => f.write_str("truncated notification message"),
            DecodeError::Version(v) => write!(f, "notification message of unknown version {v}"),
            DecodeError::Malformed => f.write_str("malformed notification message"),
            DecodeError::Unauthenticated => f.write_str("notification message without a valid MAC"),
        }
    }
}

impl From<WireError> for DecodeError {
    fn from(e: WireError) -> DecodeError {
        match e {
            WireError::Truncated { .. } => DecodeError::Truncated,
            _ => DecodeError::Malformed,
        }
    }
}

fn mac(key: &AuthKey, role: Role, signed: &[u8]) -> [u8; MAC_LEN] {
    let digest: [u8; 32] = Sha256::digest(signed).into();
    key.prove(role, MAC_CONTEXT, &digest, &[0u8; 32])
}

/// Writes the 20-byte header with `w` (in place at the front of the send buffer).
fn header(w: &mut impl Writer, kind: u8, code: u8, seq: u64, max: u32, reply_len: usize, key: Option<&AuthKey>) {
    w.u8(VERSION);
    w.u8(kind);
    w.u8(code);
    w.u8(if key.is_some() { FLAG_MAC } else { 0 });
    w.u64(seq);
    w.u32(max);
    w.u16(reply_len as u16);
    w.u16(0);
}

/// Bytes a NOTIFY with this reply address and body takes.
pub fn notify_len(reply: &[u8], body: &[u8]) -> usize {
    HEADER_LEN + reply.len() + body.len() + MAC_LEN
}

/// Writes a NOTIFY into `out` (at least [`notify_len`] bytes); returns its length. `reply` must be
/// 1..=[`MAX_REPLY_ADDR`] bytes (our own endpoint name).
pub fn encode_notify(out: &mut [u8], seq: u64, reply: &[u8], body: &[u8], key: Option<&AuthKey>) -> usize {
    debug_assert!(!reply.is_empty() && reply.len() <= MAX_REPLY_ADDR);
    let mut w: &mut [u8] = out;
    header(&mut w, KIND_NOTIFY, 0, seq, 0, reply.len(), key);
    w.bytes(reply);
    w.bytes(body);
    seal(out, HEADER_LEN + reply.len() + body.len(), Role::Initiator, key)
}

/// Writes an ANSWER into `out` (at least [`ANSWER_LEN`] bytes); returns its length.
pub fn encode_answer(out: &mut [u8], seq: u64, outcome: Outcome, max: u32, key: Option<&AuthKey>) -> usize {
    let mut w: &mut [u8] = out;
    header(&mut w, KIND_ANSWER, outcome.code(), seq, max, 0, key);
    seal(out, HEADER_LEN, Role::Responder, key)
}

fn seal(out: &mut [u8], n: usize, role: Role, key: Option<&AuthKey>) -> usize {
    match key {
        None => n,
        Some(k) => {
            let m = mac(k, role, &out[..n]);
            out[n..n + MAC_LEN].copy_from_slice(&m);
            n + MAC_LEN
        }
    }
}

/// Decodes one received message. With `key`, a message without a valid MAC is refused; without
/// one, a MAC is ignored (the sender's engine has a key, this one does not).
pub fn decode<'a>(msg: &'a [u8], key: Option<&AuthKey>) -> Result<Message<'a>, DecodeError> {
    let mut h = Reader::new(Reader::new(msg).bytes("header", HEADER_LEN)?);
    let version = h.u8("version")?;
    if version != VERSION {
        return Err(DecodeError::Version(version));
    }
    let (kind, code, flags) = (h.u8("kind")?, h.u8("code")?, h.u8("flags")?);
    let seq = h.u64("sequence number")?;
    let max = h.u32("largest payload")?;
    let reply_len = h.u16("reply address length")? as usize;
    if flags & !FLAG_MAC != 0 || h.u16("reserved")? != 0 {
        return Err(DecodeError::Malformed);
    }
    let signed_len = if flags & FLAG_MAC != 0 {
        msg.len()
            .checked_sub(MAC_LEN)
            .filter(|&n| n >= HEADER_LEN)
            .ok_or(DecodeError::Truncated)?
    } else {
        msg.len()
    };
    if let Some(k) = key {
        if flags & FLAG_MAC == 0 {
            return Err(DecodeError::Unauthenticated);
        }
        let role = if kind == KIND_NOTIFY {
            Role::Initiator
        } else {
            Role::Responder
        };
        let digest: [u8; 32] = Sha256::digest(&msg[..signed_len]).into();
        if !k.verify(role, MAC_CONTEXT, &digest, &[0u8; 32], &msg[signed_len..]) {
            return Err(DecodeError::Unauthenticated);
        }
    }
    let mut rest = Reader::new(&msg[HEADER_LEN..signed_len]);
    match kind {
        KIND_NOTIFY => {
            if code != 0 || max != 0 || reply_len == 0 || reply_len > MAX_REPLY_ADDR {
                return Err(DecodeError::Malformed);
            }
            let reply = rest.bytes("reply address", reply_len)?;
            Ok(Message::Notify {
                seq,
                reply,
                body: rest.rest(),
            })
        }
        KIND_ANSWER => {
            let outcome = Outcome::from_code(code).ok_or(DecodeError::Malformed)?;
            if reply_len != 0 || rest.end().is_err() || (max != 0 && outcome != Outcome::TooLarge) {
                return Err(DecodeError::Malformed);
            }
            Ok(Message::Answer { seq, outcome, max })
        }
        _ => Err(DecodeError::Malformed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(b: u8) -> AuthKey {
        AuthKey::from_bytes(&[b; 32]).unwrap()
    }

    #[test]
    fn round_trips_with_and_without_a_key() {
        for k in [None, Some(key(1))] {
            let mut buf = vec![0u8; 512];
            let n = encode_notify(&mut buf, 7, b"addr", b"\x01abody", k.as_ref());
            assert_eq!(n, HEADER_LEN + 4 + 6 + if k.is_some() { MAC_LEN } else { 0 });
            assert_eq!(
                decode(&buf[..n], k.as_ref()),
                Ok(Message::Notify {
                    seq: 7,
                    reply: b"addr",
                    body: b"\x01abody"
                })
            );
            let n = encode_answer(&mut buf, 9, Outcome::TooLarge, 4096, k.as_ref());
            assert_eq!(
                decode(&buf[..n], k.as_ref()),
                Ok(Message::Answer {
                    seq: 9,
                    outcome: Outcome::TooLarge,
                    max: 4096
                })
            );
        }
    }

    #[test]
    fn forged_or_unsigned_messages_are_refused_under_a_key() {
        let mut buf = vec![0u8; 512];
        // No MAC at all.
        let n = encode_notify(&mut buf, 1, b"a", b"\x00", None);
        assert_eq!(decode(&buf[..n], Some(&key(1))), Err(DecodeError::Unauthenticated));
        // Another key's MAC.
        let n = encode_notify(&mut buf, 1, b"a", b"\x00", Some(&key(2)));
        assert_eq!(decode(&buf[..n], Some(&key(1))), Err(DecodeError::Unauthenticated));
        // A changed sender name under a valid MAC.
        let n = encode_notify(&mut buf, 1, b"a", b"\x01x", Some(&key(1)));
        buf[HEADER_LEN + 2] = b'y';
        assert_eq!(decode(&buf[..n], Some(&key(1))), Err(DecodeError::Unauthenticated));
        // An answer's MAC does not pass for a notification's (roles differ).
        let n = encode_answer(&mut buf, 1, Outcome::Accepted, 0, Some(&key(1)));
        buf[1] = KIND_NOTIFY;
        assert_eq!(decode(&buf[..n], Some(&key(1))), Err(DecodeError::Unauthenticated));
    }

    #[test]
    fn hostile_headers_are_refused() {
        let mut buf = vec![0u8; 64];
        let n = encode_notify(&mut buf, 1, b"a", b"", None);
        assert_eq!(decode(&buf[..HEADER_LEN - 1], None), Err(DecodeError::Truncated));
        let mut v = buf[..n].to_vec();
        v[0] = 2;
        assert_eq!(decode(&v, None), Err(DecodeError::Version(2)));
        let mut v = buf[..n].to_vec();
        v[16] = 200; // reply longer than the message
        assert_eq!(decode(&v, None), Err(DecodeError::Truncated));
        let mut v = buf[..n].to_vec();
        v[16..18].copy_from_slice(&((MAX_REPLY_ADDR + 1) as u16).to_le_bytes());
        assert_eq!(decode(&v, None), Err(DecodeError::Malformed));
        let mut v = buf[..n].to_vec();
        v[3] = 4;
        assert_eq!(decode(&v, None), Err(DecodeError::Malformed));
        let n = encode_answer(&mut buf, 1, Outcome::Accepted, 0, None);
        let mut v = buf[..n].to_vec();
        v[2] = 9;
        assert_eq!(decode(&v, None), Err(DecodeError::Malformed));
        let mut v = buf[..n].to_vec();
        v.push(0); // an answer carries nothing after its header
        assert_eq!(decode(&v, None), Err(DecodeError::Malformed));
        // A MAC flag on a message too short to hold one.
        let mut v = buf[..HEADER_LEN].to_vec();
        v[3] = FLAG_MAC;
        assert_eq!(decode(&v, None), Err(DecodeError::Truncated));
    }

    /// The exact bytes of a known NOTIFY and ANSWER, pinned before the header encoder moved onto
    /// te-base's wire kit: every message starts with these 20 bytes, so they must not change.
    #[test]
    fn known_messages_have_these_exact_bytes() {
        let notify_head: [u8; HEADER_LEN] = [
            1, 1, 0, 0, // version, kind NOTIFY, code, flags
            0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, // sequence number
            0, 0, 0, 0, // largest payload
            3, 0, 0, 0, // reply address length, reserved
        ];
        // Every byte is written, whatever the buffer held before.
        let mut buf = [0xeeu8; 64];
        let n = encode_notify(&mut buf, 0x1112_1314_1516_1718, b"rep", b"\x01nbody", None);
        assert_eq!(&buf[..HEADER_LEN], &notify_head);
        assert_eq!(&buf[HEADER_LEN..n], b"rep\x01nbody");
        assert!(buf[n..].iter().all(|&b| b == 0xee), "nothing written past the message");

        let answer_head: [u8; HEADER_LEN] = [
            1, 2, 2, 0, // version, kind ANSWER, outcome TooLarge, flags
            0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21, // sequence number
            0x04, 0x03, 0x02, 0x01, // largest payload
            0, 0, 0, 0, // reply address length, reserved
        ];
        let mut buf = [0xeeu8; ANSWER_LEN + 8];
        let n = encode_answer(&mut buf, 0x2122_2324_2526_2728, Outcome::TooLarge, 0x0102_0304, None);
        assert_eq!(&buf[..n], &answer_head);
        assert!(buf[n..].iter().all(|&b| b == 0xee));

        // Under a key: the same header with the MAC flag, then the MAC of everything before it.
        let k = key(5);
        let mut signed = answer_head;
        signed[3] = FLAG_MAC;
        let mut buf = [0xeeu8; ANSWER_LEN];
        assert_eq!(
            encode_answer(
                &mut buf,
                0x2122_2324_2526_2728,
                Outcome::TooLarge,
                0x0102_0304,
                Some(&k)
            ),
            ANSWER_LEN
        );
        assert_eq!(&buf[..HEADER_LEN], &signed);
        assert_eq!(&buf[HEADER_LEN..], &mac(&k, Role::Responder, &signed));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(msg in proptest::collection::vec(any::<u8>(), 0..400), keyed in any::<bool>()) {
            let k = keyed.then(|| key(3));
            match decode(&msg, k.as_ref()) {
                Ok(Message::Notify { reply, body, .. }) => {
                    prop_assert!(!reply.is_empty() && reply.len() <= MAX_REPLY_ADDR);
                    prop_assert!(HEADER_LEN + reply.len() + body.len() <= msg.len());
                }
                Ok(Message::Answer { .. }) => prop_assert!(msg.len() == HEADER_LEN || msg.len() == ANSWER_LEN),
                Err(_) => {}
            }
        }

        /// The layout of every NOTIFY, as the table at the top of this file gives it.
        #[test]
        fn every_notify_has_the_pinned_layout(
            seq in any::<u64>(),
            reply in proptest::collection::vec(any::<u8>(), 1..=MAX_REPLY_ADDR),
            body in proptest::collection::vec(any::<u8>(), 0..64),
            keyed in any::<bool>(),
        ) {
            let k = keyed.then(|| key(6));
            let mut buf = vec![0xeeu8; notify_len(&reply, &body)];
            let n = encode_notify(&mut buf, seq, &reply, &body, k.as_ref());
            prop_assert_eq!(&buf[0..4], &[VERSION, KIND_NOTIFY, 0, keyed as u8][..]);
            prop_assert_eq!(&buf[4..12], &seq.to_le_bytes());
            prop_assert_eq!(&buf[12..16], &[0u8; 4]);
            prop_assert_eq!(&buf[16..18], &(reply.len() as u16).to_le_bytes());
            prop_assert_eq!(&buf[18..20], &[0u8; 2]);
            let end = HEADER_LEN + reply.len() + body.len();
            prop_assert_eq!(&buf[HEADER_LEN..HEADER_LEN + reply.len()], &reply[..]);
            prop_assert_eq!(&buf[HEADER_LEN + reply.len()..end], &body[..]);
            match &k {
                None => prop_assert_eq!(n, end),
                Some(k) => {
                    prop_assert_eq!(n, end + MAC_LEN);
                    prop_assert_eq!(&buf[end..n], &mac(k, Role::Initiator, &buf[..end]));
                }
            }
        }

        /// The layout of every ANSWER.
        #[test]
        fn every_answer_has_the_pinned_layout(
            seq in any::<u64>(),
            outcome in prop::sample::select(Outcome::ALL.to_vec()),
            max in any::<u32>(),
            keyed in any::<bool>(),
        ) {
            let k = keyed.then(|| key(7));
            let mut buf = [0xeeu8; ANSWER_LEN];
            let n = encode_answer(&mut buf, seq, outcome, max, k.as_ref());
            prop_assert_eq!(&buf[0..4], &[VERSION, KIND_ANSWER, outcome.code(), keyed as u8][..]);
            prop_assert_eq!(&buf[4..12], &seq.to_le_bytes());
            prop_assert_eq!(&buf[12..16], &max.to_le_bytes());
            prop_assert_eq!(&buf[16..20], &[0u8; 4]);
            prop_assert_eq!(n, if keyed { ANSWER_LEN } else { HEADER_LEN });
        }

        #[test]
        fn mutated_messages_never_panic(
            seq in any::<u64>(),
            reply in proptest::collection::vec(any::<u8>(), 1..64),
            body in proptest::collection::vec(any::<u8>(), 0..200),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let k = key(4);
            let mut buf = vec![0u8; notify_len(&reply, &body)];
            let n = encode_notify(&mut buf, seq, &reply, &body, Some(&k));
            prop_assert_eq!(decode(&buf[..n], Some(&k)), Ok(Message::Notify { seq, reply: &reply, body: &body }));
            let i = at.index(n);
            let changed = buf[i] != byte;
            buf[i] = byte;
            let r = decode(&buf[..n], Some(&k));
            // Any change to a signed message is caught (by the MAC or the header checks).
            prop_assert!(!changed || r.is_err());
        }
    }
}
