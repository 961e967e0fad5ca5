//! What the local-copy benches share: prefaulted buffers and one short criterion configuration.

#![allow(dead_code)] // each bench uses its own subset

use te_base::{HostBuffer, HostBufferOptions};

/// A prefaulted host buffer (page faults stay out of the timed loop).
pub fn buffer(len: usize) -> HostBuffer {
    HostBuffer::allocate(
        len,
        HostBufferOptions {
            prefault: true,
            ..Default::default()
        },
    )
    .expect("allocate")
}

/// Few, short samples: these benches compare kernels and plans, not absolute times.
pub fn quick() -> criterion::Criterion {
    criterion::Criterion::default()
        .sample_size(20)
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(1))
}
