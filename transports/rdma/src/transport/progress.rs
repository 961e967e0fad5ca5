//! The progress thread: polls every rail's completion queue, dispatches completions to their
//! QP slot (or to the notification ring of a QP this side accepted), refills send queues, posts
//! notifications `notify` left to it, starts QP re-establishments when their backoff allows, and
//! enforces the flush grace of aborted connections.
//! One persistent thread per transport; it holds only a weak reference, so dropping the transport
//! ends it.
//!
//! Waiting ([`PollMode`]): under load the thread busy-polls; once no completion has come for the
//! spin time (at once when nothing is in flight) it arms every CQ, polls once more (completions
//! queued before arming raise no event), and sleeps in `poll(2)` on the rails' completion
//! channels and its wake socket, until a completion, a waker, or the timeout (1 ms while a
//! reconnect or an abort is pending, else 100 ms).

use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use te_base::{Error, Result};

use super::peer::{try_begin_reconnect, PeerInner, Reconnect};
use super::rails::RailSet;
use super::Shared;
use crate::config::PollMode;
use crate::verbs::{Completion, Verbs};

/// What the thread sleeps on: its own copies of the channels' descriptors (so a transport torn
/// down while it sleeps cannot leave it polling a reused number) and the wake socket.
pub(crate) struct Sleeper {
    mode: PollMode,
    /// `None` when some rail has no channel: then the thread cannot sleep on completions and
    /// polls as in [`PollMode::Busy`].
    channels: Option<Vec<OwnedFd>>,
    wake: UnixStream,
    /// What `poll(2)` waits on, built once: the wake socket, then every channel.
    fds: Vec<libc::pollfd>,
}

impl Sleeper {
    pub(crate) fn new<V: Verbs>(verbs: &Arc<V>, set: &RailSet<V>, wake: UnixStream, mode: PollMode) -> Result<Self> {
        let mut channels = Some(Vec::new());
        for rail in &set.rails {
            match (rail.channel(), channels.as_mut()) {
                (Some(ch), Some(fds)) => {
                    // SAFETY: the channel is live (the rail owns it) while this borrow is used,
                    // only to duplicate it.
                    let fd = unsafe { BorrowedFd::borrow_raw(verbs.channel_fd(ch)) };
                    fds.push(
                        fd.try_clone_to_owned()
                            .map_err(|e| Error::io("rdma: duplicating a completion channel", e))?,
                    );
                }
                _ => channels = None,
            }
        }
        let fds = std::iter::once(wake.as_raw_fd())
            .chain(channels.iter().flatten().map(AsRawFd::as_raw_fd))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        Ok(Sleeper {
            mode,
            channels,
            wake,
            fds,
        })
    }

    /// Sleeps until a channel or the wake socket is readable, or `timeout`.
    fn sleep(&mut self, timeout: Duration) {
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        let fds = &mut self.fds;
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd entries for the call's duration,
        // its descriptors owned by this sleeper.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        // On a timeout or EINTR the caller looks at everything again either way.
        if n > 0 && fds[0].revents != 0 {
            let mut sink = [0u8; 64];
            while matches!((&self.wake).read(&mut sink), Ok(n) if n > 0) {}
        }
    }
}

/// Completions taken per poll call.
const POLL_BATCH: usize = 64;

/// Starts the thread; returns its handle for waking it.
pub(crate) fn spawn<V: Verbs>(shared: Weak<Shared<V>>, sleeper: Sleeper) -> Result<std::thread::Thread> {
    let handle = std::thread::Builder::new()
        .name("te-rdma-progress".into())
        .spawn(move || run(shared, sleeper))
        .map_err(|e| Error::io("rdma: starting the progress thread", e))?;
    Ok(handle.thread().clone())
}

fn run<V: Verbs>(weak: Weak<Shared<V>>, mut sleeper: Sleeper) {
    let mut wcs = vec![Completion::default(); POLL_BATCH];
    let mut targets: Vec<Option<(Arc<PeerInner<V>>, usize)>> = Vec::with_capacity(POLL_BATCH);
    let mut last_completion = Instant::now();
    // The CQs were armed before this round's poll; a round that then finds nothing sleeps.
    let mut armed = false;
    loop {
        let Some(shared) = weak.upgrade() else { return };
        if shared.stop.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        let mut got = 0;
        for rail in &shared.rails().rails {
            let n = match shared.verbs.poll_cq(rail.cq(), &mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(rail = %rail.name, "rdma: polling the CQ: {e}");
                    0
                }
            };
            if n == 0 {
                continue;
            }
            got += n;
            targets.clear();
            {
                let map = shared.qps.read();
                targets.extend(
                    wcs[..n]
                        .iter()
                        .map(|c| map.get(&c.qp_num).and_then(|(w, i)| w.upgrade().map(|p| (p, *i)))),
                );
            }
            for (t, c) in targets.drain(..).zip(&wcs[..n]) {
                match t {
                    Some((peer, index)) => peer.on_completion(index, c, now),
                    None => super::target::on_ring_completion(&shared, c),
                }
            }
        }
        let waiting_notes = std::mem::take(&mut *shared.note_waiting.lock());
        for w in waiting_notes {
            if let Some(peer) = w.upgrade() {
                let mut inner = peer.slots[0].inner.lock();
                peer.pump_notes(&mut inner);
            }
        }
        let aborting = std::mem::take(&mut *shared.aborting.lock());
        for w in aborting {
            if let Some(peer) = w.upgrade() {
                if !peer.give_up_draining(now) {
                    shared.aborting.lock().push(w);
                }
            }
        }
        let broken = std::mem::take(&mut *shared.broken.lock());
        for (w, index) in broken {
            let Some(peer) = w.upgrade() else { continue };
            match try_begin_reconnect(&peer, index, now) {
                Reconnect::Start => {
                    shared.runtime.spawn(peer.reestablish(index));
                }
                Reconnect::Wait => shared.broken.lock().push((w, index)),
                Reconnect::Nothing => {}
            }
        }
        let outstanding = shared.outstanding();
        let waiting = !shared.broken.lock().is_empty() || !shared.aborting.lock().is_empty();
        if got > 0 {
            last_completion = now;
            if armed {
                armed = false;
                shared.sleeping.store(false, Ordering::SeqCst);
            }
            continue;
        }
        let spin = match (sleeper.mode, &sleeper.channels) {
            (PollMode::Adaptive { spin }, Some(_)) => spin,
            _ => {
                drop(shared);
                if outstanding > 0 {
                    std::thread::yield_now();
                } else if waiting {
                    std::thread::park_timeout(Duration::from_millis(1));
                } else {
                    std::thread::park_timeout(Duration::from_millis(100));
                }
                continue;
            }
        };
        if outstanding > 0 && now.duration_since(last_completion) < spin {
            drop(shared);
            std::thread::yield_now();
            continue;
        }
        if !armed {
            // Wakers must write from here on; then arm, and poll once more before sleeping.
            shared.sleeping.store(true, Ordering::SeqCst);
            let mut arm_failed = false;
            for rail in &shared.rails().rails {
                if let Err(e) = shared.verbs.req_notify_cq(rail.cq()) {
                    tracing::warn!(rail = %rail.name, "rdma: arming the CQ: {e}");
                    arm_failed = true;
                }
            }
            // A CQ that could not be armed would not wake us: poll it on the short timeout.
            armed = !arm_failed;
            if arm_failed {
                shared.sleeping.store(false, Ordering::SeqCst);
                drop(shared);
                std::thread::park_timeout(Duration::from_millis(1));
            }
            continue;
        }
        let timeout = Duration::from_millis(if waiting { 1 } else { 100 });
        drop(shared);
        sleeper.sleep(timeout);
        let Some(shared) = weak.upgrade() else { return };
        shared.sleeping.store(false, Ordering::SeqCst);
        armed = false;
        // Every event is acknowledged (a CQ with unacknowledged events cannot be destroyed), and
        // the channels must be drained to stop being readable. Each CQ is re-armed before the
        // next sleep.
        for rail in &shared.rails().rails {
            if let Some(Err(e)) = rail.channel().map(|ch| shared.verbs.take_cq_events(ch)) {
                tracing::warn!(rail = %rail.name, "rdma: taking completion events: {e}");
            }
        }
    }
}
