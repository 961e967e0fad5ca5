//! Behaviour on hosts without the CUDA driver (this machine and CI): `load` reports why, nothing
//! panics. On a GPU host these tests say so and do nothing; `tests/gpu.rs` covers that case.

use std::sync::Arc;

use te_base::device::{DevicePlugin, PluginAvailability};
use te_base::Error;

/// True if the CUDA driver library can be opened here, checked independently of the plugin.
fn driver_installed() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        // SAFETY: opening the vendor driver library only runs its initialisers; dropped at once.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

#[test]
fn load_reports_not_available_with_the_missing_library() {
    if driver_installed() {
        println!("skipping: the CUDA driver is installed here (see tests/gpu.rs)");
        return;
    }
    let load: fn() -> te_base::Result<Arc<dyn DevicePlugin>> = te_plugin_cuda::load;
    let err = load().unwrap_err();
    let Error::NotAvailable { what, reason } = &err else {
        panic!("expected NotAvailable, got {err:?}");
    };
    println!("{err}");
    assert_eq!(what, "cuda");
    assert!(reason.contains("libcuda"), "reason does not name the library: {reason}");
    assert!(err.to_string().starts_with("cuda: not available: "), "{err}");
    // The outcome is remembered: a second call answers the same without panicking.
    assert_eq!(load().unwrap_err().to_string(), err.to_string());
}

#[test]
fn classifying_a_host_pointer_without_a_runtime_is_an_error() {
    if driver_installed() {
        println!("skipping: the CUDA driver is installed here (see tests/gpu.rs)");
        return;
    }
    let value = 42u64;
    let err = te_plugin_cuda::classify(&value as *const u64 as u64).unwrap_err();
    assert!(matches!(err, Error::NotAvailable { .. }), "{err:?}");
}

#[test]
fn availability_report_reads_not_available() {
    if driver_installed() {
        println!("skipping: the CUDA driver is installed here (see tests/gpu.rs)");
        return;
    }
    let report = PluginAvailability::from_load(te_plugin_cuda::NAME, te_plugin_cuda::load());
    assert!(report.plugin().is_none());
    assert!(report.to_string().starts_with("cuda: not available: "), "{report}");
}
