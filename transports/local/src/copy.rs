//! Copy kernels: non-temporal (streaming) stores for copies that overwrite whole destination lines,
//! ordinary `memcpy` below the threshold.
//!
//! A streaming store writes a full cache line without first reading it for ownership, so a copy
//! into memory that is not in cache moves a third less traffic. The kernel is chosen once, at run
//! time, from what the CPU supports (AVX-512, AVX2, SSE2 on x86-64; an ordinary copy elsewhere).
//! Streaming stores are weakly ordered: after the last one a thread must call [`store_fence`]
//! before it tells anyone the bytes are there.

use std::ptr;

use crate::plan::CopyOp;

/// Bytes in one cache line; streaming kernels align the destination to it.
pub const CACHE_LINE: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Sse2,
    Portable,
}

/// A streaming-store copy kernel this CPU supports, and how it copies below the streaming
/// threshold. Only [`NtKernel::detect`], [`NtKernel::supported`] and [`NtKernel::portable`] make
/// one, so holding a value proves the CPU can run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NtKernel {
    kind: Kind,
    /// Copies of [`REP_MOVSB_MIN_BYTES`] up to the streaming threshold use `rep movsb`: only on
    /// CPUs with fast short `rep movsb` (FSRM).
    rep_movsb: bool,
}

/// Smallest copy done with `rep movsb` where the CPU has FSRM. Measured here (AMD EPYC, FSRM),
/// cache-resident, against glibc's memcpy: slower at 256-512 B (its start-up cost), even at
/// 768 B, 9% faster at 1,000 B, 8% at 1,728 B, 15% at 2,040 B; from DRAM 23% faster at 1,728 B.
pub const REP_MOVSB_MIN_BYTES: usize = 1 << 10;

impl NtKernel {
    /// The widest kernel this CPU supports.
    pub fn detect() -> Self {
        Self::supported()[0]
    }

    /// Every kernel this CPU supports, widest first (the portable one last).
    pub fn supported() -> Vec<NtKernel> {
        let mut kinds = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                kinds.push(Kind::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                kinds.push(Kind::Avx2);
            }
            kinds.push(Kind::Sse2);
        }
        kinds.push(Kind::Portable);
        let rep_movsb = has_fast_short_rep_movsb();
        kinds.into_iter().map(|kind| NtKernel { kind, rep_movsb }).collect()
    }

    /// The portable kernel: ordinary copies only, no streaming stores, no `rep movsb`.
    pub fn portable() -> Self {
        NtKernel {
            kind: Kind::Portable,
            rep_movsb: false,
        }
    }

    /// How copies below the streaming threshold are made: `rep movsb` (from
    /// [`REP_MOVSB_MIN_BYTES`]) or `memcpy`.
    pub fn short_copy_name(self) -> &'static str {
        if self.rep_movsb {
            "rep movsb"
        } else {
            "memcpy"
        }
    }

    /// Short name for reports: `avx512`, `avx2`, `sse2` or `portable`.
    pub fn name(self) -> &'static str {
        match self.kind {
            #[cfg(target_arch = "x86_64")]
            Kind::Avx512 => "avx512",
            #[cfg(target_arch = "x86_64")]
            Kind::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Kind::Sse2 => "sse2",
            Kind::Portable => "portable",
        }
    }

    /// Copies `len` bytes from `src` to `dst` with streaming stores for every whole destination
    /// cache line and ordinary stores for the unaligned head and tail. Does not fence.
    ///
    /// # Safety
    /// `src` must be valid for `len` reads and `dst` for `len` writes, and the two ranges must not
    /// overlap. Nothing else may access `dst` concurrently.
    #[inline]
    pub unsafe fn copy(self, dst: *mut u8, src: *const u8, len: usize) {
        match self.kind {
            // SAFETY: the caller upholds the range contract; the variant exists only when the CPU
            // reported the feature (see `supported`).
            #[cfg(target_arch = "x86_64")]
            Kind::Avx512 => unsafe { x86::copy_avx512(dst, src, len) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kind::Avx2 => unsafe { x86::copy_avx2(dst, src, len) },
            // SAFETY: as above; SSE2 is part of x86-64.
            #[cfg(target_arch = "x86_64")]
            Kind::Sse2 => unsafe { x86::copy_sse2(dst, src, len) },
            // SAFETY: the caller guarantees valid, non-overlapping ranges.
            Kind::Portable => unsafe { ptr::copy_nonoverlapping(src, dst, len) },
        }
    }
}

/// Orders every streaming store of this thread before the stores that follow (an `sfence` on
/// x86-64; nothing elsewhere, where no streaming stores are issued).
#[inline]
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions and SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

/// Copies with streaming stores when `len >= nt_min`, with an ordinary `memcpy` otherwise.
///
/// # Safety
/// As [`NtKernel::copy`].
#[inline]
pub unsafe fn copy_with_threshold(kernel: NtKernel, nt_min: u64, dst: *mut u8, src: *const u8, len: usize) {
    if len as u64 >= nt_min {
        // SAFETY: forwarded caller contract.
        unsafe { kernel.copy(dst, src, len) }
    } else if kernel.rep_movsb && len >= REP_MOVSB_MIN_BYTES {
        // SAFETY: forwarded caller contract; `rep_movsb` is set only on x86-64 CPUs with FSRM.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            x86::rep_movsb(dst, src, len)
        }
    } else {
        // SAFETY: forwarded caller contract.
        unsafe { ptr::copy_nonoverlapping(src, dst, len) }
    }
}

/// Copies one [`CopyOp`]: with `memmove` semantics and no streaming stores when its source and
/// destination overlap, else [`copy_with_threshold`]. No fence: the caller fences once after its
/// run of copies ([`store_fence`]).
///
/// # Safety
/// The op must name a readable source and a writable destination that no other thread writes
/// meanwhile.
#[inline]
pub unsafe fn copy_op(op: CopyOp, kernel: NtKernel, nt_min: u64) {
    let (dst, src, len) = (
        op.dst as usize as *mut u8,
        op.src as usize as *const u8,
        op.len as usize,
    );
    if op.overlaps_itself() {
        // SAFETY: valid ranges per the caller; `copy` allows them to overlap.
        unsafe { ptr::copy(src, dst, len) }
    } else {
        // SAFETY: valid, non-overlapping ranges per the caller and the check above.
        unsafe { copy_with_threshold(kernel, nt_min, dst, src, len) }
    }
}

/// Copies `ops` in order ([`copy_op`]), prefetching the start of the next copy while one runs,
/// then fences the streaming stores.
///
/// # Safety
/// As [`copy_op`], for every op.
pub unsafe fn copy_ops(ops: &[CopyOp], kernel: NtKernel, nt_min: u64) {
    for (k, &op) in ops.iter().enumerate() {
        if let Some(next) = ops.get(k + 1) {
            prefetch(next.dst, next.src, next.len, next.len >= nt_min);
        }
        // SAFETY: forwarded caller contract.
        unsafe { copy_op(op, kernel, nt_min) };
    }
    store_fence();
}

/// True on x86-64 CPUs that report fast short `rep movsb` (CPUID leaf 7, EDX bit 4).
fn has_fast_short_rep_movsb() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 7 exists on every x86-64 CPU that reports a maximum leaf of 7 or
        // more, which is checked first; the instruction has no other preconditions. (Newer
        // compilers declare these intrinsics safe, hence the allow.)
        #[allow(unused_unsafe)]
        unsafe {
            let max_leaf = std::arch::x86_64::__cpuid(0).eax;
            max_leaf >= 7 && (std::arch::x86_64::__cpuid_count(7, 0).edx >> 4) & 1 == 1
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Most bytes of one copy [`prefetch`] asks for: enough to start the jump to a scattered fragment,
/// after which the hardware prefetcher and the copy itself keep the stream going. Measured here
/// at 1,728 B cache-resident (ratio to the memcpy loop, medians of 10 interleaved runs): 256 B
/// 0.87x, 512 B 0.89x, 768-1,024 B 0.89x, whole fragment (up to 4 KiB) 0.85x, none 0.84x; asking
/// for the whole fragment fills the miss buffers and stalls the prefetch instructions themselves.
pub const PREFETCH_MAX_BYTES: usize = 512;

/// Asks the CPU to start loading the first [`PREFETCH_MAX_BYTES`] of a copy that comes next: the
/// source for reading and, unless the copy will use streaming stores (which never read the
/// destination), the destination for writing. Scattered fragments defeat the hardware
/// prefetcher at every jump; the plan knows the next jump, so its latency overlaps the current
/// copy. A hint only: it never faults and changes no memory.
#[inline]
pub fn prefetch(dst: u64, src: u64, len: u64, streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
        let len = (len as usize).min(PREFETCH_MAX_BYTES);
        let mut off = 0;
        while off < len {
            let (s, d) = (
                src.wrapping_add(off as u64) as usize,
                dst.wrapping_add(off as u64) as usize,
            );
            // SAFETY: prefetch instructions are hints; they never fault, whatever the address,
            // and SSE is part of x86-64.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(s as *const i8);
                if !streaming {
                    _mm_prefetch::<_MM_HINT_ET0>(d as *const i8);
                }
            }
            off += CACHE_LINE;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (dst, src, len, streaming);
}

/// Bytes to copy ordinarily before `dst` reaches a cache-line boundary.
#[inline]
fn head_len(dst: *mut u8, len: usize) -> usize {
    ((CACHE_LINE - (dst as usize & (CACHE_LINE - 1))) & (CACHE_LINE - 1)).min(len)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ptr;

    use super::{head_len, CACHE_LINE};

    /// Copies with `rep movsb`.
    ///
    /// # Safety
    /// Valid, non-overlapping ranges (the direction flag is clear, as the ABI guarantees).
    #[inline]
    pub(super) unsafe fn rep_movsb(dst: *mut u8, src: *const u8, len: usize) {
        // SAFETY: the caller guarantees `src` readable and `dst` writable for `len` bytes;
        // rep movsb touches exactly those bytes, forwards, and clobbers only rcx, rsi and rdi.
        unsafe {
            std::arch::asm!(
                "rep movsb",
                inout("rcx") len => _,
                inout("rdi") dst => _,
                inout("rsi") src => _,
                options(nostack, preserves_flags)
            );
        }
    }

    /// # Safety
    /// Valid, non-overlapping ranges; the CPU supports AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn copy_avx512(dst: *mut u8, src: *const u8, len: usize) {
        let head = head_len(dst, len);
        // SAFETY: the head lies inside both ranges (head <= len).
        unsafe { ptr::copy_nonoverlapping(src, dst, head) };
        let mut n = len - head;
        // SAFETY: offsets stay within the ranges because `n` counts what is left of them.
        let (mut d, mut s) = unsafe { (dst.add(head), src.add(head)) };
        while n >= 4 * CACHE_LINE {
            // SAFETY: 256 bytes remain in both ranges; `d` is 64-byte aligned after the head, as
            // the streaming store requires; loads are unaligned.
            unsafe {
                let a = _mm512_loadu_si512(s as *const _);
                let b = _mm512_loadu_si512(s.add(64) as *const _);
                let c = _mm512_loadu_si512(s.add(128) as *const _);
                let e = _mm512_loadu_si512(s.add(192) as *const _);
                _mm512_stream_si512(d as *mut _, a);
                _mm512_stream_si512(d.add(64) as *mut _, b);
                _mm512_stream_si512(d.add(128) as *mut _, c);
                _mm512_stream_si512(d.add(192) as *mut _, e);
                d = d.add(256);
                s = s.add(256);
            }
            n -= 4 * CACHE_LINE;
        }
        while n >= CACHE_LINE {
            // SAFETY: 64 bytes remain; `d` is 64-byte aligned.
            unsafe {
                _mm512_stream_si512(d as *mut _, _mm512_loadu_si512(s as *const _));
                d = d.add(64);
                s = s.add(64);
            }
            n -= CACHE_LINE;
        }
        // SAFETY: the tail is the rest of both ranges.
        unsafe { ptr::copy_nonoverlapping(s, d, n) };
    }

    /// # Safety
    /// Valid, non-overlapping ranges; the CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_avx2(dst: *mut u8, src: *const u8, len: usize) {
        let head = head_len(dst, len);
        // SAFETY: the head lies inside both ranges.
        unsafe { ptr::copy_nonoverlapping(src, dst, head) };
        let mut n = len - head;
        // SAFETY: offsets stay within the ranges.
        let (mut d, mut s) = unsafe { (dst.add(head), src.add(head)) };
        while n >= 2 * CACHE_LINE {
            // SAFETY: 128 bytes remain; `d` is 64-byte (so 32-byte) aligned; loads are unaligned.
            unsafe {
                let a = _mm256_loadu_si256(s as *const __m256i);
                let b = _mm256_loadu_si256(s.add(32) as *const __m256i);
                let c = _mm256_loadu_si256(s.add(64) as *const __m256i);
                let e = _mm256_loadu_si256(s.add(96) as *const __m256i);
                _mm256_stream_si256(d as *mut __m256i, a);
                _mm256_stream_si256(d.add(32) as *mut __m256i, b);
                _mm256_stream_si256(d.add(64) as *mut __m256i, c);
                _mm256_stream_si256(d.add(96) as *mut __m256i, e);
                d = d.add(128);
                s = s.add(128);
            }
            n -= 2 * CACHE_LINE;
        }
        while n >= CACHE_LINE {
            // SAFETY: 64 bytes remain; `d` is 32-byte aligned.
            unsafe {
                _mm256_stream_si256(d as *mut __m256i, _mm256_loadu_si256(s as *const __m256i));
                _mm256_stream_si256(
                    d.add(32) as *mut __m256i,
                    _mm256_loadu_si256(s.add(32) as *const __m256i),
                );
                d = d.add(64);
                s = s.add(64);
            }
            n -= CACHE_LINE;
        }
        // SAFETY: the tail is the rest of both ranges.
        unsafe { ptr::copy_nonoverlapping(s, d, n) };
    }

    /// # Safety
    /// Valid, non-overlapping ranges.
    #[target_feature(enable = "sse2")]
    pub(super) unsafe fn copy_sse2(dst: *mut u8, src: *const u8, len: usize) {
        let head = head_len(dst, len);
        // SAFETY: the head lies inside both ranges.
        unsafe { ptr::copy_nonoverlapping(src, dst, head) };
        let mut n = len - head;
        // SAFETY: offsets stay within the ranges.
        let (mut d, mut s) = unsafe { (dst.add(head), src.add(head)) };
        while n >= CACHE_LINE {
            // SAFETY: 64 bytes remain; `d` is 64-byte (so 16-byte) aligned; loads are unaligned.
            unsafe {
                let a = _mm_loadu_si128(s as *const __m128i);
                let b = _mm_loadu_si128(s.add(16) as *const __m128i);
                let c = _mm_loadu_si128(s.add(32) as *const __m128i);
                let e = _mm_loadu_si128(s.add(48) as *const __m128i);
                _mm_stream_si128(d as *mut __m128i, a);
                _mm_stream_si128(d.add(16) as *mut __m128i, b);
                _mm_stream_si128(d.add(32) as *mut __m128i, c);
                _mm_stream_si128(d.add(48) as *mut __m128i, e);
                d = d.add(64);
                s = s.add(64);
            }
            n -= CACHE_LINE;
        }
        // SAFETY: the tail is the rest of both ranges.
        unsafe { ptr::copy_nonoverlapping(s, d, n) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies `len` bytes at every source and destination misalignment within a cache line and
    /// checks the destination byte for byte, including that nothing around it was touched.
    fn check(kernel: NtKernel, nt_min: u64, len: usize) {
        let src = te_base::pattern::pattern_bytes(7, 0, len + 2 * CACHE_LINE);
        for src_off in [0, 1, 7, 16, 31, 33, 63] {
            for dst_off in [0, 1, 5, 15, 32, 47, 63] {
                let mut dst = vec![0xEEu8; len + 3 * CACHE_LINE];
                // SAFETY: both offsets plus len stay inside the vectors, which are distinct.
                unsafe {
                    copy_with_threshold(
                        kernel,
                        nt_min,
                        dst.as_mut_ptr().add(dst_off),
                        src.as_ptr().add(src_off),
                        len,
                    )
                };
                store_fence();
                assert_eq!(
                    &dst[dst_off..dst_off + len],
                    &src[src_off..src_off + len],
                    "{} len {len} src+{src_off} dst+{dst_off}",
                    kernel.name()
                );
                assert!(dst[..dst_off].iter().all(|&b| b == 0xEE), "wrote before the range");
                assert!(dst[dst_off + len..].iter().all(|&b| b == 0xEE), "wrote past the range");
            }
        }
    }

    #[test]
    fn every_kernel_copies_small_sizes_at_every_alignment() {
        for kernel in NtKernel::supported() {
            for len in 0..=1024 + 65 {
                check(kernel, 0, len);
            }
        }
    }

    #[test]
    fn every_kernel_copies_large_and_odd_sizes() {
        for kernel in NtKernel::supported() {
            for len in [1727, 1728, 2047, 2048, 2049, 4095, 4096, 8448, 37_440, 65_537, 1 << 20] {
                check(kernel, 0, len);
                check(kernel, 2048, len);
            }
        }
    }

    #[test]
    fn threshold_above_every_size_is_an_ordinary_copy() {
        for len in [0, 1, 100, 5000] {
            check(NtKernel::detect(), u64::MAX, len);
        }
    }

    #[test]
    fn portable_kernel_is_always_supported_and_last() {
        let kernels = NtKernel::supported();
        assert_eq!(kernels.last().unwrap().name(), NtKernel::portable().name());
        assert_eq!(NtKernel::detect(), kernels[0]);
        assert_eq!(NtKernel::portable().short_copy_name(), "memcpy");
    }

    /// Below the streaming threshold, copies from `REP_MOVSB_MIN_BYTES` up go through `rep movsb`
    /// where the CPU has FSRM (and through memcpy elsewhere): every byte lands, at every alignment,
    /// nothing outside the range is written.
    #[test]
    fn short_copies_land_exactly_either_way() {
        for kernel in [NtKernel::detect(), NtKernel::portable()] {
            for len in [REP_MOVSB_MIN_BYTES - 1, REP_MOVSB_MIN_BYTES, 1728, 2047, 8448] {
                check(kernel, u64::MAX, len);
            }
        }
    }
}
