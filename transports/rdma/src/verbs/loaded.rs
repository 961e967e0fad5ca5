//! [`Verbs`] on libibverbs opened at run time with `dlopen("libibverbs.so.1")`.
//!
//! Why not the `ibverbs` crate: it needs rdma-core headers, cmake, libclang and libnl at build time
//! and links libibverbs, so a binary built with it does not start on a host without rdma-core. The
//! design wants one binary for every host, with "no RDMA here" reported at run time. Loading at run
//! time gives exactly that: no library means `Error::NotAvailable("libibverbs not found")`, and a
//! library without devices means "no RDMA device".
//!
//! `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` are `static inline` in verbs.h (no exported
//! symbol): they call the provider through `qp->context->ops.post_send`, `ops.post_recv` and
//! `cq->context->ops.poll_cq`. We make the
//! same call through the `#[repr(C)]` mirrors in [`super::ffi`], whose layout a test checks against
//! the system header. The alternative, a C shim compiled with `cc` against verbs.h, would add a
//! C toolchain and libibverbs-dev to every build for two one-line functions.
//!
//! Everything else used here is an exported, versioned symbol (`IBVERBS_1.1`) present in every
//! rdma-core release.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::NonNull;

use te_base::{Error, Result};

use super::ffi;
use super::{
    conv, Access, Completion, DeviceAttrs, Gid, LinkLayer, MrKeys, Mtu, PortAttrs, PostError, QpCaps, RecvRequest,
    Verbs, WorkRequest,
};
use crate::protocol::qp_state::QpTransition;

/// The library's file name (the SONAME every distribution ships).
pub const LIBIBVERBS: &str = "libibverbs.so.1";

/// Work requests converted per `post_send` / `post_recv` call into a stack array (no allocation
/// per call).
const POST_CHUNK: usize = 32;

/// Converts `items` with `fill` into linked chains of at most [`POST_CHUNK`] requests on this
/// stack frame and hands each chain to `post` (the provider's `post_send` or `post_recv`, given
/// the chain's head and where to report the first rejected request). On failure `posted` counts
/// the requests accepted before the rejected one.
fn post_chain<T, W: ffi::Linked>(
    items: &[T],
    fill: impl Fn(&T, &mut ffi::ibv_sge, &mut W),
    mut post: impl FnMut(*mut W, *mut *mut W) -> c_int,
) -> std::result::Result<(), PostError> {
    let mut sges = [ffi::ibv_sge::default(); POST_CHUNK];
    let mut chain = [W::default(); POST_CHUNK];
    for (chunk_index, chunk) in items.chunks(POST_CHUNK).enumerate() {
        let n = chunk.len();
        for (i, item) in chunk.iter().enumerate() {
            fill(item, &mut sges[i], &mut chain[i]);
        }
        // Link through raw pointers taken after the last write by index, so every pointer the
        // provider follows stays valid.
        let sge_base = sges.as_mut_ptr();
        let base = chain.as_mut_ptr();
        for i in 0..n {
            // SAFETY: `i < n <= POST_CHUNK`, so `base.add(i)`, `base.add(i + 1)` (used only when
            // `i + 1 < n`) and `sge_base.add(i)` are inside their arrays.
            unsafe {
                let next = if i + 1 < n {
                    base.add(i + 1)
                } else {
                    std::ptr::null_mut()
                };
                (*base.add(i)).link(sge_base.add(i), next);
            }
        }
        let mut bad: *mut W = std::ptr::null_mut();
        let rc = post(base, &mut bad);
        if rc != 0 {
            let failed_at = if bad.is_null() {
                0
            } else {
                // SAFETY: `bad` points into `chain` (the provider reports the first rejected one).
                usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
            };
            return Err(PostError {
                posted: chunk_index * POST_CHUNK + failed_at,
                errno: if rc < 0 { last_errno() } else { rc },
            });
        }
    }
    Ok(())
}
/// Completions taken per `poll_cq` call into a stack array.
const POLL_CHUNK: usize = 32;

struct Functions {
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void,
    free_device_list: unsafe extern "C" fn(*mut *mut c_void),
    get_device_name: unsafe extern "C" fn(*mut c_void) -> *const c_char,
    open_device: unsafe extern "C" fn(*mut c_void) -> *mut ffi::ibv_context,
    close_device: unsafe extern "C" fn(*mut ffi::ibv_context) -> c_int,
    query_device: unsafe extern "C" fn(*mut ffi::ibv_context, *mut ffi::ibv_device_attr) -> c_int,
    query_port: unsafe extern "C" fn(*mut ffi::ibv_context, u8, *mut ffi::ibv_port_attr) -> c_int,
    query_gid: unsafe extern "C" fn(*mut ffi::ibv_context, u8, c_int, *mut ffi::ibv_gid) -> c_int,
    alloc_pd: unsafe extern "C" fn(*mut ffi::ibv_context) -> *mut c_void,
    dealloc_pd: unsafe extern "C" fn(*mut c_void) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut ffi::ibv_mr,
    dereg_mr: unsafe extern "C" fn(*mut ffi::ibv_mr) -> c_int,
    /// `ibv_reg_dmabuf_mr`: absent before rdma-core 34, so optional.
    reg_dmabuf_mr: Option<unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut ffi::ibv_mr>,
    create_cq: unsafe extern "C" fn(
        *mut ffi::ibv_context,
        c_int,
        *mut c_void,
        *mut ffi::ibv_comp_channel,
        c_int,
    ) -> *mut ffi::ibv_cq,
    create_comp_channel: unsafe extern "C" fn(*mut ffi::ibv_context) -> *mut ffi::ibv_comp_channel,
    destroy_comp_channel: unsafe extern "C" fn(*mut ffi::ibv_comp_channel) -> c_int,
    get_cq_event: unsafe extern "C" fn(*mut ffi::ibv_comp_channel, *mut *mut ffi::ibv_cq, *mut *mut c_void) -> c_int,
    ack_cq_events: unsafe extern "C" fn(*mut ffi::ibv_cq, std::ffi::c_uint),
    destroy_cq: unsafe extern "C" fn(*mut ffi::ibv_cq) -> c_int,
    create_qp: unsafe extern "C" fn(*mut c_void, *mut ffi::ibv_qp_init_attr) -> *mut ffi::ibv_qp,
    modify_qp: unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_qp_attr, c_int) -> c_int,
    destroy_qp: unsafe extern "C" fn(*mut ffi::ibv_qp) -> c_int,
}

/// libibverbs, opened at run time.
pub struct LoadedVerbs {
    f: Functions,
    // Keeps the symbols above valid; dropped last.
    _lib: libloading::Library,
}

impl std::fmt::Debug for LoadedVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoadedVerbs")
    }
}

/// An opened device.
#[derive(Debug)]
pub struct Context(NonNull<ffi::ibv_context>);
/// A protection domain.
#[derive(Debug)]
pub struct Pd(NonNull<c_void>);
/// A memory region.
#[derive(Debug)]
pub struct Mr(NonNull<ffi::ibv_mr>);
/// A completion queue.
#[derive(Debug)]
pub struct Cq(NonNull<ffi::ibv_cq>);
/// A queue pair.
#[derive(Debug)]
pub struct Qp(NonNull<ffi::ibv_qp>);
/// A completion channel.
#[derive(Debug)]
pub struct Channel(NonNull<ffi::ibv_comp_channel>);

// SAFETY: libibverbs objects may be used from any thread; rdma-core documents every verb as
// thread-safe (providers lock internally), and these handles are only raw pointers to them.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}
// SAFETY: as above.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}
// SAFETY: as above.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}
// SAFETY: as above.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}
// SAFETY: as above.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}
// SAFETY: as above.
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

fn verbs_error(call: &str, errno: i32) -> Error {
    Error::transport_caused("rdma", call, std::io::Error::from_raw_os_error(errno))
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Return convention of the verbs that answer 0 or an errno (some providers return -1 and set
/// errno instead).
fn check(call: &str, rc: c_int) -> Result<()> {
    match rc {
        0 => Ok(()),
        rc if rc < 0 => Err(verbs_error(call, last_errno())),
        rc => Err(verbs_error(call, rc)),
    }
}

fn non_null<T>(call: &str, p: *mut T) -> Result<NonNull<T>> {
    NonNull::new(p).ok_or_else(|| verbs_error(call, last_errno()))
}

impl LoadedVerbs {
    /// Opens libibverbs. `Error::NotAvailable` ("libibverbs not found: ...") when the library or
    /// one of its symbols is missing.
    pub fn load() -> Result<Self> {
        // SAFETY: loading libibverbs runs its ELF constructors, which only initialize the library's
        // own state (no interaction with ours).
        let lib = unsafe { libloading::Library::new(LIBIBVERBS) }
            .map_err(|e| Error::not_available("rdma", format!("libibverbs not found: {e}")))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is declared with its C prototype from verbs.h (IBVERBS_1.1 ABI)
                // and the library stays loaded in `_lib` for as long as the pointer is used.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| Error::not_available("rdma", format!("libibverbs lacks {}: {e}", $name)))?
            };
        }
        let f = Functions {
            get_device_list: sym!("ibv_get_device_list"),
            free_device_list: sym!("ibv_free_device_list"),
            get_device_name: sym!("ibv_get_device_name"),
            open_device: sym!("ibv_open_device"),
            close_device: sym!("ibv_close_device"),
            query_device: sym!("ibv_query_device"),
            query_port: sym!("ibv_query_port"),
            query_gid: sym!("ibv_query_gid"),
            alloc_pd: sym!("ibv_alloc_pd"),
            dealloc_pd: sym!("ibv_dealloc_pd"),
            reg_mr: sym!("ibv_reg_mr"),
            dereg_mr: sym!("ibv_dereg_mr"),
            // SAFETY: declared with its C prototype from verbs.h (rdma-core >= 34); the library
            // stays loaded in `_lib` for as long as the pointer is used.
            reg_dmabuf_mr: unsafe { lib.get(b"ibv_reg_dmabuf_mr\0") }.ok().map(|s| *s),
            create_cq: sym!("ibv_create_cq"),
            create_comp_channel: sym!("ibv_create_comp_channel"),
            destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
            get_cq_event: sym!("ibv_get_cq_event"),
            ack_cq_events: sym!("ibv_ack_cq_events"),
            destroy_cq: sym!("ibv_destroy_cq"),
            create_qp: sym!("ibv_create_qp"),
            modify_qp: sym!("ibv_modify_qp"),
            destroy_qp: sym!("ibv_destroy_qp"),
        };
        Ok(LoadedVerbs { f, _lib: lib })
    }

    /// Runs `body` on the device list, freeing it afterwards. An absent list with ENOSYS (no
    /// kernel RDMA support), ENODEV or ENOENT is an empty list.
    fn with_device_list<T>(&self, body: impl FnOnce(&[*mut c_void]) -> Result<T>) -> Result<T> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below and not used afterwards.
        let list = unsafe { (self.f.get_device_list)(&mut n) };
        if list.is_null() {
            let errno = last_errno();
            return match errno {
                libc::ENOSYS | libc::ENODEV | libc::ENOENT => body(&[]),
                _ => Err(verbs_error("ibv_get_device_list", errno)),
            };
        }
        let len = usize::try_from(n).unwrap_or(0);
        // SAFETY: libibverbs returned an array of `n` device pointers (NULL-terminated beyond).
        let devices = unsafe { std::slice::from_raw_parts(list, len) };
        let out = body(devices);
        // SAFETY: `list` came from ibv_get_device_list and is freed once; opened contexts stay
        // valid after the list is freed (documented by rdma-core).
        unsafe { (self.f.free_device_list)(list) };
        out
    }

    fn device_name(&self, dev: *mut c_void) -> String {
        // SAFETY: `dev` is an entry of a live device list; the name is a NUL-terminated string
        // owned by the device.
        let name = unsafe { (self.f.get_device_name)(dev) };
        if name.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated, valid while the list lives.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    }
}

impl Verbs for LoadedVerbs {
    type Context = Context;
    type Pd = Pd;
    type Mr = Mr;
    type Cq = Cq;
    type Qp = Qp;
    type Channel = Channel;

    fn device_names(&self) -> Result<Vec<String>> {
        self.with_device_list(|devs| Ok(devs.iter().map(|&d| self.device_name(d)).collect()))
    }

    fn open_device(&self, name: &str) -> Result<Context> {
        let wanted = CString::new(name).map_err(|_| Error::config("TE_RDMA_DEVICES", name, "contains NUL"))?;
        self.with_device_list(|devs| {
            let dev = devs
                .iter()
                .copied()
                .find(|&d| self.device_name(d).as_bytes() == wanted.as_bytes())
                .ok_or_else(|| Error::not_available("rdma", format!("no RDMA device named {name:?}")))?;
            // SAFETY: `dev` is an entry of the live device list.
            let ctx = unsafe { (self.f.open_device)(dev) };
            Ok(Context(non_null("ibv_open_device", ctx)?))
        })
    }

    fn query_device(&self, ctx: &Context) -> Result<DeviceAttrs> {
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is an open context; `attr` is a full `ibv_device_attr`.
        check("ibv_query_device", unsafe {
            (self.f.query_device)(ctx.0.as_ptr(), &mut attr)
        })?;
        Ok(DeviceAttrs {
            max_mr_size: attr.max_mr_size,
            max_qp_wr: u32::try_from(attr.max_qp_wr).unwrap_or(0),
            max_cqe: u32::try_from(attr.max_cqe).unwrap_or(0),
            max_qp_rd_atom: u8::try_from(attr.max_qp_rd_atom).unwrap_or(u8::MAX),
            phys_port_cnt: attr.phys_port_cnt,
        })
    }

    fn query_port(&self, ctx: &Context, port: u8) -> Result<PortAttrs> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: `ctx` is open; the exported symbol writes at most the compat prefix of `attr`,
        // which is zeroed, exactly as verbs.h's inline wrapper does.
        check("ibv_query_port", unsafe {
            (self.f.query_port)(ctx.0.as_ptr(), port, &mut attr)
        })?;
        let link_layer = match attr.link_layer {
            ffi::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
            // UNSPECIFIED is reported by old InfiniBand drivers.
            _ => LinkLayer::Infiniband,
        };
        Ok(PortAttrs {
            active: attr.state == ffi::IBV_PORT_ACTIVE,
            active_mtu: Mtu::from_ibv(attr.active_mtu).unwrap_or(Mtu::M1024),
            lid: attr.lid,
            link_layer,
            gid_table_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
            max_msg_size: attr.max_msg_sz,
        })
    }

    fn query_gid(&self, ctx: &Context, port: u8, index: u32) -> Result<Gid> {
        let mut gid = ffi::ibv_gid::default();
        let index = c_int::try_from(index).map_err(|_| verbs_error("ibv_query_gid", libc::EINVAL))?;
        // SAFETY: `ctx` is open; `gid` is a valid 16-byte out-parameter.
        check("ibv_query_gid", unsafe {
            (self.f.query_gid)(ctx.0.as_ptr(), port, index, &mut gid)
        })?;
        Ok(Gid(gid.raw))
    }

    fn alloc_pd(&self, ctx: &Context) -> Result<Pd> {
        // SAFETY: `ctx` is open.
        let pd = unsafe { (self.f.alloc_pd)(ctx.0.as_ptr()) };
        Ok(Pd(non_null("ibv_alloc_pd", pd)?))
    }

    unsafe fn reg_mr(&self, pd: &Pd, addr: u64, len: u64, access: Access) -> Result<(Mr, MrKeys)> {
        let len = usize::try_from(len).map_err(|_| Error::LengthOverflow { addr, len })?;
        // SAFETY: `pd` is live; the caller guarantees the range is mapped memory of this process
        // that outlives the registration.
        let mr = unsafe { (self.f.reg_mr)(pd.0.as_ptr(), addr as *mut c_void, len, conv::access_flags(access)) };
        let mr = non_null("ibv_reg_mr", mr)?;
        // SAFETY: a successful ibv_reg_mr returns a valid `ibv_mr` that lives until ibv_dereg_mr.
        let keys = unsafe {
            MrKeys {
                lkey: (*mr.as_ptr()).lkey,
                rkey: (*mr.as_ptr()).rkey,
            }
        };
        Ok((Mr(mr), keys))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        pd: &Pd,
        offset: u64,
        len: u64,
        iova: u64,
        fd: i32,
        access: Access,
    ) -> Result<(Mr, MrKeys)> {
        let reg = self.f.reg_dmabuf_mr.ok_or_else(|| {
            Error::not_available("rdma", "libibverbs lacks ibv_reg_dmabuf_mr (needs rdma-core >= 34)")
        })?;
        let len = usize::try_from(len).map_err(|_| Error::LengthOverflow { addr: iova, len })?;
        // SAFETY: `pd` is live; the caller guarantees `fd` is a dma-buf covering the range for as
        // long as the registration lives.
        let mr = unsafe { reg(pd.0.as_ptr(), offset, len, iova, fd, conv::access_flags(access)) };
        let mr = non_null("ibv_reg_dmabuf_mr", mr)?;
        // SAFETY: a successful ibv_reg_dmabuf_mr returns a valid `ibv_mr` that lives until
        // ibv_dereg_mr.
        let keys = unsafe {
            MrKeys {
                lkey: (*mr.as_ptr()).lkey,
                rkey: (*mr.as_ptr()).rkey,
            }
        };
        Ok((Mr(mr), keys))
    }

    fn supports_dmabuf(&self) -> bool {
        self.f.reg_dmabuf_mr.is_some()
    }

    fn dereg_mr(&self, mr: Mr) -> Result<()> {
        // SAFETY: `mr` is owned, so this is its only deregistration.
        check("ibv_dereg_mr", unsafe { (self.f.dereg_mr)(mr.0.as_ptr()) })
    }

    fn create_comp_channel(&self, ctx: &Context) -> Result<Channel> {
        // SAFETY: `ctx` is open.
        let ch = non_null("ibv_create_comp_channel", unsafe {
            (self.f.create_comp_channel)(ctx.0.as_ptr())
        })?;
        // SAFETY: a created channel is valid until destroyed; `fd` is its descriptor, which we
        // only switch to non-blocking (ibv_get_cq_event then answers EAGAIN instead of waiting).
        let rc = unsafe {
            let fd = (*ch.as_ptr()).fd;
            libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK)
        };
        if rc < 0 {
            let errno = last_errno();
            // SAFETY: no CQ uses the channel yet.
            unsafe { (self.f.destroy_comp_channel)(ch.as_ptr()) };
            return Err(verbs_error("fcntl(O_NONBLOCK) on the completion channel", errno));
        }
        Ok(Channel(ch))
    }

    fn channel_fd(&self, channel: &Channel) -> std::os::fd::RawFd {
        // SAFETY: the channel is live while borrowed.
        unsafe { (*channel.0.as_ptr()).fd }
    }

    fn destroy_comp_channel(&self, channel: Channel) -> Result<()> {
        // SAFETY: `channel` is owned, and the CQs using it were destroyed first by their owner.
        check("ibv_destroy_comp_channel", unsafe {
            (self.f.destroy_comp_channel)(channel.0.as_ptr())
        })
    }

    fn create_cq(&self, ctx: &Context, depth: u32, channel: Option<&Channel>) -> Result<Cq> {
        let depth = c_int::try_from(depth).map_err(|_| verbs_error("ibv_create_cq", libc::EINVAL))?;
        let channel = channel.map_or(std::ptr::null_mut(), |c| c.0.as_ptr());
        // SAFETY: `ctx` is open and `channel` (if any) belongs to it and outlives the CQ; no user
        // context, vector 0.
        let cq = unsafe { (self.f.create_cq)(ctx.0.as_ptr(), depth, std::ptr::null_mut(), channel, 0) };
        Ok(Cq(non_null("ibv_create_cq", cq)?))
    }

    fn req_notify_cq(&self, cq: &Cq) -> Result<()> {
        let cq_ptr = cq.0.as_ptr();
        // SAFETY: `cq` is live, so its context and the provider's ops table are too.
        let Some(arm) = (unsafe { (*(*cq_ptr).context).ops.req_notify_cq }) else {
            return Err(verbs_error("ibv_req_notify_cq", libc::ENOSYS));
        };
        // SAFETY: `cq` is live; 0 = every completion, not only solicited ones.
        check("ibv_req_notify_cq", unsafe { arm(cq_ptr, 0) })
    }

    fn take_cq_events(&self, channel: &Channel) -> Result<u32> {
        let mut taken = 0;
        loop {
            let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
            let mut cq_context: *mut c_void = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; both out-pointers are valid.
            let rc = unsafe { (self.f.get_cq_event)(channel.0.as_ptr(), &mut cq, &mut cq_context) };
            if rc != 0 {
                let errno = last_errno();
                return match errno {
                    libc::EAGAIN | libc::EINTR => Ok(taken),
                    _ => Err(verbs_error("ibv_get_cq_event", errno)),
                };
            }
            // SAFETY: `cq` is the live CQ the event names; acknowledging at once keeps
            // `ibv_destroy_cq`, which waits for every event to be acknowledged, from blocking.
            unsafe { (self.f.ack_cq_events)(cq, 1) };
            taken += 1;
        }
    }

    fn create_qp(&self, pd: &Pd, cq: &Cq, caps: QpCaps) -> Result<(Qp, u32)> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.0.as_ptr(),
            recv_cq: cq.0.as_ptr(),
            srq: std::ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                // RDMA READ/WRITE consume no receive entries, but some providers refuse zero.
                max_recv_wr: caps.max_recv_wr.max(1),
                max_send_sge: caps.max_send_sge,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: `pd` and `cq` are live; `init` is a complete `ibv_qp_init_attr`.
        let qp = non_null("ibv_create_qp", unsafe { (self.f.create_qp)(pd.0.as_ptr(), &mut init) })?;
        // SAFETY: a created QP is valid until destroyed; `qp_num` is set by creation.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        Ok((Qp(qp), qpn))
    }

    fn modify_qp(&self, qp: &Qp, transition: &QpTransition) -> Result<()> {
        let (mut attr, mask) = conv::qp_attr(transition);
        // SAFETY: `qp` is live; `attr` is a complete `ibv_qp_attr` with the fields `mask` names.
        check("ibv_modify_qp", unsafe {
            (self.f.modify_qp)(qp.0.as_ptr(), &mut attr, mask)
        })
    }

    fn post_send(&self, qp: &Qp, wrs: &[WorkRequest]) -> std::result::Result<(), PostError> {
        let qp_ptr = qp.0.as_ptr();
        // SAFETY: `qp` is live, so its context and the provider's ops table are too.
        let Some(post) = (unsafe { (*(*qp_ptr).context).ops.post_send }) else {
            return Err(PostError {
                posted: 0,
                errno: libc::ENOSYS,
            });
        };
        post_chain(wrs, conv::send_wr, |chain, bad| {
            // SAFETY: `qp` is live and `chain` is a valid linked chain (see `post_chain`); the
            // provider copies it into the send queue before returning.
            unsafe { post(qp_ptr, chain, bad) }
        })
    }

    fn post_recv(&self, qp: &Qp, rrs: &[RecvRequest]) -> std::result::Result<(), PostError> {
        let qp_ptr = qp.0.as_ptr();
        // SAFETY: `qp` is live, so its context and the provider's ops table are too.
        let Some(post) = (unsafe { (*(*qp_ptr).context).ops.post_recv }) else {
            return Err(PostError {
                posted: 0,
                errno: libc::ENOSYS,
            });
        };
        post_chain(rrs, conv::recv_wr, |chain, bad| {
            // SAFETY: `qp` is live and `chain` is a valid linked chain (see `post_chain`); the
            // provider copies it into the receive queue before returning. The buffers it names
            // are registered and outlive the QP (the caller destroys the QP before
            // deregistering them).
            unsafe { post(qp_ptr, chain, bad) }
        })
    }

    fn poll_cq(&self, cq: &Cq, out: &mut [Completion]) -> Result<usize> {
        let cq_ptr = cq.0.as_ptr();
        // SAFETY: `cq` is live, so its context and the provider's ops table are too.
        let Some(poll) = (unsafe { (*(*cq_ptr).context).ops.poll_cq }) else {
            return Err(verbs_error("ibv_poll_cq", libc::ENOSYS));
        };
        let mut wcs = [ffi::ibv_wc::default(); POLL_CHUNK];
        let mut taken = 0;
        while taken < out.len() {
            let want = (out.len() - taken).min(POLL_CHUNK);
            // SAFETY: `wcs` holds `POLL_CHUNK >= want` entries.
            let n = unsafe { poll(cq_ptr, want as c_int, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(verbs_error("ibv_poll_cq", libc::EIO));
            }
            let n = n as usize;
            for (dst, wc) in out[taken..taken + n].iter_mut().zip(&wcs[..n]) {
                *dst = conv::completion(wc);
            }
            taken += n;
            if n < want {
                break;
            }
        }
        Ok(taken)
    }

    fn destroy_qp(&self, qp: Qp) -> Result<()> {
        // SAFETY: `qp` is owned, so this is its only destruction.
        check("ibv_destroy_qp", unsafe { (self.f.destroy_qp)(qp.0.as_ptr()) })
    }

    fn destroy_cq(&self, cq: Cq) -> Result<()> {
        // SAFETY: `cq` is owned; the QPs using it were destroyed first by their owner.
        check("ibv_destroy_cq", unsafe { (self.f.destroy_cq)(cq.0.as_ptr()) })
    }

    fn dealloc_pd(&self, pd: Pd) -> Result<()> {
        // SAFETY: `pd` is owned; its MRs and QPs were released first by their owner.
        check("ibv_dealloc_pd", unsafe { (self.f.dealloc_pd)(pd.0.as_ptr()) })
    }

    fn close_device(&self, ctx: Context) -> Result<()> {
        // SAFETY: `ctx` is owned; every object created from it was released first by its owner.
        check("ibv_close_device", unsafe { (self.f.close_device)(ctx.0.as_ptr()) })
    }
}
