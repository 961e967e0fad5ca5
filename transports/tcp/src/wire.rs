//! The wire format: a fixed 40-byte little-endian frame header, optionally followed by a payload.
//!
//! Pure encoding and decoding, no I/O, so the codec is tested (and fuzzed) without sockets. The
//! header is written in place and read with te-base's wire kit ([`te_base::wire`]), which also
//! writes and checks magic and version.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "TEtc"
//!      4     1  version (1)
//!      5     1  opcode
//!      6     2  code: error code on ERROR frames, 0 otherwise
//!      8     8  request id (per connection sequence number, echoed in the reply)
//!     16     8  token: the target's instance token (a restarted target has a new one; an
//!                   instance id, not a capability: access is granted by the shared key)
//!     24     8  address in the target's exported memory
//!     32     8  length in bytes (payload length for WRITE, READ_DATA, ERROR and NOTIFY)
//! ```
//!
//! A NOTIFY payload is a notification body (`te_base::notify::encode_body`: sender-name length,
//! name, message), decoded by `te_base::notify::decode_body`. The target answers NOTIFY_ACK once
//! the message is in its inbox, or an ERROR with code `QueueFull` or `TooLarge` (whose `addr`
//! carries the largest payload it accepts).

use std::fmt;

use te_base::wire::{Preamble, Reader, Writer};

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"TEtc";
/// Wire version this build speaks (2: authenticated HELLO, PING; 3: NOTIFY, NOTIFY_ACK).
pub const VERSION: u8 = 3;
/// Size of every frame header.
pub const HEADER_LEN: usize = 40;
/// Magic and version at the start of every frame.
pub const PREAMBLE: Preamble = Preamble {
    magic: &MAGIC,
    version: VERSION,
};
/// Largest data payload one frame may carry (slices are at most this long).
pub const MAX_DATA_LEN: u64 = 1 << 30;
/// Largest error message one frame may carry.
pub const MAX_ERROR_LEN: u64 = 4096;
/// Payload of a HELLO that starts authentication: the initiator's nonce.
pub const HELLO_AUTH_LEN: u64 = te_base::auth::NONCE_LEN as u64;
/// Payload of a CHALLENGE: the target's nonce, then its proof.
pub const CHALLENGE_LEN: u64 = (te_base::auth::NONCE_LEN + te_base::auth::PROOF_LEN) as u64;
/// Payload of a PROOF: the initiator's proof.
pub const PROOF_LEN: u64 = te_base::auth::PROOF_LEN as u64;

/// What a frame asks or answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Initiator -> target, first frame on a connection: `token` is the instance it expects; the
    /// payload is empty, or the initiator's nonce when it authenticates.
    Hello = 1,
    /// Target -> initiator: the hello was accepted; `addr` is the target's idle timeout in ms
    /// (the initiator pings idle connections well within it).
    HelloAck = 2,
    /// Initiator -> target: `len` payload bytes to store at `addr`.
    Write = 3,
    /// Target -> initiator: the write's bytes are in the target's memory.
    WriteAck = 4,
    /// Initiator -> target: send `len` bytes from `addr`.
    Read = 5,
    /// Target -> initiator: `len` payload bytes answering a read.
    ReadData = 6,
    /// Target -> initiator: the request was refused; payload is a UTF-8 reason, `code` says why.
    Error = 7,
    /// Target -> initiator, answering an authenticating HELLO: its nonce and its proof.
    Challenge = 8,
    /// Initiator -> target: the initiator's proof; HELLO_ACK (or an ERROR) follows.
    Proof = 9,
    /// Initiator -> target: keeps an idle connection open; no answer.
    Ping = 10,
    /// Initiator -> target: `len` payload bytes of a notification body for the target's inbox.
    Notify = 11,
    /// Target -> initiator: the notification is in the target's inbox.
    NotifyAck = 12,
}

impl Opcode {
    fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            1 => Opcode::Hello,
            2 => Opcode::HelloAck,
            3 => Opcode::Write,
            4 => Opcode::WriteAck,
            5 => Opcode::Read,
            6 => Opcode::ReadData,
            7 => Opcode::Error,
            8 => Opcode::Challenge,
            9 => Opcode::Proof,
            10 => Opcode::Ping,
            11 => Opcode::Notify,
            12 => Opcode::NotifyAck,
            _ => return None,
        })
    }

    /// True if `len` counts payload bytes following the header.
    pub fn has_payload(self) -> bool {
        matches!(
            self,
            Opcode::Hello
                | Opcode::Write
                | Opcode::ReadData
                | Opcode::Error
                | Opcode::Challenge
                | Opcode::Proof
                | Opcode::Notify
        )
    }

    fn max_len(self) -> u64 {
        match self {
            Opcode::Hello => HELLO_AUTH_LEN,
            Opcode::HelloAck => 0,
            Opcode::Challenge => CHALLENGE_LEN,
            Opcode::Proof => PROOF_LEN,
            Opcode::Ping | Opcode::NotifyAck => 0,
            Opcode::Notify => te_base::notify::MAX_BODY_LEN as u64,
            Opcode::Error => MAX_ERROR_LEN,
            Opcode::Write | Opcode::WriteAck | Opcode::Read | Opcode::ReadData => MAX_DATA_LEN,
        }
    }
}

/// Why a target refused a request (the `code` of an ERROR frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum RefusalCode {
    /// The range is not inside one registered, exported region (or it overflows).
    OutOfBounds = 1,
    /// The request names another instance of the target (it restarted).
    WrongInstance = 2,
    /// The frame broke the protocol; the target closes the connection after this frame.
    Protocol = 3,
    /// Zero-length request.
    ZeroLength = 4,
    /// The initiator did not authenticate (or the target demands a key it lacks); the target
    /// closes the connection after this frame.
    Unauthenticated = 5,
    /// The notification was not queued: the target's inbox is full.
    QueueFull = 6,
    /// The notification payload is above what the target accepts (the frame's `addr`).
    TooLarge = 7,
}

impl RefusalCode {
    /// Decodes a code; unknown codes from a newer peer map to `Protocol`.
    pub fn from_u16(v: u16) -> RefusalCode {
        match v {
            1 => RefusalCode::OutOfBounds,
            2 => RefusalCode::WrongInstance,
            4 => RefusalCode::ZeroLength,
            5 => RefusalCode::Unauthenticated,
            6 => RefusalCode::QueueFull,
            7 => RefusalCode::TooLarge,
            _ => RefusalCode::Protocol,
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub opcode: Opcode,
    /// Error code (ERROR frames only; 0 otherwise).
    pub code: u16,
    /// Request id, echoed in the reply.
    pub request_id: u64,
    /// The target's instance token.
    pub token: u64,
    /// Address in the target's memory.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A header that cannot be accepted. Any of these ends the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// Not our magic (another protocol, or the stream lost sync) or another version: te-base's
    /// wire error says which.
    Frame(te_base::wire::WireError),
    /// An unknown opcode.
    BadOpcode(u8),
    /// A non-zero code on a frame other than ERROR.
    StrayCode { opcode: Opcode, code: u16 },
    /// A length above the limit of the opcode.
    Oversized { opcode: Opcode, len: u64, max: u64 },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Frame(e) => write!(f, "{e}"),
            WireError::BadOpcode(o) => write!(f, "unknown opcode {o}"),
            WireError::StrayCode { opcode, code } => write!(f, "{opcode:?} frame carries error code {code}"),
            WireError::Oversized { opcode, len, max } => {
                write!(f, "{opcode:?} frame length {len} exceeds the limit {max}")
            }
        }
    }
}

impl std::error::Error for WireError {}

impl From<te_base::wire::WireError> for WireError {
    fn from(e: te_base::wire::WireError) -> Self {
        WireError::Frame(e)
    }
}

impl Header {
    /// A header with every numeric field zero.
    pub fn new(opcode: Opcode) -> Header {
        Header {
            opcode,
            code: 0,
            request_id: 0,
            token: 0,
            addr: 0,
            len: 0,
        }
    }

    /// Number of payload bytes that follow this header.
    pub fn payload_len(&self) -> u64 {
        if self.opcode.has_payload() {
            self.len
        } else {
            0
        }
    }

    /// Encodes into `out`, in place, in the order of the table above.
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        let mut w: &mut [u8] = out;
        PREAMBLE.write(&mut w);
        w.u8(self.opcode as u8);
        w.u16(self.code);
        w.u64(self.request_id);
        w.u64(self.token);
        w.u64(self.addr);
        w.u64(self.len);
        debug_assert!(w.is_empty(), "the fields fill the header exactly");
    }

    /// Encodes into a new array.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        self.encode(&mut out);
        out
    }

    /// Decodes and validates a header.
    #[inline]
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
        let mut r = Reader::new(bytes);
        PREAMBLE.check(&mut r)?;
        let op = r.u8("opcode")?;
        let opcode = Opcode::from_u8(op).ok_or(WireError::BadOpcode(op))?;
        let code = r.u16("code")?;
        if code != 0 && opcode != Opcode::Error {
            return Err(WireError::StrayCode { opcode, code });
        }
        let request_id = r.u64("request id")?;
        let token = r.u64("token")?;
        let addr = r.u64("address")?;
        let len = r.u64("length")?;
        let max = opcode.max_len();
        if len > max {
            return Err(WireError::Oversized { opcode, len, max });
        }
        Ok(Header {
            opcode,
            code,
            request_id,
            token,
            addr,
            len,
        })
    }

    /// Decodes the header at the start of `buf`: `Ok(None)` when fewer than [`HEADER_LEN`] bytes
    /// are there yet (a truncated frame is not an error until the stream ends).
    pub fn decode_prefix(buf: &[u8]) -> Result<Option<Header>, WireError> {
        match buf.get(..HEADER_LEN) {
            Some(h) => {
                let mut arr = [0u8; HEADER_LEN];
                arr.copy_from_slice(h);
                Header::decode(&arr).map(Some)
            }
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opcode() -> impl Strategy<Value = Opcode> {
        prop_oneof![
            Just(Opcode::Hello),
            Just(Opcode::HelloAck),
            Just(Opcode::Write),
            Just(Opcode::WriteAck),
            Just(Opcode::Read),
            Just(Opcode::ReadData),
            Just(Opcode::Error),
            Just(Opcode::Challenge),
            Just(Opcode::Proof),
            Just(Opcode::Ping),
            Just(Opcode::Notify),
            Just(Opcode::NotifyAck),
        ]
    }

    proptest! {
        #[test]
        fn valid_headers_round_trip(op in opcode(), id: u64, token: u64, addr: u64, len: u64, code: u16) {
            let h = Header {
                opcode: op,
                code: if op == Opcode::Error { code } else { 0 },
                request_id: id,
                token,
                addr,
                len: len % op.max_len().saturating_add(1).max(1),
            };
            prop_assert_eq!(Header::decode(&h.to_bytes()), Ok(h));
            prop_assert_eq!(Header::decode_prefix(&h.to_bytes()), Ok(Some(h)));
        }

        /// The layout of every header, as the table at the top of this file gives it.
        #[test]
        fn every_header_has_the_pinned_layout(op in opcode(), code: u16, id: u64, token: u64, addr: u64, len: u64) {
            let b = Header { opcode: op, code, request_id: id, token, addr, len }.to_bytes();
            prop_assert_eq!(&b[0..4], b"TEtc");
            prop_assert_eq!(b[4], VERSION);
            prop_assert_eq!(b[5], op as u8);
            prop_assert_eq!(&b[6..8], &code.to_le_bytes());
            prop_assert_eq!(&b[8..16], &id.to_le_bytes());
            prop_assert_eq!(&b[16..24], &token.to_le_bytes());
            prop_assert_eq!(&b[24..32], &addr.to_le_bytes());
            prop_assert_eq!(&b[32..40], &len.to_le_bytes());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            // Whatever comes back, decoding must not panic, and an accepted header re-encodes
            // to exactly the bytes it came from.
            if let Ok(Some(h)) = Header::decode_prefix(&bytes) {
                prop_assert_eq!(&h.to_bytes()[..], &bytes[..HEADER_LEN]);
                prop_assert!(h.len <= h.opcode.max_len());
            }
        }

        #[test]
        fn truncated_headers_are_incomplete(op in opcode(), cut in 0usize..HEADER_LEN) {
            let h = Header::new(op).to_bytes();
            prop_assert_eq!(Header::decode_prefix(&h[..cut]), Ok(None));
        }
    }

    /// The exact bytes of a known header, pinned before the encoder moved onto te-base's wire
    /// kit: every frame starts with these 40 bytes, so they must not change.
    #[test]
    fn a_known_header_has_these_exact_bytes() {
        let h = Header {
            opcode: Opcode::Error,
            code: 0x0a0b,
            request_id: 0x1112_1314_1516_1718,
            token: 0x2122_2324_2526_2728,
            addr: 0x3132_3334_3536_3738,
            len: 0x0102,
        };
        let expected: [u8; HEADER_LEN] = [
            b'T', b'E', b't', b'c', 3, 7, 0x0b, 0x0a, // magic, version, opcode, code
            0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, // request id
            0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21, // token
            0x38, 0x37, 0x36, 0x35, 0x34, 0x33, 0x32, 0x31, // address
            0x02, 0x01, 0, 0, 0, 0, 0, 0, // length
        ];
        assert_eq!(h.to_bytes(), expected);
        // Every byte is written, whatever the buffer held before.
        let mut out = [0xeeu8; HEADER_LEN];
        h.encode(&mut out);
        assert_eq!(out, expected);
        assert_eq!(Header::decode(&expected), Ok(h));
    }

    #[test]
    fn hostile_headers_are_rejected() {
        let good = Header {
            len: 8,
            ..Header::new(Opcode::Write)
        }
        .to_bytes();

        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            Header::decode(&b),
            Err(WireError::Frame(te_base::wire::WireError::BadMagic { .. }))
        ));

        let mut b = good;
        b[4] = 2;
        assert_eq!(
            Header::decode(&b),
            Err(WireError::Frame(te_base::wire::WireError::BadVersion {
                got: 2,
                speaks: VERSION
            }))
        );

        for op in [0u8, 13, 200, 255] {
            let mut b = good;
            b[5] = op;
            assert_eq!(Header::decode(&b), Err(WireError::BadOpcode(op)));
        }

        let mut b = good;
        b[32..40].copy_from_slice(&(MAX_DATA_LEN + 1).to_le_bytes());
        assert!(matches!(Header::decode(&b), Err(WireError::Oversized { .. })));
        b[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(Header::decode(&b), Err(WireError::Oversized { .. })));

        let mut b = Header::new(Opcode::Error).to_bytes();
        b[32..40].copy_from_slice(&(MAX_ERROR_LEN + 1).to_le_bytes());
        assert!(matches!(Header::decode(&b), Err(WireError::Oversized { .. })));

        let mut b = Header::new(Opcode::Hello).to_bytes();
        b[32] = HELLO_AUTH_LEN as u8 + 1;
        assert!(matches!(Header::decode(&b), Err(WireError::Oversized { .. })));
        let mut b = Header::new(Opcode::Ping).to_bytes();
        b[32] = 1;
        assert!(matches!(Header::decode(&b), Err(WireError::Oversized { .. })));
        let mut b = Header::new(Opcode::NotifyAck).to_bytes();
        b[32] = 1;
        assert!(matches!(Header::decode(&b), Err(WireError::Oversized { .. })));
        let mut b = Header::new(Opcode::Notify).to_bytes();
        b[32..40].copy_from_slice(&(te_base::notify::MAX_BODY_LEN as u64 + 1).to_le_bytes());
        assert!(matches!(Header::decode(&b), Err(WireError::Oversized { .. })));

        let mut b = good;
        b[6] = 1;
        assert!(matches!(Header::decode(&b), Err(WireError::StrayCode { .. })));
    }

    #[test]
    fn payload_len_only_for_payload_opcodes() {
        let h = Header {
            len: 10,
            ..Header::new(Opcode::Read)
        };
        assert_eq!(h.payload_len(), 0);
        let h = Header {
            len: 10,
            ..Header::new(Opcode::Write)
        };
        assert_eq!(h.payload_len(), 10);
    }
}
