//! `te-bench transfer --scheme S --peers N`: many processes move bytes at once, on loopback.
//!
//! - pairwise: N pairs, 2N processes; initiator process i moves its bytes to or from its own
//!   target process i, and nothing else.
//! - many-to-one: N initiator processes and one target process whose buffer holds N ranges of
//!   `--total-bytes`; initiator i moves its own range (from i x `--total-bytes`).
//! - one-to-many: this process is the one initiator: one engine with N target processes open;
//!   each repetition runs one batch per target, the N batches concurrently.
//!
//! Initiator processes ([`worker`]) connect, warm up and say `ready`; each repetition starts when
//! this process has sent `go` to all of them (after every one answered `done` for the previous),
//! so their transfers overlap. Every peer's start and end are `CLOCK_MONOTONIC` readings, one clock
//! for all processes of the host: a peer's GB/s is its bytes over its own elapsed time, the
//! aggregate is all peers' bytes over the span from the first peer's start to the last peer's
//! end. Both are medians over `--repeat`; Jain's fairness index is taken over the per-peer medians
//! ([`summary`]). Single-request latency is measured concurrently: after one more `go` every peer
//! runs its `--latency-samples` round trips while the others run theirs (not under the others'
//! bulk traffic). `--verify` then checks every peer's range with a pattern seeded by the peer
//! (writes) or by its target and position (reads), so bytes that landed in a neighbour's range or
//! came from the wrong target count as mismatches.
//!
//! Every spawned process exits when its standard input closes: the targets at once, the
//! initiators at their next barrier; so a parent that dies leaves none behind.

mod one_to_many;
mod summary;
pub(super) mod worker;

use super::{spawn_target, Args, Target, TARGET_SEED, WRITE_SEED};
use summary::Summary;

/// How many processes move bytes, and between whom (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scheme {
    /// N initiator processes, each with its own target process (N pairs).
    Pairwise,
    /// N initiator processes into one target process, each into its own range.
    ManyToOne,
    /// One initiator (this process) driving N target processes concurrently.
    OneToMany,
}

impl Scheme {
    fn name(self) -> &'static str {
        match self {
            Scheme::Pairwise => "pairwise",
            Scheme::ManyToOne => "many-to-one",
            Scheme::OneToMany => "one-to-many",
        }
    }

    /// The fewest peers the scheme means anything with: one pair is a pair; "many" is two.
    fn min_peers(self) -> usize {
        match self {
            Scheme::Pairwise => 1,
            Scheme::ManyToOne | Scheme::OneToMany => 2,
        }
    }

    /// (initiator processes, target processes) for `peers` peers.
    fn processes(self, peers: usize) -> (usize, usize) {
        match self {
            Scheme::Pairwise => (peers, peers),
            Scheme::ManyToOne => (peers, 1),
            Scheme::OneToMany => (1, peers),
        }
    }
}

/// The most peers a scheme runs: each is a process with its own buffers.
pub const MAX_PEERS: usize = 64;

/// What is wrong with a `--scheme` run's settings.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchemeError {
    #[error("--peers 0: a scheme needs at least one peer")]
    NoPeers,
    #[error("--scheme {scheme} needs --peers {min} or more (got {peers})")]
    TooFewPeers {
        scheme: &'static str,
        min: usize,
        peers: usize,
    },
    #[error("--peers {peers}: at most {max} (each peer is a process with its own buffers)")]
    TooManyPeers { peers: usize, max: usize },
    #[error("--peers {peers} x --total-bytes {total_bytes}: the target's buffer size overflows")]
    TargetTooLarge { peers: usize, total_bytes: u64 },
}

/// Checks `peers` for `scheme` with `total_bytes` per peer.
pub fn check(scheme: Scheme, peers: usize, total_bytes: u64) -> Result<(), SchemeError> {
    if peers == 0 {
        return Err(SchemeError::NoPeers);
    }
    if peers < scheme.min_peers() {
        return Err(SchemeError::TooFewPeers {
            scheme: scheme.name(),
            min: scheme.min_peers(),
            peers,
        });
    }
    if peers > MAX_PEERS {
        return Err(SchemeError::TooManyPeers { peers, max: MAX_PEERS });
    }
    if total_bytes
        .checked_mul(peers as u64)
        .is_none_or(|b| usize::try_from(b).is_err())
    {
        return Err(SchemeError::TargetTooLarge { peers, total_bytes });
    }
    Ok(())
}

/// One peer's place: the target it moves bytes with, where its range starts in that target's
/// buffer, and the seed of the pattern the target holds.
#[derive(Clone, Debug)]
pub(super) struct Plan {
    peer: u64,
    addr: String,
    remote_offset: u64,
    target_seed: u64,
}

impl Plan {
    /// `args` as this peer's initiator sees them.
    fn args(&self, args: &Args) -> Args {
        let mut a = args.clone();
        a.peer = Some(self.addr.clone());
        a.peer_index = self.peer;
        a.remote_offset = self.remote_offset;
        a.target_seed = self.target_seed;
        a
    }
}

/// The seed of the pattern a peer writes when verifying: its own, so a write that lands in a
/// neighbour's range is caught there.
pub(super) fn write_seed(peer: u64) -> u64 {
    WRITE_SEED + 0x100 + peer
}

/// A target process of `bytes` holding pattern `seed`.
fn target(args: &Args, bytes: u64, seed: u64) -> Result<Target, String> {
    let mut a = args.clone();
    a.total_bytes = bytes;
    a.target_seed = seed;
    spawn_target(&a)
}

/// Runs `scheme` (`--peers`, already in `args`), prints the result, and fails on a mismatch.
pub fn run(args: &Args, scheme: Scheme, rt: &tokio::runtime::Runtime) -> Result<(), String> {
    let peers = args.peers.unwrap_or(0);
    check(scheme, peers, args.total_bytes).map_err(|e| e.to_string())?;
    let (results, targets) = match scheme {
        Scheme::Pairwise | Scheme::OneToMany => {
            let targets = (0..peers as u64)
                .map(|i| target(args, args.total_bytes, TARGET_SEED + i))
                .collect::<Result<Vec<_>, _>>()?;
            let plans: Vec<Plan> = targets
                .iter()
                .enumerate()
                .map(|(i, t)| Plan {
                    peer: i as u64,
                    addr: t.addr.clone(),
                    remote_offset: 0,
                    target_seed: TARGET_SEED + i as u64,
                })
                .collect();
            let results = if scheme == Scheme::Pairwise {
                worker::drive(args, &plans)
            } else {
                rt.block_on(one_to_many::run(args, &plans))
            };
            (results, targets)
        }
        Scheme::ManyToOne => {
            let t = target(args, args.total_bytes * peers as u64, TARGET_SEED)?;
            let plans: Vec<Plan> = (0..peers as u64)
                .map(|i| Plan {
                    peer: i,
                    addr: t.addr.clone(),
                    remote_offset: i * args.total_bytes,
                    target_seed: TARGET_SEED,
                })
                .collect();
            (worker::drive(args, &plans), vec![t])
        }
    };
    drop(targets);
    let summary = Summary::new(&results?)?;
    summary.report(args, scheme);
    match summary.mismatched_bytes() {
        Some(n) if n > 0 => Err(format!("{n} mismatched bytes")),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_peer_counts_are_named() {
        assert_eq!(check(Scheme::Pairwise, 0, 1 << 20), Err(SchemeError::NoPeers));
        assert_eq!(check(Scheme::Pairwise, 1, 1 << 20), Ok(()));
        assert_eq!(
            check(Scheme::ManyToOne, 1, 1 << 20),
            Err(SchemeError::TooFewPeers {
                scheme: "many-to-one",
                min: 2,
                peers: 1
            })
        );
        assert!(matches!(
            check(Scheme::OneToMany, 1, 1 << 20),
            Err(SchemeError::TooFewPeers { min: 2, .. })
        ));
        assert_eq!(check(Scheme::OneToMany, MAX_PEERS, 1 << 20), Ok(()));
        assert_eq!(
            check(Scheme::ManyToOne, MAX_PEERS + 1, 1 << 20),
            Err(SchemeError::TooManyPeers {
                peers: MAX_PEERS + 1,
                max: MAX_PEERS
            })
        );
        assert_eq!(
            check(Scheme::ManyToOne, 4, u64::MAX / 2),
            Err(SchemeError::TargetTooLarge {
                peers: 4,
                total_bytes: u64::MAX / 2
            })
        );
        assert!(SchemeError::NoPeers.to_string().contains("--peers 0"));
    }

    #[test]
    fn schemes_count_their_processes() {
        assert_eq!(Scheme::Pairwise.processes(3), (3, 3));
        assert_eq!(Scheme::ManyToOne.processes(3), (3, 1));
        assert_eq!(Scheme::OneToMany.processes(3), (1, 3));
    }
}
