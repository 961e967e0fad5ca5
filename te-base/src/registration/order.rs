//! The order in which a batch's items are handed to the registration workers.

use std::fmt;
use std::str::FromStr;

/// Dispatch order of a registration batch (`TE_REG_ORDER`).
///
/// The order only matters once items queue behind a cap: unbounded, every item starts at once and
/// the dispatch order never reaches the provider. Capped, it matters as much as the cap does, because
/// registering device memory costs in proportion to the bytes already registered on the domain, so
/// small buffers should go first. Results are always returned in the caller's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegOrder {
    /// As the caller passed them.
    Given,
    /// Smallest buffer first (stable for equal sizes). The default whenever a cap is in force.
    Ascending,
    /// Largest buffer first (stable for equal sizes).
    Descending,
}

impl RegOrder {
    /// Every order, for sweeps.
    pub const ALL: [RegOrder; 3] = [RegOrder::Given, RegOrder::Ascending, RegOrder::Descending];

    /// Lower-case name, as `TE_REG_ORDER` spells it.
    pub fn name(self) -> &'static str {
        match self {
            RegOrder::Given => "given",
            RegOrder::Ascending => "ascending",
            RegOrder::Descending => "descending",
        }
    }

    /// The positions of `sizes` in dispatch order.
    pub fn dispatch(self, sizes: &[u64]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        match self {
            RegOrder::Given => {}
            RegOrder::Ascending => order.sort_by_key(|&i| sizes[i]),
            RegOrder::Descending => order.sort_by_key(|&i| std::cmp::Reverse(sizes[i])),
        }
        order
    }
}

impl fmt::Display for RegOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RegOrder {
    type Err = String;

    /// Parses `given`, `ascending` or `descending` (also `asc`, `desc`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "given" => Ok(RegOrder::Given),
            "ascending" | "asc" => Ok(RegOrder::Ascending),
            "descending" | "desc" => Ok(RegOrder::Descending),
            _ => Err(format!("unknown order {s:?} (expected given, ascending or descending)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatch_orders_are_stable_permutations() {
        let sizes = [30, 10, 20, 10];
        assert_eq!(RegOrder::Given.dispatch(&sizes), vec![0, 1, 2, 3]);
        assert_eq!(RegOrder::Ascending.dispatch(&sizes), vec![1, 3, 2, 0]);
        assert_eq!(RegOrder::Descending.dispatch(&sizes), vec![0, 2, 1, 3]);
        assert!(RegOrder::Given.dispatch(&[]).is_empty());
    }

    #[test]
    fn names_round_trip() {
        for o in RegOrder::ALL {
            assert_eq!(o.name().parse::<RegOrder>().unwrap(), o);
        }
        assert!("random".parse::<RegOrder>().is_err());
        assert!("".parse::<RegOrder>().is_err());
    }
}
