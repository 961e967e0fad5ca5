//! What only tests and benches need, kept out of the crates users depend on:
//! - [`fixture`]: sysfs trees of real instance types, generated from compact JSON specs;
//! - [`registration_sim`]: a registration provider that models what registering costs on a real
//!   node (p5.48xlarge), so a laptop or CI can reproduce a node's registration sweep.

pub mod fixture;
pub mod registration_sim;

/// A TCP port free on loopback right now (for a server about to start).
pub use te_base::test_support::free_port;

pub use fixture::{FixtureDevice, FixtureDir, FixtureKind, FixtureNuma, FixturePort, FixtureSpec};
pub use registration_sim::{NodeLoad, SimConfig, SimCostModel, SimHandle, SimProvider};
