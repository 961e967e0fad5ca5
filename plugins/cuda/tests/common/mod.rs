//! Helpers shared by the GPU tests.

pub mod device_suite;
