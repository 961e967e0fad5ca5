//! CUDA device-memory plugin, loaded at run time.
