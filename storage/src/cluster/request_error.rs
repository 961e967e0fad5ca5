//! Why a control request to one peer got no usable answer. Typed while the cluster handles it
//! (what timed out marks the peer suspect); the caller sees it as the reason of the key-level
//! error it caused (`StoreError::Remote`, `StoreError::Unacknowledged`), for the keys it names.

use std::io;

use super::wire::{Op, WireError};

/// The answers [`RequestError::decode`] expects, with their names.
pub(crate) const PLACES: (Op, &str) = (Op::Places, "PLACES");
pub(crate) const VERDICTS: (Op, &str) = (Op::Verdicts, "VERDICTS");

#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    /// A step of the round trip failed: connecting, sending or reading (`what` says which).
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// The peer answered `request` with a frame of another kind.
    #[error("{request} answered {got:?}")]
    Unexpected { request: &'static str, got: Op },
    /// The answer's body did not decode.
    #[error("malformed {answer}: {source}")]
    Malformed {
        answer: &'static str,
        #[source]
        source: WireError,
    },
    /// The answer decoded, but for another number of keys than the request named.
    #[error("{request} answered the wrong number of keys")]
    WrongCount { request: &'static str },
    /// The engine failed: opening the peer's segment, or writing to it.
    #[error("{what}: {source}")]
    Engine {
        what: &'static str,
        #[source]
        source: te_base::Error,
    },
    /// The thread that made the round trip ended unfinished.
    #[error("the request's thread failed")]
    ThreadFailed,
}

impl RequestError {
    pub(crate) fn io(what: &'static str, source: io::Error) -> RequestError {
        RequestError::Io { what, source }
    }

    /// A step that did not finish by the call's deadline.
    pub(crate) fn timed_out(what: &'static str) -> RequestError {
        RequestError::io(
            what,
            io::Error::new(io::ErrorKind::TimedOut, "not done within the cluster timeout"),
        )
    }

    /// Decodes `body`, the answer `got` to `request`, with `decode` when it is of the kind
    /// `want` (named `answer`); otherwise says which was wrong.
    pub(crate) fn decode<T>(
        request: &'static str,
        (want, answer): (Op, &'static str),
        got: Op,
        body: &[u8],
        decode: impl FnOnce(&[u8]) -> Result<T, WireError>,
    ) -> Result<T, RequestError> {
        if got != want {
            return Err(RequestError::Unexpected { request, got });
        }
        decode(body).map_err(|source| RequestError::Malformed { answer, source })
    }

    /// Whether the peer did not answer in time (it is then passed over as a suspect).
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self, RequestError::Io { source, .. } if source.kind() == io::ErrorKind::TimedOut)
    }
}
