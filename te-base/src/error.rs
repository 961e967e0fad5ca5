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

    /// A transport-level failure with the transport's own description (provider error text...).
    #[error("{transport}: {message}")]
    Transport { transport: String, message: String },

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

    /// The target's notification inbox is full (`TE_NOTIFY_QUEUE_DEPTH` undelivered messages);
    /// the notification was not queued. Retry once the target has read some.
    #[error("peer '{peer}' refused a notification: its inbox is full")]
    NotificationQueueFull { peer: String },

    /// The notification payload is larger than the target accepts (`TE_NOTIFY_MAX_BYTES`).
    #[error("peer '{peer}' refused a notification of {len} bytes: at most {max} accepted")]
    NotificationTooLarge { peer: String, len: usize, max: usize },
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
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// A transport-specific failure.
    pub fn transport(transport: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Transport {
            transport: transport.into(),
            message: message.into(),
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
