//! Waiting on several owners at once: a call's control connections are polled together with an
//! eventfd that engine batches and connecting threads signal when they finish, so the caller
//! moves each owner on as soon as its own answer is in (a silent owner holds up only its keys).

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags, Timespec};

/// An eventfd one call waits on; signalled by whatever finishes in the background.
pub(crate) struct Wake {
    fd: OwnedFd,
}

impl Wake {
    /// One per call naming several owners (one syscall); `None` when no fd is left, and the
    /// caller then polls in short steps.
    pub(crate) fn new() -> Option<Arc<Wake>> {
        eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .ok()
            .map(|fd| Arc::new(Wake { fd }))
    }

    pub(crate) fn signal(&self) {
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Signals when `batch` completes (at once if it has).
    pub(crate) fn on_complete(self: &Arc<Self>, batch: &te_core::Batch) {
        let me = self.clone();
        batch.state().on_complete(Box::new(move |_| me.signal()));
    }

    fn drain(&self) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut b);
    }
}

/// How long to sleep between checks when no eventfd could be made.
const STEP_WITHOUT_WAKE: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: 1_000_000,
};

/// Waits until one of `socks` is readable (or closed), `wake` is signalled, or `end`; returns
/// which sockets are ready. `busy`: something not on a socket is already done (no wait at all);
/// `background`: something not on a socket may finish meanwhile (without `wake`, check again
/// within a millisecond).
pub(crate) fn wait_any(
    socks: &[BorrowedFd<'_>],
    wake: Option<&Wake>,
    busy: bool,
    background: bool,
    end: Instant,
) -> Vec<bool> {
    let mut fds: Vec<PollFd<'_>> = socks.iter().map(|s| PollFd::new(s, PollFlags::IN)).collect();
    if let Some(w) = wake {
        fds.push(PollFd::new(&w.fd, PollFlags::IN));
    }
    let left = end.saturating_duration_since(Instant::now());
    let mut timeout = Timespec {
        tv_sec: left.as_secs() as i64,
        tv_nsec: left.subsec_nanos() as i64,
    };
    if busy {
        timeout = Timespec { tv_sec: 0, tv_nsec: 0 };
    } else if background && wake.is_none() && left.as_nanos() > STEP_WITHOUT_WAKE.tv_nsec as u128 {
        timeout = STEP_WITHOUT_WAKE;
    }
    let n = poll(&mut fds, Some(&timeout)).unwrap_or(0);
    if n > 0 && wake.is_some() && !fds[socks.len()].revents().is_empty() {
        if let Some(w) = wake {
            w.drain();
        }
    }
    fds[..socks.len()]
        .iter()
        .map(|f| n > 0 && !f.revents().is_empty())
        .collect()
}
