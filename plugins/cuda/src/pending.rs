//! Completion of a batch of asynchronous copies: an event recorded on the device stream after the
//! batch's last copy.

use cudarc::driver::sys::{self, CUcontext, CUevent, CUevent_flags, CUresult, CUstream};
use te_base::device::PendingCopy;
use te_base::Result;

use crate::driver::check;

/// A recorded event; complete when every copy enqueued on the stream before it has finished.
pub(crate) struct CudaPendingCopy {
    ctx: CUcontext,
    /// None once waited on (or for an empty batch).
    event: Option<CUevent>,
}

// SAFETY: events are driver handles usable from any thread once their context is made current,
// which every method does first.
unsafe impl Send for CudaPendingCopy {}
// SAFETY: `is_complete` only queries the event; `wait` consumes the box.
unsafe impl Sync for CudaPendingCopy {}

impl CudaPendingCopy {
    /// A batch with nothing in it: complete from the start.
    pub(crate) fn done(ctx: CUcontext) -> Self {
        CudaPendingCopy { ctx, event: None }
    }

    /// Records a fresh event on `stream` (its context must be current).
    pub(crate) fn record(ctx: CUcontext, stream: CUstream) -> Result<Self> {
        let mut event: CUevent = std::ptr::null_mut();
        // Timing is disabled, which makes recording and querying cheaper.
        let flags = CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: the context is current; the driver writes the event handle.
        check(unsafe { sys::cuEventCreate(&mut event, flags) }, "cuEventCreate")?;
        let pending = CudaPendingCopy {
            ctx,
            event: Some(event),
        };
        // SAFETY: `event` was just created in this context and `stream` belongs to it.
        check(unsafe { sys::cuEventRecord(event, stream) }, "cuEventRecord")?;
        Ok(pending)
    }

    fn synchronize(&mut self) -> Result<()> {
        let Some(event) = self.event.take() else {
            return Ok(());
        };
        // SAFETY: `ctx` is the retained primary context the event was created in.
        let current = check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent");
        // SAFETY: `event` is a live event of this context; it is destroyed exactly once, here.
        let waited = check(
            unsafe { sys::cuEventSynchronize(event) },
            "cuEventSynchronize (copy batch)",
        );
        // SAFETY: as above; the event is complete (or failed) and is not used again.
        unsafe { sys::cuEventDestroy_v2(event) };
        current.and(waited)
    }
}

impl PendingCopy for CudaPendingCopy {
    fn is_complete(&self) -> Result<bool> {
        let Some(event) = self.event else {
            return Ok(true);
        };
        // SAFETY: `ctx` is the retained primary context of the event.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")?;
        // SAFETY: `event` is live until `synchronize` takes it, which needs `&mut self`.
        match unsafe { sys::cuEventQuery(event) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "cuEventQuery (copy batch)").map(|_| false),
        }
    }

    fn wait(mut self: Box<Self>) -> Result<()> {
        self.synchronize()
    }
}

impl Drop for CudaPendingCopy {
    fn drop(&mut self) {
        // Waiting here keeps the caller from freeing memory the device still reads or writes.
        if let Err(e) = self.synchronize() {
            tracing::warn!("dropped CUDA copy batch failed: {e}");
        }
    }
}
