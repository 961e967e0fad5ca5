//! What the tests on the fake verbs layer share: an rdma transport on one fake device.

use std::path::Path;
use std::sync::Arc;

use te_transport_rdma::config::{PollMode, RdmaConfig};
use te_transport_rdma::transport::RdmaTransport;
use te_transport_rdma::verbs::fake::RecordingVerbs;

/// The rdma transport of segment `name` on fake device `device`, its handshake on loopback.
pub async fn rdma_on(
    verbs: &Arc<RecordingVerbs>,
    device: &str,
    name: &str,
    poll: PollMode,
) -> RdmaTransport<RecordingVerbs> {
    let config = RdmaConfig {
        handshake_addr: Some("127.0.0.1:0".parse().unwrap()),
        poll,
        ..RdmaConfig::default()
    };
    RdmaTransport::start(
        verbs.clone(),
        &[device.to_string()],
        None,
        Vec::new(),
        config,
        name,
        Path::new("/nonexistent-sysfs"),
        None,
    )
    .await
    .expect("rdma over the fake")
}
