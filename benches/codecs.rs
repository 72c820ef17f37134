//! Micro-benchmarks of the pieces on every message's path: the FIFO ring
//! push/pop and the `sm` fragment header encode/decode.
//!
//! The udp protocol's header and ACK codecs belong here too; whoever
//! integrates `udp` adds them (its sans-IO module exposes what it needs
//! through `bench_support` the same way).

use std::hint::black_box;
use std::time::Duration;

use async_btl::bench_support::{decode_frag_header, encode_frag_header, Fifo};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn fifo(c: &mut Criterion) {
    let mut g = c.benchmark_group("fifo");
    g.throughput(Throughput::Elements(1));
    let mut f = Fifo::new(1024);
    g.bench_function("push+pop", |b| {
        b.iter(|| {
            f.push(black_box(42));
            black_box(f.pop())
        })
    });
    let mut f = Fifo::new(1024);
    g.throughput(Throughput::Elements(64));
    g.bench_function("push64+pop64", |b| {
        b.iter(|| {
            for i in 0..64u64 {
                f.push(black_box(i));
            }
            for _ in 0..64 {
                black_box(f.pop());
            }
        })
    });
    g.finish();
}

fn frag_header(c: &mut Criterion) {
    let mut g = c.benchmark_group("sm_frag_header");
    g.throughput(Throughput::Elements(1));
    g.bench_function("encode", |b| {
        b.iter(|| encode_frag_header(black_box(1000), black_box(7)))
    });
    let h = encode_frag_header(1000, 7);
    g.bench_function("decode", |b| {
        b.iter(|| decode_frag_header(black_box(&h), black_box(4072)))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    targets = fifo, frag_header
}
criterion_main!(benches);
