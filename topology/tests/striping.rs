//! Property tests of the striping planner: slices tile the transfer exactly, none is empty, the
//! split follows link rates, and the plan depends only on its inputs.

use proptest::prelude::*;
use te_topology::{common_rails, RailRate, Stripe, StripePlanner};

fn rails_strategy() -> impl Strategy<Value = Vec<RailRate>> {
    prop::collection::vec(prop_oneof![Just(0u64), 1u64..400_000], 1..33).prop_map(|rates| {
        rates
            .into_iter()
            .enumerate()
            .map(|(i, rate_mbps)| RailRate {
                rail: i * 2 + 1,
                rate_mbps,
            })
            .collect()
    })
}

fn check_tiling(len: u64, plan: &[Stripe], rails: &[RailRate]) -> Result<(), TestCaseError> {
    let mut next = 0u64;
    for s in plan {
        prop_assert!(s.len > 0, "empty slice {s:?}");
        prop_assert_eq!(s.offset, next);
        prop_assert!(
            rails.iter().any(|r| r.rail == s.rail),
            "slice on unknown rail {}",
            s.rail
        );
        next = s.offset + s.len;
    }
    prop_assert_eq!(next, len);
    Ok(())
}

proptest! {
    #[test]
    fn slices_tile_the_transfer(
        len in prop_oneof![1u64..1 << 20, 1u64..u64::MAX / 2, Just(u64::MAX)],
        rails in rails_strategy(),
        min in prop_oneof![Just(0u64), Just(128u64 << 10), 0u64..1 << 24],
        granule in prop_oneof![Just(1u64), Just(4096u64), 1u64..1 << 16],
        rotation in 0usize..100,
    ) {
        let planner = StripePlanner::new(min).with_granule(granule);
        let mut plan = Vec::new();
        planner.plan(len, &rails, rotation, &mut plan);
        check_tiling(len, &plan, &rails)?;
        if len <= min || rails.len() == 1 {
            prop_assert_eq!(plan.len(), 1);
            prop_assert_eq!(plan[0].rail, rails[rotation % rails.len()].rail);
        }
        // Every slice boundary but the end sits on the granule.
        for s in plan.iter().skip(1) {
            prop_assert_eq!(s.offset % granule, 0);
        }
        // Rails appear in input order, each at most once.
        let order: Vec<usize> = plan.iter().map(|s| s.rail).collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(order, sorted);
        // Deterministic.
        let mut again = Vec::new();
        planner.plan(len, &rails, rotation, &mut again);
        prop_assert_eq!(plan, again);
    }

    #[test]
    fn slices_follow_link_rates(
        len in (1u64 << 20)..(1u64 << 34),
        rates in prop::collection::vec(1u64..400_000, 2..33),
    ) {
        let rails: Vec<RailRate> = rates.iter().enumerate().map(|(rail, &rate_mbps)| RailRate { rail, rate_mbps }).collect();
        let granule = 4096u64;
        let mut plan = Vec::new();
        StripePlanner::new(0).with_granule(granule).plan(len, &rails, 0, &mut plan);
        check_tiling(len, &plan, &rails)?;
        let total: u64 = rates.iter().sum();
        for r in &rails {
            let got = plan.iter().find(|s| s.rail == r.rail).map_or(0, |s| s.len);
            let ideal = (len as u128 * r.rate_mbps as u128 / total as u128) as u64;
            // Boundaries move by less than one granule each; the last rail also takes the rounding.
            prop_assert!(got.abs_diff(ideal) <= granule * 2, "rail {} got {got}, ideal {ideal}", r.rail);
        }
    }

    #[test]
    fn common_rails_are_the_intersection(
        local in prop::collection::btree_map(0usize..64, 1u64..400_000, 0..32),
        remote in prop::collection::btree_map(0usize..64, 1u64..400_000, 0..32),
    ) {
        let to_rates = |m: &std::collections::BTreeMap<usize, u64>| -> Vec<RailRate> {
            m.iter().map(|(&rail, &rate_mbps)| RailRate { rail, rate_mbps }).collect()
        };
        let mut out = Vec::new();
        common_rails(&to_rates(&local), &to_rates(&remote), &mut out);
        let expected: Vec<RailRate> = local
            .iter()
            .filter_map(|(rail, l)| remote.get(rail).map(|r| RailRate { rail: *rail, rate_mbps: (*l).min(*r) }))
            .collect();
        prop_assert_eq!(out, expected);
    }
}

#[test]
fn p5_gpu_transfer_stripes_over_its_four_rails() {
    let rails: Vec<RailRate> = (0..4)
        .map(|rail| RailRate {
            rail,
            rate_mbps: 100_000,
        })
        .collect();
    let mut plan = Vec::new();
    StripePlanner::default().plan(64 << 20, &rails, 0, &mut plan);
    assert_eq!(plan.iter().map(|s| s.len).collect::<Vec<_>>(), [16 << 20; 4]);
    StripePlanner::default().plan(128 << 10, &rails, 3, &mut plan);
    assert_eq!(
        plan,
        [Stripe {
            rail: 3,
            offset: 0,
            len: 128 << 10
        }]
    );
    StripePlanner::default().plan(0, &rails, 0, &mut plan);
    assert!(plan.is_empty());
    StripePlanner::default().plan(1 << 30, &[], 0, &mut plan);
    assert!(plan.is_empty());
}
