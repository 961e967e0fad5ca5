//! What `Store::get` pays for not stalling the runtime: a µs-scale local DRAM get from a task on
//! a multi-thread runtime's worker, with the blocking batch call run inline (how `get` ran before)
//! against the same call inside `block_in_place` (how `off_worker` runs it now), in one run, and
//! the whole `Store::get` beside them.
//!
//! `cargo bench -p umbp --bench async_get`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use umbp::{Range, RangedGet, Store};

const LEN: usize = 8448; // one page of the middle KV pool (docs/PERFORMANCE.md)

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = std::sync::Arc::new(
        rt.block_on(Store::builder().dram_capacity(64 << 20).ssd_dirs(vec![]).open())
            .unwrap(),
    );
    let page: Vec<u8> = (0..LEN).map(|i| i as u8).collect();
    rt.block_on(store.put("page", &page, 0)).unwrap();
    let mut dst = vec![0u8; LEN];
    let dst_addr = dst.as_mut_ptr() as u64;
    // SAFETY: `dst` outlives the registration (the store is closed before it is dropped).
    rt.block_on(unsafe { store.register_buffer(dst_addr, LEN as u64) })
        .unwrap();

    let get_into = move |s: &Store| {
        let ranges = [Range::new(0, LEN as u64, dst_addr)];
        let got = s.batch_get_ranges(&[RangedGet {
            key: "page",
            ranges: &ranges,
        }]);
        assert_eq!(got.unwrap()[0].as_ref().copied().unwrap(), LEN as u64);
    };
    let mut g = c.benchmark_group("umbp_get_from_a_worker");
    g.sample_size(30)
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    for variant in ["inline", "block_in_place", "Store::get"] {
        g.bench_function(BenchmarkId::new(variant, LEN), |b| {
            b.iter_custom(|iters| {
                let s = store.clone();
                rt.block_on(async move {
                    tokio::spawn(async move {
                        let t = std::time::Instant::now();
                        for _ in 0..iters {
                            match variant {
                                "inline" => get_into(&s),
                                "block_in_place" => tokio::task::block_in_place(|| get_into(&s)),
                                _ => assert_eq!(s.get("page").await.unwrap().len(), LEN),
                            }
                        }
                        t.elapsed()
                    })
                    .await
                    .unwrap()
                })
            })
        });
    }
    g.finish();
    rt.block_on(store.close()).unwrap();
    drop(dst);
}

criterion_group!(benches, bench);
criterion_main!(benches);
