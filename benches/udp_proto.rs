//! The sans-IO UDP protocol alone: 1 MiB messages through a simulated link
//! (virtual time), lossless and with 1% loss each way. Measures the CPU
//! cost of the protocol (chunking, CRC, reassembly, ACK handling).

use async_btl::udp::proto::{bench_transfer, Config};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn proto(c: &mut Criterion) {
    let mut g = c.benchmark_group("udp_proto_1MiB");
    const N: usize = 8;
    g.throughput(Throughput::Bytes((N << 20) as u64));
    g.sample_size(10);
    for (name, cfg) in [
        ("dgram1472", Config::default()),
        (
            "dgram65507",
            Config {
                max_datagram: 65_507,
                send_budget: 16 << 20,
                ..Config::default()
            },
        ),
    ] {
        for loss in [0.0, 0.01] {
            g.bench_function(format!("{name}/loss{}", loss * 100.0), |b| {
                b.iter(|| bench_transfer(7, cfg.clone(), loss, N, 1 << 20))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, proto);
criterion_main!(benches);
