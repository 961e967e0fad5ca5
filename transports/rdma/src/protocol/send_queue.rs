//! One QP's send queue as the transport sees it: items waiting for a slot, items in flight in
//! posting order, which ones to signal, and what a completion retires.
//!
//! Rules it enforces:
//! - at most `depth` work requests are outstanding (posting more fails with ENOMEM on hardware);
//! - one in every `signal_every` requests is signalled, and so is the last request of every post,
//!   so a completion always arrives for everything posted and slots come back;
//! - a signalled success completion retires every request up to and including it (RC completes in
//!   order; unsignalled requests before it are done);
//! - an error completion fails its own request and hands every other outstanding request back
//!   for retry; the queue is then broken until [`SendQueue::reset`] starts a new epoch, and stale
//!   completions of the old epoch are ignored.

use std::collections::VecDeque;

/// What to post: an item's sequence number (its `wr_id`) and whether it is signalled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostSlot {
    /// Sequence number, used as the work request id.
    pub seq: u64,
    /// Generate a completion.
    pub signaled: bool,
}

/// What an error completion did to the queue.
#[derive(Debug)]
pub struct ErrorSplit<T> {
    /// The item the error completion names.
    pub failed: Option<T>,
    /// Items retired as done: posted before the failed one (RC completes in order).
    pub done: Vec<T>,
    /// Everything else that was in flight or waiting: to be retried elsewhere or after recovery.
    pub requeue: Vec<T>,
}

/// A QP's send queue.
#[derive(Debug)]
pub struct SendQueue<T> {
    depth: usize,
    signal_every: u32,
    pending: VecDeque<T>,
    in_flight: VecDeque<(u64, T)>,
    next_seq: u64,
    since_signal: u32,
    epoch_start: u64,
    broken: bool,
}

impl<T> SendQueue<T> {
    /// A queue of `depth` slots signalling every `signal_every` requests.
    pub fn new(depth: u32, signal_every: u32) -> Self {
        let depth = depth.max(1) as usize;
        SendQueue {
            depth,
            signal_every: signal_every.clamp(1, depth as u32),
            pending: VecDeque::new(),
            in_flight: VecDeque::with_capacity(depth),
            next_seq: 1,
            since_signal: 0,
            epoch_start: 1,
            broken: false,
        }
    }

    /// Queues an item for posting.
    pub fn push(&mut self, item: T) {
        self.pending.push_back(item);
    }

    /// Items waiting for a slot.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Items posted and not yet retired.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// True after an error completion, until [`SendQueue::reset`].
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Moves as many waiting items into flight as slots allow, calling `emit` for each in order.
    /// Returns how many. Nothing moves while broken.
    pub fn post_ready(&mut self, mut emit: impl FnMut(PostSlot, &T)) -> usize {
        if self.broken {
            return 0;
        }
        let n = self.pending.len().min(self.depth - self.in_flight.len());
        for i in 0..n {
            let item = self.pending.pop_front().expect("counted above");
            let seq = self.next_seq;
            self.next_seq += 1;
            self.since_signal += 1;
            let signaled = self.since_signal >= self.signal_every || i + 1 == n;
            if signaled {
                self.since_signal = 0;
            }
            emit(PostSlot { seq, signaled }, &item);
            self.in_flight.push_back((seq, item));
        }
        n
    }

    /// `ibv_post_send` accepted only the first `accepted` of the last `posted` items: the rest go
    /// back to the front of the queue, in order, to be posted again.
    pub fn unpost(&mut self, posted: usize, accepted: usize) {
        for _ in accepted..posted {
            if let Some((_, item)) = self.in_flight.pop_back() {
                self.pending.push_front(item);
                self.next_seq -= 1;
            }
        }
        // The last accepted request may not be signalled; make sure a later post signals.
        self.since_signal = self.signal_every;
    }

    /// A success completion for `wr_id`: retires it and everything posted before it.
    pub fn on_success(&mut self, wr_id: u64, mut retire: impl FnMut(T)) -> usize {
        if wr_id < self.epoch_start {
            return 0;
        }
        let mut n = 0;
        while self.in_flight.front().is_some_and(|(s, _)| *s <= wr_id) {
            let (_, item) = self.in_flight.pop_front().expect("checked");
            retire(item);
            n += 1;
        }
        n
    }

    /// An error completion for `wr_id`. `None` if it belongs to an old epoch or the queue already
    /// handed everything back (later flush completions of the same failure).
    pub fn on_error(&mut self, wr_id: u64) -> Option<ErrorSplit<T>> {
        if wr_id < self.epoch_start || self.broken {
            return None;
        }
        self.broken = true;
        let mut done = Vec::new();
        let mut failed = None;
        let mut requeue = Vec::with_capacity(self.in_flight.len() + self.pending.len());
        for (seq, item) in self.in_flight.drain(..) {
            match seq.cmp(&wr_id) {
                std::cmp::Ordering::Less => done.push(item),
                std::cmp::Ordering::Equal => failed = Some(item),
                std::cmp::Ordering::Greater => requeue.push(item),
            }
        }
        requeue.extend(self.pending.drain(..));
        Some(ErrorSplit { failed, done, requeue })
    }

    /// The QP failed outside a completion (the provider refused a post): the queue is broken and
    /// every item comes back for retry.
    pub fn fail_all(&mut self) -> Vec<T> {
        self.broken = true;
        self.drain_all()
    }

    /// Takes the items never posted (an aborted connection fails them).
    pub fn take_pending(&mut self) -> Vec<T> {
        self.pending.drain(..).collect()
    }

    /// Takes the waiting items `pick` selects, keeping the others in order (a batch cut short).
    pub fn take_pending_where(&mut self, mut pick: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut taken = Vec::new();
        let mut kept = VecDeque::with_capacity(self.pending.len());
        for item in self.pending.drain(..) {
            if pick(&item) {
                taken.push(item);
            } else {
                kept.push_back(item);
            }
        }
        self.pending = kept;
        taken
    }

    /// True if an item `pick` selects is posted and not yet retired.
    pub fn any_in_flight(&self, mut pick: impl FnMut(&T) -> bool) -> bool {
        self.in_flight.iter().any(|(_, item)| pick(item))
    }

    /// Any completion for `wr_id` of a QP being drained (moved to ERROR on purpose): retires
    /// every in-flight item up to and including it, telling `retire` whether the item is the one
    /// the completion names (RC completes in order: the others before it ran to the end).
    /// Stale completions of an older epoch retire nothing.
    pub fn retire_through(&mut self, wr_id: u64, mut retire: impl FnMut(T, bool)) -> usize {
        if wr_id < self.epoch_start {
            return 0;
        }
        let mut n = 0;
        while self.in_flight.front().is_some_and(|(s, _)| *s <= wr_id) {
            let (seq, item) = self.in_flight.pop_front().expect("checked");
            retire(item, seq == wr_id);
            n += 1;
        }
        n
    }

    /// Takes every waiting and in-flight item out (the QP is being torn down).
    pub fn drain_all(&mut self) -> Vec<T> {
        let mut out: Vec<T> = self.in_flight.drain(..).map(|(_, t)| t).collect();
        out.extend(self.pending.drain(..));
        out
    }

    /// The QP was reset and reconnected: a new epoch starts; completions of older work
    /// requests are ignored from now on. Anything still recorded in flight (normally nothing: an
    /// error already handed it back) goes back to the front of the queue, never lost.
    pub fn reset(&mut self) {
        while let Some((_, item)) = self.in_flight.pop_back() {
            self.pending.push_front(item);
        }
        self.epoch_start = self.next_seq;
        self.since_signal = 0;
        self.broken = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post_all(q: &mut SendQueue<u32>) -> Vec<(PostSlot, u32)> {
        let mut v = Vec::new();
        q.post_ready(|s, &t| v.push((s, t)));
        v
    }

    #[test]
    fn draining_retires_in_order_and_names_the_completed_item() {
        let mut q = SendQueue::new(8, 4);
        for i in 0..5u32 {
            q.push(i);
        }
        let posted = post_all(&mut q);
        q.push(99);
        assert_eq!(q.take_pending(), vec![99]);
        let mut seen = Vec::new();
        assert_eq!(q.retire_through(posted[2].0.seq, |t, at| seen.push((t, at))), 3);
        assert_eq!(seen, vec![(0, false), (1, false), (2, true)]);
        assert_eq!(q.retire_through(posted[2].0.seq, |_, _| panic!("retired twice")), 0);
        assert_eq!(q.retire_through(posted[4].0.seq, |_, _| {}), 2);
        assert_eq!(q.in_flight(), 0);
    }

    proptest::proptest! {
        /// Whatever the depth, signalling interval, arrival pattern and error, every item ends
        /// exactly once as retired, failed or requeued, and the depth is never exceeded.
        #[test]
        fn every_item_is_accounted_for_exactly_once(
            depth in 1u32..32,
            every in 1u32..32,
            arrivals in proptest::collection::vec(0usize..20, 1..20),
            error_round in proptest::option::of(0usize..20),
        ) {
            let mut q = SendQueue::new(depth, every);
            let mut seen = std::collections::HashSet::new();
            let mut next = 0u32;
            let mut pushed = 0u32;
            for (round, n) in arrivals.iter().enumerate() {
                for _ in 0..*n {
                    q.push(next);
                    next += 1;
                    pushed += 1;
                }
                let mut signalled = Vec::new();
                q.post_ready(|s, _| if s.signaled { signalled.push(s.seq) });
                proptest::prop_assert!(q.in_flight() <= depth as usize);
                if error_round == Some(round) {
                    if let Some(&first) = signalled.first() {
                        let split = q.on_error(first).unwrap();
                        for t in split.done.into_iter().chain(split.failed).chain(split.requeue) {
                            proptest::prop_assert!(seen.insert(t));
                        }
                        q.reset();
                        continue;
                    }
                }
                // The hardware completes every signalled request.
                for s in signalled {
                    let mut err = None;
                    q.on_success(s, |t| if !seen.insert(t) { err = Some(t) });
                    proptest::prop_assert!(err.is_none());
                }
            }
            // Drain what is left.
            loop {
                let mut signalled = Vec::new();
                q.post_ready(|s, _| if s.signaled { signalled.push(s.seq) });
                if signalled.is_empty() {
                    break;
                }
                for s in signalled {
                    q.on_success(s, |t| { seen.insert(t); });
                }
            }
            proptest::prop_assert_eq!(seen.len() as u32, pushed);
            proptest::prop_assert_eq!(q.in_flight(), 0);
        }
    }

    #[test]
    fn respects_depth_and_signals_every_n_and_the_last() {
        let mut q = SendQueue::new(8, 3);
        for i in 0..20 {
            q.push(i);
        }
        let posted = post_all(&mut q);
        assert_eq!(posted.len(), 8, "depth");
        assert_eq!(q.pending(), 12);
        let signaled: Vec<u32> = posted.iter().filter(|(s, _)| s.signaled).map(|(_, t)| *t).collect();
        assert_eq!(signaled, vec![2, 5, 7], "every 3rd and the last of the post");
        // Nothing more fits until a completion retires something.
        assert!(post_all(&mut q).is_empty());
        let mut retired = Vec::new();
        q.on_success(posted[5].0.seq, |t| retired.push(t));
        assert_eq!(
            retired,
            vec![0, 1, 2, 3, 4, 5],
            "unsignalled ones retire with the signalled one"
        );
        assert_eq!(post_all(&mut q).len(), 6);
        assert_eq!(q.in_flight(), 8);
    }

    #[test]
    fn a_failed_post_returns_the_rejected_items_in_order() {
        let mut q = SendQueue::new(16, 4);
        for i in 0..6 {
            q.push(i);
        }
        let posted = post_all(&mut q);
        q.unpost(posted.len(), 2);
        assert_eq!(q.in_flight(), 2);
        let again = post_all(&mut q);
        assert_eq!(again.iter().map(|(_, t)| *t).collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        assert_eq!(again[0].0.seq, posted[2].0.seq, "sequence numbers are reused");
        assert!(again.last().unwrap().0.signaled);
    }

    #[test]
    fn error_completion_splits_done_failed_and_requeued() {
        let mut q = SendQueue::new(8, 8);
        for i in 0..10 {
            q.push(i);
        }
        let posted = post_all(&mut q);
        let split = q.on_error(posted[3].0.seq).unwrap();
        assert_eq!(split.done, vec![0, 1, 2]);
        assert_eq!(split.failed, Some(3));
        assert_eq!(split.requeue, vec![4, 5, 6, 7, 8, 9]);
        assert!(q.is_broken());
        assert!(post_all(&mut q).is_empty(), "nothing posts on a broken QP");
        // Flush completions of the same failure are ignored.
        assert!(q.on_error(posted[5].0.seq).is_none());
        assert_eq!(q.on_success(posted[7].0.seq, |_| panic!("nothing to retire")), 0);
    }

    #[test]
    fn a_cut_takes_only_the_waiting_items_it_names_and_sees_those_in_flight() {
        let mut q = SendQueue::new(4, 1);
        for i in 0..10 {
            q.push(i);
        }
        post_all(&mut q); // 0..4 in flight
        assert!(q.any_in_flight(|&i| i == 2));
        assert!(!q.any_in_flight(|&i| i == 6));
        assert_eq!(q.take_pending_where(|&i| i % 2 == 0), vec![4, 6, 8]);
        assert_eq!(q.pending(), 3);
        assert_eq!(q.in_flight(), 4, "what is posted stays posted");
        let rest = q.drain_all();
        assert_eq!(rest, vec![0, 1, 2, 3, 5, 7, 9], "the others kept their order");
    }

    #[test]
    fn fail_all_hands_everything_back_and_breaks_the_queue() {
        let mut q = SendQueue::new(2, 1);
        for i in 0..4 {
            q.push(i);
        }
        post_all(&mut q);
        assert_eq!(q.fail_all(), vec![0, 1, 2, 3]);
        assert!(q.is_broken());
        assert!(q.on_error(1).is_none(), "later flush completions are ignored");
    }

    #[test]
    fn reset_starts_an_epoch_and_ignores_stale_completions() {
        let mut q = SendQueue::new(4, 1);
        q.push(1);
        let old = post_all(&mut q);
        q.on_error(old[0].0.seq).unwrap();
        q.reset();
        assert!(!q.is_broken());
        q.push(2);
        let new = post_all(&mut q);
        assert!(new[0].0.seq > old[0].0.seq);
        assert!(q.on_error(old[0].0.seq).is_none(), "stale error of the old epoch");
        assert_eq!(q.on_success(old[0].0.seq, |_| panic!("stale")), 0);
        let mut got = vec![];
        q.on_success(new[0].0.seq, |t| got.push(t));
        assert_eq!(got, vec![2]);
    }
}
