//! Batches cut short on one connection ([`crate::Peer::abort_batch`]: their deadline passed), for
//! transports that stop a batch's work where it stands (between two system calls, before posting)
//! while other batches on the connection go on.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::{BatchState, Error};

/// The aborted batches still alive (an entry goes once its batch was dropped).
#[derive(Default)]
pub struct BatchAborts {
    /// Entries in `list`, read on the data path (once per system call or post) so the lock is
    /// taken only while some batch is aborted.
    live: AtomicUsize,
    list: Mutex<Vec<(Weak<BatchState>, Error)>>,
}

impl BatchAborts {
    /// Marks `batch` aborted with `err`.
    pub fn abort(&self, batch: &Arc<BatchState>, err: Error) {
        let mut list = self.list.lock();
        list.retain(|(b, _)| b.strong_count() > 0);
        if !list.iter().any(|(b, _)| std::ptr::eq(b.as_ptr(), Arc::as_ptr(batch))) {
            list.push((Arc::downgrade(batch), err));
        }
        self.live.store(list.len(), Ordering::Release);
    }

    /// The error `batch` was aborted with, if it was.
    pub fn error_of(&self, batch: &BatchState) -> Option<Error> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        // Batches dropped since their cut are forgotten here too, so the data path stops taking
        // this lock once no cut batch is alive (not only at the next cut).
        let mut list = self.list.lock();
        list.retain(|(b, _)| b.strong_count() > 0);
        self.live.store(list.len(), Ordering::Release);
        list.iter()
            .find(|(b, _)| std::ptr::eq(b.as_ptr(), batch))
            .map(|(_, e)| e.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout() -> Error {
        Error::Timeout {
            what: "test".into(),
            after_ms: 1,
        }
    }

    #[test]
    fn only_the_aborted_batch_is_named_and_dropped_batches_are_forgotten() {
        let aborts = BatchAborts::default();
        let a = BatchState::new(vec![1].into());
        let b = BatchState::new(vec![1].into());
        assert!(aborts.error_of(&a).is_none());
        aborts.abort(&a, timeout());
        aborts.abort(&a, timeout());
        assert!(matches!(aborts.error_of(&a), Some(Error::Timeout { .. })));
        assert!(aborts.error_of(&b).is_none());
        drop(a);
        assert!(aborts.error_of(&b).is_none());
        assert_eq!(
            aborts.live.load(Ordering::Acquire),
            0,
            "a lookup forgets a dropped batch"
        );
        aborts.abort(&b, timeout());
        assert_eq!(aborts.list.lock().len(), 1, "the dropped batch's entry went");
        assert!(aborts.error_of(&b).is_some());
    }
}
