//! Ranged reads: planning the payload blocks a set of object ranges touches, and reading and
//! verifying them into staging.

use super::*;

impl LogCore {
    /// Appends to `spans` the block spans of `entry` that cover the object ranges
    /// `(offset, len)` of `ranges` (sorted by offset or not; adjacent spans merge), placing them
    /// in staging from `*staging_cursor` on. Returns the staging offset of each range's first
    /// byte through `range_staging`.
    pub fn plan_ranges(
        entry_pos: usize,
        ranges: impl Iterator<Item = (u64, u64)>,
        spans: &mut Vec<ReadSpan>,
        staging_cursor: &mut u64,
        range_staging: &mut Vec<u64>,
    ) {
        let first_span = spans.len();
        for (offset, len) in ranges {
            let fb = offset / BLOCK;
            let lb = (offset + len - 1) / BLOCK;
            // Reuse a span of this entry that already holds the blocks, or extends to them.
            let mut placed = None;
            if let Some(s) = spans[first_span..].last_mut() {
                let s_end = s.first_block + s.blocks;
                if fb >= s.first_block && fb <= s_end {
                    if lb >= s_end {
                        let grow = lb + 1 - s_end;
                        s.blocks += grow;
                        *staging_cursor += grow * BLOCK;
                    }
                    placed = Some(s.staging_offset + (offset - s.first_block * BLOCK));
                }
            }
            let at = placed.unwrap_or_else(|| {
                let blocks = lb + 1 - fb;
                spans.push(ReadSpan {
                    entry: entry_pos,
                    first_block: fb,
                    blocks,
                    staging_offset: *staging_cursor,
                });
                *staging_cursor += blocks * BLOCK;
                *staging_cursor - blocks * BLOCK + (offset - fb * BLOCK)
            });
            range_staging.push(at);
        }
    }

    /// Reads `spans` of `entries` into staging and verifies every block read. Per span: `Ok` or
    /// the error of its key (nothing of a failed span may be returned to a caller). Counts the
    /// bytes read once.
    ///
    /// # Safety
    ///
    /// `staging` must be valid for writes over every span's `[staging_offset, +blocks * 4096)`,
    /// 4 KiB-aligned, and not used by anyone else until this returns.
    pub unsafe fn read_spans(
        &self,
        keys: &[&str],
        entries: &[&SsdEntry],
        spans: &[ReadSpan],
        staging: *mut u8,
        results: &mut Vec<Result<()>>,
    ) {
        results.clear();
        let in_record = |s: &ReadSpan| {
            let e = entries[s.entry];
            !e.damaged
                && s.first_block
                    .checked_add(s.blocks)
                    .is_some_and(|end| end <= e.crcs.len() as u64)
        };
        let ops: Vec<IoOp> = spans
            .iter()
            .filter(|s| in_record(s))
            .map(|s| {
                let e = entries[s.entry];
                IoOp {
                    fd: fd(&e.file.file),
                    offset: e.block_offset(s.first_block),
                    // SAFETY: inside staging per the contract.
                    buf: unsafe { staging.add(s.staging_offset as usize) },
                    len: (s.blocks * BLOCK) as usize,
                    write: false,
                }
            })
            .collect();
        let outcome = self.io.run(&ops);
        let mut read = 0u64;
        let mut op = 0usize;
        for s in spans {
            let e = entries[s.entry];
            if !in_record(s) {
                results.push(Err(StoreError::Corrupt {
                    key: keys[s.entry].to_owned(),
                    tier: Tier::Ssd,
                    detail: "the record's header failed its CRC32C".into(),
                }));
                continue;
            }
            let k = op;
            op += 1;
            if let Err((bad, err)) = &outcome {
                // Ops from the first failure on may not have completed.
                if k >= *bad {
                    results.push(Err(StoreError::io(
                        format!("read {:?} from the SSD log", keys[s.entry]),
                        clone_io(err),
                    )));
                    continue;
                }
            }
            read += s.blocks * BLOCK;
            // SAFETY: the span was just read into staging, which the caller keeps valid.
            let bytes = unsafe {
                std::slice::from_raw_parts(staging.add(s.staging_offset as usize), (s.blocks * BLOCK) as usize)
            };
            let want = &e.crcs[s.first_block as usize..(s.first_block + s.blocks) as usize];
            let bad_block = bytes
                .chunks(BLOCK as usize)
                .zip(want)
                .position(|(b, &c)| crc32c::crc32c(b) != c);
            results.push(match bad_block {
                None => Ok(()),
                Some(b) => Err(StoreError::Corrupt {
                    key: keys[s.entry].to_owned(),
                    tier: Tier::Ssd,
                    detail: format!("payload block {} failed its CRC32C", s.first_block + b as u64),
                }),
            });
        }
        self.counters.bytes_read.fetch_add(read, Ordering::Relaxed);
    }
}
