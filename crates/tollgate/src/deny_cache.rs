//! An opt-in local cache of denials: a key the store denied until a known instant is answered
//! locally, with zero round trips, until then.
//!
//! Exact, not approximate: every algorithm here only ever *consumes* from a bucket between a
//! denial and its `retry_after`, so nothing another instance does can make a request of the
//! same cost admissible earlier. Only a reset or a policy change can, and both
//! invalidate the entry (the entry remembers the policy's parameters and generation, and
//! [`crate::Limiter::reset`] removes it). The deadline is measured from when the request was
//! *sent*, which is no later than when the store decided, so the cache never denies longer than
//! the store would have — measured on this process's monotonic clock, while the store decides
//! on its own (Redis `TIME`): a Redis clock stepped forward can make the store admit the key
//! before the cached deadline, and the cache denies it until then (exact while both clocks
//! advance together).
//!
//! Only a request of the denied cost is answered: a larger cost is denied at least as long,
//! but for longer (a token bucket must refill the difference too), and a cached answer would
//! tell its client a `Retry-After` at which it is refused again.
//!
//! A cached answer repeats the denial it was made from, its `retry_after` and `reset_after`
//! counted down to now; its `remaining` is the denial's. A request on the key that this limiter
//! sends and the store admits (another cost) drops the entry, since it consumed; consumption
//! through other instances is not seen here, so the store may hold less than a cached
//! `remaining` says, and need longer than a cached `retry_after` (as a store's own answer
//! ages once given), while a refill may have left it more. A policy change through
//! [`crate::Limiter::set_policy`] (a follower's too) forgets every entry.
//!
//! Exactness assumes the store keeps what it decided. A store that loses its buckets — a Redis
//! restarted without persistence, a failover that drops unreplicated writes, `FLUSHDB`, an
//! eviction under `maxmemory` — would admit the key at once, while the cache keeps denying it
//! until the cached deadline at the latest: as if the lost bucket were still there.
//!
//! Invalidation across processes: a policy change made through another instance reaches this
//! one as a publication in the policy registry, which its follower applies (the entry no
//! longer matches the policy); a reset reaches it when made through
//! [`crate::registry::PolicyFollower::reset`], which announces it to every follower of the name. A reset
//! made only through another instance's [`crate::Limiter::reset`] does not reach this cache,
//! which then keeps denying the key until the cached deadline at the latest.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use tollgate_core::{Algorithm, Decision, Key, Policy};

use crate::log_throttle::Gate;

struct Entry {
    until: Instant,
    cost: u64,
    policy: (Algorithm, u64),
    limit: u64,
    remaining: u64,
    reset_until: Instant,
}

pub(crate) struct DenyCache {
    entries: DashMap<Key, Entry, foldhash::fast::RandomState>,
    max_entries: usize,
    /// Bumped by every [`DenyCache::remove`] (a reset), before the entry goes: a denial decided
    /// before the reset but answered after it must not be cached again.
    epoch: AtomicU64,
    /// Lets a full cache be swept at most once per [`FULL_SWEEP_GAP`]: a sweep walks every
    /// entry under every shard's write lock, and a flood of new denied keys must not pay one
    /// per denial.
    sweeps: Gate,
}

/// Least time between two sweeps of a full cache (as `LocalStore`'s sweep at its key cap).
const FULL_SWEEP_GAP: Duration = Duration::from_millis(100);

impl DenyCache {
    pub(crate) fn new(max_entries: usize) -> Self {
        Self {
            entries: DashMap::with_hasher(foldhash::fast::RandomState::default()),
            max_entries,
            epoch: AtomicU64::new(0),
            sweeps: Gate::new(FULL_SWEEP_GAP),
        }
    }

    /// The epoch to pass to [`DenyCache::insert`]: read before the store is called.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// A denial for `cost` on `key`, if one of that cost is cached and still in force at `now`.
    pub(crate) fn lookup(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u64,
        now: Instant,
    ) -> Option<Decision> {
        let hit = {
            let e = self.entries.get(key)?;
            if now < e.until && cost == e.cost && same_policy(&e.policy, policy) {
                Some(Decision {
                    allowed: false,
                    limit: e.limit,
                    remaining: e.remaining,
                    retry_after: Some(e.until - now),
                    reset_after: e.reset_until.saturating_duration_since(now),
                    enforcement: tollgate_core::Enforcement::Shared,
                })
            } else {
                None
            }
        };
        if hit.is_none() {
            self.entries.remove_if(key, |_, e| {
                now >= e.until || !same_policy(&e.policy, policy)
            });
        }
        hit
    }

    /// A shared decision on `key` for a request of `cost` sent at `sent`: a denial is remembered
    /// ([`DenyCache::insert`]), an admission drops the key's entry ([`DenyCache::admitted`]).
    pub(crate) fn record(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u64,
        decision: &Decision,
        sent: (Instant, u64),
    ) {
        if decision.allowed {
            self.admitted(key);
        } else {
            self.insert(key, policy, cost, decision, sent);
        }
    }

    /// Remembers a shared denial of `cost` on `key` for a request sent at `sent`, when the
    /// epoch read before sending ([`DenyCache::epoch`]) is still current: no reset happened
    /// while the request was in flight.
    pub(crate) fn insert(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u64,
        decision: &Decision,
        (sent, epoch): (Instant, u64),
    ) {
        let Some(retry) = decision.retry_after else {
            return;
        };
        if retry < MIN_WORTH_CACHING {
            return;
        }
        if self.entries.len() >= self.max_entries {
            // Full: drop what has lapsed (at most once per gap); if nothing has, or a sweep is
            // not due, do not cache (never unbounded, and never a sweep per denial).
            let now = Instant::now();
            if !self.sweeps.pass(now) {
                return;
            }
            self.entries.retain(|_, e| now < e.until);
            if self.entries.len() >= self.max_entries {
                return;
            }
        }
        // A wait past what an `Instant` can hold (a custom store's "never") is not cached.
        let Some(until) = sent.checked_add(retry) else {
            return;
        };
        let entry = Entry {
            until,
            cost,
            policy: (*policy.algorithm(), policy.generation()),
            limit: decision.limit,
            remaining: decision.remaining,
            reset_until: sent.checked_add(decision.reset_after).unwrap_or(until),
        };
        let slot = self.entries.entry(key.clone());
        // Checked under the entry's lock: a reset bumps the epoch before it takes that lock to
        // remove the entry, so either this sees the bump or the reset removes what this writes.
        if self.epoch.load(Ordering::SeqCst) != epoch {
            return;
        }
        // The newest denial replaces any other: of the same cost, it is as exact; of another,
        // it is the cost being asked for now.
        slot.insert(entry);
    }

    /// Forgets `key`'s denial, and any denial of it still in flight (see `epoch`).
    pub(crate) fn remove(&self, key: &Key) {
        self.remove_encoded(key.as_str());
    }

    /// [`DenyCache::remove`] by the key's encoded string (a reset announced by another
    /// process).
    pub(crate) fn remove_encoded(&self, key: &str) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.entries.remove(key);
    }

    /// The store admitted a request on `key`: its cached denial (of another cost) no longer
    /// tells what the store holds (the admission consumed), so it goes. A denial of it still in
    /// flight may be cached after: it was decided after this admission's state, or before it
    /// and then denied no longer than the store would.
    pub(crate) fn admitted(&self, key: &Key) {
        self.entries.remove(key.as_str());
    }

    /// Forgets every denial, and any still in flight: the limiter's policy changed, so no
    /// entry can answer again under it, and an entry kept until its deadline would answer
    /// again if the policy were switched back after the store had moved on.
    pub(crate) fn clear(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.entries.clear();
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Denials shorter than this are not worth an entry.
const MIN_WORTH_CACHING: Duration = Duration::from_millis(1);

/// Whether `policy` is the one an entry was cached under (`held`: its parameters and
/// generation), compared whole, in place (a 64-bit fingerprint can collide: two policies were
/// found sharing one).
fn same_policy(held: &(Algorithm, u64), policy: &Policy) -> bool {
    held.1 == policy.generation() && held.0 == *policy.algorithm()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::Rate;

    fn denial(retry_ms: u64) -> Decision {
        Decision::shared(false, 10, 0, Some(retry_ms * 1000), 10_000_000)
    }

    /// Two different policies share a 64-bit fingerprint (found by a search of ~2^32): a
    /// denial cached under one was answered to a caller under the other. Policies are told
    /// apart by their parameters.
    #[test]
    fn policies_sharing_a_fingerprint_are_told_apart() {
        let a =
            Policy::fixed_window(3_928_004_845_408_457, Duration::from_micros(2_145_000)).unwrap();
        let b =
            Policy::fixed_window(1_640_616_228_938_848, Duration::from_micros(3_174_000)).unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint(), "the colliding pair");
        let cache = DenyCache::new(100);
        let key = Key::new("op", ["k"]).unwrap();
        let t0 = Instant::now();
        cache.insert(&key, &a, 3, &denial(500), (t0, 0));
        assert!(
            cache.lookup(&key, &b, 3, t0).is_none(),
            "denied under another policy"
        );
        cache.insert(&key, &a, 3, &denial(500), (t0, 0));
        assert!(cache.lookup(&key, &a, 3, t0).is_some());
    }

    /// A custom store's "never" (`Duration::MAX`) overflowed `Instant + retry` and panicked
    /// the limiter when the denial was cached; it is not cached.
    #[test]
    fn a_wait_past_any_instant_is_not_cached() {
        let cache = DenyCache::new(100);
        let key = Key::new("op", ["k"]).unwrap();
        let p = Policy::token_bucket(10, Rate::per_second(1)).unwrap();
        let mut never = denial(500);
        never.retry_after = Some(Duration::MAX);
        never.reset_after = Duration::MAX;
        cache.insert(&key, &p, 3, &never, (Instant::now(), 0));
        assert!(cache.lookup(&key, &p, 3, Instant::now()).is_none());
        let mut long_reset = denial(500);
        long_reset.reset_after = Duration::MAX;
        cache.insert(&key, &p, 3, &long_reset, (Instant::now(), 0));
        assert!(cache.lookup(&key, &p, 3, Instant::now()).is_some());
    }

    #[test]
    fn answers_the_same_cost_until_the_deadline_then_forgets() {
        let cache = DenyCache::new(100);
        let key = Key::new("op", ["k"]).unwrap();
        let p = Policy::token_bucket(10, Rate::per_second(1)).unwrap();
        let t0 = Instant::now();
        cache.insert(&key, &p, 3, &denial(500), (t0, 0));
        let hit = cache
            .lookup(&key, &p, 3, t0 + Duration::from_millis(100))
            .unwrap();
        assert_eq!(hit.retry_after, Some(Duration::from_millis(400)));
        assert!(
            cache.lookup(&key, &p, 5, t0).is_none(),
            "a larger cost waits longer: the store says how long"
        );
        assert!(
            cache.lookup(&key, &p, 2, t0).is_none(),
            "a smaller cost may fit"
        );
        assert!(
            cache
                .lookup(&key, &p, 3, t0 + Duration::from_millis(500))
                .is_none()
        );
        assert_eq!(cache.len(), 0, "a lapsed entry is dropped");
    }

    #[test]
    fn a_policy_change_invalidates() {
        let cache = DenyCache::new(100);
        let key = Key::new("op", ["k"]).unwrap();
        let p = Policy::token_bucket(10, Rate::per_second(1)).unwrap();
        let t0 = Instant::now();
        cache.insert(&key, &p, 1, &denial(500), (t0, 0));
        assert!(cache.lookup(&key, &p.with_generation(1), 1, t0).is_none());
        let bigger = Policy::token_bucket(20, Rate::per_second(1)).unwrap();
        cache.insert(&key, &p, 1, &denial(500), (t0, 0));
        assert!(cache.lookup(&key, &bigger, 1, t0).is_none());
    }

    #[test]
    fn a_denial_decided_before_a_reset_is_not_cached_after_it() {
        let cache = DenyCache::new(100);
        let key = Key::new("op", ["k"]).unwrap();
        let p = Policy::token_bucket(10, Rate::per_second(1)).unwrap();
        let t0 = Instant::now();
        let before = cache.epoch();
        cache.remove(&key); // the reset lands while the denied request is in flight
        cache.insert(&key, &p, 1, &denial(500), (t0, before));
        assert!(cache.lookup(&key, &p, 1, t0).is_none());
        cache.insert(&key, &p, 1, &denial(500), (t0, cache.epoch()));
        assert!(cache.lookup(&key, &p, 1, t0).is_some(), "a later denial is");
    }

    #[test]
    fn never_grows_past_its_cap() {
        let cache = DenyCache::new(2);
        let p = Policy::token_bucket(10, Rate::per_second(1)).unwrap();
        let t0 = Instant::now();
        for i in 0..10 {
            cache.insert(
                &Key::new("op", [format!("{i}")]).unwrap(),
                &p,
                1,
                &denial(500),
                (t0, 0),
            );
        }
        assert_eq!(cache.len(), 2);
    }

    /// A full cache is swept (a walk of every entry under every shard's write lock) at most
    /// once per gap, not on every further denial: a flood of new denied keys cost ~190 µs per
    /// denial at 100,000 entries when each one swept.
    #[test]
    fn a_full_cache_is_swept_at_most_once_per_gap() {
        let cache = DenyCache::new(1);
        let t = cache.sweeps.epoch;
        assert!(cache.sweeps.pass(t), "the first sweep is due at once");
        assert!(!cache.sweeps.pass(t), "not again at once");
        assert!(!cache.sweeps.pass(t + Duration::from_micros(99_999)));
        assert!(cache.sweeps.pass(t + FULL_SWEEP_GAP));
        assert!(
            !cache
                .sweeps
                .pass(t + FULL_SWEEP_GAP + Duration::from_millis(1))
        );
    }
}
