//! `LocalStore` against governor's keyed limiter, in the same criterion run: one hot key and
//! 100,000 keys (pre-built, visited round-robin, and in a skewed order: `…keys_zipf`), on one
//! thread and on two threads sharing one limiter. Each group holds both limiters under the
//! same scenario, so ratios within a group are what count on a noisy machine.
//!
//! Policies are equivalent: a token bucket of capacity C refilled at R/s is governor's
//! `Quota::per_second(R).allow_burst(C)` (GCRA is the same algorithm). Both use their default
//! clock and hasher, as a user would: `MonotonicClock` (quanta-based) and foldhash for
//! `LocalStore`, quanta and SipHash for governor.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tollgate_core::{Key, Policy, Rate};
use tollgate_local::LocalStore;

/// A keyed limiter under test: one decision for `key`, true when admitted.
trait Limiter: Send + Sync + 'static {
    fn check(&self, key: &Key) -> bool;
}

struct Tollgate {
    store: LocalStore,
    policy: Policy,
}

impl Limiter for Tollgate {
    fn check(&self, key: &Key) -> bool {
        self.store
            .acquire_now(key, &self.policy, 1)
            .unwrap()
            .allowed
    }
}

struct Governor(DefaultKeyedRateLimiter<Key>);

impl Limiter for Governor {
    fn check(&self, key: &Key) -> bool {
        self.0.check_key(key).is_ok()
    }
}

/// One scenario's policy in both forms.
#[derive(Clone, Copy)]
struct Scenario {
    name: &'static str,
    capacity: u32,
    /// Refill: `tokens` every `period`.
    tokens: u32,
    period: Duration,
}

impl Scenario {
    fn tollgate(self) -> Tollgate {
        let rate = Rate::new(u64::from(self.tokens), self.period);
        let policy = Policy::token_bucket(u64::from(self.capacity), rate).unwrap();
        Tollgate {
            store: LocalStore::new(),
            policy,
        }
    }

    fn governor(self) -> Governor {
        let burst = NonZeroU32::new(self.capacity).unwrap();
        let quota = Quota::with_period(self.period / self.tokens)
            .unwrap()
            .allow_burst(burst);
        Governor(RateLimiter::keyed(quota))
    }
}

/// Generous: both admit everything, even a hot key (a token per nanosecond). A bucket is full
/// again right after a call, so `LocalStore` expires and sweeps idle keys between two visits of
/// 100,000 keys while governor keeps them.
const GENEROUS: Scenario = Scenario {
    name: "allow",
    capacity: 1_000_000,
    tokens: 1_000_000_000,
    period: Duration::from_secs(1),
};

/// Generous with slow refill: still all admitted, but no bucket is full (so none expires)
/// between two visits: the same resident work for both limiters with 100,000 keys.
const GENEROUS_SLOW: Scenario = Scenario {
    name: "allow_resident",
    capacity: 1_000_000,
    tokens: 1,
    period: Duration::from_secs(1),
};

/// The brief's equivalence: capacity 1M refilled at 1M/s, i.e.
/// `Quota::per_second(1_000_000).allow_burst(1_000_000)`. A hot key drains its burst within
/// the warm-up and then admits one call per microsecond refill: mostly denials.
const BRIEF: Scenario = Scenario {
    name: "1M_per_s",
    capacity: 1_000_000,
    tokens: 1_000_000,
    period: Duration::from_secs(1),
};

/// Mostly denying: one request an hour.
const DENYING: Scenario = Scenario {
    name: "deny",
    capacity: 1,
    tokens: 1,
    period: Duration::from_secs(3600),
};

fn keys(n: usize) -> Arc<Vec<Key>> {
    Arc::new(
        (0..n)
            .map(|i| Key::new("bench", [i.to_string()]).unwrap())
            .collect(),
    )
}

/// Zipf's law over `n` keys, as traffic is spread in practice: `visits` visits in a fixed
/// pseudo-random order where the key of rank `r` (1-based) is visited in proportion to
/// `1 / r^s`. With `s = 1` and 100,000 keys the hottest key takes ~8 % of visits and the 256
/// hottest ~50 %; half the visits are spread over the other 99,744 keys. Ranks are assigned to
/// keys by a fixed shuffle. The same `Key` values as `keys(n)` builds (one `Arc` per key, cloned
/// into every visit).
fn zipf_visits(n: usize, s: f64, visits: usize) -> Arc<Vec<Key>> {
    let keys = keys(n);
    // xorshift64*: a fixed stream, so every run and both limiters see the same order.
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut by_rank: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        by_rank.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    let mut cumulative = Vec::with_capacity(n);
    let mut total = 0.0;
    for r in 1..=n {
        total += 1.0 / (r as f64).powf(s);
        cumulative.push(total);
    }
    Arc::new(
        (0..visits)
            .map(|_| {
                let u = (next() >> 11) as f64 / (1u64 << 53) as f64 * total;
                let rank = cumulative.partition_point(|&c| c < u).min(n - 1);
                keys[by_rank[rank]].clone()
            })
            .collect(),
    )
}

/// Runs `limiter` over `keys` in order, cycling (round-robin over distinct keys), on `threads`
/// threads; criterion's time per iteration is wall time per decision (the threads' decisions
/// summed).
fn bench<L: Limiter>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    limiter: L,
    keys: &Arc<Vec<Key>>,
    threads: usize,
) {
    let limiter = Arc::new(limiter);
    let n = keys.len();
    // Touch every key once (every visit, for a Zipf order) so the measurement sees resident
    // state, not first inserts.
    for k in keys.iter() {
        black_box(limiter.check(k));
    }
    // Equal work needs equal decisions: report the share admitted in a short run.
    let sample = 200_000;
    let admitted = (0..sample).filter(|i| limiter.check(&keys[i % n])).count();
    eprintln!(
        "{name}: {:.1}% admitted of {sample} calls",
        admitted as f64 * 100.0 / sample as f64
    );
    if threads == 1 {
        let mut i = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                let admitted = limiter.check(black_box(&keys[i]));
                i += 1;
                if i == n {
                    i = 0;
                }
                admitted
            });
        });
        return;
    }
    // The threads live for the whole benchmark and run each sample's share between two
    // barriers, as a server's long-lived workers would. Spawning them per sample measured the
    // scheduler's placement of new threads too (for their first milliseconds two new threads
    // may share one CPU, where a lock holder can be preempted): it put 10-20 ns on
    // LocalStore's two-thread hot-key decisions (72-79 ns per sample-spawned call against
    // 55-65 with long-lived threads, same code) and little on governor's (BENCHMARKS.md).
    let pool = Pool::new(threads, &limiter, keys);
    group.bench_function(name, |b| b.iter_custom(|iters| pool.run(iters)));
}

/// `threads` workers making decisions on one limiter, each sample's calls split between them.
struct Pool {
    barrier: Arc<Barrier>,
    /// Calls for the next sample, in total; `u64::MAX` tells the workers to stop.
    iters: Arc<AtomicU64>,
    workers: Vec<thread::JoinHandle<()>>,
}

impl Pool {
    fn new<L: Limiter>(threads: usize, limiter: &Arc<L>, keys: &Arc<Vec<Key>>) -> Self {
        let barrier = Arc::new(Barrier::new(threads + 1));
        let iters = Arc::new(AtomicU64::new(0));
        let n = keys.len();
        let workers = (0..threads)
            .map(|t| {
                let (limiter, keys) = (Arc::clone(limiter), Arc::clone(keys));
                let (barrier, iters) = (Arc::clone(&barrier), Arc::clone(&iters));
                let mut i = t * n / threads;
                thread::spawn(move || {
                    // A panic here would leave the others waiting at the barrier for ever:
                    // end the process instead.
                    let abort = AbortOnPanic;
                    loop {
                        barrier.wait();
                        let total = iters.load(Ordering::Acquire);
                        if total == u64::MAX {
                            std::mem::forget(abort);
                            return;
                        }
                        let total = total as usize;
                        let ops = total / threads + usize::from(t < total % threads);
                        for _ in 0..ops {
                            black_box(limiter.check(&keys[i]));
                            i += 1;
                            if i == n {
                                i = 0;
                            }
                        }
                        barrier.wait();
                    }
                })
            })
            .collect();
        Self {
            barrier,
            iters,
            workers,
        }
    }

    /// Wall time for `iters` calls split between the workers.
    fn run(&self, iters: u64) -> Duration {
        self.iters.store(iters, Ordering::Release);
        let start = Instant::now();
        self.barrier.wait();
        self.barrier.wait();
        start.elapsed()
    }
}

/// Aborts the process when dropped, i.e. when the worker holding it unwinds.
struct AbortOnPanic;

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        eprintln!("a bench worker panicked");
        std::process::abort();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.iters.store(u64::MAX, Ordering::Release);
        self.barrier.wait();
        for w in self.workers.drain(..) {
            w.join().unwrap();
        }
    }
}

/// `LOCAL_BENCH_ORDER=governor-first` runs governor before `LocalStore` in every group, so
/// repeated runs (`benches/scripts/local-ratios.sh`) can alternate the order and show whether
/// going first or second in a group moves a limiter's figure.
fn governor_first() -> bool {
    std::env::var("LOCAL_BENCH_ORDER").is_ok_and(|v| v == "governor-first")
}

fn scenario(c: &mut Criterion, s: Scenario, key_counts: &[usize]) {
    for &n in key_counts {
        let label = if n == 1 {
            "1key".to_owned()
        } else {
            format!("{n}keys")
        };
        groups(c, s, &label, &keys(n));
    }
}

/// `s` on `n` keys visited in Zipf's order with exponent 1 ([`zipf_visits`]; 1,000,000
/// visits, cycled).
fn scenario_zipf(c: &mut Criterion, s: Scenario, n: usize) {
    groups(
        c,
        s,
        &format!("{n}keys_zipf"),
        &zipf_visits(n, 1.0, 1_000_000),
    );
}

/// One group per thread count for scenario `s`, both limiters visiting `keys` in order.
fn groups(c: &mut Criterion, s: Scenario, label: &str, keys: &Arc<Vec<Key>>) {
    for threads in [1, 2] {
        let mut group = c.benchmark_group(format!("local/{}/{label}/{threads}thread", s.name));
        group.throughput(Throughput::Elements(1));
        if governor_first() {
            bench(&mut group, "governor", s.governor(), keys, threads);
            bench(&mut group, "tollgate", s.tollgate(), keys, threads);
        } else {
            bench(&mut group, "tollgate", s.tollgate(), keys, threads);
            bench(&mut group, "governor", s.governor(), keys, threads);
        }
        group.finish();
    }
}

fn local(c: &mut Criterion) {
    scenario(c, GENEROUS, &[1, 100_000]);
    scenario(c, GENEROUS_SLOW, &[100_000]);
    scenario(c, BRIEF, &[1]);
    scenario(c, DENYING, &[1, 100_000]);
    scenario_zipf(c, GENEROUS_SLOW, 100_000);
    scenario_zipf(c, DENYING, 100_000);
}

criterion_group!(benches, local);
criterion_main!(benches);
