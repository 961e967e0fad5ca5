//! te-core
