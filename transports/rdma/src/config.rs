//! `TE_RDMA_*` configuration, read strictly: a malformed value is an `Error::Config` naming the
//! variable, never a silent default. Mooncake's `MC_*` names are accepted as aliases where the
//! meaning is the same.

use std::net::SocketAddr;
use std::time::Duration;

use te_base::config::{parse_bytes, parse_var, parse_var_with_alias, Env};
use te_base::listener::ListenerLimits;
use te_base::{Error, Result};

use crate::protocol::qp_state::ConnectParams;
use crate::verbs::Mtu;

/// Every variable this transport reads (Mooncake's `MC_*` names and its listener's limits
/// included).
pub const ENV_VARS: &[&str] = &[
    "TE_RDMA_DEVICES",
    "TE_RDMA_QPS_PER_PEER",
    "MC_NUM_QP_PER_EP",
    "TE_RDMA_CQ_DEPTH",
    "MC_MAX_CQE",
    "TE_RDMA_SEND_QUEUE_DEPTH",
    "MC_MAX_WR",
    "TE_RDMA_GID_INDEX",
    "MC_GID_INDEX",
    "TE_RDMA_MTU",
    "MC_MTU",
    "TE_RDMA_SL",
    "MC_IB_SL",
    "TE_RDMA_TRAFFIC_CLASS",
    "MC_IB_TC",
    "TE_RDMA_HANDSHAKE_ADDR",
    "TE_RDMA_MAX_MR_SIZE",
    "TE_RDMA_MAX_QPS_PER_SOURCE",
    "TE_RDMA_MAX_RD_ATOMIC",
    "TE_RDMA_RECONNECT_BACKOFF_MS",
    "TE_RDMA_RECONNECT_BACKOFF_MAX_MS",
    "TE_RDMA_RETRY_CNT",
    "TE_RDMA_RETRY_LIMIT",
    "TE_RDMA_RNR_RETRY",
    "TE_RDMA_SIGNAL_EVERY",
    "TE_RDMA_SLICE_SIZE",
    "TE_RDMA_TIMEOUT",
    "TE_RDMA_MAX_CONNECTIONS",
    "TE_RDMA_MAX_CONNECTIONS_PER_SOURCE",
    "TE_RDMA_HANDSHAKE_TIMEOUT_MS",
    "TE_RDMA_IDLE_TIMEOUT_MS",
    "TE_RDMA_ABORT_FLUSH_MS",
    "TE_RDMA_POLL_SPIN_US",
];

/// Every knob of the transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Devices to use (`TE_RDMA_DEVICES=mlx5_0,mlx5_1`); `None` = every device with an active port.
    pub devices: Option<Vec<String>>,
    /// RC queue pairs per (local rail, remote rail) pair of a peer (`TE_RDMA_QPS_PER_PEER`).
    pub qps_per_peer: u32,
    /// Send queue depth per QP (`TE_RDMA_SEND_QUEUE_DEPTH`), capped by the device.
    pub send_queue_depth: u32,
    /// One signalled completion every this many work requests (`TE_RDMA_SIGNAL_EVERY`).
    pub signal_every: u32,
    /// Completion queue entries per rail (`TE_RDMA_CQ_DEPTH`), capped by the device. The send
    /// queue depths of all QPs on a rail never add up to more, so the CQ cannot overrun.
    pub cq_depth: u32,
    /// Largest RDMA message (`TE_RDMA_SLICE_SIZE`); requests are cut into slices of this size,
    /// striped over the rails and QPs.
    pub slice_size: u64,
    /// Lowers the registration split point below the device's max MR size (`TE_RDMA_MAX_MR_SIZE`).
    pub max_mr_size: Option<u64>,
    /// Forces the GID index (`TE_RDMA_GID_INDEX`); default: the first RoCE v2 IPv4 GID.
    pub gid_index: Option<u8>,
    /// Re-posts of a slice after a transient error before the request fails (`TE_RDMA_RETRY_LIMIT`).
    pub retry_limit: u32,
    /// First and largest wait before re-establishing a failed QP
    /// (`TE_RDMA_RECONNECT_BACKOFF_MS`, `TE_RDMA_RECONNECT_BACKOFF_MAX_MS`).
    pub backoff_ms: (u64, u64),
    /// Address the handshake listener binds and advertises (`TE_RDMA_HANDSHAKE_ADDR`).
    pub handshake_addr: Option<SocketAddr>,
    /// QP attributes.
    pub connect: ConnectParams,
    /// The handshake listener's limits: `TE_RDMA_MAX_CONNECTIONS`,
    /// `TE_RDMA_MAX_CONNECTIONS_PER_SOURCE` (handshake connections at once) and
    /// `TE_RDMA_HANDSHAKE_TIMEOUT_MS` (accept to authenticated); each message read or written
    /// has [`HANDSHAKE_FRAME_TIMEOUT`].
    pub listener: ListenerLimits,
    /// Target-side QPs one source address may hold at once (`TE_RDMA_MAX_QPS_PER_SOURCE`).
    pub max_qps_per_source: usize,
    /// How long an aborted connection waits for the flush completions of its QPs before it
    /// destroys them instead (`TE_RDMA_ABORT_FLUSH_MS`; see `Peer::abort`).
    pub abort_flush_grace: Duration,
    /// How the progress thread waits for completions (`TE_RDMA_POLL_SPIN_US`).
    pub poll: PollMode,
    /// Requests longer than this are striped across the rails both sides share, in proportion
    /// to their link rates; shorter ones take one rail, rotating (`TE_STRIPE_MIN_BYTES`,
    /// te-base's topology policy variable).
    pub stripe_min_bytes: u64,
}

/// How the progress thread waits for completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollMode {
    /// Busy-poll the CQs for this long after the last completion while work is in flight, then
    /// arm them and sleep on their completion channels until one fires (`TE_RDMA_POLL_SPIN_US=N`,
    /// default 50). Idle, it sleeps at once.
    Adaptive { spin: Duration },
    /// Busy-poll whenever work is in flight; never sleep on a channel (`TE_RDMA_POLL_SPIN_US=busy`,
    /// the behaviour before completion events).
    Busy,
}

/// Default spin of [`PollMode::Adaptive`]: longer than a round trip on a NIC (a few
/// microseconds), so back-to-back batches never pay a wake-up, short enough that a thread waiting
/// on a slow peer gives its core back at once.
pub const DEFAULT_POLL_SPIN: Duration = Duration::from_micros(50);

/// Time one handshake message may take to arrive or leave.
pub const HANDSHAKE_FRAME_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of `TE_RDMA_MAX_QPS_PER_SOURCE`: two engines' worth of the largest request.
pub const DEFAULT_MAX_QPS_PER_SOURCE: usize = 2 * crate::protocol::handshake::MAX_SLOTS;

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            devices: None,
            qps_per_peer: 2,
            send_queue_depth: 256,
            signal_every: 16,
            cq_depth: 65536,
            slice_size: 64 << 10,
            max_mr_size: None,
            gid_index: None,
            retry_limit: 3,
            backoff_ms: (10, 5000),
            handshake_addr: None,
            connect: ConnectParams::default(),
            listener: ListenerLimits::with_frame_timeout(HANDSHAKE_FRAME_TIMEOUT),
            max_qps_per_source: DEFAULT_MAX_QPS_PER_SOURCE,
            abort_flush_grace: Duration::from_secs(5),
            poll: PollMode::Adaptive {
                spin: DEFAULT_POLL_SPIN,
            },
            stripe_min_bytes: te_topology::DEFAULT_STRIPE_MIN_BYTES,
        }
    }
}

fn ranged<T: PartialOrd + std::fmt::Display + Copy>(var: &str, v: Option<T>, lo: T, hi: T) -> Result<Option<T>> {
    match v {
        Some(x) if x < lo || x > hi => Err(Error::config(var, x.to_string(), format!("must be in {lo}..={hi}"))),
        other => Ok(other),
    }
}

impl RdmaConfig {
    /// Reads every `TE_RDMA_*` variable from `env`.
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let mut c = RdmaConfig::default();
        if let Some(raw) = env.get("TE_RDMA_DEVICES") {
            let names: Vec<String> = raw.split(',').map(|s| s.trim().to_string()).collect();
            if names.iter().any(|n| n.is_empty()) {
                return Err(Error::config("TE_RDMA_DEVICES", raw, "empty device name in the list"));
            }
            c.devices = Some(names);
        }
        let qps = parse_var_with_alias::<u32>(env, "TE_RDMA_QPS_PER_PEER", "MC_NUM_QP_PER_EP")?;
        if let Some(v) = ranged("TE_RDMA_QPS_PER_PEER", qps, 1, 64)? {
            c.qps_per_peer = v;
        }
        let depth = parse_var_with_alias::<u32>(env, "TE_RDMA_SEND_QUEUE_DEPTH", "MC_MAX_WR")?;
        if let Some(v) = ranged("TE_RDMA_SEND_QUEUE_DEPTH", depth, 1, 1 << 16)? {
            c.send_queue_depth = v;
        }
        if let Some(v) = parse_var::<u32>(env, "TE_RDMA_SIGNAL_EVERY")? {
            if v == 0 || v > c.send_queue_depth {
                return Err(Error::config(
                    "TE_RDMA_SIGNAL_EVERY",
                    v.to_string(),
                    format!("must be in 1..={} (the send queue depth)", c.send_queue_depth),
                ));
            }
            c.signal_every = v;
        }
        let cqe = parse_var_with_alias::<u32>(env, "TE_RDMA_CQ_DEPTH", "MC_MAX_CQE")?;
        if let Some(v) = ranged("TE_RDMA_CQ_DEPTH", cqe, 16, 1 << 22)? {
            c.cq_depth = v;
        }
        if let Some(v) = parse_bytes(env, te_topology::STRIPE_MIN_BYTES_VAR)? {
            c.stripe_min_bytes = v;
        }
        if let Some(v) = parse_bytes(env, "TE_RDMA_SLICE_SIZE")? {
            if !(4096..=1 << 30).contains(&v) {
                return Err(Error::config("TE_RDMA_SLICE_SIZE", v.to_string(), "must be in 4K..=1G"));
            }
            c.slice_size = v;
        }
        if let Some(v) = parse_bytes(env, "TE_RDMA_MAX_MR_SIZE")? {
            if v < 1 << 20 || v & 4095 != 0 {
                return Err(Error::config(
                    "TE_RDMA_MAX_MR_SIZE",
                    v.to_string(),
                    "must be a multiple of 4K, at least 1M",
                ));
            }
            c.max_mr_size = Some(v);
        }
        c.gid_index = parse_var_with_alias::<u8>(env, "TE_RDMA_GID_INDEX", "MC_GID_INDEX")?;
        if let Some(v) = parse_var::<u32>(env, "TE_RDMA_RETRY_LIMIT")? {
            c.retry_limit = v;
        }
        let lo = parse_var::<u64>(env, "TE_RDMA_RECONNECT_BACKOFF_MS")?.unwrap_or(c.backoff_ms.0);
        let hi = parse_var::<u64>(env, "TE_RDMA_RECONNECT_BACKOFF_MAX_MS")?.unwrap_or(c.backoff_ms.1.max(lo));
        if lo == 0 || hi < lo {
            return Err(Error::config(
                "TE_RDMA_RECONNECT_BACKOFF_MAX_MS",
                hi.to_string(),
                format!("must be at least TE_RDMA_RECONNECT_BACKOFF_MS ({lo}), which must be positive"),
            ));
        }
        c.backoff_ms = (lo, hi);
        c.handshake_addr = parse_var::<SocketAddr>(env, "TE_RDMA_HANDSHAKE_ADDR")?;
        c.listener = ListenerLimits::from_env(env, "TE_RDMA", HANDSHAKE_FRAME_TIMEOUT)?;
        let per_source = parse_var::<usize>(env, "TE_RDMA_MAX_QPS_PER_SOURCE")?;
        if let Some(v) = ranged(
            "TE_RDMA_MAX_QPS_PER_SOURCE",
            per_source,
            1,
            crate::transport::MAX_ACCEPTED_QPS,
        )? {
            c.max_qps_per_source = v;
        }

        let grace = parse_var::<u64>(env, "TE_RDMA_ABORT_FLUSH_MS")?;
        if let Some(ms) = ranged("TE_RDMA_ABORT_FLUSH_MS", grace, 1, 600_000)? {
            c.abort_flush_grace = Duration::from_millis(ms);
        }

        if let Some(spin) = parse_var::<String>(env, "TE_RDMA_POLL_SPIN_US")? {
            c.poll = match spin.trim() {
                "busy" => PollMode::Busy,
                n => match n.parse::<u64>() {
                    Ok(us) if us <= 1_000_000 => PollMode::Adaptive {
                        spin: Duration::from_micros(us),
                    },
                    _ => {
                        return Err(Error::config(
                            "TE_RDMA_POLL_SPIN_US",
                            spin,
                            "must be microseconds in 0..=1000000, or busy",
                        ))
                    }
                },
            };
        }

        let p = &mut c.connect;
        if let Some(mtu) = parse_var_with_alias::<u32>(env, "TE_RDMA_MTU", "MC_MTU")? {
            p.mtu_cap = Some(Mtu::from_bytes(mtu).ok_or_else(|| {
                Error::config("TE_RDMA_MTU", mtu.to_string(), "must be 256, 512, 1024, 2048 or 4096")
            })?);
        }
        let tc = parse_var_with_alias::<u8>(env, "TE_RDMA_TRAFFIC_CLASS", "MC_IB_TC")?;
        p.traffic_class = tc.unwrap_or(p.traffic_class);
        let sl = parse_var_with_alias::<u8>(env, "TE_RDMA_SL", "MC_IB_SL")?;
        p.sl = ranged("TE_RDMA_SL", sl, 0, 15)?.unwrap_or(p.sl);
        let t = parse_var::<u8>(env, "TE_RDMA_TIMEOUT")?;
        p.timeout = ranged("TE_RDMA_TIMEOUT", t, 0, 31)?.unwrap_or(p.timeout);
        let r = parse_var::<u8>(env, "TE_RDMA_RETRY_CNT")?;
        p.retry_cnt = ranged("TE_RDMA_RETRY_CNT", r, 0, 7)?.unwrap_or(p.retry_cnt);
        let r = parse_var::<u8>(env, "TE_RDMA_RNR_RETRY")?;
        p.rnr_retry = ranged("TE_RDMA_RNR_RETRY", r, 0, 7)?.unwrap_or(p.rnr_retry);
        let a = parse_var::<u8>(env, "TE_RDMA_MAX_RD_ATOMIC")?;
        p.max_rd_atomic = ranged("TE_RDMA_MAX_RD_ATOMIC", a, 1, 255)?.unwrap_or(p.max_rd_atomic);
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::config::MapEnv;

    #[test]
    fn defaults_when_unset() {
        assert_eq!(RdmaConfig::from_env(&MapEnv::default()).unwrap(), RdmaConfig::default());
    }

    #[test]
    fn reads_every_knob() {
        let env = MapEnv::new([
            ("TE_RDMA_DEVICES", "mlx5_0,mlx5_1"),
            ("TE_RDMA_QPS_PER_PEER", "4"),
            ("TE_RDMA_SEND_QUEUE_DEPTH", "128"),
            ("TE_RDMA_SIGNAL_EVERY", "8"),
            ("TE_RDMA_MTU", "1024"),
            ("MC_GID_INDEX", "3"),
            ("TE_RDMA_SLICE_SIZE", "128K"),
            ("TE_RDMA_HANDSHAKE_ADDR", "10.0.0.1:7000"),
        ]);
        let c = RdmaConfig::from_env(&env).unwrap();
        assert_eq!(
            c.devices.as_deref(),
            Some(&["mlx5_0".to_string(), "mlx5_1".to_string()][..])
        );
        assert_eq!((c.qps_per_peer, c.send_queue_depth, c.signal_every), (4, 128, 8));
        assert_eq!(c.connect.mtu_cap, Some(Mtu::M1024));
        assert_eq!(c.gid_index, Some(3));
        assert_eq!(c.slice_size, 128 << 10);
        assert_eq!(c.handshake_addr, Some("10.0.0.1:7000".parse().unwrap()));
        assert_eq!(
            c.poll,
            PollMode::Adaptive {
                spin: DEFAULT_POLL_SPIN
            }
        );
    }

    #[test]
    fn the_poll_mode_reads_microseconds_or_busy() {
        let spin = |v: &str| {
            RdmaConfig::from_env(&MapEnv::new([("TE_RDMA_POLL_SPIN_US", v)]))
                .unwrap()
                .poll
        };
        assert_eq!(spin("busy"), PollMode::Busy);
        assert_eq!(spin("0"), PollMode::Adaptive { spin: Duration::ZERO });
        assert_eq!(
            spin("200"),
            PollMode::Adaptive {
                spin: Duration::from_micros(200)
            }
        );
    }

    #[test]
    fn malformed_values_name_the_variable() {
        for (var, bad) in [
            ("TE_RDMA_QPS_PER_PEER", "0"),
            ("TE_RDMA_QPS_PER_PEER", "two"),
            ("TE_RDMA_MAX_QPS_PER_SOURCE", "0"),
            ("TE_RDMA_MAX_CONNECTIONS_PER_SOURCE", "0"),
            ("TE_RDMA_HANDSHAKE_TIMEOUT_MS", "soon"),
            ("TE_RDMA_DEVICES", "mlx5_0,,mlx5_1"),
            ("TE_RDMA_SIGNAL_EVERY", "100000"),
            ("TE_RDMA_MTU", "1500"),
            ("TE_RDMA_SLICE_SIZE", "1"),
            ("TE_RDMA_MAX_MR_SIZE", "1000"),
            ("TE_RDMA_RETRY_CNT", "8"),
            ("TE_RDMA_SL", "16"),
            ("TE_RDMA_HANDSHAKE_ADDR", "nowhere"),
            ("TE_RDMA_RECONNECT_BACKOFF_MS", "0"),
            ("TE_RDMA_POLL_SPIN_US", "always"),
            ("TE_RDMA_POLL_SPIN_US", "1000001"),
            ("TE_RDMA_POLL_SPIN_US", "-1"),
        ] {
            let err = RdmaConfig::from_env(&MapEnv::new([(var, bad)])).unwrap_err();
            let text = err.to_string();
            assert!(matches!(err, Error::Config { .. }), "{var}={bad}: {text}");
            assert!(
                text.contains(var) || var.starts_with("TE_RDMA_RECONNECT"),
                "{var}={bad}: {text}"
            );
        }
        let conflict = MapEnv::new([("TE_RDMA_QPS_PER_PEER", "2"), ("MC_NUM_QP_PER_EP", "4")]);
        assert!(RdmaConfig::from_env(&conflict).is_err());
    }
}
