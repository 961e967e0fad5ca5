//! Pure conversions between the crate's values and libibverbs' C structures.

use std::ffi::c_int;

use super::ffi;
use super::{Access, Completion, Opcode, RecvRequest, WcStatus, WorkRequest};
use crate::protocol::qp_state::{AddressVector, QpTransition};

/// Access flags of a registration or QP.
pub fn access_flags(access: Access) -> c_int {
    let mut flags = ffi::IBV_ACCESS_LOCAL_WRITE;
    if access.remote_write {
        flags |= ffi::IBV_ACCESS_REMOTE_WRITE;
    }
    if access.remote_read {
        flags |= ffi::IBV_ACCESS_REMOTE_READ;
    }
    flags
}

fn ah_attr(av: &AddressVector) -> ffi::ibv_ah_attr {
    ffi::ibv_ah_attr {
        grh: ffi::ibv_global_route {
            dgid: ffi::ibv_gid { raw: av.dgid.0 },
            flow_label: 0,
            sgid_index: av.sgid_index,
            hop_limit: av.hop_limit,
            traffic_class: av.traffic_class,
        },
        dlid: av.dlid,
        sl: av.sl,
        src_path_bits: 0,
        static_rate: 0,
        is_global: u8::from(av.is_global),
        port_num: av.port,
    }
}

/// The `ibv_qp_attr` and attribute mask of a transition.
pub fn qp_attr(transition: &QpTransition) -> (ffi::ibv_qp_attr, c_int) {
    let mut attr = ffi::ibv_qp_attr::default();
    match *transition {
        QpTransition::ToInit {
            port,
            pkey_index,
            access,
        } => {
            attr.qp_state = ffi::IBV_QPS_INIT;
            attr.port_num = port;
            attr.pkey_index = pkey_index;
            attr.qp_access_flags = access_flags(access) as u32;
            let mask = ffi::IBV_QP_STATE | ffi::IBV_QP_PKEY_INDEX | ffi::IBV_QP_PORT | ffi::IBV_QP_ACCESS_FLAGS;
            (attr, mask)
        }
        QpTransition::ToRtr {
            path_mtu,
            dest_qpn,
            rq_psn,
            max_dest_rd_atomic,
            min_rnr_timer,
            av,
        } => {
            attr.qp_state = ffi::IBV_QPS_RTR;
            attr.path_mtu = path_mtu as c_int;
            attr.dest_qp_num = dest_qpn;
            attr.rq_psn = rq_psn;
            attr.max_dest_rd_atomic = max_dest_rd_atomic;
            attr.min_rnr_timer = min_rnr_timer;
            attr.ah_attr = ah_attr(&av);
            let mask = ffi::IBV_QP_STATE
                | ffi::IBV_QP_AV
                | ffi::IBV_QP_PATH_MTU
                | ffi::IBV_QP_DEST_QPN
                | ffi::IBV_QP_RQ_PSN
                | ffi::IBV_QP_MAX_DEST_RD_ATOMIC
                | ffi::IBV_QP_MIN_RNR_TIMER;
            (attr, mask)
        }
        QpTransition::ToRts {
            sq_psn,
            timeout,
            retry_cnt,
            rnr_retry,
            max_rd_atomic,
        } => {
            attr.qp_state = ffi::IBV_QPS_RTS;
            attr.sq_psn = sq_psn;
            attr.timeout = timeout;
            attr.retry_cnt = retry_cnt;
            attr.rnr_retry = rnr_retry;
            attr.max_rd_atomic = max_rd_atomic;
            let mask = ffi::IBV_QP_STATE
                | ffi::IBV_QP_SQ_PSN
                | ffi::IBV_QP_TIMEOUT
                | ffi::IBV_QP_RETRY_CNT
                | ffi::IBV_QP_RNR_RETRY
                | ffi::IBV_QP_MAX_QP_RD_ATOMIC;
            (attr, mask)
        }
        QpTransition::ToReset => {
            attr.qp_state = ffi::IBV_QPS_RESET;
            (attr, ffi::IBV_QP_STATE)
        }
        QpTransition::ToError => {
            attr.qp_state = ffi::IBV_QPS_ERR;
            (attr, ffi::IBV_QP_STATE)
        }
    }
}

/// The scatter/gather entry of `len` bytes at `addr`, and how many entries the request carries:
/// a zero-byte one (a bare WRITE WITH IMM, an answer's receive) none.
fn one_sge(addr: u64, len: u32, lkey: u32) -> (ffi::ibv_sge, c_int) {
    let sge = ffi::ibv_sge {
        addr,
        length: len,
        lkey,
    };
    (sge, c_int::from(len > 0))
}

/// Fills `out` for `wr`; the caller links `next` and points `sg_list` at `sge`.
pub fn send_wr(wr: &WorkRequest, sge: &mut ffi::ibv_sge, out: &mut ffi::ibv_send_wr) {
    (*sge, out.num_sge) = one_sge(wr.local_addr, wr.len, wr.lkey);
    out.wr_id = wr.wr_id;
    out.opcode = match wr.opcode {
        Opcode::RdmaWrite => ffi::IBV_WR_RDMA_WRITE,
        Opcode::RdmaRead => ffi::IBV_WR_RDMA_READ,
        Opcode::Send => ffi::IBV_WR_SEND,
        Opcode::RdmaWriteWithImm => ffi::IBV_WR_RDMA_WRITE_WITH_IMM,
    };
    out.send_flags = if wr.signaled { ffi::IBV_SEND_SIGNALED } else { 0 };
    // Immediate data travels in network byte order.
    out.imm_data = wr.imm_data.to_be();
    out.rdma.remote_addr = wr.remote_addr;
    out.rdma.rkey = wr.rkey;
}

/// Fills `out` for `rr`; the caller links `next` and points `sg_list` at `sge` (when `num_sge`
/// is 1).
pub fn recv_wr(rr: &RecvRequest, sge: &mut ffi::ibv_sge, out: &mut ffi::ibv_recv_wr) {
    (*sge, out.num_sge) = one_sge(rr.addr, rr.len, rr.lkey);
    out.wr_id = rr.wr_id;
}

/// A completion from a work completion entry.
pub fn completion(wc: &ffi::ibv_wc) -> Completion {
    Completion {
        wr_id: wc.wr_id,
        status: WcStatus(wc.status as u32),
        vendor_err: wc.vendor_err,
        qp_num: wc.qp_num,
        byte_len: wc.byte_len,
        imm: (wc.wc_flags & ffi::IBV_WC_WITH_IMM != 0).then(|| u32::from_be(wc.imm_data)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{Gid, Mtu};

    #[test]
    fn masks_name_exactly_the_attributes_each_transition_sets() {
        let (a, m) = qp_attr(&QpTransition::ToInit {
            port: 2,
            pkey_index: 0,
            access: Access {
                remote_write: true,
                remote_read: true,
            },
        });
        assert_eq!(m, 0b111001);
        assert_eq!((a.qp_state, a.port_num, a.qp_access_flags), (ffi::IBV_QPS_INIT, 2, 7));

        let av = AddressVector {
            port: 1,
            dlid: 0,
            sl: 3,
            is_global: true,
            dgid: Gid([7; 16]),
            sgid_index: 3,
            hop_limit: 64,
            traffic_class: 106,
        };
        let (a, m) = qp_attr(&QpTransition::ToRtr {
            path_mtu: Mtu::M1024,
            dest_qpn: 0xabc,
            rq_psn: 9,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            av,
        });
        assert_eq!(m, 1 | 1 << 7 | 1 << 8 | 1 << 12 | 1 << 15 | 1 << 17 | 1 << 20);
        assert_eq!(a.path_mtu, 3);
        assert_eq!((a.dest_qp_num, a.rq_psn, a.max_dest_rd_atomic), (0xabc, 9, 16));
        assert_eq!(a.ah_attr.is_global, 1);
        assert_eq!(a.ah_attr.grh.dgid.raw, [7; 16]);
        assert_eq!((a.ah_attr.grh.sgid_index, a.ah_attr.grh.traffic_class), (3, 106));
        assert_eq!((a.ah_attr.sl, a.ah_attr.port_num), (3, 1));

        let (a, m) = qp_attr(&QpTransition::ToRts {
            sq_psn: 5,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
        });
        assert_eq!(m, 1 | 1 << 9 | 1 << 10 | 1 << 11 | 1 << 13 | 1 << 16);
        assert_eq!(
            (a.qp_state, a.sq_psn, a.timeout, a.max_rd_atomic),
            (ffi::IBV_QPS_RTS, 5, 14, 16)
        );
        assert_eq!(qp_attr(&QpTransition::ToReset).1, 1);
        assert_eq!(qp_attr(&QpTransition::ToError).0.qp_state, ffi::IBV_QPS_ERR);
    }

    #[test]
    fn work_requests_map_to_send_wrs() {
        let wr = WorkRequest {
            wr_id: 42,
            opcode: Opcode::RdmaRead,
            local_addr: 0x1000,
            len: 4096,
            lkey: 1,
            remote_addr: 0x9000,
            rkey: 2,
            signaled: true,
            imm_data: 0,
        };
        let mut sge = ffi::ibv_sge::default();
        let mut out = ffi::ibv_send_wr::default();
        send_wr(&wr, &mut sge, &mut out);
        assert_eq!((sge.addr, sge.length, sge.lkey), (0x1000, 4096, 1));
        assert_eq!(
            (out.wr_id, out.opcode, out.send_flags),
            (42, ffi::IBV_WR_RDMA_READ, ffi::IBV_SEND_SIGNALED)
        );
        assert_eq!((out.rdma.remote_addr, out.rdma.rkey), (0x9000, 2));
        send_wr(
            &WorkRequest {
                signaled: false,
                opcode: Opcode::RdmaWrite,
                ..wr
            },
            &mut sge,
            &mut out,
        );
        assert_eq!((out.opcode, out.send_flags), (ffi::IBV_WR_RDMA_WRITE, 0));
        send_wr(
            &WorkRequest {
                opcode: Opcode::RdmaWriteWithImm,
                len: 0,
                imm_data: 0x0102_0304,
                ..wr
            },
            &mut sge,
            &mut out,
        );
        assert_eq!(
            (out.opcode, out.num_sge, out.imm_data.to_ne_bytes()),
            (ffi::IBV_WR_RDMA_WRITE_WITH_IMM, 0, [1, 2, 3, 4])
        );
        send_wr(
            &WorkRequest {
                opcode: Opcode::Send,
                ..wr
            },
            &mut sge,
            &mut out,
        );
        assert_eq!((out.opcode, out.num_sge), (ffi::IBV_WR_SEND, 1));
    }

    #[test]
    fn receives_and_immediate_completions_convert() {
        let mut sge = ffi::ibv_sge::default();
        let mut out = ffi::ibv_recv_wr::default();
        let rr = RecvRequest {
            wr_id: 7,
            addr: 0x2000,
            len: 512,
            lkey: 3,
        };
        recv_wr(&rr, &mut sge, &mut out);
        assert_eq!(
            (out.wr_id, out.num_sge, sge.addr, sge.length, sge.lkey),
            (7, 1, 0x2000, 512, 3)
        );
        recv_wr(&RecvRequest { len: 0, ..rr }, &mut sge, &mut out);
        assert_eq!(out.num_sge, 0);
        let wc = ffi::ibv_wc {
            wr_id: 9,
            byte_len: 100,
            imm_data: u32::from_ne_bytes([0xaa, 0, 0, 1]),
            wc_flags: ffi::IBV_WC_WITH_IMM,
            qp_num: 5,
            ..Default::default()
        };
        let c = completion(&wc);
        assert_eq!((c.wr_id, c.byte_len, c.imm, c.qp_num), (9, 100, Some(0xaa00_0001), 5));
        assert_eq!(completion(&ffi::ibv_wc { wc_flags: 0, ..wc }).imm, None);
    }
}
