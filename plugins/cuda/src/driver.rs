//! Opening libcuda and turning driver results into `te_base::Error`.
//!
//! cudarc resolves each driver function lazily and panics when the library or a symbol is missing,
//! so before any driver call the plugin finds the library itself and checks every symbol it will
//! use. After [`open`] succeeded, no cudarc call can panic for a missing library or symbol.

use std::ffi::CStr;

use cudarc::driver::sys::{self, CUresult};
use te_base::{Error, Result};

/// Plugin name, used in errors and reports.
pub(crate) const NAME: &str = "cuda";

/// Every driver function the plugin calls unconditionally (names as exported by libcuda).
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetPCIBusId",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD_v2",
    "cuCtxSynchronize",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuPointerGetAttributes",
    "cuGetErrorString",
    "cuGetErrorName",
];

/// Batched copies of many fragments in one call (CUDA 12.8 and later).
pub(crate) const BATCH_MEMCPY_SYMBOL: &str = "cuMemcpyBatchAsync";
/// dma-buf export of a device range (CUDA 11.7 and later).
pub(crate) const DMABUF_SYMBOL: &str = "cuMemGetHandleForAddressRange";

/// The file names cudarc tries, in its order.
pub(crate) fn library_candidates() -> Vec<String> {
    cudarc::get_lib_name_candidates("cuda")
}

/// Finds the driver library among `candidates` and returns the name that opened.
///
/// [`Error::NotAvailable`] names the libraries tried and the loader's last message.
pub(crate) fn find_library(candidates: &[String]) -> Result<String> {
    let mut message: Option<String> = None;
    for name in candidates {
        // SAFETY: opening the vendor's driver library runs its initialisers, which is what every
        // CUDA program does at start-up; the handle is dropped right away (cudarc keeps its own).
        match unsafe { libloading::Library::new(name) } {
            Ok(_) => return Ok(name.clone()),
            Err(e) => {
                let text = loader_message(&e);
                // A library that exists but fails to load says more than "no such file": keep that.
                let keep_old = message.as_ref().is_some_and(|m| !is_missing_file(m));
                if !keep_old {
                    message = Some(text);
                }
            }
        }
    }
    let last_error = message.unwrap_or_else(|| "no candidate names".into());
    let first = candidates.first().map(String::as_str).unwrap_or("libcuda.so");
    Err(Error::not_available(
        NAME,
        format!(
            "the CUDA driver library is not installed: cannot open {first} or {} other name(s) ({last_error})",
            candidates.len().saturating_sub(1)
        ),
    ))
}

/// The dynamic loader's own message (`libcuda.so.1: cannot open shared object file: ...`).
fn loader_message(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => source.to_string(),
        None => e.to_string(),
    }
}

fn is_missing_file(message: &str) -> bool {
    message.contains("No such file")
}

/// Opens libcuda through cudarc and checks that every required symbol is there.
pub(crate) fn open() -> Result<String> {
    let name = find_library(&library_candidates())?;
    // SAFETY: is_culib_present only tries to dlopen the candidate names; it is the documented guard
    // before culib(), which panics when nothing opens.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::not_available(
            NAME,
            format!("{name} opened once but not through cudarc"),
        ));
    }
    let missing: Vec<&str> = REQUIRED_SYMBOLS.iter().copied().filter(|s| !has_symbol(s)).collect();
    if !missing.is_empty() {
        return Err(Error::not_available(
            NAME,
            format!("{name} is too old: missing {}", missing.join(", ")),
        ));
    }
    Ok(name)
}

/// True if libcuda exports `symbol`. Only call after [`open`] succeeded.
pub(crate) fn has_symbol(symbol: &str) -> bool {
    // SAFETY: culib() cannot panic here because is_culib_present() returned true in open(); the
    // symbol is only looked up, never called through this pointer.
    unsafe { sys::culib().get::<*const std::ffi::c_void>(symbol.as_bytes()).is_ok() }
}

/// `Ok` for `CUDA_SUCCESS`, otherwise [`Error::Transport`] with the call and the driver's text.
pub(crate) fn check(result: CUresult, call: &str) -> Result<()> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::transport(NAME, format!("{call} failed: {}", describe(result))))
    }
}

/// `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`, from the driver's own tables.
pub(crate) fn describe(result: CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string owned by the driver (or leave it
    // null for unknown codes), and both symbols were checked in open().
    let (rn, rt) = unsafe {
        (
            sys::cuGetErrorName(result, &mut name),
            sys::cuGetErrorString(result, &mut text),
        )
    };
    let as_string = |r: CUresult, p: *const std::ffi::c_char| {
        if r == CUresult::CUDA_SUCCESS && !p.is_null() {
            // SAFETY: the driver returned a NUL-terminated static string.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        } else {
            None
        }
    };
    match (as_string(rn, name), as_string(rt, text)) {
        (Some(n), Some(t)) => format!("{n} ({t})"),
        (Some(n), None) => n,
        _ => format!("{result:?}"),
    }
}

/// Formats a driver version number (12040) as `12.4`.
pub(crate) fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_not_available_with_the_names_tried() {
        let names = vec!["libcuda-does-not-exist.so.1".to_string(), "libcuda-nope.so".to_string()];
        let err = find_library(&names).unwrap_err();
        let Error::NotAvailable { what, reason } = &err else {
            panic!("expected NotAvailable, got {err:?}");
        };
        assert_eq!(what, "cuda");
        assert!(reason.contains("libcuda-does-not-exist.so.1"), "{reason}");
        assert!(reason.contains("1 other name"), "{reason}");
    }

    #[test]
    fn candidates_include_the_soname_drivers_install() {
        let names = library_candidates();
        assert!(names.iter().any(|n| n == "libcuda.so.1"), "{names:?}");
    }

    #[test]
    fn versions_print_as_major_minor() {
        assert_eq!(version_text(12040), "12.4");
        assert_eq!(version_text(12080), "12.8");
        assert_eq!(version_text(13000), "13.0");
    }
}
