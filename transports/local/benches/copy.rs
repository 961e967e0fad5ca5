//! Copy kernels: streaming stores (every kernel this CPU supports) against `std` copy
//! (`ptr::copy_nonoverlapping`, glibc `memcpy`), at the seed's fragment sizes.
//!
//! `cold`: each copy goes to the next slot of a 256 MiB destination, so destinations are not in
//! cache (the restore case streaming stores are for). `hot`: the same small buffers every time.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use te_transport_local::copy::{store_fence, NtKernel};

mod common;
use common::buffer;

const COLD_BYTES: usize = 256 << 20;

fn bench_copy(c: &mut Criterion) {
    let src = buffer(COLD_BYTES);
    let dst = buffer(COLD_BYTES);
    let mut kernels: Vec<(String, Option<NtKernel>)> = vec![("std".into(), None)];
    kernels.extend(
        NtKernel::supported()
            .into_iter()
            .filter(|k| *k != NtKernel::portable())
            .map(|k| (format!("nt-{}", k.name()), Some(k))),
    );
    for temperature in ["cold", "hot"] {
        let mut group = c.benchmark_group(format!("copy-{temperature}"));
        for size in [1728usize, 8448, 37_440, 1 << 20] {
            group.throughput(Throughput::Bytes(size as u64));
            for (name, kernel) in &kernels {
                let stride = size.next_multiple_of(4096) + 64;
                let slots = if temperature == "cold" { COLD_BYTES / stride } else { 1 };
                let mut slot = 0usize;
                group.bench_with_input(BenchmarkId::new(name, size), &size, |b, &size| {
                    b.iter(|| {
                        slot = (slot + 1) % slots;
                        let off = slot * stride;
                        // SAFETY: `off + size` stays inside both buffers, which are distinct.
                        unsafe {
                            let (d, s) = (dst.as_ptr().add(off), src.as_ptr().add(off));
                            match kernel {
                                Some(k) => {
                                    k.copy(d, s, size);
                                    store_fence();
                                }
                                None => std::ptr::copy_nonoverlapping(s, d, size),
                            }
                        }
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = common::quick();
    targets = bench_copy
}
criterion_main!(benches);
