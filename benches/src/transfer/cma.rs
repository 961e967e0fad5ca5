//! The `cma` baseline: the kernel's cross-memory attach (`process_vm_writev` / `process_vm_readv`)
//! copying the same bytes between the same two buffers as the measured run, one call per block,
//! from this process into (or out of) the loopback target process.
//!
//! This is the single copy libfabric's shm provider makes for large transfers, so it is the ceiling
//! of any shared-memory transport on this host for this working set. fi_pingpong moves one 1 MiB
//! buffer back and forth, which stays in the cache; a run of `--total-bytes` 64 MiB streams from
//! DRAM, and this baseline says what the kernel itself reaches there.

use std::time::Instant;

use te_core::TransferOp;

/// Where the measured run's bytes live: the target process and the two buffers.
#[derive(Debug, Clone, Copy)]
pub struct CmaPair {
    /// The loopback target's process id.
    pub pid: u32,
    /// Start of the initiator's buffer.
    pub local: u64,
    /// Start of the target's exported buffer.
    pub remote: u64,
    /// Start of a second buffer of the initiator, as large as its first, for the memcpy loop
    /// (0: none).
    pub memcpy_dst: u64,
    /// `--scatter`: block i goes to the remote slot [`slot`] names instead of slot i.
    pub scatter: bool,
}

/// The remote slot of block `i` of `blocks`: `i` itself, or with `scatter` a fixed permutation
/// (a stride coprime to `blocks`) that keeps neighbouring blocks apart on the remote side, so no
/// transport can coalesce them into one copy.
pub fn slot(i: u64, blocks: u64, scatter: bool) -> u64 {
    if !scatter || blocks < 3 {
        return i;
    }
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut step = (blocks / 2) | 1;
    while gcd(step, blocks) != 1 {
        step += 2;
    }
    (i * step) % blocks
}

/// The memcpy loop: the same `total` bytes in `block` pieces between the initiator's buffer and
/// a second buffer in this process (same slots as the measured run), `passes` times; GB/s.
pub fn memcpy_run(pair: CmaPair, op: TransferOp, block: u64, total: u64, passes: u32) -> Result<f64, String> {
    if pair.memcpy_dst == 0 {
        return Err("the memcpy baseline has no second buffer".into());
    }
    let blocks = total / block;
    let t0 = Instant::now();
    for _ in 0..passes {
        for i in 0..blocks {
            let (l, r) = (
                pair.local + i * block,
                pair.memcpy_dst + slot(i, blocks, pair.scatter) * block,
            );
            let (src, dst) = match op {
                TransferOp::Write => (l, r),
                TransferOp::Read => (r, l),
            };
            // SAFETY: both buffers are this process's own, live, at least `total` bytes long and
            // distinct, and every slot lies inside them.
            unsafe {
                std::ptr::copy_nonoverlapping(src as usize as *const u8, dst as usize as *mut u8, block as usize)
            };
        }
    }
    Ok(total as f64 * passes as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

/// Copies `total` bytes in `block` pieces between the pair's buffers in the direction of `op`,
/// `passes` times over, and returns GB/s. Blocks are issued one after another, as fi_pingpong's
/// messages are.
pub fn run(pair: CmaPair, op: TransferOp, block: u64, total: u64, passes: u32) -> Result<f64, String> {
    let t0 = Instant::now();
    for _ in 0..passes {
        copy_once(pair, op, block, total)?;
    }
    Ok(total as f64 * passes as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

fn copy_once(pair: CmaPair, op: TransferOp, block: u64, total: u64) -> Result<(), String> {
    let blocks = total.div_ceil(block);
    for i in 0..blocks {
        let off = i * block;
        let roff = slot(i, blocks, pair.scatter) * block;
        let len = block.min(total - off) as usize;
        let local = libc::iovec {
            iov_base: (pair.local + off) as usize as *mut libc::c_void,
            iov_len: len,
        };
        let remote = libc::iovec {
            iov_base: (pair.remote + roff) as usize as *mut libc::c_void,
            iov_len: len,
        };
        // SAFETY: `local` lies inside this process's registered buffer of at least `total` bytes,
        // which stays alive for the call; the kernel checks `remote` against the target's own
        // mappings and fails (never faults us) if it is not mapped there.
        let n = unsafe {
            match op {
                TransferOp::Write => libc::process_vm_writev(pair.pid as libc::pid_t, &local, 1, &remote, 1, 0),
                TransferOp::Read => libc::process_vm_readv(pair.pid as libc::pid_t, &local, 1, &remote, 1, 0),
            }
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            return Err(format!(
                "cma baseline: process_vm_{}v into process {}: {err} (needs ptrace permission over the target)",
                if op == TransferOp::Write { "write" } else { "read" },
                pair.pid
            ));
        }
        if n as usize != len {
            return Err(format!("cma baseline: short copy of {n} of {len} bytes"));
        }
    }
    Ok(())
}
