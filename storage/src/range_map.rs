//! Ranges of a ranged call and their validation, and the map from object offsets to where the
//! bytes are stored (one or more extents).
//!
//! Validation is one pass when a key's ranges come sorted by offset (the usual case: layers in
//! order); otherwise the ranges are ordered through a scratch index vector the caller reuses across
//! the keys of a call, so nothing is allocated per key.

use crate::error::{Result, StoreError};

/// One range of a ranged call: `len` bytes at object offset `offset`, landing at (get) or coming
/// from (put) caller address `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Offset in the object.
    pub offset: u64,
    /// Number of bytes.
    pub len: u64,
    /// Caller address (inside a buffer registered with the store).
    pub addr: u64,
}

impl Range {
    /// A range of `len` bytes at object offset `offset` and caller address `addr`.
    pub fn new(offset: u64, len: u64, addr: u64) -> Self {
        Range { offset, len, addr }
    }
}

/// Checks the ranges of a get: non-empty, inside an object of `object_len` bytes, non-overlapping.
pub fn check_get_ranges(key_index: usize, object_len: u64, ranges: &[Range], scratch: &mut Vec<u32>) -> Result<()> {
    check(key_index, object_len, ranges, scratch, false)
}

/// Checks the ranges of a put: as [`check_get_ranges`], and together they cover `[0, object_len)`
/// exactly.
pub fn check_put_ranges(key_index: usize, object_len: u64, ranges: &[Range], scratch: &mut Vec<u32>) -> Result<()> {
    if object_len == 0 {
        return Err(StoreError::ZeroLength {
            key_index,
            range_index: 0,
        });
    }
    check(key_index, object_len, ranges, scratch, true)
}

fn check(key_index: usize, object_len: u64, ranges: &[Range], scratch: &mut Vec<u32>, tile: bool) -> Result<()> {
    // The usual get: ranges in offset order, none overlapping the previous one. One pass decides
    // it; anything else (unsorted, overlapping, a put's tiling) takes the full check below.
    if !tile && in_order_without_overlap(object_len, ranges) {
        return Ok(());
    }
    let mut sorted = true;
    let mut prev_offset = 0u64;
    for (i, r) in ranges.iter().enumerate() {
        if r.len == 0 {
            return Err(StoreError::ZeroLength {
                key_index,
                range_index: i,
            });
        }
        if r.offset > object_len || r.len > object_len - r.offset {
            return Err(StoreError::RangeOutsideObject {
                key_index,
                range_index: i,
                offset: r.offset,
                len: r.len,
                object_len,
            });
        }
        if i > 0 && r.offset < prev_offset {
            sorted = false;
        }
        prev_offset = r.offset;
    }
    if sorted {
        scan(key_index, object_len, ranges, (0..ranges.len()).map(|i| i as u32), tile)
    } else {
        scratch.clear();
        scratch.extend(0..ranges.len() as u32);
        scratch.sort_unstable_by_key(|&i| ranges[i as usize].offset);
        scan(key_index, object_len, ranges, scratch.iter().copied(), tile)
    }
}

/// True when every range is non-empty, inside the object, and starts at or after the end of the
/// one before it (so none overlaps another).
#[inline]
fn in_order_without_overlap(object_len: u64, ranges: &[Range]) -> bool {
    let mut covered_to = 0u64;
    ranges.iter().all(|r| {
        let ok = r.len != 0 && r.offset >= covered_to && r.offset <= object_len && r.len <= object_len - r.offset;
        covered_to = r.offset.saturating_add(r.len);
        ok
    })
}

/// Walks ranges in offset order: overlaps, and (for puts) gaps.
fn scan(
    key_index: usize,
    object_len: u64,
    ranges: &[Range],
    order: impl Iterator<Item = u32>,
    tile: bool,
) -> Result<()> {
    let mut covered_to = 0u64;
    let mut prev: Option<usize> = None;
    for i in order {
        let i = i as usize;
        let r = ranges[i];
        if let Some(p) = prev {
            if r.offset < covered_to {
                return Err(StoreError::RangesOverlap {
                    key_index,
                    first: p.min(i),
                    second: p.max(i),
                });
            }
        }
        if tile && r.offset > covered_to {
            return Err(StoreError::RangesDoNotTile {
                key_index,
                object_len,
                gap_start: covered_to,
                gap_end: r.offset,
            });
        }
        covered_to = r.offset + r.len;
        prev = Some(i);
    }
    if tile && covered_to < object_len {
        return Err(StoreError::RangesDoNotTile {
            key_index,
            object_len,
            gap_start: covered_to,
            gap_end: object_len,
        });
    }
    Ok(())
}

/// A contiguous piece of where an object is stored: `len` bytes at `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Start (an arena address, or a byte offset in a file).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Calls `emit(storage_addr, caller_addr, len)` for each piece of object range `r` as the object is
/// laid out over `extents` (object byte 0 is the first byte of `extents[0]`). One call when the
/// object is in one extent. `r` must lie within the extents' total length.
#[inline]
pub fn map_range(extents: &[Extent], r: &Range, mut emit: impl FnMut(u64, u64, u64)) {
    if let [only] = extents {
        emit(only.addr + r.offset, r.addr, r.len);
        return;
    }
    let mut ext_start = 0u64;
    let mut offset = r.offset;
    let mut left = r.len;
    let mut caller = r.addr;
    for e in extents {
        let ext_end = ext_start + e.len;
        if offset < ext_end && left > 0 {
            let within = offset - ext_start;
            let n = (e.len - within).min(left);
            emit(e.addr + within, caller, n);
            offset += n;
            caller += n;
            left -= n;
        }
        if left == 0 {
            break;
        }
        ext_start = ext_end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn r(offset: u64, len: u64) -> Range {
        Range::new(offset, len, 0x1000u64.wrapping_add(offset))
    }

    #[test]
    fn every_shape_error_is_typed() {
        let mut s = Vec::new();
        assert!(check_get_ranges(0, 100, &[r(0, 10), r(10, 90)], &mut s).is_ok());
        assert!(matches!(
            check_get_ranges(3, 100, &[r(0, 10), r(95, 10)], &mut s),
            Err(StoreError::RangeOutsideObject {
                key_index: 3,
                range_index: 1,
                ..
            })
        ));
        assert!(matches!(
            check_get_ranges(0, 100, &[r(u64::MAX, 2)], &mut s),
            Err(StoreError::RangeOutsideObject { .. })
        ));
        assert!(matches!(
            check_get_ranges(0, 100, &[r(20, 10), r(0, 25)], &mut s),
            Err(StoreError::RangesOverlap {
                first: 0,
                second: 1,
                ..
            })
        ));
        assert!(matches!(
            check_get_ranges(0, 100, &[r(0, 0)], &mut s),
            Err(StoreError::ZeroLength { range_index: 0, .. })
        ));
        assert!(check_put_ranges(0, 100, &[r(50, 50), r(0, 50)], &mut s).is_ok());
        assert!(matches!(
            check_put_ranges(0, 100, &[r(0, 40), r(50, 50)], &mut s),
            Err(StoreError::RangesDoNotTile {
                gap_start: 40,
                gap_end: 50,
                ..
            })
        ));
        assert!(matches!(
            check_put_ranges(0, 100, &[r(0, 40)], &mut s),
            Err(StoreError::RangesDoNotTile {
                gap_start: 40,
                gap_end: 100,
                ..
            })
        ));
        assert!(matches!(
            check_put_ranges(0, 100, &[r(10, 90)], &mut s),
            Err(StoreError::RangesDoNotTile {
                gap_start: 0,
                gap_end: 10,
                ..
            })
        ));
        assert!(matches!(
            check_put_ranges(0, 0, &[], &mut s),
            Err(StoreError::ZeroLength { .. })
        ));
    }

    fn covered(object_len: u64, ranges: &[Range]) -> Vec<u32> {
        let mut c = vec![0u32; object_len as usize];
        for r in ranges {
            for b in r.offset..(r.offset + r.len).min(object_len) {
                c[b as usize] += 1;
            }
        }
        c
    }

    proptest! {
        /// The checks agree with a byte-by-byte coverage count, whatever the order of the ranges.
        #[test]
        fn checks_match_a_coverage_count(
            object_len in 1u64..200,
            raw in proptest::collection::vec((0u64..220, 0u64..80), 0..8),
        ) {
            let ranges: Vec<Range> = raw.iter().map(|&(o, l)| r(o, l)).collect();
            let mut s = Vec::new();
            let any_zero = ranges.iter().any(|r| r.len == 0);
            let any_outside = ranges.iter().any(|r| r.offset + r.len > object_len);
            let c = covered(object_len, &ranges);
            let overlap = c.iter().any(|&n| n > 1);
            let full = c.iter().all(|&n| n >= 1);
            let get = check_get_ranges(0, object_len, &ranges, &mut s);
            prop_assert_eq!(get.is_ok(), !any_zero && !any_outside && !overlap);
            let put = check_put_ranges(0, object_len, &ranges, &mut s);
            prop_assert_eq!(put.is_ok(), !any_zero && !any_outside && !overlap && full);
        }

        /// Mapping a range over any split of the object into extents yields pieces that tile the
        /// range in order and land where the object's bytes are.
        #[test]
        fn map_range_tiles_the_range(
            splits in proptest::collection::vec(1u64..50, 1..6),
            start_frac in 0.0f64..1.0,
            len_frac in 0.0f64..1.0,
        ) {
            let total: u64 = splits.iter().sum();
            let mut extents = Vec::new();
            let mut base = 1_000_000u64;
            for &l in &splits {
                extents.push(Extent { addr: base, len: l });
                base += l + 7_777; // gaps between extents
            }
            let offset = ((total - 1) as f64 * start_frac) as u64;
            let len = 1 + ((total - offset - 1) as f64 * len_frac) as u64;
            let range = Range::new(offset, len, 5_000);
            // Where object byte b lives.
            let locate = |b: u64| {
                let mut start = 0;
                for e in &extents {
                    if b < start + e.len { return e.addr + (b - start); }
                    start += e.len;
                }
                unreachable!()
            };
            let mut next_caller = range.addr;
            let mut pieces = 0;
            map_range(&extents, &range, |storage, caller, n| {
                assert_eq!(caller, next_caller);
                for k in 0..n {
                    assert_eq!(storage + k, locate(offset + (caller - range.addr) + k));
                }
                next_caller += n;
                pieces += 1;
            });
            prop_assert_eq!(next_caller, range.addr + len);
            prop_assert!(pieces >= 1 && pieces <= extents.len());
        }
    }
}
