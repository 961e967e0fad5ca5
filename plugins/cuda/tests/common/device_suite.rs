//! Checks every device plugin must pass on a real GPU, written against `&Arc<dyn DevicePlugin>`.
//! Used by the CUDA plugin's `tests/gpu.rs` and (through `#[path]`) by the HIP plugin's.

#![allow(dead_code)]

use std::collections::HashSet;
use std::sync::Arc;

use te_base::device::{CopyDirection, CopyFragment, DeviceBuffer, DevicePlugin, PointerKind};
use te_base::Error;

/// The KV-cache fragment sizes the local copy is measured with (DeepSeek-V4-Pro pools).
pub const FRAGMENT_SIZES: [u64; 3] = [1_728, 8_448, 37_440];

/// True if `TE_REQUIRE` (a comma list) names any of `names`.
pub fn required(names: &[&str]) -> bool {
    std::env::var("TE_REQUIRE").is_ok_and(|v| v.split(',').any(|s| names.contains(&s.trim())))
}

/// The plugin, or None after printing why it is unusable; panics instead when `TE_REQUIRE` names
/// it (`require_names`).
pub fn plugin_or_skip<P>(loaded: te_base::Result<P>, require_names: &[&str]) -> Option<P> {
    match loaded {
        Ok(p) => Some(p),
        Err(e) if required(require_names) => panic!("TE_REQUIRE names {require_names:?}, but {e}"),
        Err(e) => {
            println!("skipping GPU test: {e}");
            None
        }
    }
}

pub use te_base::pattern::pattern_bytes;

fn addr(v: &[u8]) -> u64 {
    v.as_ptr() as u64
}

fn addr_mut(v: &mut [u8]) -> u64 {
    v.as_mut_ptr() as u64
}

/// Every ordinal has a distinct PCI address that sysfs knows (as the topology code will look it up).
pub fn bus_ids_are_distinct_and_exist_in_sysfs(gpu: &Arc<dyn DevicePlugin>) {
    let count = gpu.device_count();
    assert!(count > 0);
    // Sandboxed hosts (gVisor) show no PCI devices in sysfs; the ids are then checked for form only.
    let sysfs = std::path::Path::new("/sys/bus/pci/devices");
    let sysfs_has_pci = std::fs::read_dir(sysfs).is_ok_and(|mut d| d.next().is_some());
    if !sysfs_has_pci {
        println!(
            "{} has no PCI devices here: checking the ids' form only",
            sysfs.display()
        );
    }
    let mut seen = HashSet::new();
    for device in 0..count {
        let id = gpu.pci_bus_id(device).unwrap();
        println!("{}:{device} at {id}", gpu.name());
        assert_eq!(te_base::device::normalize_pci_bus_id("test", &id).unwrap(), id);
        assert!(
            !sysfs_has_pci || sysfs.join(&id).exists(),
            "{}:{device} reports {id}, which sysfs does not have",
            gpu.name()
        );
        assert!(seen.insert(id.clone()), "two ordinals report {id}");
    }
    let err = gpu.pci_bus_id(count).unwrap_err();
    assert!(matches!(err, Error::NotAvailable { .. }), "{err:?}");
    println!("{}", gpu.info());
}

/// host -> device -> device -> host of 4 MiB + 123 B, and an unaligned pair of copies.
pub fn synchronous_copies_round_trip_every_byte(gpu: &Arc<dyn DevicePlugin>) {
    let len = (4 << 20) + 123;
    let src = pattern_bytes(1, 0, len);
    let mut back = vec![0u8; len];
    let a = DeviceBuffer::allocate(gpu, 0, len as u64).unwrap();
    let b = DeviceBuffer::allocate(gpu, 0, len as u64).unwrap();
    assert!(!a.location().is_host());
    let whole = |dst, src| CopyFragment {
        dst,
        src,
        len: len as u64,
    };
    // SAFETY: host vectors and device buffers are live, `len` bytes long and do not overlap.
    unsafe {
        gpu.copy(0, CopyDirection::HostToDevice, whole(a.addr(), addr(&src)))
            .unwrap();
        gpu.copy(0, CopyDirection::DeviceToDevice, whole(b.addr(), a.addr()))
            .unwrap();
        gpu.copy(0, CopyDirection::DeviceToHost, whole(addr_mut(&mut back), b.addr()))
            .unwrap();
    }
    assert!(back == src, "bytes differ after host->device->device->host");

    let mut tail = vec![0u8; 1000];
    // SAFETY: [src+3, +1000) and [a+1, +1000) lie inside their buffers; `tail` has 1000 bytes.
    unsafe {
        let f = CopyFragment {
            dst: a.addr() + 1,
            src: addr(&src) + 3,
            len: 1000,
        };
        gpu.copy(0, CopyDirection::HostToDevice, f).unwrap();
        let f = CopyFragment {
            dst: addr_mut(&mut tail),
            src: a.addr() + 1,
            len: 1000,
        };
        gpu.copy(0, CopyDirection::DeviceToHost, f).unwrap();
    }
    assert_eq!(tail, src[3..1003]);
}

/// Scatters `n` fragments host->device (every other slot), gathers them device->device in reverse
/// order, copies them back device->host in one batch each, and checks every fragment.
pub fn fragment_round_trip(gpu: &Arc<dyn DevicePlugin>, frag: u64, n: u64) {
    let total = (frag * n) as usize;
    let src = pattern_bytes(frag ^ n, 0, total);
    let mut back = vec![0u8; total];
    let scattered = DeviceBuffer::allocate(gpu, 0, 2 * frag * n).unwrap();
    let gathered = DeviceBuffer::allocate(gpu, 0, frag * n).unwrap();
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
        let p = gpu.copy_async(0, CopyDirection::HostToDevice, &h2d).unwrap();
        assert!(p.is_complete().is_ok());
        p.wait().unwrap();
        gpu.copy_async(0, CopyDirection::DeviceToDevice, &d2d)
            .unwrap()
            .wait()
            .unwrap();
        gpu.copy_async(0, CopyDirection::DeviceToHost, &d2h)
            .unwrap()
            .wait()
            .unwrap();
    }
    let f = frag as usize;
    let n = n as usize;
    for i in 0..n {
        let got = &back[i * f..(i + 1) * f];
        let want = &src[(n - 1 - i) * f..(n - i) * f];
        assert!(got == want, "fragment {i} of {n} x {frag} B differs");
    }
}

/// The three KV fragment sizes, batches of 1, 2 and 257 fragments.
pub fn kv_fragment_batches_are_byte_exact(gpu: &Arc<dyn DevicePlugin>) {
    for frag in FRAGMENT_SIZES {
        for n in [1, 2, 257] {
            fragment_round_trip(gpu, frag, n);
        }
    }
}

/// Four threads submitting batches on the shared per-device stream at once.
pub fn concurrent_batches_stay_separate(gpu: &Arc<dyn DevicePlugin>) {
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || {
                for _ in 0..10 {
                    fragment_round_trip(gpu, FRAGMENT_SIZES[(t % 3) as usize], 64 + t);
                }
            });
        }
    });
}

/// Host, stack, null and device pointers (on up to two devices, at offsets) are told apart.
pub fn pointers_are_classified(gpu: &Arc<dyn DevicePlugin>) {
    let host = vec![7u8; 4096];
    assert_eq!(gpu.classify(addr(&host)).unwrap(), PointerKind::Host);
    let stack = 5u64;
    assert_eq!(gpu.classify(&stack as *const u64 as u64).unwrap(), PointerKind::Host);
    assert!(matches!(gpu.classify(0), Err(Error::NullAddress)));
    for device in 0..gpu.device_count().min(2) {
        let buf = DeviceBuffer::allocate(gpu, device, 1 << 20).unwrap();
        assert_eq!(gpu.classify(buf.addr()).unwrap(), PointerKind::Device { device });
        assert_eq!(
            gpu.classify(buf.addr() + 12345).unwrap(),
            PointerKind::Device { device }
        );
        assert_eq!(
            gpu.classify(buf.addr()).unwrap().location(gpu.memory_kind()).unwrap(),
            buf.location()
        );
    }
}

/// Zero lengths, bad ordinals, a bad fragment in a batch and impossible allocations are typed
/// errors; `alloc_call` is the driver function named in the out-of-memory error.
pub fn bad_input_gets_typed_errors(gpu: &Arc<dyn DevicePlugin>, alloc_call: &str) {
    assert!(matches!(gpu.allocate(0, 0), Err(Error::ZeroLength { index: 0 })));
    assert!(matches!(
        gpu.allocate(gpu.device_count(), 64),
        Err(Error::NotAvailable { .. })
    ));
    let buf = DeviceBuffer::allocate(gpu, 0, 4096).unwrap();
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
    let err = unsafe { gpu.copy_async(0, CopyDirection::HostToDevice, &frags) }
        .err()
        .unwrap();
    assert!(matches!(err, Error::ZeroLength { index: 1 }), "{err:?}");
    let err = gpu.allocate(0, 1 << 50).unwrap_err();
    assert!(err.to_string().contains(alloc_call), "{err}");
}

/// 48 x 4 GiB is more than any current GPU holds: leaking would fail with out of memory.
pub fn dropping_device_buffers_frees_them(gpu: &Arc<dyn DevicePlugin>) {
    for _ in 0..48 {
        let buf = DeviceBuffer::allocate(gpu, 0, 4 << 30).unwrap();
        assert!(buf.addr() != 0);
    }
}

/// A dma-buf fd covering the page-aligned range, or NotAvailable saying why; any other error fails.
pub fn dmabuf_export_gives_a_descriptor_or_says_why_not(gpu: &Arc<dyn DevicePlugin>) {
    let buf = DeviceBuffer::allocate(gpu, 0, 4 << 20).unwrap();
    match gpu.export_dmabuf(0, buf.addr() + 100, 1 << 20) {
        Ok(export) => {
            use std::os::fd::AsRawFd;
            assert!(export.fd.as_raw_fd() >= 0);
            let start = buf.addr() + 100 - export.offset;
            assert_eq!(start % 4096, 0, "exported range must start page-aligned");
            assert!(export.offset < 65536);
            assert!(export.len >= export.offset + (1 << 20));
            println!("dma-buf exported: {} B at offset {}", export.len, export.offset);
        }
        Err(e @ Error::NotAvailable { .. }) => println!("dma-buf not offered here: {e}"),
        Err(e) => panic!("dma-buf export failed: {e}"),
    }
}
