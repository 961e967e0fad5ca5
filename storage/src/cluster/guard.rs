//! What a directory peer lets another member do to it (docs/security.md, "Trust"): a member
//! speaks only for itself, stores only so much here, and looks up only so much per second.
//!
//! - PUBLISH and UNPUBLISH must name, as owner, the member the connection's handshake proved
//!   (the member name is bound into both proofs), and that member must be a current one.
//! - Entries per source are capped (`UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE`): past the cap a
//!   PUBLISH is refused, the keys already held stay.
//! - LOOKUP work is a token bucket of keys per second per source member
//!   (`UMBP_CLUSTER_LOOKUP_KEYS_PER_S`, a burst of one second's worth), every non-member sharing
//!   one bucket: a LOOKUP past it waits for tokens (its own connection only), or is refused when
//!   that wait would exceed the frame timeout. One lock per message, not per key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use thiserror::Error;

/// Why a directory request from another peer was refused (its text is the REFUSED reason).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DirectoryRefusal {
    /// The message names another owner than the member its connection proved.
    #[error("{op} names {named:?} as owner, but this connection speaks for {proven:?}")]
    ForgedOwner {
        /// PUBLISH or UNPUBLISH.
        op: &'static str,
        /// The owner the message named.
        named: String,
        /// The member the handshake proved.
        proven: String,
    },
    /// The connection named no member in its handshake.
    #[error("{op} from a connection that named no member")]
    Anonymous {
        /// PUBLISH or UNPUBLISH.
        op: &'static str,
    },
    /// The connection's member is not in the current membership.
    #[error("{op} from {name:?}, which is not a current member")]
    NotMember {
        /// PUBLISH or UNPUBLISH.
        op: &'static str,
        /// The member the handshake proved.
        name: String,
    },
    /// The connection comes from another IP than the one its member announced.
    #[error(
        "{op} in the name of {name:?} from {from}, but {name:?} announced {announced} (UMBP_CLUSTER_CHECK_SOURCE_ADDR)"
    )]
    WrongSource {
        /// PUBLISH, UNPUBLISH or RETIRE.
        op: &'static str,
        /// The member the handshake proved.
        name: String,
        /// The connection's source IP.
        from: std::net::IpAddr,
        /// The IP of the control address the member announced.
        announced: std::net::IpAddr,
    },
    /// A RETIRE from a peer that is not a directory peer of every key it names.
    #[error("RETIRE from {name:?}, which is not a directory peer of every key it names")]
    NotDirectoryPeer {
        /// The member the handshake proved (empty: none).
        name: String,
    },
    /// The source holds as many entries here as one source may.
    #[error("{source_name:?} may hold at most {cap} directory entries here (UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE); {refused} keys refused")]
    EntriesCapped {
        /// The publishing member.
        source_name: String,
        /// The cap.
        cap: usize,
        /// Keys of this PUBLISH not indexed.
        refused: usize,
    },
    /// The source's LOOKUP rate is over its budget for longer than one frame timeout.
    #[error("LOOKUP rate of {source_name:?} over {rate} keys/s (UMBP_CLUSTER_LOOKUP_KEYS_PER_S)")]
    LookupRate {
        /// The asking member (empty: a non-member).
        source_name: String,
        /// The budget.
        rate: u64,
    },
}

/// Counts of refused and throttled directory requests.
#[derive(Debug, Default)]
pub(crate) struct GuardCounters {
    /// PUBLISH/UNPUBLISH/RETIRE refused: forged owner, anonymous, not a member, or from another
    /// IP than the member announced.
    pub(crate) refused_identity: AtomicU64,
    /// PUBLISH refused (wholly or partly) by the entries-per-source cap.
    pub(crate) refused_capped: AtomicU64,
    /// LOOKUPs that waited for, or were refused, tokens.
    pub(crate) lookups_throttled: AtomicU64,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The per-source limits of one directory peer.
pub(crate) struct Guard {
    pub(crate) max_entries_per_source: usize,
    /// Requests in a member's name must come from the IP it announced.
    pub(crate) check_source_addr: bool,
    lookup_rate: u64,
    buckets: Mutex<HashMap<Arc<str>, Bucket>>,
    pub(crate) counters: GuardCounters,
}

impl Guard {
    pub(crate) fn new(max_entries_per_source: usize, lookup_rate: u64, check_source_addr: bool) -> Guard {
        Guard {
            max_entries_per_source,
            check_source_addr,
            lookup_rate,
            buckets: Mutex::default(),
            counters: GuardCounters::default(),
        }
    }

    /// Checks that `named` (the owner a PUBLISH/UNPUBLISH names) is `proven` (the connection's
    /// member) and a current member (`is_member`).
    pub(crate) fn check_owner(
        &self,
        op: &'static str,
        named: &str,
        proven: Option<&str>,
        is_member: bool,
    ) -> Result<(), DirectoryRefusal> {
        let r = match proven {
            None => Err(DirectoryRefusal::Anonymous { op }),
            Some(p) if p != named => Err(DirectoryRefusal::ForgedOwner {
                op,
                named: named.to_owned(),
                proven: p.to_owned(),
            }),
            Some(p) if !is_member => Err(DirectoryRefusal::NotMember { op, name: p.to_owned() }),
            Some(_) => Ok(()),
        };
        if r.is_err() {
            self.counters.refused_identity.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// Checks that a request in `name`'s name comes from the IP `name` announced (`announced`:
    /// the IP of its control address; `None`, not a member, or unspecified: not checked here).
    pub(crate) fn check_source(
        &self,
        op: &'static str,
        name: &str,
        from: std::net::IpAddr,
        announced: Option<std::net::IpAddr>,
    ) -> Result<(), DirectoryRefusal> {
        let Some(announced) = announced else { return Ok(()) };
        if !self.check_source_addr || announced.is_unspecified() || announced.to_canonical() == from.to_canonical() {
            return Ok(());
        }
        self.counters.refused_identity.fetch_add(1, Ordering::Relaxed);
        Err(DirectoryRefusal::WrongSource {
            op,
            name: name.to_owned(),
            from,
            announced,
        })
    }

    /// Takes `keys` tokens from `source`'s bucket (`source`: a member's name, or `""` for every
    /// non-member); returns how long the LOOKUP must wait first (zero: none), or the refusal
    /// when that is longer than `max_wait`.
    pub(crate) fn lookup_tokens(
        &self,
        source: &Arc<str>,
        keys: usize,
        max_wait: Duration,
        members: usize,
    ) -> Result<Duration, DirectoryRefusal> {
        let rate = self.lookup_rate as f64;
        let now = Instant::now();
        let mut b = self.buckets.lock();
        if b.len() > 2 * members + 8 {
            // Buckets of peers long gone: a fresh bucket is full anyway.
            b.retain(|_, x| now.duration_since(x.at) < Duration::from_secs(2));
        }
        let x = b.entry(source.clone()).or_insert(Bucket { tokens: rate, at: now });
        x.tokens = (x.tokens + now.duration_since(x.at).as_secs_f64() * rate).min(rate);
        x.at = now;
        let wait = if x.tokens > 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((1.0 - x.tokens) / rate)
        };
        if wait > max_wait {
            self.counters.lookups_throttled.fetch_add(1, Ordering::Relaxed);
            return Err(DirectoryRefusal::LookupRate {
                source_name: source.to_string(),
                rate: self.lookup_rate,
            });
        }
        if !wait.is_zero() {
            self.counters.lookups_throttled.fetch_add(1, Ordering::Relaxed);
        }
        // Taken now: the wait pays for it; a LOOKUP larger than the burst runs into debt.
        x.tokens -= keys as f64;
        Ok(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_proven_current_member_may_name_itself_owner() {
        let g = Guard::new(10, 100, true);
        assert!(g.check_owner("PUBLISH", "a", Some("a"), true).is_ok());
        let e = g.check_owner("PUBLISH", "b", Some("a"), true).unwrap_err();
        assert!(matches!(e, DirectoryRefusal::ForgedOwner { .. }), "{e}");
        assert!(
            e.to_string().contains("\"b\"") && e.to_string().contains("\"a\""),
            "{e}"
        );
        assert!(matches!(
            g.check_owner("UNPUBLISH", "a", None, true),
            Err(DirectoryRefusal::Anonymous { .. })
        ));
        assert!(matches!(
            g.check_owner("PUBLISH", "a", Some("a"), false),
            Err(DirectoryRefusal::NotMember { .. })
        ));
        assert_eq!(g.counters.refused_identity.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn a_source_past_its_lookup_budget_waits_then_is_refused() {
        let g = Guard::new(10, 1000, true);
        let a: Arc<str> = Arc::from("a");
        let b: Arc<str> = Arc::from("b");
        // A full bucket (one second's worth) serves at once, even one LOOKUP larger than it.
        assert_eq!(
            g.lookup_tokens(&a, 1500, Duration::from_secs(10), 2).unwrap(),
            Duration::ZERO
        );
        // Now in debt by ~500 keys: the next waits about half a second...
        let w = g.lookup_tokens(&a, 10, Duration::from_secs(10), 2).unwrap();
        assert!(w > Duration::from_millis(400), "{w:?}");
        // ... or is refused when it may not wait that long; another source is not affected.
        assert!(matches!(
            g.lookup_tokens(&a, 10, Duration::from_millis(1), 2),
            Err(DirectoryRefusal::LookupRate { .. })
        ));
        assert_eq!(g.lookup_tokens(&b, 10, Duration::ZERO, 2).unwrap(), Duration::ZERO);
        assert_eq!(g.counters.lookups_throttled.load(Ordering::Relaxed), 2);
    }
}
