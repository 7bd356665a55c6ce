//! [`LocalStore`]: buckets in a sharded in-process map, each decision made by the core maths
//! under the shard's lock. Bounded by a key cap and an amortised sweep of expired buckets.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use async_trait::async_trait;
use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use tollgate_core::algorithm;
use tollgate_core::{
    Acquire, Algorithm, Batch, Clock, Decision, Key, MonotonicClock, Policy, Store, StoreError,
};

use crate::bucket::{Bucket, LendNote, ParamsTable};
use crate::lent::{DecideLent, Held, LentTable, SlotKey};

/// Default cap on the number of keys held at once.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Default number of new keys between two sweeps of expired buckets (the interval grows with
/// the number of live keys, so a sweep's cost is amortised over as many inserts as it visits).
pub const DEFAULT_SWEEP_EVERY: usize = 4_096;

/// At the key cap, a new key triggers at most one sweep per this many milliseconds of the
/// store's clock, so a flood of new keys against a full map of live buckets cannot turn every
/// refused request into a walk over the whole map.
pub const CAP_SWEEP_GAP_MS: u64 = 100;

/// The periodic sweep (every so many new keys) runs at most once per this many milliseconds
/// of the store's clock, as Redis's active expiry runs ten times a second: keys whose buckets
/// expire between two visits (a generous policy refills them within a visit) are then reused
/// in place rather than removed and inserted again at every visit. A sweep that falls due
/// within the gap waits for the first new key after it. Sweeps run on new keys only: a store
/// whose set of keys stops growing keeps its expired buckets (reused in place when their keys
/// come back) until new keys arrive, the key cap is reached, or
/// [`LocalStore::sweep_expired`] is called.
pub const SWEEP_GAP_MS: u64 = 100;

/// An in-process [`Store`]: per-process state, atomic per key, time from a [`Clock`].
///
/// Each decision runs [`tollgate_core::algorithm::apply`] while holding the lock of the map
/// shard that holds the key, so concurrent calls on one key are serialised and can never spend
/// the same allowance twice. A hot token bucket (called again within 100 µs, or run dry) is
/// lent to a small table of slots and decided there by the same maths without the shard's
/// lock: a denial writes nothing, an admission claims the slot with one compare-exchange that
/// fails if the bucket changed since it was read, so calls on it are serialised all the same.
/// Expiry follows Redis to the millisecond: a state written with a TTL of `ttl` µs at `now` µs
/// lives while `now_ms <= expires_at_ms(now, ttl)` ([`tollgate_core::algorithm::expires_at_ms`],
/// the `PXAT` the scripts set).
///
/// Memory is bounded: expired buckets are swept every [`DEFAULT_SWEEP_EVERY`] new keys (or
/// as configured), at most once per [`SWEEP_GAP_MS`] of the store's clock, and at most
/// `max_keys` buckets are held. At the cap, a new key first
/// triggers a sweep of expired buckets (at most one per [`CAP_SWEEP_GAP_MS`]); if the map is
/// still full the new key is refused with [`StoreError::KeyCapReached`], while keys already
/// held keep working.
///
/// A token bucket or fixed window is held in a compact form (a 32-byte map entry with its
/// key) whose generation and parameters are interned once per store, for the first 64
/// distinct (generation, parameters) pairs the store meets; the table is never emptied, so a
/// bucket of a later pair is held in the full form (measured by a review: 54 bytes per new key
/// on a fresh store, 182 once 64 generations had been seen) and takes the general path, which
/// decides alike. A store that follows a registry publishing a new generation every minute
/// reaches that within the hour: give such a process a new store now and then, or publish less
/// often. Reclaiming entries no bucket refers to needs a scan that sees every bucket, lent ones
/// included, while no writer holds an index it read before: not done.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::{Key, ManualClock, Policy};
/// use tollgate_local::LocalStore;
///
/// let clock = ManualClock::new(1_700_000_000_000_000);
/// let store = LocalStore::builder().max_keys(10_000).clock(clock.clone()).build();
/// let policy = Policy::fixed_window(2, Duration::from_secs(1)).unwrap();
/// let key = Key::new("login", ["alice"]).unwrap();
///
/// assert!(store.acquire_now(&key, &policy, 2).unwrap().allowed);
/// assert!(!store.acquire_now(&key, &policy, 1).unwrap().allowed);
/// clock.advance(Duration::from_secs(1));
/// assert!(store.acquire_now(&key, &policy, 1).unwrap().allowed);
/// assert_eq!(store.len(), 1);
/// ```
pub struct LocalStore<C = MonotonicClock> {
    /// foldhash rather than SipHash: it halves the cost of a hot-key decision, and its
    /// per-map random seed still keeps user-chosen keys from being aimed at one bucket chain.
    map: DashMap<Key, Bucket, foldhash::fast::RandomState>,
    /// The generations and parameters the map's compact buckets refer to.
    params: ParamsTable,
    /// Hot token buckets lent out of the map, decided without the shard's lock
    /// ([`crate::lent`]).
    pub(crate) lent: LentTable,
    clock: C,
    max_keys: usize,
    sweep_every: usize,
    /// Counters written by inserts and sweeps, on their own cache lines: a new key on one
    /// thread must not invalidate the line every other thread reads the map and clock from.
    counters: Counters,
}

/// The units per token of a token-bucket `policy`, 0 for another algorithm: what
/// [`Bucket::lendable`] compares a bucket's level with (and 0 lends nothing).
fn token_unit(policy: &Policy) -> u64 {
    match policy.algorithm() {
        Algorithm::TokenBucket(p) => p.unit,
        _ => 0,
    }
}

/// A call's decision on its lent bucket ([`Bucket::decide_on`]), always inlined into the slot
/// table's first attempt: as a closure it was left out of line, and the state and decision
/// passed through memory cost ~12 ns per hot-key call (criterion, AMD host).
struct OnLent<'a> {
    params: &'a ParamsTable,
    policy: &'a Policy,
    now: u64,
    cost: u64,
}

impl DecideLent<Decision> for OnLent<'_> {
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn decide_lent(&self, p: Held) -> Option<(Decision, Option<Held>)> {
        Bucket::decide_on(p, self.params, self.policy, self.now, self.cost)
    }
}

/// A bucket under its shard's lock, taken back if it was lent, that lends itself to its slot
/// when dropped if it is worth it ([`Bucket::lendable`]), before the lock goes.
struct Lending<'a> {
    lent: &'a LentTable,
    params: &'a ParamsTable,
    bucket: &'a mut Bucket,
    key: &'a Key,
    /// The caller's units per token (0 for another algorithm).
    unit: u64,
    now: u64,
    /// What the call saw of the bucket ([`Bucket::apply_noting`]).
    note: LendNote,
}

impl Drop for Lending<'_> {
    #[allow(clippy::inline_always)] // on every call under the lock of a key with a slot
    #[inline(always)]
    fn drop(&mut self) {
        // Most calls over many keys stop here: the key's slot is not even computed. (The rest
        // is out of line, so that this test is inlined where the guard drops.)
        if self.note.maybe {
            self.lend();
        }
    }
}

impl Lending<'_> {
    /// Lends the bucket if it is worth it: the part of the drop for a bucket that may be.
    #[inline(never)]
    fn lend(&mut self) {
        if let Some(slot_key) = SlotKey::new(self.key.as_str().as_bytes()) {
            lend_if_worth(
                self.lent,
                self.params,
                self.bucket,
                slot_key,
                self.unit,
                self.now,
                self.note.hot,
            );
        }
    }
}

/// [`lend_if_worth`] out of line, for the fast path's call whose slot may take its bucket
/// ([`LentTable::may_take`], asked first): over many dry keys most slots hold live states of
/// others, and the caller stops at the tag.
#[cold]
#[inline(never)]
fn lend_cold(
    lent: &LentTable,
    params: &ParamsTable,
    bucket: &mut Bucket,
    slot_key: SlotKey<'_>,
    unit: u64,
    now: u64,
    hot: bool,
) {
    lend_if_worth(lent, params, bucket, slot_key, unit, now, hot);
}

/// Under the key's shard lock, after a call: lends `bucket` to its slot if it is worth it
/// ([`Bucket::lendable`]) and the slot takes it (asked first of its tag word,
/// [`LentTable::may_take`]: over many hot or dry keys most slots hold live states of others).
#[allow(clippy::inline_always)] // see `Lending`
#[inline(always)]
fn lend_if_worth(
    lent: &LentTable,
    params: &ParamsTable,
    bucket: &mut Bucket,
    slot_key: SlotKey<'_>,
    unit: u64,
    now: u64,
    hot: bool,
) {
    if let Some(p) = bucket.lendable(params, unit, now, hot, || {
        lent.may_take(slot_key, now / 1000)
    }) && lent.lend(slot_key, &p, now / 1000)
    {
        bucket.mark_lent();
    }
}

/// A [`LocalStore`]'s write-shared counters, aligned to 128 bytes (a pair of cache lines, as
/// adjacent-line prefetchers fetch them) so that nothing read on every call shares their line.
#[repr(align(128))]
struct Counters {
    /// Entries in `map`; slots are reserved here before an insert so the cap is exact.
    keys: AtomicUsize,
    /// New keys since the last sweep, and how many trigger the next one.
    inserts: AtomicUsize,
    sweep_threshold: AtomicUsize,
    /// Set while one thread sweeps; others skip rather than queue behind it.
    sweeping: AtomicBool,
    /// Clock (ms) of the last sweep started because the map was full; `u64::MAX` for never.
    last_cap_sweep_ms: AtomicU64,
    /// Clock (ms) of the last periodic sweep; `u64::MAX` for never.
    last_sweep_ms: AtomicU64,
}

/// Options for a [`LocalStore`]; start from [`LocalStore::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct LocalStoreBuilder<C = MonotonicClock> {
    clock: C,
    max_keys: usize,
    sweep_every: usize,
}

impl LocalStore<MonotonicClock> {
    /// A store on the system clock with default options.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Options for a store, starting from the defaults (system clock,
    /// [`DEFAULT_MAX_KEYS`], [`DEFAULT_SWEEP_EVERY`]).
    pub fn builder() -> LocalStoreBuilder<MonotonicClock> {
        LocalStoreBuilder {
            clock: MonotonicClock::new(),
            max_keys: DEFAULT_MAX_KEYS,
            sweep_every: DEFAULT_SWEEP_EVERY,
        }
    }
}

impl Default for LocalStore<MonotonicClock> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> LocalStoreBuilder<C> {
    /// The most keys held at once. At the cap a new key is refused with
    /// [`StoreError::KeyCapReached`] once expired buckets have been swept; `0` refuses every
    /// key.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// New keys between two sweeps of expired buckets, at least (the interval also grows to the
    /// number of live keys found by the last sweep, and two sweeps are at least
    /// [`SWEEP_GAP_MS`] apart). `0` is taken as `1`.
    pub fn sweep_every(mut self, inserts: usize) -> Self {
        self.sweep_every = inserts.max(1);
        self
    }

    /// The clock decisions are made on.
    pub fn clock<C2: Clock>(self, clock: C2) -> LocalStoreBuilder<C2> {
        LocalStoreBuilder {
            clock,
            max_keys: self.max_keys,
            sweep_every: self.sweep_every,
        }
    }

    /// The store.
    pub fn build(self) -> LocalStore<C> {
        LocalStore {
            map: DashMap::with_hasher_and_shard_amount(
                foldhash::fast::RandomState::default(),
                shard_amount(),
            ),
            params: ParamsTable::new(),
            lent: LentTable::new(),
            clock: self.clock,
            max_keys: self.max_keys,
            sweep_every: self.sweep_every,
            counters: Counters {
                keys: AtomicUsize::new(0),
                inserts: AtomicUsize::new(0),
                sweep_threshold: AtomicUsize::new(self.sweep_every),
                sweeping: AtomicBool::new(false),
                last_cap_sweep_ms: AtomicU64::new(u64::MAX),
                last_sweep_ms: AtomicU64::new(u64::MAX),
            },
        }
    }
}

impl<C: Clock> LocalStore<C> {
    /// A store on `clock` with default options.
    pub fn with_clock(clock: C) -> Self {
        LocalStore::builder().clock(clock).build()
    }

    /// Applies `cost` to `key` under `policy` now and returns the decision: the synchronous form
    /// of [`Store::acquire`], with the same semantics.
    ///
    /// Does not allocate for a token bucket or fixed window already held.
    pub fn acquire_now(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        policy.check_cost(cost)?;
        // Time is read before the shard's lock is taken, so the lock is held for the maths
        // alone. A call that read its time before another call on the same key decided may
        // then decide after it with an older time: the maths treats that as a clock a little
        // behind the bucket's (the effective time is `max(now, stored time)`), never crediting
        // time twice, and retry/reset stay exact on the caller's clock. That holds while the
        // bucket is there; a call that finds it gone reads its time again under the lock
        // (`acquire_new`, `apply_lending`).
        let now = self.clock.now_micros();
        // A key short enough for the slot table: a token bucket's call first tries its slot
        // (`unit` > 0); any call may find its bucket lent there, or lend it.
        let unit = token_unit(policy);
        // Until a bucket is lent the slot table is empty, and the key's slot is not computed.
        if unit > 0
            && self.lent.ever_lent()
            && let Some(slot_key) = SlotKey::new(key.as_str().as_bytes())
            && let Some(d) = self.lent.decide(
                slot_key,
                &OnLent {
                    params: &self.params,
                    policy,
                    now,
                    cost,
                },
            )
        {
            return Ok(d);
        }
        if let Some(mut bucket) = self.map.get_mut(key) {
            // The common call, a live token bucket whose parameters govern it: the state is
            // written under the shard's lock and the decision built once the lock is released,
            // so the lock is held for the state alone; no lending guard unless it may lend.
            // (~12 % fewer instructions over 100,000 keys than through `apply_lending`, the
            // time unchanged on the AMD host: BENCHMARKS.md, "Instruction parity".)
            if let Some(f) = bucket.fast_token_bucket(&self.params, policy, now, cost, unit) {
                // Lent, if worth it and its slot takes it, under the lock (the slot's tag word
                // first). The key's slot is computed again rather than kept from the attempt
                // above: kept, it cost a hot key's lent calls ~20 instructions more than it
                // saves a dry key's here (cachegrind).
                if f.note.maybe
                    && let Some(slot_key) = SlotKey::new(key.as_str().as_bytes())
                    && self.lent.may_take(slot_key, now / 1000)
                {
                    lend_cold(
                        &self.lent,
                        &self.params,
                        &mut bucket,
                        slot_key,
                        unit,
                        now,
                        f.note.hot,
                    );
                }
                drop(bucket);
                return Ok(f.step.decision(f.p, now));
            }
            return self.apply_lending(&mut bucket, key, unit, policy, now, cost, true);
        }
        self.acquire_new(key, policy, cost, now)
    }

    /// [`Bucket::apply`] under the shard's lock; for a key that has a slot, takes a lent
    /// bucket back first, and lends it after the call if it is worth it
    /// ([`Bucket::lendable`]). `tried_fast`: the caller's [`Bucket::fast_token_bucket`] found
    /// nothing to decide on this bucket as it is (not tried again unless the bucket was lent).
    /// Always inlined: its key passed through memory costs a store-forwarding stall per call.
    #[allow(clippy::inline_always, clippy::too_many_arguments)]
    #[inline(always)]
    fn apply_lending(
        &self,
        bucket: &mut Bucket,
        key: &Key,
        unit: u64,
        policy: &Policy,
        now: u64,
        cost: u64,
        tried_fast: bool,
    ) -> Result<Decision, StoreError> {
        // A lent bucket was not the caller's to try: taken back, it may be.
        let tried_fast = tried_fast && !bucket.is_lent();
        self.settle(key, bucket);
        // A bucket gone since this call read its time (its slot taken over by another key,
        // which may happen once it expired, at that call's later time) is decided at a time
        // read now, under the shard's lock: a fresh bucket at the older time would credit
        // the refill up to the expiry twice (as in `acquire_new`).
        let now = if bucket.holds_record() {
            now
        } else {
            now.max(self.clock.now_micros())
        };
        // Lent, if worth it, when `lending` drops: after the decision is in the caller's
        // hands. Returned through a copy instead, the decision costs a store-forwarding stall
        // (half of this function's time over 1,000 keys, perf).
        let mut lending = Lending {
            lent: &self.lent,
            params: &self.params,
            bucket,
            key,
            unit,
            now,
            note: LendNote::default(),
        };
        lending.bucket.apply_noting(
            &self.params,
            policy,
            now,
            cost,
            unit,
            tried_fast,
            &mut lending.note,
        )
    }

    /// Takes `bucket` back from its slot if it is lent there (under the shard's lock).
    #[inline]
    fn settle(&self, key: &Key, bucket: &mut Bucket) {
        if bucket.is_lent()
            && let Some(slot_key) = SlotKey::new(key.as_str().as_bytes())
        {
            bucket.restore(self.lent.take_back(slot_key));
        }
    }

    /// The slow path for a key not in the map: clones the key and reserves a slot under the cap.
    #[cold]
    fn acquire_new(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u64,
        now: u64,
    ) -> Result<Decision, StoreError> {
        let slot_key = SlotKey::new(key.as_str().as_bytes());
        let unit = token_unit(policy);
        let mut swept = false;
        loop {
            match self.map.entry(key.clone()) {
                Entry::Occupied(mut held) => {
                    return self.apply_lending(held.get_mut(), key, unit, policy, now, cost, false);
                }
                Entry::Vacant(vacant) => {
                    // A missing bucket decided on before it is inserted: held only if the
                    // decision wrote a state (with its expiry). Its time is read again here,
                    // under the shard's lock: the bucket may have been removed (swept, dropped
                    // as expired by a peek, its lent state lost to another key's takeover and
                    // its entry swept) since this call read its time, by a call at a later
                    // time, past its expiry; a fresh bucket at the older time would credit
                    // the refill up to the expiry twice. (Gating the read on the removals'
                    // recorded times missed the takeover, whose time no removal records.)
                    let now = now.max(self.clock.now_micros());
                    let mut bucket = Bucket::missing();
                    let decision = bucket.apply(&self.params, policy, now, cost)?;
                    if !bucket.holds_record() {
                        return Ok(decision);
                    }
                    if self.reserve_slot() {
                        if let Some(slot_key) = slot_key {
                            lend_if_worth(
                                &self.lent,
                                &self.params,
                                &mut bucket,
                                slot_key,
                                unit,
                                now,
                                false,
                            );
                        }
                        drop(vacant.insert(bucket));
                        self.after_insert(now);
                        return Ok(decision);
                    }
                    // Release the shard before sweeping: the sweep locks every shard in turn.
                    drop(vacant);
                    if swept || !self.sweep_at_cap(now) {
                        return Err(StoreError::KeyCapReached { cap: self.max_keys });
                    }
                    swept = true;
                }
            }
        }
    }

    /// What [`LocalStore::acquire_now`] would decide for `cost` now, without consuming
    /// anything: the synchronous form of [`Store::peek`].
    pub fn peek_now(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        policy.check_cost(cost)?;
        let now = match self.map.get(key) {
            None => self.clock.now_micros(),
            Some(held) => {
                let now = self.clock.now_micros();
                // A lent bucket is read from its slot (consistently, without taking it back).
                let copy;
                let bucket = if held.is_lent() {
                    let slot_key = SlotKey::new(key.as_str().as_bytes());
                    copy = Bucket::of_held(slot_key.and_then(|k| self.lent.read(k)));
                    &copy
                } else {
                    &*held
                };
                if bucket.is_alive(&self.params, now / 1000) {
                    let mut state = bucket.record(&self.params);
                    let runs_out = algorithm::runs_out_at_expiry(state.as_ref(), policy, now);
                    let mut decision =
                        algorithm::apply(&mut state, policy, now, cost, false)?.decision;
                    if runs_out {
                        algorithm::cap_at_expiry(
                            &mut decision,
                            now,
                            bucket.expires_at_ms(&self.params),
                        );
                    }
                    return Ok(decision);
                }
                now
            }
        };
        // Seen expired: drop it, as Redis drops an expired key it reads, so that a clock stepping
        // back cannot bring it back.
        self.remove_if_expired(key, now);
        let mut missing = None;
        Ok(algorithm::apply(&mut missing, policy, now, cost, false)?.decision)
    }

    /// Forgets the bucket of `key`: the next call sees a fresh bucket. Returns whether a bucket
    /// was held (alive or not yet swept). The synchronous form of [`Store::reset`].
    ///
    /// `key` is a [`Key`] or its encoded string ([`Key::as_str`], as a reset announced by
    /// another process names it).
    ///
    /// ```
    /// use tollgate_core::{Key, Policy, Rate};
    /// use tollgate_local::LocalStore;
    ///
    /// let store = LocalStore::new();
    /// let policy = Policy::token_bucket(1, Rate::per_second(1)).unwrap();
    /// let key = Key::new("login", ["alice"]).unwrap();
    /// store.acquire_now(&key, &policy, 1).unwrap();
    /// assert!(store.reset_now(key.as_str()));
    /// assert!(!store.reset_now(&key));
    /// ```
    pub fn reset_now<Q>(&self, key: &Q) -> bool
    where
        Key: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        // a lent bucket is taken back (its slot emptied) before it goes
        let removed = self
            .map
            .remove_if_mut(key, |k, b| {
                self.settle(k, b);
                true
            })
            .is_some();
        if removed {
            self.counters.keys.fetch_sub(1, Ordering::AcqRel);
        }
        removed
    }

    /// Applies each request in order, each atomically, with one result per request; if any
    /// request is invalid nothing is applied. The synchronous form of [`Store::acquire_many`].
    ///
    /// A request for a new key when the store is at its cap gets
    /// [`StoreError::KeyCapReached`]; the requests around it are decided as usual.
    pub fn acquire_many_now(&self, requests: &[Acquire<'_>]) -> Result<Batch, StoreError> {
        for r in requests {
            r.policy.check_cost(r.cost)?;
        }
        Ok(requests
            .iter()
            .map(|r| self.acquire_now(r.key, r.policy, r.cost))
            .collect())
    }

    /// Removes every expired bucket now and returns how many this call removed (a sweep
    /// already under way is waited for first). Runs by itself every so many new keys; call it
    /// from a background task to keep memory tighter.
    pub fn sweep_expired(&self) -> usize {
        self.sweep_after_any(self.clock.now_micros() / 1000)
    }

    /// Buckets held, including expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.counters.keys.load(Ordering::Acquire)
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The configured key cap.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// The store's clock.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    fn reserve_slot(&self) -> bool {
        self.counters
            .keys
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_keys).then_some(n + 1)
            })
            .is_ok()
    }

    fn remove_if_expired(&self, key: &Key, now_us: u64) {
        if self
            .map
            .remove_if_mut(key, |k, b| {
                self.settle(k, b);
                !b.is_alive(&self.params, now_us / 1000)
            })
            .is_some()
        {
            self.counters.keys.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn after_insert(&self, now_us: u64) {
        let inserted = self.counters.inserts.fetch_add(1, Ordering::AcqRel) + 1;
        if inserted < self.counters.sweep_threshold.load(Ordering::Acquire) {
            return;
        }
        let now_ms = now_us / 1000;
        if claim_gap(&self.counters.last_sweep_ms, now_ms, SWEEP_GAP_MS) {
            self.sweep(now_ms);
        }
    }

    /// At the cap: sweeps unless a cap sweep ran within [`CAP_SWEEP_GAP_MS`]. Returns whether
    /// the caller should try to reserve a slot once more: a slot was freed, or another call's
    /// cap sweep within the gap has freed what it could. The gap is claimed only while this
    /// call holds the sweep, so a call that finds it claimed knows that sweep has finished (no
    /// walk is started for it: a flood of new keys cannot turn into one walk each).
    fn sweep_at_cap(&self, now_us: u64) -> bool {
        let now_ms = now_us / 1000;
        if !self.hold_sweep_waiting() {
            return true;
        }
        if !claim_gap(&self.counters.last_cap_sweep_ms, now_ms, CAP_SWEEP_GAP_MS) {
            self.counters.sweeping.store(false, Ordering::Release);
            return true;
        }
        self.sweep_held(now_ms) > 0
    }

    /// Sweeps at `now_ms`; if another sweep is under way (periodic, at the cap or a caller's
    /// [`LocalStore::sweep_expired`], perhaps at an older time), waits for it and then sweeps.
    /// Returns how many buckets this call removed.
    fn sweep_after_any(&self, now_ms: u64) -> usize {
        if self.hold_sweep_waiting() {
            self.sweep_held(now_ms)
        } else {
            0
        }
    }

    /// Takes the sweep, waiting for any under way first. Sweeps starting back to back could
    /// hold a caller off for ever: after three tries it gives up (`false`), and takes what the
    /// others removed for its own.
    fn hold_sweep_waiting(&self) -> bool {
        for _ in 0..3 {
            if self.try_hold_sweep() {
                return true;
            }
            self.wait_for_sweep();
        }
        false
    }

    /// Waits until no sweep is under way.
    fn wait_for_sweep(&self) {
        while self.counters.sweeping.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
    }

    /// Removes the buckets expired at `now_ms`; `None` if another thread is sweeping.
    fn sweep(&self, now_ms: u64) -> Option<usize> {
        self.try_hold_sweep().then(|| self.sweep_held(now_ms))
    }

    /// Takes the sweep (`sweeping`) if no other thread holds it.
    fn try_hold_sweep(&self) -> bool {
        self.counters
            .sweeping
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Removes the buckets expired at `now_ms`, with the sweep held; releases it (also if the
    /// walk unwinds, so no caller waits for a sweep that ended).
    fn sweep_held(&self, now_ms: u64) -> usize {
        struct Release<'a>(&'a AtomicBool);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let release = Release(&self.counters.sweeping);
        let mut removed = 0;
        self.map.retain(|k, b| {
            self.settle(k, b);
            let alive = b.is_alive(&self.params, now_ms);
            removed += usize::from(!alive);
            alive
        });
        // One update for the whole sweep rather than one contended atomic per bucket: until
        // it lands the count is above the map's size, never below, so the cap still holds.
        self.counters.keys.fetch_sub(removed, Ordering::AcqRel);
        self.counters.inserts.store(0, Ordering::Release);
        self.counters
            .sweep_threshold
            .store(self.sweep_every.max(self.len()), Ordering::Release);
        drop(release);
        removed
    }
}

/// Shards of a store's map, each behind its own lock: 32 per CPU, a power of two from 64 to
/// 1,024. A decision takes its shard's lock exclusively (it may write the bucket), where a
/// read-mostly map takes shared locks, so two threads that meet on one shard wait for each
/// other; dashmap's default (4 per CPU, 8 on two) made that common enough to cost two threads
/// over 100,000 keys ~20 % of their time, spent in the lock's slow path and `sched_yield`
/// (BENCHMARKS.md, "Two threads over 100,000 keys met"). Each shard's header takes a
/// 128-byte line of its own whether or not it holds keys: an empty store takes 8 KiB on two
/// CPUs and at most 128 KiB (32 CPUs or more), once per store (one per operation that
/// degrades to the local limiter). 256 shards on two CPUs cost one thread ~5 % over 100,000
/// keys against 64, so the count grows with the CPUs rather than being large everywhere.
fn shard_amount() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    cpus.saturating_mul(32).clamp(64, 1024).next_power_of_two()
}

/// Whether a sweep timed by `last` (the clock in ms of the last one, `u64::MAX` for never) is
/// due at `now_ms`, at least `gap_ms` after the last one or with the clock stepped back below
/// it; if so, records `now_ms` as the last one, for this caller only (the others lose the
/// exchange).
fn claim_gap(last: &AtomicU64, now_ms: u64, gap_ms: u64) -> bool {
    let prev = last.load(Ordering::Acquire);
    (now_ms < prev || now_ms - prev >= gap_ms)
        && last
            .compare_exchange(prev, now_ms, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
}

impl<C> fmt::Debug for LocalStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalStore")
            .field("len", &self.counters.keys.load(Ordering::Relaxed))
            .field("max_keys", &self.max_keys)
            .field("sweep_every", &self.sweep_every)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<C: Clock> Store for LocalStore<C> {
    async fn acquire(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.acquire_now(key, policy, cost)
    }

    async fn acquire_many(&self, requests: &[Acquire<'_>]) -> Result<Batch, StoreError> {
        self.acquire_many_now(requests)
    }

    async fn peek(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.peek_now(key, policy, cost)
    }

    async fn reset(&self, key: &Key, _policy: &Policy) -> Result<(), StoreError> {
        self.reset_now(key);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::hash::{DefaultHasher, Hash, Hasher};
    use std::time::Duration;

    use tollgate_core::algorithm::Record;
    use tollgate_core::{ManualClock, PolicyError, Rate, Transition};

    use crate::bucket::tests::{Rng, plain_apply, random_policy};

    /// The largest time a compact bucket holds (2^56 - 1 µs), as `bucket.rs` has it.
    const MAX_TIME: u64 = (1 << 56) - 1;

    /// A token-bucket policy from one of the shapes the fast paths must decide exactly: one
    /// token an hour (dry keys, lent), capacity 1, small and huge rates and capacities, a rate
    /// needing large units, a cap on credited time.
    fn token_policy(rng: &mut Rng) -> Policy {
        let p = match rng.below(8) {
            0 => Policy::token_bucket(1 + rng.below(3), Rate::new(1, Duration::from_secs(3600))),
            1 => Policy::token_bucket(1, Rate::per_second(1 + rng.below(3))),
            2 => Policy::token_bucket(2 + rng.below(8), Rate::per_second(1 + rng.below(1_000))),
            3 => Policy::token_bucket(
                1 + rng.below(1 << 30),
                Rate::new(
                    1 + rng.below(1 << 30),
                    Duration::from_millis(1 + rng.below(10)),
                ),
            ),
            4 => Policy::token_bucket(
                1 + rng.below(50),
                Rate::new(
                    1 + rng.below(7),
                    Duration::from_secs(1 + rng.below(10 * 365 * 24 * 3600)),
                ),
            ),
            5 => Policy::token_bucket(
                1 + rng.below(1_000),
                Rate::new(
                    1 + rng.below(1_000_000),
                    Duration::from_secs(1 + rng.below(7)),
                ),
            ),
            6 => Policy::token_bucket(1 + rng.below(20), Rate::new(7, Duration::from_secs(3)))
                .and_then(|p| p.with_max_elapsed(Duration::from_micros(1 + rng.below(3_000_000)))),
            _ => Policy::token_bucket(1 + rng.below(5), Rate::per_second(1 + rng.below(5)))
                .and_then(|p| p.with_max_elapsed(Duration::from_micros(1 + rng.below(2_000)))),
        };
        // a shape past 2^52 units (refused) falls back to a plain one
        let p = p.unwrap_or_else(|_| Policy::token_bucket(3, Rate::per_second(2)).unwrap());
        let rules = Transition::ALL;
        p.with_generation(rng.below(3))
            .with_transition(rules[rng.below(rules.len() as u64) as usize])
    }

    /// The record and expiry the store holds for `key` (read from its slot when lent), and
    /// whether it is lent.
    fn held<C: Clock>(store: &LocalStore<C>, key: &Key) -> (Option<Record>, u64, bool) {
        let Some(b) = store.map.get(key) else {
            return (None, 0, false);
        };
        let lent = b.is_lent();
        let copy;
        let b = if lent {
            let slot_key = SlotKey::new(key.as_str().as_bytes()).expect("a lent key has a slot");
            copy = Bucket::of_held(store.lent.read(slot_key));
            &copy
        } else {
            &*b
        };
        (
            b.record(&store.params),
            b.expires_at_ms(&store.params),
            lent,
        )
    }

    /// A seed's policies: token buckets of every shape, the first one's parameters under the
    /// next generation, other parameters under its generation, and every third seed a policy
    /// of any algorithm.
    fn policies(rng: &mut Rng, seed: u64) -> Vec<Policy> {
        let mut policies: Vec<Policy> = (0..2 + rng.below(3)).map(|_| token_policy(rng)).collect();
        // the same parameters under another generation, and other parameters under the
        // same generation
        let first = policies[0];
        policies.push(first.with_generation(first.generation() + 1));
        policies.push(
            token_policy(rng)
                .with_generation(first.generation())
                .with_transition(first.transition()),
        );
        if seed.is_multiple_of(3) {
            policies.push(random_policy(rng));
        }
        policies
    }

    /// Keys in slots of their own (and one too long for a slot), and two keys sharing the
    /// first one's slot.
    fn keys() -> (Vec<Key>, Vec<Key>) {
        let key = |part: String| Key::new("d", [part]).unwrap();
        // a key's slot, from `SlotKey`'s Debug form (its fields are the lent module's)
        let slot_of = |k: &Key| {
            SlotKey::new(k.as_str().as_bytes()).map(|s| {
                let shown = format!("{s:?}");
                let at = shown.find("slot: ").expect("SlotKey shows its slot") + 6;
                shown[at..]
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|n| n.parse::<usize>().ok())
                    .expect("a slot number")
            })
        };
        let mut taken = std::collections::HashSet::new();
        let mut apart: Vec<Key> = (0..)
            .map(|i| key(format!("k{i}")))
            .filter(|k| taken.insert(slot_of(k)))
            .take(40)
            .collect();
        apart.push(key("x".repeat(crate::lent::MAX_KEY)));
        let sharing: Vec<Key> = (0..)
            .map(|i| key(format!("s{i}")))
            .filter(|k| slot_of(k) == slot_of(&apart[0]))
            .take(2)
            .collect();
        (apart, sharing)
    }

    /// After a call at `now`: the store holds the model's record and expiry while the model's
    /// is alive, and nothing alive otherwise. Returns whether the key is lent.
    fn check_held<C: Clock>(
        store: &LocalStore<C>,
        key: &Key,
        plain: Option<&Record>,
        expiry: u64,
        now: u64,
        at: &str,
    ) -> bool {
        let (record, held_expiry, lent) = held(store, key);
        if plain.is_some() && now / 1000 <= expiry {
            assert_eq!(record.as_ref(), plain, "{at}: record");
            assert_eq!(held_expiry, expiry, "{at}: expiry");
        } else {
            assert!(
                record.is_none() || held_expiry < now / 1000,
                "{at}: alive in the store only: {record:?} until {held_expiry}"
            );
        }
        lent
    }

    /// `LocalStore::acquire_now` itself, over many keys (a few hot, most cold, one too long
    /// for a slot), against the core on a plain record with Redis's expiry (`plain_apply`):
    /// every decision equal, and after every call the record and expiry the store holds (in
    /// the map or in the key's slot) equal to the model's while the model's is alive. Policies
    /// of every shape on the same keys (capacity 1, cost = capacity, huge and tiny rates, a
    /// cap on credited time, other generations and parameters, other algorithms), a clock that
    /// stands still, creeps, jumps, steps back behind the buckets, and runs past 2^56 µs.
    /// Keys get slots of their own (a slot taken over from an expired state drops it, which a
    /// model whose clock steps back would bring back); odd seeds add two keys sharing one
    /// slot, with a clock that never steps back. Prints a digest of every decision and lend,
    /// to compare builds.
    #[test]
    fn acquire_now_decides_and_stores_exactly_as_the_core_over_many_keys() {
        let (apart, sharing) = keys();
        let (mut digest, mut calls, mut lent_calls, mut denials) =
            (DefaultHasher::new(), 0u64, 0u64, 0u64);
        for seed in 1..=400u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let mut keys = apart.clone();
            let back = if seed.is_multiple_of(2) {
                3_000_000
            } else {
                keys.extend(sharing.iter().cloned());
                0
            };
            let hot = 1 + rng.below(4) as usize;
            let mut now = if seed.is_multiple_of(5) {
                // past 2^56 µs within a few calls
                MAX_TIME - rng.below(30_000_000)
            } else {
                1_700_000_000_000_000 + rng.below(1 << 30)
            };
            let clock = ManualClock::new(now);
            let store = LocalStore::builder()
                .clock(clock.clone())
                .sweep_every(usize::MAX)
                .build();
            let policies = policies(&mut rng, seed);
            let mut model: HashMap<&Key, (Option<Record>, u64)> = HashMap::new();
            for step in 0..400 {
                let key = if rng.below(4) == 0 {
                    &keys[rng.below(keys.len() as u64) as usize]
                } else {
                    &keys[rng.below(hot as u64) as usize]
                };
                // a hot key keeps its policy for a while, so that its calls take the fast path
                let policy = if rng.below(8) == 0 {
                    &policies[rng.below(policies.len() as u64) as usize]
                } else {
                    &policies[(seed as usize + keys.iter().position(|k| k == key).unwrap())
                        % policies.len()]
                };
                now = match rng.below(20) {
                    0 => now - rng.below(back + 1),
                    1..=8 => now,
                    9..=15 => now + rng.below(300),
                    16 => now + rng.below(5_000),
                    17 | 18 => now + rng.below(2_000_000),
                    _ => now + rng.below(20_000_000),
                };
                clock.set(now);
                let at = format!("seed {seed} step {step}: {key:?} at {now} under {policy}");
                if rng.below(100) == 0 {
                    store.reset_now(key);
                    model.remove(key);
                    continue;
                }
                let limit = policy.limit();
                let cost = match rng.below(4) {
                    0 => limit,
                    1 => 1 + rng.below(limit),
                    _ => 1,
                };
                let got = store.acquire_now(key, policy, cost).map_err(|e| match e {
                    StoreError::InvalidPolicy(e) => e,
                    other => panic!("{at}: {other}"),
                });
                let (plain, expiry) = model.entry(key).or_insert((None, 0));
                let want: Result<Decision, PolicyError> =
                    plain_apply(plain, expiry, policy, now, cost);
                assert_eq!(got, want, "{at}");
                let lent = check_held(&store, key, plain.as_ref(), *expiry, now, &at);
                format!("{got:?}").hash(&mut digest);
                lent.hash(&mut digest);
                calls += 1;
                lent_calls += u64::from(lent);
                denials += u64::from(got.is_ok_and(|d| !d.allowed));
            }
        }
        eprintln!(
            "{calls} calls, {denials} denials, lent after {lent_calls}; digest {:016x}",
            digest.finish()
        );
        assert!(lent_calls > 20_000, "slots were in play: {lent_calls}");
        assert!(denials > 20_000, "denials were in play: {denials}");
    }
}
