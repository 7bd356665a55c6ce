//! A loop of `acquire_now` calls for profiling (`perf record`, `valgrind --tool=callgrind`):
//! `hot_key [allow|1M_per_s|deny] [keys] [calls]`, token bucket as in `benches/benches/local.rs`.

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
    let start = Instant::now();
    let mut admitted = 0usize;
    let mut i = 0;
    for _ in 0..calls {
        admitted += usize::from(
            store
                .acquire_now(black_box(&keys[i]), &policy, 1)
                .unwrap()
                .allowed,
        );
        i += 1;
        if i == keys.len() {
            i = 0;
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / calls as f64;
    println!(
        "{scenario}, {} keys: {ns:.1} ns per call, {admitted} admitted of {calls}",
        keys.len()
    );
}
