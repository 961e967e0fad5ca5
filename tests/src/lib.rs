//! Shared helpers for cross-crate and multi-process tests: network namespaces standing in for
//! hosts ([`netns`]), an etcd server started for a test ([`etcd`]), and engine processes driven
//! over their standard input ([`node`], the `te-node` binary).

pub mod node;
pub mod notify_check;

pub use te_base::test_support::{etcd, netns, required, skip_or_fail};

pub use te_base::pattern::pattern;
