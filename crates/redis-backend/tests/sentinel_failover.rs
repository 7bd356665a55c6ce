//! Sentinel failover against real processes (primary + replica + 3 sentinels on loopback):
//! the store follows the promoted replica with the first sentinel frozen, leaves a primary
//! deposed by `SENTINEL FAILOVER` within seconds (not at its conversion, ~10 s later), also
//! with a sentinel frozen, ends its sentinel watches when dropped, and an unknown master name
//! fails at once.

use std::time::{Duration, Instant};

use tollgate_core::{ErrorClass, Key, Policy, Rate, Store};
use tollgate_redis::RedisStore;
use tollgate_testkit::sentinel::SentinelCluster;

const HOUR: Duration = Duration::from_secs(3600);

fn policy() -> Policy {
    Policy::token_bucket(1_000_000, Rate::new(1, HOUR)).unwrap()
}

fn key(i: usize) -> Key {
    Key::new("sentinel-failover", [format!("k{i}")]).unwrap()
}

/// A store on `topology`'s sentinels (call deadline 250 ms, connect timeout 1 s) that has
/// decided once.
async fn deciding(topology: &SentinelCluster) -> RedisStore {
    let store = RedisStore::sentinel(topology.master_name(), topology.sentinel_urls())
        .timeout(Duration::from_millis(250))
        .connect_timeout(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    assert!(store.acquire(&key(0), &policy(), 1).await.is_ok());
    store
}

/// Calls the store every 50 ms until a decision, for at most `limit`: the time it took and the
/// number of calls that failed (`Err`: the calls made and the last failure). Every failure must be of class unavailable, and no call may
/// outlast `call_bound`.
async fn until_decided(
    store: &RedisStore,
    limit: Duration,
    call_bound: Duration,
) -> Result<(Duration, usize), (usize, String)> {
    let start = Instant::now();
    let mut failed = 0;
    let mut last = String::new();
    for i in 0..10_000 {
        let called = Instant::now();
        let result = store.acquire(&key(i), &policy(), 1).await;
        let took = called.elapsed();
        assert!(took <= call_bound, "call {i} took {took:?}: {result:?}");
        match result {
            Ok(d) => {
                assert!(d.allowed, "{d:?}");
                return Ok((start.elapsed(), failed));
            }
            Err(e) => {
                assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
                failed += 1;
                last = format!("{e} ({:?})", std::error::Error::source(&e));
            }
        }
        if start.elapsed() >= limit {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err((failed, last))
}

/// A frozen sentinel (SIGSTOP: its port accepts connections, nothing answers) listed first
/// is skipped for the next one: once the two others report the promoted replica, the store
/// decides on it within a few seconds. The store's connect timeout (1 s) bounds one
/// resolution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_first_sentinel_is_skipped_after_a_failover() {
    let mut topology = tokio::task::block_in_place(|| SentinelCluster::start("frozen"));
    let store = deciding(&topology).await;

    topology.sentinel_mut(0).pause();
    let killed = topology.kill_primary();
    let failover =
        tokio::task::block_in_place(|| topology.wait_for_failover(Duration::from_secs(30)));
    let reported = Instant::now();
    let recovered = until_decided(&store, Duration::from_secs(10), Duration::from_secs(1)).await;
    eprintln!(
        "frozen sentinel 0: killed data server {killed}; sentinels reported the new primary \
         {failover:?} after the kill; store: {recovered:?} after that ({:?})",
        reported.elapsed()
    );
    topology.sentinel_mut(0).resume();
    let (took, _) = recovered.expect("the store decides on the promoted replica within 10 s");
    assert!(took < Duration::from_secs(3), "took {took:?}");
}

/// `cmd`'s reply from `server` on a fresh connection (failovers kill clients), or `None`.
async fn ask<T: redis::FromRedisValue>(
    server: &tollgate_testkit::server::RedisServer,
    cmd: &redis::Cmd,
) -> Option<T> {
    let client = server.client();
    tokio::time::timeout(Duration::from_millis(500), async {
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        cmd.query_async::<T>(&mut conn).await.ok()
    })
    .await
    .ok()?
}

/// EXISTS `key` on `server`.
async fn exists(server: &tollgate_testkit::server::RedisServer, key: &str) -> Option<bool> {
    ask(server, redis::cmd("EXISTS").arg(key)).await
}

/// `ROLE`'s first field on `server`.
async fn role(server: &tollgate_testkit::server::RedisServer) -> Option<String> {
    let reply: Vec<redis::Value> = ask(server, &redis::cmd("ROLE")).await?;
    redis::from_redis_value(reply.into_iter().next()?).ok()
}

/// After `SENTINEL FAILOVER` the deposed primary stays up and answers as master until the
/// sentinels convert it to a replica (some 10 s later), and what it takes meanwhile is lost
/// when it resyncs. The store must move to the promoted replica within a few seconds of the
/// promotion, not keep deciding on the deposed primary until its conversion closes the
/// connection. (Before: 205 decisions, for 11 s after the promotion, went to the deposed
/// primary only.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_leaves_a_primary_deposed_by_a_manual_failover() {
    leaves_the_deposed_primary("manual", false).await;
}

/// The same with the first sentinel frozen (SIGSTOP) before the failover: the others'
/// announcements are enough, its silent watch holds nothing up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_sentinel_does_not_keep_the_store_on_a_deposed_primary() {
    leaves_the_deposed_primary("manualfrozen", true).await;
}

/// Fails over `name` with `SENTINEL FAILOVER` (through the second sentinel, the first frozen
/// if `freeze_first`) while deciding every 50 ms, and checks that no decision goes to the
/// deposed primary alone more than 5 s after the promotion.
async fn leaves_the_deposed_primary(name: &str, freeze_first: bool) {
    let mut topology = tokio::task::block_in_place(|| SentinelCluster::start(name));
    let store = deciding(&topology).await;
    if freeze_first {
        topology.sentinel_mut(0).pause();
    }
    let start = Instant::now();
    tokio::task::block_in_place(|| topology.fail_over_via(1));
    let (old, new) = (&topology.data_servers()[0], &topology.data_servers()[1]);
    let (mut promoted, mut demoted) = (None, None);
    // decisions taken by the deposed primary alone, after the promotion
    let mut on_old_only = Vec::new();
    let mut failed = 0;
    for i in 1..2_000 {
        if promoted.is_none() && role(new).await.as_deref() == Some("master") {
            promoted = Some(start.elapsed());
        }
        if demoted.is_none() && role(old).await.as_deref() == Some("slave") {
            demoted = Some(start.elapsed());
        }
        let k = key(i);
        match store.acquire(&k, &policy(), 1).await {
            Ok(_) => {
                let name = store.redis_key(&k, &policy());
                let (o, n) = (exists(old, &name).await, exists(new, &name).await);
                if promoted.is_some() && o == Some(true) && n == Some(false) {
                    on_old_only.push(start.elapsed());
                }
            }
            Err(e) => {
                assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
                failed += 1;
            }
        }
        if demoted.is_some_and(|d| start.elapsed() > d + Duration::from_secs(1))
            || start.elapsed() > Duration::from_secs(25)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "{name} (first sentinel frozen: {freeze_first}): replica promoted at {promoted:?}, old \
         primary demoted at {demoted:?}; {} decisions taken by the deposed primary alone after \
         the promotion (first {:?}, last {:?}); {failed} calls failed",
        on_old_only.len(),
        on_old_only.first(),
        on_old_only.last()
    );
    if freeze_first {
        topology.sentinel_mut(0).resume();
    }
    let promoted = promoted.expect("the replica is promoted");
    assert!(
        demoted.is_some(),
        "the sentinels convert the deposed primary"
    );
    if let Some(last) = on_old_only.last() {
        assert!(
            *last < promoted + Duration::from_secs(5),
            "{} decisions went to the deposed primary alone, the last {:?} after the promotion",
            on_old_only.len(),
            last.saturating_sub(promoted)
        );
    }
}

/// The subscribed clients of each sentinel (`CLIENT LIST`'s `sub=` above 0).
async fn subscribers(topology: &SentinelCluster) -> Vec<Option<usize>> {
    let mut counts = Vec::new();
    for sentinel in topology.sentinels() {
        let list: Option<String> = ask(sentinel, redis::cmd("CLIENT").arg("LIST")).await;
        counts.push(list.map(|list| {
            list.lines()
                .filter(|line| {
                    line.split(' ')
                        .any(|f| f.starts_with("sub=") && f != "sub=0")
                })
                .count()
        }));
    }
    counts
}

/// Polls [`subscribers`] every 50 ms for at most 5 s until it is `want`: the last counts.
async fn wait_subscribers(topology: &SentinelCluster, want: usize) -> Vec<Option<usize>> {
    let mut counts = Vec::new();
    for _ in 0..100 {
        counts = subscribers(topology).await;
        if counts.iter().all(|c| *c == Some(want)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    counts
}

/// The store watches every sentinel on a connection of its own, and those watches (tasks and
/// connections) end when the store is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sentinel_watches_end_with_the_store() {
    let topology = tokio::task::block_in_place(|| SentinelCluster::start("watched"));
    assert_eq!(subscribers(&topology).await, vec![Some(0); 3]);
    let store = RedisStore::sentinel(topology.master_name(), topology.sentinel_urls())
        .connect_timeout(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    assert!(store.acquire(&key(0), &policy(), 1).await.is_ok());
    assert_eq!(wait_subscribers(&topology, 1).await, vec![Some(1); 3]);
    drop(store);
    assert_eq!(wait_subscribers(&topology, 0).await, vec![Some(0); 3]);
}

/// A registry subscription made on the primary ends once the sentinels name another
/// (`SENTINEL FAILOVER`: the deposed primary stays up, answers as master and its subscribers'
/// `PING` until the sentinels convert it, some 10 s later, and hears nothing published on the
/// new one meanwhile), and is no longer alive; a new subscription hears the new primary.
/// (Before: it stayed open and alive on the deposed primary until the conversion closed it,
/// ~11 s after the failover, deaf to every publication and reset made meanwhile.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_subscription_ends_when_its_primary_is_deposed() {
    let mut topology = tokio::task::block_in_place(|| SentinelCluster::start("regdeposed"));
    let registry = RedisStore::sentinel(topology.master_name(), topology.sentinel_urls())
        .timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_secs(1))
        .build_registry()
        .await
        .expect("registry through Sentinel");
    let generation = |g: u64| policy().with_generation(g);
    let mut sub = registry.subscribe().await.unwrap();
    registry.publish("api", &generation(1)).await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(2), sub.next()).await;
    assert_eq!(heard.ok().flatten().as_deref(), Some("api"));

    let start = Instant::now();
    tokio::task::block_in_place(|| topology.fail_over_via(1));
    let ended = tokio::spawn(async move {
        let next = tokio::time::timeout(Duration::from_secs(20), sub.next_notice()).await;
        (next, start.elapsed(), sub.alive().await)
    });
    let promoted =
        tokio::task::block_in_place(|| topology.wait_for_failover(Duration::from_secs(20)));
    let (next, ended_at, alive) = ended.await.unwrap();
    let old_role = role(&topology.data_servers()[0]).await;
    eprintln!(
        "replica promoted at {promoted:?}; the old subscription ended at {ended_at:?} \
         ({next:?}, alive: {alive}); the deposed primary's role now {old_role:?}"
    );
    assert_eq!(
        next.ok(),
        Some(None),
        "the subscription on the deposed primary ends"
    );
    assert!(!alive, "a subscription on a deposed primary is not alive");
    assert!(
        ended_at < promoted + Duration::from_secs(5),
        "the subscription on the deposed primary ended {:?} after the promotion",
        ended_at.saturating_sub(promoted)
    );

    // A new one is on the new primary.
    let mut sub = registry.subscribe().await.unwrap();
    let mut failed = 0;
    while let Err(e) = registry.publish("api", &generation(2)).await {
        failed += 1;
        assert!(failed < 100, "no publication on the new primary: {e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let heard = tokio::time::timeout(Duration::from_secs(2), sub.next()).await;
    assert_eq!(heard.ok().flatten().as_deref(), Some("api"));
}
