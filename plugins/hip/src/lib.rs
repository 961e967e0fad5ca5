//! HIP (ROCm) device-memory plugin, loaded at run time.
//!
//! Opens `libamdhip64` with dlopen and binds the few functions it needs by hand, so nothing links
//! against ROCm and a host without AMD GPUs runs the same binary: [`load`] then returns
//! [`te_base::Error::NotAvailable`] with the reason.
//!
//! ```no_run
//! use te_base::device::DevicePlugin;
//!
//! match te_plugin_hip::load() {
//!     Ok(hip) => println!("{} (gpu 0 at {})", hip.info(), hip.pci_bus_id(0).unwrap()),
//!     Err(e) => println!("{e}"), // "hip: not available: ..."
//! }
//! ```
//!
//! Device ordinals are the runtime's, after `HIP_VISIBLE_DEVICES` (and `ROCR_VISIBLE_DEVICES`);
//! PCI bus ids come from the runtime for those ordinals. `hipMemoryType` is numbered differently
//! in ROCm 5 and 6; the runtime version read at load decides which numbering applies.

mod api;
mod memory_type;
mod pending;
mod plugin;

use std::sync::{Arc, OnceLock};

use te_base::device::{DevicePlugin, PointerKind};
use te_base::Result;

pub use plugin::HipPlugin;

/// The plugin's name, as in `hip: not available: ...`.
pub const NAME: &str = api::NAME;

/// Opens the HIP runtime once per process and returns the shared plugin.
///
/// [`te_base::Error::NotAvailable`] when libamdhip64 is missing or lacks a function, `hipInit`
/// fails, or no device is visible; the outcome is remembered.
pub fn load() -> Result<Arc<dyn DevicePlugin>> {
    load_hip().map(|p| p as Arc<dyn DevicePlugin>)
}

/// Like [`load`], with the concrete type.
pub fn load_hip() -> Result<Arc<HipPlugin>> {
    static LOADED: OnceLock<Result<Arc<HipPlugin>>> = OnceLock::new();
    LOADED.get_or_init(|| HipPlugin::open().map(Arc::new)).clone()
}

/// Classifies `addr` with the shared plugin: an error (not a panic) where there is no HIP runtime.
pub fn classify(addr: u64) -> Result<PointerKind> {
    load()?.classify(addr)
}

#[cfg(test)]
mod tests {
    use te_base::Error;

    use super::*;

    #[test]
    fn opening_from_missing_names_is_not_available() {
        let err = HipPlugin::open_from(&["libamdhip64-missing.so"]).err().unwrap();
        assert!(
            matches!(err, Error::NotAvailable { ref what, .. } if what == "hip"),
            "{err:?}"
        );
    }
}
