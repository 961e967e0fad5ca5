//! Planning cost per batch: sort by destination, detect overlap, coalesce.
//!
//! Layouts: `in-order` (already sorted, adjacent: one copy), `scattered-sorted` (sorted, gaps: no
//! coalescing, no sort), `permuted` (te-bench local-copy's permuted destinations: a full sort).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use te_transport_local::plan::{coalesce, sources_meet_destinations, Fragment, PlanScratch};

mod common;

fn layout(n: usize, frag: u64, kind: &str) -> Vec<Fragment> {
    let stride = if kind == "in-order" { frag } else { frag + 64 };
    let mut mult = (n / 2 + 1) | 1;
    while n > 1 && gcd(mult, n) != 1 {
        mult += 2;
    }
    (0..n)
        .map(|i| {
            let slot = if kind == "permuted" { (i * mult) % n } else { i };
            Fragment {
                dst: (1 << 40) + slot as u64 * stride,
                src: (1 << 30) + i as u64 * stride,
                len: frag,
                index: i as u32,
            }
        })
        .collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn bench_plan(c: &mut Criterion) {
    let mut group = c.benchmark_group("coalesce");
    for kind in ["in-order", "scattered-sorted", "permuted"] {
        for n in [32usize, 2048, 10_000] {
            let frags = layout(n, 1728, kind);
            let mut ops = Vec::with_capacity(n);
            let mut scratch = PlanScratch::default();
            group.throughput(Throughput::Elements(n as u64));
            group.bench_with_input(BenchmarkId::new(kind, n), &n, |b, _| {
                b.iter(|| coalesce(&frags, &mut scratch, &mut ops).expect("no overlap"))
            });
        }
    }
    group.finish();

    let mut group = c.benchmark_group("overlap-sweep");
    for n in [32usize, 2048, 10_000] {
        let frags = layout(n, 1728, "permuted");
        let mut ops = Vec::new();
        let mut scratch = PlanScratch::default();
        coalesce(&frags, &mut scratch, &mut ops).expect("no overlap");
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| sources_meet_destinations(&ops, &mut scratch))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::quick();
    targets = bench_plan
}
criterion_main!(benches);
