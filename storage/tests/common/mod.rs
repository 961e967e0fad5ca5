//! Helpers shared by the store's integration tests.

#![allow(dead_code)]

use std::path::Path;

use umbp::{Range, RangedGet, RangedPut, Store, StoreBuilder};

fn seed(key: &str, version: u32) -> u32 {
    key.bytes()
        .fold(version.wrapping_mul(0x9E37_79B9), |h, b| h.rotate_left(5) ^ b as u32)
}

fn byte_with(seed: u32, offset: u64) -> u8 {
    (seed as u64)
        .wrapping_add(offset.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40)
        .wrapping_add(offset) as u8
}

/// The byte at `offset` of object `key`, version `version`: position-dependent.
pub fn byte(key: &str, version: u32, offset: u64) -> u8 {
    byte_with(seed(key, version), offset)
}

/// The whole object.
pub fn object(key: &str, version: u32, len: u64) -> Vec<u8> {
    let s = seed(key, version);
    (0..len).map(|o| byte_with(s, o)).collect()
}

/// A buffer registered with a store for the test's life.
pub struct Buf {
    pub data: Vec<u8>,
}

impl Buf {
    pub async fn new(store: &Store, len: usize) -> Buf {
        let mut data = vec![0u8; len];
        // SAFETY: the vector is never reallocated and is dropped only after deregistration (tests
        // call `release`) or after the store is closed.
        unsafe { store.register_buffer(data.as_mut_ptr() as u64, len as u64) }
            .await
            .unwrap();
        Buf { data }
    }

    pub fn addr(&self) -> u64 {
        self.data.as_ptr() as u64
    }

    pub async fn release(self, store: &Store) {
        assert!(store.deregister_buffer(self.addr()).await.unwrap());
    }
}

pub fn dram_only(capacity: u64) -> StoreBuilder {
    Store::builder().dram_capacity(capacity).ssd_dirs(vec![])
}

pub fn with_ssd(dram: u64, dir: &Path) -> StoreBuilder {
    Store::builder()
        .dram_capacity(dram)
        .ssd_dirs(vec![dir.to_path_buf()])
        .ssd_capacity(256 << 20)
        .ssd_segment_bytes(8 << 20)
        .staging_bytes(4 << 20)
        .staging_slots(2)
}

/// Puts `key` (version `version`, `layers` layers of `layer` bytes) from `buf`, laid out whole at
/// its start, as one range per layer.
pub fn put_layers(
    store: &Store,
    buf: &mut Buf,
    key: &str,
    version: u32,
    layers: u64,
    layer: u64,
    depth: u32,
) -> umbp::Result<()> {
    let len = layers * layer;
    buf.data[..len as usize].copy_from_slice(&object(key, version, len));
    let ranges: Vec<Range> = (0..layers)
        .map(|l| Range::new(l * layer, layer, buf.addr() + l * layer))
        .collect();
    store
        .batch_put_ranges(&[RangedPut {
            key,
            object_len: len,
            ranges: &ranges,
            depth,
        }])?
        .remove(0)
}

/// Reads layers `first..first + count` of `key` into `buf` (layer by layer at the start) and
/// checks them against version `version`. Returns the per-key result.
pub fn get_layers(
    store: &Store,
    buf: &mut Buf,
    key: &str,
    version: u32,
    first: u64,
    count: u64,
    layer: u64,
) -> umbp::Result<u64> {
    buf.data[..(count * layer) as usize].fill(0);
    let ranges: Vec<Range> = (0..count)
        .map(|i| Range::new((first + i) * layer, layer, buf.addr() + i * layer))
        .collect();
    let got = store
        .batch_get_ranges(&[RangedGet { key, ranges: &ranges }])?
        .remove(0)?;
    let want = object(key, version, (first + count) * layer);
    let want = &want[(first * layer) as usize..];
    let data = &buf.data[..(count * layer) as usize];
    if data != want {
        let at = data.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0) as u64;
        panic!("{key} layer {} byte {}: wrong", first + at / layer, at % layer);
    }
    Ok(got)
}
