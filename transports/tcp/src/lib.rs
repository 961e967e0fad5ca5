//! TCP transport: persistent lanes per peer, sliced transfers, bounds-checked serving side.
