//! Striping one transfer across the rails both sides registered its buffers on, in proportion to
//! each rail's link rate. Pure functions writing into caller-owned vectors, so a transport plans a
//! whole batch without allocating per transfer.

use serde::{Deserialize, Serialize};

use super::policy::{NicPolicy, DEFAULT_STRIPE_MIN_BYTES};

/// A rail and its link rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RailRate {
    /// Rail index (NIC position in bus-id order on its host; rail `i` talks to rail `i`).
    pub rail: usize,
    /// Link rate in Mbit/s; 0 when unknown.
    pub rate_mbps: u64,
}

/// One slice of a striped transfer: bytes `[offset, offset + len)` of the transfer go over `rail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stripe {
    /// Rail index.
    pub rail: usize,
    /// Offset of the slice from the start of the transfer.
    pub offset: u64,
    /// Length of the slice (never zero).
    pub len: u64,
}

/// Writes into `out` the rails present on both sides (matched by rail index, ascending), each at
/// the slower side's rate. `out` is cleared first.
pub fn common_rails(local: &[RailRate], remote: &[RailRate], out: &mut Vec<RailRate>) {
    out.clear();
    for l in local {
        if let Some(r) = remote.iter().find(|r| r.rail == l.rail) {
            if !out.iter().any(|o| o.rail == l.rail) {
                out.push(RailRate {
                    rail: l.rail,
                    rate_mbps: l.rate_mbps.min(r.rate_mbps),
                });
            }
        }
    }
    out.sort_unstable_by_key(|r| r.rail);
}

/// Splits transfers across rails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripePlanner {
    min_bytes: u64,
    granule: u64,
}

impl Default for StripePlanner {
    fn default() -> Self {
        StripePlanner::new(DEFAULT_STRIPE_MIN_BYTES)
    }
}

impl StripePlanner {
    /// Slice boundaries are multiples of this (except the end of the transfer), so slices stay
    /// page-sized and a rail never gets a sliver.
    pub const DEFAULT_GRANULE: u64 = 4096;

    /// Stripes transfers of more than `min_bytes`.
    pub fn new(min_bytes: u64) -> StripePlanner {
        StripePlanner {
            min_bytes,
            granule: Self::DEFAULT_GRANULE,
        }
    }

    /// The planner for a policy's `TE_STRIPE_MIN_BYTES`.
    pub fn from_policy(policy: &NicPolicy) -> StripePlanner {
        StripePlanner::new(policy.stripe_min_bytes)
    }

    /// The same planner with another boundary granule (at least 1).
    pub fn with_granule(self, granule: u64) -> StripePlanner {
        StripePlanner {
            granule: granule.max(1),
            ..self
        }
    }

    /// The striping threshold in bytes.
    pub fn min_bytes(&self) -> u64 {
        self.min_bytes
    }

    /// Plans `len` bytes over `rails` into `out` (cleared first). A transfer of at most
    /// `min_bytes`, or with one rail, goes whole over `rails[rotation % rails.len()]` (callers
    /// rotate to spread small transfers). Larger ones are cut at granule-aligned boundaries in
    /// proportion to the rates; when any rate is unknown (0) all rails weigh the same. The slices
    /// tile `[0, len)` in rail order, none is empty, and the result depends only on the inputs.
    /// Nothing is written when `len` is 0 or `rails` is empty.
    pub fn plan(&self, len: u64, rails: &[RailRate], rotation: usize, out: &mut Vec<Stripe>) {
        out.clear();
        if len == 0 || rails.is_empty() {
            return;
        }
        if len <= self.min_bytes || rails.len() == 1 {
            out.push(Stripe {
                rail: rails[rotation % rails.len()].rail,
                offset: 0,
                len,
            });
            return;
        }
        let equal = rails.iter().any(|r| r.rate_mbps == 0);
        let weight = |r: &RailRate| if equal { 1u128 } else { r.rate_mbps as u128 };
        let total: u128 = rails.iter().map(weight).sum();
        let mut cumulative: u128 = 0;
        let mut start = 0u64;
        for (i, rail) in rails.iter().enumerate() {
            cumulative += weight(rail);
            let end = if i + 1 == rails.len() {
                len
            } else {
                // Fits: len < 2^64 and cumulative <= total, so the quotient is at most len.
                let ideal = (len as u128 * cumulative / total) as u64;
                (ideal - ideal % self.granule).max(start)
            };
            if end > start {
                out.push(Stripe {
                    rail: rail.rail,
                    offset: start,
                    len: end - start,
                });
                start = end;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rails(rates: &[u64]) -> Vec<RailRate> {
        rates
            .iter()
            .enumerate()
            .map(|(rail, &rate_mbps)| RailRate { rail, rate_mbps })
            .collect()
    }

    #[test]
    fn splits_by_rate() {
        let mut out = Vec::new();
        StripePlanner::new(0).plan(1 << 20, &rails(&[100_000, 300_000]), 0, &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].len, 256 << 10);
        assert_eq!(out[1].len, 768 << 10);
    }

    #[test]
    fn small_transfers_rotate_over_one_rail() {
        let mut out = Vec::new();
        let r = rails(&[1, 1, 1]);
        StripePlanner::default().plan(4096, &r, 4, &mut out);
        assert_eq!(
            out,
            [Stripe {
                rail: 1,
                offset: 0,
                len: 4096
            }]
        );
    }

    #[test]
    fn common_rails_take_the_slower_side() {
        let mut out = Vec::new();
        let local = rails(&[100, 200, 300]);
        let remote = [
            RailRate {
                rail: 2,
                rate_mbps: 100,
            },
            RailRate {
                rail: 0,
                rate_mbps: 400,
            },
        ];
        common_rails(&local, &remote, &mut out);
        assert_eq!(
            out,
            [
                RailRate {
                    rail: 0,
                    rate_mbps: 100
                },
                RailRate {
                    rail: 2,
                    rate_mbps: 100
                }
            ]
        );
    }
}
