//! Protocol logic of the verbs transport, with no verbs calls: every function takes its inputs
//! (device limits, peer info, completions, the current time) and returns what to do, so unit tests
//! drive it directly and against the recording fake.

pub mod qp_state;
