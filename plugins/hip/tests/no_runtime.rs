//! Behaviour on hosts without ROCm (this machine and CI): `load` reports why, nothing panics. On an
//! AMD GPU host these tests say so and do nothing; `tests/gpu.rs` covers that case.

use std::sync::Arc;

use te_base::device::{DevicePlugin, PluginAvailability};
use te_base::Error;

/// True if a HIP runtime library can be opened here, checked independently of the plugin.
fn runtime_installed() -> bool {
    [
        "libamdhip64.so",
        "libamdhip64.so.6",
        "libamdhip64.so.5",
        "/opt/rocm/lib/libamdhip64.so",
    ]
    .iter()
    .any(|name| {
        // SAFETY: opening the vendor runtime only runs its initialisers; dropped at once.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

#[test]
fn load_reports_not_available_with_the_missing_library() {
    if runtime_installed() {
        println!("skipping: a HIP runtime is installed here (see tests/gpu.rs)");
        return;
    }
    let load: fn() -> te_base::Result<Arc<dyn DevicePlugin>> = te_plugin_hip::load;
    let err = load().unwrap_err();
    println!("{err}");
    let Error::NotAvailable { what, reason } = &err else {
        panic!("expected NotAvailable, got {err:?}");
    };
    assert_eq!(what, "hip");
    assert!(
        reason.contains("libamdhip64"),
        "reason does not name the library: {reason}"
    );
    assert!(err.to_string().starts_with("hip: not available: "), "{err}");
    assert_eq!(load().unwrap_err().to_string(), err.to_string());
}

#[test]
fn classifying_a_host_pointer_without_a_runtime_is_an_error() {
    if runtime_installed() {
        println!("skipping: a HIP runtime is installed here (see tests/gpu.rs)");
        return;
    }
    let value = 42u64;
    let err = te_plugin_hip::classify(&value as *const u64 as u64).unwrap_err();
    assert!(matches!(err, Error::NotAvailable { .. }), "{err:?}");
}

#[test]
fn availability_report_reads_not_available() {
    if runtime_installed() {
        println!("skipping: a HIP runtime is installed here (see tests/gpu.rs)");
        return;
    }
    let report = PluginAvailability::from_load(te_plugin_hip::NAME, te_plugin_hip::load());
    assert!(report.plugin().is_none());
    assert!(report.to_string().starts_with("hip: not available: "), "{report}");
}
