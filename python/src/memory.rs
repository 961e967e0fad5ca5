//! Memory from Python objects, without copying: the buffer protocol (numpy arrays, bytearray,
//! memoryview, mmap), `__dlpack__` (torch, cupy, jax tensors, host or device) and
//! `__cuda_array_interface__`. Each gives an address, a length, a location and an [`Owner`] that
//! keeps the memory alive and is handed to the engine with the registration
//! (`register_raw_owned`), so the memory lives until the engine released the region, never
//! less, whatever Python collects meanwhile.

use std::cell::Cell;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use te_base::MemoryLocation;

use crate::errors::invalid;

/// Memory taken from a Python object.
pub struct Acquired {
    pub addr: u64,
    pub len: u64,
    pub location: MemoryLocation,
    pub owner: Owner,
}

/// Keeps an object's memory alive: the object itself and, for the buffer protocol, the
/// exported view (which also stops a bytearray from resizing). Dropped on whatever thread
/// releases the region (an engine task, usually), where the GIL is not held: both are then queued
/// and released under the GIL by a blocking-pool task (never on a runtime worker, which must not
/// wait for the GIL), or earlier by the next call into the package; `Registration.close()`
/// releases what its own deregistration dropped before it returns (`released_by_caller`).
pub struct Owner {
    object: Option<Py<PyAny>>,
    view: Option<View>,
}

/// A `Py_buffer` exported by an object, released with `PyBuffer_Release`.
struct View(Box<ffi::Py_buffer>);

// SAFETY: the view is only a record of an export; it is read nowhere, and released (the only
// operation) under the GIL by `release_pending`, whichever thread queued it.
unsafe impl Send for View {}
// SAFETY: as for `Send`: no thread reads it concurrently; `&View` gives access to nothing.
unsafe impl Sync for View {}

/// What a dropped owner leaves to release under the GIL.
struct Released {
    view: Option<View>,
    _object: Option<Py<PyAny>>,
}

static PENDING: Mutex<Vec<Released>> = Mutex::new(Vec::new());
static ANY_PENDING: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set on a thread whose caller calls [`release_pending`] itself once the engine call
    /// returns (see [`released_by_caller`]).
    static CALLER_RELEASES: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (an engine call, the GIL released) on this thread; owners it drops here are left for
/// the caller, which must call [`release_pending`] when it holds the GIL again, instead of being
/// handed to a blocking-pool thread. `Registration.close()` thus returns with the buffer view
/// released, and without starting a thread that competes with it for the GIL. Owners dropped
/// meanwhile on other threads still take the blocking-pool path.
pub fn released_by_caller<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            CALLER_RELEASES.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(CALLER_RELEASES.with(|c| c.replace(true)));
    f()
}

impl Owner {
    fn new(object: Py<PyAny>, view: Option<View>) -> Self {
        Owner {
            object: Some(object),
            view,
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        PENDING.lock().push(Released {
            view: self.view.take(),
            _object: self.object.take(),
        });
        // Anything already pending is released by whoever set the flag, or by this thread's
        // caller (`released_by_caller`), which takes every queued owner.
        if !ANY_PENDING.swap(true, Ordering::AcqRel) && !CALLER_RELEASES.with(Cell::get) {
            // Nothing to do once the interpreter is exiting (the process is ending; the views go
            // with it): see `attach_from_runtime`.
            crate::runtime::runtime().spawn_blocking(|| crate::runtime::attach_from_runtime(release_pending));
        }
    }
}

/// Releases the buffer views and object references of regions the engine let go of. One
/// atomic load when none is waiting.
pub fn release_pending(_py: Python<'_>) {
    if !ANY_PENDING.load(Ordering::Acquire) {
        return;
    }
    let released = {
        let mut p = PENDING.lock();
        ANY_PENDING.store(false, Ordering::Release);
        std::mem::take(&mut *p)
    };
    for mut r in released {
        if let Some(mut v) = r.view.take() {
            // SAFETY: `v` was filled by a successful `PyObject_GetBuffer` and is released exactly
            // once, here, with the GIL held (the `_py` token).
            unsafe { ffi::PyBuffer_Release(&mut *v.0) };
        }
        // The object reference drops here, with the GIL held.
    }
}

/// Parses `device` ("host", "cuda:0", "rocm:1", ...) into a location.
pub fn parse_location(device: &str) -> PyResult<MemoryLocation> {
    device
        .parse::<MemoryLocation>()
        .map_err(|e| invalid("InvalidArgument", e))
}

/// Takes memory from `obj`: the buffer protocol first, then `__dlpack__`, then
/// `__cuda_array_interface__`. `device` overrides the location where the object cannot say.
pub fn acquire(obj: &Bound<'_, PyAny>, device: Option<MemoryLocation>) -> PyResult<Acquired> {
    // SAFETY: `obj` is a live object and we hold the GIL (the `Bound` token).
    if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 1 {
        return from_buffer(obj, device);
    }
    if obj.hasattr("__dlpack__")? {
        return from_dlpack(obj, device);
    }
    if obj.hasattr("__cuda_array_interface__")? {
        return from_cuda_array_interface(obj, device);
    }
    Err(invalid(
        "DtypeError",
        format!(
            "cannot register a {}: it exposes neither the buffer protocol, __dlpack__ nor __cuda_array_interface__ \
             (use register_ptr for raw memory)",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ),
    ))
}

fn from_buffer(obj: &Bound<'_, PyAny>, device: Option<MemoryLocation>) -> PyResult<Acquired> {
    // SAFETY: a zeroed Py_buffer is the documented initial state for PyObject_GetBuffer.
    let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
    // Strides and format, read-only allowed: the checks below then name what is wrong instead of
    // the exporter's generic refusal.
    // SAFETY: `obj` is live, the GIL is held, `view` points to writable storage.
    let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, ffi::PyBUF_RECORDS_RO) };
    if rc != 0 {
        return Err(PyErr::fetch(obj.py()));
    }
    let release = |mut view: Box<ffi::Py_buffer>| {
        // SAFETY: the view was filled by the successful call above; released once.
        unsafe { ffi::PyBuffer_Release(&mut *view) };
    };
    if view.readonly != 0 {
        release(view);
        return Err(invalid(
            "ReadOnlyBufferError",
            "the buffer is read-only: registered memory may be written by transfers (pass a writable array)",
        ));
    }
    // SAFETY: `view` is a filled buffer view; the call only reads it.
    let contiguous = unsafe { ffi::PyBuffer_IsContiguous(&*view, b'A' as std::os::raw::c_char) } == 1;
    if !contiguous {
        release(view);
        return Err(invalid(
            "NotContiguousError",
            "the buffer is not contiguous: register the array it is a view of, or a contiguous copy",
        ));
    }
    let objects = !view.format.is_null() && {
        // SAFETY: with PyBUF_FORMAT requested, a non-null `format` is a NUL-terminated string the
        // exporter keeps alive until the view is released (below, or by the owner).
        holds_objects(unsafe { CStr::from_ptr(view.format) }.to_bytes())
    };
    if objects {
        release(view);
        return Err(invalid(
            "DtypeError",
            "the buffer holds Python object references (dtype=object): their storage is pointers the \
             interpreter owns, not data; register an array of a numeric dtype",
        ));
    }
    let len = view.len as u64;
    let addr = view.buf as u64;
    if len == 0 {
        release(view);
        return Err(invalid("InvalidArgument", "the buffer is empty: nothing to register"));
    }
    Ok(Acquired {
        addr,
        len,
        location: device.unwrap_or(MemoryLocation::HOST),
        owner: Owner::new(obj.clone().unbind(), Some(View(view))),
    })
}

/// True when a buffer-protocol format string (the `struct` module's syntax, as numpy writes it)
/// has an object-reference item (`O`), field names (`:name:`) aside.
fn holds_objects(format: &[u8]) -> bool {
    let mut in_name = false;
    format.iter().any(|&c| {
        if c == b':' {
            in_name = !in_name;
        }
        !in_name && c == b'O'
    })
}

/// The DLPack C structures (dlpack.h, v0.8 "legacy" capsule, which every producer still emits
/// when `__dlpack__` is called without `max_version`).
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;
const DL_ROCM: i32 = 10;
const DL_ROCM_HOST: i32 = 11;
const DL_CUDA_MANAGED: i32 = 13;

fn from_dlpack(obj: &Bound<'_, PyAny>, device: Option<MemoryLocation>) -> PyResult<Acquired> {
    let capsule = obj.call_method0("__dlpack__")?;
    let name: &CStr = c"dltensor";
    // SAFETY: GIL held; PyCapsule_GetPointer checks the type and name and returns NULL (with an
    // exception set) on mismatch.
    let ptr = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), name.as_ptr()) } as *const DlManagedTensor;
    if ptr.is_null() {
        return Err(PyErr::take(obj.py())
            .unwrap_or_else(|| invalid("InvalidArgument", "__dlpack__ did not return a 'dltensor' capsule")));
    }
    // SAFETY: a live "dltensor" capsule holds a valid DLManagedTensor until the capsule is
    // destroyed; we keep the capsule (the owner below) and read the tensor only here.
    let t = unsafe { &(*ptr).dl_tensor };
    if t.ndim < 0 || (t.ndim > 0 && t.shape.is_null()) {
        return Err(invalid("InvalidArgument", "__dlpack__ gave a tensor without a shape"));
    }
    let ndim = t.ndim as usize;
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: a non-null shape points to `ndim` int64 values (dlpack.h), alive with the capsule.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let elem_bits = u64::from(t.dtype.bits) * u64::from(t.dtype.lanes);
    if elem_bits == 0 || elem_bits % 8 != 0 {
        return Err(invalid(
            "DtypeError",
            format!("__dlpack__ tensor has {elem_bits}-bit elements; only whole bytes can be registered"),
        ));
    }
    let mut count: u64 = 1;
    for &d in shape {
        if d < 0 {
            return Err(invalid("InvalidArgument", "__dlpack__ tensor has a negative dimension"));
        }
        count = count
            .checked_mul(d as u64)
            .ok_or_else(|| invalid("InvalidArgument", "__dlpack__ tensor size overflows"))?;
    }
    if !t.strides.is_null() && count > 1 {
        // SAFETY: as for shape.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut expect: i64 = 1;
        for i in (0..ndim).rev() {
            if shape[i] != 1 && strides[i] != expect {
                return Err(invalid(
                    "NotContiguousError",
                    "the tensor is not contiguous: register the tensor it is a view of, or .contiguous()",
                ));
            }
            expect = expect.saturating_mul(shape[i]);
        }
    }
    let len = count * (elem_bits / 8);
    if len == 0 {
        return Err(invalid("InvalidArgument", "the tensor is empty: nothing to register"));
    }
    let addr = (t.data as u64).wrapping_add(t.byte_offset);
    let ordinal = u32::try_from(t.device.device_id)
        .map_err(|_| invalid("InvalidArgument", "__dlpack__ tensor has a negative device id"))?;
    let found = match t.device.device_type {
        DL_CPU | DL_CUDA_HOST | DL_ROCM_HOST => MemoryLocation::HOST,
        DL_CUDA | DL_CUDA_MANAGED => MemoryLocation::Cuda { device: ordinal },
        DL_ROCM => MemoryLocation::Rocm { device: ordinal },
        other => {
            return Err(invalid(
                "InvalidArgument",
                format!("__dlpack__ tensor lives on DLPack device type {other}, which the engine cannot register"),
            ))
        }
    };
    if let Some(d) = device {
        if d.kind() != found.kind() {
            return Err(invalid(
                "InvalidArgument",
                format!("device={d} but the tensor says it lives in {found} memory"),
            ));
        }
    }
    // Keep the object and the unconsumed capsule: its destructor frees the managed tensor when
    // the last reference goes, which is after the engine released the region.
    let keep = PyTuple::new(obj.py(), [obj.clone(), capsule])?;
    Ok(Acquired {
        addr,
        len,
        location: device.unwrap_or(found),
        owner: Owner::new(keep.into_any().unbind(), None),
    })
}

fn from_cuda_array_interface(obj: &Bound<'_, PyAny>, device: Option<MemoryLocation>) -> PyResult<Acquired> {
    let cai = obj.getattr("__cuda_array_interface__")?;
    let cai = cai
        .cast::<PyDict>()
        .map_err(|_| invalid("InvalidArgument", "__cuda_array_interface__ is not a dict"))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        cai.get_item(k)?
            .ok_or_else(|| invalid("InvalidArgument", format!("__cuda_array_interface__ has no '{k}'")))
    };
    let (ptr, readonly): (u64, bool) = get("data")?.extract()?;
    if readonly {
        return Err(invalid(
            "ReadOnlyBufferError",
            "the array is read-only (__cuda_array_interface__ data[1] is True)",
        ));
    }
    let shape: Vec<u64> = get("shape")?.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    let itemsize: u64 = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| invalid("DtypeError", format!("unknown typestr {typestr:?}")))?;
    let count = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    let count = count.ok_or_else(|| invalid("InvalidArgument", "array size overflows"))?;
    if let Some(strides) = cai.get_item("strides")?.filter(|s| !s.is_none()) {
        let strides: Vec<u64> = strides.extract()?;
        let mut expect = itemsize;
        for i in (0..shape.len()).rev() {
            if shape[i] != 1 && strides[i] != expect {
                return Err(invalid("NotContiguousError", "the array is not C-contiguous"));
            }
            expect = expect.saturating_mul(shape[i]);
        }
    }
    let len = count * itemsize;
    if len == 0 || ptr == 0 {
        return Err(invalid("InvalidArgument", "the array is empty: nothing to register"));
    }
    // The interface does not say which device: the caller's `device`, else the object's own
    // `.device.index` (torch) or `.device.id` (cupy).
    let location = match device {
        Some(d) => d,
        None => {
            let dev = obj.getattr("device").ok();
            let ordinal = dev.as_ref().and_then(|d| {
                d.getattr("index")
                    .ok()
                    .and_then(|i| i.extract::<u32>().ok())
                    .or_else(|| d.getattr("id").ok().and_then(|i| i.extract::<u32>().ok()))
            });
            match ordinal {
                Some(device) => MemoryLocation::Cuda { device },
                None => {
                    return Err(invalid(
                        "InvalidArgument",
                        "__cuda_array_interface__ does not name the device: pass device='cuda:N'",
                    ))
                }
            }
        }
    };
    Ok(Acquired {
        addr: ptr,
        len,
        location,
        owner: Owner::new(obj.clone().unbind(), None),
    })
}
