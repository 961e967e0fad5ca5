//! `te.TransferEngine` and the objects it hands out: registrations, segments, batches,
//! notifications and segment events.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::{PyStopAsyncIteration, PyStopIteration};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use te_base::config::{Env, MapEnv};
use te_base::{Batch, MemoryLocation, SegmentId, TransferRequest};
use te_core::{RawRegion, RegisterOptions, SegmentEvent, SegmentHandle, SubmitOptions, TransferEngine};

use crate::arrays::{common_len, U64s};
use crate::errors::{invalid, IntoPyResult};
use crate::memory::{acquire, parse_location, release_pending};
use crate::runtime::{block_on, runtime, wait_batch};

/// A transfer engine: registers memory, publishes it as a segment, opens other engines'
/// segments and moves bytes between them in batches.
#[pyclass(module = "te._native", name = "TransferEngine", frozen)]
pub struct PyEngine {
    pub(crate) engine: TransferEngine,
}

/// A registered region. Closing it (or its collection) deregisters it; while transfers on it
/// are in flight the release waits for them, and the memory's owner stays alive until then.
#[pyclass(module = "te._native", name = "Registration", frozen)]
pub struct PyRegistration {
    reg: Mutex<Option<te_core::Registration>>,
    #[pyo3(get)]
    addr: u64,
    #[pyo3(get)]
    length: u64,
    location: MemoryLocation,
    #[pyo3(get)]
    exported: bool,
}

/// An open segment of this or another engine.
#[pyclass(module = "te._native", name = "Segment", frozen)]
pub struct PySegment {
    pub(crate) handle: SegmentHandle,
}

/// What a successful batch did.
#[pyclass(module = "te._native", name = "BatchReport", frozen, get_all)]
pub struct PyBatchReport {
    requests: usize,
    bytes: u64,
}

/// A submitted batch: wait for it (GIL released), await it, poll or cancel it.
#[pyclass(module = "te._native", name = "Batch", frozen)]
pub struct PyBatch {
    data: Batch,
    notification: Option<Batch>,
}

/// A notification a peer sent to this engine's segment.
#[pyclass(module = "te._native", name = "Notification", frozen, get_all)]
pub struct PyNotification {
    sender: String,
    payload: Py<PyBytes>,
}

/// The received notifications: iterate (blocking) or `async for`.
#[pyclass(module = "te._native", name = "Notifications", frozen)]
pub struct PyNotifications {
    inbox: te_core::Notifications,
}

/// Changes to an open segment: iterate (blocking) or `async for`.
#[pyclass(module = "te._native", name = "SegmentEvents", frozen)]
pub struct PySegmentEvents {
    rx: Arc<tokio::sync::Mutex<tokio::sync::broadcast::Receiver<SegmentEvent>>>,
}

/// One segment event: `kind` is `changed`, `restarted`, `gone`, `closed` or `lagged`.
#[pyclass(module = "te._native", name = "SegmentEvent", frozen, get_all)]
pub struct PySegmentEvent {
    kind: &'static str,
    /// Exported buffers `(base, length, location)` of the new descriptor (`changed`,
    /// `restarted`), else empty.
    buffers: Vec<(u64, u64, String)>,
    /// Events lost (`lagged`), else 0.
    missed: u64,
}

fn env_from(env: Option<&Bound<'_, PyDict>>) -> PyResult<Option<Arc<dyn Env>>> {
    let Some(env) = env else { return Ok(None) };
    let mut map = std::collections::HashMap::new();
    for (k, v) in env.iter() {
        map.insert(k.extract::<String>()?, v.str()?.to_string());
    }
    Ok(Some(Arc::new(MapEnv(map))))
}

fn deadline_from(deadline: Option<f64>) -> PyResult<Option<Duration>> {
    match deadline {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(invalid(
            "InvalidArgument",
            format!("deadline={s}: must be a positive number of seconds"),
        )),
    }
}

fn segment_id(segment: &Bound<'_, PyAny>) -> PyResult<SegmentId> {
    if let Ok(s) = segment.cast::<PySegment>() {
        return Ok(s.get().handle.id());
    }
    segment.extract::<u32>().map(SegmentId).map_err(|_| {
        invalid(
            "InvalidArgument",
            "segment: expected a Segment from open_segment() or its id",
        )
    })
}

/// Builds the requests of a batched call: no Python object per request.
pub(crate) fn requests(
    write: bool,
    segment: SegmentId,
    local: &Bound<'_, PyAny>,
    remote: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
) -> PyResult<Vec<TransferRequest>> {
    let local = U64s::extract(local, "local_addrs")?;
    let remote = U64s::extract(remote, "remote_addrs")?;
    let lens = U64s::extract(lengths, "lengths")?;
    let n = common_len(&[(&local, "local_addrs"), (&remote, "remote_addrs"), (&lens, "lengths")])?;
    let make = if write {
        TransferRequest::write
    } else {
        TransferRequest::read
    };
    let mut out = Vec::with_capacity(n);
    match (local.as_slice(), remote.as_slice(), lens.as_slice()) {
        (Some(l), Some(r), Some(s)) => {
            out.extend(l.iter().zip(r).zip(s).map(|((&l, &r), &s)| make(l, segment, r, s)));
        }
        _ => out.extend((0..n).map(|i| make(local.get(i), segment, remote.get(i), lens.get(i)))),
    }
    Ok(out)
}

impl PyEngine {
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        write: bool,
        segment: &Bound<'_, PyAny>,
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        deadline: Option<f64>,
        background: bool,
        notify: Option<Vec<u8>>,
    ) -> PyResult<PyBatch> {
        release_pending(py);
        let id = segment_id(segment)?;
        let reqs = requests(write, id, local, remote, lengths)?;
        let opts = SubmitOptions {
            background,
            deadline: deadline_from(deadline)?,
            ..SubmitOptions::default()
        };
        // Without the GIL: a transport may copy on the submitting thread inside submit (shm: a
        // batch up to TE_SHM_INLINE_BYTES whole, and chunks beside its copy threads), and other
        // Python threads must run meanwhile, as during wait().
        let engine = &self.engine;
        let submit = |notify: Option<Vec<u8>>| {
            py.detach(|| match notify {
                None => engine.submit_with(&reqs, &opts).map(|data| PyBatch {
                    data,
                    notification: None,
                }),
                Some(payload) => engine.submit_notified(&reqs, payload, &opts).map(|nb| PyBatch {
                    data: nb.data,
                    notification: Some(nb.notification),
                }),
            })
        };
        match submit(notify.clone()) {
            // Beyond the buffers the segment had when we last read its descriptor: the peer may
            // have registered more since. Read it again once (one metadata round trip, only on
            // this path), then submit again; still out of bounds is the caller's error.
            Err(te_base::Error::OutOfBounds { .. }) => {
                let engine = self.engine.clone();
                py.detach(move || block_on(async move { engine.refresh_segment(id).await }))
                    .py()?;
                submit(notify).py()
            }
            other => other.py(),
        }
    }

    fn register_owned(
        &self,
        py: Python<'_>,
        acquired: crate::memory::Acquired,
        export: bool,
    ) -> PyResult<PyRegistration> {
        let crate::memory::Acquired {
            addr,
            len,
            location,
            owner,
        } = acquired;
        let engine = self.engine.clone();
        let reg = RegisterOptions {
            export,
            ..RegisterOptions::default()
        };
        let r = py.detach(move || {
            // SAFETY: `owner` keeps `[addr, addr + len)` alive (the exporter's view, the DLPack
            // capsule, or the array object) and the engine drops it only after releasing the
            // region (register_raw_owned's contract).
            block_on(unsafe { engine.register_raw_owned(addr, len, location, reg, Box::new(owner)) })
        });
        Ok(PyRegistration::new(r.py()?))
    }
}

impl PyRegistration {
    fn new(r: te_core::Registration) -> Self {
        PyRegistration {
            addr: r.addr(),
            length: r.len(),
            location: r.location(),
            exported: r.is_exported(),
            reg: Mutex::new(Some(r)),
        }
    }
}

#[pymethods]
impl PyEngine {
    /// Builds an engine. Unset options come from the `TE_*` variables (of `env` when given,
    /// which then replaces the process environment), then defaults; a malformed variable raises
    /// `te.ConfigError` naming it.
    #[new]
    #[pyo3(signature = (segment_name=None, *, transports=None, phase_timing=None, auth_key_file=None, env=None))]
    fn new(
        py: Python<'_>,
        segment_name: Option<String>,
        transports: Option<Vec<String>>,
        phase_timing: Option<bool>,
        auth_key_file: Option<std::path::PathBuf>,
        env: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        release_pending(py);
        let mut b = TransferEngine::builder();
        if let Some(n) = segment_name {
            b = b.segment_name(n);
        }
        if let Some(t) = transports {
            b = b.transports(t);
        }
        if let Some(p) = phase_timing {
            b = b.phase_timing(p);
        }
        if let Some(path) = auth_key_file {
            b = b.auth_key(te_core::auth::AuthKey::from_file(&path).py()?);
        }
        if let Some(e) = env_from(env)? {
            b = b.env(e);
        }
        let engine = py.detach(|| block_on(b.build())).py()?;
        Ok(PyEngine { engine })
    }

    /// This engine's segment name.
    #[getter]
    fn segment_name(&self) -> String {
        self.engine.segment_name().to_string()
    }

    /// Random per engine start.
    #[getter]
    fn instance(&self) -> u64 {
        self.engine.instance()
    }

    /// Every compiled-in transport: `(name, None)` when it runs here, else `(name, reason)`.
    fn transports(&self, py: Python<'_>) -> Vec<(String, Option<String>)> {
        release_pending(py);
        self.engine
            .transports()
            .iter()
            .map(|t| (t.name.clone(), t.unavailable.clone()))
            .collect()
    }

    /// Registers the memory of `obj` without copying: a writable buffer-protocol object (numpy
    /// array, bytearray, memoryview, mmap), or an object with `__dlpack__` or
    /// `__cuda_array_interface__` (host or device tensors). `device` ("host", "cuda:0",
    /// "rocm:1") overrides where the memory is said to live. `export=False` keeps it local.
    #[pyo3(signature = (obj, *, device=None, export=true))]
    fn register(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        device: Option<&str>,
        export: bool,
    ) -> PyResult<PyRegistration> {
        release_pending(py);
        let device = device.map(parse_location).transpose()?;
        let acquired = acquire(obj, device)?;
        self.register_owned(py, acquired, export)
    }

    /// Registers raw memory `[ptr, ptr + length)` (`device`: "host", the default, "cuda:N",
    /// "rocm:N"). The caller keeps the memory valid until the registration is closed and its
    /// transfers completed: nothing here can.
    #[pyo3(signature = (ptr, length, device=None, *, export=true))]
    fn register_ptr(
        &self,
        py: Python<'_>,
        ptr: u64,
        length: u64,
        device: Option<&str>,
        export: bool,
    ) -> PyResult<PyRegistration> {
        release_pending(py);
        let location = device.map(parse_location).transpose()?.unwrap_or(MemoryLocation::HOST);
        let engine = self.engine.clone();
        let r = py.detach(move || {
            // SAFETY: the Python caller takes on register_raw's contract (documented above and in
            // the stubs): the memory stays valid until the registration is released.
            block_on(unsafe {
                engine.register_raw(
                    ptr,
                    length,
                    location,
                    RegisterOptions {
                        export,
                        ..RegisterOptions::default()
                    },
                )
            })
        });
        Ok(PyRegistration::new(r.py()?))
    }

    /// Registers raw memory `[ptrs[i], ptrs[i] + lengths[i])` for every `i` in one call: one
    /// descriptor update for all of them (registering them one by one republishes the descriptor
    /// each time). Arguments are uint64 arrays (or an int repeated); the contract of
    /// `register_ptr` holds for each region. Nothing is registered if one is refused.
    #[pyo3(signature = (ptrs, lengths, device=None, *, export=true))]
    fn register_ptrs(
        &self,
        py: Python<'_>,
        ptrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        device: Option<&str>,
        export: bool,
    ) -> PyResult<Vec<PyRegistration>> {
        release_pending(py);
        let location = device.map(parse_location).transpose()?.unwrap_or(MemoryLocation::HOST);
        let addrs = U64s::extract(ptrs, "ptrs")?;
        let lens = U64s::extract(lengths, "lengths")?;
        let n = common_len(&[(&addrs, "ptrs"), (&lens, "lengths")])?;
        let items: Vec<RawRegion> = (0..n)
            .map(|i| RawRegion {
                addr: addrs.get(i),
                len: lens.get(i),
                location,
            })
            .collect();
        let engine = self.engine.clone();
        let regs = py.detach(move || {
            // SAFETY: the Python caller takes on register_raw's contract for every region
            // (documented above and in the stubs).
            block_on(unsafe {
                engine.register_raw_batch(
                    &items,
                    RegisterOptions {
                        export,
                        ..RegisterOptions::default()
                    },
                )
            })
        });
        Ok(regs.py()?.into_iter().map(PyRegistration::new).collect())
    }

    /// Opens (or refreshes) the segment called `name`.
    fn open_segment(&self, py: Python<'_>, name: String) -> PyResult<PySegment> {
        release_pending(py);
        let engine = self.engine.clone();
        let handle = py
            .detach(move || block_on(async move { engine.open_segment(&name).await }))
            .py()?;
        Ok(PySegment { handle })
    }

    /// `open_segment`, as an awaitable.
    fn open_segment_async<'py>(&self, py: Python<'py>, name: String) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.engine.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let handle = engine.open_segment(&name).await.py()?;
            Ok(PySegment { handle })
        })
    }

    /// Connects every route to `segment` before the first transfer (one small read per lazily
    /// connected path: efa rails, ...). Returns `(transport, reads, seconds)` per route, reads
    /// 0 where the segment exports nothing that route reaches.
    fn warm_up(&self, py: Python<'_>, segment: &Bound<'_, PySegment>) -> PyResult<Vec<(String, usize, f64)>> {
        let handle = segment.borrow().handle.clone();
        let engine = self.engine.clone();
        let report = py
            .detach(move || block_on(async move { engine.warm_up(&handle).await }))
            .py()?;
        Ok(report
            .routes
            .into_iter()
            .map(|r| (r.transport.to_string(), r.reads, r.elapsed.as_secs_f64()))
            .collect())
    }

    /// The routes to `segment`, in order of preference: `(transport, state, connected, pauses)`
    /// with state "active", "paused" (after repeated errors) or "probing" (docs/failover.md).
    fn routes(&self, py: Python<'_>, segment: &Bound<'_, PySegment>) -> PyResult<Vec<(String, String, bool, u64)>> {
        release_pending(py);
        let handle = segment.borrow().handle.clone();
        let routes = self.engine.routes(&handle).py()?;
        Ok(routes
            .into_iter()
            .map(|r| {
                let state = match r.state {
                    te_core::RouteState::Active => "active",
                    te_core::RouteState::Paused { .. } => "paused",
                    te_core::RouteState::Probing => "probing",
                };
                (r.transport.to_string(), state.to_string(), r.connected, r.pauses)
            })
            .collect())
    }

    /// The transports that reach `segment` but refused to connect, `(transport, why)`: e.g. shm
    /// to a process it may not attach to, whose traffic then goes over tcp.
    fn unreached_routes(&self, py: Python<'_>, segment: &Bound<'_, PySegment>) -> PyResult<Vec<(String, String)>> {
        release_pending(py);
        let handle = segment.borrow().handle.clone();
        let unreached = self.engine.unreached_routes(&handle).py()?;
        Ok(unreached
            .into_iter()
            .map(|u| (u.transport.to_string(), u.reason))
            .collect())
    }

    /// Closes a segment opened by `open_segment`.
    fn close_segment(&self, py: Python<'_>, segment: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = segment_id(segment)?;
        let engine = self.engine.clone();
        py.detach(move || block_on(async move { engine.close_segment(id).await }))
            .py()
    }

    /// Submits writes of `lengths` bytes from local addresses to the segment's remote
    /// addresses. Each argument is a 1-D array of uint64 or one int for every request. With
    /// `notify`, the bytes are sent to the target once every request completed.
    #[pyo3(signature = (segment, local_addrs, remote_addrs, lengths, *, deadline=None, background=false, notify=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_write(
        &self,
        py: Python<'_>,
        segment: &Bound<'_, PyAny>,
        local_addrs: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        deadline: Option<f64>,
        background: bool,
        notify: Option<Vec<u8>>,
    ) -> PyResult<PyBatch> {
        self.submit(
            py,
            true,
            segment,
            local_addrs,
            remote_addrs,
            lengths,
            deadline,
            background,
            notify,
        )
    }

    /// Submits reads (remote to local); as `submit_write`.
    #[pyo3(signature = (segment, local_addrs, remote_addrs, lengths, *, deadline=None, background=false, notify=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_read(
        &self,
        py: Python<'_>,
        segment: &Bound<'_, PyAny>,
        local_addrs: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        deadline: Option<f64>,
        background: bool,
        notify: Option<Vec<u8>>,
    ) -> PyResult<PyBatch> {
        self.submit(
            py,
            false,
            segment,
            local_addrs,
            remote_addrs,
            lengths,
            deadline,
            background,
            notify,
        )
    }

    /// `submit_write(...).wait()`: blocks with the GIL released.
    #[pyo3(signature = (segment, local_addrs, remote_addrs, lengths, *, deadline=None, notify=None))]
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        segment: &Bound<'_, PyAny>,
        local_addrs: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        deadline: Option<f64>,
        notify: Option<Vec<u8>>,
    ) -> PyResult<PyBatchReport> {
        self.submit(
            py,
            true,
            segment,
            local_addrs,
            remote_addrs,
            lengths,
            deadline,
            false,
            notify,
        )?
        .wait(py, None)
    }

    /// `submit_read(...).wait()`: blocks with the GIL released.
    #[pyo3(signature = (segment, local_addrs, remote_addrs, lengths, *, deadline=None, notify=None))]
    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        py: Python<'_>,
        segment: &Bound<'_, PyAny>,
        local_addrs: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        deadline: Option<f64>,
        notify: Option<Vec<u8>>,
    ) -> PyResult<PyBatchReport> {
        self.submit(
            py,
            false,
            segment,
            local_addrs,
            remote_addrs,
            lengths,
            deadline,
            false,
            notify,
        )?
        .wait(py, None)
    }

    /// Sends `payload` to `segment` on its own; returns once the target queued it.
    fn notify(&self, py: Python<'_>, segment: &Bound<'_, PySegment>, payload: Vec<u8>) -> PyResult<()> {
        let engine = self.engine.clone();
        let handle = segment.get().handle.clone();
        py.detach(move || block_on(async move { engine.notify(&handle, payload).await }))
            .py()
    }

    /// `notify`, as an awaitable.
    fn notify_async<'py>(
        &self,
        py: Python<'py>,
        segment: &Bound<'py, PySegment>,
        payload: Vec<u8>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.engine.clone();
        let handle = segment.get().handle.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move { engine.notify(&handle, payload).await.py() })
    }

    /// The notifications peers sent to this engine's segment (every iterator takes from the
    /// same queue).
    fn notifications(&self) -> PyNotifications {
        PyNotifications {
            inbox: self.engine.notifications(),
        }
    }

    /// Waits up to `timeout` seconds (None: forever) for the next notification, GIL released;
    /// None on timeout or once the engine shut down.
    #[pyo3(signature = (timeout=None))]
    fn recv_notification(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyNotification>> {
        self.notifications().recv(py, timeout)
    }

    /// Withdraws the descriptor and stops the transports.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.engine.clone();
        py.detach(move || block_on(async move { engine.shutdown().await })).py()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _a: Py<PyAny>, _b: Py<PyAny>, _c: Py<PyAny>) -> PyResult<bool> {
        self.shutdown(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("TransferEngine(segment_name={:?})", self.engine.segment_name())
    }
}

#[pymethods]
impl PyRegistration {
    /// Where the memory lives: "host", "cuda:0", ...
    #[getter]
    fn location(&self) -> String {
        self.location.to_string()
    }

    /// True until closed.
    #[getter]
    fn open(&self) -> bool {
        self.reg.lock().is_some()
    }

    /// Deregisters. Returns True when released now; False when transfers on it are still in
    /// flight: the region then refuses new transfers at once and is released (its memory owner
    /// with it) when the last one completes. Closing twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<bool> {
        release_pending(py);
        let Some(reg) = self.reg.lock().take() else {
            return Ok(true);
        };
        // The region's owner, dropped by the deregistration on this thread, is released here
        // under the GIL, not by a blocking-pool thread started for it.
        let out = py.detach(move || crate::memory::released_by_caller(|| block_on(reg.deregister())));
        release_pending(py);
        match out {
            Ok(()) => Ok(true),
            Err(te_base::Error::InFlight { .. }) => Ok(false),
            Err(e) => Err(e).py(),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _a: Py<PyAny>, _b: Py<PyAny>, _c: Py<PyAny>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// The address `offset` bytes in, checked against the region (raises `te.ClosedError` once
    /// closed, `te.OutOfBoundsError` past the end).
    #[pyo3(signature = (offset=0))]
    fn address(&self, offset: u64) -> PyResult<u64> {
        if self.reg.lock().is_none() {
            return Err(invalid("ClosedError", "the registration is closed"));
        }
        if offset >= self.length {
            return Err(invalid(
                "OutOfBoundsError",
                format!("offset {offset} is past the registration's {} bytes", self.length),
            ));
        }
        Ok(self.addr + offset)
    }

    fn __repr__(&self) -> String {
        format!(
            "Registration(addr={:#x}, length={}, location={}, exported={}, open={})",
            self.addr,
            self.length,
            self.location,
            self.exported,
            self.open()
        )
    }
}

#[pymethods]
impl PySegment {
    /// The id to pass where a segment is expected.
    #[getter]
    fn id(&self) -> u32 {
        self.handle.id().0
    }

    /// The segment's name.
    #[getter]
    fn name(&self) -> String {
        self.handle.name().to_string()
    }

    /// Buffers it exported when opened: `(base, length, location)` each.
    #[getter]
    fn buffers(&self) -> Vec<(u64, u64, String)> {
        self.handle
            .buffers()
            .iter()
            .map(|b| (b.base, b.len, b.location.to_string()))
            .collect()
    }

    /// Changes from now on: descriptor changes, a restart, removal, closing.
    fn events(&self) -> PySegmentEvents {
        PySegmentEvents {
            rx: Arc::new(tokio::sync::Mutex::new(self.handle.events())),
        }
    }

    fn __repr__(&self) -> String {
        format!("Segment(id={}, name={:?})", self.handle.id().0, self.handle.name())
    }
}

#[pymethods]
impl PyBatchReport {
    fn __repr__(&self) -> String {
        format!("BatchReport(requests={}, bytes={})", self.requests, self.bytes)
    }
}

impl PyBatch {
    fn report(py: Python<'_>, r: te_base::BatchReport) -> PyBatchReport {
        let _ = py;
        PyBatchReport {
            requests: r.requests,
            bytes: r.bytes,
        }
    }
}

async fn wait_async(data: Batch, notification: Option<Batch>) -> PyResult<PyBatchReport> {
    let r = data.wait().await.py()?;
    if let Some(n) = notification {
        if let Err(e) = n.wait().await {
            return Err(e.into_first_error()).py();
        }
    }
    Ok(PyBatchReport {
        requests: r.requests,
        bytes: r.bytes,
    })
}

#[pymethods]
impl PyBatch {
    /// Waits with the GIL released (Ctrl-C interrupts) until every request settled: the
    /// report, or `te.BatchFailedError` listing each failed request. With `timeout` (seconds)
    /// raises `te.WaitTimeoutError` if the batch is still running then (it keeps running).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyBatchReport> {
        let r = wait_batch(py, &self.data, timeout)?;
        if let Some(n) = &self.notification {
            if let Err(e) = wait_batch(py, n, timeout) {
                // The data arrived; the notification was refused (or its wait timed out).
                return Err(
                    match e.value(py).getattr("failures").ok().and_then(|f| f.get_item(0).ok()) {
                        Some(first) => first.get_item(1).map(PyErr::from_value).unwrap_or(e),
                        None => e,
                    },
                );
            }
        }
        Ok(Self::report(py, r))
    }

    /// The batch as an awaitable (the wait runs on the engine's runtime).
    fn wait_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        pyo3_async_runtimes::tokio::future_into_py(py, wait_async(self.data.clone(), self.notification.clone()))
    }

    fn __await__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.wait_async(py)?.call_method0("__await__")
    }

    /// True once every request settled.
    fn done(&self) -> bool {
        self.data.is_complete() && self.notification.as_ref().is_none_or(|n| n.is_complete())
    }

    /// Counts by state: `done`, `failed`, `cancelled`, `pending`, `bytes_done`.
    fn progress<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = self.data.poll();
        let d = PyDict::new(py);
        d.set_item("done", p.done)?;
        d.set_item("failed", p.failed)?;
        d.set_item("cancelled", p.cancelled)?;
        d.set_item("pending", p.pending)?;
        d.set_item("bytes_done", p.bytes_done)?;
        Ok(d)
    }

    /// Asks the transports not to start requests still queued (they settle as cancelled).
    fn cancel(&self) {
        self.data.cancel();
    }

    /// The number of requests.
    fn __len__(&self) -> usize {
        self.data.state().len()
    }
}

pub(crate) fn notification(py: Python<'_>, n: te_base::Notification) -> PyNotification {
    PyNotification {
        sender: n.from,
        payload: PyBytes::new(py, &n.payload).unbind(),
    }
}

impl PyNotifications {
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyNotification>> {
        let limit = match timeout {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => {
                return Err(invalid(
                    "InvalidArgument",
                    format!("timeout={t}: must be a number of seconds >= 0, or None to wait forever"),
                ))
            }
        };
        if let Some(n) = self.inbox.try_recv() {
            return Ok(Some(notification(py, n)));
        }
        let started = std::time::Instant::now();
        loop {
            // Slices of 50 ms so Ctrl-C (and other signals) are seen.
            let slice = match limit {
                Some(l) => match l.checked_sub(started.elapsed()) {
                    Some(left) if !left.is_zero() => left.min(Duration::from_millis(50)),
                    _ => return Ok(None),
                },
                None => Duration::from_millis(50),
            };
            let inbox = self.inbox.clone();
            let got = py.detach(move || block_on(async move { tokio::time::timeout(slice, inbox.recv()).await }));
            match got {
                Ok(Some(n)) => return Ok(Some(notification(py, n))),
                Ok(None) => return Ok(None),
                Err(_) => py.check_signals()?,
            }
        }
    }
}

#[pymethods]
impl PyNotifications {
    /// The oldest waiting notification, or None.
    fn try_recv(&self, py: Python<'_>) -> Option<PyNotification> {
        self.inbox.try_recv().map(|n| notification(py, n))
    }

    /// Waits up to `timeout` seconds (None: forever), GIL released; None on timeout or shutdown.
    #[pyo3(name = "recv", signature = (timeout=None))]
    fn py_recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyNotification>> {
        self.recv(py, timeout)
    }

    /// The next notification, as an awaitable (None once the engine shut down). Cancelling it
    /// (task cancel, `asyncio.wait_for` timing out) never consumes a notification.
    fn recv_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        crate::notify_future::next(py, self.inbox.clone(), false)
    }

    /// Notifications waiting.
    fn __len__(&self) -> usize {
        self.inbox.len()
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<PyNotification> {
        self.recv(py, None)?.ok_or_else(|| PyStopIteration::new_err(()))
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        crate::notify_future::next(py, self.inbox.clone(), true)
    }
}

fn event(e: Result<SegmentEvent, tokio::sync::broadcast::error::RecvError>) -> Option<PySegmentEvent> {
    use tokio::sync::broadcast::error::RecvError;
    let buffers = |d: &te_base::SegmentDescriptor| {
        d.buffers
            .iter()
            .map(|b| (b.base, b.len, b.location.to_string()))
            .collect::<Vec<_>>()
    };
    let (kind, buffers, missed) = match e {
        Ok(SegmentEvent::Changed(d)) => ("changed", buffers(&d), 0),
        Ok(SegmentEvent::Restarted(d)) => ("restarted", buffers(&d), 0),
        Ok(SegmentEvent::Gone) => ("gone", Vec::new(), 0),
        Ok(SegmentEvent::Closed) => ("closed", Vec::new(), 0),
        Ok(_) => ("other", Vec::new(), 0),
        Err(RecvError::Lagged(n)) => ("lagged", Vec::new(), n),
        Err(RecvError::Closed) => return None,
    };
    Some(PySegmentEvent { kind, buffers, missed })
}

#[pymethods]
impl PySegmentEvents {
    /// Waits up to `timeout` seconds (None: forever) for the next event, GIL released; None on
    /// timeout or when no more can come.
    #[pyo3(signature = (timeout=None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PySegmentEvent>> {
        let limit = timeout.map(Duration::from_secs_f64);
        let started = std::time::Instant::now();
        loop {
            let slice = match limit {
                Some(l) => match l.checked_sub(started.elapsed()) {
                    Some(left) if !left.is_zero() => left.min(Duration::from_millis(50)),
                    _ => return Ok(None),
                },
                None => Duration::from_millis(50),
            };
            let rx = self.rx.clone();
            let got = py.detach(move || {
                block_on(async move { tokio::time::timeout(slice, async { rx.lock().await.recv().await }).await })
            });
            match got {
                Ok(e) => return Ok(event(e)),
                Err(_) => py.check_signals()?,
            }
        }
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let rx = self.rx.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let e = rx.lock().await.recv().await;
            event(e).ok_or_else(|| PyStopAsyncIteration::new_err(()))
        })
    }
}

#[pymethods]
impl PySegmentEvent {
    fn __repr__(&self) -> String {
        format!("SegmentEvent(kind={:?}, buffers={})", self.kind, self.buffers.len())
    }
}

#[pymethods]
impl PyNotification {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Notification(sender={:?}, payload={} bytes)",
            self.sender,
            self.payload.bind(py).as_bytes().len()
        )
    }
}

/// Lists `(name, unavailable reason)` of the device plugins compiled in.
#[pyfunction]
pub fn device_plugins() -> Vec<(String, Option<String>)> {
    te_core::device_plugins()
        .into_iter()
        .map(|p| (p.name.to_string(), p.unavailable))
        .collect()
}

/// Registers the engine classes in the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<PyRegistration>()?;
    m.add_class::<PySegment>()?;
    m.add_class::<PyBatch>()?;
    m.add_class::<PyBatchReport>()?;
    m.add_class::<PyNotification>()?;
    m.add_class::<PyNotifications>()?;
    m.add_class::<PySegmentEvents>()?;
    m.add_class::<PySegmentEvent>()?;
    m.add_function(wrap_pyfunction!(device_plugins, m)?)?;
    let _ = PyList::empty(m.py());
    let _ = runtime();
    Ok(())
}
