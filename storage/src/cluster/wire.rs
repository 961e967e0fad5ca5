//! The control protocol between peers: pure encoding and decoding, no I/O, so it is fuzzed
//! without sockets. Fields are read and written with te-base's wire kit (`te_base::wire`: a
//! bounds-checked reader whose errors name the field and offset, counts refused before
//! allocation, one `WireError`); this file keeps only the protocol's own shapes (a key is a
//! `u16` length and 1 to [`MAX_KEY`] bytes of UTF-8).
//!
//! A frame is an 8-byte head and a body of at most [`MAX_BODY`] bytes. The head is te-base's
//! versioned preamble ([`PREAMBLE`]: the magic bytes `UC`, then the protocol [`VERSION`]), the
//! `u8` opcode and the `u32` body length (little-endian). A frame of another protocol or version
//! is refused at its head ([`WireError::BadMagic`], [`WireError::BadVersion`] naming both
//! versions), never parsed; every member of a cluster runs the same build, so there is no
//! compatibility with other versions. A connection opens with HELLO (the initiator's nonce, then
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

pub use te_base::wire::WireError;
use te_base::wire::{Preamble, Reader, Writer};

/// Size of a frame head.
pub const HEAD: usize = 8;
/// The version of the control protocol this build speaks (1: the first versioned head; the
/// heads before it had no magic and no version).
pub const VERSION: u8 = 1;
/// The start of every frame: magic and version.
pub const PREAMBLE: Preamble = Preamble {
    magic: b"UC",
    version: VERSION,
};
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
    PREAMBLE.write(&mut v);
    v.u8(op as u8);
    v.u32(body.len() as u32);
    v.bytes(body);
    v
}

/// Decodes a head: magic and version first, so a frame of another protocol or version is
/// refused before any of its fields is read.
pub fn decode_head(b: &[u8; HEAD]) -> Result<Head, WireError> {
    let mut r = Reader::new(b);
    PREAMBLE.check(&mut r)?;
    let at = r.position();
    let code = r.u8("opcode")?;
    let op = Op::from_u8(code).ok_or(WireError::BadValue {
        field: "opcode",
        at,
        value: code as u64,
    })?;
    let len = r.u32("body length")? as usize;
    if len > MAX_BODY {
        return Err(WireError::TooLarge {
            field: "body",
            len: len as u64,
            max: MAX_BODY as u64,
        });
    }
    Ok(Head { op, len })
}

/// A key (or member name): `u16` length, 1 to [`MAX_KEY`] bytes of UTF-8.
fn read_key(r: &mut Reader<'_>, field: &'static str) -> Result<String, WireError> {
    let at = r.position();
    let n = r.u16(field)? as usize;
    if n == 0 || n > MAX_KEY {
        return Err(WireError::BadValue {
            field,
            at,
            value: n as u64,
        });
    }
    let b = r.bytes(field, n)?;
    std::str::from_utf8(b)
        .map(str::to_owned)
        .map_err(|_| WireError::BadUtf8 { field, at })
}

/// A `u32` count of keys, then the keys.
fn read_keys(r: &mut Reader<'_>) -> Result<Vec<String>, WireError> {
    let n = r.count("key count", 3)?;
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        keys.push(read_key(r, "key")?);
    }
    Ok(keys)
}

/// A byte that must be 0 or 1.
fn read_bool(r: &mut Reader<'_>, field: &'static str) -> Result<bool, WireError> {
    let at = r.position();
    match r.u8(field)? {
        0 => Ok(false),
        1 => Ok(true),
        value => Err(WireError::BadValue {
            field,
            at,
            value: value as u64,
        }),
    }
}

fn put_key(out: &mut Vec<u8>, key: &str) {
    out.u16(key.len() as u16);
    out.bytes(key.as_bytes());
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
    out.u32(keys.len() as u32);
    for (key, ranges) in keys {
        put_key(&mut out, key);
        out.u32(ranges.len() as u32);
        for r in ranges {
            out.u64(r.offset);
            out.u64(r.len);
        }
    }
    out
}

/// Decodes a RESOLVE body.
pub fn decode_resolve(body: &[u8]) -> Result<Vec<WantedKey>, WireError> {
    let mut r = Reader::new(body);
    let n = r.count("key count", 7)?;
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        let key = read_key(&mut r, "key")?;
        let m = r.count("range count", 16)?;
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
    out.u64(lease);
    out.u32(places.len() as u32);
    for p in places {
        match p {
            Place::Dram {
                object_len,
                generation,
                extents,
            } => {
                out.u8(DRAM);
                out.u64(*object_len);
                out.u64(*generation);
                out.u32(extents.len() as u32);
                for (a, l) in extents {
                    out.u64(*a);
                    out.u64(*l);
                }
            }
            Place::Staged { object_len, addrs } => {
                out.u8(STAGED);
                out.u64(*object_len);
                out.u32(addrs.len() as u32);
                for a in addrs {
                    out.u64(*a);
                }
            }
            Place::Missing => out.push(MISSING),
            Place::Failed(why) => {
                out.u8(FAILED);
                let why = &why.as_bytes()[..why.len().min(MAX_REASON)];
                out.u16(why.len() as u16);
                out.bytes(why);
            }
        }
    }
    out
}

/// Decodes a PLACES body: the lease and one place per key.
pub fn decode_places(body: &[u8]) -> Result<(u64, Vec<Place>), WireError> {
    let mut r = Reader::new(body);
    let lease = r.u64("lease")?;
    let n = r.count("key count", 1)?;
    let mut places = Vec::with_capacity(n);
    for _ in 0..n {
        let at = r.position();
        places.push(match r.u8("status")? {
            DRAM => {
                let object_len = r.u64("object length")?;
                let generation = r.u64("generation")?;
                let m = r.count("extent count", 16)?;
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
                let m = r.count("address count", 8)?;
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
                    return Err(WireError::TooLarge {
                        field: "reason",
                        len: m as u64,
                        max: MAX_REASON as u64,
                    });
                }
                Place::Failed(String::from_utf8_lossy(r.bytes("reason", m)?).into_owned())
            }
            value => {
                return Err(WireError::BadValue {
                    field: "status",
                    at,
                    value: value as u64,
                })
            }
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
    out.u32(objs.len() as u32);
    for (key, len, depth) in objs {
        put_key(&mut out, key);
        out.u64(len);
        out.u32(depth);
    }
    out
}

/// Decodes an ALLOCATE body.
pub fn decode_allocate(body: &[u8]) -> Result<Vec<Allocation>, WireError> {
    let mut r = Reader::new(body);
    let n = r.count("object count", 15)?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(Allocation {
            key: read_key(&mut r, "key")?,
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
    out.u64(lease);
    out.u32(keys.len() as u32);
    for (key, generation) in keys {
        put_key(&mut out, key);
        out.u64(generation);
    }
    out
}

/// Decodes a VALIDATE body: the lease to release and `(key, generation)` pairs.
pub fn decode_validate(body: &[u8]) -> Result<(u64, Vec<(String, u64)>), WireError> {
    let mut r = Reader::new(body);
    let lease = r.u64("lease")?;
    let n = r.count("key count", 11)?;
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        keys.push((read_key(&mut r, "key")?, r.u64("generation")?));
    }
    r.end()?;
    Ok((lease, keys))
}

/// Encodes a VERDICTS body.
pub fn encode_verdicts(ok: &[bool]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + ok.len());
    out.u32(ok.len() as u32);
    out.extend(ok.iter().map(|&b| b as u8));
    out
}

/// Decodes a VERDICTS body.
pub fn decode_verdicts(body: &[u8]) -> Result<Vec<bool>, WireError> {
    let mut r = Reader::new(body);
    let n = r.count("verdict count", 1)?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(read_bool(&mut r, "verdict")?);
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
    let mut r = Reader::new(body);
    let owner = read_key(&mut r, "key")?;
    let keys = read_keys(&mut r)?;
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
    out.u64(deadline_ms);
    out.u32(keys.len() as u32);
    for (k, v) in keys {
        put_key(&mut out, k);
        out.u64(v);
    }
    out
}

/// A decoded PUBLISH: the owner named, the writer's deadline (0: none) and the keys with their
/// versions.
pub type Publish = (String, u64, Vec<(String, u64)>);

/// Decodes a PUBLISH body.
pub fn decode_publish(body: &[u8]) -> Result<Publish, WireError> {
    let mut r = Reader::new(body);
    let owner = read_key(&mut r, "key")?;
    let deadline = r.u64("deadline")?;
    let n = r.count("key count", 11)?;
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        keys.push((read_key(&mut r, "key")?, r.u64("version")?));
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
    out.u32(v.len() as u32);
    for x in v {
        out.u64(*x);
    }
    out
}

/// Decodes a VERSIONS body.
pub fn decode_versions(body: &[u8]) -> Result<Vec<u64>, WireError> {
    let mut r = Reader::new(body);
    let n = r.count("version count", 8)?;
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
    let mut r = Reader::new(body);
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
    out.u64(ttl);
    out
}

/// Decodes a RENEWED body.
pub fn decode_renewed(body: &[u8]) -> Result<Renewal, WireError> {
    let mut r = Reader::new(body);
    let (tag, ttl_s) = (r.u8("renewal")?, r.u64("ttl")?);
    r.end()?;
    Ok(match tag {
        0 => Renewal::Renewed { ttl_s },
        1 => Renewal::Gone,
        2 => Renewal::EtcdUnreachable,
        value => {
            return Err(WireError::BadValue {
                field: "renewal",
                at: 0,
                value: value as u64,
            })
        }
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
    Reader::new(body).count("key count", 3)
}

/// Decodes a LOOKUP body.
pub fn decode_lookup(body: &[u8]) -> Result<Vec<String>, WireError> {
    let mut r = Reader::new(body);
    let keys = read_keys(&mut r)?;
    r.end()?;
    Ok(keys)
}

/// Encodes an OWNERS body: whether the answering index is settled, and per key its owner.
pub fn encode_owners<S: AsRef<str>>(settled: bool, owners: &[Option<(S, u64)>]) -> Vec<u8> {
    let mut out = vec![settled as u8];
    out.u32(owners.len() as u32);
    for o in owners {
        match o {
            Some((name, version)) => {
                put_key(&mut out, name.as_ref());
                out.u64(*version);
            }
            None => out.u16(0),
        }
    }
    out
}

/// An OWNERS body: whether the answering peer has settled, and per key the owner and version
/// it indexes (`None`: not indexed there).
pub type OwnersAnswer = (bool, Vec<Option<(String, u64)>>);

/// Decodes an OWNERS body.
pub fn decode_owners(body: &[u8]) -> Result<OwnersAnswer, WireError> {
    let mut r = Reader::new(body);
    let settled = read_bool(&mut r, "settled")?;
    let n = r.count("owner count", 2)?;
    let mut owners = Vec::with_capacity(n);
    for _ in 0..n {
        // Length 0: not indexed there (no name, no version).
        let mut peek = r.clone();
        owners.push(match peek.u16("owner length")? {
            0 => {
                r = peek;
                None
            }
            _ => Some((read_key(&mut r, "owner")?, r.u64("owner version")?)),
        });
    }
    r.end()?;
    Ok((settled, owners))
}

fn put_keys<'a>(out: &mut Vec<u8>, keys: impl ExactSizeIterator<Item = &'a str>) {
    out.u32(keys.len() as u32);
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
            let refused = matches!(decode_renewed(&bad), Err(WireError::BadValue { field: "renewal", value: 3, .. }));
            prop_assert!(refused, "an unknown renewal tag");
        }

        #[test]
        fn heads_round_trip_and_bound_the_body(len in 0usize..(2 * MAX_BODY), op in 1u8..=19) {
            let f = frame(Op::from_u8(op).unwrap(), &[]);
            let mut head: [u8; HEAD] = f[..HEAD].try_into().unwrap();
            head[4..].copy_from_slice(&(len as u32).to_le_bytes());
            match decode_head(&head) {
                Ok(h) => prop_assert!(h.len == len && len <= MAX_BODY && h.op as u8 == op),
                Err(e) => prop_assert_eq!(e, WireError::TooLarge { field: "body", len: len as u64, max: MAX_BODY as u64 }),
            }
        }
    }

    /// The layouts of the module comment, byte for byte (the move to te-base's wire kit changed
    /// no byte on the wire).
    #[test]
    fn bodies_are_laid_out_as_documented() {
        let mut want = vec![1, 0, b'o'];
        want.extend_from_slice(&7u64.to_le_bytes());
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(&[1, 0, b'k']);
        want.extend_from_slice(&9u64.to_le_bytes());
        assert_eq!(encode_publish_by("o", 7, [("k", 9)].into_iter()), want);
        let mut want = 5u64.to_le_bytes().to_vec();
        want.extend_from_slice(&2u32.to_le_bytes());
        want.push(DRAM);
        for x in [10u64, 11, 0] {
            want.extend_from_slice(&x.to_le_bytes()[..if x == 0 { 4 } else { 8 }]);
        }
        want.push(FAILED);
        want.extend_from_slice(&2u16.to_le_bytes());
        want.extend_from_slice(b"no");
        let places = [
            Place::Dram {
                object_len: 10,
                generation: 11,
                extents: vec![],
            },
            Place::Failed("no".into()),
        ];
        assert_eq!(encode_places(5, &places), want);
        let mut want = vec![1];
        want.extend_from_slice(&2u32.to_le_bytes());
        want.extend_from_slice(&[1, 0, b'a']);
        want.extend_from_slice(&3u64.to_le_bytes());
        want.extend_from_slice(&0u16.to_le_bytes());
        assert_eq!(encode_owners(true, &[Some(("a", 3)), None]), want);
    }

    #[test]
    fn a_huge_count_is_refused_without_allocating() {
        let mut body = Vec::new();
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_resolve(&body),
            Err(WireError::CountTooLarge {
                field: "key count",
                count: 0xffff_ffff,
                ..
            })
        ));
        // The unversioned head of old (`u32` length first) is not this protocol's.
        let mut head = [0u8; HEAD];
        head[4] = 5;
        assert!(matches!(decode_head(&head), Err(WireError::BadMagic { .. })));
    }

    /// A peer of another version is refused at the head with an error naming both versions,
    /// whatever follows it.
    #[test]
    fn a_frame_of_another_version_is_refused_naming_both() {
        let f = frame(Op::Hello, b"member");
        assert_eq!(&f[..3], b"UC\x01", "magic, then the version");
        assert_eq!(f[3], Op::Hello as u8);
        assert_eq!(&f[4..HEAD], &6u32.to_le_bytes());
        for other in [0, VERSION + 1, u8::MAX] {
            let mut head: [u8; HEAD] = f[..HEAD].try_into().unwrap();
            head[2] = other;
            let e = decode_head(&head).unwrap_err();
            assert_eq!(
                e,
                WireError::BadVersion {
                    got: other,
                    speaks: VERSION
                }
            );
            let text = e.to_string();
            assert!(
                text.contains(&format!("version {other}")) && text.contains(&format!("speaks {VERSION}")),
                "{text}"
            );
        }
    }
}
