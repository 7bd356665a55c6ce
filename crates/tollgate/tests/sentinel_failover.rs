//! A Sentinel failover under load, against real processes (primary + replica + 3 sentinels on
//! loopback): limiters on a Sentinel-connected RedisStore keep answering per their failure
//! mode while the primary is dead, resume shared enforcement on the promoted replica (its
//! empty script cache absorbed), and the test measures and prints the outage each limiter saw
//! and how much bucket state the failover lost.
//!
//! Run alone to see the figures:
//! `cargo test -p tollgate --test sentinel_failover -- --nocapture`

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::limiter_with_breaker;
use tollgate::redis::{Published, RedisStore, RedisStoreBuilder};
use tollgate::registry::PolicyFollower;
use tollgate::{
    Acquire, Enforcement, Error, ErrorClass, FailureMode, Key, Limiter, Policy, Rate, Store,
};
use tollgate_testkit::sentinel::SentinelCluster;
use tollgate_testkit::wait::eventually;

const DEADLINE: Duration = Duration::from_millis(150);
/// A call may take its deadline plus scheduling slack on a loaded 2-core machine, never more.
const CALL_BOUND: Duration = Duration::from_millis(1_000);
/// How long after the kill shared enforcement must be back.
const RECOVERY_BOUND: Duration = Duration::from_secs(20);
/// Buckets written (and replicated) well before the kill, and just before it.
const SYNCED_BUCKETS: u64 = 40;
const LAST_MOMENT_BUCKETS: u64 = 40;
const CAPACITY: u64 = 100;

/// What one call returned, as the test classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Shared,
    Bypassed,
    Degraded,
    Unavailable,
}

/// Every call of one limiter: when it finished, and what it saw.
type Log = Arc<Mutex<Vec<(Instant, Seen)>>>;

/// Token bucket refilled 1 per hour: over the test, remaining only changes by what was taken.
fn policy() -> Policy {
    Policy::token_bucket(CAPACITY, Rate::new(1, Duration::from_secs(3600))).unwrap()
}

fn limiter(store: &RedisStore, operation: &str, mode: FailureMode) -> Limiter {
    limiter_with_breaker(operation, policy(), store.clone(), mode, DEADLINE)
}

/// Runs `tasks` tasks calling `limiter` every few milliseconds until `stop`, logging each call
/// and asserting it is one of the outcomes the failure mode allows, within its bound.
fn load(
    limiter: &Limiter,
    tasks: usize,
    stop: &Arc<AtomicBool>,
) -> (Log, Vec<tokio::task::JoinHandle<()>>) {
    let log: Log = Arc::default();
    let handles = (0..tasks)
        .map(|t| {
            let (limiter, log, stop) = (limiter.clone(), log.clone(), stop.clone());
            tokio::spawn(async move {
                let mode = limiter.failure_mode().as_str();
                let mut i = 0_u64;
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let out = limiter.check([format!("user-{t}-{}", i % 50)], 1).await;
                    let took = started.elapsed();
                    assert!(took < CALL_BOUND, "{mode}: a call took {took:?}");
                    let seen = match (&out, mode) {
                        (Ok(d), _) if d.enforcement == Enforcement::Shared => Seen::Shared,
                        (Ok(d), "open") if d.enforcement == Enforcement::Bypassed && d.allowed => {
                            Seen::Bypassed
                        }
                        (Ok(d), "degraded") if d.enforcement == Enforcement::Degraded => {
                            Seen::Degraded
                        }
                        (Err(Error::Unavailable { source, .. }), "closed") => {
                            assert_eq!(source.class(), ErrorClass::Unavailable, "{source}");
                            Seen::Unavailable
                        }
                        _ => panic!("{mode}: unexpected outcome during the failover: {out:?}"),
                    };
                    log.lock().unwrap().push((Instant::now(), seen));
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect();
    (log, handles)
}

/// The outage one limiter saw: from its first non-shared answer after `kill` to its first
/// shared answer after that. Also returns the non-shared answers counted.
fn outage(log: &Log, kill: Instant) -> Option<(Duration, Duration, usize, Seen)> {
    let log = log.lock().unwrap();
    let after: Vec<&(Instant, Seen)> = log.iter().filter(|(t, _)| *t >= kill).collect();
    let first_bad = after.iter().position(|(_, s)| *s != Seen::Shared)?;
    let resumed = after[first_bad..]
        .iter()
        .position(|(_, s)| *s == Seen::Shared)?
        + first_bad;
    let bad = after.iter().filter(|(_, s)| *s != Seen::Shared).count();
    Some((
        after[resumed].0 - after[first_bad].0,
        after[resumed].0 - kill,
        bad,
        after[first_bad].1,
    ))
}

/// Shared answers in `log` since `since`.
fn shared_since(log: &Log, since: Instant) -> usize {
    let log = log.lock().unwrap();
    log.iter()
        .filter(|(t, s)| *t >= since && *s == Seen::Shared)
        .count()
}

/// Polls ([`eventually`]) until every log holds `n` shared answers since `since`, for at most
/// `bound`.
async fn until_shared_answers(logs: &[&Log], since: Instant, n: usize, bound: Duration) {
    let counts = || -> Vec<usize> { logs.iter().map(|log| shared_since(log, since)).collect() };
    assert!(
        eventually(bound, || counts().iter().all(|&c| c >= n)).await,
        "not {n} shared answers per limiter within {bound:?}: {:?}",
        counts()
    );
}

fn state_key(group: &str, i: u64) -> Key {
    Key::new("failover-state", [format!("{group}-{i}")]).unwrap()
}

/// Writes `n` buckets of `group`, bucket `i` taking `1 + i % 7` tokens, in one pipeline.
async fn write_buckets(store: &RedisStore, group: &str, n: u64) {
    let p = policy();
    let keys: Vec<Key> = (0..n).map(|i| state_key(group, i)).collect();
    let requests: Vec<Acquire<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| Acquire {
            key,
            policy: &p,
            cost: 1 + i as u64 % 7,
        })
        .collect();
    let decisions = store.acquire_many(&requests).await.unwrap();
    for (i, d) in decisions.into_iter().enumerate() {
        assert_eq!(d.unwrap().remaining, CAPACITY - 1 - i as u64 % 7);
    }
}

/// Buckets of `group` that lost their state (read back full), and the tokens the failover
/// gave back across the group.
async fn state_lost(store: &RedisStore, group: &str, n: u64) -> (u64, u64) {
    let (mut lost, mut regranted) = (0, 0);
    for i in 0..n {
        // A peek reports what would remain after its cost: add it back.
        let remaining = store
            .peek(&state_key(group, i), &policy(), 1)
            .await
            .unwrap()
            .remaining
            + 1;
        let expected = CAPACITY - 1 - i % 7;
        assert!(remaining >= expected, "{group}-{i}: state went backwards");
        regranted += remaining - expected;
        if remaining == CAPACITY {
            lost += 1;
        }
    }
    (lost, regranted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limiters_ride_out_a_sentinel_failover_and_resume_on_the_promoted_replica() {
    let mut topology = tokio::task::block_in_place(|| SentinelCluster::start("tollgate"));
    let store = RedisStore::sentinel(topology.master_name(), topology.sentinel_urls())
        .timeout(DEADLINE)
        .connect_timeout(Duration::from_secs(1))
        .build()
        .await
        .expect("store through Sentinel");

    // State that had time to replicate...
    write_buckets(&store, "synced", SYNCED_BUCKETS).await;
    tokio::task::block_in_place(|| topology.wait_replica_synced(Duration::from_secs(5)));

    let stop = Arc::new(AtomicBool::new(false));
    let modes = [
        ("fo-open", FailureMode::Open),
        ("fo-closed", FailureMode::Closed),
        ("fo-degraded", FailureMode::degraded(2)),
    ];
    let mut runs = Vec::new();
    for (operation, mode) in modes {
        let limiter = limiter(&store, operation, mode);
        let (log, handles) = load(&limiter, 3, &stop);
        runs.push((limiter, log, handles));
    }
    // Every load runs against the store before the kill (polled, bounded; a fixed 300 ms
    // before).
    let logs: Vec<&Log> = runs.iter().map(|(_, log, _)| log).collect();
    let started = Instant::now();
    until_shared_answers(&logs, started, 10, RECOVERY_BOUND).await;

    // ...and state written in the last moment before the primary dies.
    write_buckets(&store, "last-moment", LAST_MOMENT_BUCKETS).await;
    let killed = topology.kill_primary();
    let kill = Instant::now();
    let sentinel_failover =
        tokio::task::block_in_place(|| topology.wait_for_failover(RECOVERY_BOUND));

    // Let every limiter see the store again.
    let deadline = kill + RECOVERY_BOUND;
    for (limiter, log, _) in &runs {
        loop {
            let resumed = outage(log, kill).is_some();
            if resumed {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}: no shared enforcement within {RECOVERY_BOUND:?} of the kill",
                limiter.operation()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // And goes on against the new primary (10 more shared answers each, bounded; a fixed
    // 200 ms before).
    let resumed = Instant::now();
    let logs: Vec<&Log> = runs.iter().map(|(_, log, _)| log).collect();
    until_shared_answers(&logs, resumed, 10, RECOVERY_BOUND).await;
    stop.store(true, Ordering::Relaxed);
    for (_, _, handles) in &mut runs {
        for h in handles.drain(..) {
            h.await.unwrap();
        }
    }

    eprintln!(
        "sentinel: killed data server {killed}; sentinels reported the promoted replica \
         {sentinel_failover:?} after the kill"
    );
    for (limiter, log, _) in &runs {
        let (outage, since_kill, answers, first) = outage(log, kill).expect("checked above");
        let total = log.lock().unwrap().len();
        eprintln!(
            "sentinel: {:>11} ({:>8}): outage {outage:?} (first {first:?} answer -> first shared \
             answer), shared again {since_kill:?} after the kill; {answers} of {total} answers \
             not shared",
            limiter.operation(),
            limiter.failure_mode().as_str(),
        );
        assert!(since_kill < RECOVERY_BOUND);
    }
    let (lost_a, regranted_a) = state_lost(&store, "synced", SYNCED_BUCKETS).await;
    let (lost_b, regranted_b) = state_lost(&store, "last-moment", LAST_MOMENT_BUCKETS).await;
    eprintln!(
        "sentinel: state lost in the failover: replicated buckets {lost_a}/{SYNCED_BUCKETS} \
         ({regranted_a} tokens re-granted); written just before the kill {lost_b}/{LAST_MOMENT_BUCKETS} \
         ({regranted_b} tokens re-granted)"
    );
    assert_eq!(
        (lost_a, regranted_a),
        (0, 0),
        "state the replica had acknowledged survives"
    );
}

/// The builder of the registry tests' stores and registries on `topology`.
fn registry_builder(topology: &SentinelCluster) -> RedisStoreBuilder {
    RedisStore::sentinel(topology.master_name(), topology.sentinel_urls())
        .timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_secs(1))
}

/// Policy `g` of the registry test: a fixed window, generation `g`.
fn generation(g: u64) -> Policy {
    Policy::fixed_window(10, Duration::from_secs(3600))
        .unwrap()
        .with_generation(g)
}

/// A policy registry built from the Sentinel store's builder follows the primary through a
/// failover: a publication after the primary died is stored on the promoted replica through
/// the same registry, a follower started before the failover switches to it, and a
/// subscription made afterwards hears publications on the new primary. (A registry connected
/// by URL to the old primary can do none of it: every call fails while it is dead.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_built_for_sentinel_follows_the_primary_through_a_failover() {
    let mut topology = tokio::task::block_in_place(|| SentinelCluster::start("registry"));
    let builder = registry_builder(&topology);
    let registry = builder
        .build_registry()
        .await
        .expect("registry through Sentinel");
    let store = builder.build().await.expect("store through Sentinel");
    let limiter = Limiter::builder("api", generation(1))
        .store(Arc::new(store))
        .failure_mode(FailureMode::Closed)
        .build()
        .unwrap();
    let mut follower = PolicyFollower::start(
        registry.clone(),
        "api",
        std::slice::from_ref(&limiter),
        Duration::from_millis(200),
    )
    .await
    .expect("follower through Sentinel");
    let bound = follower.bound() + Duration::from_secs(1);

    registry.publish("api", &generation(2)).await.unwrap();
    let switched = tokio::time::timeout(bound, follower.changed()).await;
    assert_eq!(switched.map(|p| p.generation()).ok(), Some(2));
    tokio::task::block_in_place(|| topology.wait_replica_synced(Duration::from_secs(5)));

    let killed = topology.kill_primary();
    let promoted = tokio::task::block_in_place(|| topology.wait_for_failover(RECOVERY_BOUND));
    eprintln!("killed data server {killed}; replica promoted after {promoted:?}");
    // The same registry publishes on the promoted replica once its calls reach it (the first
    // may still meet the dead primary's connection, or the sentinels' old view).
    let deadline = Instant::now() + RECOVERY_BOUND;
    let mut failed = Vec::new();
    let published = loop {
        match registry.publish("api", &generation(3)).await {
            Ok(published) => break published,
            Err(e) if Instant::now() < deadline && failed.len() < 400 => {
                failed.push(e.to_string());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no publication within {RECOVERY_BOUND:?}: {e} (before: {failed:?})"),
        }
    };
    eprintln!(
        "publication after the failover: {} failed first",
        failed.len()
    );
    assert_eq!(published, Published::Stored);
    assert_eq!(
        registry.get("api").await.unwrap().map(|p| p.generation()),
        Some(3),
        "the promoted replica holds the publication"
    );
    let switched = tokio::time::timeout(bound, follower.changed()).await;
    assert_eq!(
        switched.map(|p| p.generation()).ok(),
        Some(3),
        "the follower started before the failover did not take the publication made after it"
    );
    assert_eq!(limiter.policy().generation(), 3);

    // A subscription made now is on the new primary, and hears its publications.
    let mut sub = registry
        .subscribe()
        .await
        .expect("a subscription after the failover");
    registry.publish("api", &generation(4)).await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(2), sub.next()).await;
    assert_eq!(heard.ok().flatten().as_deref(), Some("api"));
    let switched = tokio::time::timeout(bound, follower.changed()).await;
    assert_eq!(switched.map(|p| p.generation()).ok(), Some(4));
}

/// Two instances, each with a deny cache and a follower of a registry built from its store's
/// builder (poll 200 ms), and a `SENTINEL FAILOVER` (the deposed primary stays up and answers
/// as master until the sentinels convert it, some 10 s later). Once the sentinels name the
/// promoted replica, instance a resets a key b holds a cached denial of (an hour long): the
/// reset is announced on the new primary, and b forgets its denial. (Before: b's subscription
/// stayed on the deposed primary, which answered its `PING`, and b kept denying the key 20 s
/// later and for the rest of the hour: the announcement was lost for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_announced_after_a_manual_failover_reaches_every_follower() {
    let mut topology = tokio::task::block_in_place(|| SentinelCluster::start("regreset"));
    let builder = registry_builder(&topology);
    let policy: Policy = "token-bucket:capacity=1,rate=1,period=1h".parse().unwrap();
    let mut instances = Vec::new();
    for _ in 0..2 {
        let limiter = Limiter::builder("api", policy)
            .store(Arc::new(builder.clone().build().await.unwrap()))
            .failure_mode(FailureMode::Closed)
            .deny_cache(100)
            .build()
            .unwrap();
        let follower = PolicyFollower::start(
            builder.build_registry().await.unwrap(),
            "api",
            std::slice::from_ref(&limiter),
            Duration::from_millis(200),
        )
        .await
        .unwrap();
        instances.push((limiter, follower));
    }
    let [(a, follower_a), (b, _follower_b)] = &instances[..] else {
        unreachable!()
    };
    assert!(a.check(["k"], 1).await.unwrap().allowed);
    assert!(
        !b.check(["k"], 1).await.unwrap().allowed,
        "cached for the hour"
    );
    tokio::task::block_in_place(|| topology.wait_replica_synced(Duration::from_secs(5)));

    let start = Instant::now();
    tokio::task::block_in_place(|| topology.fail_over_via(1));
    tokio::task::block_in_place(|| topology.wait_for_failover(Duration::from_secs(20)));
    // The followers' subscriptions move within a resubscription's back-off (100 ms).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut failed = 0;
    while let Err(e) = follower_a.reset(a, ["k"]).await {
        failed += 1;
        assert!(failed < 50, "no reset through a's follower: {e}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reset = start.elapsed();
    let within = Duration::from_secs(5);
    let announced = Instant::now();
    let admitted = loop {
        if b.check(["k"], 1).await.is_ok_and(|d| d.allowed) {
            break Some(announced.elapsed());
        }
        if announced.elapsed() > within {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "reset announced {reset:?} after SENTINEL FAILOVER ({failed} attempts failed first); \
         b admitted the key {admitted:?} after it"
    );
    assert!(
        admitted.is_some(),
        "b still answers its cached denial {within:?} after a reset announced on the promoted \
         primary ({reset:?} after SENTINEL FAILOVER)"
    );
}
