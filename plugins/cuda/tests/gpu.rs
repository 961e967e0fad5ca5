//! Tests on a real GPU. Without one they print why and pass, unless `TE_REQUIRE` names `cuda`,
//! in which case a missing GPU is a failure (scripts/gpu-check.sh sets it).

use std::collections::HashSet;
use std::sync::Arc;

use te_base::device::{CopyDirection, CopyFragment, DeviceBuffer, DevicePlugin, PointerKind};
use te_base::{Error, MemoryLocation};
use te_plugin_cuda::CudaPlugin;

/// The KV-cache fragment sizes the local copy is measured with (DeepSeek-V4-Pro pools).
const FRAGMENT_SIZES: [u64; 3] = [1_728, 8_448, 37_440];

fn required() -> bool {
    std::env::var("TE_REQUIRE").is_ok_and(|v| v.split(',').any(|s| s.trim() == "cuda"))
}

/// The shared plugin, or None (after printing why) when this host has no usable GPU.
fn gpu() -> Option<(Arc<CudaPlugin>, Arc<dyn DevicePlugin>)> {
    match te_plugin_cuda::load_cuda() {
        Ok(p) => {
            let dynamic: Arc<dyn DevicePlugin> = p.clone();
            Some((p, dynamic))
        }
        Err(e) if required() => panic!("TE_REQUIRE names cuda, but {e}"),
        Err(e) => {
            println!("skipping GPU test: {e}");
            None
        }
    }
}

/// Byte `i` of pattern `seed`: position-dependent, so a shifted or misplaced copy is caught.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(131) ^ (i >> 9) ^ seed.wrapping_mul(0x9e37)) as u8)
        .collect()
}

fn addr(v: &[u8]) -> u64 {
    v.as_ptr() as u64
}

fn addr_mut(v: &mut [u8]) -> u64 {
    v.as_mut_ptr() as u64
}

#[test]
fn bus_ids_are_distinct_and_exist_in_sysfs() {
    let Some((_, cuda)) = gpu() else { return };
    let count = cuda.device_count();
    assert!(count > 0);
    let mut seen = HashSet::new();
    for device in 0..count {
        let id = cuda.pci_bus_id(device).unwrap();
        println!("cuda:{device} at {id}");
        assert!(
            std::path::Path::new("/sys/bus/pci/devices").join(&id).exists(),
            "cuda:{device} reports {id}, which sysfs does not have"
        );
        assert!(seen.insert(id.clone()), "two ordinals report {id}");
    }
    let err = cuda.pci_bus_id(count).unwrap_err();
    assert!(matches!(err, Error::NotAvailable { .. }), "{err:?}");
    println!("{}", cuda.info());
}

#[test]
fn synchronous_copies_round_trip_every_byte() {
    let Some((_, cuda)) = gpu() else { return };
    let len = (4 << 20) + 123;
    let src = pattern(1, len);
    let mut back = vec![0u8; len];
    let a = DeviceBuffer::allocate(&cuda, 0, len as u64).unwrap();
    let b = DeviceBuffer::allocate(&cuda, 0, len as u64).unwrap();
    assert_eq!(a.location(), MemoryLocation::Cuda { device: 0 });
    let whole = |dst, src| CopyFragment {
        dst,
        src,
        len: len as u64,
    };
    // SAFETY: host vectors and device buffers are live, `len` bytes long and do not overlap.
    unsafe {
        cuda.copy(0, CopyDirection::HostToDevice, whole(a.addr(), addr(&src)))
            .unwrap();
        cuda.copy(0, CopyDirection::DeviceToDevice, whole(b.addr(), a.addr()))
            .unwrap();
        cuda.copy(0, CopyDirection::DeviceToHost, whole(addr_mut(&mut back), b.addr()))
            .unwrap();
    }
    assert!(back == src, "bytes differ after host->device->device->host");

    // Unaligned offsets on both sides.
    let mut tail = vec![0u8; 1000];
    // SAFETY: [src+3, +1000) and [a+1, +1000) lie inside their buffers; `tail` has 1000 bytes.
    unsafe {
        let f = CopyFragment {
            dst: a.addr() + 1,
            src: addr(&src) + 3,
            len: 1000,
        };
        cuda.copy(0, CopyDirection::HostToDevice, f).unwrap();
        let f = CopyFragment {
            dst: addr_mut(&mut tail),
            src: a.addr() + 1,
            len: 1000,
        };
        cuda.copy(0, CopyDirection::DeviceToHost, f).unwrap();
    }
    assert_eq!(tail, src[3..1003]);
}

/// Scatters `n` fragments host->device (every other slot), gathers them device->device in reverse
/// order, copies back device->host, and checks every fragment.
fn fragment_round_trip(cuda: &Arc<dyn DevicePlugin>, frag: u64, n: u64) {
    let total = (frag * n) as usize;
    let src = pattern(frag, total);
    let mut back = vec![0u8; total];
    let scattered = DeviceBuffer::allocate(cuda, 0, 2 * frag * n).unwrap();
    let gathered = DeviceBuffer::allocate(cuda, 0, frag * n).unwrap();
    let h2d: Vec<CopyFragment> = (0..n)
        .map(|i| CopyFragment {
            dst: scattered.addr() + 2 * i * frag,
            src: addr(&src) + i * frag,
            len: frag,
        })
        .collect();
    let d2d: Vec<CopyFragment> = (0..n)
        .map(|i| CopyFragment {
            dst: gathered.addr() + (n - 1 - i) * frag,
            src: scattered.addr() + 2 * i * frag,
            len: frag,
        })
        .collect();
    let back_addr = addr_mut(&mut back);
    let d2h: Vec<CopyFragment> = (0..n)
        .map(|i| CopyFragment {
            dst: back_addr + i * frag,
            src: gathered.addr() + i * frag,
            len: frag,
        })
        .collect();
    // SAFETY: every fragment lies inside its live buffer, and each batch is waited for before the
    // next reads its output and before the buffers are dropped.
    unsafe {
        let p = cuda.copy_async(0, CopyDirection::HostToDevice, &h2d).unwrap();
        assert!(p.is_complete().is_ok());
        p.wait().unwrap();
        cuda.copy_async(0, CopyDirection::DeviceToDevice, &d2d)
            .unwrap()
            .wait()
            .unwrap();
        cuda.copy_async(0, CopyDirection::DeviceToHost, &d2h)
            .unwrap()
            .wait()
            .unwrap();
    }
    for i in 0..n as usize {
        let f = frag as usize;
        let got = &back[i * f..(i + 1) * f];
        let want = &src[(n as usize - 1 - i) * f..(n as usize - i) * f];
        assert!(got == want, "fragment {i} of {n} x {frag} B differs");
    }
}

#[test]
fn batched_copies_of_kv_fragments_are_byte_exact_with_and_without_the_batch_call() {
    let Some((plugin, cuda)) = gpu() else { return };
    let initial = plugin.batch_memcpy();
    let mut modes = vec![false];
    if plugin.set_batch_memcpy(true).is_ok() {
        modes.push(true);
    } else {
        println!("cuMemcpyBatchAsync not available: testing one call per fragment only");
    }
    for batched in modes {
        plugin.set_batch_memcpy(batched).unwrap();
        for frag in FRAGMENT_SIZES {
            for n in [1, 2, 257] {
                fragment_round_trip(&cuda, frag, n);
            }
        }
    }
    plugin.set_batch_memcpy(initial).unwrap();
}

#[test]
fn concurrent_batches_on_the_shared_stream_stay_separate() {
    let Some((_, cuda)) = gpu() else { return };
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let cuda = &cuda;
            s.spawn(move || {
                for _ in 0..10 {
                    fragment_round_trip(cuda, FRAGMENT_SIZES[(t % 3) as usize], 64 + t);
                }
            });
        }
    });
}

#[test]
fn pointers_are_classified_by_the_driver() {
    let Some((_, cuda)) = gpu() else { return };
    let host = vec![7u8; 4096];
    assert_eq!(cuda.classify(addr(&host)).unwrap(), PointerKind::Host);
    let stack = 5u64;
    assert_eq!(cuda.classify(&stack as *const u64 as u64).unwrap(), PointerKind::Host);
    assert!(matches!(cuda.classify(0), Err(Error::NullAddress)));
    for device in 0..cuda.device_count().min(2) {
        let buf = DeviceBuffer::allocate(&cuda, device, 1 << 20).unwrap();
        assert_eq!(cuda.classify(buf.addr()).unwrap(), PointerKind::Device { device });
        assert_eq!(
            cuda.classify(buf.addr() + 12345).unwrap(),
            PointerKind::Device { device }
        );
        assert_eq!(
            cuda.classify(buf.addr()).unwrap().location(cuda.memory_kind()).unwrap(),
            MemoryLocation::Cuda { device }
        );
    }
}

#[test]
fn bad_input_gets_typed_errors() {
    let Some((_, cuda)) = gpu() else { return };
    assert!(matches!(cuda.allocate(0, 0), Err(Error::ZeroLength { index: 0 })));
    assert!(matches!(
        cuda.allocate(cuda.device_count(), 64),
        Err(Error::NotAvailable { .. })
    ));
    let buf = DeviceBuffer::allocate(&cuda, 0, 4096).unwrap();
    let host = vec![1u8; 4096];
    let frags = [
        CopyFragment {
            dst: buf.addr(),
            src: addr(&host),
            len: 64,
        },
        CopyFragment {
            dst: buf.addr() + 64,
            src: addr(&host) + 64,
            len: 0,
        },
    ];
    // SAFETY: validation rejects the batch before anything is enqueued.
    let err = unsafe { cuda.copy_async(0, CopyDirection::HostToDevice, &frags) }
        .err()
        .unwrap();
    assert!(matches!(err, Error::ZeroLength { index: 1 }), "{err:?}");
    // An allocation larger than any GPU's memory is a driver error with the driver's text.
    let err = cuda.allocate(0, 1 << 50).unwrap_err();
    assert!(err.to_string().contains("cuMemAlloc"), "{err}");
}

#[test]
fn dropping_device_buffers_frees_them() {
    let Some((_, cuda)) = gpu() else { return };
    // 48 x 4 GiB is more than any current GPU holds: leaking would fail with out of memory.
    for _ in 0..48 {
        let buf = DeviceBuffer::allocate(&cuda, 0, 4 << 30).unwrap();
        assert!(buf.addr() != 0);
    }
}

#[test]
fn dmabuf_export_gives_a_descriptor_or_says_why_not() {
    let Some((_, cuda)) = gpu() else { return };
    let buf = DeviceBuffer::allocate(&cuda, 0, 4 << 20).unwrap();
    match cuda.export_dmabuf(0, buf.addr() + 100, 1 << 20) {
        Ok(export) => {
            use std::os::fd::AsRawFd;
            assert!(export.fd.as_raw_fd() >= 0);
            let start = buf.addr() + 100 - export.offset;
            assert_eq!(start % 4096, 0, "exported range must start page-aligned");
            assert!(start >= buf.addr() && export.offset < 65536);
            assert!(export.len >= export.offset + (1 << 20));
            println!("dma-buf exported: {} B at offset {}", export.len, export.offset);
        }
        Err(e @ Error::NotAvailable { .. }) => println!("dma-buf not offered here: {e}"),
        Err(e) => panic!("dma-buf export failed: {e}"),
    }
}
