//! The floor under any keyed limiter on a dashmap: one `get_mut` and one write per call, on the
//! same keys and hasher as `hot_key`, with map entries of 24 bytes (a `Key` and one 8-byte
//! state, governor's layout), 32 bytes (a `Key` and a 16-byte bucket: LocalStore's since its
//! compact bucket packs the parameters' index into the time and derives the expiry) or 48
//! bytes (a `Key` and the 32-byte bucket LocalStore had before).
//! `map_floor <24|32|48> [keys] [calls]`; under `benches/scripts/local-cost.sh` it gives the
//! instructions and cache misses the map alone costs at each entry size.

use std::hint::black_box;
use std::time::Instant;

use dashmap::DashMap;
use tollgate_core::Key;

/// `calls` round-robin calls over `keys`, each adding 1 to the first word of the entry's value
/// and copying it to the last (so the whole value is written, as a decision writes its state).
fn run<const W: usize>(keys: &[Key], calls: usize) -> f64 {
    let map: DashMap<Key, [u64; W], foldhash::fast::RandomState> =
        DashMap::with_hasher(foldhash::fast::RandomState::default());
    for k in keys {
        map.insert(k.clone(), [0; W]);
    }
    let start = Instant::now();
    let mut i = 0;
    for _ in 0..calls {
        let mut v = map
            .get_mut(black_box(&keys[i]))
            .expect("every key inserted");
        v[0] += 1;
        v[W - 1] = v[0];
        i += 1;
        if i == keys.len() {
            i = 0;
        }
    }
    start.elapsed().as_nanos() as f64 / calls.max(1) as f64
}

fn main() {
    let mut args = std::env::args().skip(1);
    let entry: usize = args.next().map_or(48, |s| s.parse().expect("24, 32 or 48"));
    let keys: usize = args
        .next()
        .map_or(100_000, |s| s.parse().expect("a key count"));
    let calls: usize = args
        .next()
        .map_or(10_000_000, |s| s.parse().expect("a call count"));
    let keys: Vec<Key> = (0..keys)
        .map(|i| Key::new("bench", [i.to_string()]).expect("a valid key"))
        .collect();
    let ns = match entry {
        24 => run::<1>(&keys, calls),
        32 => run::<2>(&keys, calls),
        48 => run::<4>(&keys, calls),
        other => panic!("entry size {other}: 24, 32 or 48"),
    };
    println!(
        "map only, {entry}-byte entries, {} keys: {ns:.1} ns per call",
        keys.len()
    );
}
