//! The notification messages of the verbs transport, with no verbs calls.
//!
//! A notification is one SEND on the connection's first QP into one of the target's posted
//! receive buffers: an 8-byte header (format version, kind, sequence number; written and read
//! with te-base's wire kit) and the body te-base encodes (sender name, payload). The target
//! answers each with a zero-byte RDMA WRITE WITH IMMEDIATE on the same QP whose 32-bit immediate
//! carries the version, the outcome and the message's sequence number, so answers need no buffer
//! at either end.
//!
//! Flow control is by credits: the target advertises how many receive buffers it keeps posted
//! ([`NotifyParams::credits`]) and how large each is; a sender keeps at most that many messages
//! unanswered, and the target re-posts a buffer before it answers the message that used it, so a
//! well-behaved sender never finds the target without a posted receive.

use serde::{Deserialize, Serialize};
pub use te_base::notify::Outcome;
use te_base::wire::{Preamble, Reader, WireError, Writer};

/// Version of the message and answer format.
pub const NOTIFY_VERSION: u8 = 1;
/// Bytes of the message header.
pub const HEADER_LEN: usize = 8;
/// Kind byte of a notification message.
const KIND_NOTIFY: u8 = 1;
/// A message starts with its format version. No magic bytes: the receive ring a message lands in
/// carries nothing but notifications.
const PREAMBLE: Preamble = Preamble {
    magic: b"",
    version: NOTIFY_VERSION,
};
/// Largest credit count a sender accepts from a target's descriptor.
pub const MAX_CREDITS: u32 = 256;
/// Sequence numbers in answers are 24 bits wide.
const SEQ_MASK: u32 = 0x00ff_ffff;

/// What a target advertises about its notification receive ring (in its rdma endpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifyParams {
    /// [`NOTIFY_VERSION`].
    pub version: u8,
    /// Receive buffers kept posted for each connection: the most unanswered messages a sender
    /// may have.
    pub credits: u32,
    /// Largest payload the target's inbox accepts (`TE_NOTIFY_MAX_BYTES` there).
    pub max_bytes: u32,
}

impl NotifyParams {
    /// Bytes of one receive buffer: header, sender name length and name, payload.
    pub fn message_len(&self) -> usize {
        HEADER_LEN + 1 + te_base::notify::MAX_SENDER_NAME + self.max_bytes as usize
    }

    /// True when a sender can use these parameters (a known version, bounded sizes).
    pub fn usable(&self) -> bool {
        self.version == NOTIFY_VERSION
            && (1..=MAX_CREDITS).contains(&self.credits)
            && self.max_bytes as usize <= te_base::notify::MAX_PAYLOAD_LIMIT
    }
}

/// Writes the header of message `seq` into `out[..HEADER_LEN]`: version, kind, two reserved
/// zero bytes, `seq` (little endian).
pub fn encode_header(seq: u32, out: &mut [u8]) {
    let mut w = &mut out[..HEADER_LEN];
    PREAMBLE.write(&mut w);
    w.u8(KIND_NOTIFY);
    w.u16(0);
    w.u32(seq);
    debug_assert!(w.is_empty(), "HEADER_LEN is the fields above");
}

/// Splits a received message into its sequence number and body. The error names the field that
/// was wrong (short, another version, not a notification). The reserved bytes are not looked at.
pub fn decode_message(msg: &[u8]) -> Result<(u32, &[u8]), WireError> {
    let mut r = Reader::new(msg);
    PREAMBLE.check(&mut r)?;
    let at = r.position();
    let kind = r.u8("kind")?;
    if kind != KIND_NOTIFY {
        return Err(WireError::BadValue {
            field: "kind",
            at,
            value: kind.into(),
        });
    }
    r.u16("reserved")?;
    let seq = r.u32("sequence number")?;
    Ok((seq, r.rest()))
}

/// The immediate of the answer to message `seq`: version (4 bits), outcome (4 bits), the low 24
/// bits of `seq`.
pub fn encode_answer(outcome: Outcome, seq: u32) -> u32 {
    (u32::from(NOTIFY_VERSION) << 28) | (u32::from(outcome.code()) << 24) | (seq & SEQ_MASK)
}

/// Reads an answer's immediate: the outcome and the low 24 bits of the message's sequence number.
/// `None` for another version or an unknown outcome.
pub fn decode_answer(imm: u32) -> Option<(Outcome, u32)> {
    if imm >> 28 != u32::from(NOTIFY_VERSION) {
        return None;
    }
    let outcome = Outcome::from_code(((imm >> 24) & 0xf) as u8)?;
    Some((outcome, imm & SEQ_MASK))
}

/// True when an answer's 24-bit sequence number names message `seq`.
pub fn answers(answer_seq: u32, seq: u32) -> bool {
    answer_seq == seq & SEQ_MASK
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn headers_and_answers_round_trip() {
        let mut msg = vec![0u8; HEADER_LEN + 3];
        encode_header(0xdead_beef, &mut msg);
        msg[HEADER_LEN..].copy_from_slice(b"abc");
        assert_eq!(decode_message(&msg), Ok((0xdead_beef, &b"abc"[..])));
        for o in [
            Outcome::Accepted,
            Outcome::QueueFull,
            Outcome::TooLarge,
            Outcome::Malformed,
        ] {
            let (got, seq) = decode_answer(encode_answer(o, 0x0123_4567)).unwrap();
            assert_eq!(got, o);
            assert!(answers(seq, 0x0123_4567));
            assert!(!answers(seq, 0x0123_4568));
        }
    }

    /// One header's exact bytes: version 1, kind 1, two zero bytes, the sequence number little
    /// endian. Pinned so a change of encoder cannot change what a peer of another build reads.
    #[test]
    fn a_known_header_has_exactly_these_bytes() {
        let mut header = [0xaau8; HEADER_LEN];
        encode_header(0x0403_0201, &mut header);
        assert_eq!(header, [1, 1, 0, 0, 0x01, 0x02, 0x03, 0x04]);
        let msg = [1, 1, 0, 0, 0x01, 0x02, 0x03, 0x04, b'h', b'i'];
        assert_eq!(decode_message(&msg).ok(), Some((0x0403_0201, &b"hi"[..])));
    }

    #[test]
    fn hostile_messages_are_refused() {
        assert!(matches!(
            decode_message(&[]),
            Err(WireError::Truncated {
                field: "version",
                at: 0,
                ..
            })
        ));
        assert_eq!(
            decode_message(&[1, 1, 0, 0, 0, 0, 0]),
            Err(WireError::Truncated {
                field: "sequence number",
                at: 4,
                need: 4,
                left: 3
            })
        );
        assert_eq!(
            decode_message(&[2, 1, 0, 0, 0, 0, 0, 0]),
            Err(WireError::BadVersion { got: 2, speaks: 1 })
        );
        assert_eq!(
            decode_message(&[1, 9, 0, 0, 0, 0, 0, 0]),
            Err(WireError::BadValue {
                field: "kind",
                at: 1,
                value: 9
            })
        );
        // Every cut of a header is refused, naming the field it cut.
        let mut header = [0u8; HEADER_LEN];
        encode_header(7, &mut header);
        for cut in 0..HEADER_LEN {
            assert!(
                matches!(decode_message(&header[..cut]), Err(WireError::Truncated { .. })),
                "cut at {cut}"
            );
        }
        assert_eq!(decode_answer(0), None, "version 0");
        assert_eq!(decode_answer((1 << 28) | (7 << 24)), None, "unknown outcome");
    }

    #[test]
    fn params_bound_what_a_sender_accepts() {
        let p = NotifyParams {
            version: NOTIFY_VERSION,
            credits: 16,
            max_bytes: 4096,
        };
        assert!(p.usable());
        assert_eq!(p.message_len(), 8 + 1 + 255 + 4096);
        assert!(!NotifyParams { credits: 0, ..p }.usable());
        assert!(!NotifyParams {
            credits: MAX_CREDITS + 1,
            ..p
        }
        .usable());
        assert!(!NotifyParams { version: 2, ..p }.usable());
        assert!(!NotifyParams {
            max_bytes: (te_base::notify::MAX_PAYLOAD_LIMIT + 1) as u32,
            ..p
        }
        .usable());
    }

    proptest! {
        #[test]
        fn message_decoder_never_panics(msg in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok((seq, body)) = decode_message(&msg) {
                // An accepted message re-encodes to the same header.
                let mut header = [0u8; HEADER_LEN];
                encode_header(seq, &mut header);
                prop_assert_eq!(&header[..2], &msg[..2]);
                prop_assert_eq!(&header[4..], &msg[4..HEADER_LEN]);
                prop_assert_eq!(body, &msg[HEADER_LEN..]);
            }
        }

        #[test]
        fn every_header_is_version_kind_two_zero_bytes_and_the_sequence_number(seq in any::<u32>(), reserved in any::<[u8; 2]>(), body in proptest::collection::vec(any::<u8>(), 0..16)) {
            let s = seq.to_le_bytes();
            let mut header = [0xaau8; HEADER_LEN];
            encode_header(seq, &mut header);
            prop_assert_eq!(header, [1, 1, 0, 0, s[0], s[1], s[2], s[3]]);
            // Readers do not look at the two reserved bytes.
            let mut msg = vec![1, 1, reserved[0], reserved[1], s[0], s[1], s[2], s[3]];
            msg.extend_from_slice(&body);
            prop_assert_eq!(decode_message(&msg).ok(), Some((seq, &body[..])));
        }

        #[test]
        fn answer_decoder_never_panics(imm in any::<u32>()) {
            if let Some((o, seq)) = decode_answer(imm) {
                prop_assert_eq!(encode_answer(o, seq), imm);
            }
        }

        #[test]
        fn answers_round_trip(seq in any::<u32>(), o in 0u8..4) {
            let o = [Outcome::Accepted, Outcome::QueueFull, Outcome::TooLarge, Outcome::Malformed][o as usize];
            let (got, s) = decode_answer(encode_answer(o, seq)).unwrap();
            prop_assert_eq!(got, o);
            prop_assert!(answers(s, seq));
        }
    }
}
