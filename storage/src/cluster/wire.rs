//! The control protocol between peers: pure encoding and decoding, no I/O, so it is fuzzed
//! without sockets.
//!
//! A frame is an 8-byte little-endian head (`u32` body length, `u8` opcode, 3 zero bytes) and a
//! body of at most [`MAX_BODY`] bytes. A connection opens with HELLO (the initiator's nonce, then
//! its member name; the name alone without a key), answered by CHALLENGE (the responder's nonce
//! and proof) and PROOF, or by READY when neither side has a key. Both proofs are HMACs over a
//! context that includes the member name, so the connection proves the key and who it speaks
//! for; PUBLISH and UNPUBLISH must name that member as owner (`guard.rs`). Then each RESOLVE is
//! answered by PLACES, each VALIDATE by VERDICTS, and anything refused by REFUSED (a reason that
//! reveals nothing).
//!
//! Bodies (all integers little-endian):
//! - RESOLVE: `u32 n`, then per key `u16 key_len, key, u32 ranges, (u64 offset, u64 len)*`.
//! - PLACES: `u64 lease`, `u32 n`, then per key a status byte: DRAM (`u64 object_len,
//!   u64 generation, u32 extents, (u64 addr, u64 len)*`), STAGED (`u64 object_len, u32 ranges,
//!   u64 addr*`: where each requested range sits in a staging slot held under `lease`), MISSING, or
//!   FAILED (`u16 len, reason`).
//! - VALIDATE: `u64 lease` (released by this message), `u32 n`, then per key
//!   `u16 key_len, key, u64 generation`.
//! - VERDICTS: `u32 n`, then one byte per key (1: the generation read is still the committed one).
//!
//! The sharded directory (`rendezvous.rs`, `shard.rs`) adds:
//! - PUBLISH: `u16 owner_len, owner`, `u64 deadline` (the writer's, wall-clock milliseconds
//!   since the Unix epoch; 0: none; a PUBLISH read after it is refused), `u32 n`, then per key
//!   `u16 key_len, key, u64 version` (the version the owner minted for its write: the newest
//!   wins); answered by VERSIONS: `u32 n`, then per key `u64` (0: indexed; `u64::MAX`: refused
//!   by the entries cap; `u64::MAX - 1`: not taken, the superseded owner could not retire its
//!   copy; otherwise the newer version indexed instead: a fresh write is published again above
//!   it, a re-published copy is retired).
//! - UNPUBLISH: `u16 owner_len, owner`, `u32 n`, then per key `u16 key_len, key`; answered by
//!   VERDICTS with no entries (done).
//! - RETIRE (directory peer to a superseded owner): VALIDATE's body (the lease field is the
//!   sender's deadline as in PUBLISH, then key and the superseded version); the owner drops its
//!   copy if it still holds that version, unless the deadline has passed. Answered by VERDICTS
//!   with no entries.
//! - LOOKUP: `u32 n`, then per key `u16 key_len, key`; answered by OWNERS: `u8 settled` (1: this
//!   peer's index has seen no membership change lately, so an unknown key is unknown), `u32 n`,
//!   then per key `u16 owner_len, owner, u64 version` (length 0: not indexed here, and no
//!   version): a lookup asks a read quorum of the key's directory peers and believes the newest.

use thiserror::Error;

/// Size of a frame head.
pub const HEAD: usize = 8;
/// Largest body a peer accepts (16 MiB: ~1M ranges of one call).
pub const MAX_BODY: usize = 16 << 20;
/// Longest key (the store's own limit is lower; this bounds what a decoder allocates).
pub const MAX_KEY: usize = 4096;
/// Longest reason text.
pub const MAX_REASON: usize = 1024;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Initiator's greeting: empty, or its nonce.
    Hello = 1,
    /// Responder's nonce and proof.
    Challenge = 2,
    /// Initiator's proof.
    Proof = 3,
    /// The connection is open for requests.
    Ready = 4,
    /// Where are these keys' bytes?
    Resolve = 5,
    /// The answer to RESOLVE.
    Places = 6,
    /// Are these generations still committed? Also releases the lease.
    Validate = 7,
    /// The answer to VALIDATE.
    Verdicts = 8,
    /// A request was refused.
    Refused = 9,
    /// Reserve space for these objects (a remote put); answered by PLACES (DRAM or FAILED).
    Allocate = 10,
    /// Publish these reservations (VALIDATE's body: lease 0, key and generation); answered by
    /// VERDICTS.
    Commit = 11,
    /// Index these keys as owned by the named peer (sharded directory).
    Publish = 12,
    /// Forget these keys where the named peer still owns them (sharded directory).
    Unpublish = 13,
    /// Which peer owns these keys? Answered by OWNERS.
    Lookup = 14,
    /// The answer to LOOKUP.
    Owners = 15,
    /// Drop these keys' copies if they are still these versions (a newer write elsewhere
    /// superseded them); sent by a key's directory peer, in a VALIDATE body whose lease field is
    /// the sender's deadline (wall-clock milliseconds; a RETIRE read after it is refused: the
    /// sender has put the older entry back). Answered by VERDICTS.
    Retire = 16,
    /// The answer to PUBLISH: per key 0 (indexed), refused (`u64::MAX`: capped, `u64::MAX - 1`:
    /// the superseded copy could not be retired) or the newer version indexed instead.
    Versions = 17,
    /// Keep the sender's lease alive in etcd on its behalf: it cannot reach etcd itself but
    /// reaches this peer (issue 38's member cut off from etcd but not from its peers). Answered
    /// by RENEWED.
    Renew = 18,
    /// The answer to RENEW: what etcd said, or that it is out of this peer's reach too.
    Renewed = 19,
}

impl Op {
    fn from_u8(b: u8) -> Option<Op> {
        Some(match b {
            1 => Op::Hello,
            2 => Op::Challenge,
            3 => Op::Proof,
            4 => Op::Ready,
            5 => Op::Resolve,
            6 => Op::Places,
            7 => Op::Validate,
            8 => Op::Verdicts,
            9 => Op::Refused,
            10 => Op::Allocate,
            11 => Op::Commit,
            12 => Op::Publish,
            13 => Op::Unpublish,
            14 => Op::Lookup,
            15 => Op::Owners,
            16 => Op::Retire,
            17 => Op::Versions,
            18 => Op::Renew,
            19 => Op::Renewed,
            _ => return None,
        })
    }
}

/// Why bytes did not decode.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    /// The opcode is not one this build knows.
    #[error("unknown opcode {0}")]
    UnknownOp(u8),
    /// The head's reserved bytes are not zero.
    #[error("reserved bytes are not zero")]
    Reserved,
    /// The announced body is larger than [`MAX_BODY`].
    #[error("body of {0} bytes exceeds the limit")]
    TooLarge(u64),
    /// The body ended inside a field.
    #[error("truncated {0}")]
    Truncated(&'static str),
    /// A field holds a value out of its range.
    #[error("bad {0}")]
    Bad(&'static str),
    /// Bytes follow the last field.
    #[error("{0} trailing bytes")]
    Trailing(usize),
}

/// A decoded head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    /// The opcode.
    pub op: Op,
    /// Body length.
    pub len: usize,
}

/// A frame: head and body.
pub fn frame(op: Op, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEAD + body.len());
    v.extend_from_slice(&(body.len() as u32).to_le_bytes());
    v.extend_from_slice(&[op as u8, 0, 0, 0]);
    v.extend_from_slice(body);
    v
}

/// Decodes a head.
pub fn decode_head(b: &[u8; HEAD]) -> Result<Head, WireError> {
    let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let op = Op::from_u8(b[4]).ok_or(WireError::UnknownOp(b[4]))?;
    if b[5..8] != [0, 0, 0] {
        return Err(WireError::Reserved);
    }
    if len > MAX_BODY {
        return Err(WireError::TooLarge(len as u64));
    }
    Ok(Head { op, len })
}

/// A cursor over a body that never reads past it.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Truncated(what));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        let s = self.take(2, what)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes(s.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        let s = self.take(8, what)?;
        Ok(u64::from_le_bytes(s.try_into().expect("8 bytes")))
    }
    /// A count of items each at least `min_item` bytes: never more than the body can hold, so a
    /// hostile count cannot make the decoder reserve memory it was not sent.
    fn count(&mut self, min_item: usize, what: &'static str) -> Result<usize, WireError> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_item) > self.b.len() {
            return Err(WireError::Truncated(what));
        }
        Ok(n)
    }
    fn key(&mut self) -> Result<String, WireError> {
        let n = self.u16("key length")? as usize;
        if n == 0 || n > MAX_KEY {
            return Err(WireError::Bad("key length"));
        }
        let s = self.take(n, "key")?;
        String::from_utf8(s.to_vec()).map_err(|_| WireError::Bad("key (not UTF-8)"))
    }
    fn keys(&mut self) -> Result<Vec<String>, WireError> {
        let n = self.count(3, "key count")?;
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
    fn end(&self) -> Result<(), WireError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(WireError::Trailing(self.b.len()))
        }
    }
}

fn put_key(out: &mut Vec<u8>, key: &str) {
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
}

/// One key of a RESOLVE: the object ranges `(offset, len)` the initiator will read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantedKey {
    /// The key.
    pub key: String,
    /// Object ranges `(offset, len)`.
    pub ranges: Vec<(u64, u64)>,
}

/// Encodes a RESOLVE body from borrowed keys and their ranges.
pub fn encode_resolve<'a>(keys: impl ExactSizeIterator<Item = (&'a str, &'a [crate::range_map::Range])>) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for (key, ranges) in keys {
        put_key(&mut out, key);
        out.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
        for r in ranges {
            out.extend_from_slice(&r.offset.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
        }
    }
    out
}

/// Decodes a RESOLVE body.
pub fn decode_resolve(body: &[u8]) -> Result<Vec<WantedKey>, WireError> {
    let mut r = Reader { b: body };
    let n = r.count(7, "key count")?;
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        let key = r.key()?;
        let m = r.count(16, "range count")?;
        let mut ranges = Vec::with_capacity(m);
        for _ in 0..m {
            ranges.push((r.u64("range offset")?, r.u64("range length")?));
        }
        keys.push(WantedKey { key, ranges });
    }
    r.end()?;
    Ok(keys)
}

/// Where one key's bytes are on its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// In the owner's DRAM arena, as committed generation `generation`, at `extents`
    /// (`(addr, len)` in object order).
    Dram {
        /// Object length.
        object_len: u64,
        /// The committed entry's generation (unique per commit; VALIDATE compares it).
        generation: u64,
        /// Arena extents in object order.
        extents: Vec<(u64, u64)>,
    },
    /// Read from the owner's SSD into a staging slot held under the answer's lease: the address
    /// of each requested range, in request order.
    Staged {
        /// Object length.
        object_len: u64,
        /// Address of each requested range.
        addrs: Vec<u64>,
    },
    /// The owner does not hold the key.
    Missing,
    /// The owner holds it but cannot serve it (corrupt record, I/O error, too large).
    Failed(String),
}

const DRAM: u8 = 0;
const STAGED: u8 = 1;
const MISSING: u8 = 2;
const FAILED: u8 = 3;

/// Encodes a PLACES body.
pub fn encode_places(lease: u64, places: &[Place]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&lease.to_le_bytes());
    out.extend_from_slice(&(places.len() as u32).to_le_bytes());
    for p in places {
        match p {
            Place::Dram {
                object_len,
                generation,
                extents,
            } => {
                out.push(DRAM);
                out.extend_from_slice(&object_len.to_le_bytes());
                out.extend_from_slice(&generation.to_le_bytes());
                out.extend_from_slice(&(extents.len() as u32).to_le_bytes());
                for (a, l) in extents {
                    out.extend_from_slice(&a.to_le_bytes());
                    out.extend_from_slice(&l.to_le_bytes());
                }
            }
            Place::Staged { object_len, addrs } => {
                out.push(STAGED);
                out.extend_from_slice(&object_len.to_le_bytes());
                out.extend_from_slice(&(addrs.len() as u32).to_le_bytes());
                for a in addrs {
                    out.extend_from_slice(&a.to_le_bytes());
                }
            }
            Place::Missing => out.push(MISSING),
            Place::Failed(why) => {
                out.push(FAILED);
                let why = &why.as_bytes()[..why.len().min(MAX_REASON)];
                out.extend_from_slice(&(why.len() as u16).to_le_bytes());
                out.extend_from_slice(why);
            }
        }
    }
    out
}

/// Decodes a PLACES body: the lease and one place per key.
pub fn decode_places(body: &[u8]) -> Result<(u64, Vec<Place>), WireError> {
    let mut r = Reader { b: body };
    let lease = r.u64("lease")?;
    let n = r.count(1, "key count")?;
    let mut places = Vec::with_capacity(n);
    for _ in 0..n {
        places.push(match r.u8("status")? {
            DRAM => {
                let object_len = r.u64("object length")?;
                let generation = r.u64("generation")?;
                let m = r.count(16, "extent count")?;
                let mut extents = Vec::with_capacity(m);
                for _ in 0..m {
                    extents.push((r.u64("extent address")?, r.u64("extent length")?));
                }
                Place::Dram {
                    object_len,
                    generation,
                    extents,
                }
            }
            STAGED => {
                let object_len = r.u64("object length")?;
                let m = r.count(8, "address count")?;
                let mut addrs = Vec::with_capacity(m);
                for _ in 0..m {
                    addrs.push(r.u64("staged address")?);
                }
                Place::Staged { object_len, addrs }
            }
            MISSING => Place::Missing,
            FAILED => {
                let m = r.u16("reason length")? as usize;
                if m > MAX_REASON {
                    return Err(WireError::Bad("reason length"));
                }
                Place::Failed(String::from_utf8_lossy(r.take(m, "reason")?).into_owned())
            }
            _ => return Err(WireError::Bad("status")),
        });
    }
    r.end()?;
    Ok((lease, places))
}

/// One object of an ALLOCATE: its key, length and depth hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The key.
    pub key: String,
    /// Object length.
    pub len: u64,
    /// Depth hint.
    pub depth: u32,
}

/// Encodes an ALLOCATE body: `u32 n`, then per object `u16 key_len, key, u64 len, u32 depth`.
pub fn encode_allocate<'a>(objs: impl ExactSizeIterator<Item = (&'a str, u64, u32)>) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(objs.len() as u32).to_le_bytes());
    for (key, len, depth) in objs {
        put_key(&mut out, key);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&depth.to_le_bytes());
    }
    out
}

/// Decodes an ALLOCATE body.
pub fn decode_allocate(body: &[u8]) -> Result<Vec<Allocation>, WireError> {
    let mut r = Reader { b: body };
    let n = r.count(15, "object count")?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(Allocation {
            key: r.key()?,
            len: r.u64("object length")?,
            depth: r.u32("depth")?,
        });
    }
    r.end()?;
    Ok(v)
}

/// Encodes a VALIDATE body.
pub fn encode_validate<'a>(lease: u64, keys: impl ExactSizeIterator<Item = (&'a str, u64)>) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&lease.to_le_bytes());
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for (key, generation) in keys {
        put_key(&mut out, key);
        out.extend_from_slice(&generation.to_le_bytes());
    }
    out
}

/// Decodes a VALIDATE body: the lease to release and `(key, generation)` pairs.
pub fn decode_validate(body: &[u8]) -> Result<(u64, Vec<(String, u64)>), WireError> {
    let mut r = Reader { b: body };
    let lease = r.u64("lease")?;
    let n = r.count(11, "key count")?;
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        keys.push((r.key()?, r.u64("generation")?));
    }
    r.end()?;
    Ok((lease, keys))
}

/// Encodes a VERDICTS body.
pub fn encode_verdicts(ok: &[bool]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + ok.len());
    out.extend_from_slice(&(ok.len() as u32).to_le_bytes());
    out.extend(ok.iter().map(|&b| b as u8));
    out
}

/// Decodes a VERDICTS body.
pub fn decode_verdicts(body: &[u8]) -> Result<Vec<bool>, WireError> {
    let mut r = Reader { b: body };
    let n = r.count(1, "verdict count")?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(match r.u8("verdict")? {
            0 => false,
            1 => true,
            _ => return Err(WireError::Bad("verdict")),
        });
    }
    r.end()?;
    Ok(v)
}

/// Encodes a PUBLISH or UNPUBLISH body: the owner and its keys.
pub fn encode_owned_keys<'a>(owner: &str, keys: impl ExactSizeIterator<Item = &'a str>) -> Vec<u8> {
    let mut out = Vec::new();
    put_key(&mut out, owner);
    put_keys(&mut out, keys);
    out
}

/// Decodes a PUBLISH or UNPUBLISH body.
pub fn decode_owned_keys(body: &[u8]) -> Result<(String, Vec<String>), WireError> {
    let mut r = Reader { b: body };
    let owner = r.key()?;
    let keys = r.keys()?;
    r.end()?;
    Ok((owner, keys))
}

/// Encodes a PUBLISH body: the owner and its keys, each with its version, with no deadline (a
/// re-publication of copies held).
pub fn encode_publish<'a>(owner: &str, keys: impl ExactSizeIterator<Item = (&'a str, u64)>) -> Vec<u8> {
    encode_publish_by(owner, 0, keys)
}

/// Encodes a PUBLISH body with the writer's deadline (wall-clock milliseconds since the Unix
/// epoch; 0: none): a directory peer that reads it later refuses it, since the writer no longer
/// waits for its answer and has not acknowledged the put.
pub fn encode_publish_by<'a>(
    owner: &str,
    deadline_ms: u64,
    keys: impl ExactSizeIterator<Item = (&'a str, u64)>,
) -> Vec<u8> {
    let mut out = Vec::new();
    put_key(&mut out, owner);
    out.extend_from_slice(&deadline_ms.to_le_bytes());
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for (k, v) in keys {
        put_key(&mut out, k);
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// A decoded PUBLISH: the owner named, the writer's deadline (0: none) and the keys with their
/// versions.
pub type Publish = (String, u64, Vec<(String, u64)>);

/// Decodes a PUBLISH body.
pub fn decode_publish(body: &[u8]) -> Result<Publish, WireError> {
    let mut r = Reader { b: body };
    let owner = r.key()?;
    let deadline = r.u64("deadline")?;
    let n = r.count(11, "key count")?;
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        keys.push((r.key()?, r.u64("version")?));
    }
    r.end()?;
    Ok((owner, deadline, keys))
}

/// Wall-clock milliseconds since the Unix epoch (deadlines carried in PUBLISH and RETIRE, which
/// a peer that was frozen or cut off may read after the sender gave up).
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `end` as wall-clock milliseconds since the Unix epoch.
pub fn wall_deadline(end: std::time::Instant) -> u64 {
    wall_ms() + end.saturating_duration_since(std::time::Instant::now()).as_millis() as u64
}

/// Encodes a VERSIONS body.
pub fn encode_versions(v: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 8 * v.len());
    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Decodes a VERSIONS body.
pub fn decode_versions(body: &[u8]) -> Result<Vec<u64>, WireError> {
    let mut r = Reader { b: body };
    let n = r.count(8, "version count")?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(r.u64("version")?);
    }
    r.end()?;
    Ok(v)
}

/// What a peer asked to RENEW a lease got from etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// etcd extended the lease.
    Renewed {
        /// Seconds it lives from when etcd took the request.
        ttl_s: u64,
    },
    /// etcd no longer has the lease: it expired.
    Gone,
    /// etcd is out of the relaying peer's reach too.
    EtcdUnreachable,
}

/// Encodes a RENEW body: the lease to keep alive.
pub fn encode_renew(lease: i64) -> Vec<u8> {
    lease.to_le_bytes().to_vec()
}

/// Decodes a RENEW body.
pub fn decode_renew(body: &[u8]) -> Result<i64, WireError> {
    let mut r = Reader { b: body };
    let lease = r.u64("lease")? as i64;
    r.end()?;
    Ok(lease)
}

/// Encodes a RENEWED body: a tag (0 renewed, 1 gone, 2 etcd unreachable) and the TTL.
pub fn encode_renewed(r: Renewal) -> Vec<u8> {
    let (tag, ttl) = match r {
        Renewal::Renewed { ttl_s } => (0u8, ttl_s),
        Renewal::Gone => (1, 0),
        Renewal::EtcdUnreachable => (2, 0),
    };
    let mut out = vec![tag];
    out.extend_from_slice(&ttl.to_le_bytes());
    out
}

/// Decodes a RENEWED body.
pub fn decode_renewed(body: &[u8]) -> Result<Renewal, WireError> {
    let mut r = Reader { b: body };
    let (tag, ttl_s) = (r.u8("renewal")?, r.u64("ttl")?);
    r.end()?;
    Ok(match tag {
        0 => Renewal::Renewed { ttl_s },
        1 => Renewal::Gone,
        2 => Renewal::EtcdUnreachable,
        _ => return Err(WireError::Bad("renewal")),
    })
}

/// Encodes a LOOKUP body.
pub fn encode_lookup<'a>(keys: impl ExactSizeIterator<Item = &'a str>) -> Vec<u8> {
    let mut out = Vec::new();
    put_keys(&mut out, keys);
    out
}

/// The number of keys a LOOKUP body asks for, read from its head without decoding the keys
/// (so a throttled LOOKUP costs no decoding).
pub fn lookup_len(body: &[u8]) -> Result<usize, WireError> {
    Reader { b: body }.count(3, "key count")
}

/// Decodes a LOOKUP body.
pub fn decode_lookup(body: &[u8]) -> Result<Vec<String>, WireError> {
    let mut r = Reader { b: body };
    let keys = r.keys()?;
    r.end()?;
    Ok(keys)
}

/// Encodes an OWNERS body: whether the answering index is settled, and per key its owner.
pub fn encode_owners<S: AsRef<str>>(settled: bool, owners: &[Option<(S, u64)>]) -> Vec<u8> {
    let mut out = vec![settled as u8];
    out.extend_from_slice(&(owners.len() as u32).to_le_bytes());
    for o in owners {
        match o {
            Some((name, version)) => {
                put_key(&mut out, name.as_ref());
                out.extend_from_slice(&version.to_le_bytes());
            }
            None => out.extend_from_slice(&0u16.to_le_bytes()),
        }
    }
    out
}

/// An OWNERS body: whether the answering peer has settled, and per key the owner and version
/// it indexes (`None`: not indexed there).
pub type OwnersAnswer = (bool, Vec<Option<(String, u64)>>);

/// Decodes an OWNERS body.
pub fn decode_owners(body: &[u8]) -> Result<OwnersAnswer, WireError> {
    let mut r = Reader { b: body };
    let settled = match r.u8("settled")? {
        0 => false,
        1 => true,
        _ => return Err(WireError::Bad("settled")),
    };
    let n = r.count(2, "owner count")?;
    let mut owners = Vec::with_capacity(n);
    for _ in 0..n {
        let len = r.u16("owner length")? as usize;
        owners.push(match len {
            0 => None,
            l if l > MAX_KEY => return Err(WireError::Bad("owner length")),
            l => {
                let name =
                    String::from_utf8(r.take(l, "owner")?.to_vec()).map_err(|_| WireError::Bad("owner (not UTF-8)"))?;
                Some((name, r.u64("owner version")?))
            }
        });
    }
    r.end()?;
    Ok((settled, owners))
}

fn put_keys<'a>(out: &mut Vec<u8>, keys: impl ExactSizeIterator<Item = &'a str>) {
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        put_key(out, k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::range_map::Range;
    use proptest::prelude::*;

    fn place() -> impl Strategy<Value = Place> {
        prop_oneof![
            (
                any::<u64>(),
                any::<u64>(),
                prop::collection::vec((any::<u64>(), any::<u64>()), 0..4)
            )
                .prop_map(|(object_len, generation, extents)| Place::Dram {
                    object_len,
                    generation,
                    extents
                }),
            (any::<u64>(), prop::collection::vec(any::<u64>(), 0..4))
                .prop_map(|(object_len, addrs)| Place::Staged { object_len, addrs }),
            Just(Place::Missing),
            "[a-z ]{0,40}".prop_map(Place::Failed),
        ]
    }

    proptest! {
        #[test]
        fn decoders_never_panic_on_arbitrary_bytes(b in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_resolve(&b);
            let _ = decode_places(&b);
            let _ = decode_validate(&b);
            let _ = decode_verdicts(&b);
            let _ = decode_allocate(&b);
            let _ = decode_owned_keys(&b);
            let _ = decode_publish(&b);
            let _ = decode_versions(&b);
            let _ = decode_lookup(&b);
            let _ = decode_owners(&b);
            if b.len() >= HEAD {
                let _ = decode_head(b[..HEAD].try_into().unwrap());
            }
        }

        #[test]
        fn resolve_round_trips(keys in prop::collection::vec(("[a-z0-9/]{1,20}", prop::collection::vec((any::<u64>(), any::<u64>()), 0..5)), 0..6)) {
            let ranges: Vec<Vec<Range>> = keys.iter().map(|(_, r)| r.iter().map(|&(o, l)| Range::new(o, l, 0)).collect()).collect();
            let body = encode_resolve(keys.iter().zip(&ranges).map(|((k, _), r)| (k.as_str(), r.as_slice())));
            let back = decode_resolve(&body).unwrap();
            prop_assert_eq!(back.len(), keys.len());
            for (b, (k, r)) in back.iter().zip(&keys) {
                prop_assert_eq!(&b.key, k);
                prop_assert_eq!(&b.ranges, r);
            }
            // Every strict prefix fails to decode, with an error rather than a panic.
            for cut in 0..body.len() {
                prop_assert!(decode_resolve(&body[..cut]).is_err());
            }
        }

        #[test]
        fn places_validate_and_verdicts_round_trip(lease in any::<u64>(), places in prop::collection::vec(place(), 0..6), gens in prop::collection::vec(("[a-z]{1,8}", any::<u64>()), 0..6), ok in prop::collection::vec(any::<bool>(), 0..9)) {
            let body = encode_places(lease, &places);
            prop_assert_eq!(decode_places(&body).unwrap(), (lease, places));
            for cut in 0..body.len() {
                prop_assert!(decode_places(&body[..cut]).is_err());
            }
            let body = encode_validate(lease, gens.iter().map(|(k, g)| (k.as_str(), *g)));
            prop_assert_eq!(decode_validate(&body).unwrap(), (lease, gens.clone()));
            let body = encode_verdicts(&ok);
            prop_assert_eq!(decode_verdicts(&body).unwrap(), ok);
            let objs: Vec<(String, u64, u32)> = gens.iter().map(|(k, g)| (k.clone(), *g, *g as u32)).collect();
            let body = encode_allocate(objs.iter().map(|(k, l, d)| (k.as_str(), *l, *d)));
            let back = decode_allocate(&body).unwrap();
            prop_assert_eq!(back.len(), objs.len());
            for (b, (k, l, d)) in back.iter().zip(&objs) {
                prop_assert!(b.key == *k && b.len == *l && b.depth == *d);
            }
            for cut in 0..body.len() {
                prop_assert!(decode_allocate(&body[..cut]).is_err());
            }
        }

        #[test]
        fn directory_messages_round_trip(owner in "[a-z0-9-]{1,12}", keys in prop::collection::vec("[a-z0-9/]{1,20}", 0..6), settled in any::<bool>(), owners in prop::collection::vec(prop::option::of(("[a-z0-9-]{1,12}", any::<u64>())), 0..6)) {
            let body = encode_owned_keys(&owner, keys.iter().map(String::as_str));
            prop_assert_eq!(decode_owned_keys(&body).unwrap(), (owner.clone(), keys.clone()));
            for cut in 0..body.len() {
                prop_assert!(decode_owned_keys(&body[..cut]).is_err());
            }
            let versioned: Vec<(String, u64)> = keys.iter().enumerate().map(|(i, k)| (k.clone(), (i as u64) << 40 | 7)).collect();
            let body = encode_publish_by(&owner, 7, versioned.iter().map(|(k, v)| (k.as_str(), *v)));
            prop_assert_eq!(decode_publish(&body).unwrap(), (owner.clone(), 7, versioned.clone()));
            for cut in 0..body.len() {
                prop_assert!(decode_publish(&body[..cut]).is_err());
            }
            let vs: Vec<u64> = versioned.iter().map(|(_, v)| *v).collect();
            let body = encode_versions(&vs);
            prop_assert_eq!(decode_versions(&body).unwrap(), vs);
            for cut in 0..body.len() {
                prop_assert!(decode_versions(&body[..cut]).is_err());
            }
            let body = encode_lookup(keys.iter().map(String::as_str));
            prop_assert_eq!(decode_lookup(&body).unwrap(), keys.clone());
            prop_assert_eq!(lookup_len(&body).unwrap(), keys.len());
            for cut in 0..body.len() {
                prop_assert!(decode_lookup(&body[..cut]).is_err());
            }
            let body = encode_owners(settled, &owners);
            prop_assert_eq!(decode_owners(&body).unwrap(), (settled, owners.clone()));
            for cut in 0..body.len() {
                prop_assert!(decode_owners(&body[..cut]).is_err());
            }
        }

        #[test]
        fn renewals_round_trip(lease in any::<i64>(), ttl_s in any::<u64>(), tag in 0u8..3) {
            let body = encode_renew(lease);
            prop_assert_eq!(decode_renew(&body).unwrap(), lease);
            let r = [Renewal::Renewed { ttl_s }, Renewal::Gone, Renewal::EtcdUnreachable][tag as usize];
            let body = encode_renewed(r);
            prop_assert_eq!(decode_renewed(&body).unwrap(), r);
            for cut in 0..body.len() {
                prop_assert!(decode_renewed(&body[..cut]).is_err());
                prop_assert!(decode_renew(&body[..cut.min(7)]).is_err());
            }
            let mut bad = body.clone();
            bad[0] = 3;
            prop_assert_eq!(decode_renewed(&bad), Err(WireError::Bad("renewal")));
        }

        #[test]
        fn heads_round_trip_and_bound_the_body(len in 0usize..(2 * MAX_BODY), op in 1u8..=19) {
            let f = frame(Op::from_u8(op).unwrap(), &[]);
            let mut head: [u8; HEAD] = f[..HEAD].try_into().unwrap();
            head[..4].copy_from_slice(&(len as u32).to_le_bytes());
            match decode_head(&head) {
                Ok(h) => prop_assert!(h.len == len && len <= MAX_BODY && h.op as u8 == op),
                Err(e) => prop_assert_eq!(e, WireError::TooLarge(len as u64)),
            }
        }
    }

    #[test]
    fn a_huge_count_is_refused_without_allocating() {
        let mut body = Vec::new();
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_resolve(&body), Err(WireError::Truncated("key count")));
        let mut head = [0u8; HEAD];
        head[4] = 5;
        head[6] = 1;
        assert_eq!(decode_head(&head), Err(WireError::Reserved));
    }
}
