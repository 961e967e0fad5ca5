//! Cutting one request into RDMA messages: at most the slice size, and never across a local or
//! remote registration chunk (each message uses one lkey and one rkey).

/// One message of a request: `len` bytes at `offset` from the request's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset from the start of the request.
    pub offset: u64,
    /// Bytes (never zero).
    pub len: u64,
}

/// Where the chunks of one side's registration start and how long they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkGrid {
    /// Base address of the registered region.
    pub base: u64,
    /// Chunk size of its split.
    pub chunk: u64,
}

impl ChunkGrid {
    /// Bytes from `addr` to the next chunk boundary.
    fn room(&self, addr: u64) -> u64 {
        let into = (addr - self.base) % self.chunk;
        self.chunk - into
    }
}

/// Calls `emit` for each piece of the `len`-byte transfer between `local_addr` and `remote_addr`.
/// Pieces tile `[0, len)` in order. Both addresses must lie in their grids' regions.
pub fn slice(
    local_addr: u64,
    remote_addr: u64,
    len: u64,
    max_piece: u64,
    local: ChunkGrid,
    remote: ChunkGrid,
    mut emit: impl FnMut(Piece),
) {
    let mut offset = 0;
    while offset < len {
        let n = (len - offset)
            .min(max_piece)
            .min(local.room(local_addr + offset))
            .min(remote.room(remote_addr + offset));
        emit(Piece { offset, len: n });
        offset += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(local_addr: u64, remote_addr: u64, len: u64, max: u64, l: ChunkGrid, r: ChunkGrid) -> Vec<Piece> {
        let mut v = Vec::new();
        slice(local_addr, remote_addr, len, max, l, r, |p| v.push(p));
        v
    }

    #[test]
    fn cuts_at_slice_size() {
        let g = ChunkGrid {
            base: 0,
            chunk: 1 << 40,
        };
        let p = collect(0, 0, 150 << 10, 64 << 10, g, g);
        assert_eq!(
            p.iter().map(|p| p.len).collect::<Vec<_>>(),
            vec![64 << 10, 64 << 10, 22 << 10]
        );
    }

    #[test]
    fn never_crosses_a_local_or_remote_chunk_boundary() {
        // Local region split every 1 MiB, remote every 768 KiB, from unaligned addresses.
        let l = ChunkGrid {
            base: 0x1000,
            chunk: 1 << 20,
        };
        let r = ChunkGrid {
            base: 0x8000,
            chunk: 768 << 10,
        };
        let (la, ra, len) = (0x1000 + 1000, 0x8000 + 5000, 4 << 20);
        let pieces = collect(la, ra, len, 256 << 10, l, r);
        let mut next = 0;
        for p in &pieces {
            assert_eq!(p.offset, next);
            assert!(p.len > 0 && p.len <= 256 << 10);
            let lc = |a: u64| (a - l.base) / l.chunk;
            let rc = |a: u64| (a - r.base) / r.chunk;
            assert_eq!(
                lc(la + p.offset),
                lc(la + p.offset + p.len - 1),
                "local crossing at {p:?}"
            );
            assert_eq!(
                rc(ra + p.offset),
                rc(ra + p.offset + p.len - 1),
                "remote crossing at {p:?}"
            );
            next += p.len;
        }
        assert_eq!(next, len);
    }

    proptest::proptest! {
        #[test]
        fn pieces_tile_the_request_and_respect_every_limit(
            lbase in 0u64..1 << 40,
            rbase in 0u64..1 << 40,
            lchunk_pages in 1u64..64,
            rchunk_pages in 1u64..64,
            loff in 0u64..1 << 20,
            roff in 0u64..1 << 20,
            len in 1u64..1 << 22,
            max in 1u64..1 << 20,
        ) {
            let l = ChunkGrid { base: lbase, chunk: lchunk_pages * 4096 };
            let r = ChunkGrid { base: rbase, chunk: rchunk_pages * 4096 };
            let (la, ra) = (lbase + loff, rbase + roff);
            let mut next = 0;
            slice(la, ra, len, max, l, r, |p| {
                assert_eq!(p.offset, next);
                assert!(p.len > 0 && p.len <= max);
                let last = p.offset + p.len - 1;
                assert_eq!((la + p.offset - l.base) / l.chunk, (la + last - l.base) / l.chunk);
                assert_eq!((ra + p.offset - r.base) / r.chunk, (ra + last - r.base) / r.chunk);
                next += p.len;
            });
            proptest::prop_assert_eq!(next, len);
        }
    }

    #[test]
    fn one_byte() {
        let g = ChunkGrid { base: 0, chunk: 4096 };
        assert_eq!(collect(4095, 0, 1, 1 << 20, g, g), vec![Piece { offset: 0, len: 1 }]);
    }
}
