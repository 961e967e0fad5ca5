//! PCI addresses and the chain of bridges above a device, read from the resolved sysfs path.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A PCI function address, `domain:bus:device.function` (`0000:4f:00.0`). Orders by bus id, which
/// is the order the CUDA runtime uses with `CUDA_DEVICE_ORDER=PCI_BUS_ID`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    /// PCI segment (domain).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device (slot) number, 0..32.
    pub device: u8,
    /// Function number, 0..8.
    pub function: u8,
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl FromStr for PciAddress {
    type Err = String;

    /// Parses `0000:4f:00.0`, and the short form `4f:00.0` (domain 0). Case-insensitive; CUDA's
    /// `00000000:4F:00.0` (eight-digit domain) is accepted too.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("malformed PCI address {s:?} (expected dddd:bb:dd.f)");
        let (head, function) = s.rsplit_once('.').ok_or_else(bad)?;
        let mut parts = head.rsplitn(3, ':');
        let device = parts.next().ok_or_else(bad)?;
        let bus = parts.next().ok_or_else(bad)?;
        let domain = parts.next().unwrap_or("0");
        let hex = |t: &str, max_len: usize| -> Result<u32, String> {
            if t.is_empty() || t.len() > max_len || !t.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            u32::from_str_radix(t, 16).map_err(|_| bad())
        };
        let domain = hex(domain, 8)?;
        let bus = hex(bus, 2)?;
        let device = hex(device, 2)?;
        let function = hex(function, 1)?;
        if device >= 32 || function >= 8 {
            return Err(bad());
        }
        Ok(PciAddress {
            domain,
            bus: bus as u8,
            device: device as u8,
            function: function as u8,
        })
    }
}

impl Serialize for PciAddress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Where a device sits in the PCI hierarchy: its root bus (`pci0000:4c`, one host bridge) and the
/// bridges and switch ports between that root and the device, nearest the root first.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PciPath {
    /// The host bridge directory name under `/sys/devices`, e.g. `pci0000:4c`.
    pub root: String,
    /// Bridges, root ports and switch ports above the device, root first; the device excluded.
    pub bridges: Vec<PciAddress>,
    /// The device itself.
    pub device: PciAddress,
}

impl PciPath {
    /// Reads a path from the components after `devices/` of a resolved sysfs path, e.g.
    /// `["pci0000:4c", "0000:4c:01.0", "0000:4d:00.0", "virtio2", "net", "eth0"]`. The device is
    /// the last component that parses as a PCI address (a virtio or netdev child is ignored).
    /// `None` for virtual devices (`devices/virtual/...`) and platform devices.
    pub fn from_components<'a>(components: impl IntoIterator<Item = &'a str>) -> Option<PciPath> {
        let mut iter = components.into_iter();
        let root = iter.next()?;
        if !root.starts_with("pci") {
            return None;
        }
        let mut chain: Vec<PciAddress> = iter.map_while(|c| c.parse::<PciAddress>().ok()).collect();
        let device = chain.pop()?;
        Some(PciPath {
            root: root.to_string(),
            bridges: chain,
            device,
        })
    }

    /// Every ancestor of the device, nearest first: the bridges bottom-up, then the root bus.
    pub fn ancestors(&self) -> impl Iterator<Item = PciAncestor> + '_ {
        self.bridges
            .iter()
            .rev()
            .map(|b| PciAncestor::Bridge(*b))
            .chain(std::iter::once(PciAncestor::Root(self.root.clone())))
    }

    /// True if `ancestor` lies above this device.
    pub fn is_below(&self, ancestor: &PciAncestor) -> bool {
        match ancestor {
            PciAncestor::Bridge(b) => self.bridges.contains(b),
            PciAncestor::Root(r) => &self.root == r,
        }
    }
}

impl fmt::Display for PciPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.root)?;
        for b in &self.bridges {
            write!(f, "/{b}")?;
        }
        write!(f, "/{}", self.device)
    }
}

/// A node above a device in the PCI tree: a bridge (root port, switch port) or a root bus.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PciAncestor {
    /// A bridge or switch port.
    Bridge(PciAddress),
    /// A host bridge's root bus (`pci0000:4c`).
    Root(String),
}

impl fmt::Display for PciAncestor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PciAncestor::Bridge(b) => write!(f, "{b}"),
            PciAncestor::Root(r) => f.write_str(r),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_and_print() {
        let a: PciAddress = "0000:4f:00.0".parse().unwrap();
        assert_eq!(a.to_string(), "0000:4f:00.0");
        assert_eq!("00000000:4F:00.0".parse::<PciAddress>().unwrap(), a);
        assert_eq!("4f:00.0".parse::<PciAddress>().unwrap(), a);
        for bad in [
            "",
            "4f",
            "0000:4f:00",
            "0000:4f:20.0",
            "0000:4f:00.8",
            "0000:1ff:00.0",
            "x:4f:00.0",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad}");
        }
        assert!("0000:10:1c.0".parse::<PciAddress>().unwrap() < "0000:10:1d.0".parse().unwrap());
    }

    #[test]
    fn paths_skip_non_pci_children() {
        let p = PciPath::from_components(["pci0000:00", "0000:00:03.0", "virtio2", "net", "eth0"]).unwrap();
        assert_eq!(p.device.to_string(), "0000:00:03.0");
        assert!(p.bridges.is_empty());
        assert!(PciPath::from_components(["virtual", "net", "lo"]).is_none());
        let p = PciPath::from_components(["pci0000:4c", "0000:4c:01.0", "0000:4d:00.0", "0000:4f:00.0"]).unwrap();
        let up: Vec<String> = p.ancestors().map(|a| a.to_string()).collect();
        assert_eq!(up, ["0000:4d:00.0", "0000:4c:01.0", "pci0000:4c"]);
    }
}
