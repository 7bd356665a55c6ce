//! The opt-in deny cache against a real redis-server: a denied key is answered with zero round
//! trips until its retry instant, and a reset invalidates it.
//!
//! Redis's clock is the real one here, and fixed windows are aligned to the epoch
//! (`floor(now / window)`): an hour's window restarted at the top of the hour (and its cached
//! denial ended there) in a run that crossed it, so the counting tests use token buckets
//! refilling one token an hour (no whole token within a test).

use std::sync::Arc;
use std::time::Duration;

use tollgate::redis::RedisStore;
use tollgate::{FailureMode, Limiter, Policy, Rate};
use tollgate_testkit::server::RedisServer;

/// EVALSHA + EVAL calls the server has executed.
fn script_calls(server: &RedisServer) -> u64 {
    server.command_stats(&["evalsha", "eval"]).calls
}

/// A limiter `name` on `store` under `policy`, failing closed, with a deny cache of 100 keys
/// if `deny_cache`.
fn limiter(name: &str, policy: Policy, store: &RedisStore, deny_cache: bool) -> Limiter {
    let b = Limiter::builder(name, policy)
        .store(Arc::new(store.clone()))
        .failure_mode(FailureMode::Closed);
    if deny_cache { b.deny_cache(100) } else { b }
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_denied_key_costs_no_round_trip_until_its_retry_instant() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().await.unwrap();
    let limiter = Limiter::builder(
        "abuse",
        Policy::token_bucket(3, Rate::new(1, Duration::from_secs(3600))).unwrap(),
    )
    .store(Arc::new(store))
    .failure_mode(FailureMode::Closed)
    .deny_cache(10_000)
    .build()
    .unwrap();
    for _ in 0..3 {
        assert!(limiter.check(["mallory"], 1).await.unwrap().allowed);
    }
    let first_denial = limiter.check(["mallory"], 1).await.unwrap();
    assert!(!first_denial.allowed);
    let before = script_calls(&server);
    for _ in 0..1_000 {
        let d = limiter.check(["mallory"], 1).await.unwrap();
        assert!(!d.allowed);
        assert!(d.retry_after.unwrap() <= first_denial.retry_after.unwrap());
    }
    assert_eq!(
        script_calls(&server),
        before,
        "1,000 denials served without a round trip"
    );

    // Another key still goes to Redis; a reset invalidates the cached denial.
    assert!(limiter.check(["alice"], 1).await.unwrap().allowed);
    limiter.reset(["mallory"]).await.unwrap();
    assert!(limiter.check(["mallory"], 1).await.unwrap().allowed);
}

/// A cached denial answers its own cost only: a larger cost must wait for more tokens, and
/// the `retry_after` it is told (its `Retry-After`) is the store's, exact, not the smaller
/// cost's — a client that waits as told is not refused again for want of the difference.
#[tokio::test]
async fn a_larger_cost_is_told_its_own_wait_not_the_cached_one() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().await.unwrap();
    let policy = Policy::token_bucket(10, tollgate::Rate::per_second(1)).unwrap();
    let build = |cache: bool| limiter("weighted", policy, &store, cache);
    let (cached, plain) = (build(true), build(false));
    assert!(cached.check(["k"], 10).await.unwrap().allowed);
    let one = cached.check(["k"], 1).await.unwrap();
    assert!(!one.allowed);
    let five = cached.check(["k"], 5).await.unwrap();
    let truth = plain.check(["k"], 5).await.unwrap();
    eprintln!(
        "cost 1: {:?}; cost 5 through the cache: {:?}; from the store: {:?}",
        one.retry_after, five.retry_after, truth.retry_after
    );
    assert!(!five.allowed && !truth.allowed);
    let (five, truth) = (five.retry_after.unwrap(), truth.retry_after.unwrap());
    assert!(five > Duration::from_secs(4), "{five:?}");
    assert!(
        five.abs_diff(truth) < Duration::from_millis(100),
        "{five:?} vs {truth:?}"
    );
    // Its own cost is now the cached one: answered locally, no round trip.
    let before = script_calls(&server);
    let again = cached.check(["k"], 5).await.unwrap();
    assert!(!again.allowed && again.retry_after.unwrap() <= five);
    assert_eq!(script_calls(&server), before);
}

/// `check_many` uses the deny cache as `check` does: its denials are cached, and a later batch
/// sends only the keys the cache does not answer (here: one of three), in order.
#[tokio::test]
async fn batches_use_the_deny_cache() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().await.unwrap();
    let limiter = Limiter::builder(
        "batch-abuse",
        Policy::token_bucket(2, Rate::new(1, Duration::from_secs(3600))).unwrap(),
    )
    .store(Arc::new(store))
    .failure_mode(FailureMode::Closed)
    .deny_cache(100)
    .build()
    .unwrap();
    let keys: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|k| limiter.key([k]).unwrap())
        .collect();
    let allowed = |out: &[Result<tollgate::Decision, tollgate::Error>]| -> Vec<bool> {
        out.iter().map(|r| r.as_ref().unwrap().allowed).collect()
    };
    // "a" drained and denied by a batch of its own: the denial is cached.
    let a = &keys[..1];
    for _ in 0..2 {
        assert_eq!(allowed(&limiter.check_many(a, 1).await.unwrap()), [true]);
    }
    assert_eq!(allowed(&limiter.check_many(a, 1).await.unwrap()), [false]);
    let before = script_calls(&server);
    assert_eq!(allowed(&limiter.check_many(a, 1).await.unwrap()), [false]);
    assert_eq!(
        script_calls(&server),
        before,
        "a cached denial costs no call"
    );
    // A batch of all three: "a" from the cache, "b" and "c" from Redis, results in order.
    let out = limiter.check_many(&keys, 1).await.unwrap();
    assert_eq!(allowed(&out), [false, true, true]);
    assert_eq!(script_calls(&server), before + 2, "only b and c were sent");
    let denied = out[0].as_ref().unwrap();
    assert!(denied.retry_after.is_some() && denied.remaining == 0);
}

/// Every answer the cache gives, alone or in a batch, counts in
/// `tollgate_deny_cache_answers_total` (and as a shared denial in `tollgate_decisions_total`),
/// and only those: the count is exactly the script calls the cache saved.
#[tokio::test]
async fn cached_answers_are_counted_in_their_own_metric() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().await.unwrap();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Metric handles are registered when the limiter is built: build it under the recorder.
    let policy = Policy::token_bucket(1, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let limiter =
        metrics::with_local_recorder(&recorder, || limiter("counted", policy, &store, true));
    let keys: Vec<_> = ["a", "b"]
        .iter()
        .map(|k| limiter.key([k]).unwrap())
        .collect();
    // Each key admitted once, then denied by the store (cached).
    for key in &keys {
        assert!(limiter.check_key(key, 1).await.unwrap().allowed);
        assert!(!limiter.check_key(key, 1).await.unwrap().allowed);
    }
    let before = script_calls(&server);
    for _ in 0..5 {
        assert!(!limiter.check_key(&keys[0], 1).await.unwrap().allowed);
    }
    let batch = limiter.check_many(&keys, 1).await.unwrap();
    assert!(batch.iter().all(|d| !d.as_ref().unwrap().allowed));
    assert_eq!(script_calls(&server), before, "all 7 answered locally");
    // A key the cache does not hold goes to the store and is not counted.
    assert!(limiter.check(["c"], 1).await.unwrap().allowed);

    // One snapshot: taking one drains the counters.
    let snapshot = snapshotter.snapshot().into_vec();
    let count = |name: &str, outcome: Option<&str>| -> u64 {
        snapshot
            .iter()
            .filter(|(ck, _, _, _)| {
                let key = ck.key();
                key.name() == name
                    && key
                        .labels()
                        .any(|l| l.key() == "operation" && l.value() == "counted")
                    && outcome.is_none_or(|o| {
                        key.labels().any(|l| l.key() == "outcome" && l.value() == o)
                            && key
                                .labels()
                                .any(|l| l.key() == "enforcement" && l.value() == "shared")
                    })
            })
            .map(|(_, _, _, v)| match v {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is a counter, not {other:?}"),
            })
            .sum()
    };
    assert_eq!(count("tollgate_deny_cache_answers_total", None), 7);
    assert_eq!(
        count("tollgate_decisions_total", Some("denied")),
        2 + 7,
        "two denials from the store, seven from the cache"
    );
    assert_eq!(count("tollgate_decisions_total", Some("allowed")), 3);
}

/// A denial cached under generation 1 must not come back when the limiter is switched to
/// generation 2 (which another instance used to reset the bucket) and then back to 1: the
/// store, where generation 2 governs the bucket, admits the key. (The entry was only hidden
/// while another policy was active, and answered again after the switch back.)
#[tokio::test]
async fn a_policy_switched_back_does_not_revive_a_denial_the_store_lifted() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().await.unwrap();
    let g1: Policy = "token-bucket:capacity=1,rate=1,period=1h,generation=1,transition=carry"
        .parse()
        .unwrap();
    let g2: Policy = "token-bucket:capacity=10,rate=1,period=1h,generation=2,transition=reset"
        .parse()
        .unwrap();
    let build = |p: Policy, cache: bool| limiter("rollback", p, &store, cache);
    let (a, other, plain) = (build(g1, true), build(g2, false), build(g1, false));
    assert!(a.check(["k"], 1).await.unwrap().allowed);
    assert!(
        !a.check(["k"], 1).await.unwrap().allowed,
        "denied and cached for an hour"
    );
    a.set_policy(g2);
    // another instance on generation 2 meets the bucket: Reset, a fresh bucket of 10
    assert!(other.check(["k"], 1).await.unwrap().allowed);
    a.set_policy(g1); // switched back (a configuration rollback)
    let through_cache = a.check(["k"], 1).await.unwrap();
    let store_says = plain.check(["k"], 1).await.unwrap();
    assert!(
        store_says.allowed,
        "generation 2 governs the bucket: admitted"
    );
    assert!(
        through_cache.allowed,
        "the deny cache denied what the store admits: {through_cache:?}"
    );
}

/// After a policy change a full deny cache still caches denials under the new policy (it was
/// full of the old policy's entries, which could never answer again but stayed until their
/// deadlines: every denial of the abusive key went to Redis, 10 of 10).
#[tokio::test]
async fn a_full_cache_still_caches_after_a_policy_change() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().await.unwrap();
    let g1: Policy = "token-bucket:capacity=1,rate=1,period=1h,generation=1,transition=carry"
        .parse()
        .unwrap();
    let g2: Policy = "token-bucket:capacity=1,rate=1,period=1h,generation=2,transition=carry"
        .parse()
        .unwrap();
    let limiter = Limiter::builder("full", g1)
        .store(Arc::new(store))
        .failure_mode(FailureMode::Closed)
        .deny_cache(2)
        .build()
        .unwrap();
    for k in ["a", "b"] {
        assert!(limiter.check([k], 1).await.unwrap().allowed);
        assert!(!limiter.check([k], 1).await.unwrap().allowed);
    }
    limiter.set_policy(g2);
    assert!(limiter.check(["c"], 1).await.unwrap().allowed);
    assert!(!limiter.check(["c"], 1).await.unwrap().allowed);
    let before = script_calls(&server);
    for _ in 0..10 {
        assert!(!limiter.check(["c"], 1).await.unwrap().allowed);
    }
    assert_eq!(
        script_calls(&server) - before,
        0,
        "denials of c under the new policy went to Redis"
    );
}

/// A request of another cost that the store admits on a key drops its cached denial: the
/// cached answer would report the denial's `remaining` (2) above what the store holds (0), and
/// a `retry_after` (3 h) shorter than the store's (5 h), at which its client is refused again.
#[tokio::test]
async fn an_admission_on_a_key_drops_its_cached_denial() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().await.unwrap();
    let policy = Policy::token_bucket(10, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let build = |cache: bool| limiter("remaining", policy, &store, cache);
    let (cached, plain) = (build(true), build(false));
    assert!(cached.check(["k"], 8).await.unwrap().allowed);
    let denied = cached.check(["k"], 5).await.unwrap();
    assert!(!denied.allowed && denied.remaining == 2, "{denied:?}");
    // a smaller cost fits and is admitted by the store: 0 left
    let two = cached.check(["k"], 2).await.unwrap();
    assert!(two.allowed && two.remaining == 0, "{two:?}");
    let answered = cached.check(["k"], 5).await.unwrap();
    let truth = plain.check(["k"], 5).await.unwrap();
    assert!(!answered.allowed && !truth.allowed);
    assert_eq!(
        answered.remaining, truth.remaining,
        "{answered:?} vs {truth:?}"
    );
    let (a, t) = (answered.retry_after.unwrap(), truth.retry_after.unwrap());
    assert!(
        a.abs_diff(t) < Duration::from_secs(1),
        "retry_after {a:?} vs the store's {t:?}"
    );
}

/// `check_many` keeps the deny cache as `check` does (limiter.rs, `decide_many`): a request of
/// another cost that the store admits in a batch drops the key's cached denial, or the cached
/// answer reports the denial's `remaining` (2) above what the store holds (0) and a
/// `retry_after` (3 h) shorter than the store's (5 h), at which its client is refused again.
/// The batch twin of deny_cache.rs's `an_admission_on_a_key_drops_its_cached_denial`.
mod batch_admission {

    use std::time::Duration;

    use tollgate::redis::RedisStore;
    use tollgate::{Policy, Rate};
    use tollgate_testkit::server::RedisServer;

    use super::limiter;

    #[tokio::test]
    async fn an_admission_in_a_batch_drops_the_keys_cached_denial() {
        let server = RedisServer::start();
        let store = RedisStore::builder(server.url()).build().await.unwrap();
        let policy = Policy::token_bucket(10, Rate::new(1, Duration::from_secs(3600))).unwrap();
        let build = |cache: bool| limiter("remaining", policy, &store, cache);
        let (cached, plain) = (build(true), build(false));
        let k = cached.key(["k"]).unwrap();
        let other = cached.key(["other"]).unwrap();
        assert!(cached.check_key(&k, 8).await.unwrap().allowed);
        let denied = cached.check_key(&k, 5).await.unwrap();
        assert!(!denied.allowed && denied.remaining == 2, "{denied:?}");
        // a smaller cost fits and is admitted by the store, in a batch: 0 left
        let got = cached.check_many(&[k.clone(), other], 2).await.unwrap();
        let two = got[0].as_ref().unwrap();
        assert!(two.allowed && two.remaining == 0, "{two:?}");
        let answered = cached.check_key(&k, 5).await.unwrap();
        let truth = plain.check(["k"], 5).await.unwrap();
        assert!(!answered.allowed && !truth.allowed);
        assert_eq!(
            answered.remaining, truth.remaining,
            "{answered:?} vs {truth:?}"
        );
        let (a, t) = (answered.retry_after.unwrap(), truth.retry_after.unwrap());
        assert!(
            a.abs_diff(t) < Duration::from_secs(1),
            "retry_after {a:?} vs the store's {t:?}"
        );
    }
}
