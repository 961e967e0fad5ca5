//! The HIP runtime functions the plugin calls, looked up in libamdhip64 with dlopen/dlsym.
//!
//! Only what is needed, with C signatures from `hip_runtime_api.h`. Every symbol is resolved at
//! load; a missing one makes the plugin unavailable instead of failing later.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};

use te_base::{Error, Result};

/// Plugin name, used in errors and reports.
pub(crate) const NAME: &str = "hip";

/// `hipError_t`.
pub(crate) type HipError = c_int;
/// `hipStream_t`, `hipEvent_t`: opaque pointers.
pub(crate) type Handle = *mut c_void;

pub(crate) const HIP_SUCCESS: HipError = 0;
pub(crate) const HIP_ERROR_INVALID_VALUE: HipError = 1;
pub(crate) const HIP_ERROR_NOT_READY: HipError = 600;
pub(crate) const HIP_ERROR_NOT_SUPPORTED: HipError = 801;

/// `hipMemcpyKind`.
pub(crate) const MEMCPY_HOST_TO_DEVICE: c_int = 1;
pub(crate) const MEMCPY_DEVICE_TO_HOST: c_int = 2;
pub(crate) const MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// `hipStreamNonBlocking`.
pub(crate) const STREAM_NON_BLOCKING: c_uint = 1;
/// `hipEventDisableTiming`.
pub(crate) const EVENT_DISABLE_TIMING: c_uint = 2;
/// `hipMemRangeHandleTypeDmaBufFd`.
pub(crate) const MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;

/// `hipPointerAttribute_t`. The layout is the same in ROCm 5 and 6; the first field's values are
/// not (see `memory_type.rs`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct PointerAttributes {
    pub(crate) memory_type: c_int,
    pub(crate) device: c_int,
    pub(crate) device_pointer: *mut c_void,
    pub(crate) host_pointer: *mut c_void,
    pub(crate) is_managed: c_int,
    pub(crate) allocation_flags: c_uint,
}

/// Library names tried, in order: the development link, then the versioned sonames, then the
/// default ROCm install path for hosts whose loader path does not include it.
pub(crate) const LIBRARY_CANDIDATES: &[&str] = &[
    "libamdhip64.so",
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
    "/opt/rocm/lib/libamdhip64.so",
];

/// Function pointers into an open libamdhip64, valid as long as `_library` is.
pub(crate) struct HipApi {
    pub(crate) library_name: String,
    pub(crate) init: unsafe extern "C" fn(c_uint) -> HipError,
    pub(crate) runtime_get_version: unsafe extern "C" fn(*mut c_int) -> HipError,
    pub(crate) driver_get_version: unsafe extern "C" fn(*mut c_int) -> HipError,
    pub(crate) get_device_count: unsafe extern "C" fn(*mut c_int) -> HipError,
    pub(crate) set_device: unsafe extern "C" fn(c_int) -> HipError,
    pub(crate) malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> HipError,
    pub(crate) free: unsafe extern "C" fn(*mut c_void) -> HipError,
    pub(crate) memcpy_async: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, Handle) -> HipError,
    pub(crate) stream_create_with_flags: unsafe extern "C" fn(*mut Handle, c_uint) -> HipError,
    pub(crate) stream_synchronize: unsafe extern "C" fn(Handle) -> HipError,
    pub(crate) event_create_with_flags: unsafe extern "C" fn(*mut Handle, c_uint) -> HipError,
    pub(crate) event_record: unsafe extern "C" fn(Handle, Handle) -> HipError,
    pub(crate) event_query: unsafe extern "C" fn(Handle) -> HipError,
    pub(crate) event_synchronize: unsafe extern "C" fn(Handle) -> HipError,
    pub(crate) event_destroy: unsafe extern "C" fn(Handle) -> HipError,
    pub(crate) pointer_get_attributes: unsafe extern "C" fn(*mut PointerAttributes, *const c_void) -> HipError,
    pub(crate) device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipError,
    pub(crate) get_error_name: unsafe extern "C" fn(HipError) -> *const c_char,
    pub(crate) get_error_string: unsafe extern "C" fn(HipError) -> *const c_char,
    /// `hipMemGetHandleForAddressRange`, present in newer ROCm releases only.
    pub(crate) mem_get_handle_for_address_range:
        Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, c_ulonglong) -> HipError>,
    _library: libloading::Library,
}

impl HipApi {
    /// Opens the first library of `candidates` that loads and resolves every function.
    pub(crate) fn open(candidates: &[&str]) -> Result<Self> {
        let mut failures = Vec::new();
        for name in candidates {
            // SAFETY: opening the vendor's runtime library runs its initialisers, as any HIP program
            // does at start-up.
            match unsafe { libloading::Library::new(*name) } {
                Ok(library) => return Self::resolve(name, library),
                Err(e) => failures.push(loader_message(&e)),
            }
        }
        // Prefer a message about a library that exists but failed over "no such file".
        let detail = failures
            .iter()
            .find(|m| !m.contains("No such file"))
            .or(failures.first())
            .cloned()
            .unwrap_or_else(|| "no candidate names".into());
        Err(Error::not_available(
            NAME,
            format!(
                "the HIP runtime library is not installed: cannot open {} ({detail})",
                candidates.join(", ")
            ),
        ))
    }

    fn resolve(name: &str, library: libloading::Library) -> Result<Self> {
        let mut missing = Vec::new();
        macro_rules! symbol {
            ($sym:literal) => {{
                // SAFETY: the Rust type the symbol is read as is the C signature of that function in
                // hip_runtime_api.h; the pointer stays valid while `library` is kept in the struct.
                match unsafe { library.get(concat!($sym, "\0").as_bytes()) } {
                    Ok(s) => Some(*s),
                    Err(_) => {
                        missing.push($sym);
                        None
                    }
                }
            }};
        }
        let api = (|| {
            Some(HipApi {
                library_name: name.to_string(),
                init: symbol!("hipInit")?,
                runtime_get_version: symbol!("hipRuntimeGetVersion")?,
                driver_get_version: symbol!("hipDriverGetVersion")?,
                get_device_count: symbol!("hipGetDeviceCount")?,
                set_device: symbol!("hipSetDevice")?,
                malloc: symbol!("hipMalloc")?,
                free: symbol!("hipFree")?,
                memcpy_async: symbol!("hipMemcpyAsync")?,
                stream_create_with_flags: symbol!("hipStreamCreateWithFlags")?,
                stream_synchronize: symbol!("hipStreamSynchronize")?,
                event_create_with_flags: symbol!("hipEventCreateWithFlags")?,
                event_record: symbol!("hipEventRecord")?,
                event_query: symbol!("hipEventQuery")?,
                event_synchronize: symbol!("hipEventSynchronize")?,
                event_destroy: symbol!("hipEventDestroy")?,
                pointer_get_attributes: symbol!("hipPointerGetAttributes")?,
                device_get_pci_bus_id: symbol!("hipDeviceGetPCIBusId")?,
                get_error_name: symbol!("hipGetErrorName")?,
                get_error_string: symbol!("hipGetErrorString")?,
                mem_get_handle_for_address_range: {
                    // SAFETY: as in symbol!; an absent optional function is simply None.
                    unsafe { library.get(b"hipMemGetHandleForAddressRange\0") }
                        .ok()
                        .map(|s| *s)
                },
                _library: library,
            })
        })();
        api.ok_or_else(|| Error::not_available(NAME, format!("{name} lacks {}", missing.join(", "))))
    }

    /// `Ok` for `hipSuccess`, otherwise [`Error::Transport`] with the call and the runtime's text.
    pub(crate) fn check(&self, result: HipError, call: &str) -> Result<()> {
        if result == HIP_SUCCESS {
            Ok(())
        } else {
            Err(Error::transport(
                NAME,
                format!("{call} failed: {}", self.describe(result)),
            ))
        }
    }

    /// `hipErrorOutOfMemory (out of memory)`, from the runtime's own tables.
    pub(crate) fn describe(&self, result: HipError) -> String {
        let text = |p: *const c_char| {
            // SAFETY: the runtime returns a pointer to a static NUL-terminated string (or null).
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        // SAFETY: both functions take any error code and return static strings.
        let (name, string) = unsafe { ((self.get_error_name)(result), (self.get_error_string)(result)) };
        match (text(name), text(string)) {
            (Some(n), Some(s)) => format!("{n} ({s})"),
            (Some(n), None) => n,
            _ => format!("hipError_t {result}"),
        }
    }
}

/// The dynamic loader's own message (`libamdhip64.so: cannot open shared object file: ...`).
fn loader_message(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => source.to_string(),
        None => e.to_string(),
    }
}

/// Splits `HIP_VERSION` (major * 10_000_000 + minor * 100_000 + patch) into `6.0.32830`.
pub(crate) fn version_text(v: c_int) -> String {
    format!("{}.{}.{}", v / 10_000_000, (v / 100_000) % 100, v % 100_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_not_available_with_the_names_tried() {
        let err = HipApi::open(&["libamdhip64-does-not-exist.so.6"]).err().unwrap();
        let Error::NotAvailable { what, reason } = &err else {
            panic!("expected NotAvailable, got {err:?}");
        };
        assert_eq!(what, "hip");
        assert!(reason.contains("libamdhip64-does-not-exist.so.6"), "{reason}");
    }

    #[test]
    fn a_library_without_the_functions_is_not_available() {
        // libc opens everywhere and has none of the HIP functions.
        let err = HipApi::open(&["libc.so.6"]).err().unwrap();
        let Error::NotAvailable { reason, .. } = &err else {
            panic!("expected NotAvailable, got {err:?}");
        };
        assert!(reason.contains("libc.so.6 lacks hipInit"), "{reason}");
    }

    #[test]
    fn hip_versions_split_into_major_minor_patch() {
        assert_eq!(version_text(60032830), "6.0.32830");
        assert_eq!(version_text(50422804), "5.4.22804");
    }
}
