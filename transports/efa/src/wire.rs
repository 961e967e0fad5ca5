//! What this transport puts into segment descriptors, and the strict parsing of what peers put
//! there: the endpoint info (provider, address mode, one address per rail) and per-buffer keys.
//!
//! ```json
//! {"provider": "tcp;ofi_rxm", "virt_addr": false,
//!  "rails": [{"domain": "eth0", "addr": "0200a4c1c0000202..."}]}
//! ```
//! Per exported buffer: `{"keys": ["0x1f", null]}`, one key per rail of the owner in rail order,
//! `null` where the buffer is not registered on that rail (rail-local placement).

use serde::{Deserialize, Serialize};
use te_base::{Error, Result};

/// Upper bounds that keep a hostile descriptor from exhausting memory.
const MAX_RAILS: usize = crate::registry::MAX_RAILS;
const MAX_ADDR_LEN: usize = 1024;

/// One rail of a peer, as advertised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RailEndpoint {
    /// Provider domain (NIC) name, informational.
    pub domain: String,
    /// Endpoint address (fi_getname), hex.
    pub addr: String,
}

/// The transport's endpoint info.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointInfo {
    /// Provider name (`efa`, `tcp;ofi_rxm`, `shm`).
    pub provider: String,
    /// Remote addresses are virtual addresses (FI_MR_VIRT_ADDR) rather than offsets.
    pub virt_addr: bool,
    /// Rails in order.
    pub rails: Vec<RailEndpoint>,
}

/// The keys of one exported buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferKeys {
    /// One remote key per rail of the owner, hex with 0x; `None` where not registered.
    pub keys: Vec<Option<String>>,
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Bytes of a hex string.
pub fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

/// A parsed peer endpoint: addresses as bytes.
#[derive(Debug, Clone)]
pub struct PeerEndpoint {
    /// Provider name.
    pub provider: String,
    /// Address mode of the peer's provider.
    pub virt_addr: bool,
    /// Rail addresses.
    pub addrs: Vec<Vec<u8>>,
}

impl EndpointInfo {
    /// Parses and validates a peer's endpoint info.
    pub fn parse(segment: &str, value: &serde_json::Value) -> Result<PeerEndpoint> {
        let bad = |m: String| Error::InvalidDescriptor(format!("segment '{segment}': efa endpoint: {m}"));
        let info: EndpointInfo = serde_json::from_value(value.clone()).map_err(|e| bad(e.to_string()))?;
        if info.rails.is_empty() || info.rails.len() > MAX_RAILS {
            return Err(bad(format!("{} rails (must be 1..={MAX_RAILS})", info.rails.len())));
        }
        let addrs = info
            .rails
            .iter()
            .enumerate()
            .map(|(i, r)| match from_hex(&r.addr) {
                Some(a) if !a.is_empty() && a.len() <= MAX_ADDR_LEN => Ok(a),
                _ => Err(bad(format!(
                    "rail {i} address {:?} is not 1..={MAX_ADDR_LEN} hex bytes",
                    r.addr
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PeerEndpoint {
            provider: info.provider,
            virt_addr: info.virt_addr,
            addrs,
        })
    }
}

impl BufferKeys {
    /// Encodes keys.
    pub fn encode(keys: &[Option<u64>]) -> serde_json::Value {
        serde_json::to_value(BufferKeys {
            keys: keys.iter().map(|k| k.map(|k| format!("{k:#x}"))).collect(),
        })
        .unwrap_or(serde_json::Value::Null)
    }

    /// Parses one buffer's keys; must hold exactly `rails` entries, at least one of them a key.
    pub fn parse(segment: &str, buffer: usize, value: &serde_json::Value, rails: usize) -> Result<Vec<Option<u64>>> {
        let bad = |m: String| Error::InvalidDescriptor(format!("segment '{segment}': buffer {buffer} efa keys: {m}"));
        let keys: BufferKeys = serde_json::from_value(value.clone()).map_err(|e| bad(e.to_string()))?;
        if keys.keys.len() != rails {
            return Err(bad(format!("{} keys for {rails} rails", keys.keys.len())));
        }
        if keys.keys.iter().all(Option::is_none) {
            return Err(bad("no rail holds the buffer".into()));
        }
        keys.keys
            .iter()
            .map(|k| match k {
                None => Ok(None),
                Some(k) => k
                    .strip_prefix("0x")
                    .and_then(|h| u64::from_str_radix(h, 16).ok())
                    .map(Some)
                    .ok_or_else(|| bad(format!("key {k:?} is not 0x-prefixed hex"))),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let b = vec![0u8, 1, 0xab, 0xff];
        assert_eq!(from_hex(&to_hex(&b)).unwrap(), b);
        assert!(from_hex("abc").is_none());
        assert!(from_hex("zz").is_none());
        assert!(from_hex("é1").is_none());
    }

    #[test]
    fn endpoint_and_keys_validate() {
        let good =
            serde_json::json!({"provider": "shm", "virt_addr": true, "rails": [{"domain": "shm", "addr": "0a0b"}]});
        let p = EndpointInfo::parse("s", &good).unwrap();
        assert_eq!(p.addrs, vec![vec![10, 11]]);
        for bad in [
            serde_json::json!({"provider": "shm", "virt_addr": true, "rails": []}),
            serde_json::json!({"provider": "shm", "virt_addr": true, "rails": [{"domain": "x", "addr": "0"}]}),
            serde_json::json!({"provider": "shm", "rails": [{"domain": "x", "addr": "00"}]}),
            serde_json::json!("nope"),
        ] {
            let e = EndpointInfo::parse("s", &bad).unwrap_err();
            assert!(matches!(e, Error::InvalidDescriptor(_)), "{e}");
        }
        let k = BufferKeys::encode(&[Some(1), None, Some(u64::MAX)]);
        assert_eq!(
            BufferKeys::parse("s", 0, &k, 3).unwrap(),
            vec![Some(1), None, Some(u64::MAX)]
        );
        assert!(BufferKeys::parse("s", 0, &k, 1).is_err());
        assert!(BufferKeys::parse("s", 0, &BufferKeys::encode(&[None]), 1).is_err());
        assert!(BufferKeys::parse("s", 0, &serde_json::json!({"keys": ["12"]}), 1).is_err());
        assert!(BufferKeys::parse("s", 0, &serde_json::Value::Null, 1).is_err());
    }
}
