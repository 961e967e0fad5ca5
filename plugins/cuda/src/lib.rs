//! CUDA device-memory plugin, loaded at run time.
//!
//! Opens the CUDA driver (`libcuda.so.1`) with dlopen through `cudarc`, so nothing links against
//! it and a host without a GPU runs the same binary: [`load`] then returns
//! [`te_base::Error::NotAvailable`] with the reason instead of panicking.
//!
//! ```no_run
//! use te_base::device::DevicePlugin;
//!
//! match te_plugin_cuda::load() {
//!     Ok(cuda) => println!("{} (gpu 0 at {})", cuda.info(), cuda.pci_bus_id(0).unwrap()),
//!     Err(e) => println!("{e}"), // "cuda: not available: ..."
//! }
//! ```
//!
//! Device ordinals are the driver's, i.e. after `CUDA_VISIBLE_DEVICES`; PCI bus ids come from the
//! driver for those ordinals, so the topology code maps the right GPU to its NICs.
//!
//! Configuration: `TE_CUDA_BATCH_MEMCPY=0` makes multi-fragment batches use one driver call per
//! fragment even where `cuMemcpyBatchAsync` exists (default: use it when the driver has it).

mod batch;
mod context;
mod driver;
mod pending;
mod plugin;

use std::sync::{Arc, OnceLock};

use te_base::config::{parse_bool, Env, ProcessEnv};
use te_base::device::{DevicePlugin, PointerKind};
use te_base::Result;

pub use plugin::CudaPlugin;

/// The plugin's name, as in `cuda: not available: ...`.
pub const NAME: &str = driver::NAME;

/// Opens the CUDA driver once per process and returns the shared plugin.
///
/// [`te_base::Error::NotAvailable`] when libcuda is missing or too old, `cuInit` fails, or no device
/// is visible; the error is remembered, so later calls answer the same without retrying.
pub fn load() -> Result<Arc<dyn DevicePlugin>> {
    load_cuda().map(|p| p as Arc<dyn DevicePlugin>)
}

/// Every variable this plugin reads.
pub const ENV_VARS: &[&str] = &["TE_CUDA_BATCH_MEMCPY"];

/// Like [`load`], with the concrete type (for [`CudaPlugin::set_batch_memcpy`]).
pub fn load_cuda() -> Result<Arc<CudaPlugin>> {
    static LOADED: OnceLock<Result<Arc<CudaPlugin>>> = OnceLock::new();
    LOADED.get_or_init(|| open_with(&ProcessEnv)).clone()
}

fn open_with(env: &dyn Env) -> Result<Arc<CudaPlugin>> {
    let batch_memcpy = parse_bool(env, "TE_CUDA_BATCH_MEMCPY")?;
    CudaPlugin::open(batch_memcpy).map(Arc::new)
}

/// Classifies `addr` with the shared plugin: an error (not a panic) where there is no CUDA runtime.
pub fn classify(addr: u64) -> Result<PointerKind> {
    load()?.classify(addr)
}

#[cfg(test)]
mod tests {
    use te_base::config::MapEnv;
    use te_base::Error;

    use super::*;

    #[test]
    fn malformed_batch_memcpy_setting_is_named() {
        let env = MapEnv::new([("TE_CUDA_BATCH_MEMCPY", "sometimes")]);
        let err = open_with(&env).unwrap_err();
        assert!(
            matches!(&err, Error::Config { var, .. } if var == "TE_CUDA_BATCH_MEMCPY"),
            "{err:?}"
        );
    }
}
