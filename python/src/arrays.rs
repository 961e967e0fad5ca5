//! Request arrays from Python without a Python object per element: a 1-D contiguous array of
//! 8-byte integers (numpy `uint64` / `int64`, `array.array('Q')`, any buffer-protocol exporter)
//! read in place, or a single `int` that applies to every request.

use std::ffi::CStr;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyInt;

use crate::errors::invalid;

/// One argument of a batched call: an array read in place, or one value for every request.
pub enum U64s {
    Scalar(u64),
    Array(ArrayView),
}

/// A borrowed buffer of `len` 8-byte integers, released when dropped (with the GIL held: the
/// type is not `Send`, so it never leaves the calling thread's GIL scope).
pub struct ArrayView {
    view: Box<ffi::Py_buffer>,
    ptr: *const u64,
    len: usize,
}

impl Drop for ArrayView {
    fn drop(&mut self) {
        // SAFETY: filled by a successful PyObject_GetBuffer in `U64s::extract`, released once; the
        // GIL is held (ArrayView is !Send and lives inside a GIL-holding call).
        unsafe { ffi::PyBuffer_Release(&mut *self.view) };
    }
}

impl U64s {
    /// Reads argument `what` (named in errors) from `obj`.
    pub fn extract(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<U64s> {
        if let Ok(i) = obj.cast::<PyInt>() {
            let v: u64 = i.extract().map_err(|_| {
                invalid(
                    "InvalidArgument",
                    format!("{what}: {i} is not a 64-bit unsigned integer"),
                )
            })?;
            return Ok(U64s::Scalar(v));
        }
        // SAFETY: `obj` is live and the GIL is held.
        if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 1 {
            return Err(invalid(
                "DtypeError",
                format!(
                    "{what}: expected an int or a 1-D numpy array of uint64, got {}",
                    obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                ),
            ));
        }
        // SAFETY: the zeroed Py_buffer is PyObject_GetBuffer's expected initial state.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: `obj` is live, GIL held, `view` is writable storage.
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, ffi::PyBUF_RECORDS_RO) } != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        let ptr = view.buf as *const u64;
        let mut out = ArrayView { view, ptr, len: 0 };
        let v = &out.view;
        let format = if v.format.is_null() {
            "B".to_string()
        } else {
            // SAFETY: a non-null format is a NUL-terminated string owned by the view.
            unsafe { CStr::from_ptr(v.format) }.to_string_lossy().into_owned()
        };
        let code = format.trim_start_matches(['@', '=', '<', '!']);
        let eight_byte_int = v.itemsize == 8 && matches!(code, "Q" | "L" | "q" | "l" | "N" | "n");
        if !eight_byte_int {
            return Err(invalid(
                "DtypeError",
                format!(
                    "{what}: expected 8-byte integers (numpy uint64), got format {format:?} with {}-byte items",
                    v.itemsize
                ),
            ));
        }
        if v.ndim != 1 {
            return Err(invalid(
                "ShapeError",
                format!("{what}: expected a 1-D array, got {} dimensions", v.ndim),
            ));
        }
        // SAFETY: ndim is 1, so strides (requested by PyBUF_RECORDS_RO) and shape hold one value.
        let (stride, n) = unsafe { (*v.strides, *v.shape) };
        if stride != 8 && n > 1 {
            return Err(invalid(
                "NotContiguousError",
                format!("{what}: the array is not contiguous (stride {stride} bytes); pass np.ascontiguousarray(...)"),
            ));
        }
        if !(ptr as usize).is_multiple_of(std::mem::align_of::<u64>()) {
            return Err(invalid(
                "InvalidArgument",
                format!("{what}: the array is not 8-byte aligned"),
            ));
        }
        out.len = n as usize;
        Ok(U64s::Array(out))
    }

    /// The number of values, `None` for a scalar.
    pub fn count(&self) -> Option<usize> {
        match self {
            U64s::Scalar(_) => None,
            U64s::Array(a) => Some(a.len),
        }
    }

    /// The values, for `n` requests (a scalar repeats; an array's length was checked).
    pub fn get(&self, i: usize) -> u64 {
        match self {
            U64s::Scalar(v) => *v,
            // SAFETY: callers index below the array's checked length; the view keeps it mapped.
            U64s::Array(a) => unsafe { *a.ptr.add(i) },
        }
    }

    /// The array as a slice (None for a scalar).
    pub fn as_slice(&self) -> Option<&[u64]> {
        match self {
            U64s::Scalar(_) => None,
            // SAFETY: `len` aligned u64 values at `ptr`, kept alive by the view for `&self`'s life.
            U64s::Array(a) => Some(unsafe { std::slice::from_raw_parts(a.ptr, a.len) }),
        }
    }
}

/// The common request count of several arguments: every array has the same length; scalars
/// repeat; all scalars make one request.
pub fn common_len(args: &[(&U64s, &str)]) -> PyResult<usize> {
    let mut n: Option<(usize, &str)> = None;
    for (a, name) in args {
        if let Some(c) = a.count() {
            match n {
                None => n = Some((c, name)),
                Some((m, first)) if m != c => {
                    return Err(invalid(
                        "ShapeError",
                        format!("{first} has {m} values but {name} has {c}: the arrays must have one length"),
                    ))
                }
                _ => {}
            }
        }
    }
    Ok(n.map(|(c, _)| c).unwrap_or(1))
}
