//! `#[repr(C)]` mirrors of the libibverbs ABI structures this crate touches, and the constants it
//! uses.
//!
//! Why hand-written mirrors instead of bindgen: libibverbs is opened at run time, so the build must
//! not need `<infiniband/verbs.h>`. rdma-core keeps these structures ABI-stable since libibverbs
//! 1.1 (new fields go into `verbs_context`, which sits *before* `ibv_context`, or into `_ex`
//! structures), which is what makes a mirror sound. `tests/abi_layout.rs` compiles a C program
//! against the system header, when one is installed, and checks every size and offset below.
//!
//! Structures the library allocates and we only read (`ibv_context`, `ibv_qp`, `ibv_cq`) are
//! mirrored up to the last field we read; structures we allocate and the library reads or writes
//! (`ibv_qp_attr`, `ibv_send_wr`, `ibv_wc`...) are mirrored completely.

#![allow(non_camel_case_types, missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `union ibv_gid`: 16 raw bytes, 8-byte aligned (the union's other member is two `__be64`).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr`. The exported `ibv_query_port` symbol writes the compat prefix (through
/// `link_layer`); the struct is zeroed first, as the header's inline wrapper does.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut c_void,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The `wr.rdma` member of `ibv_send_wr`'s `wr` union, padded to the union's size (the `atomic`
/// member, 32 bytes, is the largest).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
    pub _pad: [u32; 5],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    pub imm_data: u32,
    pub rdma: ibv_send_wr_rdma,
    pub qp_type_xrc_remote_srqn: u32,
    /// The `bind_mw` / `tso` union (48 bytes, pointer-aligned); unused for RDMA READ/WRITE.
    pub _bind_mw_or_tso: [u64; 6],
}

impl Default for ibv_send_wr {
    fn default() -> Self {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            rdma: ibv_send_wr_rdma::default(),
            qp_type_xrc_remote_srqn: 0,
            _bind_mw_or_tso: [0; 6],
        }
    }
}

/// `struct ibv_recv_wr`: one receive buffer (`sg_list`, `num_sge` entries; none for zero-byte
/// messages).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

impl Default for ibv_recv_wr {
    fn default() -> Self {
        ibv_recv_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        }
    }
}

/// A work request that providers take as a linked chain (`ibv_send_wr`, `ibv_recv_wr`).
pub trait Linked: Copy + Default {
    /// Points the request at its scatter/gather entry and the next request (null: the last).
    fn link(&mut self, sge: *mut ibv_sge, next: *mut Self);
}

impl Linked for ibv_send_wr {
    fn link(&mut self, sge: *mut ibv_sge, next: *mut Self) {
        self.sg_list = sge;
        self.next = next;
    }
}

impl Linked for ibv_recv_wr {
    fn link(&mut self, sge: *mut ibv_sge, next: *mut Self) {
        self.sg_list = sge;
        self.next = next;
    }
}

pub type PostSendFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecvFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;

/// `struct ibv_context_ops`: the provider's function table. `ibv_post_send`, `ibv_post_recv` and
/// `ibv_poll_cq` are `static inline` in verbs.h and call through `post_send` / `post_recv` /
/// `poll_cq` here, and `ibv_req_notify_cq` through `req_notify_cq`; we do the same.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: *mut c_void,
    pub _compat_query_port: *mut c_void,
    pub _compat_alloc_pd: *mut c_void,
    pub _compat_dealloc_pd: *mut c_void,
    pub _compat_reg_mr: *mut c_void,
    pub _compat_rereg_mr: *mut c_void,
    pub _compat_dereg_mr: *mut c_void,
    pub alloc_mw: *mut c_void,
    pub bind_mw: *mut c_void,
    pub dealloc_mw: *mut c_void,
    pub _compat_create_cq: *mut c_void,
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyCqFn>,
    pub _compat_cq_event: *mut c_void,
    pub _compat_resize_cq: *mut c_void,
    pub _compat_destroy_cq: *mut c_void,
    pub _compat_create_srq: *mut c_void,
    pub _compat_modify_srq: *mut c_void,
    pub _compat_query_srq: *mut c_void,
    pub _compat_destroy_srq: *mut c_void,
    pub post_srq_recv: *mut c_void,
    pub _compat_create_qp: *mut c_void,
    pub _compat_query_qp: *mut c_void,
    pub _compat_modify_qp: *mut c_void,
    pub _compat_destroy_qp: *mut c_void,
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _compat_create_ah: *mut c_void,
    pub _compat_destroy_ah: *mut c_void,
    pub _compat_attach_mcast: *mut c_void,
    pub _compat_detach_mcast: *mut c_void,
    pub _compat_async_event: *mut c_void,
}

/// Prefix of `struct ibv_context` (the library allocates it; we read `device` and `ops`).
#[repr(C)]
pub struct ibv_context {
    pub device: *mut c_void,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
}

/// Prefix of `struct ibv_qp` (through `qp_num`).
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
}

/// `struct ibv_comp_channel` (the library allocates it; we read `fd`).
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// Prefix of `struct ibv_cq` (through `cqe`).
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut c_void,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
}

// enum ibv_qp_state
pub const IBV_QPS_RESET: c_int = 0;
pub const IBV_QPS_INIT: c_int = 1;
pub const IBV_QPS_RTR: c_int = 2;
pub const IBV_QPS_RTS: c_int = 3;
pub const IBV_QPS_ERR: c_int = 6;

// enum ibv_qp_attr_mask
pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

// enum ibv_access_flags
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: c_int = 1 << 2;

// enum ibv_qp_type, ibv_wr_opcode, ibv_send_flags
pub const IBV_QPT_RC: c_int = 2;
pub const IBV_WR_RDMA_WRITE: c_int = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_int = 1;
pub const IBV_WR_SEND: c_int = 2;
pub const IBV_WR_RDMA_READ: c_int = 4;
pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;

// enum ibv_wc_flags
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;

// enum ibv_port_state, ibv_link_layer
pub const IBV_PORT_ACTIVE: c_int = 4;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

/// Every (struct, field, offset) and (struct, size) the ABI test checks against verbs.h.
#[cfg(test)]
fn layout_table() -> Vec<(&'static str, usize)> {
    use std::mem::{offset_of, size_of};
    macro_rules! off {
        ($t:ident, $f:ident) => {
            (concat!(stringify!($t), ".", stringify!($f)), offset_of!($t, $f))
        };
        ($t:ident, $f:ident, $c:literal) => {
            (concat!(stringify!($t), ".", $c), offset_of!($t, $f))
        };
    }
    vec![
        ("sizeof ibv_device_attr", size_of::<ibv_device_attr>()),
        off!(ibv_device_attr, max_mr_size),
        off!(ibv_device_attr, max_qp_wr),
        off!(ibv_device_attr, max_sge),
        off!(ibv_device_attr, max_cqe),
        off!(ibv_device_attr, max_qp_rd_atom),
        off!(ibv_device_attr, phys_port_cnt),
        ("sizeof ibv_port_attr", size_of::<ibv_port_attr>()),
        off!(ibv_port_attr, state),
        off!(ibv_port_attr, active_mtu),
        off!(ibv_port_attr, gid_tbl_len),
        off!(ibv_port_attr, max_msg_sz),
        off!(ibv_port_attr, lid),
        off!(ibv_port_attr, link_layer),
        ("sizeof ibv_wc", size_of::<ibv_wc>()),
        off!(ibv_wc, status),
        off!(ibv_wc, vendor_err),
        off!(ibv_wc, byte_len),
        off!(ibv_wc, imm_data),
        off!(ibv_wc, qp_num),
        off!(ibv_wc, wc_flags),
        off!(ibv_wc, dlid_path_bits),
        off!(ibv_mr, length),
        off!(ibv_mr, lkey),
        off!(ibv_mr, rkey),
        ("sizeof ibv_ah_attr", size_of::<ibv_ah_attr>()),
        off!(ibv_ah_attr, dlid),
        off!(ibv_ah_attr, is_global),
        off!(ibv_ah_attr, port_num),
        ("sizeof ibv_global_route", size_of::<ibv_global_route>()),
        off!(ibv_global_route, sgid_index),
        off!(ibv_global_route, traffic_class),
        ("sizeof ibv_qp_init_attr", size_of::<ibv_qp_init_attr>()),
        off!(ibv_qp_init_attr, cap),
        off!(ibv_qp_init_attr, qp_type),
        off!(ibv_qp_init_attr, sq_sig_all),
        ("sizeof ibv_qp_attr", size_of::<ibv_qp_attr>()),
        off!(ibv_qp_attr, path_mtu),
        off!(ibv_qp_attr, dest_qp_num),
        off!(ibv_qp_attr, qp_access_flags),
        off!(ibv_qp_attr, ah_attr),
        off!(ibv_qp_attr, pkey_index),
        off!(ibv_qp_attr, max_rd_atomic),
        off!(ibv_qp_attr, max_dest_rd_atomic),
        off!(ibv_qp_attr, min_rnr_timer),
        off!(ibv_qp_attr, port_num),
        off!(ibv_qp_attr, timeout),
        off!(ibv_qp_attr, retry_cnt),
        off!(ibv_qp_attr, rnr_retry),
        off!(ibv_qp_attr, rate_limit),
        ("sizeof ibv_sge", size_of::<ibv_sge>()),
        ("sizeof ibv_send_wr", size_of::<ibv_send_wr>()),
        off!(ibv_send_wr, next),
        off!(ibv_send_wr, sg_list),
        off!(ibv_send_wr, num_sge),
        off!(ibv_send_wr, opcode),
        off!(ibv_send_wr, send_flags),
        off!(ibv_send_wr, rdma, "wr.rdma.remote_addr"),
        (
            "ibv_send_wr.wr.rdma.rkey",
            offset_of!(ibv_send_wr, rdma) + offset_of!(ibv_send_wr_rdma, rkey),
        ),
        off!(ibv_send_wr, qp_type_xrc_remote_srqn, "qp_type.xrc.remote_srqn"),
        off!(ibv_send_wr, _bind_mw_or_tso, "bind_mw"),
        ("sizeof ibv_recv_wr", size_of::<ibv_recv_wr>()),
        off!(ibv_recv_wr, next),
        off!(ibv_recv_wr, sg_list),
        off!(ibv_recv_wr, num_sge),
        off!(ibv_context, ops),
        (
            "ibv_context.ops.post_recv",
            offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, post_recv),
        ),
        (
            "ibv_context.ops.poll_cq",
            offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, poll_cq),
        ),
        (
            "ibv_context.ops.post_send",
            offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, post_send),
        ),
        (
            "ibv_context.ops.req_notify_cq",
            offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, req_notify_cq),
        ),
        off!(ibv_context, cmd_fd),
        ("sizeof ibv_comp_channel", size_of::<ibv_comp_channel>()),
        off!(ibv_comp_channel, fd),
        off!(ibv_qp, context),
        off!(ibv_qp, qp_num),
        off!(ibv_cq, context),
        off!(ibv_cq, cqe),
    ]
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::process::Command;

    /// Compiles a C program against the system's verbs.h that prints every size and offset of
    /// [`super::layout_table`], and compares. Needs a C compiler and libibverbs-dev (headers only:
    /// the program links nothing); skips with a message otherwise unless `TE_REQUIRE` names
    /// `libibverbs-dev`.
    #[test]
    fn mirrors_match_the_system_verbs_header() {
        let header = Path::new("/usr/include/infiniband/verbs.h");
        let required = std::env::var("TE_REQUIRE")
            .map(|v| v.split(',').any(|x| x.trim() == "libibverbs-dev"))
            .unwrap_or(false);
        if !header.exists() {
            assert!(
                !required,
                "TE_REQUIRE names libibverbs-dev but {} is missing",
                header.display()
            );
            eprintln!(
                "skipped: {} not installed (Debian package libibverbs-dev)",
                header.display()
            );
            return;
        }
        let table = super::layout_table();
        let mut c =
            String::from("#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {\n");
        for (name, _) in &table {
            let expr = match name.strip_prefix("sizeof ") {
                Some(s) => format!("sizeof(struct {s})"),
                None => {
                    let (ty, field) = name.split_once('.').expect("name is struct.field");
                    format!("offsetof(struct {ty}, {field})")
                }
            };
            c.push_str(&format!("  printf(\"%zu\\n\", (size_t)({expr}));\n"));
        }
        c.push_str("  return 0;\n}\n");
        let dir = std::env::temp_dir().join(format!("te-rdma-abi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("abi.c");
        let exe = dir.join("abi");
        std::fs::write(&src, c).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let built = Command::new(&cc).arg("-o").arg(&exe).arg(&src).status();
        match built {
            Ok(s) if s.success() => {}
            other => {
                assert!(!required, "TE_REQUIRE names libibverbs-dev but {cc} failed: {other:?}");
                eprintln!("skipped: could not compile the ABI probe with {cc}: {other:?}");
                return;
            }
        }
        let out = Command::new(&exe).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let c_values: Vec<usize> = text.lines().map(|l| l.parse().unwrap()).collect();
        assert_eq!(c_values.len(), table.len());
        let mismatches: Vec<String> = table
            .iter()
            .zip(&c_values)
            .filter(|((_, rust), c)| rust != *c)
            .map(|((name, rust), c)| format!("{name}: rust {rust}, verbs.h {c}"))
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(mismatches.is_empty(), "ABI mismatches: {mismatches:#?}");
    }
}
