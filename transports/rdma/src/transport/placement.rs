//! Rail-local placement: which of this transport's rails a region is registered on, from
//! te-base's [`NicPlacement`] (NUMA-local NICs for host memory, switch-local NICs for GPU memory),
//! with topology NICs matched to our rails by device name.

use te_base::topology::NicPlacement;
use te_base::RegionInfo;

/// The topology's placement joined to our rails.
#[derive(Debug)]
pub struct RailPlacement {
    placement: NicPlacement,
    /// `rail_of_nic[i]`: our rail on topology NIC `i`, when we opened one on it.
    rail_of_nic: Vec<Option<usize>>,
}

impl RailPlacement {
    /// Joins `placement` to our rails (device names in rail order). `None` when no topology NIC is
    /// one of our rails: placement could only ever say "every rail".
    pub fn new(placement: NicPlacement, rail_names: &[&str]) -> Option<RailPlacement> {
        let rail_of_nic: Vec<Option<usize>> = placement
            .topology()
            .nics
            .iter()
            .map(|nic| rail_names.iter().position(|name| *name == nic.name))
            .collect();
        rail_of_nic
            .iter()
            .any(Option::is_some)
            .then_some(RailPlacement { placement, rail_of_nic })
    }

    /// Our rails for `region`, ascending; every rail (of `rail_count`) when the placement cannot
    /// say (lookup failure, or none of the chosen NICs is one of our rails), with a warning.
    pub fn rails_for(&self, region: &RegionInfo, rail_count: usize) -> Vec<usize> {
        let all = || (0..rail_count).collect();
        match self.placement.rails_for(region.location, Some(region.base)) {
            Ok(selection) => {
                let mut ours: Vec<usize> = selection
                    .rails
                    .iter()
                    .filter_map(|&nic| self.rail_of_nic.get(nic).copied().flatten())
                    .collect();
                ours.sort_unstable();
                ours.dedup();
                if ours.is_empty() {
                    tracing::warn!(
                        location = %region.location,
                        "rdma: none of the NICs placed for this region is an open rail; registering on every rail"
                    );
                    all()
                } else {
                    ours
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "rdma: rail placement failed; registering on every rail");
                all()
            }
        }
    }
}
