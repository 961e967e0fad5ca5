//! What `te.compat` (the Mooncake / mori drop-in modules) needs from Rust: Python lists of
//! addresses turned into one 8-byte array per call. Code written against Mooncake passes lists;
//! converting them element by element in Python costs more than the layer's whole per-address
//! budget, while the native calls keep refusing lists (one Python object per request is what
//! they are built to avoid).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::errors::invalid;

/// `array.array('Q')` holding the list's values (each a 64-bit unsigned int, else
/// `te.InvalidArgument` naming its index), made in one pass.
#[pyfunction]
fn u64_array<'py>(py: Python<'py>, values: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyAny>> {
    let mut out: Vec<u8> = Vec::with_capacity(values.len() * 8);
    for (i, item) in values.iter().enumerate() {
        let v: u64 = item.extract().map_err(|_| {
            invalid(
                "InvalidArgument",
                format!("[{i}]: {item} is not a 64-bit unsigned integer"),
            )
        })?;
        out.extend_from_slice(&v.to_ne_bytes());
    }
    py.import("array")?
        .getattr("array")?
        .call1(("Q", PyBytes::new(py, &out)))
}

pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(u64_array, m)?)
}
