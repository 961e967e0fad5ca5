//! What `te.compat` (the Mooncake / mori drop-in modules) needs from Rust: a connector's Python
//! lists of addresses and lengths turned into 8-byte integers in one pass each. Code written
//! against Mooncake passes lists; converting them element by element in Python costs more than
//! the layer's per-address budget, while the native calls keep refusing lists (one Python object
//! per request is what they are built to avoid).

use std::os::raw::c_ulong;
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::errors::invalid;

// `unsigned long` holds a u64 on the LP64 targets the wheel is built for.
const _: () = assert!(std::mem::size_of::<c_ulong>() == 8);

/// How the running CPython lays out an `int` (its `PyLongObject`), for the versions whose
/// layout is known (3.11 to 3.13); `None` elsewhere (then every value goes through the C API).
/// On those versions a list (`PyListObject`) is the variable-size header, then `ob_item`, the
/// pointer to its items.
#[derive(Clone, Copy)]
enum IntLayout {
    /// 3.11: `ob_size` after the object header (its sign the number's, its magnitude the
    /// digit count), then 30-bit digits in `uint32_t`s, least significant first.
    SignedSize,
    /// 3.12 and 3.13: `lv_tag` after the header (bits 0-1 the sign: 0 positive, 1 zero,
    /// 2 negative; the digit count from bit 3 up), then the same digits.
    Tagged,
}

fn int_layout(py: Python<'_>) -> Option<IntLayout> {
    static LAYOUT: OnceLock<Option<IntLayout>> = OnceLock::new();
    *LAYOUT.get_or_init(|| {
        // The digits read below are 30 bits in 4 bytes, CPython's default; a build configured
        // with 15-bit digits (`--enable-big-digits=15`) goes through the C API.
        let digits_as_read = py
            .import("sys")
            .and_then(|sys| sys.getattr("int_info"))
            .and_then(|i| {
                Ok((
                    i.getattr("bits_per_digit")?.extract::<u32>()?,
                    i.getattr("sizeof_digit")?.extract::<u32>()?,
                ))
            })
            .is_ok_and(|d| d == (30, 4));
        let v = py.version_info();
        match (v.major, v.minor) {
            _ if !digits_as_read => None,
            (3, 11) => Some(IntLayout::SignedSize),
            (3, 12 | 13) => Some(IntLayout::Tagged),
            _ => None,
        }
    })
}

/// The value of an exact `int` of up to two 30-bit digits, read from the object itself (what
/// `PyLong_AsUnsignedLong` computes, without the call); `None` for anything else (a negative
/// or larger int, an int subclass, another type), which the caller hands to the C API.
///
/// # Safety
/// `item` is a live object and the GIL is held.
#[inline]
unsafe fn small_int(item: *mut ffi::PyObject, layout: IntLayout) -> Option<u64> {
    // SAFETY: `item` is live (caller); its type pointer is part of every object's header.
    if unsafe { ffi::PyLong_CheckExact(item) } == 0 {
        return None;
    }
    // The header is `ob_refcnt`, `ob_type` (on the 64-bit non-free-threaded builds an abi3
    // extension loads into); the size or tag word follows it, then the digits.
    const SIZE_AT: usize = 2 * std::mem::size_of::<usize>();
    const DIGITS_AT: usize = SIZE_AT + std::mem::size_of::<usize>();
    let base = item.cast::<u8>();
    // SAFETY: an exact int of this CPython version has this layout (`int_layout` matched the
    // version), so the word at SIZE_AT is initialised and inside the object.
    let word = unsafe { base.add(SIZE_AT).cast::<isize>().read() };
    let digits = match layout {
        IntLayout::SignedSize if word >= 0 => word as usize,
        IntLayout::Tagged if word & 3 == 1 => 0,
        IntLayout::Tagged if word & 3 == 0 => (word as usize) >> 3,
        _ => return None,
    };
    let digit = |i: usize| {
        // SAFETY: called for i below the object's digit count: those digits are allocated.
        u64::from(unsafe { base.add(DIGITS_AT + 4 * i).cast::<u32>().read() })
    };
    match digits {
        0 => Some(0),
        1 => Some(digit(0)),
        2 => Some(digit(0) | digit(1) << 30),
        _ => None,
    }
}

/// Writes `list`'s values into `out` (8 native-endian bytes each; `out` holds exactly the list's
/// length). `which` (the list's position among several) is named in the error of a value that
/// is not a 64-bit unsigned int.
///
/// An item that is the same object as the item before it (a connector's `[block_len] * n`, or
/// one `block_len` appended per block) reuses its value: a pointer comparison instead of a
/// conversion.
fn read_list(py: Python<'_>, list: &Bound<'_, PyList>, out: &mut [u8], which: Option<usize>) -> PyResult<()> {
    let mut prev: (*mut ffi::PyObject, u64) = (std::ptr::null_mut(), 0);
    let layout = int_layout(py);
    let n = out.len() / 8;
    // The list's item array, read in place where the layout is known (the list is exactly a
    // `list`, not a subclass, and holds `n` items).
    let items: Option<*const *mut ffi::PyObject> = match layout {
        // SAFETY: `list` is live and the GIL is held.
        Some(_) if unsafe { ffi::PyList_CheckExact(list.as_ptr()) } != 0 && list.len() == n => {
            // SAFETY: on these versions `ob_item` follows the 3-word variable-size header.
            Some(unsafe {
                list.as_ptr()
                    .cast::<u8>()
                    .add(3 * std::mem::size_of::<usize>())
                    .cast::<*const *mut ffi::PyObject>()
                    .read()
            })
        }
        _ => None,
    };
    for (i, slot) in out.chunks_exact_mut(8).enumerate() {
        // The GIL is held and no Python code runs in this loop (the conversion below calls no
        // `__index__`), so the list keeps its length and its item array.
        let item = match items {
            // SAFETY: `i < n`, the list's length: inside its item array (see above).
            Some(a) => unsafe { a.add(i).read() },
            // SAFETY: `list` is live, the GIL held; an index past the end returns NULL, handled
            // below.
            None => unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) },
        };
        let v = if !item.is_null() && item == prev.0 {
            Some(prev.1)
        } else if item.is_null() {
            None
        // SAFETY: `item` is a borrowed reference checked non-null; the GIL is held.
        } else if let Some(v) = layout.and_then(|l| unsafe { small_int(item, l) }) {
            prev = (item, v);
            Some(v)
        } else {
            // The `unsigned long` call: CPython 3.11's `unsigned long long` one goes through a
            // byte-array conversion, several times slower per value. It takes ints (and their
            // subclasses) only, so no `__index__` (Python code) runs here.
            // SAFETY: `item` is a borrowed reference checked non-null; the GIL is held.
            let v = unsafe { ffi::PyLong_AsUnsignedLong(item) } as u64;
            // SAFETY: the GIL is held.
            if v != u64::MAX || unsafe { ffi::PyErr_Occurred() }.is_null() {
                prev = (item, v);
                Some(v)
            } else {
                None
            }
        };
        match v {
            Some(v) => slot.copy_from_slice(&v.to_ne_bytes()),
            None => {
                drop(PyErr::take(py));
                return Err(invalid(
                    "InvalidArgument",
                    match which {
                        Some(j) => format!("list {j}[{i}]: not a 64-bit unsigned integer"),
                        None => format!("[{i}]: not a 64-bit unsigned integer"),
                    },
                ));
            }
        }
    }
    Ok(())
}

/// The list's values as native-endian u64s in one `bytes` (`memoryview(b).cast("Q")` reads
/// them as an array); a value that is not a 64-bit unsigned int raises `te.InvalidArgument`
/// naming its index.
#[pyfunction]
fn u64_bytes<'py>(py: Python<'py>, values: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, values.len() * 8, |buf| read_list(py, values, buf, None))
}

/// Several lists of one length `n` as native-endian u64s in one `bytes`: list `j`'s values at
/// `[j * n, (j + 1) * n)` of `memoryview(b).cast("Q")`, so a connector's three lists (local
/// addresses, remote addresses, lengths) become three arrays with one call and one allocation.
/// Lists of different lengths raise `te.ShapeError`; a value that is not a 64-bit unsigned int
/// raises `te.InvalidArgument` naming its list and index.
#[pyfunction]
#[pyo3(signature = (*lists))]
fn u64_lists<'py>(py: Python<'py>, lists: &Bound<'py, PyTuple>) -> PyResult<Bound<'py, PyBytes>> {
    let lists: Vec<Bound<'py, PyList>> = lists
        .iter()
        .enumerate()
        .map(|(j, l)| {
            l.cast_into::<PyList>()
                .map_err(|_| invalid("InvalidArgument", format!("list {j}: expected a list")))
        })
        .collect::<PyResult<_>>()?;
    let n = lists.first().map_or(0, |l| l.len());
    if let Some((j, l)) = lists.iter().enumerate().find(|(_, l)| l.len() != n) {
        return Err(invalid(
            "ShapeError",
            format!(
                "list 0 has {n} values but list {j} has {}: the lists must have one length",
                l.len()
            ),
        ));
    }
    PyBytes::new_with(py, lists.len() * n * 8, |buf| {
        if n == 0 {
            return Ok(());
        }
        for (j, (list, out)) in lists.iter().zip(buf.chunks_exact_mut(n * 8)).enumerate() {
            read_list(py, list, out, Some(j))?;
        }
        Ok(())
    })
}

pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(u64_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(u64_lists, m)?)
}
