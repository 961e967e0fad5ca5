//! Segment descriptors: what an engine publishes so peers can reach the memory it exports.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::memory::MemoryLocation;

/// The descriptor format version this build writes and reads.
pub const DESCRIPTOR_VERSION: u32 = 1;

/// Upper bounds that keep a hostile descriptor from exhausting memory.
const MAX_NAME_LEN: usize = 1024;
const MAX_TRANSPORTS: usize = 64;
const MAX_BUFFERS: usize = 1 << 20;

/// How a peer reaches one transport of a segment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransportEndpoint {
    /// Transport name (`local`, `tcp`, `efa`, `rdma`).
    pub transport: String,
    /// Transport-specific endpoint data (addresses, process token...), validated by the transport.
    pub info: serde_json::Value,
}

/// One buffer a segment exports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedBuffer {
    /// Address of the first byte in the owner's address space.
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where the memory lives.
    pub location: MemoryLocation,
    /// Per-transport access keys (rkeys, rails holding the buffer...), keyed by transport name.
    #[serde(default)]
    pub keys: BTreeMap<String, serde_json::Value>,
}

impl ExportedBuffer {
    /// The export of a registered region, with no access keys yet (transports that need them add
    /// theirs under their name).
    pub fn of_region(info: &crate::memory::RegionInfo) -> Self {
        ExportedBuffer {
            base: info.base,
            len: info.len,
            location: info.location,
            keys: BTreeMap::new(),
        }
    }

    /// True if `[addr, addr + len)` lies inside the buffer. Overflow-safe.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && len <= self.len && addr - self.base <= self.len - len
    }
}

/// Everything a peer needs to read and write a segment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    /// Format version; must equal [`DESCRIPTOR_VERSION`].
    pub version: u32,
    /// Segment name (unique in the cluster).
    pub name: String,
    /// Random per engine start: a restarted peer publishes a new instance.
    pub instance: u64,
    /// Transports the segment can be reached by, in the owner's order of preference.
    pub transports: Vec<TransportEndpoint>,
    /// Exported buffers, sorted by base, non-overlapping.
    pub buffers: Vec<ExportedBuffer>,
}

impl SegmentDescriptor {
    /// An empty descriptor for `name`.
    pub fn new(name: impl Into<String>, instance: u64) -> Self {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: name.into(),
            instance,
            transports: vec![],
            buffers: vec![],
        }
    }

    /// Checks every invariant a peer relies on. Called on every descriptor read from outside.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidDescriptor(m));
        if self.version != DESCRIPTOR_VERSION {
            return bad(format!(
                "version {} (this build reads {DESCRIPTOR_VERSION})",
                self.version
            ));
        }
        if self.name.is_empty() || self.name.len() > MAX_NAME_LEN {
            return bad(format!("name length {} (must be 1..={MAX_NAME_LEN})", self.name.len()));
        }
        if self.transports.len() > MAX_TRANSPORTS {
            return bad(format!("{} transports (max {MAX_TRANSPORTS})", self.transports.len()));
        }
        for (i, t) in self.transports.iter().enumerate() {
            if t.transport.is_empty() || self.transports[..i].iter().any(|o| o.transport == t.transport) {
                return bad(format!(
                    "transport entry {i} ({:?}) is empty or duplicated",
                    t.transport
                ));
            }
        }
        if self.buffers.len() > MAX_BUFFERS {
            return bad(format!("{} buffers (max {MAX_BUFFERS})", self.buffers.len()));
        }
        let mut prev_end = 0u64;
        for (i, b) in self.buffers.iter().enumerate() {
            if b.len == 0 {
                return bad(format!("buffer {i} has zero length"));
            }
            let Some(end) = b.base.checked_add(b.len) else {
                return bad(format!("buffer {i} [{:#x}, +{}) overflows", b.base, b.len));
            };
            if i > 0 && b.base < prev_end {
                return bad(format!(
                    "buffer {i} at {:#x} is unsorted or overlaps the previous one",
                    b.base
                ));
            }
            prev_end = end;
        }
        Ok(())
    }

    /// Serializes to JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("descriptor serialization cannot fail")
    }

    /// Parses and validates a descriptor received from outside.
    pub fn from_json(text: &[u8]) -> Result<Self> {
        let d: SegmentDescriptor =
            serde_json::from_slice(text).map_err(|e| Error::InvalidDescriptor(format!("malformed JSON: {e}")))?;
        d.validate()?;
        Ok(d)
    }

    /// The index of the exported buffer holding all of `[addr, addr + len)`, by binary search.
    pub fn find_buffer(&self, addr: u64, len: u64) -> Result<usize> {
        let idx = self.buffers.partition_point(|b| b.base <= addr);
        if idx > 0 && self.buffers[idx - 1].contains(addr, len) {
            return Ok(idx - 1);
        }
        if addr.checked_add(len).is_none() {
            return Err(Error::LengthOverflow { addr, len });
        }
        Err(Error::OutOfBounds {
            segment: self.name.clone(),
            addr,
            len,
        })
    }

    /// The endpoint info of `transport`, if the segment advertises it.
    pub fn endpoint(&self, transport: &str) -> Option<&serde_json::Value> {
        self.transports
            .iter()
            .find(|t| t.transport == transport)
            .map(|t| &t.info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc() -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new("seg", 7);
        d.transports.push(TransportEndpoint {
            transport: "tcp".into(),
            info: serde_json::json!({"addr": "127.0.0.1:1"}),
        });
        for base in [0x1000u64, 0x3000] {
            d.buffers.push(ExportedBuffer {
                base,
                len: 0x1000,
                location: MemoryLocation::HOST,
                keys: Default::default(),
            });
        }
        d
    }

    #[test]
    fn round_trips_and_validates() {
        let d = desc();
        assert_eq!(SegmentDescriptor::from_json(d.to_json().as_bytes()).unwrap(), d);
    }

    #[test]
    fn finds_buffers_and_rejects_outside() {
        let d = desc();
        assert_eq!(d.find_buffer(0x1000, 0x1000).unwrap(), 0);
        assert_eq!(d.find_buffer(0x3fff, 1).unwrap(), 1);
        assert!(matches!(d.find_buffer(0x1fff, 2), Err(Error::OutOfBounds { .. })));
        assert!(matches!(d.find_buffer(0x2000, 1), Err(Error::OutOfBounds { .. })));
        assert!(matches!(d.find_buffer(0x0, 1), Err(Error::OutOfBounds { .. })));
        assert!(matches!(d.find_buffer(u64::MAX, 2), Err(Error::LengthOverflow { .. })));
    }

    #[test]
    fn hostile_descriptors_are_errors() {
        let mut d = desc();
        d.buffers[1].base = 0x1800;
        assert!(d.validate().is_err());
        let mut d = desc();
        d.buffers[0].len = 0;
        assert!(d.validate().is_err());
        let mut d = desc();
        d.buffers[1].base = u64::MAX;
        assert!(d.validate().is_err());
        let mut d = desc();
        d.version = 99;
        assert!(d.validate().is_err());
        let mut d = desc();
        d.transports.push(d.transports[0].clone());
        assert!(d.validate().is_err());
        assert!(SegmentDescriptor::from_json(b"{not json").is_err());
        assert!(SegmentDescriptor::from_json(b"{\"version\":1}").is_err());
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        // Nesting in the free-form parts (endpoint info, buffer keys) and where a struct is due.
        for (head, open) in [
            (
                r#"{"version":1,"name":"x","instance":1,"transports":[{"transport":"t","info":"#,
                b'[',
            ),
            (
                r#"{"version":1,"name":"x","instance":1,"transports":[],"buffers":[{"base":0,"len":1,"location":{"kind":"host","numa":null},"keys":{"k":"#,
                b'{',
            ),
            (r#"{"version":1,"name":"#, b'['),
        ] {
            let mut text = head.as_bytes().to_vec();
            text.resize(text.len() + 100_000, open);
            let e = SegmentDescriptor::from_json(&text).unwrap_err();
            assert!(matches!(e, Error::InvalidDescriptor(_)), "{e}");
        }
    }

    mod fuzz {
        use super::super::*;
        use proptest::prelude::*;

        /// Arbitrary JSON (no floats: they need not survive a round trip bit for bit).
        fn json() -> impl Strategy<Value = serde_json::Value> {
            let leaf = prop_oneof![
                Just(serde_json::Value::Null),
                any::<bool>().prop_map(serde_json::Value::from),
                any::<i64>().prop_map(serde_json::Value::from),
                any::<u64>().prop_map(serde_json::Value::from),
                "\\PC{0,12}".prop_map(serde_json::Value::from),
            ];
            leaf.prop_recursive(4, 32, 6, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                    proptest::collection::btree_map("\\PC{0,8}", inner, 0..6)
                        .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
                ]
            })
        }

        fn location() -> impl Strategy<Value = MemoryLocation> {
            prop_oneof![
                proptest::option::of(any::<u32>()).prop_map(|numa| MemoryLocation::Host { numa }),
                any::<u32>().prop_map(|device| MemoryLocation::Cuda { device }),
                any::<u32>().prop_map(|device| MemoryLocation::Rocm { device }),
            ]
        }

        /// Valid descriptors: unique transports, sorted non-overlapping non-empty buffers.
        fn descriptor() -> impl Strategy<Value = SegmentDescriptor> {
            let transports = proptest::collection::btree_map("[a-z]{1,8}", json(), 0..4);
            let buffers = proptest::collection::vec(
                (
                    0u64..1 << 20,
                    1u64..1 << 20,
                    location(),
                    proptest::collection::btree_map("[a-z]{1,5}", json(), 0..3),
                ),
                0..8,
            );
            ("\\PC{1,40}", any::<u64>(), transports, buffers).prop_map(|(name, instance, transports, buffers)| {
                let mut d = SegmentDescriptor::new(name, instance);
                d.transports = transports
                    .into_iter()
                    .map(|(transport, info)| TransportEndpoint { transport, info })
                    .collect();
                let mut next = 0u64;
                for (gap, len, location, keys) in buffers {
                    let base = next + gap;
                    d.buffers.push(ExportedBuffer {
                        base,
                        len,
                        location,
                        keys,
                    });
                    next = base + len;
                }
                d
            })
        }

        proptest! {
            #[test]
            fn arbitrary_bytes_are_errors_not_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
                let _ = SegmentDescriptor::from_json(&bytes);
            }

            #[test]
            fn arbitrary_json_is_an_error_or_a_valid_descriptor(v in json()) {
                if let Ok(d) = SegmentDescriptor::from_json(&serde_json::to_vec(&v).unwrap()) {
                    prop_assert!(d.validate().is_ok());
                }
            }

            #[test]
            fn valid_descriptors_round_trip(d in descriptor()) {
                prop_assert!(d.validate().is_ok());
                let text = d.to_json();
                prop_assert_eq!(SegmentDescriptor::from_json(text.as_bytes()).unwrap(), d);
            }

            /// A valid descriptor with any one byte changed, cut short or with a field replaced by
            /// arbitrary JSON is an error or a valid descriptor, never a panic.
            #[test]
            fn damaged_descriptors_are_errors_or_valid(
                d in descriptor(),
                at in any::<prop::sample::Index>(),
                byte in any::<u8>(),
                field in prop_oneof![Just("version"), Just("name"), Just("instance"), Just("transports"), Just("buffers")],
                junk in json(),
            ) {
                let text = d.to_json().into_bytes();
                let i = at.index(text.len());
                let mut flipped = text.clone();
                flipped[i] = byte;
                for bytes in [&flipped[..], &text[..i]] {
                    if let Ok(d) = SegmentDescriptor::from_json(bytes) {
                        prop_assert!(d.validate().is_ok());
                    }
                }
                let mut v = serde_json::to_value(&d).unwrap();
                v[field] = junk;
                if let Ok(d) = SegmentDescriptor::from_json(&serde_json::to_vec(&v).unwrap()) {
                    prop_assert!(d.validate().is_ok());
                }
            }
        }
    }
}
