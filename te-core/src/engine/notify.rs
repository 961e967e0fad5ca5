//! Notifications: a write batch that tells its target(s) when it is done, bare notifications to a
//! segment, and the receiving side (this engine's inbox).
//!
//! A notified batch is an ordinary batch plus a completion hook ([`BatchState::on_complete`]):
//! once every request of the batch succeeded, the hook hands the message to each target segment's
//! first route that is neither paused nor disconnected and accepts it ([`Peer::notify`]). The
//! batch completes only when every byte is at the destination, so the target can never read the
//! message before the data; and since hooks run in the order batches complete and each peer keeps
//! its messages in order, the target receives them in that order while they take one route (across
//! a failover, messages on two routes may arrive in either order). A batch with any failed or cancelled request sends nothing: its notification
//! outcome is `Cancelled`.

use std::sync::Arc;

use te_base::{
    Batch, BatchReport, BatchState, Error, Notification, NotifyInbox, Peer, Result, SegmentId, TransferRequest,
};

use super::{EngineInner, SubmitOptions, TransferEngine};
use crate::segment::SegmentHandle;

/// A submitted batch that carries a notification.
#[derive(Debug, Clone)]
pub struct NotifiedBatch {
    /// The data: as any [`Batch`].
    pub data: Batch,
    /// The notification: one request per target segment, settled when the target queued the
    /// message (done), refused it (failed: [`Error::NotificationQueueFull`],
    /// [`Error::NotificationTooLarge`], or the connection's error), or when the data failed and
    /// nothing was sent (cancelled).
    pub notification: Batch,
}

impl NotifiedBatch {
    /// Waits for the data, then for every target's answer to the notification. Failed data gives
    /// [`Error::BatchFailed`]; data that arrived with a refused notification gives the refusal
    /// ([`Error::NotificationQueueFull`], [`Error::NotificationTooLarge`], or the connection's
    /// error), and [`NotifiedBatch::data`] then reports the data's success.
    pub async fn wait(&self) -> Result<BatchReport> {
        let report = self.data.wait().await?;
        answer(&self.notification).await?;
        Ok(report)
    }
}

/// Waits for a notification's answers: `Ok` once every target queued it, else the first refusal
/// (or `Cancelled` when nothing was sent).
async fn answer(notification: &Batch) -> Result<()> {
    match notification.wait().await {
        Ok(_) => Ok(()),
        Err(e) => Err(e.into_first_error()),
    }
}

/// This engine's received notifications, in arrival order, each tagged with its sender: an
/// async [`Stream`](futures_core::Stream), [`recv`](Notifications::recv) and the non-blocking
/// [`try_recv`](Notifications::try_recv).
///
/// Every clone takes from the same queue; a message is received once.
pub struct Notifications {
    inbox: Arc<NotifyInbox>,
    /// The stream's registration for the next arrival.
    waiter: Option<te_base::notify::Waiter>,
}

impl Clone for Notifications {
    fn clone(&self) -> Self {
        Notifications {
            inbox: self.inbox.clone(),
            waiter: None,
        }
    }
}

impl std::fmt::Debug for Notifications {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifications").field("inbox", &self.inbox).finish()
    }
}

impl futures_core::Stream for Notifications {
    type Item = Notification;

    /// Ends (`None`) once the engine shut down and every waiting notification was taken.
    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Notification>> {
        let this = self.get_mut();
        this.inbox.poll_recv(&mut this.waiter, cx)
    }
}

impl Notifications {
    /// Waits for the next notification; `None` once the engine shut down and the queue is empty.
    pub async fn recv(&self) -> Option<Notification> {
        self.inbox.recv().await
    }

    /// The oldest waiting notification, without waiting.
    pub fn try_recv(&self) -> Option<Notification> {
        self.inbox.try_recv()
    }

    /// Puts a received notification back as the oldest waiting one: for a receiver that took
    /// it but could not hand it on (a binding whose waiter was cancelled), so that cancelling a
    /// wait never consumes a message.
    pub fn put_back(&self, note: Notification) {
        self.inbox.put_back(note)
    }

    /// Notifications waiting.
    pub fn len(&self) -> usize {
        self.inbox.len()
    }

    /// True when none is waiting.
    pub fn is_empty(&self) -> bool {
        self.inbox.is_empty()
    }
}

impl TransferEngine {
    /// The notifications peers sent to this engine's segment.
    ///
    /// ```no_run
    /// # async fn demo(engine: te_core::TransferEngine) {
    /// let inbox = engine.notifications();
    /// while let Some(n) = inbox.recv().await {
    ///     println!("{} says {:?}", n.from, n.payload);
    /// }
    /// # }
    /// ```
    pub fn notifications(&self) -> Notifications {
        Notifications {
            inbox: self.inbox().clone(),
            waiter: None,
        }
    }

    /// Submits a batch that sends `payload` to every segment it writes to (or reads from) once
    /// all of its requests completed; see [`NotifiedBatch`]. Refused up front, like
    /// [`TransferEngine::submit`], if a request is malformed or the payload is above
    /// [`te_base::notify::MAX_PAYLOAD_LIMIT`].
    pub fn submit_notified(
        &self,
        requests: &[TransferRequest],
        payload: impl Into<Vec<u8>>,
        opts: &SubmitOptions,
    ) -> Result<NotifiedBatch> {
        self.inner.check_open()?;
        self.inner.submit_notified(requests, payload.into(), opts)
    }

    /// Sends `payload` to `segment` on its own, ordered after the notified batches to it that
    /// already completed. Returns once the target queued it, or with its refusal.
    pub async fn notify(&self, segment: &SegmentHandle, payload: impl Into<Vec<u8>>) -> Result<()> {
        self.inner.check_open()?;
        let peers = self.inner.notify_routes(segment.id())?;
        let state = BatchState::new(vec![0].into());
        let note = self.inner.note(payload.into())?;
        send_note(&peers, note, &state, 0)?;
        answer(&Batch::new(state)).await
    }
}

impl EngineInner {
    /// A notification from this engine, if the payload can travel at all.
    fn note(&self, payload: Vec<u8>) -> Result<Notification> {
        if payload.len() > te_base::notify::MAX_PAYLOAD_LIMIT {
            return Err(Error::NotificationTooLarge {
                peer: self.name.clone(),
                len: payload.len(),
                max: te_base::notify::MAX_PAYLOAD_LIMIT,
            });
        }
        Ok(Notification {
            from: self.name.clone(),
            payload,
        })
    }

    /// The routes a notification to segment `id` may take, best first: those not avoided (paused
    /// or disconnected) in order of preference, then the rest. The message goes on the first that
    /// accepts it ([`send_note`]), so after a failover it rides the route that carried the data.
    fn notify_routes(&self, id: SegmentId) -> Result<Vec<Arc<dyn Peer>>> {
        let segs = self.segments.read();
        let seg = segs
            .get(id.0 as usize)
            .filter(|s| !s.routes.is_empty())
            .ok_or_else(|| Error::UnknownSegment(format!("#{}", id.0)))?;
        let (good, avoided): (Vec<_>, Vec<_>) = seg.routes.iter().partition(|r| !r.avoided());
        Ok(good.into_iter().chain(avoided).map(|r| r.peer.clone()).collect())
    }

    fn submit_notified(
        self: &Arc<Self>,
        requests: &[TransferRequest],
        payload: Vec<u8>,
        opts: &SubmitOptions,
    ) -> Result<NotifiedBatch> {
        let note = self.note(payload)?;
        // Distinct targets, per batch (most batches have one): resolved before anything starts,
        // so an unknown segment refuses the batch like `submit` does.
        let mut targets: Vec<SegmentId> = Vec::new();
        for r in requests {
            if !targets.contains(&r.segment) {
                targets.push(r.segment);
            }
        }
        let peers = targets
            .iter()
            .map(|&id| self.notify_routes(id))
            .collect::<Result<Vec<_>>>()?;
        let data = self.submit(requests, opts)?;
        let notification = BatchState::new(vec![0; peers.len()].into());
        let answers = notification.clone();
        data.state().on_complete(Box::new(move |batch| {
            for (i, peer) in peers.iter().enumerate() {
                let peer = peer.as_slice();
                if !batch.succeeded() {
                    answers.cancel(i);
                    continue;
                }
                if let Err(e) = send_note(peer, note.clone(), &answers, i) {
                    answers.fail(i, e);
                }
            }
        }));
        Ok(NotifiedBatch {
            data,
            notification: Batch::new(notification),
        })
    }
}

/// Hands `note` to the first of `routes` that takes it (an `Err` from a route means it sent
/// nothing, so the next one may); the last refusal if none does.
fn send_note(routes: &[Arc<dyn Peer>], note: Notification, done: &Arc<BatchState>, index: usize) -> Result<()> {
    let mut last = None;
    for peer in routes {
        match peer.notify(note.clone(), done, index) {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::not_available("notifications", "the segment has no route")))
}
