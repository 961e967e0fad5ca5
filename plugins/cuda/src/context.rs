//! Per-device state: the device's primary context and one cached non-blocking stream.
//!
//! Created on first use of a device, so loading the plugin on an 8-GPU host does not create eight
//! contexts (hundreds of MiB of device memory each) for a process that uses one GPU.

use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdevice_attribute, CUstream, CUstream_flags};
use te_base::Result;

use crate::driver::check;

/// A device's primary context and the stream all of the plugin's copies on that device use.
#[derive(Debug)]
pub(crate) struct DeviceContext {
    pub(crate) ctx: CUcontext,
    pub(crate) stream: CUstream,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub(crate) dmabuf_supported: bool,
}

// SAFETY: a CUcontext and a CUstream are opaque driver handles that the driver allows any thread to
// use (a context is made current per thread before use; stream calls are thread-safe).
unsafe impl Send for DeviceContext {}
// SAFETY: as above; the struct is never mutated after creation.
unsafe impl Sync for DeviceContext {}

impl DeviceContext {
    /// Retains the primary context of `device` and creates its stream.
    ///
    /// The plugin lives for the whole process, so the context and stream are never released.
    pub(crate) fn create(device: CUdevice) -> Result<Self> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `device` came from cuDeviceGet; the driver writes the context handle.
        let result = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) };
        check(result, "cuDevicePrimaryCtxRetain")?;
        // SAFETY: `ctx` is the primary context just retained.
        check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
        let mut stream: CUstream = std::ptr::null_mut();
        // A non-blocking stream does not serialise with the legacy default stream of other code.
        let flags = CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: a context is current on this thread; the driver writes the stream handle.
        check(unsafe { sys::cuStreamCreate(&mut stream, flags) }, "cuStreamCreate")?;
        let mut dmabuf: std::ffi::c_int = 0;
        // SAFETY: plain attribute query into a local integer.
        let attr = unsafe {
            sys::cuDeviceGetAttribute(
                &mut dmabuf,
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                device,
            )
        };
        Ok(DeviceContext {
            ctx,
            stream,
            // Drivers older than the attribute answer CUDA_ERROR_INVALID_VALUE: no dma-buf then.
            dmabuf_supported: check(attr, "cuDeviceGetAttribute").is_ok() && dmabuf != 0,
        })
    }

    /// Makes the context current on the calling thread (thread-local; cheap, once per call).
    pub(crate) fn make_current(&self) -> Result<()> {
        // SAFETY: `ctx` is a retained primary context that is never released.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }
}
