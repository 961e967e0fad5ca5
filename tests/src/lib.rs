//! Shared helpers for cross-crate tests.
