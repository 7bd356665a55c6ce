//! One stored bucket and its expiry, kept in Redis's millisecond terms so the local store
//! expires keys exactly when a Redis server on the same clock would.
//!
//! A bucket holds a [`Record`] in one of two forms. The common records — a token bucket or a
//! fixed window with no pending policy change — are kept compact: the generation and parameters
//! that wrote them are interned once per store in a [`ParamsTable`], and the bucket keeps only
//! their index and the algorithm's two numbers (a map slot of 48 bytes with its key, against
//! 144 for a full `Record`). Anything else (a sliding log, a pending mark, a table already
//! full) is boxed. The compact form stands for exactly the record it was made from, and every
//! decision is the core's: the fast path below runs only where
//! [`algorithm::apply`] would decide on the stored record as it is, and does what it does.

use std::sync::OnceLock;

use tollgate_core::algorithm::{self, FixedWindowState, Record, State, TokenBucketState};
use tollgate_core::algorithm::{expires_at_ms, fixed_window, token_bucket};
use tollgate_core::{Algorithm, Decision, Policy, PolicyError, StoreError};

use crate::lent::{COLD_US, HOT_US, Held};

/// Distinct (generation, parameters) pairs a store interns; buckets written under more are
/// boxed.
const INTERNED: usize = 64;

/// The generation and parameters that wrote a compact bucket.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Governing {
    generation: u64,
    params: Algorithm,
    /// `params` is in [`Algorithm::normalized`] form (always so for records this store wrote).
    normalized: bool,
}

impl Governing {
    /// Whether `params == caller.normalized()`, without building the normalized form: for a
    /// token bucket the normalized refill is a function of `rate` and `unit`, so equal numbers
    /// and normalized stored parameters are the same test.
    #[allow(clippy::inline_always)] // left out of line otherwise, on every call
    #[inline(always)]
    fn params_match(&self, caller: &Algorithm) -> bool {
        match (&self.params, caller) {
            (Algorithm::TokenBucket(held), Algorithm::TokenBucket(c)) => {
                self.normalized
                    && held.capacity == c.capacity
                    && held.unit == c.unit
                    && held.rate == c.rate
                    && held.max_elapsed_micros == c.max_elapsed_micros
            }
            (held, caller) => *held == caller.normalized(),
        }
    }
}

/// The (generation, parameters) pairs of a store's compact buckets, each written once and then
/// only read (lock-free), so buckets refer to them by index.
#[derive(Debug)]
pub(crate) struct ParamsTable {
    entries: Box<[OnceLock<Governing>]>,
}

impl ParamsTable {
    pub(crate) fn new() -> Self {
        Self {
            entries: (0..INTERNED).map(|_| OnceLock::new()).collect(),
        }
    }

    fn get(&self, id: u8) -> &Governing {
        self.entries[usize::from(id)]
            .get()
            .expect("an interned index refers to a written entry")
    }

    /// The index of (`generation`, `params`), added if new; `None` when the table is full.
    fn intern(&self, generation: u64, params: &Algorithm) -> Option<u8> {
        for (i, entry) in self.entries.iter().enumerate() {
            let held = entry.get_or_init(|| Governing {
                generation,
                params: *params,
                normalized: params.normalized() == *params,
            });
            if held.generation == generation && held.params == *params {
                return u8::try_from(i).ok();
            }
        }
        None
    }
}

/// A bucket's record in compact or boxed form.
#[derive(Debug)]
enum Slot {
    /// No record: a missing (or expired) bucket.
    Missing,
    /// A token bucket record with no pending mark; its generation and parameters interned.
    TokenBucket(u8, TokenBucketState),
    /// A fixed window record with no pending mark; its generation and parameters interned.
    FixedWindow(u8, FixedWindowState),
    /// Any other record (always `Some`; boxed as an `Option` so the core decides on it in place).
    Boxed(Box<Option<Record>>),
    /// A compact token bucket lent to the store's slot table ([`crate::lent`]), which holds it.
    Lent,
}

impl Slot {
    /// The slot for `record`: compact when it can be.
    fn of(record: Option<Record>, table: &ParamsTable) -> Self {
        let Some(r) = record else {
            return Self::Missing;
        };
        Self::compact(&r, table).unwrap_or_else(|| Self::Boxed(Box::new(Some(r))))
    }

    /// The compact form of `r`, if it has one (and the table has room for its parameters).
    fn compact(r: &Record, table: &ParamsTable) -> Option<Self> {
        if r.pending.is_some() {
            return None;
        }
        match (&r.params, &r.state) {
            (Algorithm::TokenBucket(_), State::TokenBucket(s)) => table
                .intern(r.generation, &r.params)
                .map(|id| Self::TokenBucket(id, *s)),
            (Algorithm::FixedWindow(_), State::FixedWindow(s)) => table
                .intern(r.generation, &r.params)
                .map(|id| Self::FixedWindow(id, *s)),
            _ => None,
        }
    }

    /// The record this slot stands for.
    fn record(&self, table: &ParamsTable) -> Option<Record> {
        let (id, state) = match self {
            Self::Missing => return None,
            Self::Lent => {
                debug_assert!(false, "a lent bucket is taken back before it is read");
                return None;
            }
            Self::Boxed(r) => return (**r).clone(),
            Self::TokenBucket(id, s) => (*id, State::TokenBucket(*s)),
            Self::FixedWindow(id, s) => (*id, State::FixedWindow(*s)),
        };
        let g = table.get(id);
        Some(Record {
            generation: g.generation,
            params: g.params,
            pending: None,
            state,
        })
    }
}

/// A bucket's record and the instant it expires.
#[derive(Debug)]
pub(crate) struct Bucket {
    slot: Slot,
    /// Last millisecond (since the epoch) at which the bucket is alive, as Redis `PEXPIRE`.
    pub(crate) expires_at_ms: u64,
}

impl Bucket {
    /// A missing bucket (as Redis sees a key that does not exist).
    pub(crate) const fn missing() -> Self {
        Self {
            slot: Slot::Missing,
            expires_at_ms: 0,
        }
    }

    /// Whether a record is held (alive or not).
    pub(crate) const fn holds_record(&self) -> bool {
        !matches!(self.slot, Slot::Missing)
    }

    /// A new bucket holding `record`, written at `now_us` with a TTL of `ttl_us`.
    #[cfg(test)]
    pub(crate) fn new(
        record: Option<Record>,
        table: &ParamsTable,
        now_us: u64,
        ttl_us: u64,
    ) -> Self {
        Self {
            slot: Slot::of(record, table),
            expires_at_ms: expires_at_ms(now_us, ttl_us),
        }
    }

    /// Whether the bucket is alive at `now_ms`. Redis treats a key as expired once its
    /// expiry is strictly in the past.
    pub(crate) fn is_alive(&self, now_ms: u64) -> bool {
        self.holds_record() && now_ms <= self.expires_at_ms
    }

    /// The record held (whether alive or not).
    pub(crate) fn record(&self, table: &ParamsTable) -> Option<Record> {
        self.slot.record(table)
    }

    /// Applies `cost` at `now_us` in place. An expired bucket counts as missing and stays
    /// expired unless the outcome writes a state; an unchanged state keeps its expiry, and so
    /// does one rewritten with `keep_expiry` (Redis `SET ... KEEPTTL`). `cost` must have
    /// passed `policy.check_cost` (every caller checks it before taking the shard's lock).
    pub(crate) fn apply(
        &mut self,
        table: &ParamsTable,
        policy: &Policy,
        now_us: u64,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        debug_assert!(!self.is_lent(), "a lent bucket is taken back before a call");
        let was_alive = self.is_alive(now_us / 1000);
        if !was_alive {
            // Like Redis's lazy expiry: once seen expired, a bucket never comes back, even if
            // the clock steps back before its expiry.
            self.slot = Slot::Missing;
        }
        if let Some(decision) = self.fast(table, policy, now_us, cost) {
            return Ok(decision);
        }
        let runs_out = self.runs_out_at_expiry(table, policy);
        let out = self.general(table, policy, now_us, cost)?;
        match out.ttl_micros {
            Some(ttl) => self.expires_at_ms = expires_at_ms(now_us, ttl),
            None if !was_alive && !out.keep_expiry => self.slot = Slot::Missing,
            None => {}
        }
        let mut decision = out.decision;
        if runs_out {
            algorithm::cap_at_expiry(&mut decision, now_us, self.expires_at_ms);
        }
        Ok(decision)
    }

    /// [`algorithm::runs_out_at_expiry`] for this bucket's record (never for a compact one
    /// unless `policy` would start a deferral on it: compact records have none pending).
    fn runs_out_at_expiry(&self, table: &ParamsTable, policy: &Policy) -> bool {
        match &self.slot {
            Slot::Missing | Slot::Lent => false,
            Slot::Boxed(r) => algorithm::runs_out_at_expiry((**r).as_ref(), policy),
            Slot::TokenBucket(..) | Slot::FixedWindow(..) => {
                policy.transition() == tollgate_core::Transition::DeferUntilExpiry
                    && algorithm::runs_out_at_expiry(self.slot.record(table).as_ref(), policy)
            }
        }
    }

    /// Whether the bucket is lent to the store's slot table ([`crate::lent`]): its state is
    /// there, and must be taken back ([`Bucket::restore`]) before the bucket is read or changed.
    #[inline]
    pub(crate) const fn is_lent(&self) -> bool {
        matches!(self.slot, Slot::Lent)
    }

    /// Whether a compact token bucket was written less than [`HOT_US`] before `now_us` (or
    /// after it: a clock behind the bucket's): taken before a call, it tells whether that call
    /// finds the bucket hot.
    #[inline]
    pub(crate) fn is_hot(&self, now_us: u64) -> bool {
        matches!(self.slot, Slot::TokenBucket(_, s) if now_us < s.updated.saturating_add(HOT_US))
    }

    /// The bucket as [`Held`] when it is worth lending: a compact token bucket alive at
    /// `now_us` that `hot` says is called often, or that holds less than `unit` (the caller's
    /// units per token; 0 lends nothing) so that a call now is likely denied. For any other
    /// bucket the locked path is as quick, and a slot taken by a bucket seldom called would
    /// only keep it from a hot one.
    #[inline]
    pub(crate) fn lendable(&self, unit: u64, now_us: u64, hot: bool) -> Option<Held> {
        self.held()
            .filter(|p| unit > 0 && (hot || p.state.level < unit) && self.is_alive(now_us / 1000))
    }

    /// A compact token bucket as a slot holds it; `None` for any other bucket.
    #[inline]
    fn held(&self) -> Option<Held> {
        match self.slot {
            Slot::TokenBucket(id, state) => Some(Held {
                id,
                state,
                expires_at_ms: self.expires_at_ms,
            }),
            _ => None,
        }
    }

    /// Marks the bucket lent (its state now held by its slot).
    pub(crate) fn mark_lent(&mut self) {
        self.slot = Slot::Lent;
    }

    /// A bucket standing for what a slot holds for its key: `p`, or missing when the slot held
    /// another key (the state expired there and was dropped).
    pub(crate) fn of_held(p: Option<Held>) -> Self {
        match p {
            Some(p) => Self {
                slot: Slot::TokenBucket(p.id, p.state),
                expires_at_ms: p.expires_at_ms,
            },
            None => Self::missing(),
        }
    }

    /// Takes a lent bucket's state back from its slot (see [`Bucket::of_held`]).
    pub(crate) fn restore(&mut self, p: Option<Held>) {
        debug_assert!(self.is_lent());
        *self = Self::of_held(p);
    }

    /// What the locked path would decide for `cost` at `now_us` on the bucket `p` stands for,
    /// and the state it would then hold if that changed (`None` when the decision writes
    /// nothing); `None` for a bucket the locked path must decide on (expired, or not decided
    /// as it is: see [`Bucket::fast`]) or that should go back to it (cold: [`COLD_US`]).
    /// Decides on a copy, by the same code.
    #[inline]
    pub(crate) fn decide_on(
        p: Held,
        table: &ParamsTable,
        policy: &Policy,
        now_us: u64,
        cost: u64,
    ) -> Option<(Decision, Option<Held>)> {
        let mut copy = Self::of_held(Some(p));
        if !copy.is_alive(now_us / 1000) {
            return None;
        }
        let d = copy.fast(table, policy, now_us, cost)?;
        // An admission on a bucket not written for `COLD_US`: the locked path decides it again
        // and keeps the bucket (a denial stays here: it writes nothing, so a bucket denied
        // without end is cold by its time however often it is called).
        if d.allowed && now_us > p.state.updated.saturating_add(COLD_US) {
            return None;
        }
        let after = copy.held()?;
        Some((d, (after != p).then_some(after)))
    }

    /// [`algorithm::apply`] on the record, and the expiry it sets, for a compact bucket the
    /// caller's policy decides as it is (a commit by a caller of the generation and parameters
    /// that wrote it, or an older one), and for a missing token bucket; `None` elsewhere,
    /// including for a cost above the stored limit (the general path reports it).
    ///
    /// Holds the core's rules for those cases: a record of the caller's kind, with no pending
    /// mark, is decided under its stored parameters unless the caller is newer (a higher
    /// generation, or the same with other parameters); a missing bucket starts full under the
    /// caller's. A state written gets the TTL the algorithm returns; none keeps its expiry.
    /// A compact bucket here is alive (an expired one was made missing).
    #[inline]
    fn fast(
        &mut self,
        table: &ParamsTable,
        policy: &Policy,
        now: u64,
        cost: u64,
    ) -> Option<Decision> {
        // `apply`'s callers have checked the cost against the caller's policy
        // (`Policy::check_cost`); against stored parameters it is checked below.
        debug_assert!(policy.check_cost(cost).is_ok());
        let caller = policy.algorithm();
        let g = policy.generation();
        let governs = |held: &Governing| {
            g < held.generation || (g == held.generation && held.params_match(caller))
        };
        let out = match (&mut self.slot, &caller) {
            (Slot::TokenBucket(id, s), Algorithm::TokenBucket(_)) => {
                let held = table.get(*id);
                let Algorithm::TokenBucket(p) = &held.params else {
                    return None;
                };
                if !governs(held) || cost > p.capacity {
                    return None;
                }
                token_bucket::apply_in_place(s, p, now, cost, true)
            }
            (Slot::FixedWindow(id, s), Algorithm::FixedWindow(_)) => {
                let held = table.get(*id);
                let Algorithm::FixedWindow(p) = &held.params else {
                    return None;
                };
                if !governs(held) || cost > p.limit {
                    return None;
                }
                let mut state = Some(*s);
                let out = fixed_window::apply(&mut state, p, now, cost, true);
                if let Some(state) = state {
                    *s = state;
                }
                out
            }
            (Slot::Missing, Algorithm::TokenBucket(_)) => {
                let caller = caller.normalized();
                let Algorithm::TokenBucket(p) = &caller else {
                    return None;
                };
                let id = table.intern(g, &caller)?;
                let mut s = TokenBucketState {
                    level: p.capacity_units(),
                    updated: now,
                };
                let out = token_bucket::apply_in_place(&mut s, p, now, cost, true);
                self.slot = Slot::TokenBucket(id, s);
                out
            }
            _ => return None,
        };
        if let Some(ttl) = out.ttl_micros {
            self.expires_at_ms = expires_at_ms(now, ttl);
        }
        Some(out.decision)
    }

    /// [`algorithm::apply`] on the record, in its general form.
    #[cold]
    fn general(
        &mut self,
        table: &ParamsTable,
        policy: &Policy,
        now: u64,
        cost: u64,
    ) -> Result<algorithm::Outcome, PolicyError> {
        if let Slot::Boxed(record) = &mut self.slot {
            let out = algorithm::apply(record, policy, now, cost, true)?;
            // A transition may have left a record the compact form holds.
            if out.wrote()
                && let Some(slot) = (**record).as_ref().and_then(|r| Slot::compact(r, table))
            {
                self.slot = slot;
            }
            return Ok(out);
        }
        let mut record = self.slot.record(table);
        let out = algorithm::apply(&mut record, policy, now, cost, true)?;
        if out.wrote() {
            self.slot = Slot::of(record, table);
        }
        Ok(out)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;
    use tollgate_core::Rate;

    fn policy_for_test() -> Policy {
        Policy::token_bucket(2, Rate::per_second(1)).unwrap()
    }

    #[test]
    fn expiry_is_the_millisecond_holding_the_end_of_the_ttl() {
        assert_eq!(expires_at_ms(1_000_999, 1), 1_001);
        assert_eq!(expires_at_ms(1_000_999, 1_000), 1_001);
        assert_eq!(expires_at_ms(1_000_999, 1_001), 1_002);
        assert_eq!(expires_at_ms(5_000_000, 3_500_000), 8_500);
        // not the write's millisecond plus the TTL rounded up (1,002): alive through 1,001
        // is alive until 1,002,000 µs, past the 1,001,600 the TTL ends at
        assert_eq!(expires_at_ms(1_000_100, 1_500), 1_001);
        assert_eq!(expires_at_ms(u64::MAX - 5, 1), u64::MAX / 1000);
    }

    #[test]
    fn alive_through_the_expiry_millisecond_then_missing() {
        let table = ParamsTable::new();
        let state = Record {
            generation: 0,
            params: *policy_for_test().algorithm(),
            pending: None,
            state: State::TokenBucket(TokenBucketState {
                level: 0,
                updated: 0,
            }),
        };
        let b = Bucket::new(Some(state.clone()), &table, 1_000_000, 1_500);
        assert!(matches!(b.slot, Slot::TokenBucket(0, _)));
        assert_eq!(b.record(&table), Some(state));
        assert_eq!(b.expires_at_ms, 1_001);
        assert!(b.is_alive(1_001));
        assert!(!b.is_alive(1_002));
    }

    #[test]
    fn an_expired_bucket_counts_as_missing() {
        let table = ParamsTable::new();
        let policy = Policy::token_bucket(2, Rate::per_second(1)).unwrap();
        let mut b = Bucket {
            slot: Slot::Missing,
            expires_at_ms: 0,
        };
        assert!(b.apply(&table, &policy, 0, 2).unwrap().allowed);
        assert_eq!(b.expires_at_ms, 2_000);
        assert!(!b.apply(&table, &policy, 500_000, 2).unwrap().allowed);
        // the same empty state, expired, is a full bucket
        b.expires_at_ms = 499;
        let d = b.apply(&table, &policy, 500_000, 2).unwrap();
        assert!(d.allowed);
        assert_eq!(d.reset_after, Duration::from_secs(2));
        assert_eq!(b.expires_at_ms, 2_500);
    }

    #[test]
    fn records_round_trip_through_every_form() {
        let table = ParamsTable::new();
        let tb = Policy::token_bucket(5, Rate::new(7, Duration::from_secs(3))).unwrap();
        let fw = Policy::fixed_window(3, Duration::from_secs(1)).unwrap();
        let sl = Policy::sliding_log(3, Duration::from_secs(1)).unwrap();
        for (policy, boxed) in [(&tb, false), (&fw, false), (&sl, true)] {
            let mut record = None;
            algorithm::apply(&mut record, policy, 1_000, 1, true).unwrap();
            let b = Bucket::new(record.clone(), &table, 1_000, 1);
            assert_eq!(matches!(b.slot, Slot::Boxed(_)), boxed, "{policy}");
            assert_eq!(b.record(&table), record);
        }
        // a pending mark is boxed
        let mut record = None;
        algorithm::apply(&mut record, &tb, 1_000, 1, true).unwrap();
        let newer = tb
            .with_generation(1)
            .with_transition(tollgate_core::Transition::DeferUntilExpiry);
        algorithm::apply(&mut record, &newer, 2_000, 1, true).unwrap();
        assert_eq!(record.as_ref().unwrap().pending, Some(1));
        let b = Bucket::new(record.clone(), &table, 1_000, 1);
        assert!(matches!(b.slot, Slot::Boxed(_)));
        assert_eq!(b.record(&table), record);
    }

    #[test]
    fn a_full_table_boxes_further_parameters() {
        let table = ParamsTable::new();
        for capacity in 1..=INTERNED as u64 + 3 {
            let policy = Policy::token_bucket(capacity, Rate::per_second(1)).unwrap();
            let mut b = Bucket {
                slot: Slot::Missing,
                expires_at_ms: 0,
            };
            assert!(b.apply(&table, &policy, 0, 1).unwrap().allowed);
            assert_eq!(
                matches!(b.slot, Slot::Boxed(_)),
                capacity > INTERNED as u64,
                "{capacity}"
            );
            assert_eq!(
                b.apply(&table, &policy, 0, 1).unwrap().remaining,
                capacity.saturating_sub(2)
            );
        }
    }

    /// xorshift64*: a deterministic stream for the differential test below.
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        pub(crate) fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    pub(crate) fn random_policy(rng: &mut Rng) -> Policy {
        let p = match rng.below(6) {
            0 => Policy::token_bucket(1 + rng.below(10), Rate::per_second(1 + rng.below(5))),
            1 => Policy::token_bucket(
                1 + rng.below(1_000_000),
                Rate::new(
                    1 + rng.below(1_000_000),
                    Duration::from_micros(1 + rng.below(5_000_000)),
                ),
            ),
            2 => Policy::token_bucket(1 + rng.below(100), Rate::new(7, Duration::from_secs(3)))
                .and_then(|p| p.with_max_elapsed(Duration::from_micros(1 + rng.below(3_000_000)))),
            3 => Policy::fixed_window(
                1 + rng.below(20),
                Duration::from_millis(1 + rng.below(3_000)),
            ),
            4 => Policy::fixed_window(1 + rng.below(1_000_000), Duration::from_secs(1)),
            _ => Policy::sliding_log(
                1 + rng.below(20),
                Duration::from_millis(1 + rng.below(3_000)),
            ),
        }
        .unwrap();
        let rules = tollgate_core::Transition::ALL;
        p.with_generation(rng.below(4))
            .with_transition(rules[rng.below(rules.len() as u64) as usize])
    }

    /// The model the local store is held to: [`algorithm::apply`] on a plain record with
    /// Redis's expiry (`expiry`, the last millisecond it is alive; an expired record counts as
    /// missing, and stays missing unless the outcome writes or keeps the expiry).
    pub(crate) fn plain_apply(
        plain: &mut Option<Record>,
        expiry: &mut u64,
        policy: &Policy,
        now: u64,
        cost: u64,
    ) -> Result<Decision, PolicyError> {
        let was_alive = plain.is_some() && now / 1000 <= *expiry;
        if !was_alive {
            *plain = None;
        }
        let runs_out = algorithm::runs_out_at_expiry(plain.as_ref(), policy);
        algorithm::apply(plain, policy, now, cost, true).map(|out| {
            match out.ttl_micros {
                Some(ttl) => *expiry = expires_at_ms(now, ttl),
                None if !was_alive && !out.keep_expiry => *plain = None,
                None => {}
            }
            let mut decision = out.decision;
            if runs_out {
                algorithm::cap_at_expiry(&mut decision, now, *expiry);
            }
            decision
        })
    }

    /// The bucket in compact form against the plain `Option<Record>` it replaced (the same
    /// expiry rules over [`algorithm::apply`]): equal decisions, records and expiries, under
    /// mixed policies, generations and rules, a clock that steps back, and a full table.
    #[test]
    fn compact_buckets_decide_and_store_exactly_as_plain_records() {
        for seed in 1..=3_000u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let table = ParamsTable::new();
            if seed % 10 == 0 {
                // A table with no room left: every bucket is boxed.
                for c in 0..INTERNED as u64 {
                    let filler = Policy::token_bucket(c + 1_000, Rate::per_second(3)).unwrap();
                    table.intern(99, &filler.algorithm().normalized());
                }
            }
            let mut policies: Vec<Policy> = (0..=rng.below(3))
                .map(|_| random_policy(&mut rng))
                .collect();
            if seed % 7 == 0 {
                let same = Policy::token_bucket(3, Rate::new(2, Duration::from_secs(2))).unwrap();
                policies.push(same.with_generation(rng.below(3)));
            }
            let mut bucket = Bucket {
                slot: Slot::Missing,
                expires_at_ms: 0,
            };
            let (mut plain, mut plain_expiry): (Option<Record>, u64) = (None, 0);
            let mut now = 1_700_000_000_000_000 + rng.below(1 << 30);
            if seed % 7 == 0 {
                // A record whose parameters are not in normalized form (2 per 2 s): never
                // written by the core, held compactly all the same.
                let raw = Policy::token_bucket(3, Rate::new(2, Duration::from_secs(2))).unwrap();
                let record = Record {
                    generation: rng.below(3),
                    params: *raw.algorithm(),
                    pending: None,
                    state: State::TokenBucket(TokenBucketState {
                        level: rng.below(3_000_001),
                        updated: now,
                    }),
                };
                assert_ne!(record.params, record.params.normalized());
                bucket = Bucket::new(Some(record.clone()), &table, now, 10_000_000);
                (plain, plain_expiry) = (Some(record), bucket.expires_at_ms);
            }
            for step in 0..200 {
                let policy = &policies[rng.below(policies.len() as u64) as usize];
                now = match rng.below(10) {
                    0 => now - rng.below(2_000_000),
                    1..=3 => now,
                    4..=7 => now + rng.below(2_000),
                    8 => now + rng.below(2_000_000),
                    _ => now + rng.below(20_000_000),
                };
                let cost = 1 + rng.below(policy.limit().min(5));
                let got = bucket.apply(&table, policy, now, cost);

                let want = plain_apply(&mut plain, &mut plain_expiry, policy, now, cost);
                let at = format!("seed {seed} step {step}: cost {cost} at {now} under {policy}");
                let got = got.map_err(|e| match e {
                    StoreError::InvalidPolicy(e) => e,
                    other => panic!("{at}: {other}"),
                });
                assert_eq!(got, want, "{at}");
                assert_eq!(bucket.record(&table), plain, "{at}");
                if plain.is_some() {
                    assert_eq!(bucket.expires_at_ms, plain_expiry, "{at}");
                }
            }
        }
    }

    #[test]
    fn a_compact_bucket_is_small() {
        assert!(
            std::mem::size_of::<Bucket>() <= 32,
            "{}",
            std::mem::size_of::<Bucket>()
        );
    }
}
