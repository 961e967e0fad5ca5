//! Hand-written bindings to the C shim in `csrc/fi_shim.c` (see `build.rs` for why we keep our own).
//!
//! Everything here is raw; the safe wrappers live in the crate's `fabric` module. Every function but
//! `te_fi_load` and the version/path getters needs libfabric loaded first (`crate::library`; the
//! safe wrappers ensure it). Constants use the shim's own
//! stable encoding, not libfabric's header values, so these declarations hold for 1.x and 2.x.

use std::ffi::{c_char, c_int, c_void};

/// `-FI_EAGAIN`: the queue is full, progress the CQ and retry.
pub const FI_EAGAIN: isize = 11;
/// `-FI_EAVAIL`: an error completion is waiting in the CQ.
pub const FI_EAVAIL: isize = 259;
/// `-FI_ENODATA`: fi_getinfo found nothing matching.
pub const FI_ENODATA: c_int = 61;
/// `-FI_ENOSYS`: not implemented (here: a loaded libfabric older than the option).
pub const FI_ENOSYS: c_int = 38;
/// `-FI_ENOPROTOOPT`: the provider does not know the option.
pub const FI_ENOPROTOOPT: c_int = 92;
/// `-FI_ENOKEY`: "required key not available": the requested MR key is in use (or, from the shim,
/// the provider has no key to report).
pub const FI_ENOKEY: c_int = 266;

/// mr_mode bits in the shim's encoding.
pub mod mr {
    /// Local buffers need a registered descriptor.
    pub const LOCAL: u32 = 1;
    /// Remote addresses are virtual addresses (otherwise offsets from the region start).
    pub const VIRT_ADDR: u32 = 2;
    /// The provider chooses the keys.
    pub const PROV_KEY: u32 = 4;
    /// Regions must be bound to the endpoint and enabled.
    pub const ENDPOINT: u32 = 8;
    /// Only allocated (backed) memory may be registered.
    pub const ALLOCATED: u32 = 16;
    /// Device memory registration.
    pub const HMEM: u32 = 32;
}

/// Step of [`te_fi_rail_open`] that failed, as text.
pub fn rail_step_name(step: c_int) -> &'static str {
    match step {
        1 => "fi_fabric",
        2 => "fi_domain",
        3 => "fi_av_open",
        4 => "fi_cq_open",
        5 => "fi_endpoint",
        6 => "fi_ep_bind(av)",
        7 => "fi_ep_bind(cq)",
        8 => "fi_enable",
        _ => "rail setup",
    }
}

/// Opaque `struct fi_info`.
#[repr(C)]
pub struct FiInfo {
    _private: [u8; 0],
}

/// Opaque `struct fid_mr`.
#[repr(C)]
pub struct FidMr {
    _private: [u8; 0],
}

/// The shim's `struct te_fi_rail`: the libfabric objects of one rail.
#[repr(C)]
#[derive(Debug)]
pub struct RawRail {
    pub fabric: *mut c_void,
    pub domain: *mut c_void,
    pub av: *mut c_void,
    pub cq: *mut c_void,
    pub ep: *mut c_void,
    pub cq_can_wait: c_int,
    pub info: *mut FiInfo,
    pub deny_shm: c_int,
    pub cq_size: usize,
}

impl RawRail {
    /// All-null, ready for `te_fi_rail_open` to fill.
    pub const fn empty() -> Self {
        RawRail {
            fabric: std::ptr::null_mut(),
            domain: std::ptr::null_mut(),
            av: std::ptr::null_mut(),
            cq: std::ptr::null_mut(),
            ep: std::ptr::null_mut(),
            cq_can_wait: 0,
            info: std::ptr::null_mut(),
            deny_shm: 0,
            cq_size: 0,
        }
    }
}

extern "C" {
    /// Opens libfabric at `path` and resolves its exported functions (see `csrc/fi_shim.c`): 0, or
    /// 1 (dlopen failed) / 2 (a function is missing) with the reason in `err`. Only through
    /// `crate::library`, which calls it once per process.
    pub fn te_fi_load(path: *const c_char, err: *mut c_char, err_len: usize) -> c_int;
    pub fn te_fi_loaded_path() -> *const c_char;
    pub fn te_fi_abi_version() -> *const c_char;
    pub fn te_fi_api_version() -> u32;
    pub fn te_fi_runtime_version() -> u32;
    pub fn te_fi_header_version() -> u32;
    pub fn te_fi_strerror(err: c_int) -> *const c_char;

    pub fn te_fi_getinfo(
        prov: *const c_char,
        mr_mode: u32,
        delivery_complete: c_int,
        hmem: c_int,
        out: *mut *mut FiInfo,
    ) -> c_int;
    pub fn te_fi_freeinfo(info: *mut FiInfo);
    pub fn te_fi_info_next(info: *const FiInfo) -> *mut FiInfo;
    pub fn te_fi_info_provider(info: *const FiInfo) -> *const c_char;
    pub fn te_fi_info_fabric(info: *const FiInfo) -> *const c_char;
    pub fn te_fi_info_domain(info: *const FiInfo) -> *const c_char;
    pub fn te_fi_info_mr_mode(info: *const FiInfo) -> u32;
    pub fn te_fi_info_mr_key_size(info: *const FiInfo) -> usize;
    pub fn te_fi_info_max_msg_size(info: *const FiInfo) -> usize;
    pub fn te_fi_info_tx_size(info: *const FiInfo) -> usize;
    pub fn te_fi_info_is_ipv4(info: *const FiInfo) -> c_int;
    pub fn te_fi_info_needs_context(info: *const FiInfo) -> c_int;
    pub fn te_fi_info_hmem(info: *const FiInfo) -> c_int;

    pub fn te_fi_rail_open(
        info: *mut FiInfo,
        cq_size: usize,
        deny_shm: c_int,
        rail: *mut RawRail,
        step: *mut c_int,
        shm_opt: *mut c_int,
    ) -> c_int;
    pub fn te_fi_rail_close(rail: *mut RawRail);
    pub fn te_fi_ep_close(rail: *mut RawRail);
    pub fn te_fi_ep_reset(rail: *mut RawRail) -> c_int;
    pub fn te_fi_getname(rail: *mut RawRail, buf: *mut c_void, len: *mut usize) -> c_int;
    pub fn te_fi_av_insert(rail: *mut RawRail, addr: *const c_void, fi_addr: *mut u64) -> c_int;
    pub fn te_fi_av_remove(rail: *mut RawRail, fi_addr: u64) -> c_int;

    #[allow(clippy::too_many_arguments)]
    pub fn te_fi_mr_reg(
        rail: *mut RawRail,
        buf: *mut c_void,
        len: usize,
        remote: c_int,
        requested_key: u64,
        bind_ep: c_int,
        nocache: c_int,
        hmem_iface: c_int,
        hmem_device: c_int,
        mr: *mut *mut FidMr,
        key: *mut u64,
        desc: *mut *mut c_void,
    ) -> c_int;
    pub fn te_fi_mr_close(mr: *mut FidMr) -> c_int;

    #[allow(clippy::too_many_arguments)]
    pub fn te_fi_write(
        rail: *mut RawRail,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        raddr: u64,
        rkey: u64,
        ctx: *mut c_void,
    ) -> isize;
    #[allow(clippy::too_many_arguments)]
    pub fn te_fi_read(
        rail: *mut RawRail,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        raddr: u64,
        rkey: u64,
        ctx: *mut c_void,
    ) -> isize;
    pub fn te_fi_cq_read(rail: *mut RawRail, ctxs: *mut *mut c_void, lens: *mut usize, count: usize) -> isize;
    pub fn te_fi_cq_sread(
        rail: *mut RawRail,
        ctxs: *mut *mut c_void,
        lens: *mut usize,
        count: usize,
        timeout_ms: c_int,
    ) -> isize;
    pub fn te_fi_recv(rail: *mut RawRail, buf: *mut c_void, len: usize, desc: *mut c_void, ctx: *mut c_void) -> isize;
    pub fn te_fi_send(
        rail: *mut RawRail,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        ctx: *mut c_void,
    ) -> isize;
    pub fn te_fi_cq_signal(rail: *mut RawRail) -> c_int;
    pub fn te_fi_cq_readerr(
        rail: *mut RawRail,
        ctx: *mut *mut c_void,
        err: *mut c_int,
        msg: *mut c_char,
        msg_len: usize,
    ) -> isize;
}

/// libfabric's error for a return code, kept as the source of a transport error so callers can
/// match on the code.
pub fn native_error(rc: i64) -> te_base::NativeError {
    te_base::NativeError {
        library: "libfabric",
        code: -(rc.unsigned_abs().min(i32::MAX as u64) as i64),
        text: strerror(rc),
    }
}

/// libfabric's text for a (positive or negative) fi error code.
pub fn strerror(err: i64) -> String {
    let code = err.unsigned_abs().min(i32::MAX as u64) as c_int;
    // SAFETY: fi_strerror returns a pointer to a static NUL-terminated string for any code; the
    // shim returns null instead while libfabric is not loaded.
    let p = unsafe { te_fi_strerror(code) };
    if p.is_null() {
        return format!("fi error {code}");
    }
    // SAFETY: non-null and NUL-terminated (see above); we copy it out at once.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
