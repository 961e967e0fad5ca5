//! Tests on a real NVIDIA GPU. Without one they print why and pass, unless `TE_REQUIRE` names
//! `cuda`, in which case a missing GPU is a failure (scripts/gpu-check.sh sets it).

mod common;

use std::sync::Arc;

use common::device_suite as suite;
use te_base::device::DevicePlugin;
use te_plugin_cuda::CudaPlugin;

fn gpu() -> Option<(Arc<CudaPlugin>, Arc<dyn DevicePlugin>)> {
    let plugin = suite::plugin_or_skip(te_plugin_cuda::load_cuda(), &["cuda"])?;
    let dynamic: Arc<dyn DevicePlugin> = plugin.clone();
    Some((plugin, dynamic))
}

#[test]
fn bus_ids_are_distinct_and_exist_in_sysfs() {
    let Some((_, cuda)) = gpu() else { return };
    suite::bus_ids_are_distinct_and_exist_in_sysfs(&cuda);
}

#[test]
fn synchronous_copies_round_trip_every_byte() {
    let Some((_, cuda)) = gpu() else { return };
    suite::synchronous_copies_round_trip_every_byte(&cuda);
}

#[test]
fn kv_fragment_batches_are_byte_exact_with_and_without_the_batch_call() {
    let Some((plugin, cuda)) = gpu() else { return };
    let initial = plugin.batch_memcpy();
    let mut modes = vec![false];
    match plugin.set_batch_memcpy(true) {
        Ok(()) => modes.push(true),
        Err(e) => println!("testing one call per fragment only: {e}"),
    }
    for batched in modes {
        plugin.set_batch_memcpy(batched).unwrap();
        suite::kv_fragment_batches_are_byte_exact(&cuda);
    }
    plugin.set_batch_memcpy(initial).unwrap();
}

#[test]
fn plain_memcpy_baseline_is_byte_exact() {
    use te_base::device::{CopyDirection, CopyFragment, DeviceBuffer};
    let Some((plugin, cuda)) = gpu() else { return };
    let len = 37_440;
    let src = suite::pattern_bytes(9, 0, len);
    let mut back = vec![0u8; len];
    let a = DeviceBuffer::allocate(&cuda, 0, len as u64).unwrap();
    let b = DeviceBuffer::allocate(&cuda, 0, len as u64).unwrap();
    let f = |dst, src| CopyFragment {
        dst,
        src,
        len: len as u64,
    };
    // SAFETY: all four buffers are live and `len` bytes long; synchronize() runs before reading.
    unsafe {
        plugin
            .plain_memcpy(0, CopyDirection::HostToDevice, f(a.addr(), src.as_ptr() as u64))
            .unwrap();
        plugin
            .plain_memcpy(0, CopyDirection::DeviceToDevice, f(b.addr(), a.addr()))
            .unwrap();
        plugin
            .plain_memcpy(0, CopyDirection::DeviceToHost, f(back.as_mut_ptr() as u64, b.addr()))
            .unwrap();
    }
    plugin.synchronize(0).unwrap();
    assert!(back == src);
}

#[test]
fn concurrent_batches_on_the_shared_stream_stay_separate() {
    let Some((_, cuda)) = gpu() else { return };
    suite::concurrent_batches_stay_separate(&cuda);
}

#[test]
fn pointers_are_classified_by_the_driver() {
    let Some((_, cuda)) = gpu() else { return };
    suite::pointers_are_classified(&cuda);
}

#[test]
fn bad_input_gets_typed_errors() {
    let Some((_, cuda)) = gpu() else { return };
    suite::bad_input_gets_typed_errors(&cuda, "cuMemAlloc");
}

#[test]
fn dropping_device_buffers_frees_them() {
    let Some((_, cuda)) = gpu() else { return };
    suite::dropping_device_buffers_frees_them(&cuda);
}

#[test]
fn dmabuf_export_gives_a_descriptor_or_says_why_not() {
    let Some((_, cuda)) = gpu() else { return };
    suite::dmabuf_export_gives_a_descriptor_or_says_why_not(&cuda);
}
