//! Metadata backends: where engines publish their segment descriptors and find each other's.
//!
//! The trait is [`te_base::MetadataStore`]; [`InProcessStore`] is the embedded default.

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "http-metadata")]
pub mod http;
mod in_process;
pub mod p2p;

pub use in_process::InProcessStore;
pub use te_base::{DescriptorEvent, DescriptorWatch, MetadataStore};
