//! Micro-benchmarks of the pieces on every message's path: the FIFO ring
//! push/pop, the `sm` fragment header and the `udp` datagram header (with
//! its CRC32C) encode/decode.

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

fn udp_header(c: &mut Criterion) {
    use async_btl::udp::proto::{decode, Chunk, Flags, Header, Kind};
    let h = Header {
        job: 0x1234_5678,
        src: 1,
        dst: 2,
        flags: Flags::NONE,
        seq: 1 << 40,
        ack: (1 << 40) - 7,
        kind: Kind::Data(Chunk {
            msg_id: 9,
            offset: 0,
            total_len: 1400,
        }),
    };
    let payload = vec![7u8; 1400];
    let mut g = c.benchmark_group("udp_datagram_header");
    g.throughput(Throughput::Bytes(payload.len() as u64));
    let mut out = Vec::with_capacity(1500);
    g.bench_function("encode 1400 B", |b| {
        b.iter(|| {
            out.clear();
            black_box(&h).encode(black_box(&payload), &mut out);
        })
    });
    out.clear();
    h.encode(&payload, &mut out);
    g.bench_function("decode 1400 B", |b| {
        b.iter(|| decode(black_box(&out)).is_ok())
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    targets = fifo, frag_header, udp_header
}
criterion_main!(benches);
