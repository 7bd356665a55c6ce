//! The key cap, the sweep of expired buckets and Redis's millisecond expiry, seen through
//! `LocalStore`'s public API.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate_core::{ErrorClass, Key, ManualClock, Policy, Rate, StoreError};
use tollgate_local::{CAP_SWEEP_GAP_MS, LocalStore, SWEEP_GAP_MS};

/// A whole second, so fixed windows of 1 s start here.
const T: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;

fn key(i: usize) -> Key {
    Key::new("cap", [i.to_string()]).unwrap()
}

fn second_window() -> Policy {
    Policy::fixed_window(5, Duration::from_secs(1)).unwrap()
}

fn hour_window() -> Policy {
    Policy::fixed_window(5, Duration::from_secs(3600)).unwrap()
}

fn store(max_keys: usize, clock: &ManualClock) -> LocalStore<ManualClock> {
    LocalStore::builder()
        .max_keys(max_keys)
        .clock(clock.clone())
        .build()
}

#[track_caller]
/// A store with no key cap to speak of that sweeps every 10 new keys.
fn sweeping_every_10(clock: &ManualClock) -> LocalStore<ManualClock> {
    LocalStore::builder()
        .sweep_every(10)
        .clock(clock.clone())
        .build()
}

fn assert_cap_reached(got: Result<tollgate_core::Decision, StoreError>, cap: usize) {
    match got {
        Err(e @ StoreError::KeyCapReached { cap: c }) if c == cap => {
            assert_eq!(e.class(), ErrorClass::Capacity);
        }
        other => panic!("expected KeyCapReached {{ cap: {cap} }}, got {other:?}"),
    }
}

#[test]
fn new_key_is_refused_at_the_cap_while_held_keys_keep_working() {
    let clock = ManualClock::new(T);
    let s = store(3, &clock);
    let p = hour_window();
    for i in 0..3 {
        assert!(s.acquire_now(&key(i), &p, 1).unwrap().allowed);
    }
    assert_cap_reached(s.acquire_now(&key(3), &p, 1), 3);
    assert_eq!(s.len(), 3);
    for i in 0..3 {
        assert_eq!(s.acquire_now(&key(i), &p, 1).unwrap().remaining, 3);
    }
    // peek needs no slot
    assert!(s.peek_now(&key(3), &p, 5).unwrap().allowed);
}

#[test]
fn expired_buckets_are_swept_to_make_room_at_the_cap() {
    let clock = ManualClock::new(T);
    let s = store(2, &clock);
    s.acquire_now(&key(0), &second_window(), 1).unwrap();
    s.acquire_now(&key(1), &hour_window(), 1).unwrap();
    assert_cap_reached(s.acquire_now(&key(2), &second_window(), 1), 2);
    clock.advance(Duration::from_secs(2));
    assert!(s.acquire_now(&key(2), &second_window(), 1).unwrap().allowed);
    assert_eq!(s.len(), 2, "key 0 swept, keys 1 and 2 held");
    assert_cap_reached(s.acquire_now(&key(3), &second_window(), 1), 2);
}

#[test]
fn at_the_cap_a_sweep_runs_at_most_once_per_gap() {
    let clock = ManualClock::new(T + 950 * MS);
    let s = store(1, &clock);
    // the window ends, and the bucket expires, at T + 1 s
    s.acquire_now(&key(0), &second_window(), 1).unwrap();
    clock.set(T + 960 * MS);
    assert_cap_reached(s.acquire_now(&key(1), &second_window(), 1), 1);
    // key 0 has expired, but the last cap sweep was only 41 ms ago
    clock.set(T + 1_001 * MS);
    assert_cap_reached(s.acquire_now(&key(1), &second_window(), 1), 1);
    clock.set(T + 960 * MS + CAP_SWEEP_GAP_MS * MS);
    assert!(s.acquire_now(&key(1), &second_window(), 1).unwrap().allowed);
    assert_eq!(s.len(), 1);
}

#[test]
fn reset_frees_a_slot() {
    let clock = ManualClock::new(T);
    let s = store(1, &clock);
    s.acquire_now(&key(0), &hour_window(), 1).unwrap();
    assert!(s.reset_now(&key(0)));
    assert!(!s.reset_now(&key(0)));
    assert!(s.is_empty());
    assert!(s.acquire_now(&key(1), &hour_window(), 1).unwrap().allowed);
}

#[test]
fn a_cap_of_zero_refuses_every_key() {
    let clock = ManualClock::new(T);
    let s = store(0, &clock);
    assert_cap_reached(s.acquire_now(&key(0), &hour_window(), 1), 0);
    assert!(s.is_empty());
}

#[test]
fn expired_buckets_are_swept_every_so_many_new_keys() {
    let clock = ManualClock::new(T);
    let s = sweeping_every_10(&clock);
    for i in 0..5 {
        s.acquire_now(&key(i), &second_window(), 1).unwrap();
    }
    clock.advance(Duration::from_secs(2));
    for i in 5..9 {
        s.acquire_now(&key(i), &second_window(), 1).unwrap();
    }
    assert_eq!(s.len(), 9, "no sweep before the 10th new key");
    s.acquire_now(&key(9), &second_window(), 1).unwrap();
    assert_eq!(s.len(), 5, "the 10th new key sweeps the 5 expired ones");
}

#[test]
fn the_periodic_sweep_runs_at_most_once_per_gap_of_the_clock() {
    let clock = ManualClock::new(T);
    let s = sweeping_every_10(&clock);
    // one-second windows aligned to T: a bucket written in [T + k s, T + (k + 1) s) expires
    // at the end of that second
    for i in 0..5 {
        s.acquire_now(&key(i), &second_window(), 1).unwrap();
    }
    clock.set(T + 2_990 * MS);
    for i in 5..10 {
        s.acquire_now(&key(i), &second_window(), 1).unwrap();
    }
    assert_eq!(s.len(), 5, "the 10th new key swept the 5 expired buckets");
    // 50 ms after that sweep keys 5..9 have expired; a visit renews key 5 in place, and ten
    // new keys reach the threshold again within the gap: no sweep
    clock.set(T + 3_040 * MS);
    s.acquire_now(&key(5), &second_window(), 1).unwrap();
    for i in 10..20 {
        s.acquire_now(&key(i), &second_window(), 1).unwrap();
    }
    assert_eq!(
        s.len(),
        15,
        "no second sweep within {SWEEP_GAP_MS} ms of the first"
    );
    // a gap after the first sweep, the next new key sweeps keys 6..9
    clock.set(T + 2_990 * MS + SWEEP_GAP_MS * MS);
    s.acquire_now(&key(20), &second_window(), 1).unwrap();
    assert_eq!(s.len(), 12);
}

#[test]
fn sweep_expired_removes_only_expired_buckets() {
    let clock = ManualClock::new(T);
    let s = store(100, &clock);
    for i in 0..6 {
        let p = if i % 2 == 0 {
            second_window()
        } else {
            hour_window()
        };
        s.acquire_now(&key(i), &p, 1).unwrap();
    }
    // alive through the millisecond of the window's end, gone after it
    clock.advance(Duration::from_secs(1));
    assert_eq!(s.sweep_expired(), 0);
    clock.advance(Duration::from_millis(1));
    assert_eq!(s.sweep_expired(), 3);
    assert_eq!(s.len(), 3);
    for i in [1, 3, 5] {
        assert_eq!(
            s.peek_now(&key(i), &hour_window(), 1).unwrap().remaining,
            3,
            "key {i} kept"
        );
    }
}

#[test]
fn expiry_is_redis_milliseconds_with_the_ttl_rounded_up() {
    let clock = ManualClock::new(T + 999);
    let s = store(100, &clock);
    // a TTL of 500 ms written 999 µs into millisecond T: alive through millisecond T + 500
    let half_second = Policy::token_bucket(10, Rate::per_second(2)).unwrap();
    s.acquire_now(&key(0), &half_second, 1).unwrap();
    // a TTL of 2_333_334 µs rounds up to 2_334 ms
    let odd = Policy::token_bucket(1, Rate::new(3, Duration::from_secs(7))).unwrap();
    s.acquire_now(&key(1), &odd, 1).unwrap();

    clock.set(T + 500 * MS + 999);
    assert_eq!(s.sweep_expired(), 0);
    clock.set(T + 501 * MS);
    assert_eq!(s.sweep_expired(), 1);
    clock.set(T + 2_334 * MS + 999);
    assert_eq!(s.sweep_expired(), 0);
    clock.set(T + 2_335 * MS);
    assert_eq!(s.sweep_expired(), 1);
    assert!(s.is_empty());
}

#[test]
fn peek_stores_nothing_and_drops_an_expired_bucket() {
    let clock = ManualClock::new(T);
    let s = store(100, &clock);
    let p = second_window();
    assert!(s.peek_now(&key(0), &p, 5).unwrap().allowed);
    assert!(matches!(
        s.acquire_now(&key(0), &p, 0),
        Err(StoreError::InvalidPolicy(_))
    ));
    assert!(
        s.is_empty(),
        "neither a peek nor an invalid request stores a bucket"
    );

    s.acquire_now(&key(0), &p, 5).unwrap();
    assert!(!s.peek_now(&key(0), &p, 1).unwrap().allowed);
    assert_eq!(s.len(), 1);
    clock.advance(Duration::from_millis(1_001));
    assert!(s.peek_now(&key(0), &p, 5).unwrap().allowed);
    assert!(
        s.is_empty(),
        "an expired bucket seen by a peek is dropped, as Redis does"
    );
    // and a clock stepping back does not bring it back
    clock.set(T);
    assert!(s.peek_now(&key(0), &p, 5).unwrap().allowed);
}

#[test]
fn many_threads_on_one_key_never_admit_more_than_the_limit() {
    let clock = ManualClock::new(T);
    let s = store(100, &clock);
    let policies = [
        Policy::token_bucket(100, Rate::per_second(1)).unwrap(),
        Policy::fixed_window(100, Duration::from_secs(10)).unwrap(),
        Policy::sliding_log(100, Duration::from_secs(10)).unwrap(),
    ];
    for (i, p) in policies.iter().enumerate() {
        let admitted = AtomicU64::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..200 {
                        if s.acquire_now(&key(i), p, 1).unwrap().allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), 100, "{p}");
    }
}

/// A clock reading within a TTL of `u64::MAX` (a broken or hostile `Clock`): decisions, a
/// peek and the sweep run without overflow (the core maths panicked inside the shard's lock
/// in debug builds), and the decision is the one any other instant gets.
#[test]
fn a_clock_near_the_end_of_u64_decides_as_any_other() {
    for now in [u64::MAX - 1, u64::MAX] {
        let clock = ManualClock::new(now);
        let store = LocalStore::builder().clock(clock).build();
        let key = Key::new("edge", ["k"]).unwrap();
        let policy = Policy::token_bucket(10, Rate::per_second(1)).unwrap();
        for left in [9, 8] {
            let d = store.acquire_now(&key, &policy, 1).unwrap();
            assert!(d.allowed);
            assert_eq!(d.remaining, left);
            assert_eq!(d.reset_after, Duration::from_secs(10 - left));
        }
        assert_eq!(store.peek_now(&key, &policy, 1).unwrap().remaining, 7);
        store.sweep_expired();
    }
}

/// A clock that counts its reads, so a test knows when a call has read it.
#[derive(Clone)]
struct CountingClock {
    inner: ManualClock,
    reads: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl tollgate_core::Clock for CountingClock {
    fn now_micros(&self) -> u64 {
        let now = self.inner.now_micros();
        self.reads.fetch_add(1, Ordering::SeqCst);
        now
    }
}

/// A background `sweep_expired` (as the docs suggest) that started before the buckets
/// expired is still walking the map when a new key arrives at the cap: the new key's cap
/// sweep waits for it and then runs, rather than refusing the key and spending the gap
/// without sweeping (which refused every new key for `CAP_SWEEP_GAP_MS` while every held
/// bucket had expired).
#[test]
fn a_cap_sweep_waits_for_a_background_sweep_under_way() {
    const CAP: usize = 200_000;
    for run in 0..5 {
        let clock = CountingClock {
            inner: ManualClock::new(T),
            reads: std::sync::Arc::default(),
        };
        let store = LocalStore::builder()
            .max_keys(CAP)
            .sweep_every(usize::MAX)
            .clock(clock.clone())
            .build();
        let p = second_window();
        for i in 0..CAP {
            store.acquire_now(&key(i), &p, 1).unwrap();
        }
        let (first, later) = std::thread::scope(|s| {
            let before = clock.reads.load(Ordering::SeqCst);
            // at T: nothing has expired yet; a walk over 200,000 buckets
            let background = s.spawn(|| store.sweep_expired());
            let started = std::time::Instant::now();
            while clock.reads.load(Ordering::SeqCst) == before {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "no sweep started"
                );
                std::hint::spin_loop();
            }
            clock.inner.advance(Duration::from_secs(2)); // every bucket has expired
            let first = store.acquire_now(&Key::new("new", ["a"]).unwrap(), &p, 1);
            assert_eq!(
                background.join().unwrap(),
                0,
                "the background sweep ran at T"
            );
            clock.inner.advance(Duration::from_millis(50));
            let later = store.acquire_now(&Key::new("new", ["b"]).unwrap(), &p, 1);
            (first, later)
        });
        assert!(first.is_ok(), "run {run}: first new key: {first:?}");
        assert!(later.is_ok(), "run {run}: 50 ms later: {later:?}");
        assert_eq!(store.len(), 2, "run {run}");
    }
}

/// A periodic sweep that falls due within `SWEEP_GAP_MS` of the last one is not dropped: the
/// first new key after the gap runs it.
#[test]
fn a_sweep_due_inside_the_gap_runs_at_the_first_new_key_after_it() {
    let clock = ManualClock::new(T);
    let store = LocalStore::builder()
        .sweep_every(10)
        .clock(clock.clone())
        .build();
    let p = second_window();
    for i in 0..10 {
        store.acquire_now(&key(i), &p, 1).unwrap(); // the 10th runs a sweep at T
    }
    clock.advance(Duration::from_millis(50));
    for i in 10..20 {
        store.acquire_now(&key(i), &p, 1).unwrap(); // due again, within the gap
    }
    assert_eq!(store.len(), 20);
    clock.advance(Duration::from_secs(2)); // every bucket has expired
    store.acquire_now(&key(0), &p, 1).unwrap(); // a held key: no sweep
    assert_eq!(store.len(), 20, "sweeps run on new keys only");
    store.acquire_now(&key(100), &p, 1).unwrap(); // the first new key after the gap
    assert_eq!(store.len(), 2, "the deferred sweep ran");
}

/// Many new keys at once at a cap of expired buckets (8 threads, up to 3,000 runs within 5 s):
/// none is refused (one sweep frees room for all of them). A call whose cap sweep fell within
/// another's gap was refused at once (two threads: 19 of 20 runs refused one), and, once it
/// waited for a sweep under way, a call that found the gap claimed by another that had not yet
/// started its walk waited for nothing (60–144 runs of ~1,200 in a debug build, 1–21 of 3,000
/// in release, before the gap was claimed with the sweep held).
#[test]
fn many_new_keys_at_a_cap_of_expired_buckets_are_all_admitted() {
    const CAP: usize = 2_000;
    const THREADS: usize = 8;
    let p = second_window();
    let started = std::time::Instant::now();
    let (mut runs, mut refused_runs) = (0, 0);
    while runs < 3000 && started.elapsed() < Duration::from_secs(5) {
        runs += 1;
        let clock = ManualClock::new(T);
        let store = LocalStore::builder()
            .max_keys(CAP)
            .sweep_every(usize::MAX)
            .clock(clock.clone())
            .build();
        for i in 0..CAP {
            store.acquire_now(&key(i), &p, 1).unwrap();
        }
        clock.advance(Duration::from_secs(2)); // every bucket has expired
        let barrier = std::sync::Barrier::new(THREADS);
        let refused: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (store, p, barrier) = (&store, &p, &barrier);
                    s.spawn(move || {
                        let k = Key::new("new", [format!("{runs}-{t}")]).unwrap();
                        barrier.wait();
                        match store.acquire_now(&k, p, 1) {
                            Ok(_) => 0,
                            Err(StoreError::KeyCapReached { .. }) => 1,
                            Err(e) => panic!("{e}"),
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        refused_runs += usize::from(refused > 0);
    }
    assert_eq!(
        refused_runs, 0,
        "{refused_runs} of {runs} runs refused a new key while every held bucket had expired"
    );
}
