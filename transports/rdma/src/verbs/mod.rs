//! The thin verbs layer: every call into libibverbs goes through the [`Verbs`] trait, so the
//! protocol logic above it runs against `fake::RecordingVerbs` (feature `fake-verbs`) in tests and against
//! [`loaded::LoadedVerbs`] (libibverbs opened at run time) on RDMA hosts.
//!
//! The trait is deliberately small and mechanical: it converts between Rust values and the C
//! structures and does nothing else. Decisions (which attributes, when to signal, what to retry)
//! live in [`crate::protocol`].

pub mod conv;
#[cfg(any(test, feature = "fake-verbs"))]
pub mod fake;
pub mod ffi;
pub mod loaded;

use te_base::Result;

use crate::protocol::qp_state::QpTransition;
pub use crate::protocol::values::{Access, Gid, LinkLayer, Mtu, WcStatus};

/// The device limits the transport plans with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAttrs {
    /// Largest single memory registration.
    pub max_mr_size: u64,
    /// Most outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Most completion queue entries.
    pub max_cqe: u32,
    /// Most outstanding RDMA READs a QP may initiate.
    pub max_qp_rd_atom: u8,
    /// Number of physical ports (numbered from 1).
    pub phys_port_cnt: u8,
}

/// One port's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttrs {
    /// True when the port is ACTIVE.
    pub active: bool,
    /// Active path MTU.
    pub active_mtu: Mtu,
    /// Local identifier (InfiniBand).
    pub lid: u16,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
    /// Entries in the GID table.
    pub gid_table_len: u32,
    /// Largest message the port sends.
    pub max_msg_size: u32,
}

/// Keys of a memory registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrKeys {
    /// Local key, for our own work requests.
    pub lkey: u32,
    /// Remote key, published for peers.
    pub rkey: u32,
}

/// Send-queue limits of a new queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Scatter/gather entries per work request.
    pub max_send_sge: u32,
    /// Receive queue depth (0: the QP receives nothing; some providers still get 1).
    pub max_recv_wr: u32,
}

/// RDMA operation of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    /// Local to remote.
    RdmaWrite,
    /// Remote to local.
    RdmaRead,
    /// A message into the peer QP's next posted receive buffer (`IBV_WR_SEND`); no remote
    /// address or key. Without a posted receive the peer answers RNR and the send fails once the
    /// QP's RNR retries are spent.
    Send,
    /// An RDMA WRITE that also consumes the peer's next posted receive and reports `imm_data`
    /// in its completion (`IBV_WR_RDMA_WRITE_WITH_IMM`); may carry zero bytes.
    RdmaWriteWithImm,
}

/// One posted receive buffer (`ibv_post_recv` with at most one scatter/gather entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Buffer address (ignored when `len` is 0: a receive for zero-byte messages).
    pub addr: u64,
    /// Buffer length; a longer incoming message fails the receive (`LOC_LEN_ERR`) and the QP.
    pub len: u32,
    /// Local key of the registration holding the buffer.
    pub lkey: u32,
}

/// One work request with a single local scatter/gather entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// READ or WRITE.
    pub opcode: Opcode,
    /// Local address.
    pub local_addr: u64,
    /// Bytes (at most the port's `max_msg_size`).
    pub len: u32,
    /// Local key of the registration holding the local range.
    pub lkey: u32,
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key of the peer's registration holding the remote range.
    pub rkey: u32,
    /// Generates a completion when it finishes.
    pub signaled: bool,
    /// Immediate data of [`Opcode::RdmaWriteWithImm`] (host order; the layer converts).
    pub imm_data: u32,
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` of the work request.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Vendor-specific error syndrome.
    pub vendor_err: u32,
    /// The local QP number it completed on.
    pub qp_num: u32,
    /// Bytes received (receive completions only).
    pub byte_len: u32,
    /// Immediate data of a received [`Opcode::RdmaWriteWithImm`] (host order), when it carried one.
    pub imm: Option<u32>,
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            wr_id: 0,
            status: WcStatus::SUCCESS,
            vendor_err: 0,
            qp_num: 0,
            byte_len: 0,
            imm: None,
        }
    }
}

/// `ibv_post_send` failed: the first `posted` work requests were accepted, the rest were not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostError {
    /// Number of work requests accepted before the failing one.
    pub posted: usize,
    /// The error number the provider returned (ENOMEM: send queue full, EINVAL: bad request).
    pub errno: i32,
}

/// The verbs calls the transport makes. One implementation calls libibverbs; the recording fake
/// records calls and completes work requests by copying bytes.
///
/// Handles are owned values: destroying one consumes it, so a handle cannot be used after its
/// destruction.
pub trait Verbs: Send + Sync + 'static {
    /// An opened device (`ibv_context`).
    type Context: Send + Sync;
    /// A protection domain.
    type Pd: Send + Sync;
    /// A memory region.
    type Mr: Send + Sync;
    /// A completion queue.
    type Cq: Send + Sync;
    /// A queue pair.
    type Qp: Send + Sync;
    /// A completion channel (`ibv_comp_channel`): a file descriptor that turns readable when a
    /// CQ armed with [`Verbs::req_notify_cq`] receives a completion.
    type Channel: Send + Sync;

    /// Names of the RDMA devices on this host. Empty when there are none (including when the
    /// kernel has no RDMA support, `ENOSYS`).
    fn device_names(&self) -> Result<Vec<String>>;
    /// Opens a device by name.
    fn open_device(&self, name: &str) -> Result<Self::Context>;
    /// Device limits.
    fn query_device(&self, ctx: &Self::Context) -> Result<DeviceAttrs>;
    /// State of port `port` (from 1).
    fn query_port(&self, ctx: &Self::Context, port: u8) -> Result<PortAttrs>;
    /// Entry `index` of the port's GID table.
    fn query_gid(&self, ctx: &Self::Context, port: u8, index: u32) -> Result<Gid>;
    /// Allocates a protection domain.
    fn alloc_pd(&self, ctx: &Self::Context) -> Result<Self::Pd>;
    /// Registers `[addr, addr + len)`.
    ///
    /// # Safety
    ///
    /// The range must be memory of this process that stays mapped until [`Verbs::dereg_mr`]; with
    /// remote write access, peers may change its bytes at any time while it is registered.
    unsafe fn reg_mr(&self, pd: &Self::Pd, addr: u64, len: u64, access: Access) -> Result<(Self::Mr, MrKeys)>;
    /// Registers `len` bytes of a dma-buf starting `offset` bytes into it, addressed by peers and
    /// work requests as `iova` (`ibv_reg_dmabuf_mr`, rdma-core >= 34). [`te_base::Error::NotAvailable`]
    /// when the library lacks the verb.
    ///
    /// # Safety
    ///
    /// `fd` must be a dma-buf whose range `[offset, offset + len)` stays allocated until
    /// [`Verbs::dereg_mr`] (the registration keeps its own reference to the dma-buf, so `fd` may
    /// be closed once this returns).
    unsafe fn reg_dmabuf_mr(
        &self,
        pd: &Self::Pd,
        offset: u64,
        len: u64,
        iova: u64,
        fd: i32,
        access: Access,
    ) -> Result<(Self::Mr, MrKeys)>;
    /// True when [`Verbs::reg_dmabuf_mr`] can succeed (the library has the verb).
    fn supports_dmabuf(&self) -> bool;
    /// Releases a registration.
    fn dereg_mr(&self, mr: Self::Mr) -> Result<()>;
    /// Creates a completion channel on `ctx`, its descriptor non-blocking.
    fn create_comp_channel(&self, ctx: &Self::Context) -> Result<Self::Channel>;
    /// The channel's file descriptor, to wait on with `poll(2)`.
    fn channel_fd(&self, channel: &Self::Channel) -> std::os::fd::RawFd;
    /// Destroys a channel (after every CQ using it).
    fn destroy_comp_channel(&self, channel: Self::Channel) -> Result<()>;
    /// Creates a completion queue of at least `depth` entries, reporting to `channel` when armed.
    fn create_cq(&self, ctx: &Self::Context, depth: u32, channel: Option<&Self::Channel>) -> Result<Self::Cq>;
    /// Arms `cq`: the next completion it receives raises one event on its channel
    /// (`ibv_req_notify_cq`, every completion, not only solicited ones). Completions already in
    /// the CQ raise none, so a caller polls once more after arming before it waits.
    fn req_notify_cq(&self, cq: &Self::Cq) -> Result<()>;
    /// Takes every event pending on `channel` without blocking and acknowledges each
    /// (`ibv_get_cq_event` + `ibv_ack_cq_events`); returns how many there were.
    fn take_cq_events(&self, channel: &Self::Channel) -> Result<u32>;
    /// Creates an RC queue pair (in RESET) whose send and receive completions go to `cq`. Returns
    /// its number.
    fn create_qp(&self, pd: &Self::Pd, cq: &Self::Cq, caps: QpCaps) -> Result<(Self::Qp, u32)>;
    /// Moves a queue pair to another state with the transition's attributes.
    fn modify_qp(&self, qp: &Self::Qp, transition: &QpTransition) -> Result<()>;
    /// Posts work requests in order. On failure the first `posted` were accepted.
    fn post_send(&self, qp: &Self::Qp, wrs: &[WorkRequest]) -> std::result::Result<(), PostError>;
    /// Posts receive buffers in order (consumed by incoming SENDs and WRITE WITH IMMs in that
    /// order). On failure the first `posted` were accepted.
    fn post_recv(&self, qp: &Self::Qp, rrs: &[RecvRequest]) -> std::result::Result<(), PostError>;
    /// Takes up to `out.len()` completions; returns how many.
    fn poll_cq(&self, cq: &Self::Cq, out: &mut [Completion]) -> Result<usize>;
    /// Destroys a queue pair.
    fn destroy_qp(&self, qp: Self::Qp) -> Result<()>;
    /// Destroys a completion queue.
    fn destroy_cq(&self, cq: Self::Cq) -> Result<()>;
    /// Frees a protection domain.
    fn dealloc_pd(&self, pd: Self::Pd) -> Result<()>;
    /// Closes a device.
    fn close_device(&self, ctx: Self::Context) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_conversions() {
        assert_eq!(Mtu::from_ibv(5), Some(Mtu::M4096));
        assert_eq!(Mtu::from_ibv(1), Some(Mtu::M256));
        assert_eq!(Mtu::from_ibv(0), None);
        assert_eq!(Mtu::from_ibv(6), None);
        assert_eq!(Mtu::from_ibv(-1), None);
        assert_eq!(Mtu::from_ibv(99), None);
        assert_eq!(Mtu::M1024.bytes(), 1024);
        assert_eq!(Mtu::from_bytes(2048), Some(Mtu::M2048));
        assert_eq!(Mtu::from_bytes(1500), None);
        assert!(Mtu::M1024 < Mtu::M4096);
    }
}
