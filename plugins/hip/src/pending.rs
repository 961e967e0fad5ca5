//! Completion of a batch of asynchronous copies: an event recorded on the device stream after the
//! batch's last copy.

use std::sync::Arc;

use te_base::device::PendingCopy;
use te_base::Result;

use crate::api::{Handle, HipApi, EVENT_DISABLE_TIMING, HIP_ERROR_NOT_READY, HIP_SUCCESS};

/// A recorded event; complete when every copy enqueued on the stream before it has finished.
pub(crate) struct HipPendingCopy {
    api: Arc<HipApi>,
    /// None once waited on (or for an empty batch).
    event: Option<Handle>,
}

// SAFETY: HIP events are runtime handles that any thread may query, synchronise and destroy.
unsafe impl Send for HipPendingCopy {}
// SAFETY: `is_complete` only queries the event; `wait` consumes the box.
unsafe impl Sync for HipPendingCopy {}

impl HipPendingCopy {
    /// A batch with nothing in it: complete from the start.
    pub(crate) fn done(api: Arc<HipApi>) -> Self {
        HipPendingCopy { api, event: None }
    }

    /// Records a fresh event on `stream`; the stream's device must be current.
    pub(crate) fn record(api: Arc<HipApi>, stream: Handle) -> Result<Self> {
        let mut event: Handle = std::ptr::null_mut();
        // SAFETY: the runtime writes the event handle into the local.
        let created = unsafe { (api.event_create_with_flags)(&mut event, EVENT_DISABLE_TIMING) };
        api.check(created, "hipEventCreateWithFlags")?;
        let pending = HipPendingCopy {
            api,
            event: Some(event),
        };
        // SAFETY: `event` was just created on the current device, which owns `stream`.
        let recorded = unsafe { (pending.api.event_record)(event, stream) };
        pending.api.check(recorded, "hipEventRecord")?;
        Ok(pending)
    }

    fn synchronize(&mut self) -> Result<()> {
        let Some(event) = self.event.take() else {
            return Ok(());
        };
        // SAFETY: `event` is live; it is destroyed exactly once, right after.
        let waited = unsafe { (self.api.event_synchronize)(event) };
        // SAFETY: as above; the event is not used again.
        unsafe { (self.api.event_destroy)(event) };
        self.api.check(waited, "hipEventSynchronize (copy batch)")
    }
}

impl PendingCopy for HipPendingCopy {
    fn is_complete(&self) -> Result<bool> {
        let Some(event) = self.event else {
            return Ok(true);
        };
        // SAFETY: `event` is live until `synchronize` takes it, which needs `&mut self`.
        match unsafe { (self.api.event_query)(event) } {
            HIP_SUCCESS => Ok(true),
            HIP_ERROR_NOT_READY => Ok(false),
            other => self.api.check(other, "hipEventQuery (copy batch)").map(|_| false),
        }
    }

    fn wait(mut self: Box<Self>) -> Result<()> {
        self.synchronize()
    }
}

impl Drop for HipPendingCopy {
    fn drop(&mut self) {
        // Waiting here keeps the caller from freeing memory the device still reads or writes.
        if let Err(e) = self.synchronize() {
            tracing::warn!("dropped HIP copy batch failed: {e}");
        }
    }
}
