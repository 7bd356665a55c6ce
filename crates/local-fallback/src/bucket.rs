//! One stored bucket and its expiry, kept in Redis's millisecond terms so the local store
//! expires keys exactly when a Redis server on the same clock would.
//!
//! A bucket holds a [`Record`] in one of two forms. The common records — a token bucket or a
//! fixed window with no pending policy change — are kept compact in 16 bytes: the generation
//! and parameters that wrote them are interned once per store in a [`ParamsTable`], and the
//! bucket keeps only the algorithm's two numbers, its time packed with the parameters' index
//! (a map slot of 32 bytes with its key, against 144 for a full `Record`). A compact bucket
//! keeps no expiry: it is the one its record's last write set, computed again from the record
//! ([`token_bucket_expiry`], [`fixed_window_expiry`]), and a record whose expiry is not that
//! one (a token bucket written with the clock behind it, a window written in its last
//! millisecond) is boxed with its expiry instead, as is anything else (a sliding log, a pending
//! mark, a table already full, a time past 2^56 µs). The compact form stands for exactly the
//! record and expiry it was made from, and every decision is the core's: the fast path below
//! runs only where [`algorithm::apply`] would decide on the stored record as it is, and does
//! what it does.

use std::num::NonZeroU64;
use std::sync::OnceLock;

use tollgate_core::algorithm::token_bucket::Step;
use tollgate_core::algorithm::{self, FixedWindowState, Record, State, TokenBucketState};
use tollgate_core::algorithm::{expires_at_ms, fixed_window, token_bucket};
use tollgate_core::{
    Algorithm, Decision, FixedWindow, Policy, PolicyError, StoreError, TokenBucket,
};

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

    /// Whether this entry's parameters decide a call under `policy` as they are: the caller
    /// is older, or of the same generation and parameters (a newer caller goes to the general
    /// path, which applies the policy's transition).
    #[allow(clippy::inline_always)] // on every call
    #[inline(always)]
    fn governs(&self, policy: &Policy) -> bool {
        let g = policy.generation();
        g < self.generation || (g == self.generation && self.params_match(policy.algorithm()))
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

    #[allow(clippy::inline_always)] // left out of line otherwise, on every call
    #[inline(always)]
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

/// The last millisecond a token bucket holding `s` is alive when `s` was written at
/// `s.updated` (the clock not behind the bucket): the `PXAT` of a write with the TTL the core
/// returns then, the time the bucket takes to be full again (at least 1 µs). Never inlined:
/// off the hot paths (a lend, a write with the clock behind the bucket), and inlined it makes
/// a lent bucket's decision too large to be inlined where it is called.
#[inline(never)]
fn token_bucket_expiry(p: &TokenBucket, s: TokenBucketState) -> u64 {
    let refill = p.capacity_units().saturating_sub(s.level).div_ceil(p.rate);
    expires_at_ms(s.updated, refill.max(1))
}

/// Whether a compact token bucket holding `s` is alive at `now_ms`
/// (`now_ms <= token_bucket_expiry(p, s)`), with no division: the expiry ends the
/// millisecond holding `s.updated + max(refill, 1000)`, so the bucket is alive while that
/// instant is at or past `now_ms`'s first microsecond, and `refill >= x` is
/// `cap - level > (x - 1) * rate`.
#[inline]
fn token_bucket_alive(p: &TokenBucket, s: TokenBucketState, now_ms: u64) -> bool {
    let from = now_ms * 1000;
    if s.updated.saturating_add(1000) >= from {
        return true;
    }
    let x = from - s.updated;
    u128::from(p.capacity_units().saturating_sub(s.level)) > u128::from(x - 1) * u128::from(p.rate)
}

/// The last millisecond a fixed window holding `s` is alive: the one holding its end (the
/// `PXAT` of any write in it but one made in its last millisecond, which is boxed).
fn fixed_window_expiry(p: &FixedWindow, s: FixedWindowState) -> u64 {
    s.window_start.saturating_add(p.window_micros) / 1000
}

/// The largest time (µs since the epoch, 2^56 - 1: the year 4253) a compact bucket holds.
const MAX_TIME: u64 = (1 << 56) - 1;
/// Codes in a compact bucket's low byte: a missing bucket, a lent one, a token bucket
/// (`TOKEN_BUCKET + id`) or a fixed window (`FIXED_WINDOW + id`) under interned entry `id`.
const MISSING: u8 = 0xFF;
const LENT: u8 = 0xFE;
const TOKEN_BUCKET: u8 = 1;
const FIXED_WINDOW: u8 = TOKEN_BUCKET + INTERNED as u8;
const FIXED_WINDOW_END: u8 = FIXED_WINDOW + INTERNED as u8;

/// A bucket in 16 bytes: two numbers (a token bucket's level and time, a fixed window's count
/// and start) and a code (see [`MISSING`]). `meta` is never 0, so that [`Slot`] fits in the
/// same 16 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Compact {
    /// A token bucket's level, a fixed window's count; 0 for a missing or lent bucket.
    value: u64,
    /// The time (`updated`, `window_start`; at most [`MAX_TIME`]) << 8 | the code.
    meta: NonZeroU64,
}

impl Compact {
    const MISSING: Self = Self::new(0, 0, MISSING);
    const LENT: Self = Self::new(0, 0, LENT);

    const fn new(value: u64, time: u64, code: u8) -> Self {
        // Codes are never 0; a 0 (which no caller makes) would read as a missing bucket.
        let meta = match NonZeroU64::new(time << 8 | code as u64) {
            Some(meta) => meta,
            None => NonZeroU64::MAX,
        };
        Self { value, meta }
    }

    #[inline]
    const fn code(self) -> u8 {
        self.meta.get() as u8
    }

    #[inline]
    const fn time(self) -> u64 {
        self.meta.get() >> 8
    }

    fn token_bucket(id: u8, s: TokenBucketState) -> Self {
        debug_assert!(s.updated <= MAX_TIME && usize::from(id) < INTERNED);
        Self::new(s.level, s.updated, TOKEN_BUCKET + id)
    }

    fn fixed_window(id: u8, s: FixedWindowState) -> Self {
        debug_assert!(s.window_start <= MAX_TIME && usize::from(id) < INTERNED);
        Self::new(s.count, s.window_start, FIXED_WINDOW + id)
    }

    /// A token bucket's interned index and state.
    #[inline]
    fn as_token_bucket(self) -> Option<(u8, TokenBucketState)> {
        let code = self.code();
        (TOKEN_BUCKET..FIXED_WINDOW).contains(&code).then(|| {
            let s = TokenBucketState {
                level: self.value,
                updated: self.time(),
            };
            (code - TOKEN_BUCKET, s)
        })
    }

    /// A fixed window's interned index and state.
    #[inline]
    fn as_fixed_window(self) -> Option<(u8, FixedWindowState)> {
        let code = self.code();
        (FIXED_WINDOW..FIXED_WINDOW_END).contains(&code).then(|| {
            let s = FixedWindowState {
                window_start: self.time(),
                count: self.value,
            };
            (code - FIXED_WINDOW, s)
        })
    }

    /// The compact form of `r` with expiry `expires_at_ms`, if it has one (and the table has
    /// room for its parameters).
    fn of(r: &Record, expires_at_ms: u64, table: &ParamsTable) -> Option<Self> {
        if r.pending.is_some() {
            return None;
        }
        match (&r.params, &r.state) {
            (Algorithm::TokenBucket(p), State::TokenBucket(s))
                if s.updated <= MAX_TIME && token_bucket_expiry(p, *s) == expires_at_ms =>
            {
                table
                    .intern(r.generation, &r.params)
                    .map(|id| Self::token_bucket(id, *s))
            }
            (Algorithm::FixedWindow(p), State::FixedWindow(s))
                if s.window_start <= MAX_TIME && fixed_window_expiry(p, *s) == expires_at_ms =>
            {
                table
                    .intern(r.generation, &r.params)
                    .map(|id| Self::fixed_window(id, *s))
            }
            _ => None,
        }
    }

    /// The record this bucket stands for (`None` for a missing one) and its expiry.
    fn record(self, table: &ParamsTable) -> (Option<Record>, u64) {
        let (id, state, expiry) = if let Some((id, s)) = self.as_token_bucket() {
            let Algorithm::TokenBucket(p) = &table.get(id).params else {
                unreachable!("a token bucket's index holds token-bucket parameters")
            };
            (id, State::TokenBucket(s), token_bucket_expiry(p, s))
        } else if let Some((id, s)) = self.as_fixed_window() {
            let Algorithm::FixedWindow(p) = &table.get(id).params else {
                unreachable!("a fixed window's index holds fixed-window parameters")
            };
            (id, State::FixedWindow(s), fixed_window_expiry(p, s))
        } else {
            debug_assert!(
                self.code() != LENT,
                "a lent bucket is taken back before it is read"
            );
            return (None, 0);
        };
        let g = table.get(id);
        let record = Record {
            generation: g.generation,
            params: g.params,
            pending: None,
            state,
        };
        (Some(record), expiry)
    }
}

/// A record kept whole, with its expiry.
#[derive(Debug)]
struct Boxed {
    /// Always `Some` (an `Option` so the core decides on it in place).
    record: Option<Record>,
    /// Last millisecond (since the epoch) at which the bucket is alive, as Redis `PEXPIRE`.
    expires_at_ms: u64,
}

/// A bucket's record in compact or boxed form.
#[derive(Debug)]
enum Slot {
    Compact(Compact),
    Boxed(Box<Boxed>),
}

/// The fast path's step on an alive token bucket holding `s`, written under `held`: what
/// [`algorithm::apply`] decides when `policy` lets the stored parameters govern as they are and
/// the cost fits them, as the numbers the decision is made of ([`Step::decision`] builds it;
/// the state is written, with TTL [`Step::ttl_micros`], when [`Step::writes`]); `None`
/// elsewhere, or when the state written would not be compact (the clock behind the bucket
/// leaving an expiry the record does not give, a time past [`MAX_TIME`]).
#[allow(clippy::inline_always)] // on every call of a hot key, lent or not
#[inline(always)]
fn step_token_bucket<'h>(
    held: &'h Governing,
    policy: &Policy,
    now: u64,
    cost: u64,
    s: TokenBucketState,
) -> Option<(Step, &'h TokenBucket)> {
    let Algorithm::TokenBucket(p) = &held.params else {
        return None;
    };
    if !held.governs(policy) || cost > p.capacity {
        return None;
    }
    let step = Step::of(s, p, now, cost);
    // Written with the clock behind the bucket, the expiry may not be the one the record gives,
    // and past `MAX_TIME` the time does not fit: the general path boxes such a record. (The TTL
    // is computed only then: the fast path does not keep it.)
    if step.writes(p)
        && (step.next.updated > MAX_TIME
            || (now < s.updated
                && token_bucket_expiry(p, step.next)
                    != expires_at_ms(now, step.ttl_micros(p, now))))
    {
        return None;
    }
    Some((step, p))
}

/// [`step_token_bucket`] and its decision, with `s` and `ttl` then the state written and the
/// TTL it gets (both unchanged when nothing is written; the expiry is
/// [`expires_at_ms`]`(now, ttl)`, computed by a caller that keeps it); `None` and nothing
/// changed where `step_token_bucket` says `None`.
#[allow(clippy::inline_always)] // on every call of a hot key, lent or not
#[inline(always)]
fn decide_token_bucket(
    held: &Governing,
    policy: &Policy,
    now: u64,
    cost: u64,
    s: &mut TokenBucketState,
    ttl: &mut Option<u64>,
) -> Option<Decision> {
    let (step, p) = step_token_bucket(held, policy, now, cost, *s)?;
    let out = step.outcome(p, now, true);
    if out.ttl_micros.is_some() {
        *s = step.next;
        *ttl = out.ttl_micros;
    }
    Some(out.decision)
}

/// A fast-path call on a live compact token bucket ([`Bucket::fast_token_bucket`]): its step,
/// the parameters it was decided under (the bucket's), and what it saw for lending.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FastStep<'t> {
    pub(crate) step: Step,
    pub(crate) p: &'t TokenBucket,
    pub(crate) note: LendNote,
}

/// What a call under the shard's lock saw of its bucket, for lending it after the call
/// ([`Bucket::lendable`]): whether the bucket was hot before the call ([`Bucket::is_hot`]), and
/// whether it may be worth lending at all (`false`: certainly not, so the caller need not ask).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LendNote {
    pub(crate) hot: bool,
    pub(crate) maybe: bool,
}

impl LendNote {
    /// A token bucket's note: hot before the call, holding `level` after it, for a caller
    /// with `unit` units per token — [`Bucket::lendable`]'s first test.
    #[inline]
    fn of(hot: bool, level: u64, unit: u64) -> Self {
        Self {
            hot,
            maybe: unit > 0 && (hot || level < unit),
        }
    }
}

/// A bucket's record and the instant it expires, in 16 bytes.
#[derive(Debug)]
pub(crate) struct Bucket {
    slot: Slot,
}

impl Bucket {
    /// A missing bucket (as Redis sees a key that does not exist).
    pub(crate) const fn missing() -> Self {
        Self {
            slot: Slot::Compact(Compact::MISSING),
        }
    }

    /// The bucket holding `record` (`None`: missing) with expiry `expires_at_ms`: compact when
    /// it can be.
    fn holding(record: Option<Record>, expires_at_ms: u64, table: &ParamsTable) -> Self {
        let Some(r) = record else {
            return Self::missing();
        };
        let slot = match Compact::of(&r, expires_at_ms, table) {
            Some(c) => Slot::Compact(c),
            None => Slot::Boxed(Box::new(Boxed {
                record: Some(r),
                expires_at_ms,
            })),
        };
        Self { slot }
    }

    /// Whether a record is held (alive or not).
    pub(crate) fn holds_record(&self) -> bool {
        !matches!(self.slot, Slot::Compact(c) if c.code() == MISSING)
    }

    /// A new bucket holding `record`, written at `now_us` with a TTL of `ttl_us`.
    #[cfg(test)]
    pub(crate) fn new(
        record: Option<Record>,
        table: &ParamsTable,
        now_us: u64,
        ttl_us: u64,
    ) -> Self {
        Self::holding(record, expires_at_ms(now_us, ttl_us), table)
    }

    /// Whether the bucket is alive at `now_ms`. Redis treats a key as expired once its
    /// expiry is strictly in the past.
    pub(crate) fn is_alive(&self, table: &ParamsTable, now_ms: u64) -> bool {
        match &self.slot {
            Slot::Boxed(b) => now_ms <= b.expires_at_ms,
            Slot::Compact(c) => {
                if let Some((id, s)) = c.as_token_bucket() {
                    let Algorithm::TokenBucket(p) = &table.get(id).params else {
                        return false;
                    };
                    token_bucket_alive(p, s, now_ms)
                } else if let Some((id, s)) = c.as_fixed_window() {
                    let Algorithm::FixedWindow(p) = &table.get(id).params else {
                        return false;
                    };
                    now_ms <= fixed_window_expiry(p, s)
                } else {
                    debug_assert!(c.code() != LENT, "a lent bucket is taken back first");
                    false
                }
            }
        }
    }

    /// The last millisecond the bucket is alive (0 for a missing one).
    pub(crate) fn expires_at_ms(&self, table: &ParamsTable) -> u64 {
        match &self.slot {
            Slot::Boxed(b) => b.expires_at_ms,
            Slot::Compact(c) => c.record(table).1,
        }
    }

    /// The record held (whether alive or not).
    pub(crate) fn record(&self, table: &ParamsTable) -> Option<Record> {
        match &self.slot {
            Slot::Boxed(b) => b.record.clone(),
            Slot::Compact(c) => c.record(table).0,
        }
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
        self.apply_noting(
            table,
            policy,
            now_us,
            cost,
            0,
            false,
            &mut LendNote::default(),
        )
    }

    /// [`Bucket::apply`], noting in `note` whether the bucket may be worth lending after the
    /// call ([`Bucket::lendable`] to `unit`, the caller's units per token): the fast path
    /// knows it from the state it has decoded anyway, so a call that lends nothing — most
    /// calls over many keys — does not decode the bucket again.
    /// `tried_fast`: the caller's [`Bucket::fast_token_bucket`] already found nothing to decide
    /// on this bucket as it is, so [`Bucket::fast`] does not try it again.
    #[allow(clippy::inline_always)] // a call of its own cost ~20 instructions a decision
    #[allow(clippy::too_many_arguments)] // the fast path's state, passed through registers
    #[inline(always)]
    pub(crate) fn apply_noting(
        &mut self,
        table: &ParamsTable,
        policy: &Policy,
        now_us: u64,
        cost: u64,
        unit: u64,
        tried_fast: bool,
        note: &mut LendNote,
    ) -> Result<Decision, StoreError> {
        debug_assert!(!self.is_lent(), "a lent bucket is taken back before a call");
        if let Some(decision) = self.fast(table, policy, now_us, cost, unit, tried_fast, note) {
            return Ok(decision);
        }
        *note = LendNote {
            hot: self.is_hot(now_us),
            maybe: unit > 0,
        };
        Ok(self.general(table, policy, now_us, cost)?)
    }

    /// [`algorithm::runs_out_at_expiry`] for this bucket's record (never for a compact one
    /// unless `policy` would start a deferral on it: compact records have none pending).
    fn runs_out_at_expiry(&self, table: &ParamsTable, policy: &Policy, now: u64) -> bool {
        match &self.slot {
            Slot::Boxed(b) => algorithm::runs_out_at_expiry(b.record.as_ref(), policy, now),
            Slot::Compact(c) => {
                c.code() < LENT
                    && policy.transition() == tollgate_core::Transition::DeferUntilExpiry
                    && algorithm::runs_out_at_expiry(c.record(table).0.as_ref(), policy, now)
            }
        }
    }

    /// Whether the bucket is lent to the store's slot table ([`crate::lent`]): its state is
    /// there, and must be taken back ([`Bucket::restore`]) before the bucket is read or changed.
    #[inline]
    pub(crate) fn is_lent(&self) -> bool {
        matches!(self.slot, Slot::Compact(c) if c.code() == LENT)
    }

    /// Whether a compact token bucket was written less than [`HOT_US`] before `now_us` (or
    /// after it: a clock behind the bucket's): taken before a call, it tells whether that call
    /// finds the bucket hot.
    #[inline]
    pub(crate) fn is_hot(&self, now_us: u64) -> bool {
        matches!(self.slot, Slot::Compact(c)
            if c.as_token_bucket().is_some_and(|(_, s)| now_us < s.updated.saturating_add(HOT_US)))
    }

    /// The bucket as [`Held`] when it is worth lending and `may_take` says its slot would take
    /// it (asked before the bucket's aliveness, which reads its parameters): a compact token
    /// bucket alive at `now_us` that `hot` says is called often, or that holds less than `unit`
    /// (the caller's units per token; 0 lends nothing) so that a call now is likely denied.
    /// For any other bucket the locked path is as quick, and a slot taken by a bucket seldom
    /// called would only keep it from a hot one.
    #[inline]
    pub(crate) fn lendable(
        &self,
        table: &ParamsTable,
        unit: u64,
        now_us: u64,
        hot: bool,
        may_take: impl FnOnce() -> bool,
    ) -> Option<Held> {
        let Slot::Compact(c) = self.slot else {
            return None;
        };
        let (id, state) = c.as_token_bucket()?;
        // `may_take` first: over many dry keys, most slots hold live states of others
        if unit == 0 || !(hot || state.level < unit) || !may_take() {
            return None;
        }
        let Algorithm::TokenBucket(p) = &table.get(id).params else {
            return None;
        };
        token_bucket_alive(p, state, now_us / 1000).then(|| Held {
            id,
            state,
            expires_at_ms: token_bucket_expiry(p, state),
        })
    }

    /// Marks the bucket lent (its state now held by its slot).
    pub(crate) fn mark_lent(&mut self) {
        self.slot = Slot::Compact(Compact::LENT);
    }

    /// A bucket standing for what a slot holds for its key: `p`, or missing when the slot held
    /// another key (the state expired there and was dropped). A held state is always one a
    /// compact bucket holds: its expiry is the one its record gives.
    pub(crate) fn of_held(p: Option<Held>) -> Self {
        match p {
            Some(p) => Self {
                slot: Slot::Compact(Compact::token_bucket(p.id, p.state)),
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
    /// Decides on a copy of the state, by the code the locked path runs
    /// ([`decide_token_bucket`]).
    #[allow(clippy::inline_always)] // into the slot table's first attempt, on every hot call
    #[inline(always)]
    pub(crate) fn decide_on(
        p: Held,
        table: &ParamsTable,
        policy: &Policy,
        now_us: u64,
        cost: u64,
    ) -> Option<(Decision, Option<Held>)> {
        if now_us / 1000 > p.expires_at_ms {
            return None;
        }
        let (mut state, mut ttl) = (p.state, None);
        let d = decide_token_bucket(table.get(p.id), policy, now_us, cost, &mut state, &mut ttl)?;
        // An admission on a bucket not written for `COLD_US`: the locked path decides it again
        // and keeps the bucket (a denial stays here: it writes nothing, so a bucket denied
        // without end is cold by its time however often it is called).
        if d.allowed && now_us > p.state.updated.saturating_add(COLD_US) {
            return None;
        }
        let after = Held {
            id: p.id,
            state,
            expires_at_ms: ttl.map_or(p.expires_at_ms, |ttl| expires_at_ms(now_us, ttl)),
        };
        Some((d, (after != p).then_some(after)))
    }

    /// [`algorithm::apply`] on the record, and the expiry it sets, for a compact bucket the
    /// caller's policy decides as it is (a commit by a caller of the generation and parameters
    /// that wrote it, or an older one) and that stays compact, and for a missing or expired
    /// token bucket; `None` elsewhere, including for a cost above the stored limit (the
    /// general path reports it), and then nothing is changed.
    ///
    /// Holds the core's rules for those cases: a record of the caller's kind, with no pending
    /// mark, is decided under its stored parameters unless the caller is newer (a higher
    /// generation, or the same with other parameters); a missing bucket starts full under the
    /// caller's. A state written gets the TTL the algorithm returns; none keeps its expiry.
    /// Its common case is [`Bucket::fast_token_bucket`], skipped when `tried_fast` says the
    /// caller tried it already.
    #[inline]
    #[allow(clippy::too_many_arguments)] // the fast path's state, passed through registers
    fn fast(
        &mut self,
        table: &ParamsTable,
        policy: &Policy,
        now: u64,
        cost: u64,
        unit: u64,
        tried_fast: bool,
        note: &mut LendNote,
    ) -> Option<Decision> {
        // `apply`'s callers have checked the cost against the caller's policy
        // (`Policy::check_cost`); against stored parameters it is checked below.
        debug_assert!(policy.check_cost(cost).is_ok());
        if !tried_fast && let Some(f) = self.fast_token_bucket(table, policy, now, cost, unit) {
            *note = f.note;
            return Some(f.step.decision(f.p, now));
        }
        let Slot::Compact(c) = &mut self.slot else {
            return None;
        };
        match policy.algorithm() {
            Algorithm::TokenBucket(_) => {
                // Not a live bucket whose parameters govern the call as they are: a missing or
                // expired one starts full, any other goes to the general path.
                let Some((id, s)) = c.as_token_bucket() else {
                    return if c.code() == MISSING {
                        Self::fresh_token_bucket(c, table, policy, now, cost, unit, false, note)
                    } else {
                        None
                    };
                };
                let Algorithm::TokenBucket(p) = &table.get(id).params else {
                    return None;
                };
                if token_bucket_alive(p, s, now / 1000) {
                    return None;
                }
                // Expired: a missing bucket (a clock stepping back later cannot bring it back,
                // as with Redis's lazy expiry).
                let hot = now < s.updated.saturating_add(HOT_US);
                Self::fresh_token_bucket(c, table, policy, now, cost, unit, hot, note)
            }
            Algorithm::FixedWindow(_) => {
                let (id, s) = c.as_fixed_window()?;
                let held = table.get(id);
                let Algorithm::FixedWindow(p) = &held.params else {
                    return None;
                };
                if now / 1000 > fixed_window_expiry(p, s) || !held.governs(policy) || cost > p.limit
                {
                    return None;
                }
                let mut state = Some(s);
                let out = fixed_window::apply(&mut state, p, now, cost, true);
                let Some(ttl) = out.ttl_micros else {
                    *note = LendNote::default();
                    return Some(out.decision);
                };
                let s = state?;
                if fixed_window_expiry(p, s) != expires_at_ms(now, ttl) || s.window_start > MAX_TIME
                {
                    return None;
                }
                *c = Compact::fixed_window(id, s);
                // a fixed window is never lent
                *note = LendNote::default();
                Some(out.decision)
            }
            _ => None,
        }
    }

    /// The fast path's common case ([`Bucket::fast`] tries it first): a token-bucket call on a
    /// live compact token bucket whose stored parameters govern it as they are, or on an
    /// expired one written under the caller's own generation and parameters (a new bucket,
    /// full, under the same index: the case of keys whose buckets refill between two visits,
    /// which went through the general path's detour and the table's lookup, ~10 % of their
    /// time over 100,000 keys, BENCHMARKS.md). The bucket is
    /// written as `fast` writes it, and the step is returned instead of the decision
    /// ([`FastStep`]), so that a caller holding a lock builds the decision
    /// ([`Step::decision`]) after releasing it. `None`, and nothing changed, for any other
    /// bucket or call.
    #[allow(clippy::inline_always)] // on every call over many keys, under the shard's lock
    #[inline(always)]
    pub(crate) fn fast_token_bucket<'t>(
        &mut self,
        table: &'t ParamsTable,
        policy: &Policy,
        now: u64,
        cost: u64,
        unit: u64,
    ) -> Option<FastStep<'t>> {
        let Slot::Compact(c) = &mut self.slot else {
            return None;
        };
        if !matches!(policy.algorithm(), Algorithm::TokenBucket(_)) {
            return None;
        }
        let (id, stored) = c.as_token_bucket()?;
        let held = table.get(id);
        let Algorithm::TokenBucket(p) = &held.params else {
            return None;
        };
        let alive = token_bucket_alive(p, stored, now / 1000);
        let s = if alive {
            stored
        } else if policy.generation() == held.generation && held.params_match(policy.algorithm()) {
            // Expired, so missing: a new bucket, full under the caller's parameters. When they
            // are the ones that wrote the old one (a key coming back after its bucket refilled
            // and expired), it keeps their index rather than going through the table again.
            TokenBucketState {
                level: p.capacity_units(),
                updated: now,
            }
        } else {
            return None;
        };
        let (step, p) = step_token_bucket(held, policy, now, cost, s)?;
        if !alive && !step.writes(p) {
            // (never: a full bucket admits any cost the policy accepts, and an admission
            // writes; the expired state must not stay behind as if it were this call's)
            return None;
        }
        // what `is_hot` says of the bucket before the call
        let hot = now < stored.updated.saturating_add(HOT_US);
        let after = if step.writes(p) {
            *c = Compact::token_bucket(id, step.next);
            step.next
        } else {
            s
        };
        Some(FastStep {
            step,
            p,
            note: LendNote::of(hot, after.level, unit),
        })
    }

    /// The fast path's new token bucket (missing, or expired): full under the caller's
    /// parameters, then decided; `None` (nothing changed) if it would not be compact. `hot`:
    /// what [`Bucket::is_hot`] said of the bucket it replaces (for `note`).
    #[inline]
    #[allow(clippy::too_many_arguments)] // the fast path's state, passed through registers
    fn fresh_token_bucket(
        c: &mut Compact,
        table: &ParamsTable,
        policy: &Policy,
        now: u64,
        cost: u64,
        unit: u64,
        hot: bool,
        note: &mut LendNote,
    ) -> Option<Decision> {
        if now > MAX_TIME {
            return None;
        }
        let caller = policy.algorithm().normalized();
        let Algorithm::TokenBucket(p) = &caller else {
            return None;
        };
        let id = table.intern(policy.generation(), &caller)?;
        let mut s = TokenBucketState {
            level: p.capacity_units(),
            updated: now,
        };
        let out = token_bucket::apply_in_place(&mut s, p, now, cost, true);
        // A full bucket admits any cost the policy accepts, and an admission writes (with the
        // expiry the record gives: written at its own time).
        out.ttl_micros?;
        *c = Compact::token_bucket(id, s);
        *note = LendNote::of(hot, s.level, unit);
        Some(out.decision)
    }

    /// [`algorithm::apply`] on the record, in its general form, and the bucket rewritten in
    /// the form its new record and expiry allow.
    #[cold]
    fn general(
        &mut self,
        table: &ParamsTable,
        policy: &Policy,
        now: u64,
        cost: u64,
    ) -> Result<Decision, PolicyError> {
        // The compact record and the expiry, read once: alive is a held record whose expiry is
        // not past (what `is_alive` tells without building the record).
        let (compact, mut expiry) = match &self.slot {
            Slot::Boxed(b) => (None, b.expires_at_ms),
            Slot::Compact(c) => c.record(table),
        };
        let was_alive = self.holds_record() && now / 1000 <= expiry;
        if !was_alive {
            // Like Redis's lazy expiry: once seen expired, a bucket never comes back, even if
            // the clock steps back before its expiry.
            *self = Self::missing();
        }
        let runs_out = self.runs_out_at_expiry(table, policy, now);
        let out = match &mut self.slot {
            Slot::Boxed(b) => {
                let out = algorithm::apply(&mut b.record, policy, now, cost, true)?;
                if let Some(ttl) = out.ttl_micros {
                    b.expires_at_ms = expires_at_ms(now, ttl);
                }
                expiry = b.expires_at_ms;
                // A transition may have left a record the compact form holds.
                if out.wrote()
                    && let Some(c) = b
                        .record
                        .as_ref()
                        .and_then(|r| Compact::of(r, expiry, table))
                {
                    self.slot = Slot::Compact(c);
                }
                out
            }
            Slot::Compact(_) => {
                let mut record = if was_alive { compact } else { None };
                let out = algorithm::apply(&mut record, policy, now, cost, true)?;
                match out.ttl_micros {
                    Some(ttl) => {
                        expiry = expires_at_ms(now, ttl);
                        *self = Self::holding(record, expiry, table);
                    }
                    None if !was_alive && !out.keep_expiry => {}
                    None if out.keep_expiry => *self = Self::holding(record, expiry, table),
                    None => {}
                }
                out
            }
        };
        let mut decision = out.decision;
        if runs_out {
            algorithm::cap_at_expiry(&mut decision, now, expiry);
        }
        Ok(decision)
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
        let policy = policy_for_test();
        // An expiry the record does not give (an empty bucket refills in 2 s): boxed with it.
        let state = Record {
            generation: 0,
            params: *policy.algorithm(),
            pending: None,
            state: State::TokenBucket(TokenBucketState {
                level: 0,
                updated: 0,
            }),
        };
        let b = Bucket::new(Some(state.clone()), &table, 1_000_000, 1_500);
        assert!(matches!(b.slot, Slot::Boxed(_)));
        assert_eq!(b.record(&table), Some(state));
        assert_eq!(b.expires_at_ms(&table), 1_001);
        assert!(b.is_alive(&table, 1_001));
        assert!(!b.is_alive(&table, 1_002));
        // A record as the core writes it, with the TTL it returns: compact, the same expiry.
        for (at, cost) in [(1_000_000, 1), (1_000_999, 2), (1_000_100, 1)] {
            let mut record = None;
            let out = algorithm::apply(&mut record, &policy, at, cost, true).unwrap();
            let expiry = expires_at_ms(at, out.ttl_micros.unwrap());
            let b = Bucket::new(record.clone(), &table, at, out.ttl_micros.unwrap());
            assert!(matches!(b.slot, Slot::Compact(_)), "{at} {cost}");
            assert_eq!(b.record(&table), record);
            assert_eq!(b.expires_at_ms(&table), expiry);
            assert!(b.is_alive(&table, expiry));
            assert!(!b.is_alive(&table, expiry + 1));
        }
    }

    #[test]
    fn an_expired_bucket_counts_as_missing() {
        let table = ParamsTable::new();
        let policy = Policy::token_bucket(2, Rate::per_second(1)).unwrap();
        let mut b = Bucket::missing();
        assert!(b.apply(&table, &policy, 0, 2).unwrap().allowed);
        assert_eq!(b.expires_at_ms(&table), 2_000);
        assert!(!b.apply(&table, &policy, 500_000, 2).unwrap().allowed);
        // the same empty state, expired, is a full bucket
        let empty = b.record(&table);
        let mut b = Bucket::new(empty, &table, 0, 499_000);
        assert_eq!(b.expires_at_ms(&table), 499);
        let d = b.apply(&table, &policy, 500_000, 2).unwrap();
        assert!(d.allowed);
        assert_eq!(d.reset_after, Duration::from_secs(2));
        assert_eq!(b.expires_at_ms(&table), 2_500);
    }

    #[test]
    fn records_round_trip_through_every_form() {
        let table = ParamsTable::new();
        let tb = Policy::token_bucket(5, Rate::new(7, Duration::from_secs(3))).unwrap();
        let fw = Policy::fixed_window(3, Duration::from_secs(1)).unwrap();
        let sl = Policy::sliding_log(3, Duration::from_secs(1)).unwrap();
        for (policy, boxed) in [(&tb, false), (&fw, false), (&sl, true)] {
            let mut record = None;
            let ttl = algorithm::apply(&mut record, policy, 1_000, 1, true)
                .unwrap()
                .ttl_micros
                .unwrap();
            let b = Bucket::new(record.clone(), &table, 1_000, ttl);
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
            let mut b = Bucket::missing();
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
        let runs_out = algorithm::runs_out_at_expiry(plain.as_ref(), policy, now);
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
            let mut bucket = Bucket::missing();
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
                (plain, plain_expiry) = (Some(record), bucket.expires_at_ms(&table));
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
                    assert_eq!(bucket.expires_at_ms(&table), plain_expiry, "{at}");
                }
            }
        }
    }

    /// The division-free aliveness test agrees with the expiry, at and around every edge: the
    /// expiry's millisecond, the write's millisecond plus one, the first millisecond past the
    /// write's 1,000 µs floor.
    #[test]
    fn a_token_bucket_is_alive_exactly_through_its_expiry() {
        let mut rng = Rng(0x5EED_1234_ABCD_0001);
        let mut checked = 0;
        for _ in 0..20_000 {
            let policy = loop {
                let p = random_policy(&mut rng);
                if matches!(p.algorithm(), Algorithm::TokenBucket(_)) {
                    break p;
                }
            };
            let Algorithm::TokenBucket(p) = *policy.algorithm() else {
                unreachable!()
            };
            let cap = p.capacity_units();
            // levels near full (a refill under 1 ms) as often as any
            let level = match rng.below(3) {
                0 => cap - rng.below(cap.min(3 * p.rate) + 1),
                1 => cap,
                _ => rng.below(cap + 1),
            };
            let s = TokenBucketState {
                level,
                updated: 1_700_000_000_000_000 + rng.below(1 << 20),
            };
            let expiry = token_bucket_expiry(&p, s);
            let first = s.updated / 1000;
            for now_ms in [
                expiry - 1,
                expiry,
                expiry + 1,
                first,
                first + 1,
                first + 2,
                (s.updated + 1000) / 1000,
                (s.updated + 1000) / 1000 + 1,
                first + rng.below(5_000),
            ] {
                assert_eq!(
                    token_bucket_alive(&p, s, now_ms),
                    now_ms <= expiry,
                    "{policy} {s:?} at {now_ms} ms, expiry {expiry}"
                );
                checked += 1;
            }
        }
        assert_eq!(checked, 180_000);
    }

    #[test]
    fn a_compact_bucket_is_small() {
        assert_eq!(std::mem::size_of::<Bucket>(), 16);
    }
}
