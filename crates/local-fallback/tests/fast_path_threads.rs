//! Threads on the same keys through `LocalStore::acquire_now`'s common call (a live token
//! bucket whose parameters govern it: the state written under the shard's lock, the decision
//! built after the lock is released), on keys too long for the lent slots (every call takes the
//! shard's lock) and on short ones (hot calls decided in a slot): every admission is one
//! token's, and the decision each call gets is the one its own step made.

use std::sync::Mutex;
use std::time::Duration;

use tollgate_core::{Key, ManualClock, Policy, Rate};
use tollgate_local::LocalStore;

const T: u64 = 1_700_000_000_000_000;
const THREADS: usize = 4;
const CALLS: usize = 1_500;

/// A key of more than 88 bytes (no slot: decided under the shard's lock), or a short one.
fn keys() -> Vec<Key> {
    vec![
        Key::new("fast", ["long-".repeat(20)]).unwrap(),
        Key::new("fast", ["long-".repeat(21)]).unwrap(),
        Key::new("fast", ["a"]).unwrap(),
    ]
}

/// On a frozen clock, threads hammering each key (the keys interleaved) admit exactly the
/// capacity, and the admissions' `remaining` are capacity - 1 down to 0, each exactly once:
/// no two calls were handed a decision made from the same state. After the clock moves by one
/// token's refill, exactly one more on each key, with `remaining` 0.
#[test]
fn each_call_gets_the_decision_its_own_step_made() {
    const CAPACITY: u64 = 300;
    let clock = ManualClock::new(T);
    let store = LocalStore::builder().clock(clock.clone()).build();
    let policy = Policy::token_bucket(CAPACITY, Rate::per_second(1)).unwrap();
    let keys = keys();
    for round in 0..5 {
        let admitted: Vec<Mutex<Vec<u64>>> = keys.iter().map(|_| Mutex::new(Vec::new())).collect();
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (store, policy, keys, admitted) = (&store, &policy, &keys, &admitted);
                s.spawn(move || {
                    let mut mine: Vec<Vec<u64>> = keys.iter().map(|_| Vec::new()).collect();
                    for i in 0..CALLS {
                        let k = (i + t) % keys.len();
                        let d = store.acquire_now(&keys[k], policy, 1).unwrap();
                        if d.allowed {
                            mine[k].push(d.remaining);
                        } else {
                            // a denial on a frozen clock: the bucket is empty
                            assert_eq!(d.remaining, 0, "round {round}, key {k}");
                            assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
                        }
                    }
                    for (k, m) in mine.into_iter().enumerate() {
                        admitted[k].lock().unwrap().extend(m);
                    }
                });
            }
        });
        for (k, a) in admitted.iter().enumerate() {
            let mut a = a.lock().unwrap().clone();
            a.sort_unstable();
            let want: Vec<u64> = if round == 0 {
                (0..CAPACITY).collect()
            } else {
                vec![0]
            };
            assert_eq!(a, want, "round {round}, key {k}");
        }
        clock.advance(Duration::from_secs(1));
    }
}

/// With the clock moving under the threads (a fourth thread advances it by 1 ms, a bounded
/// number of times), no key admits more than its capacity plus what the elapsed time refills,
/// and at least that many were admitted when every call wanted one (the calls outnumber the
/// tokens).
#[test]
fn a_moving_clock_never_admits_more_than_the_refill() {
    const CAPACITY: u64 = 50;
    const STEPS: u64 = 400;
    let clock = ManualClock::new(T);
    let store = LocalStore::builder().clock(clock.clone()).build();
    // one token per 2 ms
    let policy = Policy::token_bucket(CAPACITY, Rate::per_second(500)).unwrap();
    let keys = keys();
    let counts: Vec<Mutex<u64>> = keys.iter().map(|_| Mutex::new(0)).collect();
    std::thread::scope(|s| {
        for t in 0..THREADS - 1 {
            let (store, policy, keys, counts) = (&store, &policy, &keys, &counts);
            s.spawn(move || {
                let mut mine = vec![0u64; keys.len()];
                for i in 0..CALLS * 4 {
                    let k = (i + t) % keys.len();
                    let d = store.acquire_now(&keys[k], policy, 1).unwrap();
                    assert!(d.remaining < CAPACITY);
                    mine[k] += u64::from(d.allowed);
                }
                for (k, m) in mine.into_iter().enumerate() {
                    *counts[k].lock().unwrap() += m;
                }
            });
        }
        let clock = &clock;
        s.spawn(move || {
            for _ in 0..STEPS {
                clock.advance(Duration::from_millis(1));
                std::thread::yield_now();
            }
        });
    });
    let refill = STEPS / 2;
    for (k, c) in counts.iter().enumerate() {
        let c = *c.lock().unwrap();
        assert!(c <= CAPACITY + refill, "key {k}: {c} admitted");
        assert!(c >= CAPACITY, "key {k}: {c} admitted");
    }
    // what is left agrees with the admissions: the bucket's level is what the calls left
    for (k, key) in keys.iter().enumerate() {
        let c = *counts[k].lock().unwrap();
        let left = store.peek_now(key, &policy, 1).unwrap();
        assert!(left.remaining + c <= CAPACITY + refill, "key {k}");
    }
}
