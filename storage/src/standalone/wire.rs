//! The standalone wire: a compact, versioned, length-prefixed binary protocol over the Unix socket
//! between workers and `umbp-server`. No KV byte travels here: requests name keys (or a key
//! handle) and ranges of the worker's own shared memory; replies say what was delivered.
//!
//! Every frame is an 8-byte header `b"UB" | version | op | payload length (u32 LE)` and a payload of
//! little-endian fields. Decoding is separate from socket I/O, borrows from the frame (keys are
//! `&str` into it, ranges a byte slice of 24-byte records) and reads through te-base's wire kit
//! ([`te_base::wire`]): every read is bounds-checked and every count checked against the bytes
//! left, so a hostile frame yields a [`WireError`] naming the field, never a panic or an
//! allocation it announced. The stats reply is encoded from one table per section
//! ([`te_base::stats_table!`]).
//!
//! Why not gRPC: a ranged get is a few microseconds of copying inside the server; HTTP/2 framing,
//! protobuf and a runtime per call would cost more than the call. A fixed header and flat records
//! decode with no allocation per key or range.

use crate::core::stats::CoreStats;
use crate::error::{StoreError, Tier};
use crate::range_map::Range;
use crate::ssd::record::MAX_KEY_LEN;
use crate::standalone::stats::StandaloneStats;
use crate::store::stats::StoreStats;
/// The field writers under the name this module gave them before te-base's wire kit.
pub use te_base::wire::Writer as Put;
use te_base::wire::{Preamble, StatsTable};
pub use te_base::wire::{Reader, WireError, Writer};

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"UB";
/// Protocol version; a peer speaking another is refused at the header. 2: `StoreStats` carries
/// `resolve_reused` (33 counters). 3: stats in sections (core with hits and misses, the
/// server's standalone counters, an optional cluster section).
pub const VERSION: u8 = 3;
/// Bytes of a frame header.
pub const HEADER: usize = 8;
/// Magic and version at the start of every frame.
pub const PREAMBLE: Preamble = Preamble {
    magic: &MAGIC,
    version: VERSION,
};
/// Bytes of one encoded range: object offset, length, worker address.
pub const RANGE_BYTES: usize = 24;
/// `ranges_per_key` value saying each key carries its own count.
const PER_KEY_COUNTS: u32 = u32::MAX;

/// Request and reply operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Open a session (zero token) or join one (its token).
    Hello = 1,
    /// Register a sealed memfd (sent with `SCM_RIGHTS`) mapped at a worker base.
    Register = 2,
    /// Deregister the buffer at a worker base.
    Deregister = 3,
    /// Ranged get, naming its keys or a key handle.
    GetRanges = 4,
    /// Ranged put.
    PutRanges = 5,
    /// Whole-object get.
    GetWhole = 6,
    /// Does a key exist.
    Exists = 7,
    /// Consecutive prefix of keys that exist.
    ExistsConsecutive = 8,
    /// Remove a key.
    Remove = 9,
    /// Object lengths.
    ObjectLens = 10,
    /// Store counters.
    Stats = 11,
    /// Phase timings of ranged calls.
    PhaseReport = 12,
    /// Clear phase timings.
    ResetPhases = 13,
    /// Make puts durable.
    Flush = 14,
    /// Compact the SSD log.
    Compact = 15,
    /// The client's proof of the shared key (after a `Challenge`).
    Proof = 16,
    /// Reply: success, payload by request.
    Ok = 0x80,
    /// Reply: the call failed as a whole (an encoded [`StoreError`]).
    Err = 0x81,
    /// Reply: the key handle is not (or no longer) known; resend the keys.
    KeyHandleUnknown = 0x82,
    /// Reply to a hello when the server has a shared key: its nonce and proof.
    Challenge = 0x83,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        use Op::*;
        Some(match v {
            1 => Hello,
            2 => Register,
            3 => Deregister,
            4 => GetRanges,
            5 => PutRanges,
            6 => GetWhole,
            7 => Exists,
            8 => ExistsConsecutive,
            9 => Remove,
            10 => ObjectLens,
            11 => Stats,
            12 => PhaseReport,
            13 => ResetPhases,
            14 => Flush,
            15 => Compact,
            16 => Proof,
            0x80 => Ok,
            0x81 => Err,
            0x82 => KeyHandleUnknown,
            0x83 => Challenge,
            _ => return None,
        })
    }
}

/// An operation this side does not know, or one not valid here.
pub fn bad_op(op: u8) -> WireError {
    WireError::BadValue {
        field: "operation",
        at: 3,
        value: op as u64,
    }
}

/// Counts that contradict each other or the frame.
pub fn bad_count(field: &'static str) -> WireError {
    WireError::Inconsistent {
        field,
        at: 0,
        what: "counts that contradict each other or the frame",
    }
}

/// A field value out of its domain.
pub fn bad_value(field: &'static str) -> WireError {
    WireError::BadValue { field, at: 0, value: 0 }
}

impl From<WireError> for StoreError {
    fn from(e: WireError) -> Self {
        StoreError::Protocol { detail: e.to_string() }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The operation.
    pub op: Op,
    /// Payload bytes that follow.
    pub len: usize,
}

/// Decodes a header, refusing payloads over `max`.
pub fn decode_header(b: &[u8; HEADER], max: usize) -> Result<Header, WireError> {
    let mut r = Reader::new(b);
    PREAMBLE.check(&mut r)?;
    let op = r.u8("operation")?;
    let op = Op::from_u8(op).ok_or(bad_op(op))?;
    let len = r.u32("payload length")? as usize;
    if len > max {
        return Err(WireError::TooLarge {
            field: "frame",
            len: len as u64,
            max: max as u64,
        });
    }
    Ok(Header { op, len })
}

/// Starts a frame in `out` (cleared); [`finish`] writes its length.
pub fn begin(out: &mut Vec<u8>, op: Op) {
    out.clear();
    PREAMBLE.write(out);
    out.push(op as u8);
    out.extend_from_slice(&[0; 4]);
}

/// Writes the payload length of the frame in `out`.
pub fn finish(out: &mut [u8]) -> Result<(), WireError> {
    let len = out.len() - HEADER;
    let l32 = u32::try_from(len).map_err(|_| WireError::TooLarge {
        field: "frame",
        len: len as u64,
        max: u32::MAX as u64,
    })?;
    out[4..8].copy_from_slice(&l32.to_le_bytes());
    Ok(())
}

/// Keys as they travel: `u32 n | n x u16 length | the key bytes back to back`.
#[derive(Debug, Clone, Copy)]
pub struct Keys<'a> {
    lens: &'a [u8],
    blob: &'a str,
}

impl<'a> Keys<'a> {
    /// Encodes `keys`.
    pub fn encode<'k>(out: &mut Vec<u8>, keys: impl ExactSizeIterator<Item = &'k str> + Clone) {
        out.u32(keys.len() as u32);
        for k in keys.clone() {
            out.extend_from_slice(&(k.len().min(u16::MAX as usize) as u16).to_le_bytes());
        }
        for k in keys {
            out.extend_from_slice(&k.as_bytes()[..k.len().min(u16::MAX as usize)]);
        }
    }

    /// Decodes keys: lengths in `1..=MAX_KEY_LEN`, UTF-8, each on a character boundary.
    pub fn decode(r: &mut Reader<'a>) -> Result<Keys<'a>, WireError> {
        let n = r.count("key count", 2)?;
        let lens_at = r.position();
        let lens = r.bytes("key lengths", 2 * n)?;
        let mut total = 0usize;
        for (i, l) in lens.chunks_exact(2).enumerate() {
            let l = u16::from_le_bytes([l[0], l[1]]) as usize;
            if l == 0 || l > MAX_KEY_LEN {
                return Err(WireError::BadValue {
                    field: "key length",
                    at: lens_at + 2 * i,
                    value: l as u64,
                });
            }
            total += l;
        }
        let blob_at = r.position();
        let blob = r.bytes("keys", total)?;
        let blob = std::str::from_utf8(blob).map_err(|_| WireError::BadUtf8 {
            field: "keys",
            at: blob_at,
        })?;
        let keys = Keys { lens, blob };
        let mut at = 0;
        for l in keys.lens() {
            at += l;
            if !blob.is_char_boundary(at) {
                return Err(WireError::BadUtf8 {
                    field: "keys",
                    at: blob_at + at,
                });
            }
        }
        Ok(keys)
    }

    fn lens(&self) -> impl Iterator<Item = usize> + 'a {
        self.lens
            .chunks_exact(2)
            .map(|l| u16::from_le_bytes([l[0], l[1]]) as usize)
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.lens.len() / 2
    }

    /// True without keys.
    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    /// The keys in order.
    pub fn iter(&self) -> impl Iterator<Item = &'a str> + 'a {
        let blob = self.blob;
        let mut at = 0;
        self.lens().map(move |l| {
            let k = &blob[at..at + l];
            at += l;
            k
        })
    }

    /// The key bytes back to back.
    pub fn blob(&self) -> &'a str {
        self.blob
    }
}

/// Encoded ranges: 24-byte records `offset | len | worker address`.
#[derive(Debug, Clone, Copy)]
pub struct Ranges<'a>(pub &'a [u8]);

impl Ranges<'_> {
    /// Appends `ranges`.
    pub fn encode(out: &mut Vec<u8>, ranges: &[Range]) {
        out.reserve(ranges.len() * RANGE_BYTES);
        for r in ranges {
            out.u64(r.offset);
            out.u64(r.len);
            out.u64(r.addr);
        }
    }

    /// Number of ranges.
    pub fn len(&self) -> usize {
        self.0.len() / RANGE_BYTES
    }

    /// True without ranges.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The ranges.
    pub fn iter(&self) -> impl Iterator<Item = Range> + '_ {
        self.0.chunks_exact(RANGE_BYTES).map(|c| {
            let f = |i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8 bytes"));
            Range::new(f(0), f(8), f(16))
        })
    }
}

/// How many ranges each key of a get has.
#[derive(Debug, Clone, Copy)]
pub enum Counts<'a> {
    /// Every key has this many (the common layer-group shape: one number on the wire).
    Uniform(u32),
    /// A u32 per key.
    PerKey(&'a [u8]),
}

impl Counts<'_> {
    /// The count of key `k`.
    pub fn get(&self, k: usize) -> usize {
        match self {
            Counts::Uniform(n) => *n as usize,
            Counts::PerKey(b) => u32::from_le_bytes(b[4 * k..4 * k + 4].try_into().expect("4 bytes")) as usize,
        }
    }
}

/// A decoded ranged get.
#[derive(Debug, Clone)]
pub struct GetRanges<'a> {
    /// The key handle named (0: none).
    pub handle: u64,
    /// Fingerprint of the key set (0: do not remember it).
    pub fingerprint: u64,
    /// Keys in the call.
    pub nkeys: usize,
    /// Ranges per key.
    pub counts: Counts<'a>,
    /// The keys, when sent (always when `handle` is 0).
    pub keys: Option<Keys<'a>>,
    /// All ranges, key by key.
    pub ranges: Ranges<'a>,
}

/// Encodes a ranged get: with `send_keys` false only the handle names the key set.
pub fn encode_get_ranges(
    out: &mut Vec<u8>,
    handle: u64,
    fingerprint: u64,
    items: &[crate::RangedGet<'_>],
    send_keys: bool,
) -> Result<(), WireError> {
    begin(out, Op::GetRanges);
    out.u64(if send_keys { 0 } else { handle });
    out.u64(fingerprint);
    out.u32(items.len() as u32);
    let first = items.first().map_or(0, |i| i.ranges.len());
    if items.iter().all(|i| i.ranges.len() == first) {
        out.u32(first as u32);
    } else {
        out.u32(PER_KEY_COUNTS);
        for it in items {
            out.u32(it.ranges.len() as u32);
        }
    }
    if send_keys {
        Keys::encode(out, items.iter().map(|i| i.key));
    }
    out.reserve(items.iter().map(|i| i.ranges.len()).sum::<usize>() * RANGE_BYTES);
    for it in items {
        Ranges::encode(out, it.ranges);
    }
    finish(out)
}

/// Decodes a ranged get.
pub fn decode_get_ranges(payload: &[u8]) -> Result<GetRanges<'_>, WireError> {
    let mut r = Reader::new(payload);
    let handle = r.u64("key handle")?;
    let fingerprint = r.u64("fingerprint")?;
    let nkeys_at = r.position();
    let nkeys = r.u32("key count")? as usize;
    let per = r.u32("ranges per key")?;
    let (counts, total) = if per == PER_KEY_COUNTS {
        r.check_count("key count", nkeys_at, nkeys as u64, 4)?;
        let b = r.bytes("range counts", 4 * nkeys)?;
        let c = Counts::PerKey(b);
        let total: usize = (0..nkeys).map(|k| c.get(k)).sum();
        (c, total)
    } else {
        let total = (per as usize).saturating_mul(nkeys);
        (Counts::Uniform(per), total)
    };
    let keys = if handle == 0 {
        let k = Keys::decode(&mut r)?;
        if k.len() != nkeys {
            return Err(WireError::Inconsistent {
                field: "keys",
                at: nkeys_at,
                what: "key count differs from the header's",
            });
        }
        Some(k)
    } else {
        None
    };
    if total.saturating_mul(RANGE_BYTES) != r.remaining() {
        return Err(WireError::Inconsistent {
            field: "ranges",
            at: r.position(),
            what: "range count differs from the bytes sent",
        });
    }
    let ranges = Ranges(r.bytes("ranges", total * RANGE_BYTES)?);
    Ok(GetRanges {
        handle,
        fingerprint,
        nkeys,
        counts,
        keys,
        ranges,
    })
}

/// Per-key metadata of a put: object length, depth, range count.
pub const PUT_META_BYTES: usize = 16;

/// A decoded ranged put.
#[derive(Debug, Clone)]
pub struct PutRanges<'a> {
    /// The keys.
    pub keys: Keys<'a>,
    /// `object_len u64 | depth u32 | nranges u32` per key.
    pub meta: &'a [u8],
    /// All ranges, key by key.
    pub ranges: Ranges<'a>,
}

impl PutRanges<'_> {
    /// `(object_len, depth, nranges)` of key `k`.
    pub fn meta(&self, k: usize) -> (u64, u32, usize) {
        let m = &self.meta[k * PUT_META_BYTES..(k + 1) * PUT_META_BYTES];
        (
            u64::from_le_bytes(m[0..8].try_into().expect("8")),
            u32::from_le_bytes(m[8..12].try_into().expect("4")),
            u32::from_le_bytes(m[12..16].try_into().expect("4")) as usize,
        )
    }
}

/// Encodes a ranged put.
pub fn encode_put_ranges(out: &mut Vec<u8>, items: &[crate::RangedPut<'_>]) -> Result<(), WireError> {
    begin(out, Op::PutRanges);
    Keys::encode(out, items.iter().map(|i| i.key));
    for it in items {
        out.u64(it.object_len);
        out.u32(it.depth);
        out.u32(it.ranges.len() as u32);
    }
    for it in items {
        Ranges::encode(out, it.ranges);
    }
    finish(out)
}

/// Decodes a ranged put.
pub fn decode_put_ranges(payload: &[u8]) -> Result<PutRanges<'_>, WireError> {
    let mut r = Reader::new(payload);
    let keys = Keys::decode(&mut r)?;
    let meta = r.bytes("put metadata", keys.len().saturating_mul(PUT_META_BYTES))?;
    let p = PutRanges {
        keys,
        meta,
        ranges: Ranges(&[]),
    };
    let total: usize = (0..keys.len()).map(|k| p.meta(k).2).sum();
    if total.saturating_mul(RANGE_BYTES) != r.remaining() {
        return Err(WireError::Inconsistent {
            field: "ranges",
            at: r.position(),
            what: "range count differs from the bytes sent",
        });
    }
    let ranges = Ranges(r.bytes("ranges", total * RANGE_BYTES)?);
    Ok(PutRanges { ranges, ..p })
}

/// Encodes a whole-object get: keys, then `addr | capacity` per key.
pub fn encode_get_whole(out: &mut Vec<u8>, items: &[(&str, u64, u64)]) -> Result<(), WireError> {
    begin(out, Op::GetWhole);
    Keys::encode(out, items.iter().map(|i| i.0));
    for &(_, addr, cap) in items {
        out.u64(addr);
        out.u64(cap);
    }
    finish(out)
}

/// Decodes a whole-object get into keys and `(addr, capacity)` records.
pub fn decode_get_whole(payload: &[u8]) -> Result<(Keys<'_>, Vec<(u64, u64)>), WireError> {
    let mut r = Reader::new(payload);
    let keys = Keys::decode(&mut r)?;
    if r.remaining() != keys.len().saturating_mul(16) {
        return Err(WireError::Inconsistent {
            field: "buffers",
            at: r.position(),
            what: "one (addr, capacity) per key",
        });
    }
    let mut v = Vec::with_capacity(keys.len());
    for _ in 0..keys.len() {
        v.push((r.u64("buffer address")?, r.u64("buffer capacity")?));
    }
    Ok((keys, v))
}

/// Encodes a request carrying only keys (`Exists`, `Remove`, `ExistsConsecutive`, `ObjectLens`).
pub fn encode_keys<'k>(
    out: &mut Vec<u8>,
    op: Op,
    keys: impl ExactSizeIterator<Item = &'k str> + Clone,
) -> Result<(), WireError> {
    begin(out, op);
    Keys::encode(out, keys);
    finish(out)
}

/// Decodes a request carrying only keys.
pub fn decode_keys(payload: &[u8]) -> Result<Keys<'_>, WireError> {
    let mut r = Reader::new(payload);
    let k = Keys::decode(&mut r)?;
    r.end()?;
    Ok(k)
}

/// The session a `Hello` opens or joins, and the server's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome {
    /// The session's secret token (joins more connections to it).
    pub token: [u8; 16],
    /// The server's idle timeout for data connections, in ms.
    pub idle_ms: u32,
    /// The longest frame the server accepts.
    pub max_frame: u32,
}

impl Welcome {
    /// Encodes an `Ok` reply to a hello.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), WireError> {
        begin(out, Op::Ok);
        out.extend_from_slice(&self.token);
        out.u32(self.idle_ms);
        out.u32(self.max_frame);
        finish(out)
    }

    /// Decodes the reply.
    pub fn decode(payload: &[u8]) -> Result<Welcome, WireError> {
        let mut r = Reader::new(payload);
        let w = Welcome {
            token: r.array("session token")?,
            idle_ms: r.u32("idle timeout")?,
            max_frame: r.u32("max frame")?,
        };
        r.end()?;
        Ok(w)
    }
}

/// Error codes on the wire.
mod code {
    pub const RANGE_OUTSIDE: u8 = 1;
    pub const OVERLAP: u8 = 2;
    pub const NO_TILE: u8 = 3;
    pub const ZERO_LEN: u8 = 4;
    pub const UNREGISTERED: u8 = 5;
    pub const BAD_KEY: u8 = 6;
    pub const DUPLICATE: u8 = 7;
    pub const NOT_FOUND: u8 = 8;
    pub const CORRUPT: u8 = 9;
    pub const NO_SPACE: u8 = 10;
    pub const TOO_SMALL: u8 = 11;
    pub const CONFLICT: u8 = 12;
    pub const TOO_LARGE: u8 = 13;
    pub const IO: u8 = 14;
    pub const CLOSED: u8 = 15;
    pub const PROTOCOL: u8 = 16;
    pub const REFUSED: u8 = 17;
    pub const NOT_SHAREABLE: u8 = 18;
    pub const OTHER: u8 = 19;
}

/// Encodes a store error as `code | a u32 | b u32 | x u64 | y u64 | z u64 | s str | t str`.
pub fn encode_error(out: &mut Vec<u8>, e: &StoreError) {
    let (c, a, b, x, y, z, s, t): (u8, usize, usize, u64, u64, u64, &str, String) = match e {
        StoreError::RangeOutsideObject {
            key_index,
            range_index,
            offset,
            len,
            object_len,
        } => (
            code::RANGE_OUTSIDE,
            *key_index,
            *range_index,
            *offset,
            *len,
            *object_len,
            "",
            String::new(),
        ),
        StoreError::RangesOverlap {
            key_index,
            first,
            second,
        } => (
            code::OVERLAP,
            *key_index,
            *first,
            *second as u64,
            0,
            0,
            "",
            String::new(),
        ),
        StoreError::RangesDoNotTile {
            key_index,
            object_len,
            gap_start,
            gap_end,
        } => (
            code::NO_TILE,
            *key_index,
            0,
            *object_len,
            *gap_start,
            *gap_end,
            "",
            String::new(),
        ),
        StoreError::ZeroLength { key_index, range_index } => {
            (code::ZERO_LEN, *key_index, *range_index, 0, 0, 0, "", String::new())
        }
        StoreError::Unregistered {
            key_index,
            range_index,
            addr,
            len,
        } => (
            code::UNREGISTERED,
            *key_index,
            *range_index,
            *addr,
            *len,
            0,
            "",
            String::new(),
        ),
        StoreError::BadKey { key_index, len, max } => (
            code::BAD_KEY,
            *key_index,
            0,
            *len as u64,
            *max as u64,
            0,
            "",
            String::new(),
        ),
        StoreError::DuplicateKey { key_index, first_index } => {
            (code::DUPLICATE, *key_index, *first_index, 0, 0, 0, "", String::new())
        }
        StoreError::NotFound { key } => (code::NOT_FOUND, 0, 0, 0, 0, 0, key, String::new()),
        StoreError::Corrupt { key, tier, detail } => (
            code::CORRUPT,
            0,
            0,
            (*tier == Tier::Ssd) as u64,
            0,
            0,
            key,
            detail.clone(),
        ),
        StoreError::NoSpace { key, len } => (code::NO_SPACE, 0, 0, *len, 0, 0, key, String::new()),
        StoreError::BufferTooSmall { key, need, have } => (code::TOO_SMALL, 0, 0, *need, *have, 0, key, String::new()),
        StoreError::WriteConflict { key } => (code::CONFLICT, 0, 0, 0, 0, 0, key, String::new()),
        StoreError::TooLarge { key, need, limit } => (code::TOO_LARGE, 0, 0, *need, *limit, 0, key, String::new()),
        StoreError::Io { context, source } => (code::IO, 0, 0, 0, 0, 0, context, source.to_string()),
        StoreError::Closed => (code::CLOSED, 0, 0, 0, 0, 0, "", String::new()),
        StoreError::Protocol { detail } => (code::PROTOCOL, 0, 0, 0, 0, 0, detail, String::new()),
        StoreError::Refused { reason } => (code::REFUSED, 0, 0, 0, 0, 0, reason, String::new()),
        StoreError::NotShareable { addr, len, reason } => {
            (code::NOT_SHAREABLE, 0, 0, *addr, *len, 0, reason, String::new())
        }
        other => (code::OTHER, 0, 0, 0, 0, 0, "", other.to_string()),
    };
    out.u8(c);
    out.u32(a as u32);
    out.u32(b as u32);
    out.u64(x);
    out.u64(y);
    out.u64(z);
    out.str(s);
    out.str(&t);
}

/// Decodes an error written by [`encode_error`].
pub fn decode_error(r: &mut Reader<'_>) -> Result<StoreError, WireError> {
    let code_at = r.position();
    let c = r.u8("error code")?;
    let a = r.u32("error a")? as usize;
    let b = r.u32("error b")? as usize;
    let (x, y, z) = (r.u64("error x")?, r.u64("error y")?, r.u64("error z")?);
    let s = r.str("error text")?.to_owned();
    let t = r.str("error detail")?.to_owned();
    Ok(match c {
        code::RANGE_OUTSIDE => StoreError::RangeOutsideObject {
            key_index: a,
            range_index: b,
            offset: x,
            len: y,
            object_len: z,
        },
        code::OVERLAP => StoreError::RangesOverlap {
            key_index: a,
            first: b,
            second: x as usize,
        },
        code::NO_TILE => StoreError::RangesDoNotTile {
            key_index: a,
            object_len: x,
            gap_start: y,
            gap_end: z,
        },
        code::ZERO_LEN => StoreError::ZeroLength {
            key_index: a,
            range_index: b,
        },
        code::UNREGISTERED => StoreError::Unregistered {
            key_index: a,
            range_index: b,
            addr: x,
            len: y,
        },
        code::BAD_KEY => StoreError::BadKey {
            key_index: a,
            len: x as usize,
            max: y as usize,
        },
        code::DUPLICATE => StoreError::DuplicateKey {
            key_index: a,
            first_index: b,
        },
        code::NOT_FOUND => StoreError::NotFound { key: s },
        code::CORRUPT => StoreError::Corrupt {
            key: s,
            tier: if x == 1 { Tier::Ssd } else { Tier::Dram },
            detail: t,
        },
        code::NO_SPACE => StoreError::NoSpace { key: s, len: x },
        code::TOO_SMALL => StoreError::BufferTooSmall {
            key: s,
            need: x,
            have: y,
        },
        code::CONFLICT => StoreError::WriteConflict { key: s },
        code::TOO_LARGE => StoreError::TooLarge {
            key: s,
            need: x,
            limit: y,
        },
        code::IO => StoreError::io(s, std::io::Error::other(t)),
        code::CLOSED => StoreError::Closed,
        code::PROTOCOL => StoreError::Protocol { detail: s },
        code::REFUSED => StoreError::Refused { reason: s },
        code::NOT_SHAREABLE => StoreError::NotShareable {
            addr: x,
            len: y,
            reason: s,
        },
        code::OTHER => StoreError::Server { detail: t },
        _ => {
            return Err(WireError::BadValue {
                field: "error code",
                at: code_at,
                value: c as u64,
            })
        }
    })
}

/// Encodes per-key results: `u32 n`, then per key `0 | u64 value` or `1 | error`.
pub fn encode_results(out: &mut Vec<u8>, results: &[crate::Result<u64>]) {
    out.u32(results.len() as u32);
    for r in results {
        match r {
            Ok(v) => {
                out.u8(0);
                out.u64(*v);
            }
            Err(e) => {
                out.u8(1);
                encode_error(out, e);
            }
        }
    }
}

/// Decodes per-key results, expecting `n` of them.
pub fn decode_results(r: &mut Reader<'_>, n: usize) -> Result<Vec<crate::Result<u64>>, WireError> {
    let at = r.position();
    if r.count("result count", 9)? != n {
        return Err(WireError::Inconsistent {
            field: "result count",
            at,
            what: "one result per key",
        });
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let tag_at = r.position();
        v.push(match r.u8("result tag")? {
            0 => Ok(r.u64("result")?),
            1 => Err(decode_error(r)?),
            t => {
                return Err(WireError::BadValue {
                    field: "result tag",
                    at: tag_at,
                    value: t as u64,
                })
            }
        });
    }
    Ok(v)
}

// One table per section (te_base::stats_table!): each lists every field of its struct once, as
// sent or as skipped, and destructures the struct without `..`, so a field added to a stats
// struct fails to compile here until it is sent (or, for fields the client fills itself, named
// as not sent), and encode and decode cannot disagree on the order. The wire order is the
// order of each list.

te_base::stats_table! {
    /// The core's numeric counters (its engine name and direct-I/O flag follow them in their
    /// own encodings).
    pub CoreWire for CoreStats {
        send: [
            dram_objects,
            dram_used_bytes,
            dram_capacity_bytes,
            dram_read_bytes,
            ssd_objects,
            ssd_read_bytes,
            ssd_written_bytes,
            ssd_delivered_bytes,
            demoted,
            dropped,
            demotion_failed,
            promoted,
            puts_ok,
            puts_failed,
            ssd_torn_dropped,
            ssd_corrupt_records,
            ssd_file_bytes,
            ssd_capacity_bytes,
            ssd_segments_compacted,
            ssd_compaction_written_bytes,
            ssd_compaction_freed_bytes,
            local_hits,
            misses,
            resolve_reused,
        ],
        skip: [ssd_io_engine, ssd_direct_io],
    }
}

te_base::stats_table! {
    /// The server's own standalone counters (the client fills its key-handle counters itself).
    pub ServerWire for StandaloneStats {
        send: [
            server_key_handle_hits,
            server_key_handle_misses,
            server_key_handle_mints,
            server_key_handle_held,
            server_key_handle_bytes,
            server_sessions,
            server_mapped_buffers,
        ],
        skip: [key_handle_hits, key_handle_misses, key_handle_mints, key_handle_remints],
    }
}

/// Counters of a cluster section: a build without the cluster feature reads (and drops) this
/// many from a cluster-mode server.
const CLUSTER_COUNTERS: usize = 12;

#[cfg(feature = "cluster")]
te_base::stats_table! {
    /// A cluster section's counters.
    pub ClusterWire for crate::cluster::stats::ClusterStats {
        send: [
            remote_hits,
            remote_bytes,
            remote_requests,
            remote_control_bytes,
            remote_stale,
            remote_errors,
            directory_entries,
            directory_messages,
            directory_refused_identity,
            directory_refused_capped,
            directory_lookups_throttled,
            lease_rejoins,
        ],
        skip: [],
    }
}

// Builds with and without the cluster feature must agree on the section's size.
#[cfg(feature = "cluster")]
const _: () = assert!(ClusterWire::FIELDS == CLUSTER_COUNTERS);

/// Encodes a server's counters: the core's, its standalone counters, then a cluster section
/// (a flag byte, and its counters when the server is a cluster peer).
pub fn encode_stats(out: &mut Vec<u8>, s: &StoreStats) {
    CoreWire::encode(out, &s.core);
    out.str(&s.core.ssd_io_engine);
    out.bool(s.core.ssd_direct_io);
    match &s.standalone {
        Some(sa) => ServerWire::encode(out, sa),
        None => ServerWire::encode(out, &StandaloneStats::default()),
    }
    #[cfg(feature = "cluster")]
    if let Some(c) = &s.cluster {
        out.bool(true);
        ClusterWire::encode(out, c);
        return;
    }
    out.bool(false);
}

/// Decodes a server's counters (the standalone section holds the server's part).
pub fn decode_stats(payload: &[u8]) -> Result<StoreStats, WireError> {
    let mut r = Reader::new(payload);
    let mut core = CoreWire::decode(&mut r)?;
    core.ssd_io_engine = r.str("ssd_io_engine")?.to_owned();
    core.ssd_direct_io = r.bool("ssd_direct_io")?;
    let sa = ServerWire::decode(&mut r)?;
    let cluster = if r.bool("cluster section flag")? {
        #[cfg(feature = "cluster")]
        let c = Some(ClusterWire::decode(&mut r)?);
        // A build without the feature reads a server's cluster section and has nowhere to put it.
        #[cfg(not(feature = "cluster"))]
        let c = {
            r.bytes("cluster section", 8 * CLUSTER_COUNTERS)?;
            None::<()>
        };
        c
    } else {
        None
    };
    r.end()?;
    #[cfg(not(feature = "cluster"))]
    let _ = cluster;
    Ok(StoreStats {
        core,
        standalone: Some(sa),
        #[cfg(feature = "cluster")]
        cluster,
    })
}

/// Encodes an optional phase report.
pub fn encode_phases(out: &mut Vec<u8>, p: Option<&te_base::PhaseReport>) {
    let Some(p) = p else {
        out.u8(0);
        return;
    };
    out.u8(1);
    for n in p.nanos {
        out.u64(n);
    }
    out.u64(p.calls);
    out.u64(p.items);
}

/// Decodes an optional phase report.
pub fn decode_phases(payload: &[u8]) -> Result<Option<te_base::PhaseReport>, WireError> {
    let mut r = Reader::new(payload);
    if !r.bool("phase report flag")? {
        r.end()?;
        return Ok(None);
    }
    let mut p = te_base::PhaseReport::default();
    for n in p.nanos.iter_mut() {
        *n = r.u64("phase nanos")?;
    }
    p.calls = r.u64("phase calls")?;
    p.items = r.u64("phase items")?;
    r.end()?;
    Ok(Some(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RangedGet, RangedPut};
    use proptest::prelude::*;

    fn key_strategy() -> impl Strategy<Value = String> {
        "[a-zé/0-9]{1,40}"
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn decoders_never_panic_on_arbitrary_bytes(b in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_get_ranges(&b);
            let _ = decode_put_ranges(&b);
            let _ = decode_get_whole(&b);
            let _ = decode_keys(&b);
            let _ = Welcome::decode(&b);
            let _ = decode_results(&mut Reader::new(&b), 3);
            let _ = decode_error(&mut Reader::new(&b));
            let _ = decode_stats(&b);
            if b.len() >= HEADER {
                let _ = decode_header(b[..HEADER].try_into().unwrap(), 1 << 20);
            }
        }

        #[test]
        fn stats_round_trip_in_their_sections(
            values in proptest::collection::vec(any::<u64>(), STATS_VALUES),
            engine in "[a-z]{0,8}", direct in any::<bool>(), peer in any::<bool>(),
        ) {
            let (sent, expected) = stats_by_hand(&values, engine, direct, peer);
            let mut out = Vec::new();
            encode_stats(&mut out, &sent);
            prop_assert_eq!(decode_stats(&out).unwrap(), expected);
            // Every cut of the encoding is a typed error, never a panic or a shorter report.
            for cut in 0..out.len() {
                prop_assert!(decode_stats(&out[..cut]).is_err());
            }
        }

        #[test]
        fn get_ranges_round_trips(
            keys in proptest::collection::vec(key_strategy(), 0..8),
            per in proptest::collection::vec(proptest::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 0..4), 8),
            handle in any::<u64>(), fp in any::<u64>(), send in any::<bool>(),
        ) {
            let ranges: Vec<Vec<Range>> = per.iter().map(|v| v.iter().map(|&(o, l, a)| Range::new(o, l, a)).collect()).collect();
            let items: Vec<RangedGet<'_>> = keys.iter().zip(&ranges).map(|(k, r)| RangedGet { key: k, ranges: r }).collect();
            let send = send || handle == 0;
            let mut out = Vec::new();
            encode_get_ranges(&mut out, handle, fp, &items, send).unwrap();
            let h = decode_header(out[..HEADER].try_into().unwrap(), usize::MAX).unwrap();
            prop_assert_eq!(h.op, Op::GetRanges);
            prop_assert_eq!(h.len, out.len() - HEADER);
            let g = decode_get_ranges(&out[HEADER..]).unwrap();
            prop_assert_eq!(g.handle, if send { 0 } else { handle });
            prop_assert_eq!(g.fingerprint, fp);
            prop_assert_eq!(g.nkeys, items.len());
            if send {
                let got: Vec<&str> = g.keys.unwrap().iter().collect();
                prop_assert_eq!(got, keys.iter().map(String::as_str).collect::<Vec<_>>());
            }
            let all: Vec<Range> = g.ranges.iter().collect();
            let want: Vec<Range> = ranges[..items.len()].iter().flatten().copied().collect();
            prop_assert_eq!(all, want);
            for (k, it) in items.iter().enumerate() {
                prop_assert_eq!(g.counts.get(k), it.ranges.len());
            }
            // Every truncation is an error, never a panic.
            for cut in 0..out.len() - HEADER {
                let _ = decode_get_ranges(&out[HEADER..HEADER + cut]);
            }
        }

        #[test]
        fn put_ranges_and_results_round_trip(
            keys in proptest::collection::vec(key_strategy(), 1..6),
            len in 1u64..1 << 40, depth in any::<u32>(),
            values in proptest::collection::vec(any::<u64>(), 0..6),
        ) {
            let r = [Range::new(0, len, 4096)];
            let items: Vec<RangedPut<'_>> = keys.iter().map(|k| RangedPut { key: k, object_len: len, ranges: &r, depth }).collect();
            let mut out = Vec::new();
            encode_put_ranges(&mut out, &items).unwrap();
            let p = decode_put_ranges(&out[HEADER..]).unwrap();
            prop_assert_eq!(p.keys.len(), keys.len());
            for k in 0..keys.len() {
                prop_assert_eq!(p.meta(k), (len, depth, 1));
            }
            let results: Vec<crate::Result<u64>> = values.iter().enumerate().map(|(i, &v)| if i % 2 == 0 { Ok(v) } else {
                Err(StoreError::BufferTooSmall { key: keys[0].clone(), need: v, have: 1 })
            }).collect();
            let mut out = Vec::new();
            encode_results(&mut out, &results);
            let back = decode_results(&mut Reader::new(&out), results.len()).unwrap();
            prop_assert_eq!(format!("{back:?}"), format!("{results:?}"));
        }
    }

    /// Values [`stats_by_hand`] takes: 26 core, 11 standalone, 11 cluster.
    const STATS_VALUES: usize = 26 + 11 + 12;

    /// A report with every field of every section set from `v`, written out field by field
    /// (struct literals without `..`: a new field must be added here too), and what a client
    /// must decode from it: the same, less the fields the client fills itself. Built without
    /// the wire tables, so a field dropped from a table's sent list is caught.
    fn stats_by_hand(v: &[u64], engine: String, direct: bool, peer: bool) -> (StoreStats, StoreStats) {
        let core = CoreStats {
            dram_objects: v[0],
            dram_used_bytes: v[1],
            dram_capacity_bytes: v[2],
            dram_read_bytes: v[3],
            ssd_objects: v[4],
            ssd_read_bytes: v[5],
            ssd_written_bytes: v[6],
            ssd_delivered_bytes: v[7],
            demoted: v[8],
            dropped: v[9],
            demotion_failed: v[10],
            promoted: v[11],
            puts_ok: v[12],
            puts_failed: v[13],
            ssd_torn_dropped: v[14],
            ssd_corrupt_records: v[15],
            ssd_file_bytes: v[16],
            ssd_capacity_bytes: v[17],
            ssd_segments_compacted: v[18],
            ssd_compaction_written_bytes: v[19],
            ssd_compaction_freed_bytes: v[20],
            ssd_io_engine: engine,
            ssd_direct_io: direct,
            local_hits: v[23],
            misses: v[24],
            resolve_reused: v[25],
        };
        let server = StandaloneStats {
            key_handle_hits: v[26],
            key_handle_misses: v[27],
            key_handle_mints: v[28],
            key_handle_remints: v[29],
            server_key_handle_hits: v[30],
            server_key_handle_misses: v[31],
            server_key_handle_mints: v[32],
            server_key_handle_held: v[33],
            server_key_handle_bytes: v[34],
            server_sessions: v[35],
            server_mapped_buffers: v[36],
        };
        // The client's own key-handle counters never travel: a client decodes them as 0.
        let received = StandaloneStats {
            key_handle_hits: 0,
            key_handle_misses: 0,
            key_handle_mints: 0,
            key_handle_remints: 0,
            ..server.clone()
        };
        #[cfg(feature = "cluster")]
        let cluster = peer.then(|| crate::cluster::stats::ClusterStats {
            remote_hits: v[37],
            remote_bytes: v[38],
            remote_requests: v[39],
            remote_control_bytes: v[40],
            remote_stale: v[41],
            remote_errors: v[42],
            directory_entries: v[43],
            directory_messages: v[44],
            directory_refused_identity: v[45],
            directory_refused_capped: v[46],
            directory_lookups_throttled: v[47],
            lease_rejoins: v[48],
        });
        #[cfg(not(feature = "cluster"))]
        let _ = peer;
        let sent = StoreStats {
            core: core.clone(),
            standalone: Some(server),
            #[cfg(feature = "cluster")]
            cluster: cluster.clone(),
        };
        let expected = StoreStats {
            core,
            standalone: Some(received),
            #[cfg(feature = "cluster")]
            cluster,
        };
        (sent, expected)
    }

    #[test]
    fn every_field_of_every_section_reaches_the_client() {
        // Distinct non-zero values: a field dropped from a table (or two swapped) shows.
        let values: Vec<u64> = (1..=STATS_VALUES as u64).map(|i| i * 1_000_003).collect();
        for peer in [false, true] {
            let (sent, expected) = stats_by_hand(&values, "uring".into(), true, peer);
            let mut out = Vec::new();
            encode_stats(&mut out, &sent);
            let got = decode_stats(&out).unwrap();
            assert_eq!(got, expected, "peer section {peer}");
            // Compared field by field as printed too, so a failure names the field.
            for (g, e) in format!("{got:#?}").lines().zip(format!("{expected:#?}").lines()) {
                assert_eq!(g, e);
            }
        }
    }

    #[test]
    fn hostile_counts_are_refused_without_allocating_them() {
        // A get claiming 2^32-2 ranges per key for 1000 keys, with nothing behind it.
        let mut b = Vec::new();
        b.u64(0);
        b.u64(0);
        b.u32(1000);
        b.u32(u32::MAX - 1);
        assert!(decode_get_ranges(&b).is_err());
        // Keys whose lengths exceed the frame.
        let mut b = Vec::new();
        b.u32(2);
        b.extend_from_slice(&1000u16.to_le_bytes());
        b.extend_from_slice(&1000u16.to_le_bytes());
        assert!(matches!(decode_keys(&b), Err(WireError::Truncated { .. })));
        // A key length splitting a character.
        let mut b = Vec::new();
        b.u32(2);
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice("é".as_bytes());
        assert!(matches!(decode_keys(&b).unwrap_err(), WireError::BadUtf8 { .. }));
        let mut h = [0u8; HEADER];
        h[..2].copy_from_slice(&MAGIC);
        h[2] = VERSION + 1;
        assert_eq!(
            decode_header(&h, 10).unwrap_err(),
            WireError::BadVersion {
                got: VERSION + 1,
                speaks: VERSION
            }
        );
        h[2] = VERSION;
        h[3] = Op::Stats as u8;
        h[4..8].copy_from_slice(&11u32.to_le_bytes());
        assert!(matches!(decode_header(&h, 10), Err(WireError::TooLarge { .. })));
    }

    #[test]
    fn a_handle_hit_costs_at_most_64_bytes_beyond_the_ranges() {
        let keys: Vec<String> = (0..1024).map(|i| format!("{i:0>120}")).collect();
        let r = vec![Range::new(0, 64, 4096); 8];
        let items: Vec<RangedGet<'_>> = keys.iter().map(|k| RangedGet { key: k, ranges: &r }).collect();
        let mut out = Vec::new();
        encode_get_ranges(&mut out, 7, 99, &items, false).unwrap();
        let overhead = out.len() - 1024 * 8 * RANGE_BYTES;
        assert!(overhead <= 64, "{overhead} bytes beyond the ranges");
    }
}
