//! Enqueuing a batch of copy fragments on a stream: one `cuMemcpyBatchAsync` call for the whole
//! batch where the driver has it (12.8+), otherwise one `cuMemcpy*Async` call per fragment with
//! the direction given explicitly, so the driver never has to look the pointers up.

use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUmemLocation, CUmemLocationType, CUmemcpyAttributes, CUmemcpySrcAccessOrder, CUstream,
};
use te_base::device::{CopyDirection, CopyFragment};
use te_base::{Error, Result};

use crate::driver::{check, describe, NAME};

/// Enqueues every fragment on `stream`.
///
/// # Safety
/// The stream's context is current; every fragment is validated and its memory is valid for the
/// kinds `direction` names until the stream has executed it; `device` is the device side's ordinal.
pub(crate) unsafe fn enqueue(
    stream: CUstream,
    device: u32,
    direction: CopyDirection,
    fragments: &[CopyFragment],
    batched: bool,
) -> Result<()> {
    if batched {
        // SAFETY: forwarded from the caller.
        return unsafe { enqueue_batched(stream, device, direction, fragments) };
    }
    for f in fragments {
        let len = f.len as usize;
        // SAFETY: forwarded from the caller; each call only enqueues a copy of valid memory.
        let result = unsafe {
            match direction {
                CopyDirection::HostToDevice => sys::cuMemcpyHtoDAsync_v2(f.dst, f.src as *const c_void, len, stream),
                CopyDirection::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(f.dst as *mut c_void, f.src, len, stream),
                CopyDirection::DeviceToDevice => sys::cuMemcpyDtoDAsync_v2(f.dst, f.src, len, stream),
            }
        };
        check(result, "cuMemcpyAsync")?;
    }
    Ok(())
}

/// One driver call for the whole batch. The arrays are built once per batch.
///
/// # Safety
/// As for [`enqueue`]; additionally the driver must export `cuMemcpyBatchAsync` (checked at load).
unsafe fn enqueue_batched(
    stream: CUstream,
    device: u32,
    direction: CopyDirection,
    fragments: &[CopyFragment],
) -> Result<()> {
    let mut dsts: Vec<u64> = fragments.iter().map(|f| f.dst).collect();
    let mut srcs: Vec<u64> = fragments.iter().map(|f| f.src).collect();
    let mut sizes: Vec<usize> = fragments.iter().map(|f| f.len as usize).collect();
    let host = CUmemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
        id: 0,
    };
    let gpu = CUmemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device as i32,
    };
    let (src_hint, dst_hint) = match direction {
        CopyDirection::HostToDevice => (host, gpu),
        CopyDirection::DeviceToHost => (gpu, host),
        CopyDirection::DeviceToDevice => (gpu, gpu),
    };
    // One attribute set for every copy: sources are read in stream order (the caller keeps them
    // valid until the batch completes), so the driver need not copy them at call time.
    let mut attrs = [CUmemcpyAttributes {
        srcAccessOrder: CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: src_hint,
        dstLocHint: dst_hint,
        flags: 0,
    }];
    let mut attr_index = [0usize];
    let mut fail_index = usize::MAX;
    // SAFETY: the three arrays have `fragments.len()` entries and live across the call; one
    // attribute applies from copy 0 on; the stream is non-blocking (never the legacy stream).
    let result = unsafe {
        sys::cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            fragments.len(),
            attrs.as_mut_ptr(),
            attr_index.as_mut_ptr(),
            1,
            &mut fail_index,
            stream,
        )
    };
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let which = if fail_index == usize::MAX {
        "the batch as a whole".to_string()
    } else {
        format!("fragment {fail_index}")
    };
    Err(Error::transport(
        NAME,
        format!(
            "cuMemcpyBatchAsync of {} fragment(s) ({direction}) failed at {which}: {}",
            fragments.len(),
            describe(result)
        ),
    ))
}
