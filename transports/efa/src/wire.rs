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
/// Most rails one transport drives (rail sets are 64-bit masks).
pub(crate) const MAX_RAILS: usize = 64;
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
    /// Notifications this engine accepts (absent: an engine that predates them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<NotifyInfo>,
}

/// What a peer accepts as notifications over efa.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifyInfo {
    /// Message version it speaks ([`crate::note_wire::VERSION`]).
    pub version: u8,
    /// Largest payload its inbox accepts (`TE_NOTIFY_MAX_BYTES`).
    pub max_bytes: u64,
}

/// The keys of one exported buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferKeys {
    /// One remote key per rail of the owner, hex with 0x; `None` where not registered.
    pub keys: Vec<Option<String>>,
}

/// A peer-supplied string as shown in an error: quoted, and cut after 64 characters so a hostile
/// descriptor cannot make our errors and logs arbitrarily large.
fn shown(text: &str) -> String {
    const MAX: usize = 64;
    match text.char_indices().nth(MAX) {
        None => format!("{text:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes)", &text[..cut], text.len()),
    }
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
    /// Largest notification payload it accepts; `None` when it takes none this build can send.
    pub notify_max: Option<usize>,
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
                    "rail {i} address {} is not 1..={MAX_ADDR_LEN} hex bytes",
                    shown(&r.addr)
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        let notify_max = info
            .notify
            .filter(|n| n.version == crate::note_wire::VERSION)
            .map(|n| n.max_bytes.min(te_base::notify::MAX_PAYLOAD_LIMIT as u64) as usize);
        Ok(PeerEndpoint {
            provider: info.provider,
            virt_addr: info.virt_addr,
            addrs,
            notify_max,
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
                    .ok_or_else(|| bad(format!("key {} is not 0x-prefixed hex", shown(k)))),
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

    mod fuzz {
        use super::super::*;
        use proptest::prelude::*;

        fn json() -> impl Strategy<Value = serde_json::Value> {
            let leaf = prop_oneof![
                Just(serde_json::Value::Null),
                any::<bool>().prop_map(serde_json::Value::from),
                any::<i64>().prop_map(serde_json::Value::from),
                "\\PC{0,16}".prop_map(serde_json::Value::from),
                "(0x)?[0-9a-fA-F]{0,20}".prop_map(serde_json::Value::from),
            ];
            leaf.prop_recursive(4, 32, 6, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                    proptest::collection::btree_map(
                        prop_oneof![
                            Just("provider".to_string()),
                            Just("virt_addr".to_string()),
                            Just("rails".to_string()),
                            Just("domain".to_string()),
                            Just("addr".to_string()),
                            Just("keys".to_string()),
                            "\\PC{0,6}",
                        ],
                        inner,
                        0..5
                    )
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
                ]
            })
        }

        proptest! {
            /// Arbitrary JSON in the descriptor's efa endpoint or buffer keys is an error or a
            /// parse that respects every bound, never a panic.
            #[test]
            fn arbitrary_endpoint_and_key_json_never_panics(v in json(), rails in 0usize..8) {
                if let Ok(p) = EndpointInfo::parse("s", &v) {
                    prop_assert!(!p.addrs.is_empty() && p.addrs.len() <= MAX_RAILS);
                    prop_assert!(p.addrs.iter().all(|a| !a.is_empty() && a.len() <= MAX_ADDR_LEN));
                }
                if let Ok(k) = BufferKeys::parse("s", 0, &v, rails) {
                    prop_assert_eq!(k.len(), rails);
                    prop_assert!(k.iter().any(Option::is_some));
                }
            }

            #[test]
            fn arbitrary_strings_never_panic_the_hex_and_key_parsers(text in "\\PC{0,80}", bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
                let _ = from_hex(&text);
                prop_assert_eq!(from_hex(&to_hex(&bytes)), Some(bytes.clone()));
                let rail = serde_json::json!({"provider": "p", "virt_addr": false, "rails": [{"domain": "d", "addr": text}]});
                if let Err(e) = EndpointInfo::parse("s", &rail) {
                    prop_assert!(e.to_string().len() < 400, "{}", e);
                }
                let _ = BufferKeys::parse("s", 0, &serde_json::json!({"keys": [text]}), 1);
            }

            #[test]
            fn endpoints_and_keys_round_trip(
                addrs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..64), 1..4),
                keys in proptest::collection::vec(proptest::option::of(any::<u64>()), 1..6),
            ) {
                let info = EndpointInfo {
                    provider: "tcp;ofi_rxm".into(),
                    virt_addr: true,
                    rails: addrs.iter().map(|a| RailEndpoint { domain: "eth0".into(), addr: to_hex(a) }).collect(),
                    notify: Some(NotifyInfo { version: 1, max_bytes: 4096 }),
                };
                let p = EndpointInfo::parse("s", &serde_json::to_value(&info).unwrap()).unwrap();
                prop_assert_eq!(p.addrs, addrs);
                prop_assert_eq!(p.notify_max, Some(4096));
                let encoded = BufferKeys::encode(&keys);
                let parsed = BufferKeys::parse("s", 0, &encoded, keys.len());
                if keys.iter().any(Option::is_some) {
                    prop_assert_eq!(parsed.unwrap(), keys);
                } else {
                    prop_assert!(parsed.is_err());
                }
            }
        }
    }

    #[test]
    fn hostile_strings_are_cut_in_errors() {
        let long = "z".repeat(1 << 20);
        let v = serde_json::json!({"provider": "p", "virt_addr": false, "rails": [{"domain": "d", "addr": long}]});
        let e = EndpointInfo::parse("s", &v).unwrap_err().to_string();
        assert!(
            e.len() < 400 && e.contains("1048576 bytes"),
            "{}",
            &e[..e.len().min(500)]
        );
        let e = BufferKeys::parse("s", 0, &serde_json::json!({"keys": [long]}), 1)
            .unwrap_err()
            .to_string();
        assert!(e.len() < 400, "{}", &e[..e.len().min(500)]);
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
