//! The NUMA node a host address really lives on, asked of the kernel (never assumed from the
//! calling thread or a hint).

use te_base::error::{Error, Result};

// From <linux/mempolicy.h>; not every libc version exports them.
const MPOL_F_NODE: libc::c_ulong = 1;
const MPOL_F_ADDR: libc::c_ulong = 2;

/// The node holding the page at `addr`: [`node_via_move_pages`] (no side effect), and when the
/// page is not present yet, [`node_via_get_mempolicy`] (which faults it in, as registration would).
/// `Ok(None)` when the kernel cannot say (NUMA syscalls unavailable or blocked).
pub fn numa_node_of(addr: u64) -> Result<Option<u32>> {
    match node_via_move_pages(addr) {
        Ok(Some(node)) => return Ok(Some(node)),
        Ok(None) => {}
        Err(Error::NotAvailable { .. }) => {}
        Err(e) => return Err(e),
    }
    match node_via_get_mempolicy(addr) {
        Ok(node) => Ok(Some(node)),
        Err(Error::NotAvailable { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR)`: the node of the page at `addr`, faulting the page in
/// if needed. An unmapped address is [`Error::Io`] (`EFAULT`); syscalls blocked by seccomp or a
/// kernel without NUMA are [`Error::NotAvailable`].
pub fn node_via_get_mempolicy(addr: u64) -> Result<u32> {
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy writes one int to `node`, a live local; the nodemask pointer is null
    // with maxnode 0, so nothing else is written. The kernel validates `addr` itself (EFAULT) and
    // never writes through it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as usize as *mut libc::c_void,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if rc != 0 {
        return Err(syscall_error("get_mempolicy", addr, std::io::Error::last_os_error()));
    }
    u32::try_from(node).map_err(|_| Error::not_available("get_mempolicy", format!("kernel returned node {node}")))
}

/// `move_pages(0, 1, [addr], NULL, status, 0)`: queries the node of the page at `addr` without
/// moving or faulting it. `Ok(None)` when the page is not present yet.
pub fn node_via_move_pages(addr: u64) -> Result<Option<u32>> {
    let page_size = te_base::host_buffer::page_size() as u64;
    let page = (addr & !(page_size - 1)) as usize as *mut libc::c_void;
    let pages = [page];
    let mut status: [libc::c_int; 1] = [i32::MIN];
    // SAFETY: move_pages reads `count` (1) page pointers from `pages` and writes `count` ints to
    // `status`, both live locals of that length; `nodes` is null, so it only queries. pid 0 is this
    // process. The page address is validated by the kernel and never dereferenced by us.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_int,
            1 as libc::c_ulong,
            pages.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    if rc != 0 {
        return Err(syscall_error("move_pages", addr, std::io::Error::last_os_error()));
    }
    match status[0] {
        n if n >= 0 => Ok(Some(n as u32)),
        n if -n == libc::ENOENT => Ok(None),
        n if -n == libc::EFAULT => Err(Error::io(
            format!("move_pages: address {addr:#x}"),
            std::io::Error::from_raw_os_error(libc::EFAULT),
        )),
        n => Err(Error::io(
            format!("move_pages: address {addr:#x}"),
            std::io::Error::from_raw_os_error(-n),
        )),
    }
}

fn syscall_error(name: &str, addr: u64, err: std::io::Error) -> Error {
    match err.raw_os_error() {
        Some(libc::ENOSYS) | Some(libc::EPERM) => Error::not_available(name, err.to_string()),
        _ => Error::io(format!("{name}: address {addr:#x}"), err),
    }
}
