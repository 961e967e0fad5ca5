//! Notifications on the local copy: an in-process queue. The target's inbox is reached through
//! its domain; delivery happens on the calling thread, after the batch's copies (and their store
//! fences) finished, so every byte is in place before the message can be read.

use std::sync::Arc;

use te_base::{BatchState, Notification};

use crate::domain::Domain;

/// Queues `note` in `target`'s inbox and settles request `index` of `done` with the outcome.
pub(crate) fn deliver(target: &Domain, target_name: &str, note: Notification, done: &Arc<BatchState>, index: usize) {
    let len = note.payload.len();
    let max = target.inbox.limits().max_bytes;
    match target.inbox.deliver(note) {
        Ok(()) => done.complete(index),
        Err(refusal) => done.fail(index, refusal.into_error(target_name, len, max)),
    }
}
