//! Cardinality: a million distinct keys through a `LocalStore` capped at 50,000 keys. The map
//! never holds more than its cap, expired buckets make room for new keys, a flood of new keys
//! against a full map of live buckets is refused quickly with `KeyCapReached` while held keys
//! keep working, and the process's memory stays flat across the run.

use std::time::{Duration, Instant};

use tollgate_core::{ErrorClass, Key, ManualClock, Policy, StoreError};
use tollgate_local::LocalStore;

/// A whole second, so one-second windows start here.
const T: u64 = 1_700_000_000_000_000;
const CAP: usize = 50_000;
const ROUNDS: usize = 20;

fn key(round: usize, i: usize) -> Key {
    Key::new("card", [format!("r{round}"), i.to_string()]).unwrap()
}

/// Resident set size of this process, in KiB (`VmRSS` in /proc/self/status).
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_million_distinct_keys_stay_under_the_cap_and_memory_stays_flat() {
    let clock = ManualClock::new(T);
    let store = LocalStore::builder()
        .max_keys(CAP)
        .clock(clock.clone())
        .build();
    let policy = Policy::fixed_window(5, Duration::from_secs(1)).unwrap();
    let started = Instant::now();
    let mut rss_after_first = 0;
    let mut peak_len = 0;
    for round in 0..ROUNDS {
        for i in 0..CAP {
            let d = store
                .acquire_now(&key(round, i), &policy, 1)
                .unwrap_or_else(|e| panic!("round {round}, key {i}: {e}"));
            assert!(d.allowed);
            if i % 1_000 == 0 {
                peak_len = peak_len.max(store.len());
                assert!(store.len() <= CAP, "{} keys held", store.len());
            }
        }
        assert_eq!(
            store.len(),
            CAP,
            "round {round}: every key of the round is live"
        );
        peak_len = peak_len.max(store.len());
        if round == 0 {
            rss_after_first = rss_kib();
        }
        // The whole round expires: the next round's keys take its place.
        clock.advance(Duration::from_secs(2));
    }
    let rss_end = rss_kib();
    let elapsed = started.elapsed();

    // At the cap with every bucket live, a flood of new keys is refused, quickly and without
    // growing the map, while the keys held keep working.
    let round = ROUNDS - 1;
    clock.advance(Duration::from_millis(1));
    let mut live = 0;
    for i in 0..CAP {
        if store.acquire_now(&key(round + 1, i), &policy, 1).is_ok() {
            live += 1;
        }
    }
    assert_eq!(
        live, CAP,
        "the expired round made room for a full new round"
    );
    let flood_started = Instant::now();
    for i in 0..100_000 {
        match store.acquire_now(&key(round + 2, i), &policy, 1) {
            Err(e @ StoreError::KeyCapReached { cap: CAP }) => {
                assert_eq!(e.class(), ErrorClass::Capacity);
            }
            other => panic!("new key {i} at the cap: {other:?}"),
        }
    }
    let flood = flood_started.elapsed();
    assert_eq!(store.len(), CAP);
    assert_eq!(
        store
            .acquire_now(&key(round + 1, 7), &policy, 1)
            .unwrap()
            .remaining,
        3,
        "a held key keeps its bucket"
    );
    assert!(
        flood < Duration::from_secs(5),
        "100k refusals at the cap took {flood:?}"
    );

    // Once everything expires, a sweep empties the map.
    clock.advance(Duration::from_secs(2));
    assert_eq!(store.sweep_expired(), CAP);
    assert!(store.is_empty());

    let growth = rss_end.saturating_sub(rss_after_first);
    println!(
        "local cardinality: {} distinct keys in {elapsed:.2?}, cap {CAP}, peak len {peak_len}; \
         100k refusals at the cap in {flood:.2?}; VmRSS after round 1 {rss_after_first} KiB, \
         after round {ROUNDS} {rss_end} KiB (+{growth} KiB)",
        ROUNDS * CAP
    );
    assert!(
        growth < 32 * 1024,
        "memory grew by {growth} KiB over {ROUNDS} rounds of {CAP} new keys"
    );
}
