//! A recording fake of the verbs layer, for tests (never installed by `install()`).
//!
//! It records every call, checks what hardware checks (QP state transitions, send-queue
//! overflow, lkey/rkey bounds and access rights), and executes RDMA READ/WRITE by copying bytes
//! between registered ranges of this process, so the transport's logic can be tested end to end
//! with byte verification. Faults are injected per QP: the next work request fails with a chosen
//! status, the QP goes to ERROR and everything posted after it is flushed, as on hardware.
//!
//! Two-sided operations are modelled with RC semantics: a SEND or WRITE WITH IMM consumes the
//! connected QP's oldest posted receive (in order) and completes it there; with none posted and
//! finite RNR retries the sender fails with `RNR_RETRY_EXC_ERR`, a message longer than the
//! receive buffer fails both sides (`REM_INV_REQ_ERR` / `LOC_LEN_ERR`), and nothing is dropped
//! silently; with `rnr_retry` 7 (retry forever) the SEND waits, posted, until a receive is
//! posted. A device can stop responding ([`RecordingVerbs::stop_responding`]): work requests
//! aimed at its QPs are held unexecuted and uncompleted at the sender until the sender's QP enters
//! ERROR, which flushes them (`WR_FLUSH_ERR`, one completion each) as hardware does, unless the
//! sender's device was told not to ([`RecordingVerbs::stop_flushing`]).

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};

use parking_lot::Mutex;
use te_base::{Error, Result};

use super::{
    Access, Completion, DeviceAttrs, Gid, LinkLayer, MrKeys, Mtu, Opcode, PortAttrs, PostError, QpCaps, RecvRequest,
    Verbs, WcStatus, WorkRequest,
};
use crate::protocol::qp_state::{QpMachine, QpState, QpTransition};

/// One recorded verbs call.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    /// `create_comp_channel` on a device.
    CreateCompChannel,
    /// `open_device(name)`.
    OpenDevice(String),
    /// `alloc_pd` on a device.
    AllocPd,
    /// `reg_mr(addr, len)` in a protection domain of `device`.
    RegMr { device: String, addr: u64, len: u64 },
    /// `reg_dmabuf_mr` in a protection domain of `device`: `len` bytes at `offset` into dma-buf
    /// `fd`, addressed as `iova`.
    RegDmabufMr {
        device: String,
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
    },
    /// `dereg_mr(lkey)`.
    DeregMr { lkey: u32 },
    /// `create_cq(depth)`.
    CreateCq { depth: u32 },
    /// `create_qp` returning `qpn`.
    CreateQp { qpn: u32, caps: QpCaps },
    /// `modify_qp(qpn, transition)`.
    ModifyQp { qpn: u32, transition: QpTransition },
    /// `post_send(qpn, wrs)`: the work requests of one call.
    PostSend { qpn: u32, wrs: Vec<WorkRequest> },
    /// `post_recv(qpn, rrs)`: the receive buffers of one call.
    PostRecv { qpn: u32, rrs: Vec<RecvRequest> },
    /// `destroy_qp(qpn)`.
    DestroyQp { qpn: u32 },
}

/// A fake device's description.
#[derive(Debug, Clone)]
pub struct FakeDevice {
    /// Device name (`mlx5_0`).
    pub name: String,
    /// Limits.
    pub attrs: DeviceAttrs,
    /// Port 1.
    pub port: PortAttrs,
    /// GID table of port 1.
    pub gids: Vec<Gid>,
}

impl FakeDevice {
    /// A RoCE device with an active 4096-byte MTU port and an IPv4-mapped GID at index 3.
    pub fn roce(name: &str, ipv4: [u8; 4]) -> Self {
        let mut v4 = [0u8; 16];
        v4[10] = 0xff;
        v4[11] = 0xff;
        v4[12..].copy_from_slice(&ipv4);
        let mut link_local = [0u8; 16];
        link_local[0] = 0xfe;
        link_local[1] = 0x80;
        link_local[15] = 1;
        FakeDevice {
            name: name.into(),
            attrs: DeviceAttrs {
                max_mr_size: 1 << 40,
                max_qp_wr: 8192,
                max_cqe: 1 << 16,
                max_qp_rd_atom: 16,
                phys_port_cnt: 1,
            },
            port: PortAttrs {
                active: true,
                active_mtu: Mtu::M4096,
                lid: 0,
                link_layer: LinkLayer::Ethernet,
                gid_table_len: 4,
                max_msg_size: 1 << 30,
            },
            gids: vec![Gid(link_local), Gid(link_local), Gid(v4), Gid(v4)],
        }
    }
}

#[derive(Debug)]
struct FakeMr {
    addr: u64,
    len: u64,
    access: Access,
}

#[derive(Debug)]
struct FakeQp {
    cq: u32,
    depth: u32,
    /// Work requests posted and not yet retired by a signalled completion being polled.
    outstanding: u32,
    /// Unsignalled requests since the last signalled one (retired with it).
    unsignalled: u32,
    machine: QpMachine,
    fail_next: Option<WcStatus>,
    /// The connected QP (set by the RTR transition).
    remote: Option<u32>,
    /// Posted receives, oldest first, at most `recv_depth`.
    recvs: VecDeque<RecvRequest>,
    recv_depth: u32,
    /// Work requests posted but not run: aimed at a device that stopped responding, or waiting
    /// for the peer to post a receive (RNR retried forever). Everything posted after the first
    /// one waits behind it (RC order).
    held: VecDeque<WorkRequest>,
    /// `rnr_retry` 7: a SEND finding no receive waits instead of failing.
    rnr_forever: bool,
}

#[derive(Debug, Default)]
struct State {
    calls: Vec<Call>,
    next_id: u32,
    mrs: HashMap<u32, FakeMr>,
    qps: HashMap<u32, FakeQp>,
    cqs: HashMap<u32, VecDeque<(Completion, u32)>>,
    fail_calls: HashMap<&'static str, i32>,
    fail_posts: HashMap<u32, i32>,
    /// Device index of every PD, MR and QP, by handle.
    device_of: HashMap<u32, u32>,
    /// Whether `reg_dmabuf_mr` answers as a library without the verb would.
    no_dmabuf: bool,
    /// Devices (by index) that stopped responding, and devices whose QPs never flush.
    silent: Vec<u32>,
    no_flush: Vec<u32>,
    /// Flush completions generated so far.
    flushed: u64,
    /// Every QP that ever entered ERROR (kept after it is destroyed).
    errored: std::collections::HashSet<u32>,
    /// Each CQ's channel (the writing end), the armed CQs, and the events raised so far.
    cq_channel: HashMap<u32, std::os::unix::net::UnixStream>,
    armed: std::collections::HashSet<u32>,
    events_raised: u64,
}

/// The recording fake. Handles are plain ids.
#[derive(Debug)]
pub struct RecordingVerbs {
    devices: Vec<FakeDevice>,
    state: Mutex<State>,
}

/// A fake completion channel: a socket pair; the fake writes a byte per event into one end, the
/// transport waits on the other.
#[derive(Debug)]
pub struct FakeChannel {
    rx: std::os::unix::net::UnixStream,
    tx: std::os::unix::net::UnixStream,
}

/// Handle of a fake object (its id; for a QP, its QP number; for an MR, its lkey).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct Handle(pub u32);

impl RecordingVerbs {
    /// A fake host with these devices.
    pub fn new(devices: Vec<FakeDevice>) -> Self {
        RecordingVerbs {
            devices,
            state: Mutex::new(State {
                next_id: 0x100,
                ..State::default()
            }),
        }
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().calls.clone()
    }

    /// Forgets the recorded calls.
    pub fn clear_calls(&self) {
        self.state.lock().calls.clear();
    }

    /// The next work request posted to `qpn` completes with `status`, and the QP enters ERROR.
    pub fn fail_next_wr(&self, qpn: u32, status: WcStatus) {
        if let Some(qp) = self.state.lock().qps.get_mut(&qpn) {
            qp.fail_next = Some(status);
        }
    }

    /// The next `post_send` on `qpn` is refused with `errno` (nothing of it is accepted).
    pub fn fail_next_post(&self, qpn: u32, errno: i32) {
        self.state.lock().fail_posts.insert(qpn, errno);
    }

    /// The next call of verb `name` (`"reg_mr"`, `"create_qp"`, `"modify_qp"`...) fails with `errno`.
    pub fn fail_next_call(&self, name: &'static str, errno: i32) {
        self.state.lock().fail_calls.insert(name, errno);
    }

    /// Device `name` stops responding (its host hangs without closing anything): work requests
    /// aimed at its QPs stay outstanding at their senders, uncompleted, until the sender's QP
    /// enters ERROR.
    pub fn stop_responding(&self, name: &str) {
        let i = self.index_of(name);
        self.state.lock().silent.extend(i);
    }

    /// Device `name` responds again: work requests held for it run now, in order, and new ones
    /// run at once.
    pub fn resume_responding(&self, name: &str) {
        let i = self.index_of(name);
        let mut s = self.state.lock();
        s.silent.retain(|d| Some(*d) != i);
        let qpns: Vec<u32> = s.qps.keys().copied().collect();
        for qpn in qpns {
            redrive(&mut s, qpn);
        }
    }

    /// QPs of device `name` never flush: entering ERROR completes nothing they hold (a wedged
    /// device or driver). Only destroying the QP ends them.
    pub fn stop_flushing(&self, name: &str) {
        let i = self.index_of(name);
        self.state.lock().no_flush.extend(i);
    }

    /// Work requests held (posted, not executed, not completed) on QP `qpn`.
    pub fn held(&self, qpn: u32) -> usize {
        self.state.lock().qps.get(&qpn).map_or(0, |q| q.held.len())
    }

    /// Work requests held on every QP.
    pub fn held_total(&self) -> usize {
        self.state.lock().qps.values().map(|q| q.held.len()).sum()
    }

    /// Flush completions generated so far.
    pub fn flushed(&self) -> u64 {
        self.state.lock().flushed
    }

    /// Receives posted and not yet consumed on QP `qpn`.
    pub fn posted_recvs(&self, qpn: u32) -> usize {
        self.state.lock().qps.get(&qpn).map_or(0, |q| q.recvs.len())
    }

    /// Completion-channel events raised so far (one per completion that found its CQ armed).
    pub fn events_raised(&self) -> u64 {
        self.state.lock().events_raised
    }

    /// Completions waiting in every CQ (not yet polled).
    pub fn unpolled(&self) -> usize {
        self.state.lock().cqs.values().map(VecDeque::len).sum()
    }

    /// The local key of a live registration covering `[addr, addr + len)`.
    pub fn lkey_of(&self, addr: u64, len: u64) -> Option<u32> {
        let s = self.state.lock();
        s.mrs.iter().find(|(_, m)| covers(m, addr, len)).map(|(k, _)| *k)
    }

    fn index_of(&self, name: &str) -> Option<u32> {
        self.devices.iter().position(|d| d.name == name).map(|i| i as u32)
    }

    /// The state of QP `qpn`, if it exists.
    pub fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.state.lock().qps.get(&qpn).map(|q| q.machine.state())
    }

    /// Whether QP `qpn` ever entered ERROR, even if it was destroyed since (a transport replaces
    /// a failed QP at once, so its ERROR state may last too briefly to be seen by polling).
    pub fn entered_error(&self, qpn: u32) -> bool {
        self.state.lock().errored.contains(&qpn)
    }

    /// The library behaves as rdma-core < 34: `reg_dmabuf_mr` is not available.
    pub fn without_dmabuf(self) -> Self {
        self.state.lock().no_dmabuf = true;
        self
    }

    /// The device a live MR (by lkey) or QP (by number) belongs to.
    pub fn device_of(&self, handle: u32) -> Option<String> {
        let s = self.state.lock();
        s.device_of
            .get(&handle)
            .and_then(|&d| self.devices.get(d as usize))
            .map(|d| d.name.clone())
    }

    /// Number of live memory registrations.
    pub fn live_mrs(&self) -> usize {
        self.state.lock().mrs.len()
    }

    fn pd_device(&self, s: &State, pd: &Handle) -> Result<u32> {
        s.device_of
            .get(&pd.0)
            .copied()
            .ok_or_else(|| Error::transport("rdma", "fake: unknown protection domain"))
    }

    fn device(&self, name_or_ctx: u32) -> Result<&FakeDevice> {
        self.devices
            .get(name_or_ctx as usize)
            .ok_or_else(|| Error::transport("rdma", "fake: bad device handle"))
    }
}

fn injected(state: &mut State, name: &'static str) -> Result<()> {
    match state.fail_calls.remove(name) {
        Some(errno) => Err(Error::transport_caused(
            "rdma",
            name,
            std::io::Error::from_raw_os_error(errno),
        )),
        None => Ok(()),
    }
}

fn insert_mr(s: &mut State, device: u32, mr: FakeMr) -> (Handle, MrKeys) {
    s.next_id += 1;
    let key = s.next_id;
    s.mrs.insert(key, mr);
    s.device_of.insert(key, device);
    (Handle(key), MrKeys { lkey: key, rkey: key })
}

fn covers(mr: &FakeMr, addr: u64, len: u64) -> bool {
    addr >= mr.addr && len <= mr.len && addr - mr.addr <= mr.len - len
}

/// Executes one work request against the registrations; the status hardware would report.
fn execute(state: &mut State, qpn: u32, wr: &WorkRequest) -> WcStatus {
    let len = u64::from(wr.len);
    if len > 0 && !state.mrs.get(&wr.lkey).is_some_and(|m| covers(m, wr.local_addr, len)) {
        return WcStatus::LOC_PROT_ERR;
    }
    match wr.opcode {
        Opcode::Send => receive(state, qpn, wr, None),
        Opcode::RdmaWriteWithImm => {
            if len > 0 {
                let st = one_sided(state, wr, Opcode::RdmaWrite);
                if st != WcStatus::SUCCESS {
                    return st;
                }
            }
            receive(state, qpn, wr, Some(wr.imm_data))
        }
        op => one_sided(state, wr, op),
    }
}

/// A SEND (`imm: None`, its bytes copied into the receive buffer) or WRITE WITH IMM arriving at
/// the QP connected to `qpn`: consumes its oldest posted receive and completes it there.
fn receive(state: &mut State, qpn: u32, wr: &WorkRequest, imm: Option<u32>) -> WcStatus {
    let Some(remote) = state.qps.get(&qpn).and_then(|q| q.remote) else {
        return WcStatus::RETRY_EXC_ERR;
    };
    let Some(rq) = state.qps.get_mut(&remote) else {
        return WcStatus::RETRY_EXC_ERR;
    };
    if !matches!(rq.machine.state(), QpState::Rtr | QpState::Rts) {
        // A responder in RESET or ERROR does not acknowledge.
        return WcStatus::RETRY_EXC_ERR;
    }
    let Some(rr) = rq.recvs.pop_front() else {
        // Receiver not ready, and the sender's RNR retries are finite (forever: `blocked` held
        // it): they run out.
        return WcStatus::RNR_RETRY_EXC_ERR;
    };
    let cq = rq.cq;
    let done = |status: WcStatus, byte_len: u32, state: &mut State| {
        let c = Completion {
            wr_id: rr.wr_id,
            status,
            vendor_err: 0,
            qp_num: remote,
            byte_len,
            imm,
        };
        push_cq(state, cq, (c, 0));
    };
    if imm.is_none() {
        if wr.len > rr.len {
            done(WcStatus::LOC_LEN_ERR, 0, state);
            enter_error(state, remote);
            return WcStatus::REM_INV_REQ_ERR;
        }
        // Every registration of this crate grants local write.
        let dst_ok = wr.len == 0
            || state
                .mrs
                .get(&rr.lkey)
                .is_some_and(|m| covers(m, rr.addr, u64::from(wr.len)));
        if !dst_ok {
            done(WcStatus::LOC_PROT_ERR, 0, state);
            enter_error(state, remote);
            return WcStatus::REM_OP_ERR;
        }
        if wr.len > 0 {
            // SAFETY: the sender's range lies in a live registration (checked by `execute`) and
            // the receive buffer in a live registration with local write access: both are mapped
            // memory of this process by `reg_mr`'s contract; `copy` tolerates overlap.
            unsafe { std::ptr::copy(wr.local_addr as *const u8, rr.addr as *mut u8, wr.len as usize) };
        }
    }
    done(WcStatus::SUCCESS, wr.len, state);
    WcStatus::SUCCESS
}

/// Moves QP `qpn` to ERROR: its held work requests and posted receives complete with
/// `WR_FLUSH_ERR` (unless its device never flushes), one completion each, as hardware does.
fn enter_error(state: &mut State, qpn: u32) {
    let no_flush = state.device_of.get(&qpn).is_some_and(|d| state.no_flush.contains(d));
    if state.qps.contains_key(&qpn) {
        state.errored.insert(qpn);
    }
    let Some(q) = state.qps.get_mut(&qpn) else { return };
    q.machine.mark_error();
    q.fail_next = None;
    if no_flush {
        return;
    }
    let cq = q.cq;
    let mut out = Vec::with_capacity(q.held.len() + q.recvs.len());
    for wr in q.held.drain(..) {
        // The first flush also retires the unsignalled requests that ran before it.
        out.push((wr.wr_id, 1 + std::mem::take(&mut q.unsignalled)));
    }
    for rr in q.recvs.drain(..) {
        out.push((rr.wr_id, 0));
    }
    state.flushed += out.len() as u64;
    for (wr_id, retire) in out {
        let c = Completion {
            wr_id,
            status: WcStatus::WR_FLUSH_ERR,
            qp_num: qpn,
            ..Completion::default()
        };
        push_cq(state, cq, (c, retire));
    }
}

/// Queues a completion on CQ `cq`; if the CQ is armed, disarms it and raises one event on its
/// channel, as a device does (completions queued while unarmed raise none).
fn push_cq(state: &mut State, cq: u32, entry: (Completion, u32)) {
    state.cqs.get_mut(&cq).expect("QP's CQ exists").push_back(entry);
    if state.armed.remove(&cq) {
        if let Some(tx) = state.cq_channel.get(&cq) {
            // A full socket buffer already makes the channel readable: nothing is lost.
            let _ = (&*tx).write(&[1]);
            state.events_raised += 1;
        }
    }
}

/// True when `wr`, next in line on QP `qpn`, cannot run yet: its peer stopped responding, or it
/// needs a receive the peer has not posted and the QP retries RNR forever (`rnr_retry` 7). Such a
/// request stays posted and uncompleted, as on hardware.
fn blocked(state: &State, qpn: u32, wr: &WorkRequest) -> bool {
    let Some(q) = state.qps.get(&qpn) else { return false };
    if q.machine.state() != QpState::Rts || q.fail_next.is_some() {
        return false;
    }
    let Some(remote) = q.remote else { return false };
    if state.device_of.get(&remote).is_some_and(|d| state.silent.contains(d)) {
        return true;
    }
    let needs_receive = matches!(wr.opcode, Opcode::Send | Opcode::RdmaWriteWithImm);
    needs_receive
        && q.rnr_forever
        && state
            .qps
            .get(&remote)
            .is_some_and(|r| matches!(r.machine.state(), QpState::Rtr | QpState::Rts) && r.recvs.is_empty())
}

/// Runs `wr` on QP `qpn` (flushed if the QP is in ERROR) and queues its completion.
fn run(state: &mut State, qpn: u32, wr: &WorkRequest) {
    let q = state.qps.get(&qpn).expect("caller checked");
    let error = q.machine.state() == QpState::Error;
    let status = if error {
        state.flushed += 1;
        WcStatus::WR_FLUSH_ERR
    } else if let Some(st) = q.fail_next {
        st
    } else {
        execute(state, qpn, wr)
    };
    let q = state.qps.get_mut(&qpn).expect("caller checked");
    let cq = q.cq;
    let failed = status != WcStatus::SUCCESS;
    // Errors complete every request (signalled or not), as flushed WRs do on hardware.
    if wr.signaled || failed {
        let retire = q.unsignalled + 1;
        q.unsignalled = 0;
        let c = Completion {
            wr_id: wr.wr_id,
            status,
            qp_num: qpn,
            ..Completion::default()
        };
        push_cq(state, cq, (c, retire));
    } else {
        q.unsignalled += 1;
    }
    if failed && !error {
        enter_error(state, qpn);
    }
}

/// Runs the requests waiting on QP `qpn` that can run now, in order.
fn redrive(state: &mut State, qpn: u32) {
    loop {
        let Some(&wr) = state.qps.get(&qpn).and_then(|q| q.held.front()) else {
            return;
        };
        if blocked(state, qpn, &wr) {
            return;
        }
        state.qps.get_mut(&qpn).expect("just read").held.pop_front();
        run(state, qpn, &wr);
    }
}

/// An RDMA READ or WRITE between registered ranges.
fn one_sided(state: &State, wr: &WorkRequest, opcode: Opcode) -> WcStatus {
    let len = u64::from(wr.len);
    let Some(remote) = state.mrs.get(&wr.rkey).filter(|m| covers(m, wr.remote_addr, len)) else {
        return WcStatus::REM_ACCESS_ERR;
    };
    let (src, dst) = match opcode {
        Opcode::RdmaWrite if remote.access.remote_write => (wr.local_addr, wr.remote_addr),
        Opcode::RdmaRead if remote.access.remote_read => (wr.remote_addr, wr.local_addr),
        _ => return WcStatus::REM_ACCESS_ERR,
    };
    // SAFETY: both ranges lie inside live registrations, whose `reg_mr` contract guarantees mapped
    // memory of this process; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, wr.len as usize) };
    WcStatus::SUCCESS
}

impl Verbs for RecordingVerbs {
    type Context = Handle;
    type Pd = Handle;
    type Mr = Handle;
    type Cq = Handle;
    type Qp = Handle;
    type Channel = FakeChannel;

    fn device_names(&self) -> Result<Vec<String>> {
        Ok(self.devices.iter().map(|d| d.name.clone()).collect())
    }

    fn open_device(&self, name: &str) -> Result<Handle> {
        let mut s = self.state.lock();
        s.calls.push(Call::OpenDevice(name.into()));
        injected(&mut s, "open_device")?;
        let idx = self
            .devices
            .iter()
            .position(|d| d.name == name)
            .ok_or_else(|| Error::not_available("rdma", format!("no RDMA device named {name:?}")))?;
        Ok(Handle(idx as u32))
    }

    fn query_device(&self, ctx: &Handle) -> Result<DeviceAttrs> {
        Ok(self.device(ctx.0)?.attrs)
    }

    fn query_port(&self, ctx: &Handle, port: u8) -> Result<PortAttrs> {
        if port != 1 {
            return Err(Error::transport("rdma", "ibv_query_port: Invalid argument"));
        }
        Ok(self.device(ctx.0)?.port)
    }

    fn query_gid(&self, ctx: &Handle, _port: u8, index: u32) -> Result<Gid> {
        Ok(self
            .device(ctx.0)?
            .gids
            .get(index as usize)
            .copied()
            .unwrap_or_default())
    }

    fn alloc_pd(&self, ctx: &Handle) -> Result<Handle> {
        let mut s = self.state.lock();
        s.calls.push(Call::AllocPd);
        injected(&mut s, "alloc_pd")?;
        s.next_id += 1;
        let id = s.next_id;
        s.device_of.insert(id, ctx.0);
        Ok(Handle(id))
    }

    unsafe fn reg_mr(&self, pd: &Handle, addr: u64, len: u64, access: Access) -> Result<(Handle, MrKeys)> {
        let mut s = self.state.lock();
        let device = self.pd_device(&s, pd)?;
        s.calls.push(Call::RegMr {
            device: self.devices[device as usize].name.clone(),
            addr,
            len,
        });
        injected(&mut s, "reg_mr")?;
        Ok(insert_mr(&mut s, device, FakeMr { addr, len, access }))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        pd: &Handle,
        offset: u64,
        len: u64,
        iova: u64,
        fd: i32,
        access: Access,
    ) -> Result<(Handle, MrKeys)> {
        let mut s = self.state.lock();
        if s.no_dmabuf {
            return Err(Error::not_available(
                "rdma",
                "libibverbs lacks ibv_reg_dmabuf_mr (needs rdma-core >= 34)",
            ));
        }
        let device = self.pd_device(&s, pd)?;
        s.calls.push(Call::RegDmabufMr {
            device: self.devices[device as usize].name.clone(),
            fd,
            offset,
            len,
            iova,
        });
        injected(&mut s, "reg_dmabuf_mr")?;
        // The fake's "device memory" is host memory addressed by `iova`, so work requests execute.
        Ok(insert_mr(
            &mut s,
            device,
            FakeMr {
                addr: iova,
                len,
                access,
            },
        ))
    }

    fn supports_dmabuf(&self) -> bool {
        !self.state.lock().no_dmabuf
    }

    fn dereg_mr(&self, mr: Handle) -> Result<()> {
        let mut s = self.state.lock();
        s.calls.push(Call::DeregMr { lkey: mr.0 });
        s.mrs
            .remove(&mr.0)
            .map(|_| ())
            .ok_or_else(|| Error::transport("rdma", "fake: dereg of an unknown MR"))
    }

    fn create_comp_channel(&self, _ctx: &Handle) -> Result<FakeChannel> {
        let mut s = self.state.lock();
        s.calls.push(Call::CreateCompChannel);
        injected(&mut s, "create_comp_channel")?;
        let (rx, tx) = std::os::unix::net::UnixStream::pair().map_err(|e| Error::io("fake: socketpair", e))?;
        rx.set_nonblocking(true)
            .map_err(|e| Error::io("fake: nonblocking", e))?;
        tx.set_nonblocking(true)
            .map_err(|e| Error::io("fake: nonblocking", e))?;
        Ok(FakeChannel { rx, tx })
    }

    fn channel_fd(&self, channel: &FakeChannel) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        channel.rx.as_raw_fd()
    }

    fn destroy_comp_channel(&self, _channel: FakeChannel) -> Result<()> {
        Ok(())
    }

    fn create_cq(&self, _ctx: &Handle, depth: u32, channel: Option<&FakeChannel>) -> Result<Handle> {
        let mut s = self.state.lock();
        s.calls.push(Call::CreateCq { depth });
        injected(&mut s, "create_cq")?;
        s.next_id += 1;
        let id = s.next_id;
        s.cqs.insert(id, VecDeque::new());
        if let Some(ch) = channel {
            let tx = ch.tx.try_clone().map_err(|e| Error::io("fake: dup", e))?;
            s.cq_channel.insert(id, tx);
        }
        Ok(Handle(id))
    }

    fn req_notify_cq(&self, cq: &Handle) -> Result<()> {
        let mut s = self.state.lock();
        if !s.cqs.contains_key(&cq.0) {
            return Err(Error::transport("rdma", "fake: req_notify_cq on an unknown CQ"));
        }
        if !s.cq_channel.contains_key(&cq.0) {
            return Err(Error::transport(
                "rdma",
                "fake: req_notify_cq on a CQ without a channel",
            ));
        }
        s.armed.insert(cq.0);
        Ok(())
    }

    fn take_cq_events(&self, channel: &FakeChannel) -> Result<u32> {
        let mut taken = 0u32;
        let mut buf = [0u8; 64];
        loop {
            match (&channel.rx).read(&mut buf) {
                Ok(0) => return Ok(taken),
                Ok(n) => taken += n as u32,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(taken),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("fake: reading the channel", e)),
            }
        }
    }

    fn create_qp(&self, pd: &Handle, cq: &Handle, caps: QpCaps) -> Result<(Handle, u32)> {
        let mut s = self.state.lock();
        injected(&mut s, "create_qp")?;
        let device = self.pd_device(&s, pd)?;
        s.next_id += 1;
        let qpn = s.next_id;
        s.device_of.insert(qpn, device);
        s.calls.push(Call::CreateQp { qpn, caps });
        s.qps.insert(
            qpn,
            FakeQp {
                cq: cq.0,
                depth: caps.max_send_wr,
                outstanding: 0,
                unsignalled: 0,
                machine: QpMachine::default(),
                fail_next: None,
                remote: None,
                recvs: VecDeque::new(),
                recv_depth: caps.max_recv_wr,
                held: VecDeque::new(),
                rnr_forever: false,
            },
        );
        Ok((Handle(qpn), qpn))
    }

    fn modify_qp(&self, qp: &Handle, transition: &QpTransition) -> Result<()> {
        let mut s = self.state.lock();
        s.calls.push(Call::ModifyQp {
            qpn: qp.0,
            transition: *transition,
        });
        injected(&mut s, "modify_qp")?;
        let q = s
            .qps
            .get_mut(&qp.0)
            .ok_or_else(|| Error::transport("rdma", "fake: unknown QP"))?;
        q.machine.apply(transition)?;
        match transition {
            QpTransition::ToReset => {
                // RESET discards every queued request without completions.
                q.outstanding = 0;
                q.unsignalled = 0;
                q.fail_next = None;
                q.remote = None;
                q.recvs.clear();
                q.held.clear();
            }
            QpTransition::ToRtr { dest_qpn, .. } => q.remote = Some(*dest_qpn),
            QpTransition::ToRts { rnr_retry, .. } => q.rnr_forever = *rnr_retry == 7,
            QpTransition::ToError => enter_error(&mut s, qp.0),
            _ => {}
        }
        Ok(())
    }

    fn post_send(&self, qp: &Handle, wrs: &[WorkRequest]) -> std::result::Result<(), PostError> {
        let mut s = self.state.lock();
        s.calls.push(Call::PostSend {
            qpn: qp.0,
            wrs: wrs.to_vec(),
        });
        if let Some(errno) = s.fail_posts.remove(&qp.0) {
            return Err(PostError { posted: 0, errno });
        }
        if !s.qps.contains_key(&qp.0) {
            return Err(PostError {
                posted: 0,
                errno: libc::EINVAL,
            });
        }
        for (i, wr) in wrs.iter().enumerate() {
            let q = s.qps.get_mut(&qp.0).expect("checked above");
            if !matches!(q.machine.state(), QpState::Rts | QpState::Error) {
                return Err(PostError {
                    posted: i,
                    errno: libc::EINVAL,
                });
            }
            if q.outstanding >= q.depth {
                return Err(PostError {
                    posted: i,
                    errno: libc::ENOMEM,
                });
            }
            q.outstanding += 1;
            let wait_behind = !q.held.is_empty() && q.machine.state() == QpState::Rts;
            if wait_behind || blocked(&s, qp.0, wr) {
                s.qps.get_mut(&qp.0).expect("checked above").held.push_back(*wr);
            } else {
                run(&mut s, qp.0, wr);
            }
        }
        Ok(())
    }

    fn post_recv(&self, qp: &Handle, rrs: &[RecvRequest]) -> std::result::Result<(), PostError> {
        let mut s = self.state.lock();
        s.calls.push(Call::PostRecv {
            qpn: qp.0,
            rrs: rrs.to_vec(),
        });
        let Some(q) = s.qps.get(&qp.0) else {
            return Err(PostError {
                posted: 0,
                errno: libc::EINVAL,
            });
        };
        let cq = q.cq;
        let sender = q.remote;
        for (i, rr) in rrs.iter().enumerate() {
            let q = s.qps.get_mut(&qp.0).expect("checked above");
            if q.machine.state() == QpState::Reset {
                return Err(PostError {
                    posted: i,
                    errno: libc::EINVAL,
                });
            }
            if q.recvs.len() >= q.recv_depth as usize {
                return Err(PostError {
                    posted: i,
                    errno: libc::ENOMEM,
                });
            }
            if q.machine.state() == QpState::Error {
                // Posted to a QP in ERROR: flushed at once.
                s.flushed += 1;
                let c = Completion {
                    wr_id: rr.wr_id,
                    status: WcStatus::WR_FLUSH_ERR,
                    qp_num: qp.0,
                    ..Completion::default()
                };
                push_cq(&mut s, cq, (c, 0));
            } else {
                q.recvs.push_back(*rr);
            }
        }
        // A sender retrying RNR finds the new receives.
        if let Some(sender) = sender {
            redrive(&mut s, sender);
        }
        Ok(())
    }

    fn poll_cq(&self, cq: &Handle, out: &mut [Completion]) -> Result<usize> {
        let mut s = self.state.lock();
        let mut n = 0;
        while n < out.len() {
            let Some((c, retire)) = s.cqs.get_mut(&cq.0).and_then(|q| q.pop_front()) else {
                break;
            };
            if let Some(q) = s.qps.get_mut(&c.qp_num) {
                q.outstanding = q.outstanding.saturating_sub(retire);
            }
            out[n] = c;
            n += 1;
        }
        Ok(n)
    }

    fn destroy_qp(&self, qp: Handle) -> Result<()> {
        let mut s = self.state.lock();
        s.calls.push(Call::DestroyQp { qpn: qp.0 });
        s.qps.remove(&qp.0);
        Ok(())
    }

    fn destroy_cq(&self, cq: Handle) -> Result<()> {
        let mut s = self.state.lock();
        s.cqs.remove(&cq.0);
        s.cq_channel.remove(&cq.0);
        s.armed.remove(&cq.0);
        Ok(())
    }

    fn dealloc_pd(&self, _pd: Handle) -> Result<()> {
        Ok(())
    }

    fn close_device(&self, _ctx: Handle) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fake's channel behaves as a device's: one event per arming, raised by the next
    /// completion only (those queued before arming raise none), none on an unarmed CQ.
    #[test]
    fn a_channel_fires_once_per_arming_on_the_next_completion() {
        let verbs = RecordingVerbs::new(vec![FakeDevice::roce("mlx5_0", [10, 0, 0, 1])]);
        let ctx = verbs.open_device("mlx5_0").unwrap();
        let ch = verbs.create_comp_channel(&ctx).unwrap();
        let cq = verbs.create_cq(&ctx, 16, Some(&ch)).unwrap();
        let plain = verbs.create_cq(&ctx, 16, None).unwrap();
        let push = |id: u32| push_cq(&mut verbs.state.lock(), id, (Completion::default(), 0));

        push(cq.0);
        assert_eq!(verbs.take_cq_events(&ch).unwrap(), 0, "unarmed: no event");
        verbs.req_notify_cq(&cq).unwrap();
        assert_eq!(
            verbs.take_cq_events(&ch).unwrap(),
            0,
            "arming with a completion queued raises none"
        );
        push(cq.0);
        push(cq.0);
        assert_eq!(verbs.take_cq_events(&ch).unwrap(), 1, "one event per arming");
        assert_eq!(verbs.take_cq_events(&ch).unwrap(), 0, "taken events are gone");
        assert_eq!(verbs.events_raised(), 1);
        let mut out = [Completion::default(); 8];
        assert_eq!(
            verbs.poll_cq(&cq, &mut out).unwrap(),
            3,
            "events do not consume completions"
        );

        assert!(
            verbs.req_notify_cq(&plain).is_err(),
            "a CQ without a channel cannot be armed"
        );
        verbs.destroy_cq(cq).unwrap();
        verbs.destroy_cq(plain).unwrap();
        verbs.destroy_comp_channel(ch).unwrap();
    }
}
