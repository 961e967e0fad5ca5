//! The one error type of the engine. Every public call validates its input and returns one of these
//! variants, each naming what was wrong; transports convert their private errors into it.

use std::sync::Arc;

/// Result alias used across the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the transfer engine.
///
/// Cloneable so that one failure can be reported against every request it affected.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The local range does not fall in any registered region.
    #[error("local memory [{addr:#x}, +{len}) is not registered")]
    Unregistered { addr: u64, len: u64 },

    /// The local range starts in a registered region but runs past its end.
    #[error("local memory [{addr:#x}, +{len}) is only partly registered: region [{region_base:#x}, +{region_len}) ends first")]
    PartlyRegistered {
        addr: u64,
        len: u64,
        region_base: u64,
        region_len: u64,
    },

    /// A range overlaps a region that is already registered.
    #[error("memory [{addr:#x}, +{len}) overlaps the registered region [{region_base:#x}, +{region_len})")]
    AlreadyRegistered {
        addr: u64,
        len: u64,
        region_base: u64,
        region_len: u64,
    },

    /// A range inside a registered region cannot share that region's registration (the
    /// engine's registration cache) because it asks for something the region does not have:
    /// `what` names the option that differs, with the region's value and the requested one.
    #[error("memory [{addr:#x}, +{len}) lies inside the registered region [{region_base:#x}, +{region_len}) but cannot share its registration: {what} differs (region: {region}, requested: {requested})")]
    RegistrationMismatch {
        addr: u64,
        len: u64,
        region_base: u64,
        region_len: u64,
        /// The option that differs (`export`, `location`).
        what: &'static str,
        /// The covering region's value.
        region: String,
        /// The requested value.
        requested: String,
    },

    /// The remote range is not inside one buffer exported by the target segment.
    #[error("remote range [{addr:#x}, +{len}) is outside every buffer exported by segment '{segment}'")]
    OutOfBounds { segment: String, addr: u64, len: u64 },

    /// `addr + len` does not fit in 64 bits (or in the address space).
    #[error("address {addr:#x} + length {len} overflows")]
    LengthOverflow { addr: u64, len: u64 },

    /// A request or registration of zero bytes.
    #[error("request {index} has zero length")]
    ZeroLength { index: usize },

    /// A null pointer was given where memory was expected.
    #[error("null address")]
    NullAddress,

    /// No segment of that name is known to the metadata store, or the handle is stale.
    #[error("unknown segment '{0}'")]
    UnknownSegment(String),

    /// The transport cannot serve memory of this kind.
    #[error("transport '{transport}' cannot serve {what} memory")]
    WrongMemoryKind { transport: String, what: String },

    /// No installed transport can reach the segment with these memory kinds.
    #[error("no transport can serve segment '{segment}': {reason}")]
    NoTransport { segment: String, reason: String },

    /// The region still has transfers in flight; deregistration is refused.
    #[error("region [{base:#x}, +{len}) has {in_flight} batch(es) in flight")]
    InFlight { base: u64, len: u64, in_flight: u64 },

    /// A configuration value was malformed. Never silently defaulted.
    #[error("invalid configuration {var}={value:?}: {reason}")]
    Config { var: String, value: String, reason: String },

    /// A component is compiled in but cannot run on this host.
    #[error("{what}: not available: {reason}")]
    NotAvailable { what: String, reason: String },

    /// The peer did not prove it holds the shared key (or this side lacks it). Says nothing
    /// about the key, tokens or instances.
    #[error("peer '{peer}' refused: not authenticated ({reason})")]
    Unauthenticated { peer: String, reason: String },

    /// The peer went away (connection closed, process killed, lease expired).
    #[error("peer '{peer}' went away: {reason}")]
    PeerGone { peer: String, reason: String },

    /// The operation did not complete in time.
    #[error("{what} timed out after {after_ms} ms")]
    Timeout { what: String, after_ms: u64 },

    /// The peer restarted (its descriptor names a new instance): requests that were in flight to
    /// the old instance failed; new ones go to the new instance.
    #[error("peer '{peer}' restarted: {reason}")]
    PeerRestarted { peer: String, reason: String },

    /// The segment was closed by this engine (`TransferEngine::close_segment`); open it again
    /// to use it.
    #[error("segment '{0}' was closed")]
    SegmentClosed(String),

    /// The request was cancelled before it started.
    #[error("request cancelled")]
    Cancelled,

    /// A segment descriptor (local or received from a peer) failed validation.
    #[error("invalid segment descriptor: {0}")]
    InvalidDescriptor(String),

    /// The target refused the request (it is outside what the target exported, or similar).
    #[error("peer '{peer}' refused the request: {reason}")]
    Refused { peer: String, reason: String },

    /// A registration batch failed; every failed item is listed and the successful ones were
    /// released, so nothing stays half-registered.
    #[error("registration batch failed for {} item(s): {}", failures.len(), summarize(failures))]
    RegistrationFailed { failures: Vec<RegistrationFailure> },

    /// The transport found devices (NICs, provider domains) but could open none of them: each one
    /// tried, with why it was skipped. When at least one opens, the transport installs and lists
    /// the others in [`crate::Transport::skipped_devices`] instead.
    #[error("{transport}: no device could be opened: {}", summarize_skipped(skipped))]
    NoDeviceOpened {
        transport: String,
        skipped: Vec<SkippedDevice>,
    },

    /// A transport-level failure: what was being done, and, where a native library failed, its
    /// own error as the [`std::error::Error::source`] (a [`NativeError`] with libfabric's code, an
    /// [`std::io::Error`] with the verbs errno), so callers can match on it. The display includes
    /// the source's text, so a log line that prints only this error loses nothing.
    #[error("{transport}: {message}{}", source_suffix(source))]
    Transport {
        transport: String,
        message: String,
        #[source]
        source: Option<ErrorSource>,
    },

    /// Some requests of a submitted batch failed (the others completed): every failed request's
    /// index and error. Returned by waiting calls such as `TransferEngine::transfer`, so one `?`
    /// covers a refused submission and a failed transfer alike.
    #[error(transparent)]
    BatchFailed(#[from] crate::batch::BatchError),

    /// Metadata service failure (etcd, peer-to-peer lookup).
    #[error("metadata: {0}")]
    Metadata(String),

    /// An operating-system I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: Arc<std::io::Error>,
    },

    /// The engine or component was shut down.
    #[error("{0} is closed")]
    Closed(String),

    /// Another engine of this process that is not shut down holds this segment name; a second
    /// one would shadow it.
    #[error("segment name '{0}' is taken by a live engine in this process: shut that one down first, or choose another name")]
    SegmentNameTaken(String),

    /// The target's notification inbox is full (`TE_NOTIFY_QUEUE_DEPTH` undelivered messages);
    /// the notification was not queued. Retry once the target has read some.
    #[error("peer '{peer}' refused a notification: its inbox is full")]
    NotificationQueueFull { peer: String },

    /// The notification payload is larger than the target accepts (`TE_NOTIFY_MAX_BYTES`).
    #[error("peer '{peer}' refused a notification of {len} bytes: at most {max} accepted")]
    NotificationTooLarge { peer: String, len: usize, max: usize },
}

/// The underlying error kept as the [`std::error::Error::source`] of an [`Error`]: shared, so
/// the error stays cheap to clone. It derefs to the error itself, so
/// `source()` yields that error and callers can `downcast_ref` it (an `Arc` in the chain would
/// hide the type).
#[derive(Debug, Clone)]
pub struct ErrorSource(Arc<dyn std::error::Error + Send + Sync>);

impl ErrorSource {
    /// Wraps an error.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        ErrorSource(Arc::new(error))
    }
}

impl std::ops::Deref for ErrorSource {
    type Target = dyn std::error::Error + Send + Sync;
    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

fn source_suffix(source: &Option<ErrorSource>) -> String {
    source.as_ref().map(|s| format!(": {}", &**s)).unwrap_or_default()
}

/// A native library's own error: its numeric code and text (libfabric's `fi_strerror`...). Kept
/// as the source of [`Error::Transport`] so the code survives for callers that match on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text} ({library} error {code})")]
pub struct NativeError {
    /// The library (`libfabric`...).
    pub library: &'static str,
    /// Its error code, as the library returns it (libfabric: a negative `FI_E*`).
    pub code: i64,
    /// Its text for the code.
    pub text: String,
}

/// One failed item of a registration batch.
#[derive(Debug, Clone)]
pub struct RegistrationFailure {
    /// Position of the item in the caller's batch.
    pub index: usize,
    /// Size of the buffer in bytes.
    pub len: u64,
    /// Where the memory lives, as text (host, cuda:0...).
    pub location: String,
    /// Why it failed.
    pub cause: Box<Error>,
}

/// A device (NIC, provider domain) a transport did not open, and why: named in the error when no
/// device opened, and by [`crate::Transport::skipped_devices`] when others did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SkippedDevice {
    /// The device's name as the configuration names it (`rxe0`, `rdmap16s27`, `eth0`).
    pub name: String,
    /// Why it was skipped: the failed call and the native library's text.
    pub reason: String,
}

fn summarize_skipped(skipped: &[SkippedDevice]) -> String {
    if skipped.is_empty() {
        return "none was selected".into();
    }
    skipped
        .iter()
        .map(|d| format!("'{}': {}", d.name, d.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

fn summarize(failures: &[RegistrationFailure]) -> String {
    let mut parts: Vec<String> = failures
        .iter()
        .take(4)
        .map(|f| format!("#{} ({} B, {}): {}", f.index, f.len, f.location, f.cause))
        .collect();
    if failures.len() > 4 {
        parts.push(format!("and {} more", failures.len() - 4));
    }
    parts.join("; ")
}

impl Error {
    /// True for [`Error::Timeout`]: a deadline passed (a batch's, a connect's, a metadata call's).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// A transport-specific failure described by text alone.
    pub fn transport(transport: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Transport {
            transport: transport.into(),
            message: message.into(),
            source: None,
        }
    }

    /// A transport failure caused by `source` (a native library's error), kept as the source.
    pub fn transport_caused(
        transport: impl Into<String>,
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Transport {
            transport: transport.into(),
            message: context.into(),
            source: Some(ErrorSource::new(source)),
        }
    }

    /// A component that is compiled in but unusable here.
    pub fn not_available(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::NotAvailable {
            what: what.into(),
            reason: reason.into(),
        }
    }

    /// A malformed configuration value.
    pub fn config(var: impl Into<String>, value: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config {
            var: var.into(),
            value: value.into(),
            reason: reason.into(),
        }
    }
}
