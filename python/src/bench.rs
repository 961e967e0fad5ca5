//! Rust loops over the same calls the Python benchmark (`python -m te.bench`) times, run in the
//! same process on the same engine, store and buffers: the difference is what Python adds.

use std::time::Instant;

use pyo3::prelude::*;
use te_base::{SegmentId, TransferRequest};
use umbp::{Range, RangedGet};

use crate::arrays::U64s;
use crate::engine::{PyEngine, PySegment};
use crate::errors::{invalid, IntoPyResult};
use crate::store::PyStore;

/// Times `iters` one-request writes (submit, then wait) from Rust: nanoseconds per call.
#[pyfunction]
fn rust_write_loop(
    py: Python<'_>,
    engine: &Bound<'_, PyEngine>,
    segment: &Bound<'_, PySegment>,
    local_addr: u64,
    remote_addr: u64,
    length: u64,
    iters: u64,
) -> PyResult<f64> {
    let engine = engine.get().engine.clone();
    let seg: SegmentId = segment.get().handle.id();
    let out = py.detach(move || -> te_base::Result<f64> {
        let t0 = Instant::now();
        for _ in 0..iters {
            let reqs = [TransferRequest::write(local_addr, seg, remote_addr, length)];
            let b = engine.submit(&reqs)?;
            b.wait_blocking(None).expect("no timeout")?;
        }
        Ok(t0.elapsed().as_nanos() as f64 / iters.max(1) as f64)
    });
    out.py()
}

/// Times `iters` calls of `batch_get_ranges` from Rust over the given ranges (grouped by key as
/// the Python call takes them): nanoseconds per call. Every key must be found.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rust_get_ranges_loop(
    py: Python<'_>,
    store: &Bound<'_, PyStore>,
    keys: Vec<String>,
    key_index: &Bound<'_, PyAny>,
    offsets: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
    addrs: &Bound<'_, PyAny>,
    iters: u64,
) -> PyResult<f64> {
    let copy = |o: &Bound<'_, PyAny>, what: &str| -> PyResult<Vec<u64>> {
        U64s::extract(o, what)?
            .as_slice()
            .map(<[u64]>::to_vec)
            .ok_or_else(|| invalid("InvalidArgument", format!("{what}: an array is needed here")))
    };
    let (ki, off, len, addr) = (
        copy(key_index, "key_index")?,
        copy(offsets, "offsets")?,
        copy(lengths, "lengths")?,
        copy(addrs, "addrs")?,
    );
    let store = store.get().store.clone();
    let out = py.detach(move || -> umbp::Result<f64> {
        let t0 = Instant::now();
        for _ in 0..iters {
            let ranges: Vec<Range> = off
                .iter()
                .zip(&len)
                .zip(&addr)
                .map(|((&o, &l), &a)| Range::new(o, l, a))
                .collect();
            let mut items: Vec<RangedGet<'_>> = Vec::with_capacity(keys.len());
            let mut start = 0;
            for i in 1..=ki.len() {
                if i == ki.len() || ki[i] != ki[start] {
                    items.push(RangedGet {
                        key: &keys[ki[start] as usize],
                        ranges: &ranges[start..i],
                    });
                    start = i;
                }
            }
            for r in store.batch_get_ranges(&items)? {
                r?;
            }
        }
        Ok(t0.elapsed().as_nanos() as f64 / iters.max(1) as f64)
    });
    out.py()
}

/// Registers the benchmark loops in the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rust_write_loop, m)?)?;
    m.add_function(wrap_pyfunction!(rust_get_ranges_loop, m)?)?;
    Ok(())
}
