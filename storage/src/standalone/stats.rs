//! Standalone mode's counters, as a section of `StoreStats`: the client's key-handle cache and
//! the server's key-set table, sessions and mappings.

/// Counters of a standalone client and the server it talks to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StandaloneStats {
    /// Client: ranged gets that named their keys by a key handle the server accepted.
    pub key_handle_hits: u64,
    /// Client: ranged gets that sent their keys.
    pub key_handle_misses: u64,
    /// Client: handles received for key sets sent.
    pub key_handle_mints: u64,
    /// Client: mints of a key set minted before.
    pub key_handle_remints: u64,
    /// Server: handles resolved.
    pub server_key_handle_hits: u64,
    /// Server: handles not known.
    pub server_key_handle_misses: u64,
    /// Server: handles minted.
    pub server_key_handle_mints: u64,
    /// Server: key sets held now.
    pub server_key_handle_held: u64,
    /// Server: heap bytes the held key sets take.
    pub server_key_handle_bytes: u64,
    /// Server: worker sessions connected.
    pub server_sessions: u64,
    /// Server: worker buffers mapped.
    pub server_mapped_buffers: u64,
}
