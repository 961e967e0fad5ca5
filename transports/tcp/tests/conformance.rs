//! The shared transport conformance suite over real loopback sockets, with one and several lanes
//! and with slices small enough that every large transfer is cut and spread.

use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::conformance::{
    concurrent_batches, deregistered_target_is_refused, hostile_requests_fail_alone, large_batch, unaligned_offsets,
    write_read_sizes, ConformanceOptions, ConformancePair,
};
use te_base::Transport;
use te_transport_tcp::{TcpConfig, TcpTransport};

async fn transport(lanes: &str, slice: &str) -> Arc<dyn Transport> {
    let env = MapEnv::new([
        ("TE_TCP_LISTEN", "127.0.0.1:0"),
        ("TE_TCP_LANES", lanes),
        ("TE_TCP_SLICE_BYTES", slice),
    ]);
    Arc::new(TcpTransport::start(TcpConfig::from_env(&env).unwrap()).await.unwrap())
}

async fn pair(lanes: &str, slice: &str) -> ConformancePair {
    ConformancePair {
        initiator: transport(lanes, slice).await,
        target: transport(lanes, slice).await,
        target_name: "tcp-conformance-target".into(),
    }
}

/// Every check on a fresh pair: the suite frees buffers without deregistering them, and the
/// target rightly refuses to register a new buffer overlapping a still-registered one.
async fn run_each(lanes: &str, slice: &str, opts: &ConformanceOptions) {
    write_read_sizes(&pair(lanes, slice).await, opts).await;
    unaligned_offsets(&pair(lanes, slice).await, opts).await;
    large_batch(&pair(lanes, slice).await, opts).await;
    concurrent_batches(&pair(lanes, slice).await, opts).await;
    hostile_requests_fail_alone(&pair(lanes, slice).await, opts).await;
    deregistered_target_is_refused(&pair(lanes, slice).await, opts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lane_default_slices() {
    run_each("1", "1M", &ConformanceOptions::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_lanes_small_slices() {
    let opts = ConformanceOptions {
        max_bytes: 16 << 20,
        ..ConformanceOptions::default()
    };
    run_each("3", "64K", &opts).await;
}

/// Notifications (ordering after the data, inbox bounds) with several lanes and small slices, so
/// a notification on the first lane could overtake data still on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_follow_their_data_in_order() {
    let env = MapEnv::new([
        ("TE_TCP_LISTEN", "127.0.0.1:0"),
        ("TE_TCP_LANES", "3"),
        ("TE_TCP_SLICE_BYTES", "64K"),
    ]);
    let config = TcpConfig::from_env(&env).unwrap();
    let inbox = te_base::NotifyInbox::new(te_base::NotifyLimits {
        queue_depth: 64,
        max_bytes: 4096,
    });
    let target = TcpTransport::start_with(config.clone(), None, inbox.clone())
        .await
        .unwrap();
    let pair = ConformancePair {
        initiator: transport("3", "64K").await,
        target: Arc::new(target),
        target_name: "tcp-conformance-target".into(),
    };
    let opts = ConformanceOptions {
        max_bytes: 16 << 20,
        ..ConformanceOptions::default()
    };
    te_base::conformance::notify::run_all(&pair, &inbox, &opts).await;
}
