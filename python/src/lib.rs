//! The `te` Python package's native module (`te._native`): PyO3 bindings of te-core's
//! `TransferEngine` and of the UMBP `Store`. The pure-Python part of the package (`python/te/`)
//! re-exports these classes, defines the exception hierarchy and holds the benchmark.
//!
//! Linking: nothing but libc. The rdma transport and the CUDA/HIP plugins load their vendor
//! libraries at run time. The efa transport (which now loads libfabric at run time too) is a
//! cargo feature left out of the default wheel until a wheel with it has been tested.

mod arrays;
mod bench;
mod compat;
mod engine;
mod errors;
mod memory;
mod notify_future;
mod runtime;
mod store;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    pyo3_async_runtimes::tokio::init_with_runtime(runtime::runtime())
        .map_err(|()| pyo3::exceptions::PyRuntimeError::new_err("the async runtime was already initialised"))?;
    engine::add(m)?;
    m.add_class::<errors::Failures>()?;
    store::add(m)?;
    bench::add(m)?;
    compat::add(m)?;
    m.add("COMPILED_TRANSPORTS", te_core::COMPILED_TRANSPORTS.to_vec())?;
    m.add("DISTRIBUTED", cfg!(feature = "distributed"))?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    runtime::install_exit_hook(m)?;
    Ok(())
}
