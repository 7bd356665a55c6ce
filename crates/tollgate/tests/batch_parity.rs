//! `Limiter::check_many(keys, cost)` against the same `check_key` calls made one by one, in the
//! same order, on a twin: same policy, same features, a redis-server of its own on a frozen
//! clock at the same instant. Each request's decision and the per-outcome decision counters
//! must agree (the documented exceptions — the breaker and the store-error counter count a
//! batch that failed whole once — are not compared).

// Its log and metrics capture; the flood checks are not used here.
#[allow(dead_code)]
mod flood;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_util::debugging::{DebugValue, Snapshotter};
use tollgate::redis::RedisStore;
use tollgate::{Decision, Error, FailureMode, Key, Limiter, LocalStore, ManualClock, Policy, Rate};
use tollgate_testkit::server::RedisServer;

/// The instant both twins' servers (and their degraded local stores) are frozen at.
const T0: u64 = 1_800_000_000_000_000;

/// One request's result, comparable across the twins: a cached denial's `retry_after` counts
/// down on this process's clock, so it is kept in minutes, rounded up (the waits here are hours).
fn outcome(r: &Result<Decision, Error>) -> String {
    match r {
        Ok(d) => format!(
            "allowed={} limit={} remaining={} retry={:?} enforcement={:?}",
            d.allowed,
            d.limit,
            d.remaining,
            d.retry_after
                .map(|r| format!("{}min", r.as_secs().div_ceil(60))),
            d.enforcement
        ),
        Err(Error::Unavailable { source, .. }) => {
            format!("unavailable ({})", source.class().as_str())
        }
        Err(e) => format!("error: {e}"),
    }
}

/// The decision counters, by outcome and enforcement.
fn decisions(snapshotter: &Snapshotter) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let key = key.key();
            let DebugValue::Counter(n) = value else {
                return None;
            };
            (key.name() == "tollgate_decisions_total" && n > 0).then(|| {
                let labels: Vec<String> = key
                    .labels()
                    .filter(|l| l.key() != "operation")
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                (labels.join(","), n)
            })
        })
        .collect();
    out.sort();
    out
}

/// What a twin does: its mode, whether the server is killed before the requests, and the
/// requests (key names, one cost).
#[derive(Clone, Copy)]
struct Scenario {
    degraded: bool,
    kill: bool,
    keys: &'static [&'static str],
    cost: u64,
}

/// Runs `scenario` on a fresh twin, its requests as one batch or one by one: each request's
/// outcome, then the outcome of one more check of each key (what the deny cache and the
/// buckets hold after), and the decision counters of the requests.
fn twin(s: Scenario, batch: bool) -> (Vec<String>, Vec<String>, Vec<(String, u64)>) {
    let got = Arc::new(Mutex::new((Vec::new(), Vec::new())));
    let sink = Arc::clone(&got);
    let (_, snapshotter, _) = flood::run(|| async move {
        let mut server = RedisServer::builder().clock_control(true).start();
        server.clock().freeze_at_micros(T0);
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .await
            .unwrap();
        let mode = if s.degraded {
            let local = Arc::new(LocalStore::with_clock(ManualClock::new(T0)));
            FailureMode::degraded_with(local, 2)
        } else {
            FailureMode::Closed
        };
        // 4 tokens refilled 1 an hour (2 per instance degraded): nothing refills in a test.
        let policy = Policy::token_bucket(4, Rate::new(1, Duration::from_secs(3600))).unwrap();
        let limiter = Limiter::builder("parity", policy)
            .store(Arc::new(store))
            .failure_mode(mode)
            .timeout(Duration::from_secs(2))
            .deny_cache(100)
            .build()
            .unwrap();
        // Before: "cached" drained and its denial of this cost cached; "held" denied at a
        // larger cost (an entry that cannot answer this one).
        for _ in 0..4 {
            assert!(limiter.check(["cached"], 1).await.unwrap().allowed);
        }
        assert!(!limiter.check(["cached"], s.cost).await.unwrap().allowed);
        assert!(limiter.check(["held"], 2).await.unwrap().allowed);
        assert!(!limiter.check(["held"], 3).await.unwrap().allowed);
        if s.kill {
            server.kill();
        }
        let keys: Vec<Key> = s.keys.iter().map(|k| limiter.key([k]).unwrap()).collect();
        // The setup's decisions are counted too: the same on both twins.
        let requests: Vec<String> = if batch {
            let out = limiter.check_many(&keys, s.cost).await.unwrap();
            out.iter().map(outcome).collect()
        } else {
            let mut out = Vec::new();
            for k in &keys {
                out.push(outcome(&limiter.check_key(k, s.cost).await));
            }
            out
        };
        let mut after = Vec::new();
        for k in ["a", "b", "cached", "held"] {
            after.push(format!(
                "{k}: {}",
                outcome(&limiter.check([k], s.cost).await)
            ));
        }
        *sink.lock().unwrap() = (requests, after);
    });
    let (requests, after) = std::mem::take(&mut *got.lock().unwrap());
    (requests, after, decisions(&snapshotter))
}

fn compare(s: Scenario) {
    let (one_by_one, after_one, counted_one) = twin(s, false);
    let (batch, after_batch, counted_batch) = twin(s, true);
    for (i, (a, b)) in one_by_one.iter().zip(&batch).enumerate() {
        eprintln!(
            "{:>2} {:<7} one by one: {a}\n{:>11}batch:      {b}",
            i, s.keys[i], ""
        );
    }
    eprintln!("after, one by one: {after_one:#?}\nafter, batch: {after_batch:#?}");
    eprintln!("counted, one by one: {counted_one:?}\ncounted, batch: {counted_batch:?}");
    assert_eq!(batch, one_by_one, "each request's decision");
    assert_eq!(after_batch, after_one, "what the batch left behind");
    assert_eq!(counted_batch, counted_one, "the decision counters");
}

const KEYS: &[&str] = &[
    "a", "cached", "a", "held", "b", "a", "cached", "a", "a", "b", "held",
];

/// Shared enforcement with the deny cache: cached denials, fresh keys, a key repeated until it
/// is denied (and denied again later in the same batch), a key whose entry is of another cost.
#[test]
fn a_batch_with_the_deny_cache_decides_as_one_by_one() {
    compare(Scenario {
        degraded: false,
        kill: false,
        keys: KEYS,
        cost: 1,
    });
}

/// The store killed before the batch, degraded to a local share of 2 (4 over 2 instances):
/// a key repeated spends its share in order; the cached denials still answer.
#[test]
fn a_degraded_batch_decides_as_one_by_one() {
    compare(Scenario {
        degraded: true,
        kill: true,
        keys: KEYS,
        cost: 1,
    });
}

/// The store killed, failing closed: every request not answered by the cache is unavailable.
#[test]
fn a_closed_batch_on_a_dead_store_decides_as_one_by_one() {
    compare(Scenario {
        degraded: false,
        kill: true,
        keys: KEYS,
        cost: 1,
    });
}

/// A batch that misses its deadline on a paused server tells each request what a single call
/// missing it is told: the deadline that bound it, whichever of the limiter's and the store's
/// it was. The batch said the time left when the store started on it ("store call timed out
/// after 149.995203ms" where a single call says "150ms").
#[tokio::test]
async fn a_batch_missing_its_deadline_says_what_a_single_call_says() {
    let mut server = RedisServer::start();
    let policy = Policy::token_bucket(4, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let ms = Duration::from_millis;
    // (the limiter's deadline, the store's): equal, the limiter's shorter, the store's shorter
    let mut limiters = Vec::new();
    for (i, (limiter_deadline, store_deadline)) in
        [(ms(150), ms(150)), (ms(150), ms(300)), (ms(300), ms(150))]
            .into_iter()
            .enumerate()
    {
        let store = RedisStore::builder(server.url())
            .timeout(store_deadline)
            .build()
            .await
            .unwrap();
        let limiter = Limiter::builder(format!("deadline{i}"), policy)
            .store(Arc::new(store))
            .failure_mode(FailureMode::Closed)
            .timeout(limiter_deadline)
            .build()
            .unwrap();
        limiters.push((limiter, limiter_deadline.min(store_deadline)));
    }
    server.pause();
    for (limiter, bound) in &limiters {
        let started = std::time::Instant::now();
        let single = limiter.check(["a"], 1).await.unwrap_err().to_string();
        let keys = [limiter.key(["b"]).unwrap(), limiter.key(["c"]).unwrap()];
        let batch = limiter.check_many(&keys, 1).await.unwrap();
        // Two calls, each bounded by its deadline (and scheduling slack on a loaded machine).
        assert!(started.elapsed() < ms(2_000), "{:?}", started.elapsed());
        assert!(
            single.ends_with(&format!("timed out after {bound:?}")),
            "{single}"
        );
        for r in &batch {
            let Err(e @ Error::Unavailable { .. }) = r else {
                panic!("{r:?}")
            };
            assert_eq!(e.to_string(), single, "{}", limiter.operation());
        }
    }
    server.resume();
}
