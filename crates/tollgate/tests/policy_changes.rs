//! Policy changes and clock steps on live buckets, on both backends: a real redis-server whose
//! clock the test freezes and moves, and `LocalStore` on a `ManualClock`. The same sequences
//! give the same decisions on both.
//!
//! - `mixed_fleet_*`: instances on generation 1 and 2 hammer one key concurrently; once
//!   generation 2 has written the bucket, the admitted total is exactly what generation 2's
//!   rule leaves (every rule × algorithm, growing and shrinking the limit).
//! - `clock_steps_*`: seconds and hours, forward and back, on live buckets of every algorithm.
//! - `a_deferral_ends_*`: the millisecond a deferred bucket's key outlives its end.

use std::sync::Arc;
use std::time::Duration;

use tollgate::redis::RedisStore;
use tollgate::{Decision, Key, LocalStore, ManualClock, Policy, Rate, Store, Transition};
use tollgate_testkit::server::RedisServer;

const T0: u64 = 1_700_000_000_000_000;
const SEC: u64 = 1_000_000;
const HOUR: u64 = 3_600 * SEC;
const INSTANCES: usize = 8;

async fn redis_stores(server: &RedisServer, n: usize) -> Vec<Arc<dyn Store>> {
    let mut out: Vec<Arc<dyn Store>> = Vec::new();
    for _ in 0..n {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(5))
            .build()
            .await
            .unwrap();
        out.push(Arc::new(store));
    }
    out
}

/// Old (generation 1, limit 10) and new (generation 2, `limit`) policies of one algorithm.
fn pair(alg: &str, limit: u64, rule: Transition) -> (Policy, Policy) {
    let make = |l: u64| match alg {
        // one token per second: a frozen clock refills nothing
        "tb" => Policy::token_bucket(l, Rate::per_second(1)).unwrap(),
        "fw" => Policy::fixed_window(l, Duration::from_secs(3600)).unwrap(),
        _ => Policy::sliding_log(l, Duration::from_secs(3600)).unwrap(),
    };
    (
        make(10).with_generation(1),
        make(limit).with_generation(2).with_transition(rule),
    )
}

/// What is left for the whole fleet once generation 2 meets a bucket on which generation 1
/// admitted 3 of 10 (frozen clock), by the rules of docs/policy-changes.md.
fn expected_after_takeover(alg: &str, limit: u64, rule: Transition) -> u64 {
    match rule {
        Transition::Reset => limit,
        // token bucket: 7 tokens, clamped; windows and logs: 3 used stay used
        Transition::Carry if alg == "tb" => limit.min(7),
        Transition::Carry => limit.saturating_sub(3),
        // 70 % still available, rounded down
        Transition::Proportional => 7 * limit / 10,
        // generation 1 governs until the bucket expires: 7 left under its limit
        _ => 7,
    }
}

/// Runs one scenario on `stores` (instances 0..INSTANCES/2 on generation 1, the rest on 2) and
/// returns the admitted total after generation 2's first write, that write included.
async fn takeover(stores: &[Arc<dyn Store>], key: &Key, old: &Policy, new: &Policy) -> u64 {
    let d = stores[0].acquire(key, old, 3).await.unwrap();
    assert!(
        d.allowed && d.remaining == 7,
        "generation 1 takes 3 of 10: {d:?}"
    );
    // Generation 2 meets the bucket first (the condition of the bound), then everyone hammers.
    let first = stores[INSTANCES - 1].acquire(key, new, 1).await.unwrap();
    let mut tasks = Vec::new();
    for (i, store) in stores.iter().enumerate() {
        let (store, key) = (store.clone(), key.clone());
        let policy = if i < INSTANCES / 2 { *old } else { *new };
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0;
            for _ in 0..12 {
                if store.acquire(&key, &policy, 1).await.unwrap().allowed {
                    admitted += 1;
                }
            }
            admitted
        }));
    }
    let mut total = u64::from(first.allowed);
    for t in tasks {
        total += t.await.unwrap();
    }
    total
}

async fn mixed_fleet(stores: &[Arc<dyn Store>], backend: &str) {
    for alg in ["tb", "fw", "sl"] {
        for (limit, direction) in [(5, "shrink"), (20, "grow")] {
            for rule in Transition::ALL {
                let (old, new) = pair(alg, limit, rule);
                let key = Key::new("fleet", [format!("{alg}-{direction}-{rule}")]).unwrap();
                let got = takeover(stores, &key, &old, &new).await;
                let want = expected_after_takeover(alg, limit, rule);
                assert_eq!(
                    got, want,
                    "{backend}: {alg} {direction} to {limit} by {rule}: admitted {got} after generation 2 wrote, expected {want}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_fleet_on_redis_obeys_generation_two_under_every_rule() {
    let server = RedisServer::builder().clock_control(true).start();
    server.clock().freeze_at_micros(T0);
    let stores = redis_stores(&server, INSTANCES).await;
    mixed_fleet(&stores, "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_fleet_on_local_store_obeys_generation_two_under_every_rule() {
    let local: Arc<dyn Store> = Arc::new(LocalStore::with_clock(ManualClock::new(T0)));
    let stores = vec![local; INSTANCES];
    mixed_fleet(&stores, "local").await;
}

/// A deferred bucket switches to generation 2 once it expires (the clock moves past it).
#[tokio::test]
async fn defer_until_expiry_switches_when_the_bucket_expires_on_both_backends() {
    let server = RedisServer::builder().clock_control(true).start();
    let clock = ManualClock::new(T0);
    let stores: [(&str, Arc<dyn Store>); 2] = [
        ("redis", redis_stores(&server, 1).await.remove(0)),
        ("local", Arc::new(LocalStore::with_clock(clock.clone()))),
    ];
    for (name, store) in stores {
        server.clock().freeze_at_micros(T0);
        clock.set(T0);
        let old = Policy::fixed_window(10, Duration::from_secs(10))
            .unwrap()
            .with_generation(1);
        let new = Policy::fixed_window(2, Duration::from_secs(10))
            .unwrap()
            .with_generation(2)
            .with_transition(Transition::DeferUntilExpiry);
        let key = Key::new("defer", ["k"]).unwrap();
        assert!(store.acquire(&key, &old, 3).await.unwrap().allowed);
        let d = store.acquire(&key, &new, 1).await.unwrap();
        assert_eq!(
            (d.allowed, d.limit, d.remaining),
            (true, 10, 6),
            "{name}: old governs"
        );
        server.clock().advance(Duration::from_secs(10));
        clock.advance(Duration::from_secs(10));
        // the window (and with it the bucket) ended: generation 2 takes a fresh one
        let d = store.acquire(&key, &old, 1).await.unwrap();
        assert_eq!(
            d.limit, 10,
            "{name}: an old caller on a fresh bucket writes generation 1"
        );
        let d = store.acquire(&key, &new, 1).await.unwrap();
        assert_eq!(
            (d.limit, d.remaining),
            (10, 8),
            "{name}: deferred again, to this window's end"
        );
        server.clock().advance(Duration::from_secs(10));
        clock.advance(Duration::from_secs(10));
        let d = store.acquire(&key, &new, 1).await.unwrap();
        assert_eq!(
            (d.allowed, d.limit, d.remaining),
            (true, 2, 1),
            "{name}: generation 2"
        );
        let d = store.acquire(&key, &old, 2).await.unwrap();
        assert_eq!(
            (d.allowed, d.limit, d.remaining),
            (false, 2, 1),
            "{name}: old caller under generation 2"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Clock steps on a real server clock against LocalStore on a ManualClock.

/// One step: move the clock by `by` microseconds (negative: back), then acquire `cost`.
type Step = (i64, u64);

const SECONDS: &[Step] = &[
    (0, 3),
    (1_500_000, 2),
    (-1_000_000, 4),
    (-5_000_000, 1),
    (7_000_000, 5),
    (250_000, 1),
    (-250_000, 1),
    (3_000_000, 2),
    (-2_999_999, 1),
    (12_000_000, 5),
    (0, 1),
];

const HOURS: &[Step] = &[
    (0, 4),
    (3_600_000_000, 5),
    (-7_200_000_000, 1),
    (-3_600_000_000, 2),
    (5 * 3_600_000_000, 5),
    (1_000_000, 1),
    (-10 * 3_600_000_000, 5),
    (24 * 3_600_000_000, 3),
    (-1_000_000, 1),
];

async fn run_steps(
    server: &RedisServer,
    redis: &RedisStore,
    local: &LocalStore<ManualClock>,
    policy: &Policy,
    steps: &[Step],
    case: &str,
) {
    let key = Key::new("clock", [case]).unwrap();
    let mut now = T0 + 1_000 * HOUR;
    for (i, &(by, cost)) in steps.iter().enumerate() {
        now = now.saturating_add_signed(by);
        server.clock().freeze_at_micros(now);
        local.clock().set(now);
        // touch first, so an expired key is gone on both before the clock may step back
        let peek_r = redis.peek(&key, policy, cost).await.unwrap();
        let peek_l = local.peek_now(&key, policy, cost).unwrap();
        assert_eq!(peek_r, peek_l, "{case} step {i} ({by:+} us): peek");
        let r: Decision = redis.acquire(&key, policy, cost).await.unwrap();
        let l = local.acquire_now(&key, policy, cost).unwrap();
        assert_eq!(r, l, "{case} step {i} ({by:+} us): acquire {cost}");
    }
}

async fn clock_steps(steps: &[Step], scale: &str) {
    let server = RedisServer::builder().clock_control(true).start();
    let redis = RedisStore::builder(server.url()).build().await.unwrap();
    let local = LocalStore::with_clock(ManualClock::new(T0));
    let policies = [
        ("tb", Policy::token_bucket(5, Rate::per_second(1)).unwrap()),
        (
            "tb-capped",
            Policy::token_bucket(5, Rate::new(1, Duration::from_secs(2)))
                .unwrap()
                .with_max_elapsed(Duration::from_secs(3))
                .unwrap(),
        ),
        (
            "fw-second",
            Policy::fixed_window(5, Duration::from_secs(2)).unwrap(),
        ),
        (
            "fw-hour",
            Policy::fixed_window(5, Duration::from_secs(3600)).unwrap(),
        ),
        (
            "sl-second",
            Policy::sliding_log(5, Duration::from_secs(2)).unwrap(),
        ),
        (
            "sl-hour",
            Policy::sliding_log(5, Duration::from_secs(3600)).unwrap(),
        ),
    ];
    for (name, policy) in &policies {
        run_steps(
            &server,
            &redis,
            &local,
            policy,
            steps,
            &format!("{scale}-{name}"),
        )
        .await;
    }
}

#[tokio::test]
async fn clock_steps_of_seconds_forward_and_back_decide_alike_on_redis_and_local() {
    clock_steps(SECONDS, "seconds").await;
}

#[tokio::test]
async fn clock_steps_of_hours_forward_and_back_decide_alike_on_redis_and_local() {
    clock_steps(HOURS, "hours").await;
}

const DEFER_T0: u64 = 1_700_000_000_000_000; // a multiple of 10 s
const DEFER_SEC: u64 = 1_000_000;

/// A bucket of generation 1 (limit 10 per 10 s) spent whole, then met by generation 2 (limit
/// 2, `DeferUntilExpiry`): denied under the old limit until the old bucket ends. From its end
/// the fleet, all on generation 2, calls 12 times at the end, 500 µs after it and 2 ms after
/// it. Returns the admissions.
async fn defer_then_burst(
    name: &str,
    store: &Arc<dyn Store>,
    set: &dyn Fn(u64),
    old: Policy,
    new: Policy,
    spend: u64,
) -> u64 {
    set(DEFER_T0);
    let key = Key::new("defer-end", [name]).unwrap();
    assert!(
        store.acquire(&key, &old, spend).await.unwrap().allowed,
        "{name}"
    );
    let d = store.acquire(&key, &new, 1).await.unwrap();
    assert!(!d.allowed, "{name}: deferred, the old limit spent: {d:?}");
    let end = DEFER_T0 + 10 * DEFER_SEC;
    let mut admitted = 0;
    for at in [end, end + 500, end + 2_000] {
        set(at);
        for _ in 0..12 {
            if store.acquire(&key, &new, 1).await.unwrap().allowed {
                admitted += 1;
            }
        }
    }
    admitted
}

/// DESIGN.md: under `DeferUntilExpiry` the old parameters govern a bucket until it expires,
/// then the new ones. Its key outlives the bucket's end by up to a millisecond (Redis expires
/// keys by the millisecond); in that millisecond the old limit governed what was logically a
/// fresh bucket, its admissions written keeping the key's expiry and gone with it, and then
/// the new limit admitted its own: 12 in the new window for a new limit of 2, on both
/// backends, for a fixed window and a sliding log (found by a review); a token bucket full
/// again the same. Now a bucket whose deferral has run out is a missing one: 2 (a token
/// bucket of capacity 2, refilled at 1 per 5 s, admits its 2 at the end and nothing more
/// within 2 ms).
#[tokio::test]
async fn a_deferral_ends_when_its_bucket_does_not_a_millisecond_later() {
    let server = RedisServer::builder().clock_control(true).start();
    let redis: Arc<dyn Store> = Arc::new(RedisStore::builder(server.url()).build().await.unwrap());
    let clock = ManualClock::new(DEFER_T0);
    let local: Arc<dyn Store> = Arc::new(LocalStore::with_clock(clock.clone()));
    let set_redis = |t: u64| server.clock().freeze_at_micros(t);
    let set_local = |t: u64| clock.set(t);
    for alg in ["fixed window", "sliding log", "token bucket"] {
        let make = |limit: u64| match alg {
            "fixed window" => Policy::fixed_window(limit, Duration::from_secs(10)).unwrap(),
            "sliding log" => Policy::sliding_log(limit, Duration::from_secs(10)).unwrap(),
            // full again 10 s after being emptied, as the others end 10 s on
            _ => Policy::token_bucket(limit, Rate::new(limit, Duration::from_secs(10))).unwrap(),
        };
        let old = make(10).with_generation(1);
        let new = make(2)
            .with_generation(2)
            .with_transition(Transition::DeferUntilExpiry);
        let mut out = Vec::new();
        for (backend, store, set) in [
            ("redis", &redis, &set_redis as &dyn Fn(u64)),
            ("local", &local, &set_local as &dyn Fn(u64)),
        ] {
            let name = format!("{alg}-{backend}");
            out.push((
                backend,
                defer_then_burst(&name, store, set, old, new, 10).await,
            ));
        }
        assert_eq!(
            out,
            [("redis", 2), ("local", 2)],
            "{alg}: admitted after the deferred bucket's end by a fleet on generation 2 (limit 2)"
        );
    }
}
