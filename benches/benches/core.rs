//! Nanoseconds per decision of the core maths ([`tollgate_core::algorithm::apply`]) for each
//! algorithm: one hot state, commit, the clock advancing between calls as in steady traffic.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tollgate_core::algorithm::{self, Record};
use tollgate_core::{Policy, Rate};

/// Redis `TIME` in 2023, so timestamps have realistic magnitude.
const START: u64 = 1_700_000_000_000_000;

/// Benches `policy` with cost 1, the clock moving `step` µs per call; the state is warmed up
/// first so every measured call finds it hot.
fn bench_policy(c: &mut Criterion, name: &str, policy: &Policy, step: u64) {
    let mut group = c.benchmark_group("core");
    group.throughput(Throughput::Elements(1));
    group.bench_function(name, |b| {
        let mut state: Option<Record> = None;
        let mut now = START;
        for _ in 0..10_000 {
            now += step;
            algorithm::apply(&mut state, policy, now, 1, true).unwrap();
        }
        b.iter(|| {
            now += step;
            let out = algorithm::apply(&mut state, black_box(policy), black_box(now), 1, true);
            black_box(out.unwrap().decision.allowed)
        });
    });
    group.finish();
}

fn core(c: &mut Criterion) {
    let tb = Policy::token_bucket(1_000_000, Rate::per_second(1_000_000)).unwrap();
    bench_policy(c, "token_bucket", &tb, 1);
    let odd = Policy::token_bucket(100, Rate::new(7, Duration::from_secs(3))).unwrap();
    bench_policy(c, "token_bucket_7_per_3s_denying", &odd, 1);
    let fw = Policy::fixed_window(1_000_000, Duration::from_secs(1)).unwrap();
    bench_policy(c, "fixed_window", &fw, 1);
    // Steady state of a sliding log: one entry per call, `limit` entries live, so each call
    // walks the whole log (its bounded worst case).
    let sl10 = Policy::sliding_log(10, Duration::from_millis(10)).unwrap();
    bench_policy(c, "sliding_log_10_entries", &sl10, 1_000);
    let sl1000 = Policy::sliding_log(1_000, Duration::from_secs(1)).unwrap();
    bench_policy(c, "sliding_log_1000_entries", &sl1000, 1_000);
}

criterion_group!(benches, core);
criterion_main!(benches);
