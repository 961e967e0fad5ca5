//! `HipPlugin`: the HIP implementation of `te_base::device::DevicePlugin`.

use std::ffi::{c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use te_base::device::{
    check_device, normalize_pci_bus_id, CopyDirection, CopyFragment, DevicePlugin, DeviceRuntimeInfo, DmaBufExport,
    PendingCopy, PointerKind,
};
use te_base::{Error, MemoryKind, Result};

use crate::api::{
    version_text, Handle, HipApi, PointerAttributes, HIP_ERROR_INVALID_VALUE, HIP_ERROR_NOT_SUPPORTED, HIP_SUCCESS,
    LIBRARY_CANDIDATES, MEMCPY_DEVICE_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE,
    MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, NAME, STREAM_NON_BLOCKING,
};
use crate::memory_type::pointer_kind;
use crate::pending::HipPendingCopy;

/// A device's cached non-blocking stream.
#[derive(Debug)]
struct DeviceStream(Handle);

// SAFETY: a hipStream_t is a runtime handle that any thread may enqueue on.
unsafe impl Send for DeviceStream {}
// SAFETY: as above; the handle is never changed after creation.
unsafe impl Sync for DeviceStream {}

/// The HIP runtime, opened at run time. One per process (see [`crate::load`]).
pub struct HipPlugin {
    api: Arc<HipApi>,
    runtime_version: c_int,
    driver_version: c_int,
    count: u32,
    streams: Vec<OnceLock<Result<DeviceStream>>>,
}

impl HipPlugin {
    /// Opens libamdhip64, initialises it and counts the visible devices.
    pub(crate) fn open() -> Result<Self> {
        Self::open_from(LIBRARY_CANDIDATES)
    }

    pub(crate) fn open_from(candidates: &[&str]) -> Result<Self> {
        let api = Arc::new(HipApi::open(candidates)?);
        // SAFETY: hipInit takes flags (must be 0) and has no other precondition.
        let init = unsafe { (api.init)(0) };
        if init != HIP_SUCCESS {
            return Err(Error::not_available(
                NAME,
                format!("hipInit failed: {}", api.describe(init)),
            ));
        }
        let mut runtime_version = 0;
        // SAFETY: writes one integer.
        let r = unsafe { (api.runtime_get_version)(&mut runtime_version) };
        api.check(r, "hipRuntimeGetVersion")?;
        let mut driver_version = 0;
        // SAFETY: writes one integer. Some releases do not implement it; the version is then 0.
        let _ = unsafe { (api.driver_get_version)(&mut driver_version) };
        let mut count = 0;
        // SAFETY: writes one integer; the runtime counts only devices HIP_VISIBLE_DEVICES lets through.
        let r = unsafe { (api.get_device_count)(&mut count) };
        if r != HIP_SUCCESS || count <= 0 {
            let visible = std::env::var("HIP_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into());
            let why = if r == HIP_SUCCESS {
                "no device".to_string()
            } else {
                api.describe(r)
            };
            return Err(Error::not_available(
                NAME,
                format!("no HIP device is visible ({why}; HIP_VISIBLE_DEVICES={visible})"),
            ));
        }
        Ok(HipPlugin {
            api,
            runtime_version,
            driver_version,
            count: count as u32,
            streams: (0..count).map(|_| OnceLock::new()).collect(),
        })
    }

    /// Major version of the runtime (5, 6, 7...), which decides how memory types are numbered.
    pub fn runtime_major(&self) -> i32 {
        self.runtime_version / 10_000_000
    }

    /// Makes `device` current on this thread (thread-local; once per call).
    fn set_device(&self, device: u32) -> Result<()> {
        check_device(NAME, device, self.count)?;
        // SAFETY: the ordinal is below the device count.
        let r = unsafe { (self.api.set_device)(device as c_int) };
        self.api.check(r, "hipSetDevice")
    }

    /// The device's stream, created on first use (the device must be current). Failures are kept.
    fn stream(&self, device: u32) -> Result<Handle> {
        let cached = self.streams[device as usize].get_or_init(|| {
            let mut stream: Handle = std::ptr::null_mut();
            // SAFETY: the device is current; the runtime writes the stream handle. Non-blocking: no
            // implicit synchronisation with the null stream of other code.
            let r = unsafe { (self.api.stream_create_with_flags)(&mut stream, STREAM_NON_BLOCKING) };
            self.api
                .check(r, "hipStreamCreateWithFlags")
                .map(|_| DeviceStream(stream))
        });
        cached.as_ref().map(|s| s.0).map_err(Clone::clone)
    }
}

impl DevicePlugin for HipPlugin {
    fn name(&self) -> &'static str {
        NAME
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Rocm
    }

    fn info(&self) -> DeviceRuntimeInfo {
        DeviceRuntimeInfo {
            name: NAME,
            library: self.api.library_name.clone(),
            driver_version: (self.driver_version > 0).then(|| version_text(self.driver_version)),
            runtime_version: Some(version_text(self.runtime_version)),
            devices: self.count,
        }
    }

    fn device_count(&self) -> u32 {
        self.count
    }

    fn pci_bus_id(&self, device: u32) -> Result<String> {
        check_device(NAME, device, self.count)?;
        let mut buf = [0 as std::ffi::c_char; 64];
        // SAFETY: the buffer holds 64 bytes and the runtime writes at most `len` including the NUL.
        let r = unsafe { (self.api.device_get_pci_bus_id)(buf.as_mut_ptr(), buf.len() as c_int, device as c_int) };
        self.api.check(r, "hipDeviceGetPCIBusId")?;
        // SAFETY: the buffer was zeroed, so it is NUL-terminated whatever the runtime wrote.
        let raw = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        normalize_pci_bus_id(NAME, &raw)
    }

    fn classify(&self, addr: u64) -> Result<PointerKind> {
        if addr == 0 {
            return Err(Error::NullAddress);
        }
        let mut attrs = PointerAttributes {
            memory_type: 0,
            device: -1,
            device_pointer: std::ptr::null_mut(),
            host_pointer: std::ptr::null_mut(),
            is_managed: 0,
            allocation_flags: 0,
        };
        // SAFETY: the runtime fills the struct (same layout in ROCm 5 and 6) and only looks the
        // address up; it never dereferences it.
        let r = unsafe { (self.api.pointer_get_attributes)(&mut attrs, addr as *const c_void) };
        match r {
            HIP_SUCCESS => Ok(pointer_kind(
                self.runtime_major(),
                attrs.memory_type,
                attrs.device,
                attrs.is_managed != 0,
            )),
            // Memory the runtime never saw (ROCm 5, and some 6.x releases): ordinary host memory.
            HIP_ERROR_INVALID_VALUE => Ok(PointerKind::Host),
            other => self
                .api
                .check(other, "hipPointerGetAttributes")
                .map(|_| PointerKind::Host),
        }
    }

    fn allocate(&self, device: u32, len: u64) -> Result<u64> {
        if len == 0 {
            return Err(Error::ZeroLength { index: 0 });
        }
        let bytes = usize::try_from(len).map_err(|_| Error::LengthOverflow { addr: 0, len })?;
        self.set_device(device)?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: the device is current; the runtime writes the new address.
        let r = unsafe { (self.api.malloc)(&mut ptr, bytes) };
        self.api.check(r, "hipMalloc")?;
        Ok(ptr as u64)
    }

    unsafe fn free(&self, device: u32, addr: u64) -> Result<()> {
        if addr == 0 {
            return Err(Error::NullAddress);
        }
        self.set_device(device)?;
        // SAFETY: the caller guarantees `addr` came from allocate(device, _) and is unused.
        let r = unsafe { (self.api.free)(addr as *mut c_void) };
        self.api.check(r, "hipFree")
    }

    unsafe fn copy(&self, device: u32, direction: CopyDirection, fragment: CopyFragment) -> Result<()> {
        // hipMemcpy may return before a device-to-device copy lands; a waited batch of one does not.
        // SAFETY: the caller's guarantees are exactly copy_async's.
        let pending = unsafe { self.copy_async(device, direction, std::slice::from_ref(&fragment)) }?;
        pending.wait()
    }

    unsafe fn copy_async(
        &self,
        device: u32,
        direction: CopyDirection,
        fragments: &[CopyFragment],
    ) -> Result<Box<dyn PendingCopy>> {
        for (i, f) in fragments.iter().enumerate() {
            f.validate(i)?;
        }
        self.set_device(device)?;
        let stream = self.stream(device)?;
        if fragments.is_empty() {
            return Ok(Box::new(HipPendingCopy::done(Arc::clone(&self.api))));
        }
        // The kind is given explicitly so the runtime does not look the pointers up per fragment.
        let kind = match direction {
            CopyDirection::HostToDevice => MEMCPY_HOST_TO_DEVICE,
            CopyDirection::DeviceToHost => MEMCPY_DEVICE_TO_HOST,
            CopyDirection::DeviceToDevice => MEMCPY_DEVICE_TO_DEVICE,
        };
        for f in fragments {
            // SAFETY: validated fragment; the caller guarantees both ranges until completion.
            let r = unsafe {
                (self.api.memcpy_async)(
                    f.dst as *mut c_void,
                    f.src as *const c_void,
                    f.len as usize,
                    kind,
                    stream,
                )
            };
            if let Err(e) = self.api.check(r, "hipMemcpyAsync") {
                // Earlier fragments may be queued: let them finish before the caller reuses memory.
                // SAFETY: the stream belongs to the current device.
                unsafe { (self.api.stream_synchronize)(stream) };
                return Err(e);
            }
        }
        Ok(Box::new(HipPendingCopy::record(Arc::clone(&self.api), stream)?))
    }

    fn export_dmabuf(&self, device: u32, addr: u64, len: u64) -> Result<DmaBufExport> {
        CopyFragment {
            dst: addr,
            src: addr,
            len,
        }
        .validate(0)?;
        let Some(export) = self.api.mem_get_handle_for_address_range else {
            return Err(Error::not_available(
                "hip dma-buf",
                format!(
                    "{} (HIP {}) has no hipMemGetHandleForAddressRange",
                    self.api.library_name,
                    version_text(self.runtime_version)
                ),
            ));
        };
        self.set_device(device)?;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let start = addr & !(page - 1);
        let end = (addr + len)
            .checked_next_multiple_of(page)
            .ok_or(Error::LengthOverflow { addr, len })?;
        let mut fd: c_int = -1;
        let fd_out: *mut c_void = (&mut fd as *mut c_int).cast();
        // SAFETY: the runtime writes one int (the fd) and only looks the range up.
        let r = unsafe {
            export(
                fd_out,
                start as *mut c_void,
                (end - start) as usize,
                MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        if r == HIP_ERROR_NOT_SUPPORTED {
            return Err(Error::not_available(
                "hip dma-buf",
                format!("hipMemGetHandleForAddressRange: {}", self.api.describe(r)),
            ));
        }
        self.api.check(r, "hipMemGetHandleForAddressRange")?;
        if fd < 0 {
            return Err(Error::transport(
                NAME,
                "hipMemGetHandleForAddressRange returned no file descriptor",
            ));
        }
        Ok(DmaBufExport {
            // SAFETY: the runtime just created this descriptor for us; nothing else owns it.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            offset: addr - start,
            len: end - start,
        })
    }
}

impl std::fmt::Debug for HipPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipPlugin")
            .field("library", &self.api.library_name)
            .field("runtime_version", &version_text(self.runtime_version))
            .field("devices", &self.count)
            .finish()
    }
}
