//! Protocol logic of the verbs transport, with no verbs calls: every function takes its inputs
//! (device limits, peer info, completions, the current time) and returns what to do, so unit tests
//! drive it directly and against the recording fake.

pub mod completion;
pub mod handshake;
pub mod mr_split;
pub mod notify_wire;
pub mod qp_state;
pub mod recovery;
pub mod remote_keys;
pub mod send_queue;
pub mod slicing;
pub mod values;
