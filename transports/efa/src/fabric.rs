//! Safe wrappers over the shim: provider discovery (`fi_getinfo`), one rail's libfabric objects,
//! memory regions and the raw data-path calls the owner thread makes.

use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;

use parking_lot::Mutex;
use te_base::{Error, Result};

use crate::address_table::AddressTable;
use crate::ffi::{self, mr, FiInfo, FidMr, RawRail};
use crate::mr_keys::KeySequence;

/// Name used in errors.
pub(crate) const TRANSPORT: &str = "efa";

/// Every mr_mode bit we know how to follow; the provider keeps the ones it needs.
const MR_MODES_WE_FOLLOW: u32 = mr::LOCAL | mr::VIRT_ADDR | mr::PROV_KEY | mr::ENDPOINT | mr::ALLOCATED;

fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric strings in fi_info are NUL-terminated and live as long as the info list,
    // which outlives this call; we copy at once.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The list `fi_getinfo` returned; freed on drop.
pub(crate) struct InfoList {
    head: *mut FiInfo,
}

// SAFETY: the list is immutable after fi_getinfo and only read (or handed to fi_fabric/fi_domain,
// which copy what they need); nothing in it is tied to a thread.
unsafe impl Send for InfoList {}
// SAFETY: as above, shared access only reads.
unsafe impl Sync for InfoList {}

impl InfoList {
    /// RDM + RMA providers matching `provider` (any provider when `None`). `Ok(None)` when nothing
    /// matches.
    pub(crate) fn query(provider: Option<&str>) -> Result<Option<InfoList>> {
        // Every libfabric call that initialises the library comes after a query: the cache
        // settings must be in the environment before libfabric reads its parameters.
        crate::mr_cache::settings();
        // Opens libfabric on the first call; NotAvailable ("libfabric.so.1 not found") without it.
        crate::library::libfabric()?;
        let prov = provider
            .map(CString::new)
            .transpose()
            .map_err(|_| Error::config("TE_FABRIC_PROVIDER", provider.unwrap_or(""), "contains a NUL byte"))?;
        let mut head = std::ptr::null_mut();
        // SAFETY: prov is a valid C string or null; head receives a list we own and free in Drop.
        let rc = unsafe {
            ffi::te_fi_getinfo(
                prov.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                MR_MODES_WE_FOLLOW,
                1,
                0,
                &mut head,
            )
        };
        if rc == -ffi::FI_ENODATA || (rc == 0 && head.is_null()) {
            return Ok(None);
        }
        if rc != 0 {
            return Err(Error::transport_caused(
                TRANSPORT,
                "fi_getinfo",
                ffi::native_error(rc as i64),
            ));
        }
        Ok(Some(InfoList { head }))
    }

    /// The entries in provider order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = Info<'_>> {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur.is_null() {
                return None;
            }
            let info = Info { ptr: cur, _list: self };
            // SAFETY: cur is a live node of our list.
            cur = unsafe { ffi::te_fi_info_next(cur) };
            Some(info)
        })
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        // SAFETY: head came from fi_getinfo and is freed exactly once.
        unsafe { ffi::te_fi_freeinfo(self.head) };
    }
}

/// The names of every provider offering RDM endpoints with RMA here, for error messages.
pub(crate) fn providers_found() -> Vec<String> {
    let Ok(Some(list)) = InfoList::query(None) else {
        return vec![];
    };
    let set: BTreeSet<String> = list.iter().map(|i| i.provider()).collect();
    set.into_iter().collect()
}

/// The distinct domain names of `provider` (first provider fi_getinfo returns for that name).
pub(crate) fn domains_of(provider: &str) -> Vec<String> {
    let Ok(Some(list)) = InfoList::query(Some(provider)) else {
        return vec![];
    };
    let first = list.iter().next().map(|i| i.provider()).unwrap_or_default();
    let mut out: Vec<String> = Vec::new();
    for d in list.iter().filter(|i| i.provider() == first).map(|i| i.domain()) {
        if !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// One entry of an [`InfoList`].
#[derive(Clone, Copy)]
pub(crate) struct Info<'a> {
    ptr: *mut FiInfo,
    _list: &'a InfoList,
}

impl Info<'_> {
    pub(crate) fn provider(&self) -> String {
        // SAFETY: ptr is a live node of the borrowed list.
        cstr(unsafe { ffi::te_fi_info_provider(self.ptr) })
    }
    pub(crate) fn fabric(&self) -> String {
        // SAFETY: as above.
        cstr(unsafe { ffi::te_fi_info_fabric(self.ptr) })
    }
    pub(crate) fn domain(&self) -> String {
        // SAFETY: as above.
        cstr(unsafe { ffi::te_fi_info_domain(self.ptr) })
    }
    pub(crate) fn is_ipv4(&self) -> bool {
        // SAFETY: as above.
        unsafe { ffi::te_fi_info_is_ipv4(self.ptr) != 0 }
    }
}

/// What the provider granted for one rail.
#[derive(Debug, Clone)]
pub(crate) struct RailAttrs {
    pub provider: String,
    pub fabric: String,
    pub domain: String,
    /// Granted mr_mode bits ([`mr`] encoding).
    pub mr_mode: u32,
    pub mr_key_size: usize,
    pub max_msg_size: u64,
    pub tx_size: usize,
}

impl RailAttrs {
    pub(crate) fn virt_addr(&self) -> bool {
        self.mr_mode & mr::VIRT_ADDR != 0
    }
    pub(crate) fn local_desc(&self) -> bool {
        self.mr_mode & mr::LOCAL != 0
    }
    pub(crate) fn prov_key(&self) -> bool {
        self.mr_mode & mr::PROV_KEY != 0
    }
    pub(crate) fn bind_ep(&self) -> bool {
        self.mr_mode & mr::ENDPOINT != 0
    }
    /// Registrations on this rail ask the provider not to cache them (see [`crate::mr_cache`]).
    pub(crate) fn mr_cache_bypass(&self) -> bool {
        crate::mr_cache::bypass_per_registration(&self.provider)
    }
}

/// One NIC: fabric, domain, endpoint, address vector and completion queue.
pub(crate) struct Rail {
    raw: Box<RawRail>,
    pub attrs: RailAttrs,
    /// This endpoint's address (fi_getname), what peers insert into their AV.
    pub address: Vec<u8>,
    /// The CQ has a wait object (blocking reads and fi_cq_signal work).
    pub cq_can_wait: bool,
    /// Peer addresses in the AV, each inserted once (see [`AddressTable`]).
    addresses: Mutex<AddressTable>,
    /// Keys for registrations when the application chooses them (see [`KeySequence`]).
    keys: Mutex<KeySequence>,
    /// Memory the provider may write until the endpoint closes (posted receive buffers and their
    /// contexts): freed only after the endpoint, in [`Rail::drop`].
    retained: Mutex<Vec<Box<[Block]>>>,
    /// Held (shared) by threads signalling the CQ, and (exclusive) while the owner replaces it.
    cq_swap: parking_lot::RwLock<()>,
}

/// A 64-byte, 64-aligned unit of [`Rail::retained_area`]: big enough for a libfabric context.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Block(pub [u8; 64]);

// SAFETY: the domain is opened FI_THREAD_SAFE, so libfabric serialises concurrent calls on these
// objects; the raw pointers are only handed to libfabric.
unsafe impl Send for Rail {}
// SAFETY: as above.
unsafe impl Sync for Rail {}

impl Rail {
    /// Opens the objects of one rail from a getinfo entry. Without `shm_permitted` the endpoint
    /// is told not to use shared memory for intra-node peers (see [`crate::config::VAR_SHM`]).
    pub(crate) fn open(info: Info<'_>, shm_permitted: bool) -> Result<Rail> {
        // SAFETY: info.ptr is a live node of the borrowed list; these accessors only read it.
        let (mr_mode, mr_key_size, max_msg_size, tx_size) = unsafe {
            (
                ffi::te_fi_info_mr_mode(info.ptr),
                ffi::te_fi_info_mr_key_size(info.ptr),
                ffi::te_fi_info_max_msg_size(info.ptr) as u64,
                ffi::te_fi_info_tx_size(info.ptr),
            )
        };
        let attrs = RailAttrs {
            provider: info.provider(),
            fabric: info.fabric(),
            domain: info.domain(),
            mr_mode,
            mr_key_size,
            max_msg_size,
            tx_size,
        };
        let cq_size = attrs.tx_size.clamp(64, 1 << 16) * 2;
        let mut raw = Box::new(RawRail::empty());
        let mut step: c_int = 0;
        let mut shm_opt: c_int = 0;
        // SAFETY: info.ptr is live; raw is a valid out-struct that stays at a fixed address (boxed).
        let rc = unsafe {
            ffi::te_fi_rail_open(
                info.ptr,
                cq_size,
                c_int::from(!shm_permitted),
                &mut *raw,
                &mut step,
                &mut shm_opt,
            )
        };
        if rc != 0 {
            return Err(Error::transport_caused(
                TRANSPORT,
                format!(
                    "opening rail on {} domain '{}': {} failed",
                    attrs.provider,
                    attrs.domain,
                    ffi::rail_step_name(step)
                ),
                ffi::native_error(rc as i64),
            ));
        }
        let cq_can_wait = raw.cq_can_wait != 0;
        let mut rail = Rail {
            raw,
            attrs,
            address: Vec::new(),
            cq_can_wait,
            addresses: Mutex::new(AddressTable::default()),
            keys: Mutex::new(KeySequence::new(mr_key_size)),
            retained: Mutex::new(Vec::new()),
            cq_swap: parking_lot::RwLock::new(()),
        };
        rail.address = rail.getname()?;
        rail.check_shm_denied(shm_permitted, shm_opt)?;
        Ok(rail)
    }

    /// With shared memory denied: the efa provider must have accepted the option (it is the one
    /// that hands intra-node peers to shm); providers without the option have no shm path to close.
    fn check_shm_denied(&self, shm_permitted: bool, shm_opt: c_int) -> Result<()> {
        if shm_permitted || shm_opt == 0 {
            return Ok(());
        }
        let core = core_provider(&self.attrs.provider);
        if core == "efa" || (shm_opt != -ffi::FI_ENOPROTOOPT && shm_opt != -ffi::FI_ENOSYS) {
            return Err(Error::transport(
                TRANSPORT,
                format!(
                    "{} domain '{}' did not accept FI_OPT_SHARED_MEMORY_PERMITTED=false ({}); set \
                     FI_EFA_ENABLE_SHM_TRANSFER=0 in the environment instead, or {}=allow",
                    self.attrs.provider,
                    self.attrs.domain,
                    ffi::strerror(shm_opt as i64),
                    crate::config::VAR_SHM
                ),
            ));
        }
        tracing::debug!(provider = %self.attrs.provider, "efa: provider has no shared-memory option; nothing to deny");
        Ok(())
    }

    fn raw(&self) -> *mut RawRail {
        (&*self.raw as *const RawRail).cast_mut()
    }

    fn getname(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: buf has len bytes; fi_getname writes at most len and updates it.
        let mut rc = unsafe { ffi::te_fi_getname(self.raw(), buf.as_mut_ptr().cast(), &mut len) };
        if rc != 0 && len > buf.len() {
            buf.resize(len, 0);
            // SAFETY: as above with the size the provider asked for.
            rc = unsafe { ffi::te_fi_getname(self.raw(), buf.as_mut_ptr().cast(), &mut len) };
        }
        if rc != 0 {
            return Err(self.error("fi_getname", rc as i64));
        }
        buf.truncate(len);
        Ok(buf)
    }

    /// A zeroed area of `blocks` 64-byte blocks that lives as long as this rail's endpoint: what
    /// operations still posted when their owner stops (receives) may be written into.
    pub(crate) fn retained_area(&self, blocks: usize) -> *mut Block {
        let mut area = vec![Block([0; 64]); blocks].into_boxed_slice();
        let p = area.as_mut_ptr();
        self.retained.lock().push(area);
        p
    }

    pub(crate) fn error(&self, call: &str, rc: i64) -> Error {
        Error::transport_caused(
            TRANSPORT,
            format!("{call} on {} domain '{}'", self.attrs.provider, self.attrs.domain),
            ffi::native_error(rc),
        )
    }

    /// The AV address of a peer endpoint: inserted on first use, shared by every connected peer
    /// with the same address after that. Pair each success with one [`Rail::av_release`].
    pub(crate) fn av_acquire(&self, addr: &[u8]) -> Result<u64> {
        self.addresses.lock().acquire(addr, |addr| {
            let mut out = 0u64;
            // SAFETY: addr points at a full endpoint name of this provider (the caller pads it to
            // at least our own name's length); out receives the fi_addr_t.
            let rc = unsafe { ffi::te_fi_av_insert(self.raw(), addr.as_ptr().cast(), &mut out) };
            if rc != 0 {
                return Err(self.error("fi_av_insert", rc as i64));
            }
            Ok(out)
        })
    }

    /// Drops one user of an AV address; the last one removes it from the provider (which closes
    /// its connection on connection-based providers).
    pub(crate) fn av_release(&self, fi_addr: u64) {
        let mut table = self.addresses.lock();
        if !table.release(fi_addr) {
            return;
        }
        // SAFETY: fi_addr came from av_acquire on this AV and no peer uses it any more; removal
        // happens under the table lock, so a concurrent acquire cannot hand it out meanwhile.
        let rc = unsafe { ffi::te_fi_av_remove(self.raw(), fi_addr) };
        if rc != 0 {
            tracing::debug!(rc, domain = %self.attrs.domain, "fi_av_remove failed");
        }
    }

    /// Registers `[base, base + len)` on this rail's domain. `remote` grants peers access.
    pub(crate) fn register(self: &Arc<Self>, base: u64, len: u64, remote: bool) -> Result<MemoryRegion> {
        // Application-chosen keys (providers without FI_MR_PROV_KEY) come from the rail's key
        // sequence: not a walk (1, 2, 3...) a stranger could follow, and never a key an earlier,
        // since deregistered region had. A key the provider already holds (another user of the
        // domain) is skipped, a bounded number of times.
        const KEY_DRAWS: usize = 8;
        let mut mr: *mut FidMr = std::ptr::null_mut();
        let mut key = 0u64;
        let mut desc: *mut c_void = std::ptr::null_mut();
        let mut rc = 0;
        for _ in 0..KEY_DRAWS {
            let requested_key = if self.attrs.prov_key() {
                0
            } else {
                self.keys.lock().next_key().ok_or_else(|| {
                    Error::transport(
                        TRANSPORT,
                        format!(
                            "{} domain '{}': every {}-byte memory-region key has been used",
                            self.attrs.provider, self.attrs.domain, self.attrs.mr_key_size
                        ),
                    )
                })?
            };
            // SAFETY: the caller guarantees [base, base+len) is mapped memory that stays valid until
            // the returned MemoryRegion is dropped (the engine's registration contract); out-params
            // are valid.
            rc = unsafe {
                ffi::te_fi_mr_reg(
                    self.raw(),
                    base as *mut c_void,
                    len as usize,
                    c_int::from(remote),
                    requested_key,
                    c_int::from(self.attrs.bind_ep()),
                    c_int::from(self.attrs.mr_cache_bypass()),
                    0,
                    0,
                    &mut mr,
                    &mut key,
                    &mut desc,
                )
            };
            let key_taken = rc == -ffi::FI_ENOKEY || rc == -libc::EKEYREJECTED;
            if !key_taken || self.attrs.prov_key() {
                break;
            }
        }
        if rc != 0 {
            return Err(self.error(&format!("fi_mr_regattr([{base:#x}, +{len}))"), rc as i64));
        }
        Ok(MemoryRegion {
            mr,
            key,
            desc,
            _rail: self.clone(),
        })
    }

    /// Posts one RMA write (delivery complete). Returns 0, `-FI_EAGAIN` or another negative error.
    ///
    /// # Safety
    /// `buf..buf+len` must be registered local memory valid until the completion for `ctx` is read,
    /// `ctx` must point to a 64-byte scratch area valid until then, `desc` must be this rail's
    /// descriptor for the buffer (or null) and `dest` an address from this rail's AV.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn post_write(
        &self,
        buf: u64,
        len: u64,
        desc: *mut c_void,
        dest: u64,
        raddr: u64,
        rkey: u64,
        ctx: *mut c_void,
    ) -> isize {
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            ffi::te_fi_write(
                self.raw(),
                buf as *const c_void,
                len as usize,
                desc,
                dest,
                raddr,
                rkey,
                ctx,
            )
        }
    }

    /// Posts one RMA read.
    ///
    /// # Safety
    /// As [`Rail::post_write`]; the local buffer is written by the provider.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn post_read(
        &self,
        buf: u64,
        len: u64,
        desc: *mut c_void,
        dest: u64,
        raddr: u64,
        rkey: u64,
        ctx: *mut c_void,
    ) -> isize {
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            ffi::te_fi_read(
                self.raw(),
                buf as *mut c_void,
                len as usize,
                desc,
                dest,
                raddr,
                rkey,
                ctx,
            )
        }
    }

    /// Reads completions into `out` (non-blocking): contexts, and in `lens` each one's received
    /// length (receives only). Returns the count, 0, `-FI_EAVAIL` or an error.
    pub(crate) fn cq_read(&self, out: &mut [*mut c_void], lens: &mut [usize]) -> isize {
        let n = out.len().min(lens.len());
        // SAFETY: out and lens have at least n writable slots; the shim writes at most n of each.
        let rc = unsafe { ffi::te_fi_cq_read(self.raw(), out.as_mut_ptr(), lens.as_mut_ptr(), n) };
        if rc == -ffi::FI_EAGAIN {
            0
        } else {
            rc
        }
    }

    /// Blocking read with a timeout; only when [`Rail::cq_can_wait`].
    pub(crate) fn cq_sread(&self, out: &mut [*mut c_void], lens: &mut [usize], timeout_ms: i32) -> isize {
        let n = out.len().min(lens.len());
        // SAFETY: as cq_read; the CQ has a wait object (checked by the caller).
        let rc = unsafe { ffi::te_fi_cq_sread(self.raw(), out.as_mut_ptr(), lens.as_mut_ptr(), n, timeout_ms) };
        if rc == -ffi::FI_EAGAIN || rc == -(libc::ETIMEDOUT as isize) || rc == -(libc::EINTR as isize) {
            0
        } else {
            rc
        }
    }

    /// Posts a receive buffer for messages from any peer.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and untouched by us until the completion for `ctx` is read
    /// (or the endpoint is closed); `desc` is this rail's descriptor for it (or null); `ctx`
    /// points to a 64-byte scratch area valid as long.
    pub(crate) unsafe fn post_recv(&self, buf: *mut u8, len: usize, desc: *mut c_void, ctx: *mut c_void) -> isize {
        // SAFETY: forwarded from the caller's contract.
        unsafe { ffi::te_fi_recv(self.raw(), buf.cast(), len, desc, ctx) }
    }

    /// Sends one message to `dest` (an address of this rail's AV).
    ///
    /// # Safety
    /// As [`Rail::post_recv`], the buffer being read rather than written.
    pub(crate) unsafe fn post_send(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        ctx: *mut c_void,
    ) -> isize {
        // SAFETY: forwarded from the caller's contract.
        unsafe { ffi::te_fi_send(self.raw(), buf.cast(), len, desc, dest, ctx) }
    }

    /// Closes the endpoint and opens a new one at the same address (owner thread only; no other
    /// thread uses the endpoint itself). fi_endpoint(3): the operations still posted to the old
    /// one are discarded without completions, and none of their buffers is touched once the close
    /// returned. `Err` when the new endpoint cannot be opened or got another address: the rail
    /// then refuses every post.
    pub(crate) fn reset_endpoint(&self) -> Result<()> {
        let swap = self.cq_swap.write();
        // SAFETY: raw is this rail's live struct; only the owner thread posts to the endpoint or
        // reads the CQ, and other threads' signals wait on `cq_swap`.
        let rc = unsafe { ffi::te_fi_ep_reset(self.raw()) };
        drop(swap);
        if rc != 0 {
            return Err(self.error("reopening the endpoint", rc as i64));
        }
        let now = self.getname()?;
        if now != self.address {
            return Err(Error::transport(
                TRANSPORT,
                format!(
                    "{} domain '{}': the reopened endpoint has another address; peers must reconnect",
                    self.attrs.provider, self.attrs.domain
                ),
            ));
        }
        Ok(())
    }

    /// Closes the endpoint for good (shutdown): posted operations are discarded and their buffers
    /// no longer touched.
    pub(crate) fn close_endpoint(&self) {
        // SAFETY: as reset_endpoint.
        unsafe { ffi::te_fi_ep_close(self.raw()) };
    }

    /// Wakes a thread blocked in [`Rail::cq_sread`].
    pub(crate) fn cq_signal(&self) {
        if self.cq_can_wait {
            let _swap = self.cq_swap.read();
            // SAFETY: the CQ is live (not being replaced: we hold `cq_swap`); the shim checks it
            // exists and has a wait object.
            unsafe { ffi::te_fi_cq_signal(self.raw()) };
        }
    }

    /// Reads one error completion: the failed operation's context and the provider's text.
    pub(crate) fn cq_readerr(&self) -> Option<(*mut c_void, i32, String)> {
        let mut ctx: *mut c_void = std::ptr::null_mut();
        let mut err: c_int = 0;
        let mut msg = [0 as c_char; 512];
        // SAFETY: out-params valid; msg has msg.len() bytes and the shim NUL-terminates.
        let rc = unsafe { ffi::te_fi_cq_readerr(self.raw(), &mut ctx, &mut err, msg.as_mut_ptr(), msg.len()) };
        if rc < 0 {
            return None;
        }
        Some((ctx, err, cstr(msg.as_ptr())))
    }
}

impl Drop for Rail {
    fn drop(&mut self) {
        // SAFETY: the last reference is gone: no worker thread, memory region or peer uses it.
        unsafe { ffi::te_fi_rail_close(&mut *self.raw) };
        // The endpoint is closed: nothing writes into the retained areas any more.
        self.retained.lock().clear();
    }
}

/// One registration on one rail. Closed on drop; keeps the rail alive until then.
pub(crate) struct MemoryRegion {
    mr: *mut FidMr,
    /// Remote key peers use.
    pub key: u64,
    /// Local descriptor (null when the provider needs none).
    pub desc: *mut c_void,
    _rail: Arc<Rail>,
}

// SAFETY: the MR handle and descriptor are opaque tokens for a FI_THREAD_SAFE domain.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above; shared access only reads key and desc.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Closes the registration, reporting libfabric's error.
    pub(crate) fn close(mut self) -> Result<()> {
        let mr = std::mem::replace(&mut self.mr, std::ptr::null_mut());
        // SAFETY: mr came from fi_mr_regattr and is closed exactly once (Drop sees null now).
        let rc = unsafe { ffi::te_fi_mr_close(mr) };
        if rc != 0 {
            return Err(self._rail.error("fi_close(mr)", rc as i64));
        }
        Ok(())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if self.mr.is_null() {
            return;
        }
        // SAFETY: mr came from fi_mr_regattr and is closed exactly once, before its rail (we hold it).
        let rc = unsafe { ffi::te_fi_mr_close(self.mr) };
        if rc != 0 {
            tracing::warn!(rc, "fi_close(mr) failed");
        }
    }
}

/// Versions of libfabric: the headers the shim was compiled against (the vendored 2.6) and the
/// library loaded now, `None` when none could be (then [`crate::libfabric`] says why). Loads it
/// on the first call.
pub fn libfabric_versions() -> ((u32, u32), Option<(u32, u32)>) {
    (
        crate::library::HEADER_VERSION,
        crate::library::libfabric().ok().map(|l| l.version),
    )
}

/// The core provider of a provider name: `tcp` for `tcp;ofi_rxm`, `efa` for `efa`.
pub(crate) fn core_provider(provider: &str) -> &str {
    provider.split(';').next().unwrap_or("")
}
