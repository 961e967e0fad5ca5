//! Rust errors as Python exceptions. The classes live in `te/errors.py` (a hierarchy with
//! multiple inheritance: `te.TimeoutError` is also the builtin `TimeoutError`...); each variant
//! of `te_base::Error` and `umbp::StoreError` maps to one class, whose message is the Rust
//! error's text and whose attributes carry its fields.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyList, PyModule};
use te_base::Error;
use umbp::StoreError;

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn errors_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    ERRORS
        .get_or_try_init(py, || Ok(PyModule::import(py, "te.errors")?.unbind()))
        .map(|m| m.bind(py))
}

/// An exception of class `class` (a name in `te.errors`) with `message`, its `kind` attribute set
/// to `kind` and `fields` as further attributes.
pub fn raise(py: Python<'_>, class: &str, kind: &str, message: String, fields: &[(&str, Py<PyAny>)]) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let cls = errors_module(py)?.getattr(class)?;
        let exc = cls.call1((message.clone(),))?;
        exc.setattr("kind", kind)?;
        for (name, value) in fields {
            exc.setattr(*name, value)?;
        }
        Ok(PyErr::from_value(exc))
    };
    // The error module itself failing to load (a broken install) must still raise something.
    build().unwrap_or_else(|e| e)
}

/// A bad argument caught on the Python side of the call (class in `te.errors`).
pub fn invalid(class: &str, message: impl Into<String>) -> PyErr {
    Python::attach(|py| raise(py, class, class, message.into(), &[]))
}

fn int(py: Python<'_>, v: u64) -> Py<PyAny> {
    v.into_pyobject(py).expect("u64 converts").into_any().unbind()
}

fn text(py: Python<'_>, v: &str) -> Py<PyAny> {
    v.into_pyobject(py).expect("str converts").into_any().unbind()
}

/// The class and attributes of one engine error.
pub fn engine_error(py: Python<'_>, e: &Error) -> PyErr {
    let msg = e.to_string();
    let (class, kind, fields): (&str, &str, Vec<(&str, Py<PyAny>)>) = match e {
        Error::Unregistered { addr, len } => (
            "UnregisteredError",
            "unregistered",
            vec![("addr", int(py, *addr)), ("length", int(py, *len))],
        ),
        Error::PartlyRegistered { addr, len, .. } => (
            "UnregisteredError",
            "partly_registered",
            vec![("addr", int(py, *addr)), ("length", int(py, *len))],
        ),
        Error::AlreadyRegistered { addr, len, .. } => (
            "AlreadyRegisteredError",
            "already_registered",
            vec![("addr", int(py, *addr)), ("length", int(py, *len))],
        ),
        Error::RegistrationMismatch { addr, len, what, .. } => (
            "InvalidArgument",
            "registration_mismatch",
            vec![
                ("addr", int(py, *addr)),
                ("length", int(py, *len)),
                ("what", text(py, what)),
            ],
        ),
        Error::OutOfBounds { segment, addr, len } => (
            "OutOfBoundsError",
            "out_of_bounds",
            vec![
                ("segment", text(py, segment)),
                ("addr", int(py, *addr)),
                ("length", int(py, *len)),
            ],
        ),
        Error::LengthOverflow { .. } => ("LengthOverflowError", "length_overflow", vec![]),
        Error::ZeroLength { index } => (
            "ZeroLengthError",
            "zero_length",
            vec![("index", int(py, *index as u64))],
        ),
        Error::NullAddress => ("NullAddressError", "null_address", vec![]),
        Error::UnknownSegment(name) => (
            "UnknownSegmentError",
            "unknown_segment",
            vec![("segment", text(py, name))],
        ),
        Error::WrongMemoryKind { .. } => ("WrongMemoryKindError", "wrong_memory_kind", vec![]),
        Error::NoTransport { segment, .. } => {
            ("NoTransportError", "no_transport", vec![("segment", text(py, segment))])
        }
        Error::InFlight { in_flight, .. } => ("InFlightError", "in_flight", vec![("in_flight", int(py, *in_flight))]),
        Error::Config { var, value, .. } => (
            "ConfigError",
            "config",
            vec![("var", text(py, var)), ("value", text(py, value))],
        ),
        Error::NotAvailable { what, .. } => ("NotAvailableError", "not_available", vec![("what", text(py, what))]),
        Error::NoDeviceOpened { transport, .. } => (
            "NotAvailableError",
            "no_device_opened",
            vec![("what", text(py, transport))],
        ),
        Error::Unauthenticated { peer, .. } => (
            "UnauthenticatedError",
            "unauthenticated",
            vec![("peer", text(py, peer))],
        ),
        Error::PeerGone { peer, .. } => ("PeerGoneError", "peer_gone", vec![("peer", text(py, peer))]),
        Error::PeerRestarted { peer, .. } => ("PeerRestartedError", "peer_restarted", vec![("peer", text(py, peer))]),
        Error::Timeout { after_ms, .. } => ("TimeoutError", "timeout", vec![("after_ms", int(py, *after_ms))]),
        Error::SegmentClosed(name) => (
            "SegmentClosedError",
            "segment_closed",
            vec![("segment", text(py, name))],
        ),
        Error::Cancelled => ("CancelledError", "cancelled", vec![]),
        Error::InvalidDescriptor(_) => ("InvalidDescriptorError", "invalid_descriptor", vec![]),
        Error::Refused { peer, .. } => ("RefusedError", "refused", vec![("peer", text(py, peer))]),
        Error::RegistrationFailed { .. } => ("RegistrationFailedError", "registration_failed", vec![]),
        Error::Transport { transport, .. } => ("TransportError", "transport", vec![("transport", text(py, transport))]),
        Error::BatchFailed(b) => return batch_error(py, b.clone()),
        Error::Metadata(_) => ("MetadataError", "metadata", vec![]),
        Error::Io { source, .. } => (
            "IoError",
            "io",
            vec![(
                "errno",
                source
                    .raw_os_error()
                    .unwrap_or(0)
                    .into_pyobject(py)
                    .expect("int")
                    .into_any()
                    .unbind(),
            )],
        ),
        Error::Closed(_) => ("ClosedError", "closed", vec![]),
        Error::SegmentNameTaken(name) => (
            "SegmentNameTakenError",
            "segment_name_taken",
            vec![("name", text(py, name))],
        ),
        Error::NotificationQueueFull { peer } => (
            "NotificationQueueFullError",
            "notification_queue_full",
            vec![("peer", text(py, peer))],
        ),
        Error::NotificationTooLarge { peer, len, max } => (
            "NotificationTooLargeError",
            "notification_too_large",
            vec![
                ("peer", text(py, peer)),
                ("length", int(py, *len as u64)),
                ("max", int(py, *max as u64)),
            ],
        ),
        _ => ("TeError", "other", vec![]),
    };
    raise(py, class, kind, msg, &fields)
}

/// A batch with failed requests: `BatchFailedError` with the counts by state, and its
/// `failures` (a list of `(request index, exception)`) built from [`Failures`] on first access:
/// a failed batch of many requests (a peer killed mid-batch fails every request left) would
/// otherwise make one exception per request before the caller sees the error, and the garbage
/// collection those allocations set off, whether or not anyone reads them.
pub fn batch_error(py: Python<'_>, b: te_base::BatchError) -> PyErr {
    let (p, message) = (b.progress, b.to_string());
    let timed_out = b.failures.iter().any(|(_, e)| matches!(e, Error::Timeout { .. }));
    let failures = match Py::new(
        py,
        Failures {
            items: b.failures,
            list: PyOnceLock::new(),
        },
    ) {
        Ok(f) => f.into_any(),
        Err(e) => return e,
    };
    raise(
        py,
        "BatchFailedError",
        "batch_failed",
        message,
        &[
            ("_failures_source", failures),
            ("done", int(py, p.done as u64)),
            ("failed", int(py, p.failed as u64)),
            ("cancelled", int(py, p.cancelled as u64)),
            ("pending", int(py, p.pending as u64)),
            ("timed_out", PyBool::new(py, timed_out).to_owned().into_any().unbind()),
        ],
    )
}

/// A failed batch's per-request errors, held in Rust until `BatchFailedError.failures` is read.
#[pyclass(frozen, module = "te._native", name = "_Failures")]
pub struct Failures {
    items: Vec<(usize, Error)>,
    /// Built once: threads reading `failures` at the same time all get this list.
    list: PyOnceLock<Py<PyList>>,
}

#[pymethods]
impl Failures {
    /// `[(request index, exception)]` in index order, one exception per request.
    fn materialize(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let list = self.list.get_or_try_init(py, || {
            let list = PyList::empty(py);
            for (i, e) in &self.items {
                list.append((*i, engine_error(py, e).into_value(py)))?;
            }
            Ok::<_, PyErr>(list.unbind())
        })?;
        Ok(list.clone_ref(py))
    }
}

/// The class and attributes of one store error.
pub fn store_error(py: Python<'_>, e: &StoreError) -> PyErr {
    let msg = e.to_string();
    let (class, kind, fields): (&str, &str, Vec<(&str, Py<PyAny>)>) = match e {
        StoreError::Engine(inner) => return engine_error(py, inner),
        StoreError::RangeOutsideObject {
            key_index, object_len, ..
        } => (
            "RangeError",
            "range_outside_object",
            vec![
                ("key_index", int(py, *key_index as u64)),
                ("object_len", int(py, *object_len)),
            ],
        ),
        StoreError::RangesOverlap { key_index, .. } => (
            "RangeError",
            "ranges_overlap",
            vec![("key_index", int(py, *key_index as u64))],
        ),
        StoreError::RangesDoNotTile { key_index, .. } => (
            "RangeError",
            "ranges_do_not_tile",
            vec![("key_index", int(py, *key_index as u64))],
        ),
        StoreError::ZeroLength { key_index, .. } => (
            "RangeError",
            "zero_length",
            vec![("key_index", int(py, *key_index as u64))],
        ),
        StoreError::Unregistered { .. } => ("StoreUnregisteredError", "unregistered", vec![]),
        StoreError::BadKey { .. } => ("BadKeyError", "bad_key", vec![]),
        StoreError::DuplicateKey { .. } => ("BadKeyError", "duplicate_key", vec![]),
        StoreError::NotFound { key } => ("NotFoundError", "not_found", vec![("key", text(py, key))]),
        StoreError::Corrupt { .. } => ("CorruptError", "corrupt", vec![]),
        StoreError::NoSpace { .. } => ("NoSpaceError", "no_space", vec![]),
        StoreError::BufferTooSmall { .. } => ("BufferTooSmallError", "buffer_too_small", vec![]),
        StoreError::WriteConflict { .. } => ("WriteConflictError", "write_conflict", vec![]),
        StoreError::TooLarge { .. } => ("TooLargeError", "too_large", vec![]),
        StoreError::Io { .. } => ("StoreIoError", "io", vec![]),
        StoreError::Closed => ("ClosedError", "closed", vec![]),
        StoreError::ServerGone { .. } => ("ServerGoneError", "server_gone", vec![]),
        StoreError::NotShareable { .. } => ("NotShareableError", "not_shareable", vec![]),
        StoreError::Protocol { .. } => ("ProtocolError", "protocol", vec![]),
        StoreError::Refused { .. } => ("StoreRefusedError", "refused", vec![]),
        StoreError::Server { .. } => ("ServerError", "server", vec![]),
        StoreError::Remote { .. } => ("RemoteError", "remote", vec![]),
        StoreError::Cluster(_) => ("ClusterError", "cluster", vec![]),
        _ => ("StoreError", "other", vec![]),
    };
    raise(py, class, kind, msg, &fields)
}

/// Converts results of the engine into Python results.
pub trait IntoPyResult<T> {
    /// The Python exception of the error.
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| Python::attach(|py| engine_error(py, &e)))
    }
}

impl<T> IntoPyResult<T> for Result<T, StoreError> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| Python::attach(|py| store_error(py, &e)))
    }
}

impl<T> IntoPyResult<T> for Result<T, te_base::BatchError> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| Python::attach(|py| batch_error(py, e)))
    }
}
