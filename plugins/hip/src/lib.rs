//! HIP (ROCm) device-memory plugin, loaded at run time.
