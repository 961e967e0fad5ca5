//! Device memory on the local copy: which plugin serves a request, and one batched device copy per
//! (plugin, direction, device) group of a batch.
//!
//! The memory kind of each side comes from its registration (`RegionInfo::location`, classified
//! once by the engine); nothing here asks a driver what a pointer is. A request with a device side
//! resolves to a [`DeviceFragment`] carrying its group key. Per batch the device fragments are
//! sorted by (group, destination), exactly adjacent ones are coalesced, and each group becomes one
//! contiguous run of [`CopyFragment`]s handed to [`DevicePlugin::copy_async`] in a single call.

use std::ops::Range;
use std::sync::Arc;

use te_base::device::{CopyDirection, CopyFragment, DevicePlugin, PendingCopy};
use te_base::{Error, MemoryKind, MemoryKinds, MemoryLocation, Result};

use crate::plan::Fragment;
use crate::NAME;

/// Plugin slots: one per device memory kind.
const SLOTS: usize = 2;

/// The device plugins a transport copies with: at most one per memory kind (the first given).
#[derive(Clone, Default)]
pub(crate) struct DeviceRoutes {
    plugins: [Option<Arc<dyn DevicePlugin>>; SLOTS],
}

impl std::fmt::Debug for DeviceRoutes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.plugins.iter().flatten().map(|p| p.name()))
            .finish()
    }
}

fn slot(kind: MemoryKind) -> Option<usize> {
    match kind {
        MemoryKind::Host => None,
        MemoryKind::Cuda => Some(0),
        MemoryKind::Rocm => Some(1),
    }
}

fn ordinal(location: MemoryLocation) -> u32 {
    match location {
        MemoryLocation::Cuda { device } | MemoryLocation::Rocm { device } => device,
        MemoryLocation::Host { .. } => 0,
    }
}

fn direction_code(direction: CopyDirection) -> u64 {
    match direction {
        CopyDirection::HostToDevice => 0,
        CopyDirection::DeviceToHost => 1,
        CopyDirection::DeviceToDevice => 2,
    }
}

fn direction_of(code: u64) -> CopyDirection {
    match code {
        0 => CopyDirection::HostToDevice,
        1 => CopyDirection::DeviceToHost,
        _ => CopyDirection::DeviceToDevice,
    }
}

/// Which side of a request a location belongs to, for error messages.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Side {
    Local,
    Remote,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Local => "local",
            Side::Remote => "remote",
        }
    }
}

impl DeviceRoutes {
    /// Routes through `devices`; a second plugin of a kind already served is ignored.
    pub fn new(devices: &[Arc<dyn DevicePlugin>]) -> Self {
        let mut routes = DeviceRoutes::default();
        for plugin in devices {
            if let Some(s) = slot(plugin.memory_kind()) {
                if routes.plugins[s].is_none() {
                    routes.plugins[s] = Some(Arc::clone(plugin));
                }
            }
        }
        routes
    }

    /// Host memory plus every device kind a plugin serves.
    pub fn kinds(&self) -> MemoryKinds {
        let mut kinds = MemoryKinds::HOST;
        for p in self.plugins.iter().flatten() {
            kinds = kinds.with(p.memory_kind());
        }
        kinds
    }

    /// The plugin of a group key made by [`DeviceRoutes::route`].
    fn plugin(&self, key: u64) -> Option<&Arc<dyn DevicePlugin>> {
        self.plugins.get((key >> 40) as usize).and_then(Option::as_ref)
    }

    /// The group key of a copy from `src` to `dst`, at least one of them device memory; `src_side`
    /// and `dst_side` name the request's sides in errors. The key orders by plugin, then direction,
    /// then the device whose stream runs the copy (the device side; the source for device->device).
    pub fn route(&self, src: MemoryLocation, src_side: Side, dst: MemoryLocation, dst_side: Side) -> Result<u64> {
        let direction = CopyDirection::between(src, dst).unwrap_or(CopyDirection::DeviceToDevice);
        let (device, side) = match direction {
            CopyDirection::HostToDevice => (dst, dst_side),
            CopyDirection::DeviceToHost | CopyDirection::DeviceToDevice => (src, src_side),
        };
        if direction == CopyDirection::DeviceToDevice && src.kind() != dst.kind() {
            return Err(Error::WrongMemoryKind {
                transport: NAME.to_owned(),
                what: format!("{src} to {dst} (device->device between two runtimes)"),
            });
        }
        let kind = device.kind();
        let s = slot(kind)
            .filter(|&s| self.plugins[s].is_some())
            .ok_or_else(|| Error::WrongMemoryKind {
                transport: NAME.to_owned(),
                what: format!("{} {device} (no {kind} device plugin is loaded)", side.name()),
            })?;
        Ok(((s as u64) << 40) | (direction_code(direction) << 32) | u64::from(ordinal(device)))
    }
}

/// One request with a device side, resolved to addresses, before planning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceFragment {
    /// Group key from [`DeviceRoutes::route`].
    pub group: u64,
    /// First destination byte.
    pub dst: u64,
    /// First source byte.
    pub src: u64,
    /// Bytes (never zero).
    pub len: u64,
    /// The request's index in its batch.
    pub index: u32,
}

impl DeviceFragment {
    /// The addresses alone, for the batch-wide overlap check.
    pub fn as_fragment(&self) -> Fragment {
        Fragment {
            dst: self.dst,
            src: self.src,
            len: self.len,
            index: self.index,
        }
    }

    /// As one fragment for the plugin.
    pub fn copy(&self) -> CopyFragment {
        CopyFragment {
            dst: self.dst,
            src: self.src,
            len: self.len,
        }
    }
}

/// One (plugin, direction, device) group of a planned batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Group {
    /// Group key.
    pub key: u64,
    /// Its coalesced copies, in the batch's copy list.
    pub copies: Range<usize>,
    /// Its requests, in the (sorted) device fragments.
    pub requests: Range<usize>,
}

impl Group {
    /// The direction of every copy of the group.
    pub fn direction(&self) -> CopyDirection {
        direction_of((self.key >> 32) & 0xff)
    }

    /// The device whose stream runs the group's copies.
    pub fn device(&self) -> u32 {
        self.key as u32
    }
}

/// Sorts `frags` by (group, destination) and writes one [`Group`] per key to `groups` and its
/// coalesced copies to `copies` (both cleared first). Two fragments merge only when their sources
/// and destinations both continue each other. The caller has ruled out overlapping destinations.
pub(crate) fn plan_groups(frags: &mut [DeviceFragment], copies: &mut Vec<CopyFragment>, groups: &mut Vec<Group>) {
    copies.clear();
    groups.clear();
    frags.sort_unstable_by_key(|f| (f.group, f.dst));
    let mut start = 0;
    while start < frags.len() {
        let key = frags[start].group;
        let end = start + frags[start..].iter().take_while(|f| f.group == key).count();
        let first = copies.len();
        let mut cur = frags[start].copy();
        for f in &frags[start + 1..end] {
            if f.dst == cur.dst + cur.len && f.src == cur.src + cur.len {
                cur.len += f.len;
            } else {
                copies.push(cur);
                cur = f.copy();
            }
        }
        copies.push(cur);
        groups.push(Group {
            key,
            copies: first..copies.len(),
            requests: start..end,
        });
        start = end;
    }
}

/// Starts every group's copies with one [`DevicePlugin::copy_async`] call each, in group order.
/// A group whose call fails gets its error and starts nothing.
///
/// # Safety
/// Every copy must be between live memory of the kinds its group names, stay valid until the
/// returned handles complete or are dropped, and no destination may overlap another copy's
/// source or destination.
pub(crate) unsafe fn start_groups(
    routes: &DeviceRoutes,
    groups: &[Group],
    copies: &[CopyFragment],
) -> Vec<Result<Box<dyn PendingCopy>>> {
    groups
        .iter()
        .map(|g| {
            let plugin = routes.plugin(g.key).ok_or_else(|| missing(g.key))?;
            // SAFETY: forwarded from the caller: the group's copies are between live memory of the
            // kinds the group names and do not overlap.
            unsafe { plugin.copy_async(g.device(), g.direction(), &copies[g.copies.clone()]) }
        })
        .collect()
}

/// Copies one request with the plugin's synchronous copy (batches whose requests overlap run one
/// request at a time). A request whose own source and destination overlap is refused: device
/// copies do not promise `memmove` semantics.
///
/// # Safety
/// As for [`DevicePlugin::copy`].
pub(crate) unsafe fn copy_one(routes: &DeviceRoutes, f: &DeviceFragment) -> Result<()> {
    if f.src < f.dst + f.len && f.dst < f.src + f.len {
        return Err(Error::transport(
            NAME,
            format!(
                "request {} copies device memory onto an overlapping range of itself ([{:#x}, +{}) to {:#x})",
                f.index, f.src, f.len, f.dst
            ),
        ));
    }
    let plugin = routes.plugin(f.group).ok_or_else(|| missing(f.group))?;
    let group = Group {
        key: f.group,
        copies: 0..0,
        requests: 0..0,
    };
    // SAFETY: forwarded from the caller.
    unsafe { plugin.copy(group.device(), group.direction(), f.copy()) }
}

fn missing(key: u64) -> Error {
    Error::not_available(
        format!("{NAME} device plugin slot {}", key >> 40),
        "no plugin in that slot",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frag(group: u64, dst: u64, src: u64, len: u64, index: u32) -> DeviceFragment {
        DeviceFragment {
            group,
            dst,
            src,
            len,
            index,
        }
    }

    #[test]
    fn groups_are_sorted_and_coalesced_within_a_group_only() {
        let mut frags = vec![
            frag(2, 1100, 5100, 100, 0),
            frag(1, 1000, 5000, 100, 1),
            frag(2, 1000, 5000, 100, 2),
            frag(1, 1100, 5100, 100, 3),
            frag(1, 1200, 9000, 100, 4), // destination continues, source does not
        ];
        let (mut copies, mut groups) = (Vec::new(), Vec::new());
        plan_groups(&mut frags, &mut copies, &mut groups);
        let c = |dst, src, len| CopyFragment { dst, src, len };
        assert_eq!(copies, vec![c(1000, 5000, 200), c(1200, 9000, 100), c(1000, 5000, 200)]);
        assert_eq!(
            groups,
            vec![
                Group {
                    key: 1,
                    copies: 0..2,
                    requests: 0..3
                },
                Group {
                    key: 2,
                    copies: 2..3,
                    requests: 3..5
                },
            ]
        );
        let mut indices: Vec<u32> = frags[0..3].iter().map(|f| f.index).collect();
        indices.sort_unstable();
        assert_eq!(indices, vec![1, 3, 4]);
    }

    #[test]
    fn routes_name_the_missing_plugin() {
        let routes = DeviceRoutes::default();
        assert_eq!(routes.kinds(), MemoryKinds::HOST);
        let err = routes
            .route(
                MemoryLocation::HOST,
                Side::Local,
                MemoryLocation::Cuda { device: 1 },
                Side::Remote,
            )
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "transport 'local' cannot serve remote cuda:1 (no cuda device plugin is loaded) memory"
        );
    }

    #[test]
    fn group_keys_carry_direction_and_device() {
        for (direction, device) in [
            (CopyDirection::HostToDevice, 0),
            (CopyDirection::DeviceToHost, 7),
            (CopyDirection::DeviceToDevice, u32::MAX),
        ] {
            let g = Group {
                key: (1 << 40) | (direction_code(direction) << 32) | u64::from(device),
                copies: 0..0,
                requests: 0..0,
            };
            assert_eq!((g.direction(), g.device()), (direction, device));
        }
    }
}
