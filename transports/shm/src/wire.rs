//! The control connection's frames: pure encoding and decoding, no I/O.
//!
//! Every frame is a 24-byte header (opcode, code, 2 reserved bytes, body length, two 64-bit
//! arguments, little-endian) and a body of at most [`MAX_BODY`] bytes. Fields are read and
//! written with te-base's wire kit (`te_base::wire`), whose errors name the field and its offset.

pub use te_base::wire::WireError;
use te_base::wire::{Reader, Writer};

/// Header bytes.
pub const HEADER_LEN: usize = 24;
/// Largest body a peer may send (a region update of [`MAX_RANGES`] ranges, 1 MiB).
pub const MAX_BODY: u32 = 1 << 20;
/// Ranges per region-update frame.
pub const MAX_RANGES: usize = (MAX_BODY as usize - 8) / 16;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Opcode {
    /// Initiator: `a` = the token it expects, `b` = 1 when the body is an auth nonce.
    Hello = 1,
    /// Target: its nonce and proof (body), when it has a key.
    Challenge = 2,
    /// Initiator: its proof.
    Proof = 3,
    /// Target: accepted; `a` = its token, `b` = the address of its probe byte.
    Welcome = 4,
    /// Target: refused; `code` says why, the body is a message.
    Refuse = 5,
    /// Target: exported ranges added (`code` 0) or revoked (`code` 1) at epoch `a`; body: ranges.
    Regions = 6,
    /// Initiator: every region update up to epoch `a` is applied.
    Ack = 7,
    /// Initiator: a notification; `a` = its sequence number, body per `te_base::notify`.
    Note = 8,
    /// Target: the answer to notification `a`; `code` = `te_base::notify::Outcome`, `b` = its
    /// largest accepted payload.
    NoteAck = 9,
    /// Target: the sealed memfd behind exported range `[a, a + b)` travels with this frame
    /// (`SCM_RIGHTS`); the body is the range's 8-byte offset in the file. Sent once per region,
    /// before the [`Opcode::Regions`] update (or the [`Opcode::Welcome`]) that exports it; the
    /// initiator checks the seals, maps it shared and copies into the mapping.
    RegionFd = 10,
}

impl Opcode {
    fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            1 => Opcode::Hello,
            2 => Opcode::Challenge,
            3 => Opcode::Proof,
            4 => Opcode::Welcome,
            5 => Opcode::Refuse,
            6 => Opcode::Regions,
            7 => Opcode::Ack,
            8 => Opcode::Note,
            9 => Opcode::NoteAck,
            10 => Opcode::RegionFd,
            _ => return None,
        })
    }
}

/// Why a target refused a connection (the code of a [`Opcode::Refuse`] frame).
pub mod refusal {
    /// The socket's owner is not the instance the initiator asked for (it restarted).
    pub const WRONG_INSTANCE: u8 = 1;
    /// Authentication failed or was required.
    pub const UNAUTHENTICATED: u8 = 2;
    /// The initiator's uid is not allowed.
    pub const UID: u8 = 3;
    /// Too many connections.
    pub const BUSY: u8 = 4;
}

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What it is.
    pub op: Opcode,
    /// Opcode-specific small value.
    pub code: u8,
    /// Body length.
    pub len: u32,
    /// First argument.
    pub a: u64,
    /// Second argument.
    pub b: u64,
}

impl Header {
    /// A header with no body and zero arguments.
    pub fn new(op: Opcode) -> Header {
        Header {
            op,
            code: 0,
            len: 0,
            a: 0,
            b: 0,
        }
    }

    /// Appends its bytes to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.u8(self.op as u8);
        out.u8(self.code);
        out.u16(0);
        out.u32(self.len);
        out.u64(self.a);
        out.u64(self.b);
    }

    /// Its bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = Vec::with_capacity(HEADER_LEN);
        self.encode_into(&mut out);
        out.try_into().expect("a header is HEADER_LEN bytes")
    }

    /// Decodes and bounds-checks a header (the reserved bytes are not looked at).
    pub fn decode(raw: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
        let mut r = Reader::new(raw);
        let op = r.u8("opcode")?;
        let op = Opcode::from_u8(op).ok_or(WireError::BadValue {
            field: "opcode",
            at: 0,
            value: op as u64,
        })?;
        let code = r.u8("code")?;
        r.bytes("reserved", 2)?;
        let len = r.u32("body length")?;
        if len > MAX_BODY {
            return Err(WireError::TooLarge {
                field: "body",
                len: len as u64,
                max: MAX_BODY as u64,
            });
        }
        Ok(Header {
            op,
            code,
            len,
            a: r.u64("a")?,
            b: r.u64("b")?,
        })
    }
}

/// Encodes `(base, len)` ranges as a region-update body.
pub fn encode_ranges(ranges: &[(u64, u64)], out: &mut Vec<u8>) {
    out.reserve(ranges.len() * 16);
    for (base, len) in ranges {
        out.u64(*base);
        out.u64(*len);
    }
}

/// Decodes a [`Opcode::RegionFd`] frame: `(base, len, offset)`; a zero length, a range that
/// overflows or a body that is not 8 bytes is an error.
pub fn decode_region_fd(h: &Header, body: &[u8]) -> Result<(u64, u64, u64), WireError> {
    let mut r = Reader::new(body);
    let offset = r.u64("memfd offset")?;
    r.end()?;
    if h.b == 0 || h.a.checked_add(h.b).is_none() || offset.checked_add(h.b).is_none() {
        return Err(WireError::Inconsistent {
            field: "region",
            at: 0,
            what: "empty, or past the end of the address space or of the file",
        });
    }
    Ok((h.a, h.b, offset))
}

/// Decodes a region-update body (`(u64 base, u64 len)*`); ranges of zero length or that
/// overflow are errors.
pub fn decode_ranges(body: &[u8]) -> Result<Vec<(u64, u64)>, WireError> {
    if !body.len().is_multiple_of(16) {
        return Err(WireError::Inconsistent {
            field: "ranges",
            at: 0,
            what: "not a whole number of 16-byte ranges",
        });
    }
    let mut r = Reader::new(body);
    let mut ranges = Vec::with_capacity(body.len() / 16);
    while r.remaining() > 0 {
        let at = r.position();
        let (base, len) = (r.u64("range base")?, r.u64("range length")?);
        if len == 0 || base.checked_add(len).is_none() {
            return Err(WireError::Inconsistent {
                field: "range",
                at,
                what: "empty, or past the end of the address space",
            });
        }
        ranges.push((base, len));
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_errors() {
        let h = Header {
            op: Opcode::Regions,
            code: 1,
            len: 32,
            a: 7,
            b: u64::MAX,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut raw = h.encode();
        raw[0] = 0;
        assert_eq!(
            Header::decode(&raw),
            Err(WireError::BadValue {
                field: "opcode",
                at: 0,
                value: 0
            })
        );
        let mut raw = h.encode();
        raw[4..8].copy_from_slice(&(MAX_BODY + 1).to_le_bytes());
        assert!(matches!(Header::decode(&raw), Err(WireError::TooLarge { .. })));
        // Any 24 bytes decode or fail, never panic.
        for seed in 0..2000u64 {
            let mut raw = [0u8; HEADER_LEN];
            for (i, b) in raw.iter_mut().enumerate() {
                *b = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (i % 8 * 8)) as u8 ^ i as u8;
            }
            let _ = Header::decode(&raw);
        }
    }

    #[test]
    fn region_fd_frames_decode_strictly() {
        let h = Header {
            a: 0x1000,
            b: 4096,
            ..Header::new(Opcode::RegionFd)
        };
        assert_eq!(Header::decode(&h.encode()).unwrap().op, Opcode::RegionFd);
        assert_eq!(decode_region_fd(&h, &7u64.to_le_bytes()).unwrap(), (0x1000, 4096, 7));
        assert!(decode_region_fd(&h, &[0u8; 7]).is_err());
        assert!(decode_region_fd(&Header { b: 0, ..h }, &0u64.to_le_bytes()).is_err());
        assert!(decode_region_fd(&Header { a: u64::MAX, ..h }, &0u64.to_le_bytes()).is_err());
        assert!(decode_region_fd(&h, &u64::MAX.to_le_bytes()).is_err());
    }

    #[test]
    fn ranges_round_trip_and_bad_ones_are_errors() {
        let r = vec![(0x1000, 10), (u64::MAX - 5, 5)];
        let mut body = Vec::new();
        encode_ranges(&r, &mut body);
        assert_eq!(decode_ranges(&body).unwrap(), r);
        assert!(decode_ranges(&body[..17]).is_err());
        let mut zero = Vec::new();
        encode_ranges(&[(1, 0)], &mut zero);
        assert!(decode_ranges(&zero).is_err());
        let mut over = Vec::new();
        encode_ranges(&[(u64::MAX, 2)], &mut over);
        assert!(decode_ranges(&over).is_err());
    }
}
