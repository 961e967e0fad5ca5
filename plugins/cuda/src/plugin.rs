//! `CudaPlugin`: the CUDA implementation of `te_base::device::DevicePlugin` over the driver API.

use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUdevice, CUmemRangeHandleType, CUpointer_attribute, CUresult};
use te_base::device::{
    check_device, normalize_pci_bus_id, CopyDirection, CopyFragment, DevicePlugin, DeviceRuntimeInfo, DmaBufExport,
    PendingCopy, PointerKind,
};
use te_base::{Error, MemoryKind, Result};

use crate::batch::enqueue;
use crate::context::DeviceContext;
use crate::driver::{self, check, NAME};
use crate::pending::CudaPendingCopy;

/// The CUDA driver, opened at run time. One per process (see [`crate::load`]).
pub struct CudaPlugin {
    library: String,
    driver_version: i32,
    devices: Vec<CUdevice>,
    contexts: Vec<OnceLock<Result<DeviceContext>>>,
    batch_memcpy_available: bool,
    batch_memcpy: AtomicBool,
    dmabuf_export: bool,
}

impl CudaPlugin {
    /// Opens the driver, initialises it and enumerates the visible devices.
    ///
    /// `batch_memcpy`: use `cuMemcpyBatchAsync` for multi-fragment batches when the driver has it
    /// (`None`: whenever available).
    pub(crate) fn open(batch_memcpy: Option<bool>) -> Result<Self> {
        let library = driver::open()?;
        // SAFETY: every symbol used below was checked by driver::open().
        let init = unsafe { sys::cuInit(0) };
        if init != CUresult::CUDA_SUCCESS {
            return Err(Error::not_available(
                NAME,
                format!("cuInit failed: {}", driver::describe(init)),
            ));
        }
        let mut driver_version = 0;
        // SAFETY: writes one integer.
        let result = unsafe { sys::cuDriverGetVersion(&mut driver_version) };
        check(result, "cuDriverGetVersion")?;
        let mut count = 0;
        // SAFETY: writes one integer; the driver counts only devices CUDA_VISIBLE_DEVICES lets through.
        check(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount")?;
        if count <= 0 {
            let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into());
            return Err(Error::not_available(
                NAME,
                format!("no CUDA device is visible (CUDA_VISIBLE_DEVICES={visible})"),
            ));
        }
        let mut devices = Vec::with_capacity(count as usize);
        for ordinal in 0..count {
            let mut dev: CUdevice = 0;
            // SAFETY: `ordinal` is below the count the driver just reported.
            check(unsafe { sys::cuDeviceGet(&mut dev, ordinal) }, "cuDeviceGet")?;
            devices.push(dev);
        }
        let batch_memcpy_available = driver_version >= 12080 && driver::has_symbol(driver::BATCH_MEMCPY_SYMBOL);
        Ok(CudaPlugin {
            library,
            driver_version,
            contexts: (0..devices.len()).map(|_| OnceLock::new()).collect(),
            devices,
            batch_memcpy_available,
            batch_memcpy: AtomicBool::new(batch_memcpy.unwrap_or(true) && batch_memcpy_available),
            dmabuf_export: driver::has_symbol(driver::DMABUF_SYMBOL),
        })
    }

    /// True if multi-fragment batches go through `cuMemcpyBatchAsync` (one driver call per batch);
    /// false if they are one `cuMemcpy*Async` per fragment.
    pub fn batch_memcpy(&self) -> bool {
        self.batch_memcpy.load(Ordering::Relaxed)
    }

    /// Chooses between the batched driver call and one call per fragment (for measurements).
    /// Asking for the batched call on a driver without it gives [`Error::NotAvailable`].
    pub fn set_batch_memcpy(&self, on: bool) -> Result<()> {
        if on && !self.batch_memcpy_available {
            return Err(Error::not_available(
                "cuda cuMemcpyBatchAsync",
                format!(
                    "driver {} has no batched copy (needs 12.8)",
                    driver::version_text(self.driver_version)
                ),
            ));
        }
        self.batch_memcpy.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Baseline for measurements: one plain `cuMemcpy{HtoD,DtoH,DtoD}` call, what `cudaMemcpy`
    /// does, on the legacy default stream. Device-to-device (and host-to-device from pageable
    /// memory) may return before the bytes land: call [`CudaPlugin::synchronize`] before reading.
    ///
    /// # Safety
    /// As for [`DevicePlugin::copy`].
    pub unsafe fn plain_memcpy(&self, device: u32, direction: CopyDirection, fragment: CopyFragment) -> Result<()> {
        fragment.validate(0)?;
        self.context(device)?.make_current()?;
        let (dst, src, len) = (fragment.dst, fragment.src, fragment.len as usize);
        // SAFETY: the caller guarantees both ranges for the kinds `direction` names.
        let result = unsafe {
            match direction {
                CopyDirection::HostToDevice => sys::cuMemcpyHtoD_v2(dst, src as *const c_void, len),
                CopyDirection::DeviceToHost => sys::cuMemcpyDtoH_v2(dst as *mut c_void, src, len),
                CopyDirection::DeviceToDevice => sys::cuMemcpyDtoD_v2(dst, src, len),
            }
        };
        check(result, "cuMemcpy")
    }

    /// Waits for all work of the device's context (`cuCtxSynchronize`), for baselines.
    pub fn synchronize(&self, device: u32) -> Result<()> {
        self.context(device)?.make_current()?;
        // SAFETY: the context is current; the call only waits.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    /// The device's context and stream, created on first use. A failure is remembered.
    fn context(&self, device: u32) -> Result<&DeviceContext> {
        check_device(NAME, device, self.devices.len() as u32)?;
        let i = device as usize;
        self.contexts[i]
            .get_or_init(|| DeviceContext::create(self.devices[i]))
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl DevicePlugin for CudaPlugin {
    fn name(&self) -> &'static str {
        NAME
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Cuda
    }

    fn info(&self) -> DeviceRuntimeInfo {
        DeviceRuntimeInfo {
            name: NAME,
            library: self.library.clone(),
            driver_version: Some(driver::version_text(self.driver_version)),
            runtime_version: None,
            devices: self.devices.len() as u32,
        }
    }

    fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    fn pci_bus_id(&self, device: u32) -> Result<String> {
        check_device(NAME, device, self.devices.len() as u32)?;
        let mut buf = [0 as std::ffi::c_char; 64];
        let dev = self.devices[device as usize];
        // SAFETY: the buffer is 64 bytes and the driver writes at most `len` bytes including NUL.
        let result = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) };
        check(result, "cuDeviceGetPCIBusId")?;
        // SAFETY: the driver NUL-terminated the string inside `buf` (it zero-fills the rest anyway).
        let raw = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        normalize_pci_bus_id(NAME, &raw)
    }

    fn classify(&self, addr: u64) -> Result<PointerKind> {
        if addr == 0 {
            return Err(Error::NullAddress);
        }
        let mut memory_type: u32 = 0;
        let mut ordinal: i32 = -1;
        let mut managed: u32 = 0;
        let mut attributes = [
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        ];
        let mut data: [*mut c_void; 3] = [
            (&mut memory_type as *mut u32).cast(),
            (&mut ordinal as *mut i32).cast(),
            (&mut managed as *mut u32).cast(),
        ];
        // SAFETY: three attributes, three pointers to live locals of the sizes the driver writes
        // (memory type and managed flag are 32-bit, the ordinal an int). The address is only looked
        // up, never dereferenced.
        let result = unsafe { sys::cuPointerGetAttributes(3, attributes.as_mut_ptr(), data.as_mut_ptr(), addr) };
        match result {
            CUresult::CUDA_SUCCESS => {}
            // Drivers before 11.x answer this for memory they do not know: ordinary host memory.
            CUresult::CUDA_ERROR_INVALID_VALUE => return Ok(PointerKind::Host),
            other => check(other, "cuPointerGetAttributes")?,
        }
        if managed != 0 {
            return Ok(PointerKind::Managed);
        }
        const HOST: u32 = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
        const DEVICE: u32 = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        Ok(match memory_type {
            0 => PointerKind::Host,
            HOST => PointerKind::PinnedHost,
            DEVICE if ordinal >= 0 => PointerKind::Device { device: ordinal as u32 },
            code => PointerKind::Unknown { code },
        })
    }

    fn allocate(&self, device: u32, len: u64) -> Result<u64> {
        if len == 0 {
            return Err(Error::ZeroLength { index: 0 });
        }
        let bytes = usize::try_from(len).map_err(|_| Error::LengthOverflow { addr: 0, len })?;
        let ctx = self.context(device)?;
        ctx.make_current()?;
        let mut addr = 0;
        // SAFETY: the device's context is current; the driver writes the new address.
        check(unsafe { sys::cuMemAlloc_v2(&mut addr, bytes) }, "cuMemAlloc")?;
        Ok(addr)
    }

    unsafe fn free(&self, device: u32, addr: u64) -> Result<()> {
        if addr == 0 {
            return Err(Error::NullAddress);
        }
        let ctx = self.context(device)?;
        ctx.make_current()?;
        // SAFETY: the caller guarantees `addr` came from allocate(device, _) and is unused.
        check(unsafe { sys::cuMemFree_v2(addr) }, "cuMemFree")
    }

    unsafe fn copy(&self, device: u32, direction: CopyDirection, fragment: CopyFragment) -> Result<()> {
        // Plain cuMemcpy{HtoD,DtoD} may return before the bytes land (pageable staging, device to
        // device), so a synchronous copy is a one-fragment batch that is waited for.
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
        let ctx = self.context(device)?;
        ctx.make_current()?;
        if fragments.is_empty() {
            return Ok(Box::new(CudaPendingCopy::done(ctx.ctx)));
        }
        let batched = fragments.len() > 1 && self.batch_memcpy.load(Ordering::Relaxed);
        // SAFETY: fragments validated; the caller guarantees the memory; the context is current.
        let enqueued = unsafe { enqueue(ctx.stream, device, direction, fragments, batched) };
        if let Err(e) = enqueued {
            // Some fragments may be queued already: let them finish before the caller reuses memory.
            // SAFETY: the stream belongs to the current context.
            unsafe { sys::cuStreamSynchronize(ctx.stream) };
            return Err(e);
        }
        Ok(Box::new(CudaPendingCopy::record(ctx.ctx, ctx.stream)?))
    }

    fn export_dmabuf(&self, device: u32, addr: u64, len: u64) -> Result<DmaBufExport> {
        CopyFragment {
            dst: addr,
            src: addr,
            len,
        }
        .validate(0)?;
        if !self.dmabuf_export {
            return Err(Error::not_available(
                "cuda dma-buf",
                format!(
                    "driver {} has no cuMemGetHandleForAddressRange (needs 11.7)",
                    driver::version_text(self.driver_version)
                ),
            ));
        }
        let ctx = self.context(device)?;
        if !ctx.dmabuf_supported {
            return Err(Error::not_available(
                "cuda dma-buf",
                format!("device {device} does not support dma-buf (open kernel module and Linux 5.12+ needed)"),
            ));
        }
        ctx.make_current()?;
        // The range handed to the driver must be page-aligned at both ends.
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let start = addr & !(page - 1);
        let end = (addr + len)
            .checked_next_multiple_of(page)
            .ok_or(Error::LengthOverflow { addr, len })?;
        let mut fd: std::ffi::c_int = -1;
        let handle_type = CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD;
        let fd_out: *mut c_void = (&mut fd as *mut std::ffi::c_int).cast();
        // SAFETY: the driver writes one int (the fd) and only looks the range up in its tables.
        let result =
            unsafe { sys::cuMemGetHandleForAddressRange(fd_out, start, (end - start) as usize, handle_type, 0) };
        if result == CUresult::CUDA_ERROR_NOT_SUPPORTED {
            return Err(Error::not_available(
                "cuda dma-buf",
                format!("cuMemGetHandleForAddressRange: {}", driver::describe(result)),
            ));
        }
        check(result, "cuMemGetHandleForAddressRange")?;
        if fd < 0 {
            return Err(Error::transport(
                NAME,
                "cuMemGetHandleForAddressRange returned no file descriptor",
            ));
        }
        Ok(DmaBufExport {
            // SAFETY: the driver just created this descriptor for us; nothing else owns it.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            offset: addr - start,
            len: end - start,
        })
    }
}

impl std::fmt::Debug for CudaPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaPlugin")
            .field("library", &self.library)
            .field("driver_version", &self.driver_version)
            .field("devices", &self.devices.len())
            .field("batch_memcpy", &self.batch_memcpy())
            .field("dmabuf_export", &self.dmabuf_export)
            .finish()
    }
}
