//! What `te.compat` (the Mooncake / mori drop-in modules) needs from Rust: a Python list of
//! addresses turned into 8-byte integers in one pass. Code written against Mooncake passes
//! lists; converting them element by element in Python costs more than the layer's per-address
//! budget, while the native calls keep refusing lists (one Python object per request is what
//! they are built to avoid).

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::errors::invalid;

// `unsigned long` holds a u64 on the LP64 targets the wheel is built for.
const _: () = assert!(std::mem::size_of::<std::os::raw::c_ulong>() == 8);

/// The list's values as native-endian u64s in one `bytes` (`memoryview(b).cast("Q")` reads
/// them as an array); a value that is not a 64-bit unsigned int raises `te.InvalidArgument`
/// naming its index.
#[pyfunction]
fn u64_bytes<'py>(py: Python<'py>, values: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyBytes>> {
    let n = values.len();
    PyBytes::new_with(py, n * 8, |buf| {
        for (i, out) in buf.chunks_exact_mut(8).enumerate() {
            // SAFETY: the GIL is held and no Python code runs in this loop (PyLong conversion of
            // an int runs none), so the list keeps its length; a missing item returns NULL.
            let item = unsafe { ffi::PyList_GetItem(values.as_ptr(), i as ffi::Py_ssize_t) };
            let v = if item.is_null() {
                None
            } else {
                // The `unsigned long` call: CPython 3.11's `unsigned long long` one goes through a
                // byte-array conversion, several times slower per value.
                // SAFETY: `item` is a borrowed reference checked non-null; the GIL is held.
                Some(unsafe { ffi::PyLong_AsUnsignedLong(item) } as u64)
            };
            match v {
                // SAFETY: the GIL is held.
                Some(v) if v != u64::MAX || unsafe { ffi::PyErr_Occurred() }.is_null() => {
                    out.copy_from_slice(&v.to_ne_bytes())
                }
                _ => {
                    drop(PyErr::take(py));
                    return Err(invalid(
                        "InvalidArgument",
                        format!("[{i}]: not a 64-bit unsigned integer"),
                    ));
                }
            }
        }
        Ok(())
    })
}

pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(u64_bytes, m)?)
}
