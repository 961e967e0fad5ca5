//! A 4 KiB-aligned heap buffer for the log's own headers and start-up scan (O_DIRECT needs
//! aligned memory). Caller data never passes through it.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use super::record::BLOCK;

/// Zeroed, 4 KiB-aligned memory whose length is a multiple of 4 KiB.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer owns its allocation exclusively; access goes through &self / &mut self.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// At least `len` bytes (rounded up to whole blocks, at least one).
    pub fn new(len: usize) -> Self {
        let len = (len.max(1) as u64).div_ceil(BLOCK) as usize * BLOCK as usize;
        let layout = Layout::from_size_align(len, BLOCK as usize).expect("block-aligned layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Never true; for API symmetry.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The first byte, for I/O.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the allocation is live, initialised (zeroed) and `len` bytes long.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
