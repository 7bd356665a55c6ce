//! Concurrency exactness: several independent RedisStore instances (each with its own pool),
//! many tasks each, hammer the same keys; the total admitted never exceeds what the policy
//! allows over the run measured on Redis's own clock, and falls short of a reachable bound by
//! less than one request's cost. Bounded in requests and time; loopback only.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::Server;
use tollgate_core::{Algorithm, Key, Policy, Rate, Store};
use tollgate_redis::RedisStore;

const INSTANCES: usize = 4;
const TASKS_PER_INSTANCE: usize = 16;
const REQUESTS_PER_TASK: usize = 40;
const MAX_COST: u64 = 3;
const HOUR: Duration = Duration::from_secs(3600);

struct Run {
    admitted: Vec<u64>,
    requests: u64,
    start_us: u64,
    end_us: u64,
}

/// Every task sends `REQUESTS_PER_TASK` requests, spread over `keys`, with costs 1..=3.
async fn hammer(server: &Server, keys: &[Key], policy: Policy) -> Run {
    let mut stores = Vec::new();
    for _ in 0..INSTANCES {
        stores.push(server.pooled(4).await);
    }
    let keys: Arc<Vec<Key>> = Arc::new(keys.to_vec());
    let admitted: Arc<Vec<AtomicU64>> = Arc::new(keys.iter().map(|_| AtomicU64::new(0)).collect());
    let requests = Arc::new(AtomicU64::new(0));
    let start_us = server.time_micros();
    let mut tasks = Vec::new();
    for (instance, store) in stores.iter().enumerate() {
        for t in 0..TASKS_PER_INSTANCE {
            let (store, keys, admitted, requests): (RedisStore, _, _, _) = (
                store.clone(),
                keys.clone(),
                admitted.clone(),
                requests.clone(),
            );
            let task = instance * TASKS_PER_INSTANCE + t;
            tasks.push(tokio::spawn(async move {
                for i in 0..REQUESTS_PER_TASK {
                    let k = (task + i) % keys.len();
                    let cost = ((task * 7 + i * 3) as u64 % MAX_COST) + 1;
                    let d = store
                        .acquire(&keys[k], &policy, cost)
                        .await
                        .expect("store call");
                    requests.fetch_add(1, Ordering::Relaxed);
                    if d.allowed {
                        admitted[k].fetch_add(cost, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("run finished in time");
    let end_us = server.time_micros();
    Run {
        admitted: admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect(),
        requests: requests.load(Ordering::Relaxed),
        start_us,
        end_us,
    }
}

fn keys(n: usize, name: &str) -> Vec<Key> {
    (0..n)
        .map(|i| Key::new("hammer", [format!("{name}-{i}")]).unwrap())
        .collect()
}

/// Upper bound of a token bucket over [start, end] on Redis's clock, in whole tokens.
fn token_bucket_bound(policy: &Policy, run: &Run) -> u64 {
    let Algorithm::TokenBucket(tb) = policy.algorithm() else {
        unreachable!()
    };
    (tb.capacity_units() + (run.end_us - run.start_us) * tb.rate) / tb.unit
}

fn check_reachable(name: &str, run: &Run, bound: u64) {
    let demand = run.requests * 2 / run.admitted.len() as u64;
    assert!(
        demand > 3 * bound,
        "{name}: the run must ask for far more than the bound"
    );
    for (k, &a) in run.admitted.iter().enumerate() {
        assert!(
            a <= bound,
            "{name} key {k}: admitted {a} above the bound {bound}"
        );
        assert!(
            a + MAX_COST > bound,
            "{name} key {k}: admitted {a}, more than one request below {bound}"
        );
    }
    eprintln!(
        "{name}: {} requests, admitted per key {:?}, bound {bound}",
        run.requests, run.admitted
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_one_key_admits_exactly_capacity_when_refill_is_negligible() {
    let server = Server::start();
    // One token per hour: over a run of seconds the bound is exactly the capacity.
    let policy = Policy::token_bucket(300, Rate::new(1, HOUR)).unwrap();
    let run = hammer(&server, &keys(1, "tb"), policy).await;
    let bound = token_bucket_bound(&policy, &run);
    assert_eq!(bound, 300);
    check_reachable("token bucket, one key", &run, bound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_with_live_refill_never_admits_more_than_capacity_plus_refill() {
    let server = Server::start();
    let policy = Policy::token_bucket(50, Rate::new(7, Duration::from_millis(30))).unwrap();
    let run = hammer(&server, &keys(1, "tb-live"), policy).await;
    let bound = token_bucket_bound(&policy, &run);
    assert!(
        run.admitted[0] <= bound,
        "admitted {} above {bound}",
        run.admitted[0]
    );
    assert!(
        run.admitted[0] >= 50,
        "at least the initial capacity: {}",
        run.admitted[0]
    );
    eprintln!(
        "token bucket, live refill: {} requests over {} us, admitted {}, bound {bound}",
        run.requests,
        run.end_us - run.start_us,
        run.admitted[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_bucket_many_keys_each_admit_exactly_capacity() {
    let server = Server::start();
    let policy = Policy::token_bucket(40, Rate::new(1, HOUR)).unwrap();
    let run = hammer(&server, &keys(8, "tb-many"), policy).await;
    check_reachable(
        "token bucket, 8 keys",
        &run,
        token_bucket_bound(&policy, &run),
    );
}

fn same_window(run: &Run, window_us: u64) -> bool {
    run.start_us / window_us == run.end_us / window_us
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_window_admits_exactly_the_limit_per_window() {
    let server = Server::start();
    let policy = Policy::fixed_window(300, HOUR).unwrap();
    let run = hammer(&server, &keys(1, "fw"), policy).await;
    if same_window(&run, 3_600_000_000) {
        check_reachable("fixed window, one key", &run, 300);
    } else {
        assert!(
            run.admitted[0] <= 600,
            "two windows at most: {}",
            run.admitted[0]
        );
    }
    let policy = Policy::fixed_window(40, HOUR).unwrap();
    let run = hammer(&server, &keys(8, "fw-many"), policy).await;
    if same_window(&run, 3_600_000_000) {
        check_reachable("fixed window, 8 keys", &run, 40);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_log_admits_exactly_the_limit_per_window() {
    let server = Server::start();
    let policy = Policy::sliding_log(300, HOUR).unwrap();
    let run = hammer(&server, &keys(1, "sl"), policy).await;
    check_reachable("sliding log, one key", &run, 300);
    let policy = Policy::sliding_log(40, HOUR).unwrap();
    let run = hammer(&server, &keys(8, "sl-many"), policy).await;
    check_reachable("sliding log, 8 keys", &run, 40);
}

/// With Redis's clock frozen for the run, a live refill rate cannot add anything: the bound
/// is exactly the capacity or limit, whatever the policy's rate or window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_frozen_clock_every_algorithm_admits_exactly_its_limit() {
    let server = Server::start_with_clock();
    server.set_time(1_700_000_000_500_000);
    let policies = [
        (
            "token bucket",
            Policy::token_bucket(120, Rate::per_second(1000)).unwrap(),
            120,
        ),
        (
            "fixed window",
            Policy::fixed_window(90, Duration::from_secs(1)).unwrap(),
            90,
        ),
        (
            "sliding log",
            Policy::sliding_log(70, Duration::from_millis(10)).unwrap(),
            70,
        ),
    ];
    for (name, policy, bound) in policies {
        let run = hammer(&server, &keys(1, name), policy).await;
        assert_eq!(run.start_us, run.end_us, "the clock stayed frozen");
        check_reachable(&format!("{name}, frozen clock, one key"), &run, bound);
        let run = hammer(&server, &keys(6, &format!("{name}-many")), policy).await;
        check_reachable(&format!("{name}, frozen clock, 6 keys"), &run, bound);
    }
}
