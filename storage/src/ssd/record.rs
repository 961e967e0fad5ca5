//! The on-disk record of the SSD log.
//!
//! A record is a header of whole 4 KiB blocks followed by the payload padded to whole blocks, so
//! every record starts 4 KiB-aligned and a ranged read can fetch just the payload blocks it needs.
//! The header holds one CRC32C per payload block (a ranged read verifies exactly what it read) and
//! a CRC32C of itself. Layout (little endian):
//!
//! ```text
//!  0  magic "UMBPREC\x01"      8  flags u32 (bit 0: dead,   12  header crc u32
//!                                          bit 1: void)
//! 16  seq u64                  24  payload_len u64           32  key_len u32
//! 36  depth u32                40  nblocks u32               44  header_len u32
//! 48  key bytes, then nblocks x u32 block crcs, zero padding to header_len
//! ```

/// Alignment and block size of the log.
pub const BLOCK: u64 = 4096;
/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 1024;

const MAGIC: [u8; 8] = *b"UMBPREC\x01";
const FIXED: usize = 48;
const CRC_AT: usize = 12;
/// The flag of a record that was removed or superseded: at open it hides every record of its key
/// with a sequence number not above its own.
pub const FLAG_DEAD: u32 = 1;
/// The flag of a surplus copy of a version whose record lives elsewhere (a compaction copy left
/// by a crash, or a version appended twice): at open it is skipped and hides nothing. Marking such
/// a copy dead instead would hide the live copy of the same version.
pub const FLAG_VOID: u32 = 2;

/// Rounds `n` up to whole blocks.
pub const fn align_up(n: u64) -> u64 {
    n.div_ceil(BLOCK) * BLOCK
}

/// Payload blocks of a payload of `payload_len` bytes.
pub fn payload_blocks(payload_len: u64) -> u64 {
    payload_len.div_ceil(BLOCK)
}

/// Header length in bytes (whole blocks) of a record.
pub fn header_len(key_len: usize, payload_len: u64) -> u64 {
    align_up(FIXED as u64 + key_len as u64 + 4 * payload_blocks(payload_len))
}

/// Total on-disk length of a record.
pub fn record_len(key_len: usize, payload_len: u64) -> u64 {
    header_len(key_len, payload_len) + payload_blocks(payload_len) * BLOCK
}

/// Total on-disk length of a record whose header says `header_len` and `payload_len`, or `None`
/// when the sum does not fit in a u64 (fields read from disk are never trusted to add up).
pub fn checked_record_len(header_len: u64, payload_len: u64) -> Option<u64> {
    payload_blocks(payload_len).checked_mul(BLOCK)?.checked_add(header_len)
}

/// A parsed, checksum-verified header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Flags (see [`FLAG_DEAD`] and [`FLAG_VOID`]).
    pub flags: u32,
    /// Log sequence number (larger is newer).
    pub seq: u64,
    /// Payload length in bytes.
    pub payload_len: u64,
    /// Depth hint given at put.
    pub depth: u32,
    /// Header length in bytes.
    pub header_len: u64,
    /// The key.
    pub key: String,
    /// CRC32C of each payload block (the last one padded with zeros).
    pub block_crcs: Vec<u32>,
}

/// Fields a header is written from.
#[derive(Debug, Clone, Copy)]
pub struct HeaderFields<'a> {
    /// Flags.
    pub flags: u32,
    /// Sequence number.
    pub seq: u64,
    /// Payload length.
    pub payload_len: u64,
    /// Depth hint.
    pub depth: u32,
    /// The key.
    pub key: &'a str,
    /// One CRC per payload block.
    pub block_crcs: &'a [u32],
}

/// Writes the header into `out` (exactly [`header_len`] bytes, zero-padded).
pub fn encode_header(f: &HeaderFields<'_>, out: &mut [u8]) {
    let hl = header_len(f.key.len(), f.payload_len) as usize;
    debug_assert_eq!(out.len(), hl);
    debug_assert_eq!(f.block_crcs.len() as u64, payload_blocks(f.payload_len));
    out.fill(0);
    out[0..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&f.flags.to_le_bytes());
    out[16..24].copy_from_slice(&f.seq.to_le_bytes());
    out[24..32].copy_from_slice(&f.payload_len.to_le_bytes());
    out[32..36].copy_from_slice(&(f.key.len() as u32).to_le_bytes());
    out[36..40].copy_from_slice(&f.depth.to_le_bytes());
    out[40..44].copy_from_slice(&(f.block_crcs.len() as u32).to_le_bytes());
    out[44..48].copy_from_slice(&(hl as u32).to_le_bytes());
    let key_end = FIXED + f.key.len();
    out[FIXED..key_end].copy_from_slice(f.key.as_bytes());
    for (i, c) in f.block_crcs.iter().enumerate() {
        out[key_end + 4 * i..key_end + 4 * i + 4].copy_from_slice(&c.to_le_bytes());
    }
    let used = key_end + 4 * f.block_crcs.len();
    let crc = crc32c::crc32c(&out[..used]);
    out[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// True when `block` starts with the record magic (a candidate header when resynchronising).
pub fn has_magic(block: &[u8]) -> bool {
    block.len() >= FIXED && block[0..8] == MAGIC
}

/// What the first block of a record says about its length, before the rest is read: `None` when
/// it is not a record start (no magic, impossible fields).
pub fn peek_header_len(first_block: &[u8]) -> Option<u64> {
    if !has_magic(first_block) {
        return None;
    }
    let payload_len = u64_at(first_block, 24);
    let key_len = u32_at(first_block, 32) as usize;
    let nblocks = u32_at(first_block, 40) as u64;
    let hl = u32_at(first_block, 44) as u64;
    if key_len == 0 || key_len > MAX_KEY_LEN || nblocks != payload_blocks(payload_len) || payload_len == 0 {
        return None;
    }
    // nblocks fits a u32 and equals the payload's blocks, so the lengths below cannot overflow.
    (hl == header_len(key_len, payload_len)).then_some(hl)
}

/// Parses and verifies a whole header (`bytes` holds at least its [`peek_header_len`] bytes).
/// `None` for anything torn or not a header.
pub fn decode_header(bytes: &[u8]) -> Option<Header> {
    let h = decode_header_unverified(bytes)?;
    let key_end = FIXED + h.key.len();
    let used = key_end + 4 * h.block_crcs.len();
    let stored = u32_at(bytes, CRC_AT);
    let crc = crc32c::crc32c_append(crc32c::crc32c(&bytes[..CRC_AT]), &[0; 4]);
    let crc = crc32c::crc32c_append(crc, &bytes[CRC_AT + 4..used]);
    (crc == stored).then_some(h)
}

/// Parses a header without checking its CRC: what a damaged header claims (used only to tell a
/// damaged header over an intact payload from a torn write). `None` when the fields are
/// implausible or the key is not UTF-8.
pub fn decode_header_unverified(bytes: &[u8]) -> Option<Header> {
    let hl = peek_header_len(bytes)? as usize;
    if bytes.len() < hl {
        return None;
    }
    let key_len = u32_at(bytes, 32) as usize;
    let nblocks = u32_at(bytes, 40) as usize;
    let key_end = FIXED + key_len;
    let key = std::str::from_utf8(&bytes[FIXED..key_end]).ok()?.to_owned();
    let block_crcs = (0..nblocks).map(|i| u32_at(bytes, key_end + 4 * i)).collect();
    Some(Header {
        flags: u32_at(bytes, 8),
        seq: u64_at(bytes, 16),
        payload_len: u64_at(bytes, 24),
        depth: u32_at(bytes, 36),
        header_len: hl as u64,
        key,
        block_crcs,
    })
}

/// CRC32C of each block of `padded` (a whole number of blocks), into `out`.
pub fn block_crcs(padded: &[u8], out: &mut Vec<u32>) {
    debug_assert_eq!(padded.len() as u64 % BLOCK, 0);
    out.clear();
    out.extend(padded.chunks(BLOCK as usize).map(crc32c::crc32c));
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any header round-trips, and flipping any byte of its used part is detected.
        #[test]
        fn header_round_trips_and_detects_flips(
            key in "[a-z0-9/_-]{1,300}",
            payload_len in 1u64..3_000_000,
            seq in any::<u64>(),
            depth in any::<u32>(),
            flip in any::<prop::sample::Index>(),
        ) {
            let n = payload_blocks(payload_len) as usize;
            let crcs: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
            let f = HeaderFields { flags: 0, seq, payload_len, depth, key: &key, block_crcs: &crcs };
            let mut buf = vec![0u8; header_len(key.len(), payload_len) as usize];
            encode_header(&f, &mut buf);
            let h = decode_header(&buf).expect("valid header");
            prop_assert_eq!(&h.key, &key);
            prop_assert_eq!(h.seq, seq);
            prop_assert_eq!(h.payload_len, payload_len);
            prop_assert_eq!(h.depth, depth);
            prop_assert_eq!(&h.block_crcs, &crcs);
            let used = FIXED + key.len() + 4 * n;
            let at = flip.index(used);
            buf[at] ^= 0x40;
            prop_assert!(decode_header(&buf).is_none());
        }
    }

    proptest! {
        /// Arbitrary bytes never panic the decoder; with the magic in front they still never
        /// panic, and whatever decodes re-encodes to the same bytes.
        #[test]
        fn arbitrary_bytes_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 0..3 * BLOCK as usize), magic in any::<bool>()) {
            if magic && bytes.len() >= 8 {
                bytes[..8].copy_from_slice(&MAGIC);
            }
            let _ = peek_header_len(&bytes);
            let _ = decode_header_unverified(&bytes);
            if let Some(h) = decode_header(&bytes) {
                let mut again = vec![0u8; h.header_len as usize];
                let f = HeaderFields {
                    flags: h.flags,
                    seq: h.seq,
                    payload_len: h.payload_len,
                    depth: h.depth,
                    key: &h.key,
                    block_crcs: &h.block_crcs,
                };
                encode_header(&f, &mut again);
                prop_assert_eq!(decode_header(&again), Some(h));
            }
        }

        /// Plausible fixed fields with garbage lengths never panic or overflow.
        #[test]
        fn hostile_fields_never_panic(payload_len in any::<u64>(), key_len in any::<u32>(), nblocks in any::<u32>(), hl in any::<u32>()) {
            let mut b = vec![0u8; BLOCK as usize];
            b[..8].copy_from_slice(&MAGIC);
            b[24..32].copy_from_slice(&payload_len.to_le_bytes());
            b[32..36].copy_from_slice(&key_len.to_le_bytes());
            b[40..44].copy_from_slice(&nblocks.to_le_bytes());
            b[44..48].copy_from_slice(&hl.to_le_bytes());
            if let Some(h) = peek_header_len(&b) {
                prop_assert!(h >= BLOCK && h % BLOCK == 0);
                prop_assert!(checked_record_len(h, payload_len).is_some());
            }
            let _ = decode_header(&b);
            let _ = decode_header_unverified(&b);
        }
    }

    #[test]
    fn lengths_are_block_aligned() {
        assert_eq!(header_len(10, 1), BLOCK);
        assert_eq!(record_len(10, 1), 2 * BLOCK);
        assert_eq!(record_len(10, BLOCK), 2 * BLOCK);
        assert_eq!(record_len(10, BLOCK + 1), 3 * BLOCK);
        // 1,100 blocks of CRCs do not fit in one header block.
        assert_eq!(header_len(10, 1100 * BLOCK), 2 * BLOCK);
        assert!(peek_header_len(&[0u8; 4096]).is_none());
    }
}
