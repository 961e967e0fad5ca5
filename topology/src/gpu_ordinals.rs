//! Device ordinal -> PCI bus id, the link between a `cuda:N` buffer and a GPU in the rail map.
//!
//! Without a device plugin, ordinals follow bus-id order filtered by `CUDA_VISIBLE_DEVICES` /
//! `HIP_VISIBLE_DEVICES` (integer lists only). That matches the runtime with
//! `CUDA_DEVICE_ORDER=PCI_BUS_ID` and, for identical GPUs, with CUDA's default fastest-first order.
//! A device plugin that can ask the runtime supplies the real mapping with
//! [`GpuOrdinals::from_runtime`], which always wins.

use serde::Serialize;

use super::pci::PciAddress;
use te_base::config::Env;
use te_base::error::{Error, Result};

/// Where a mapping came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "origin", rename_all = "snake_case")]
pub enum OrdinalOrigin {
    /// All GPUs of the vendor in bus-id order.
    BusOrder,
    /// Bus-id order filtered by a visible-devices variable.
    VisibleDevices {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
    },
    /// Supplied by the device runtime (the CUDA or HIP plugin).
    Runtime,
    /// Cannot be worked out from sysfs (UUIDs, MIG instances, indices past the GPU count); every
    /// ordinal is unknown until a plugin supplies the mapping.
    Unresolved {
        /// Why.
        reason: String,
    },
}

/// Maps device ordinals of one runtime to PCI bus ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuOrdinals {
    bus_ids: Vec<PciAddress>,
    origin: OrdinalOrigin,
}

impl GpuOrdinals {
    /// Ordinal `i` is the `i`-th GPU in bus-id order.
    pub fn bus_order(gpus: &[PciAddress]) -> GpuOrdinals {
        let mut bus_ids = gpus.to_vec();
        bus_ids.sort();
        GpuOrdinals {
            bus_ids,
            origin: OrdinalOrigin::BusOrder,
        }
    }

    /// The mapping reported by the runtime: `bus_ids[i]` is the bus id of ordinal `i`.
    pub fn from_runtime(bus_ids: Vec<PciAddress>) -> GpuOrdinals {
        GpuOrdinals {
            bus_ids,
            origin: OrdinalOrigin::Runtime,
        }
    }

    /// Bus-id order filtered and reordered by `var` (`CUDA_VISIBLE_DEVICES`, `HIP_VISIBLE_DEVICES`)
    /// when it is set. As in CUDA, the list ends at the first entry that is not a valid index. A
    /// value that is neither indices nor device UUIDs is an [`Error::Config`].
    pub fn from_visible_devices(gpus: &[PciAddress], env: &dyn Env, var: &str) -> Result<GpuOrdinals> {
        let all = GpuOrdinals::bus_order(gpus);
        let Some(value) = env.get(var) else { return Ok(all) };
        let unresolved = |reason: String| GpuOrdinals {
            bus_ids: Vec::new(),
            origin: OrdinalOrigin::Unresolved { reason },
        };
        let mut bus_ids = Vec::new();
        for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if item.starts_with("GPU-") || item.starts_with("MIG-") {
                return Ok(unresolved(format!(
                    "{var}={value} names devices by UUID; the device plugin must supply the ordinal map"
                )));
            }
            let index: i64 = item.parse().map_err(|_| {
                Error::config(
                    var,
                    &value,
                    format!("{item:?} is neither a device index nor a GPU-/MIG- UUID"),
                )
            })?;
            let Some(bus) = usize::try_from(index).ok().and_then(|i| all.bus_ids.get(i)) else {
                break;
            };
            if bus_ids.contains(bus) {
                return Err(Error::config(var, &value, format!("device {index} is listed twice")));
            }
            bus_ids.push(*bus);
        }
        Ok(GpuOrdinals {
            bus_ids,
            origin: OrdinalOrigin::VisibleDevices {
                var: var.to_string(),
                value,
            },
        })
    }

    /// The bus id of `ordinal`, if known.
    pub fn bus_id(&self, ordinal: u32) -> Option<PciAddress> {
        self.bus_ids.get(ordinal as usize).copied()
    }

    /// Number of ordinals known.
    pub fn len(&self) -> usize {
        self.bus_ids.len()
    }

    /// True when no ordinal is known.
    pub fn is_empty(&self) -> bool {
        self.bus_ids.is_empty()
    }

    /// Where the mapping came from.
    pub fn origin(&self) -> &OrdinalOrigin {
        &self.origin
    }

    /// The bus ids, by ordinal.
    pub fn bus_ids(&self) -> &[PciAddress] {
        &self.bus_ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::config::MapEnv;

    fn gpus() -> Vec<PciAddress> {
        ["0000:c0:00.0", "0000:4f:00.0", "0000:60:00.0"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect()
    }

    #[test]
    fn visible_devices_filter_bus_order() {
        let g = gpus();
        let none = MapEnv::default();
        let all = GpuOrdinals::from_visible_devices(&g, &none, "CUDA_VISIBLE_DEVICES").unwrap();
        assert_eq!(all.bus_id(0).unwrap().to_string(), "0000:4f:00.0");
        assert_eq!(all.bus_id(2).unwrap().to_string(), "0000:c0:00.0");
        let env = MapEnv::new([("CUDA_VISIBLE_DEVICES", "2,0")]);
        let vis = GpuOrdinals::from_visible_devices(&g, &env, "CUDA_VISIBLE_DEVICES").unwrap();
        assert_eq!(vis.bus_id(0).unwrap().to_string(), "0000:c0:00.0");
        assert_eq!(vis.bus_id(1).unwrap().to_string(), "0000:4f:00.0");
        assert_eq!(vis.bus_id(2), None);
        // CUDA stops at the first invalid index.
        let env = MapEnv::new([("CUDA_VISIBLE_DEVICES", "1,7,0")]);
        let vis = GpuOrdinals::from_visible_devices(&g, &env, "CUDA_VISIBLE_DEVICES").unwrap();
        assert_eq!(vis.len(), 1);
        let env = MapEnv::new([("CUDA_VISIBLE_DEVICES", "")]);
        assert!(GpuOrdinals::from_visible_devices(&g, &env, "CUDA_VISIBLE_DEVICES")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn uuids_are_unresolved_and_garbage_is_an_error() {
        let g = gpus();
        let env = MapEnv::new([("CUDA_VISIBLE_DEVICES", "GPU-8d2c")]);
        let vis = GpuOrdinals::from_visible_devices(&g, &env, "CUDA_VISIBLE_DEVICES").unwrap();
        assert!(matches!(vis.origin(), OrdinalOrigin::Unresolved { .. }));
        assert_eq!(vis.bus_id(0), None);
        for bad in ["x", "0,0"] {
            let env = MapEnv::new([("HIP_VISIBLE_DEVICES", bad)]);
            let err = GpuOrdinals::from_visible_devices(&g, &env, "HIP_VISIBLE_DEVICES").unwrap_err();
            assert!(err.to_string().contains("HIP_VISIBLE_DEVICES"), "{err}");
        }
    }
}
