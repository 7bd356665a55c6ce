//! A loop of `acquire_now` calls for profiling (`perf record`, `valgrind --tool=callgrind`):
//! `hot_key [allow|allow_resident|1M_per_s|deny] [keys] [calls] [threads]`, token bucket as in
//! `benches/benches/local.rs`; with several threads each makes `calls` calls on one store.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tollgate_core::{Key, Policy, Rate};
use tollgate_local::LocalStore;

fn main() {
    let mut args = std::env::args().skip(1);
    let scenario = args.next().unwrap_or_else(|| "allow".to_owned());
    let keys: usize = args.next().map_or(1, |s| s.parse().expect("a key count"));
    let calls: usize = args
        .next()
        .map_or(20_000_000, |s| s.parse().expect("a call count"));
    let (capacity, rate) = match scenario.as_str() {
        "allow" => (1_000_000, Rate::per_second(1_000_000_000)),
        "allow_resident" => (1_000_000, Rate::per_second(1)),
        "1M_per_s" => (1_000_000, Rate::per_second(1_000_000)),
        "deny" => (1, Rate::new(1, Duration::from_secs(3600))),
        other => panic!("unknown scenario {other}"),
    };
    let policy = Policy::token_bucket(capacity, rate).unwrap();
    let store = LocalStore::new();
    let keys: Vec<Key> = (0..keys)
        .map(|i| Key::new("bench", [i.to_string()]).unwrap())
        .collect();
    for k in &keys {
        store.acquire_now(k, &policy, 1).unwrap();
    }
    let threads: usize = args
        .next()
        .map_or(1, |s| s.parse().expect("a thread count"));
    if args.next().as_deref() == Some("governor") {
        let burst = std::num::NonZeroU32::new(capacity as u32).unwrap();
        let quota = governor::Quota::with_period(rate.period() / rate.tokens() as u32)
            .unwrap()
            .allow_burst(burst);
        let lim = governor::RateLimiter::keyed(quota);
        for k in &keys {
            let _ = lim.check_key(k);
        }
        let start = Instant::now();
        std::thread::scope(|scope| {
            for t in 0..threads {
                let (lim, keys) = (&lim, &keys);
                scope.spawn(move || {
                    let mut i = t * keys.len() / threads;
                    for _ in 0..calls {
                        black_box(lim.check_key(black_box(&keys[i])).is_ok());
                        i += 1;
                        if i == keys.len() {
                            i = 0;
                        }
                    }
                });
            }
        });
        let ns = start.elapsed().as_nanos() as f64 / (calls * threads) as f64;
        println!("governor {scenario}, {threads} threads: {ns:.1} ns per call");
        return;
    }
    let start = Instant::now();
    let admitted: usize = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (store, keys, policy) = (&store, &keys, &policy);
                scope.spawn(move || {
                    let mut admitted = 0usize;
                    let mut i = t * keys.len() / threads;
                    for _ in 0..calls {
                        admitted += usize::from(
                            store
                                .acquire_now(black_box(&keys[i]), policy, 1)
                                .unwrap()
                                .allowed,
                        );
                        i += 1;
                        if i == keys.len() {
                            i = 0;
                        }
                    }
                    admitted
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    let total = calls * threads;
    let ns = start.elapsed().as_nanos() as f64 / total as f64;
    println!(
        "{scenario}, {} keys, {threads} threads: {ns:.1} ns per call (wall / calls), {admitted} admitted of {total}",
        keys.len()
    );
}
