//! Rail-local placement for a transport: which of *its* rails a region is registered on, from
//! [`NicPlacement`] (NUMA-local NICs for host memory, switch-local NICs for GPU memory), with the
//! topology's NICs matched to the transport's rails by device name. Every transport with rails
//! (efa, rdma) joins the placement to its rails the same way.

use te_base::memory::RegionInfo;

use super::placement::NicPlacement;

/// The topology's placement joined to one transport's rails.
#[derive(Debug)]
pub struct RailPlacement {
    placement: NicPlacement,
    /// `rail_of_nic[i]`: the transport's rail on topology NIC `i`, when it opened one there.
    rail_of_nic: Vec<Option<usize>>,
}

/// True when a rail called `rail` runs on the NIC called `nic`: the same name, or the NIC's name
/// followed by `-` and a suffix (an EFA domain is named `rdmap79s0-rdm` for NIC `rdmap79s0`).
fn runs_on(rail: &str, nic: &str) -> bool {
    rail == nic || rail.strip_prefix(nic).is_some_and(|rest| rest.starts_with('-'))
}

impl RailPlacement {
    /// Joins `placement` to the rails named `rail_names` (in rail order). `None` when no topology
    /// NIC carries any of them (software providers, loopback): placement could only ever say
    /// "every rail".
    pub fn new(placement: NicPlacement, rail_names: &[&str]) -> Option<RailPlacement> {
        let rail_of_nic: Vec<Option<usize>> = placement
            .topology()
            .nics
            .iter()
            .map(|nic| rail_names.iter().position(|rail| runs_on(rail, &nic.name)))
            .collect();
        rail_of_nic
            .iter()
            .any(Option::is_some)
            .then_some(RailPlacement { placement, rail_of_nic })
    }

    /// The transport's rails for `region`, ascending; every rail (of `rail_count`) when the
    /// placement cannot say (lookup failure, or none of the chosen NICs is one of the rails),
    /// with a warning naming `transport`.
    pub fn rails_for(&self, region: &RegionInfo, rail_count: usize, transport: &str) -> Vec<usize> {
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
                        "{transport}: none of the NICs placed for this region is an open rail; registering on every rail"
                    );
                    all()
                } else {
                    ours
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "{transport}: rail placement failed; registering on every rail");
                all()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::runs_on;

    #[test]
    fn rails_match_their_nic_by_name_or_suffixed_name() {
        assert!(runs_on("mlx5_0", "mlx5_0"));
        assert!(runs_on("rdmap79s0-rdm", "rdmap79s0"));
        assert!(runs_on("rdmap79s0-dgrm", "rdmap79s0"));
        assert!(!runs_on("mlx5_10", "mlx5_1"));
        assert!(!runs_on("rdmap79s0", "rdmap79s0-rdm"));
        assert!(!runs_on("rdmap79s01-rdm", "rdmap79s0"));
    }
}
