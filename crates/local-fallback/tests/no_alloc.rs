//! The hot path allocates nothing: a token bucket or fixed window already held is decided
//! without touching the allocator.

use std::time::Duration;

use tollgate_core::{Key, ManualClock, Policy, Rate};
use tollgate_local::LocalStore;
use tollgate_testkit::alloc::{Counting, allocations};

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn deciding_on_a_held_key_does_not_allocate() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = LocalStore::with_clock(clock.clone());
    let key = Key::new("hot", ["user-42"]).unwrap();
    let policies = [
        Policy::token_bucket(1_000, Rate::per_second(100)).unwrap(),
        Policy::fixed_window(1_000, Duration::from_secs(1)).unwrap(),
    ];
    for p in &policies {
        store.reset_now(&key);
        store.acquire_now(&key, p, 1).unwrap();
        let before = allocations();
        for _ in 0..2_000 {
            clock.advance_micros(7);
            store.acquire_now(&key, p, 1).unwrap();
            store.peek_now(&key, p, 1).unwrap();
        }
        assert_eq!(allocations() - before, 0, "{p}: the hot path allocated");
    }
}
