//! The RC queue-pair state machine and the attributes of each transition (RESET -> INIT -> RTR ->
//! RTS, and back to RESET for re-establishment), as plain values. The verbs layer turns a
//! [`QpTransition`] into `ibv_modify_qp` attributes and mask; this module decides what they are.

use te_base::{Error, Result};

use super::values::{Access, Gid, LinkLayer, Mtu};

/// States of a queue pair that the transport uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created or reset: no traffic.
    Reset,
    /// Bound to a port with access rights; not connected.
    Init,
    /// Ready to receive: knows its peer.
    Rtr,
    /// Ready to send.
    Rts,
    /// Failed: outstanding work requests are flushed; must go back to RESET to be reused.
    Error,
}

/// How to reach the remote queue pair (`ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// Local port number.
    pub port: u8,
    /// Remote LID (InfiniBand).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// True when packets carry a global route header (always on RoCE).
    pub is_global: bool,
    /// Remote GID (global route).
    pub dgid: Gid,
    /// Index of our GID to send from (global route).
    pub sgid_index: u8,
    /// Hop limit (global route).
    pub hop_limit: u8,
    /// Traffic class (global route; DSCP on RoCE).
    pub traffic_class: u8,
}

/// One `ibv_modify_qp` call: the target state and the attributes it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpTransition {
    /// RESET -> INIT.
    ToInit {
        /// Local port.
        port: u8,
        /// Partition key index.
        pkey_index: u16,
        /// What the remote side may do to our memory through this QP.
        access: Access,
    },
    /// INIT -> RTR.
    ToRtr {
        /// Negotiated path MTU (the smaller of both sides).
        path_mtu: Mtu,
        /// Remote QP number.
        dest_qpn: u32,
        /// First packet sequence number expected from the remote QP (its send PSN).
        rq_psn: u32,
        /// RDMA READs the remote side may have outstanding at us.
        max_dest_rd_atomic: u8,
        /// Minimum RNR NAK timer (encoded per the IB spec).
        min_rnr_timer: u8,
        /// Route to the remote QP.
        av: AddressVector,
    },
    /// RTR -> RTS.
    ToRts {
        /// Our first send packet sequence number.
        sq_psn: u32,
        /// Local ACK timeout (4.096 us * 2^timeout).
        timeout: u8,
        /// Transport retries before RETRY_EXC_ERR.
        retry_cnt: u8,
        /// RNR retries (7 = forever).
        rnr_retry: u8,
        /// RDMA READs we may have outstanding.
        max_rd_atomic: u8,
    },
    /// Any state -> RESET (before re-establishing).
    ToReset,
    /// Any state -> ERROR (flushes outstanding work requests).
    ToError,
}

impl QpTransition {
    /// The state the QP is in after the transition.
    pub fn target(&self) -> QpState {
        match self {
            QpTransition::ToInit { .. } => QpState::Init,
            QpTransition::ToRtr { .. } => QpState::Rtr,
            QpTransition::ToRts { .. } => QpState::Rts,
            QpTransition::ToReset => QpState::Reset,
            QpTransition::ToError => QpState::Error,
        }
    }
}

/// Tracks one QP's state and refuses transitions the hardware would refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpMachine {
    state: QpState,
}

impl Default for QpMachine {
    fn default() -> Self {
        QpMachine { state: QpState::Reset }
    }
}

impl QpMachine {
    /// The current state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// True if `transition` is legal from the current state.
    pub fn allows(&self, transition: &QpTransition) -> bool {
        matches!(
            (self.state, transition.target()),
            (QpState::Reset, QpState::Init)
                | (QpState::Init, QpState::Rtr)
                | (QpState::Rtr, QpState::Rts)
                | (_, QpState::Error)
                | (_, QpState::Reset)
        )
    }

    /// Checks `transition` and records the new state. Call after the verbs call succeeded.
    pub fn apply(&mut self, transition: &QpTransition) -> Result<()> {
        if !self.allows(transition) {
            return Err(Error::transport(
                "rdma",
                format!("invalid QP transition {:?} -> {:?}", self.state, transition.target()),
            ));
        }
        self.state = transition.target();
        Ok(())
    }

    /// The QP went to ERROR on its own (an error completion or async event).
    pub fn mark_error(&mut self) {
        self.state = QpState::Error;
    }
}

/// Per-transport tuning of the connection attributes (from `TE_RDMA_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectParams {
    /// Partition key index.
    pub pkey_index: u16,
    /// ACK timeout exponent.
    pub timeout: u8,
    /// Transport retry count (0..=7).
    pub retry_cnt: u8,
    /// RNR retry count (0..=7).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Outstanding RDMA READs per QP (capped by both devices).
    pub max_rd_atomic: u8,
    /// Service level.
    pub sl: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit of the global route header.
    pub hop_limit: u8,
    /// Largest MTU we allow (`TE_RDMA_MTU`), below the ports' MTUs.
    pub mtu_cap: Option<Mtu>,
}

impl Default for ConnectParams {
    fn default() -> Self {
        ConnectParams {
            pkey_index: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            sl: 0,
            traffic_class: 0,
            hop_limit: 64,
            mtu_cap: None,
        }
    }
}

/// Our side of one QP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalQpEnd {
    /// Local port.
    pub port: u8,
    /// Link layer of the local port.
    pub link_layer: LinkLayer,
    /// Our GID index (RoCE v2 entry chosen at discovery).
    pub gid_index: u8,
    /// Our send PSN.
    pub psn: u32,
    /// Most RDMA READs our device lets one QP initiate or accept.
    pub device_max_rd_atomic: u8,
}

/// The remote side of one QP connection, from the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteQpEnd {
    /// Remote QP number.
    pub qpn: u32,
    /// Remote send PSN.
    pub psn: u32,
    /// Remote LID.
    pub lid: u16,
    /// Remote GID.
    pub gid: Gid,
    /// Remote link layer.
    pub link_layer: LinkLayer,
}

/// The three transitions that take a fresh QP from RESET to RTS, connected to `remote`.
///
/// `path_mtu` is the negotiated MTU (see [`crate::protocol::handshake::negotiate_mtu`]).
pub fn connect_transitions(
    local: &LocalQpEnd,
    remote: &RemoteQpEnd,
    path_mtu: Mtu,
    params: &ConnectParams,
) -> Result<[QpTransition; 3]> {
    if local.link_layer != remote.link_layer {
        return Err(Error::transport(
            "rdma",
            format!(
                "cannot connect a {:?} port to a {:?} port",
                local.link_layer, remote.link_layer
            ),
        ));
    }
    // RoCE always routes by GID; InfiniBand by LID inside the subnet.
    let is_global = local.link_layer == LinkLayer::Ethernet;
    if is_global && remote.gid.is_zero() {
        return Err(Error::transport("rdma", "remote RoCE port advertised no GID"));
    }
    if !is_global && remote.lid == 0 {
        return Err(Error::transport("rdma", "remote InfiniBand port advertised LID 0"));
    }
    let rd_atomic = params.max_rd_atomic.min(local.device_max_rd_atomic).max(1);
    let av = AddressVector {
        port: local.port,
        dlid: if is_global { 0 } else { remote.lid },
        sl: params.sl,
        is_global,
        dgid: if is_global { remote.gid } else { Gid::default() },
        sgid_index: local.gid_index,
        hop_limit: params.hop_limit,
        traffic_class: params.traffic_class,
    };
    Ok([
        QpTransition::ToInit {
            port: local.port,
            pkey_index: params.pkey_index,
            access: Access {
                remote_write: true,
                remote_read: true,
            },
        },
        QpTransition::ToRtr {
            path_mtu,
            dest_qpn: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: rd_atomic,
            min_rnr_timer: params.min_rnr_timer,
            av,
        },
        QpTransition::ToRts {
            sq_psn: local.psn,
            timeout: params.timeout,
            retry_cnt: params.retry_cnt,
            rnr_retry: params.rnr_retry,
            max_rd_atomic: rd_atomic,
        },
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roce_local() -> LocalQpEnd {
        LocalQpEnd {
            port: 1,
            link_layer: LinkLayer::Ethernet,
            gid_index: 3,
            psn: 0x1234,
            device_max_rd_atomic: 16,
        }
    }

    fn roce_remote() -> RemoteQpEnd {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 0, 0, 2]);
        RemoteQpEnd {
            qpn: 0x77,
            psn: 0x4321,
            lid: 0,
            gid: Gid(gid),
            link_layer: LinkLayer::Ethernet,
        }
    }

    #[test]
    fn walks_reset_init_rtr_rts_and_refuses_skips() {
        let ts = connect_transitions(&roce_local(), &roce_remote(), Mtu::M1024, &ConnectParams::default()).unwrap();
        let mut m = QpMachine::default();
        // Skipping INIT is refused and leaves the state alone.
        assert!(m.apply(&ts[1]).is_err());
        assert!(m.apply(&ts[2]).is_err());
        assert_eq!(m.state(), QpState::Reset);
        for t in &ts {
            m.apply(t).unwrap();
        }
        assert_eq!(m.state(), QpState::Rts);
        // Going back to INIT without RESET is refused; RESET then INIT is the recovery path.
        assert!(m.apply(&ts[0]).is_err());
        m.mark_error();
        assert_eq!(m.state(), QpState::Error);
        assert!(m.apply(&ts[0]).is_err());
        m.apply(&QpTransition::ToReset).unwrap();
        m.apply(&ts[0]).unwrap();
        assert_eq!(m.state(), QpState::Init);
    }

    #[test]
    fn rtr_and_rts_carry_the_peer_and_our_psns() {
        let p = ConnectParams {
            max_rd_atomic: 32,
            traffic_class: 106,
            ..ConnectParams::default()
        };
        let ts = connect_transitions(&roce_local(), &roce_remote(), Mtu::M2048, &p).unwrap();
        let QpTransition::ToRtr {
            path_mtu,
            dest_qpn,
            rq_psn,
            max_dest_rd_atomic,
            av,
            ..
        } = ts[1]
        else {
            panic!("second transition is {:?}", ts[1]);
        };
        assert_eq!(path_mtu, Mtu::M2048);
        assert_eq!(dest_qpn, 0x77);
        assert_eq!(rq_psn, 0x4321, "expects the remote's send PSN");
        assert_eq!(max_dest_rd_atomic, 16, "capped by the device");
        assert!(av.is_global, "RoCE routes by GID");
        assert_eq!(av.dgid, roce_remote().gid);
        assert_eq!(av.sgid_index, 3);
        assert_eq!(av.traffic_class, 106);
        let QpTransition::ToRts {
            sq_psn, max_rd_atomic, ..
        } = ts[2]
        else {
            panic!("third transition is {:?}", ts[2]);
        };
        assert_eq!(sq_psn, 0x1234, "sends from our own PSN");
        assert_eq!(max_rd_atomic, 16);
    }

    #[test]
    fn infiniband_routes_by_lid_and_mismatched_link_layers_are_refused() {
        let local = LocalQpEnd {
            link_layer: LinkLayer::Infiniband,
            ..roce_local()
        };
        let remote = RemoteQpEnd {
            link_layer: LinkLayer::Infiniband,
            lid: 9,
            gid: Gid::default(),
            ..roce_remote()
        };
        let ts = connect_transitions(&local, &remote, Mtu::M4096, &ConnectParams::default()).unwrap();
        let QpTransition::ToRtr { av, .. } = ts[1] else {
            panic!()
        };
        assert!(!av.is_global);
        assert_eq!(av.dlid, 9);
        assert!(connect_transitions(&local, &roce_remote(), Mtu::M4096, &ConnectParams::default()).is_err());
        let no_lid = RemoteQpEnd { lid: 0, ..remote };
        assert!(connect_transitions(&local, &no_lid, Mtu::M4096, &ConnectParams::default()).is_err());
        let no_gid = RemoteQpEnd {
            gid: Gid::default(),
            ..roce_remote()
        };
        assert!(connect_transitions(&roce_local(), &no_gid, Mtu::M4096, &ConnectParams::default()).is_err());
    }
}
