//! The plain values the protocol decides with and the verbs layer converts to C: MTU, link
//! layer, GID, access rights, completion status. They live here, not in the verbs layer, so the
//! protocol imports nothing from it (it could be a crate of its own, as quinn-proto is); the
//! verbs layer re-exports them.

/// Path MTU of a queue pair (`enum ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(into = "u32", try_from = "u32")]
pub enum Mtu {
    /// 256 bytes.
    M256 = 1,
    /// 512 bytes.
    M512 = 2,
    /// 1024 bytes.
    M1024 = 3,
    /// 2048 bytes.
    M2048 = 4,
    /// 4096 bytes.
    M4096 = 5,
}

impl Mtu {
    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }

    /// From a byte count (256, 512, 1024, 2048, 4096).
    pub fn from_bytes(bytes: u32) -> Option<Mtu> {
        Some(match bytes {
            256 => Mtu::M256,
            512 => Mtu::M512,
            1024 => Mtu::M1024,
            2048 => Mtu::M2048,
            4096 => Mtu::M4096,
            _ => return None,
        })
    }

    /// From the `enum ibv_mtu` value a port reports.
    pub fn from_ibv(value: i32) -> Option<Mtu> {
        Self::from_bytes(128u32.checked_shl(u32::try_from(value).ok()?)?)
    }
}

impl From<Mtu> for u32 {
    fn from(m: Mtu) -> u32 {
        m.bytes()
    }
}

impl TryFrom<u32> for Mtu {
    type Error = String;
    fn try_from(bytes: u32) -> std::result::Result<Self, String> {
        Mtu::from_bytes(bytes).ok_or_else(|| format!("MTU {bytes} is not one of 256, 512, 1024, 2048, 4096"))
    }
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID; GRH only across subnets.
    Infiniband,
    /// RoCE: addressed by GID; every packet carries a GRH.
    Ethernet,
}

/// A 128-bit global identifier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// True for the all-zero (unset) GID.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

/// `enum ibv_wc_status` value of a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WcStatus(pub u32);

impl WcStatus {
    /// Success.
    pub const SUCCESS: WcStatus = WcStatus(0);
    /// Local length error: an incoming message is longer than the posted receive buffer.
    pub const LOC_LEN_ERR: WcStatus = WcStatus(1);
    /// Local protection error: the lkey does not cover the local range.
    pub const LOC_PROT_ERR: WcStatus = WcStatus(4);
    /// Flushed: the QP entered the error state before this request ran.
    pub const WR_FLUSH_ERR: WcStatus = WcStatus(5);
    /// The responder rejected the request as invalid.
    pub const REM_INV_REQ_ERR: WcStatus = WcStatus(9);
    /// The rkey does not cover the remote range or lacks the access right.
    pub const REM_ACCESS_ERR: WcStatus = WcStatus(10);
    /// The responder failed the operation.
    pub const REM_OP_ERR: WcStatus = WcStatus(11);
    /// Transport retries exhausted (no ACK: peer gone, link down, congestion).
    pub const RETRY_EXC_ERR: WcStatus = WcStatus(12);
    /// Receiver-not-ready retries exhausted.
    pub const RNR_RETRY_EXC_ERR: WcStatus = WcStatus(13);
    /// Fatal device error.
    pub const FATAL_ERR: WcStatus = WcStatus(19);
    /// Response timeout.
    pub const RESP_TIMEOUT_ERR: WcStatus = WcStatus(20);
    /// Unspecified error.
    pub const GENERAL_ERR: WcStatus = WcStatus(21);
}

/// Memory access rights of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// Peers may RDMA WRITE into it.
    pub remote_write: bool,
    /// Peers may RDMA READ from it.
    pub remote_read: bool,
}
