//! Differential test: the Lua scripts against `tollgate_core::algorithm::apply`, on the same
//! clock. Thousands of random operations (random keys from a small set, random costs, clock
//! steps of every size including idle gaps past expiry and steps backwards) go to a RedisStore
//! on a redis-server whose clock the test freezes and moves, and to a model that applies the
//! core maths to a map with Redis's millisecond expiry. Every decision, every stored record
//! (byte for byte, and decoded) and every key's remaining TTL must be identical.
//!
//! Policy changes: with shared keys, callers of several policies — different parameters,
//! generations and transition rules, of one algorithm or of all three (one record per key
//! whatever the algorithm) — take turns on live buckets, so every rule meets buckets written by
//! older, newer and same-generation policies, growing and shrinking, and converts every
//! algorithm into every other.
//!
//! Windows' edges (`…on_both_backends`): hand-written sequences of a full sliding log and of
//! fixed windows of 1 ms and of an odd length, on Redis and `LocalStore` at the same instants,
//! each denial's `retry_after` exact to the microsecond.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::Server;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tollgate_core::algorithm::{self, Record};
use tollgate_core::{
    Acquire, Decision, Key, MAX_DURATION, MAX_EXACT, Policy, PolicyError, Rate, Store, StoreError,
    Transition,
};
use tollgate_redis::{RedisStore, record};

const T0: u64 = 1_700_000_000_123_457;
const KEYS_PER_POLICY: usize = 3;

/// The core maths on a map with Redis's expiry: a state written at `now` with a TTL of `ttl`
/// µs lives while `now_ms <= algorithm::expires_at_ms(now, ttl)`.
#[derive(Default)]
struct Model {
    map: HashMap<String, (Record, u64)>,
}

impl Model {
    /// A decision, or the cost above the governing limit (a policy change can shrink it).
    fn apply(
        &mut self,
        rkey: &str,
        policy: &Policy,
        now: u64,
        cost: u64,
        commit: bool,
    ) -> Result<Decision, PolicyError> {
        let entry = self.map.get(rkey).cloned();
        let mut state = entry.as_ref().map(|(s, _)| s.clone());
        let runs_out = algorithm::runs_out_at_expiry(state.as_ref(), policy, now);
        let mut out = algorithm::apply(&mut state, policy, now, cost, commit)?;
        if runs_out && let Some((_, expires_at_ms)) = &entry {
            algorithm::cap_at_expiry(&mut out.decision, now, *expires_at_ms);
        }
        if out.wrote() {
            let expires_at_ms = match (out.ttl_micros, &entry) {
                (Some(ttl), _) => algorithm::expires_at_ms(now, ttl),
                (None, Some((_, kept))) => *kept,
                (None, None) => unreachable!("keep_expiry on a missing bucket"),
            };
            self.map.insert(
                rkey.to_owned(),
                (state.expect("a written state"), expires_at_ms),
            );
        }
        Ok(out.decision)
    }

    /// Drops every state expired at `now`, returning their keys (so the test can make Redis
    /// drop them too, deterministically, before the clock may step back).
    fn expire(&mut self, now: u64) -> Vec<String> {
        let now_ms = now / 1000;
        let gone: Vec<String> = self
            .map
            .iter()
            .filter(|(_, (_, exp))| now_ms > *exp)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &gone {
            self.map.remove(k);
        }
        gone
    }
}

struct Bucket {
    key: Key,
    policy: Policy,
    rkey: String,
}

struct Differential {
    server: Server,
    store: RedisStore,
    model: Model,
    rng: StdRng,
    now: u64,
    buckets: Vec<Bucket>,
    conn: redis::Connection,
    ops: u64,
}

impl Differential {
    /// With `share_keys`, every policy uses the same keys, so policies of one algorithm take
    /// turns on live buckets (a policy change: the state is reinterpreted, tokens clamped).
    async fn start(policies: &[Policy], seed: u64, share_keys: bool) -> Self {
        let server = Server::start_with_clock();
        server.set_time(T0);
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(5))
            .build()
            .await
            .unwrap();
        let mut buckets = Vec::new();
        for (i, policy) in policies.iter().enumerate() {
            for j in 0..KEYS_PER_POLICY {
                let ns = if share_keys {
                    "diff".to_owned()
                } else {
                    format!("diff{i}")
                };
                let key = Key::new(&ns, [format!("k{j}")]).unwrap();
                let rkey = store.redis_key(&key, policy);
                buckets.push(Bucket {
                    key,
                    policy: *policy,
                    rkey,
                });
            }
        }
        let conn = server.conn();
        Self {
            server,
            store,
            model: Model::default(),
            rng: StdRng::seed_from_u64(seed),
            now: T0,
            buckets,
            conn,
            ops: 0,
        }
    }

    fn step_clock(&mut self) {
        let r: u32 = self.rng.random_range(0..100);
        let step: i64 = match r {
            0..15 => 0,
            15..50 => self.rng.random_range(1..1_000),
            50..75 => self.rng.random_range(1_000..2_000_000),
            75..85 => self.rng.random_range(2_000_000..60_000_000),
            85..90 => self.rng.random_range(3_600_000_000..30 * 86_400_000_000),
            _ => -self.rng.random_range(1..3_000_000),
        };
        self.now = self.now.saturating_add_signed(step).max(T0 - 10_000_000);
        self.server.set_time(self.now);
        // Keys expired at the new instant: have Redis drop them now (lazily, on access), as the
        // model does, so a later step back cannot find them alive in one and gone in the other.
        for rkey in self.model.expire(self.now) {
            let exists: bool = redis::cmd("EXISTS")
                .arg(&rkey)
                .query(&mut self.conn)
                .unwrap();
            assert!(!exists, "{rkey} outlived its expiry at {}", self.now);
        }
    }

    fn cost(&mut self, limit: u64) -> u64 {
        match self.rng.random_range(0..10) {
            0..7 => self.rng.random_range(1..=limit.min(3)),
            7..9 => self.rng.random_range(1..=limit),
            _ => limit,
        }
    }

    /// Checks the bucket's stored state and TTL in Redis against the model.
    fn check_state(&mut self, b: usize) {
        let rkey = self.buckets[b].rkey.clone();
        let raw: Option<Vec<u8>> = redis::cmd("GET").arg(&rkey).query(&mut self.conn).unwrap();
        let pttl: i64 = redis::cmd("PTTL").arg(&rkey).query(&mut self.conn).unwrap();
        let expected = self.model.map.get(&rkey);
        match (raw, expected) {
            (None, None) => assert_eq!(pttl, -2),
            (Some(raw), Some((state, exp))) => {
                let ctx = format!("op {} at {}: {rkey}", self.ops, self.now);
                assert_eq!(
                    record::decode(&raw).as_ref(),
                    Some(state),
                    "{ctx}: stored record"
                );
                assert_eq!(raw, record::encode(state), "{ctx}: stored bytes");
                assert_eq!(
                    pttl,
                    i64::try_from(*exp - self.now / 1000).unwrap(),
                    "{ctx}: PTTL"
                );
            }
            (raw, expected) => panic!(
                "op {} at {}: {rkey}: Redis holds {raw:?}, the model {expected:?}",
                self.ops, self.now
            ),
        }
    }

    async fn one_op(&mut self) {
        self.step_clock();
        self.ops += 1;
        let b = self.rng.random_range(0..self.buckets.len());
        let (key, policy, rkey) = {
            let bk = &self.buckets[b];
            (bk.key.clone(), bk.policy, bk.rkey.clone())
        };
        let ctx = format!("op {} at {}: {policy} on {rkey}", self.ops, self.now);
        match self.rng.random_range(0..100) {
            0..70 => {
                let cost = self.cost(policy.limit());
                let got = self.store.acquire(&key, &policy, cost).await;
                let want = self.model.apply(&rkey, &policy, self.now, cost, true);
                same(got, want, &format!("{ctx}: acquire {cost}"));
            }
            70..85 => {
                let cost = self.cost(policy.limit());
                let got = self.store.peek(&key, &policy, cost).await;
                let want = self.model.apply(&rkey, &policy, self.now, cost, false);
                same(got, want, &format!("{ctx}: peek {cost}"));
            }
            85..88 => {
                self.store.reset(&key, &policy).await.unwrap();
                self.model.map.remove(&rkey);
            }
            _ => {
                // a batch at one instant, possibly naming one bucket twice
                let n = self.rng.random_range(2..=4);
                let picks: Vec<(usize, u64)> = (0..n)
                    .map(|_| {
                        let i = self.rng.random_range(0..self.buckets.len());
                        (i, self.cost(self.buckets[i].policy.limit()))
                    })
                    .collect();
                let reqs: Vec<Acquire<'_>> = picks
                    .iter()
                    .map(|&(i, cost)| Acquire {
                        key: &self.buckets[i].key,
                        policy: &self.buckets[i].policy,
                        cost,
                    })
                    .collect();
                let got = self.store.acquire_many(&reqs).await;
                let want: Vec<Result<Decision, PolicyError>> = picks
                    .iter()
                    .map(|&(i, cost)| {
                        self.model.apply(
                            &self.buckets[i].rkey,
                            &self.buckets[i].policy,
                            self.now,
                            cost,
                            true,
                        )
                    })
                    .collect();
                // Each request has its own result: a cost refused by the governing (newer)
                // policy fails that request alone, and the others are decided and applied.
                let got = got.unwrap_or_else(|e| panic!("{ctx}: batch {picks:?}: {e}"));
                assert_eq!(got.len(), want.len(), "{ctx}: batch {picks:?}");
                for (j, (g, w)) in got.into_iter().zip(want).enumerate() {
                    same(g, w, &format!("{ctx}: batch {picks:?} [{j}]"));
                }
                for (i, _) in picks {
                    self.check_state(i);
                }
            }
        }
        self.check_state(b);
    }

    async fn run(mut self, ops: u64) -> Self {
        for _ in 0..ops {
            self.one_op().await;
        }
        self
    }
}

#[track_caller]
fn same(got: Result<Decision, StoreError>, want: Result<Decision, PolicyError>, ctx: &str) {
    match (got, want) {
        (Ok(g), Ok(w)) => assert_eq!(g, w, "{ctx}"),
        (Err(StoreError::InvalidPolicy(g)), Err(w)) => assert_eq!(g, w, "{ctx}"),
        (g, w) => panic!("{ctx}: Redis {g:?}, model {w:?}"),
    }
}

fn seed() -> u64 {
    std::env::var("TOLLGATE_DIFF_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x70_11_6a_7e)
}

fn ops() -> u64 {
    std::env::var("TOLLGATE_DIFF_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3_000)
}

async fn differential(name: &str, policies: &[Policy], seed: u64) {
    differential_on(name, policies, seed, false).await;
}

async fn differential_on(name: &str, policies: &[Policy], seed: u64, share_keys: bool) {
    let d = Differential::start(policies, seed, share_keys).await;
    let d = d.run(ops()).await;
    let allowed = d.model.map.len();
    eprintln!(
        "{name}: {} operations identical (seed {seed:#x}, {allowed} live buckets at the end)",
        d.ops
    );
}

#[tokio::test]
async fn token_bucket_scripts_equal_the_core_maths() {
    let big_capacity = (MAX_EXACT - 1) / 1_000_000; // one token per second: unit 10^6, ~2^52 units
    let policies = [
        Policy::token_bucket(10, Rate::new(7, Duration::from_secs(3))).unwrap(),
        Policy::token_bucket(1, Rate::per_second_f64(0.3).unwrap()).unwrap(),
        Policy::token_bucket(100, Rate::new(13, Duration::from_secs(7)))
            .unwrap()
            .with_max_elapsed(Duration::from_millis(2_500))
            .unwrap(),
        Policy::token_bucket(big_capacity, Rate::per_second(1)).unwrap(),
        Policy::token_bucket(
            (1 << 50) + 7,
            Rate::new((1 << 50) - 1, Duration::from_micros(3)),
        )
        .unwrap(),
        Policy::token_bucket(3, Rate::new(1_000_003, Duration::from_micros(999_983))).unwrap(),
    ];
    differential("token bucket", &policies, seed()).await;
}

#[tokio::test]
async fn fixed_window_scripts_equal_the_core_maths() {
    let policies = [
        Policy::fixed_window(5, Duration::from_secs(1)).unwrap(),
        Policy::fixed_window(7, Duration::from_millis(3)).unwrap(),
        Policy::fixed_window(MAX_EXACT, MAX_DURATION).unwrap(),
        Policy::fixed_window(1000, Duration::from_micros(1_700_003)).unwrap(),
    ];
    differential("fixed window", &policies, seed() ^ 1).await;
}

#[tokio::test]
async fn sliding_log_scripts_equal_the_core_maths() {
    let policies = [
        Policy::sliding_log(5, Duration::from_secs(1)).unwrap(),
        Policy::sliding_log(1000, Duration::from_millis(3)).unwrap(),
        Policy::sliding_log(7, Duration::from_micros(1_700_003)).unwrap(),
        Policy::sliding_log(1000, MAX_DURATION).unwrap(),
    ];
    differential("sliding log", &policies, seed() ^ 2).await;
}

#[tokio::test]
async fn all_algorithms_interleaved_equal_the_core_maths() {
    let policies = [
        Policy::token_bucket(10, Rate::new(7, Duration::from_secs(3))).unwrap(),
        Policy::fixed_window(5, Duration::from_secs(2)).unwrap(),
        Policy::sliding_log(6, Duration::from_millis(1500)).unwrap(),
    ];
    differential("all algorithms", &policies, seed() ^ 3).await;
}

#[tokio::test]
async fn token_bucket_policy_changes_on_live_buckets_equal_the_core_maths() {
    let policies = [
        Policy::token_bucket(10, Rate::new(7, Duration::from_secs(3))).unwrap(),
        Policy::token_bucket(4, Rate::per_second(1)).unwrap(),
        Policy::token_bucket(25, Rate::new(3, Duration::from_millis(700)))
            .unwrap()
            .with_max_elapsed(Duration::from_secs(1))
            .unwrap(),
    ];
    differential_on("token bucket policy changes", &policies, seed() ^ 4, true).await;
}

/// Every (parameters, generation, rule) combination of `bases`: generations 0 to 3, each rule.
fn generations(bases: &[Policy]) -> Vec<Policy> {
    let mut out = Vec::new();
    for (i, base) in bases.iter().enumerate() {
        for rule in Transition::ALL {
            // base i at generations i and i + 1, so parameters and generations both vary
            for g in [i as u64, i as u64 + 1] {
                out.push(base.with_generation(g).with_transition(rule));
            }
        }
    }
    out
}

#[tokio::test]
async fn token_bucket_generations_and_transitions_equal_the_core_maths() {
    let policies = generations(&[
        Policy::token_bucket(10, Rate::new(7, Duration::from_secs(3))).unwrap(),
        Policy::token_bucket(4, Rate::per_second(1)).unwrap(),
        Policy::token_bucket(25, Rate::new(3, Duration::from_millis(700)))
            .unwrap()
            .with_max_elapsed(Duration::from_secs(1))
            .unwrap(),
        Policy::token_bucket((1 << 40) + 3, Rate::new(999_983, Duration::from_micros(7))).unwrap(),
    ]);
    differential_on("token bucket transitions", &policies, seed() ^ 5, true).await;
}

#[tokio::test]
async fn fixed_window_generations_and_transitions_equal_the_core_maths() {
    let policies = generations(&[
        Policy::fixed_window(5, Duration::from_secs(1)).unwrap(),
        Policy::fixed_window(12, Duration::from_millis(2_500)).unwrap(),
        Policy::fixed_window(3, Duration::from_millis(300)).unwrap(),
        Policy::fixed_window(MAX_EXACT, Duration::from_secs(7)).unwrap(),
    ]);
    differential_on("fixed window transitions", &policies, seed() ^ 6, true).await;
}

#[tokio::test]
async fn sliding_log_generations_and_transitions_equal_the_core_maths() {
    let policies = generations(&[
        Policy::sliding_log(5, Duration::from_secs(1)).unwrap(),
        Policy::sliding_log(12, Duration::from_millis(2_500)).unwrap(),
        Policy::sliding_log(3, Duration::from_millis(300)).unwrap(),
        Policy::sliding_log(1000, Duration::from_millis(3)).unwrap(),
    ]);
    differential_on("sliding log transitions", &policies, seed() ^ 7, true).await;
}

/// One generation (0), other parameters, every rule, on shared keys: at an equal generation the
/// caller's parameters take over by carry whatever the rule, in Lua as in the core maths.
#[tokio::test]
async fn equal_generations_take_over_by_carry_equal_the_core_maths() {
    let mut policies = Vec::new();
    for base in [
        Policy::token_bucket(5, Rate::new(7, Duration::from_secs(3))).unwrap(),
        Policy::token_bucket(4, Rate::per_second(1)).unwrap(),
        Policy::fixed_window(5, Duration::from_secs(1)).unwrap(),
        Policy::fixed_window(4, Duration::from_millis(2_500)).unwrap(),
        Policy::sliding_log(5, Duration::from_secs(1)).unwrap(),
        Policy::sliding_log(4, Duration::from_millis(2_500)).unwrap(),
    ] {
        for rule in Transition::ALL {
            policies.push(base.with_transition(rule));
        }
    }
    differential_on("equal generations", &policies, seed() ^ 8, true).await;
}

/// Algorithm changes on live buckets: token buckets, fixed windows and sliding logs at
/// generations 0 to 6 under every rule take turns on shared keys (one record per key whatever
/// the algorithm), so every rule converts every algorithm into every other, older callers are
/// decided under a newer record of another algorithm, and deferrals across algorithms run out.
#[tokio::test]
async fn algorithm_changes_across_generations_equal_the_core_maths() {
    let policies = generations(&[
        Policy::token_bucket(10, Rate::new(7, Duration::from_secs(3))).unwrap(),
        Policy::fixed_window(5, Duration::from_secs(1)).unwrap(),
        Policy::sliding_log(6, Duration::from_millis(1500)).unwrap(),
        Policy::token_bucket(4, Rate::per_second(1))
            .unwrap()
            .with_max_elapsed(Duration::from_millis(2_500))
            .unwrap(),
        Policy::fixed_window(12, Duration::from_millis(2_500)).unwrap(),
        Policy::sliding_log(3, Duration::from_millis(300)).unwrap(),
        Policy::token_bucket((1 << 40) + 3, Rate::new(999_983, Duration::from_micros(7))).unwrap(),
    ]);
    differential_on("algorithm changes", &policies, seed() ^ 9, true).await;
}

/// A store under test: its name, the store, and how to set its clock.
type Backend<'a> = (&'a str, &'a dyn Store, &'a dyn Fn(u64));

/// A `Reset` into another algorithm after Redis's clock stepped back starts the fresh bucket
/// at `max(now, the old bucket's time)`, as the core does: when the clock comes back to where
/// the bucket already was, nothing is credited twice (it started at the stepped-back clock,
/// and a second fresh allowance was admitted at its return). A sliding log keeps its time in
/// its entries, so the empty log of a `Reset` keeps the old bucket's time until its first
/// entry is written there (it had none, and admitted 5 again: found by a review). The same
/// cases on `LocalStore` on a clock the test moves.
#[tokio::test]
async fn reset_across_algorithms_after_a_step_back_credits_nothing_twice() {
    const S: u64 = 1_000_000;
    let t = 1_700_000_000_000_000 + S; // one second into a 10-second window
    let server = Server::start_with_clock();
    let redis = server.multiplexed().await;
    let clock = tollgate_core::ManualClock::new(t);
    let local = tollgate::LocalStore::with_clock(clock.clone());
    let reset = |p: Policy, g| p.with_generation(g).with_transition(Transition::Reset);
    let window = |g| reset(Policy::fixed_window(5, Duration::from_secs(10)).unwrap(), g);
    let bucket = |g| reset(Policy::token_bucket(5, Rate::per_second(1)).unwrap(), g);
    let log = |g| reset(Policy::sliding_log(5, Duration::from_secs(10)).unwrap(), g);
    // (old, new, name, admitted when the clock is back at T): a fixed window keeps only its
    // window's start (T - 1 s), so a token bucket starting there has refilled one token by T
    let cases = [
        (window(0), window(2), "fixed window -> fixed window", 0),
        (bucket(0), window(2), "token bucket -> fixed window", 0),
        (bucket(0), bucket(2), "token bucket -> token bucket", 0),
        (window(0), bucket(2), "fixed window -> token bucket", 1),
        (log(0), log(2), "sliding log -> sliding log", 0),
        (bucket(0), log(2), "token bucket -> sliding log", 0),
        (window(0), log(2), "fixed window -> sliding log", 0),
        (log(0), bucket(2), "sliding log -> token bucket", 0),
    ];
    let stores: [Backend<'_>; 2] = [
        ("Redis", &redis, &|at| server.set_time(at)),
        ("LocalStore", &local, &|at| clock.set(at)),
    ];
    for (backend, store, set) in stores {
        for (i, (old, new, name, refilled)) in cases.iter().enumerate() {
            let key = Key::new("reset-back", [format!("k{i}")]).unwrap();
            set(t);
            assert!(store.acquire(&key, old, 5).await.unwrap().allowed, "{name}");
            set(t - 10 * S);
            let mut back = 0;
            for _ in 0..5 {
                back += u32::from(store.acquire(&key, new, 1).await.unwrap().allowed);
            }
            set(t);
            let mut again = 0;
            for _ in 0..5 {
                again += u32::from(store.acquire(&key, new, 1).await.unwrap().allowed);
            }
            assert_eq!((back, again), (5, *refilled), "{name}, reset, on {backend}");
        }
    }
}

/// The windows tests' base time (a multiple of 10 s).
const TW: u64 = 1_700_000_000_000_000;

/// `script` (clock offset from `TW` in µs, cost) on a redis-server whose clock the test sets and
/// on a `LocalStore` on a `ManualClock` at the same instants: every decision equal, and each
/// denial's `retry_after` exact (the cost admitted then by a peek on both, not a microsecond
/// before). From a review of both algorithms' edges; it passed.
async fn on_both_backends(
    name: &str,
    policy: &Policy,
    script: &[(i64, u64)], // (clock offset from TW in µs, cost)
) -> Vec<Decision> {
    let server = Server::start_with_clock();
    let redis = server.multiplexed().await;
    let clock = tollgate_core::ManualClock::new(TW);
    let local = tollgate::LocalStore::with_clock(clock.clone());
    let key = Key::new("windows", [name]).unwrap();
    let mut out = Vec::new();
    for (i, &(off, cost)) in script.iter().enumerate() {
        let at = TW.checked_add_signed(off).unwrap();
        server.set_time(at);
        clock.set(at);
        let r = redis.acquire(&key, policy, cost).await.unwrap();
        let l = local.acquire(&key, policy, cost).await.unwrap();
        assert_eq!(r, l, "{name} step {i} at {off}: Redis vs LocalStore");
        // retry_after is exact: admitted then (peek), not a microsecond before
        if let Some(w) = r.retry_after {
            let w = w.as_micros() as u64;
            for (t, want) in [(at + w, true), (at + w - 1, false)] {
                server.set_time(t);
                clock.set(t);
                let pr = redis.peek(&key, policy, cost).await.unwrap();
                let pl = local.peek(&key, policy, cost).await.unwrap();
                assert_eq!(pr, pl, "{name} step {i}: peek at {t}");
                assert_eq!(pr.allowed, want, "{name} step {i}: retry_after {w} at {t}");
            }
        }
        out.push(r);
    }
    out
}

/// A full sliding log of limit 1,000 in distinct microseconds stays within 16 KB + header,
/// and bursts at one microsecond merge; steps back and forward forget nothing.
#[tokio::test]
async fn a_full_sliding_log_merges_steps_and_stays_bounded_on_both_backends() {
    let p = Policy::sliding_log(1000, Duration::from_secs(10)).unwrap();
    let mut script: Vec<(i64, u64)> = (0..1000).map(|i| (i, 1)).collect();
    script.push((1000, 1)); // denied, until the entry at 0 leaves
    script.push((-5_000_000, 1)); // step back: still denied
    script.push((10_000_002, 3)); // entries 0..2 left: admitted
    script.push((10_000_002, 1)); // same µs: denied (3 merged)
    let d = on_both_backends("log", &p, &script).await;
    assert!(d[..1000].iter().all(|d| d.allowed));
    assert!(!d[1000].allowed && !d[1001].allowed);
    assert!(d[1002].allowed, "{:?}", d[1002]);
    assert!(!d[1003].allowed);
    let server = Server::start_with_clock();
    server.set_time(TW);
    let redis = server.multiplexed().await;
    let key = Key::new("windows", ["size"]).unwrap();
    for i in 0..1000 {
        server.set_time(TW + i);
        assert!(redis.acquire(&key, &p, 1).await.unwrap().allowed);
    }
    let rkey = redis.redis_key(&key, &p);
    let len: usize = redis::cmd("STRLEN")
        .arg(rkey)
        .query(&mut server.conn())
        .unwrap();
    assert!(len <= 16_000 + 31, "record of {len} bytes");
}

/// Weighted costs in a 1 ms fixed window and a window of an odd length, stepping across
/// boundaries, back and forward.
#[tokio::test]
async fn fixed_window_edges_decide_alike_on_both_backends() {
    let p = Policy::fixed_window(5, Duration::from_millis(1)).unwrap();
    let script = [
        (0, 5),
        (999, 1),
        (1000, 5),
        (500, 1),
        (2_000, 3),
        (2_000, 3),
    ];
    let d = on_both_backends("fw1ms", &p, &script).await;
    assert_eq!(
        d.iter().map(|d| d.allowed).collect::<Vec<_>>(),
        [true, false, true, false, true, false]
    );
    let p = Policy::fixed_window(4, Duration::from_micros(1_700_003)).unwrap();
    let script = [
        (0, 4),
        (1, 1),
        (3_000_000, 2),
        (-2_000_000, 3),
        (3_400_007, 4),
    ];
    on_both_backends("fwodd", &p, &script).await;
}
