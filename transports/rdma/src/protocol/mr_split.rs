//! Splitting registrations larger than the device's max MR size, and finding the chunk (and so
//! the key) that holds an address in O(1).
//!
//! Every chunk but the last has the same size, so the chunk of an address is a division, and a
//! transfer slice never crosses a chunk boundary (see [`super::slicing`]).

use te_base::{Error, Result};

/// Smallest chunk: one page, so a split never produces sub-page registrations.
pub const MIN_CHUNK: u64 = 4096;

/// The chunk size for a region on devices whose smallest max MR size is `device_max`, optionally
/// lowered by `TE_RDMA_MAX_MR_SIZE`. Page-aligned, at least [`MIN_CHUNK`].
pub fn chunk_size(device_max: u64, configured: Option<u64>) -> u64 {
    let limit = configured.map_or(device_max, |c| c.min(device_max));
    (limit - limit % MIN_CHUNK).max(MIN_CHUNK)
}

/// Number of chunks of a region of `len` bytes.
pub fn chunk_count(len: u64, chunk: u64) -> u64 {
    len.div_ceil(chunk)
}

/// The `(address, length)` of each registration a region `[base, base + len)` needs.
pub fn split(base: u64, len: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..chunk_count(len, chunk)).map(move |i| {
        let off = i * chunk;
        (base + off, chunk.min(len - off))
    })
}

/// Where an address falls in a split region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPos {
    /// Chunk index.
    pub index: usize,
    /// Bytes from the address to the end of its chunk.
    pub room: u64,
}

/// Finds the chunk holding `addr` in the region `[base, base + len)` split at `chunk`.
pub fn locate(base: u64, len: u64, chunk: u64, addr: u64) -> Result<ChunkPos> {
    if addr < base || addr - base >= len || chunk == 0 {
        return Err(Error::Unregistered { addr, len: 1 });
    }
    let off = addr - base;
    let index = off / chunk;
    let chunk_end = ((index + 1) * chunk).min(len);
    Ok(ChunkPos {
        index: index as usize,
        room: chunk_end - off,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_size_respects_device_and_configuration() {
        assert_eq!(chunk_size(1 << 40, None), 1 << 40);
        assert_eq!(chunk_size(1 << 40, Some(1 << 30)), 1 << 30);
        assert_eq!(chunk_size(1 << 20, Some(1 << 30)), 1 << 20, "device is the ceiling");
        assert_eq!(chunk_size((1 << 20) + 123, None), 1 << 20, "page-aligned");
        assert_eq!(chunk_size(100, None), MIN_CHUNK);
    }

    #[test]
    fn splits_tile_the_region_exactly() {
        let chunk = 1 << 20;
        let base = 0x7f00_0000_1000;
        let len = (5 << 20) + 4096 + 17;
        let parts: Vec<_> = split(base, len, chunk).collect();
        assert_eq!(parts.len(), 6);
        assert_eq!(parts[0], (base, chunk));
        assert_eq!(parts[5], (base + (5 << 20), 4096 + 17));
        let mut next = base;
        for (a, l) in &parts {
            assert_eq!(*a, next);
            assert!(*l > 0 && *l <= chunk);
            next = a + l;
        }
        assert_eq!(next, base + len);
        assert_eq!(split(base, chunk, chunk).count(), 1, "exact multiple: no empty tail");
    }

    #[test]
    fn locate_finds_the_chunk_and_the_room_left() {
        let (base, len, chunk) = (0x10000, 3 * 4096 + 100, 4096);
        assert_eq!(
            locate(base, len, chunk, base).unwrap(),
            ChunkPos { index: 0, room: 4096 }
        );
        assert_eq!(
            locate(base, len, chunk, base + 4095).unwrap(),
            ChunkPos { index: 0, room: 1 }
        );
        assert_eq!(
            locate(base, len, chunk, base + 4096).unwrap(),
            ChunkPos { index: 1, room: 4096 }
        );
        assert_eq!(
            locate(base, len, chunk, base + 3 * 4096 + 1).unwrap(),
            ChunkPos { index: 3, room: 99 }
        );
        assert!(locate(base, len, chunk, base + len).is_err());
        assert!(locate(base, len, chunk, base - 1).is_err());
    }
}
