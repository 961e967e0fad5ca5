//! The one tokio runtime of the package: the engines' transports and background tasks run on
//! it, blocking calls wait on it with the GIL released, and asyncio awaitables (through
//! pyo3-async-runtimes) resolve on it.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use te_base::{Batch, BatchReport};

use crate::errors::{invalid, IntoPyResult};

static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

/// The package's runtime (built on first use; worker threads: the cores, at most 4).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    RUNTIME.get_or_init(|| {
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 4);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("te-py")
            .enable_all()
            .build()
            .expect("building the tokio runtime");
        rt
    })
}

/// Runs `fut` to completion on the runtime from a thread that is not one of its workers (the
/// caller released the GIL).
pub fn block_on<F: Future>(fut: F) -> F::Output {
    runtime().block_on(fut)
}

/// Waits for a batch with the GIL released, in slices of 50 ms so signals (Ctrl-C) are seen. An
/// already complete batch returns without releasing the GIL.
pub fn wait_batch(py: Python<'_>, batch: &Batch, timeout: Option<f64>) -> PyResult<BatchReport> {
    if batch.is_complete() {
        return batch.wait_blocking(None).expect("complete").py();
    }
    let limit = match timeout {
        None => None,
        Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t)),
        Some(t) => return Err(invalid("InvalidArgument", format!("timeout={t}: must be >= 0 seconds"))),
    };
    let started = std::time::Instant::now();
    loop {
        let slice = match limit {
            Some(l) => match l.checked_sub(started.elapsed()) {
                Some(left) if !left.is_zero() => left.min(Duration::from_millis(50)),
                _ => {
                    return Err(invalid(
                        "WaitTimeoutError",
                        format!(
                            "the batch was still running after {:.3} s (it keeps running)",
                            l.as_secs_f64()
                        ),
                    ))
                }
            },
            None => Duration::from_millis(50),
        };
        if let Some(out) = py.detach(|| batch.wait_blocking(Some(slice))) {
            return out.py();
        }
        py.check_signals()?;
    }
}

/// Threads of the runtime that are taking (or hold) the GIL to hand something to Python.
static ATTACHING: AtomicUsize = AtomicUsize::new(0);
/// Set by the interpreter's exit hook: from then on no runtime thread takes the GIL.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Runs `f` with the GIL from one of the runtime's threads, unless the interpreter is exiting
/// (then `None`, and what `f` would have released is left to the process's end). A thread still
/// waiting for the GIL when the interpreter finalizes is ended by CPython with a forced unwind,
/// which Rust frames cannot survive (a crash at exit); the exit hook below waits for every such
/// thread to be done before finalization starts, and no new one starts after it.
pub fn attach_from_runtime<R>(f: impl FnOnce(Python<'_>) -> R) -> Option<R> {
    ATTACHING.fetch_add(1, Ordering::AcqRel);
    let out = if EXITING.load(Ordering::Acquire) {
        None
    } else {
        Python::try_attach(f)
    };
    ATTACHING.fetch_sub(1, Ordering::AcqRel);
    out
}

/// The interpreter's exit hook (`atexit`): stops runtime threads from taking the GIL and lets
/// those already waiting for it finish, with the GIL released, for at most a second.
#[pyfunction]
pub fn _at_exit(py: Python<'_>) {
    EXITING.store(true, Ordering::Release);
    let until = std::time::Instant::now() + Duration::from_secs(1);
    while ATTACHING.load(Ordering::Acquire) > 0 && std::time::Instant::now() < until {
        py.detach(|| std::thread::sleep(Duration::from_millis(1)));
    }
}

/// Registers [`_at_exit`] with `atexit`.
pub fn install_exit_hook(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = wrap_pyfunction!(_at_exit, m)?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}
