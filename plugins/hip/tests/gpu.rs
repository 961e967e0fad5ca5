//! Tests on a real AMD GPU. Without one they print why and pass, unless `TE_REQUIRE` names `hip`
//! or `rocm`, in which case a missing GPU is a failure. The checks are the CUDA plugin's suite.

#[path = "../../cuda/tests/common/device_suite.rs"]
mod device_suite;

use std::sync::Arc;

use device_suite as suite;
use te_base::device::DevicePlugin;

fn gpu() -> Option<Arc<dyn DevicePlugin>> {
    suite::plugin_or_skip(te_plugin_hip::load(), &["hip", "rocm"])
}

#[test]
fn bus_ids_are_distinct_and_exist_in_sysfs() {
    let Some(hip) = gpu() else { return };
    suite::bus_ids_are_distinct_and_exist_in_sysfs(&hip);
}

#[test]
fn synchronous_copies_round_trip_every_byte() {
    let Some(hip) = gpu() else { return };
    suite::synchronous_copies_round_trip_every_byte(&hip);
}

#[test]
fn kv_fragment_batches_are_byte_exact() {
    let Some(hip) = gpu() else { return };
    suite::kv_fragment_batches_are_byte_exact(&hip);
}

#[test]
fn concurrent_batches_on_the_shared_stream_stay_separate() {
    let Some(hip) = gpu() else { return };
    suite::concurrent_batches_stay_separate(&hip);
}

#[test]
fn pointers_are_classified_by_the_runtime() {
    let Some(hip) = gpu() else { return };
    suite::pointers_are_classified(&hip);
}

#[test]
fn bad_input_gets_typed_errors() {
    let Some(hip) = gpu() else { return };
    suite::bad_input_gets_typed_errors(&hip, "hipMalloc");
}

#[test]
fn dropping_device_buffers_frees_them() {
    let Some(hip) = gpu() else { return };
    suite::dropping_device_buffers_frees_them(&hip);
}

#[test]
fn dmabuf_export_gives_a_descriptor_or_says_why_not() {
    let Some(hip) = gpu() else { return };
    suite::dmabuf_export_gives_a_descriptor_or_says_why_not(&hip);
}
