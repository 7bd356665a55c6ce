//! The policy registry against a real redis-server: atomic publication that never goes back a
//! generation, and several limiter instances (each with its own store, registry connection and
//! follower) converging on a new publication — by notification, and by polling when the
//! notification is lost.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::redis::{Published, RedisRegistry, RegistryError};
use tollgate::registry::PolicyFollower;
use tollgate::{Enforcement, FailureMode, Limiter, LocalStore, Policy, Transition};
use tollgate_testkit::proxy::FaultProxy;
use tollgate_testkit::server::RedisServer;
use tollgate_testkit::wait::eventually;

const TIMEOUT: Duration = Duration::from_secs(2);

// Redis's clock is the real one here, and fixed windows are aligned to the epoch
// (`floor(now / window)`): an hour's window restarted at the top of the hour (ending its counts
// and cached denials) in a run that crossed it. A test that counts across calls under fixed
// windows uses 30-day windows; the deny-cache tests use a token bucket of 1 refilling one token
// an hour (no whole token within a test).

fn spec(text: &str) -> Policy {
    text.parse().unwrap()
}

async fn registry(server: &RedisServer) -> RedisRegistry {
    RedisRegistry::connect(&server.url(), "tollgate:", TIMEOUT)
        .await
        .unwrap()
}

/// A follower of "api" on `server`'s registry, for `limiters`, polling every `poll`.
async fn follow(server: &RedisServer, limiters: &[Limiter], poll: Duration) -> PolicyFollower {
    PolicyFollower::start(registry(server).await, "api", limiters, poll)
        .await
        .unwrap()
}

#[tokio::test]
async fn publish_is_atomic_and_never_goes_back_a_generation() {
    let server = RedisServer::start();
    let reg = registry(&server).await;
    let g1 = spec("fixed-window:limit=10,window=1m,generation=1,transition=reset");
    let g2 = spec("fixed-window:limit=5,window=1m,generation=2,transition=carry");
    assert_eq!(reg.get("login").await.unwrap(), None);
    assert_eq!(reg.publish("login", &g1).await.unwrap(), Published::Stored);
    assert_eq!(
        reg.publish("login", &g1).await.unwrap(),
        Published::Unchanged
    );
    assert_eq!(reg.publish("login", &g2).await.unwrap(), Published::Stored);
    assert!(matches!(
        reg.publish("login", &g1).await,
        Err(RegistryError::Stale {
            stored: 2,
            offered: 1,
            ..
        })
    ));
    let other = spec("fixed-window:limit=6,window=1m,generation=2,transition=carry");
    assert!(matches!(
        reg.publish("login", &other).await,
        Err(RegistryError::Conflict { generation: 2, .. })
    ));
    assert!(matches!(
        reg.publish("Bad{name}", &g1).await,
        Err(RegistryError::BadName(_))
    ));
    let search = spec("token-bucket:capacity=3,rate=1,generation=7,transition=proportional");
    reg.publish("search", &search).await.unwrap();
    assert_eq!(reg.get("login").await.unwrap(), Some(g2));
    let listed: Vec<(String, Policy)> = reg
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|(n, p)| (n, p.unwrap()))
        .collect();
    assert_eq!(
        listed,
        vec![("login".to_owned(), g2), ("search".to_owned(), search)]
    );
}

async fn instance(server: &RedisServer, policy: Policy) -> Limiter {
    instance_with(server, policy, None).await
}

/// An instance with a deny cache of `deny_cache` entries, if any.
async fn instance_with(server: &RedisServer, policy: Policy, deny_cache: Option<usize>) -> Limiter {
    let builder = common::api_builder(server.url(), policy, FailureMode::Closed).await;
    match deny_cache {
        Some(n) => builder.deny_cache(n),
        None => builder,
    }
    .build()
    .unwrap()
}

/// Waits until every follower reports generation `g`; returns the time it took.
async fn converge(followers: &mut [PolicyFollower], g: u64, within: Duration) -> Duration {
    let started = Instant::now();
    for f in followers.iter_mut() {
        while f.current().generation() < g {
            tokio::time::timeout(within, f.changed())
                .await
                .unwrap_or_else(|_| panic!("no switch to generation {g} within {within:?}"));
        }
    }
    started.elapsed()
}

#[tokio::test]
async fn several_instances_converge_on_a_publication_by_notification_and_by_polling() {
    let server = RedisServer::start();
    let g1 = spec("fixed-window:limit=10,window=30d,generation=1,transition=reset");
    registry(&server).await.publish("api", &g1).await.unwrap();

    // Three instances by notification (a poll too slow to matter), one by polling alone.
    let mut limiters = Vec::new();
    let mut followers = Vec::new();
    for poll in [600, 600, 600, 0] {
        let poll = if poll == 0 {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(poll)
        };
        let l = instance(&server, g1).await;
        let f = follow(&server, std::slice::from_ref(&l), poll).await;
        limiters.push(l);
        followers.push(f);
    }
    assert_eq!(followers[0].bound(), Duration::from_secs(600) + TIMEOUT);
    let key = limiters[0].key(["tenant"]).unwrap();
    assert_eq!(limiters[0].check_key(&key, 4).await.unwrap().remaining, 6);

    // Generation 2 by notification.
    let g2 = spec("fixed-window:limit=5,window=30d,generation=2,transition=carry");
    registry(&server).await.publish("api", &g2).await.unwrap();
    let took = converge(&mut followers[..3], 2, Duration::from_secs(5)).await;
    eprintln!("3 instances switched to generation 2 by notification in {took:?}");
    // The polling instance gets there within its bound.
    let bound = followers[3].bound();
    assert_eq!(bound, Duration::from_millis(200) + TIMEOUT);
    let polled = converge(&mut followers[3..], 2, bound).await;
    eprintln!("the polling instance switched in {polled:?} (bound {bound:?})");
    for l in &limiters {
        assert_eq!(l.policy(), g2);
    }
    // Carry: the 4 used under generation 1 count against the new limit of 5.
    let d = limiters[1].check_key(&key, 1).await.unwrap();
    assert_eq!((d.allowed, d.limit, d.remaining), (true, 5, 0));

    // Lose every subscription: generation 3 still arrives, by polling.
    let killed: u64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "pubsub"])
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    assert_eq!(killed, 4, "one subscription per follower");
    let g3 = spec("fixed-window:limit=8,window=30d,generation=3,transition=proportional");
    registry(&server).await.publish("api", &g3).await.unwrap();
    let polled = converge(&mut followers[3..], 3, bound).await;
    eprintln!("after the subscriptions were killed, the polling instance switched in {polled:?}");
    assert_eq!(
        followers[3].current().transition(),
        Transition::Proportional
    );
}

/// Redis restarts under a following instance: its registry connection reconnects by itself,
/// and a policy published after the restart arrives (by polling, the subscription having been
/// lost with the server) within a few poll bounds.
#[tokio::test]
async fn a_follower_keeps_following_after_redis_restarts() {
    let mut server = RedisServer::start();
    let g1 = spec("fixed-window:limit=10,window=1h,generation=1,transition=reset");
    registry(&server).await.publish("api", &g1).await.unwrap();
    let limiter = instance(&server, g1).await;
    let mut follower = follow(
        &server,
        std::slice::from_ref(&limiter),
        Duration::from_millis(200),
    )
    .await;
    server.restart();
    let g2 = spec("fixed-window:limit=5,window=1h,generation=2,transition=carry");
    registry(&server).await.publish("api", &g2).await.unwrap();
    let within = follower.bound() * 3;
    let took = converge(std::slice::from_mut(&mut follower), 2, within).await;
    eprintln!("after a restart, switched to generation 2 in {took:?} (bound {within:?})");
    assert_eq!(limiter.policy(), g2);
}

/// One follower for several limiters that do not all run the same policy yet (one already
/// at the published generation, one behind): every limiter is compared with the publication
/// on its own, so none is left behind because another already has it.
#[tokio::test]
async fn a_follower_brings_every_limiter_to_the_publication_not_just_the_first() {
    let server = RedisServer::start();
    let g1 = spec("fixed-window:limit=10,window=1h,generation=1,transition=reset");
    let g2 = spec("fixed-window:limit=5,window=1h,generation=2,transition=carry");
    registry(&server).await.publish("api", &g2).await.unwrap();
    let ahead = instance(&server, g2).await;
    let behind = instance(&server, g1).await;
    let mut follower = follow(
        &server,
        &[ahead.clone(), behind.clone()],
        Duration::from_secs(600),
    )
    .await;
    assert_eq!(follower.current(), g2);
    assert_eq!(ahead.policy(), g2);
    assert_eq!(
        behind.policy(),
        g2,
        "the second limiter missed the publication"
    );

    // Later publications reach both too, whichever one was switched by hand in between.
    behind.set_policy(g1);
    let g3 = spec("fixed-window:limit=8,window=1h,generation=3,transition=carry");
    registry(&server).await.publish("api", &g3).await.unwrap();
    converge(
        std::slice::from_mut(&mut follower),
        3,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!((ahead.policy(), behind.policy()), (g3, g3));
}

/// Two instances with deny caches deny one key (a token bucket of 1 refilling one an hour:
/// cached for the hour). A reset through one instance's follower reaches the other's cache:
/// its next check goes to Redis and is admitted. Through `Limiter::reset` alone it would not:
/// the other instance keeps answering its cached denial.
#[tokio::test]
async fn a_reset_through_a_follower_clears_every_instances_deny_cache() {
    let server = RedisServer::start();
    let policy = spec("token-bucket:capacity=1,rate=1,period=1h");
    let (a, b) = (
        instance_with(&server, policy, Some(100)).await,
        instance_with(&server, policy, Some(100)).await,
    );
    let follow = async |l: &Limiter| {
        follow(&server, std::slice::from_ref(l), Duration::from_secs(3600)).await
    };
    let (fa, _fb) = (follow(&a).await, follow(&b).await);
    // a's check takes the key's one admission; b's is denied by Redis and cached for the hour
    let denied = async |l: &Limiter, key: &str| !l.check([key], 1).await.unwrap().allowed;

    // Limiter::reset alone: b's cached denial survives a's reset.
    assert!(a.check(["alone"], 1).await.unwrap().allowed);
    assert!(denied(&b, "alone").await);
    a.reset(["alone"]).await.unwrap();
    // the bucket is fresh in Redis: only b's cache can still deny it
    assert!(denied(&b, "alone").await, "b answers from its cache");

    // Through the follower: b's cache hears of it.
    assert!(a.check(["shared"], 1).await.unwrap().allowed);
    assert!(denied(&b, "shared").await);
    let started = Instant::now();
    fa.reset(&a, ["shared"]).await.unwrap();
    let admitted = loop {
        // the announcement travels over pub/sub: b is admitted once it has arrived (and its
        // check reaches Redis, where the bucket is fresh); bounded by TIMEOUT
        if b.check(["shared"], 1).await.unwrap().allowed {
            break Some(started.elapsed());
        }
        if started.elapsed() > TIMEOUT {
            break None;
        }
        tokio::task::yield_now().await;
    };
    let took = admitted.expect("b admitted after the announced reset");
    eprintln!(
        "a reset announced through the registry reached the other instance's deny cache in {took:?}"
    );
}

/// A reset announced by another instance reaches this instance's degraded enforcement too, as
/// a reset through this instance (`Limiter::reset`) does: b's store is cut off (its checks are
/// decided on its local store), b spends its local share of a key, and a resets the key
/// through its follower. Before, the announcement cleared only b's deny cache: b kept denying
/// the key from its local bucket for the hour (the reset user locked out until Redis came
/// back, or for good if it came back and went again).
#[tokio::test]
async fn a_reset_announced_by_another_instance_clears_the_degraded_local_bucket() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let policy = spec("token-bucket:capacity=1,rate=1,period=1h");
    let a = instance(&server, policy).await;
    let degraded = FailureMode::degraded_with(Arc::new(LocalStore::new()), 1);
    let b = common::api_builder(proxy.url(), policy, degraded)
        .await
        .build()
        .unwrap();
    let fa = follow(&server, std::slice::from_ref(&a), Duration::from_secs(3600)).await;
    let _fb = follow(&server, std::slice::from_ref(&b), Duration::from_secs(3600)).await;

    // b loses its store: its checks are decided locally, and its local share of "k" is spent
    proxy.set_refuse(true);
    proxy.cut_all();
    let first = b.check(["k"], 1).await.unwrap();
    assert_eq!(
        (first.allowed, first.enforcement),
        (true, Enforcement::Degraded)
    );
    let second = b.check(["k"], 1).await.unwrap();
    assert_eq!(
        (second.allowed, second.enforcement),
        (false, Enforcement::Degraded)
    );

    let started = Instant::now();
    fa.reset(&a, ["k"]).await.unwrap();
    let admitted = loop {
        // the announcement travels over pub/sub; bounded by TIMEOUT
        let d = b.check(["k"], 1).await.unwrap();
        assert_eq!(d.enforcement, Enforcement::Degraded);
        if d.allowed {
            break Some(started.elapsed());
        }
        if started.elapsed() > TIMEOUT {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let took = admitted.expect("b's local bucket forgotten after the announced reset");
    eprintln!("an announced reset reached the other instance's degraded bucket in {took:?}");
}

/// The registry's path dies without a reset (`FaultProxy::stall_open`: every open connection
/// falls silent; new ones pass). Before, the poll's connection timed out on every poll and
/// the subscription's stream never ended, so the follower stayed on generation 1 for good
/// (6 s = 20 × its bound in the review's run). The poll's connection is replaced after a
/// timeout, and a subscription that no longer answers a `PING` is replaced.
#[tokio::test]
async fn a_follower_converges_after_its_connections_stall() {
    let server = RedisServer::start();
    let proxy = tollgate_testkit::proxy::FaultProxy::start(server.port());
    let g1 = spec("fixed-window:limit=10,window=1h,generation=1,transition=reset");
    registry(&server).await.publish("api", &g1).await.unwrap();
    let limiter = instance_with(&server, g1, None).await;
    let reg = RedisRegistry::connect(&proxy.url(), "tollgate:", Duration::from_millis(200))
        .await
        .unwrap();
    let mut follower = PolicyFollower::start(
        reg,
        "api",
        std::slice::from_ref(&limiter),
        Duration::from_millis(100),
    )
    .await
    .unwrap();
    let bound = follower.bound();
    proxy.stall_open();
    let g2 = spec("fixed-window:limit=5,window=1h,generation=2,transition=carry");
    registry(&server).await.publish("api", &g2).await.unwrap();
    // one poll meets the silence, the next goes over a new connection
    let within = bound * 5;
    let switched = tokio::time::timeout(within, async {
        while follower.current().generation() < 2 {
            follower.changed().await;
        }
    })
    .await;
    assert!(
        switched.is_ok(),
        "no switch to generation 2 within {within:?} (bound {bound:?}); limiter at {}",
        limiter.policy()
    );
    assert_eq!(limiter.policy(), g2);
}

/// The same stall: the follower notices its silent subscription at its next poll and
/// resubscribes, so a reset announced after that reaches its deny cache.
#[tokio::test]
async fn a_reset_reaches_a_follower_whose_subscription_stalled() {
    let server = RedisServer::start();
    let proxy = tollgate_testkit::proxy::FaultProxy::start(server.port());
    let policy = spec("token-bucket:capacity=1,rate=1,period=1h");
    let a = instance_with(&server, policy, Some(100)).await;
    let b = instance_with(&server, policy, Some(100)).await;
    let fa = follow(&server, std::slice::from_ref(&a), Duration::from_secs(3600)).await;
    let reg_b = RedisRegistry::connect(&proxy.url(), "tollgate:", Duration::from_millis(200))
        .await
        .unwrap();
    let fb = PolicyFollower::start(
        reg_b,
        "api",
        std::slice::from_ref(&b),
        Duration::from_millis(100),
    )
    .await
    .unwrap();
    // The subscribers of the registry's channel: a's, and b's (through the proxy; stalled, it
    // stays subscribed on the server's side).
    let channel = registry(&server).await.key().to_owned();
    let subscribers = || {
        let (_, n): (String, u64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query(&mut server.client().get_connection().unwrap())
            .unwrap();
        n
    };
    proxy.stall_open();
    let stalled = subscribers();
    assert!(a.check(["k"], 1).await.unwrap().allowed);
    assert!(
        !b.check(["k"], 1).await.unwrap().allowed,
        "cached for the hour"
    );
    // A poll, its PING's deadline and a resubscription: b's follower subscribes again, over a
    // new connection. (A fixed 4 bounds before.)
    let within = fb.bound() * 10;
    assert!(
        eventually(within, || subscribers() > stalled).await,
        "b's follower did not subscribe again within {within:?}: {} subscribers, {stalled} \
         at the stall",
        subscribers()
    );
    fa.reset(&a, ["k"]).await.unwrap();
    let started = Instant::now();
    let within = fb.bound() * 10;
    while !b.check(["k"], 1).await.unwrap().allowed {
        assert!(
            started.elapsed() < within,
            "the announced reset never reached b's deny cache within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An entry this version cannot parse (here hand-written; in a rolling upgrade, a newer
/// version's algorithm) kept a follower from starting, so an older instance restarting during
/// the upgrade failed. It now starts on its limiters' policies, and follows the next readable
/// publication.
#[tokio::test]
async fn a_follower_starts_over_an_entry_it_cannot_read() {
    let server = RedisServer::start();
    let reg = registry(&server).await;
    let mut conn = server.client().get_connection().unwrap();
    let _: () = redis::cmd("HSET")
        .arg(reg.key())
        .arg("api")
        .arg("3 leaky-bucket:capacity=5,leak=1")
        .query(&mut conn)
        .unwrap();
    let g0 = spec("fixed-window:limit=10,window=1h");
    let limiter = instance(&server, g0).await;
    let mut follower = PolicyFollower::start(
        registry(&server).await,
        "api",
        std::slice::from_ref(&limiter),
        Duration::from_millis(100),
    )
    .await
    .expect("started on the limiter's policy");
    assert_eq!(follower.current(), g0);
    assert_eq!(limiter.policy(), g0);
    let g4 = spec("fixed-window:limit=5,window=1h,generation=4,transition=carry");
    reg.publish("api", &g4).await.unwrap();
    tokio::time::timeout(follower.bound() * 5, async {
        while follower.current() != g4 {
            follower.changed().await;
        }
    })
    .await
    .expect("follows the next readable publication");
    assert_eq!(limiter.policy(), g4);
}

/// An entry this version cannot read does not hide the others from `list` (it failed the whole
/// listing with `Corrupt`, so `tollgate policy show` showed nothing during a rolling upgrade).
#[tokio::test]
async fn list_shows_every_entry_and_why_one_is_unreadable() {
    let server = RedisServer::start();
    let reg = registry(&server).await;
    let g1 = spec("fixed-window:limit=10,window=1h,generation=1,transition=carry");
    reg.publish("login", &g1).await.unwrap();
    let mut conn = server.client().get_connection().unwrap();
    let _: () = redis::cmd("HSET")
        .arg(reg.key())
        .arg("api")
        .arg("3 leaky-bucket:capacity=5,leak=1")
        .query(&mut conn)
        .unwrap();
    let listed = reg.list().await.expect("the readable entries are listed");
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0].0, "api");
    assert!(
        matches!(&listed[0].1, Err(RegistryError::Corrupt { name, .. }) if name == "api"),
        "{listed:?}"
    );
    assert_eq!(listed[1].0, "login");
    assert_eq!(listed[1].1.as_ref().ok(), Some(&g1));
}

/// The registry is the source of truth for a name (registry.rs, `newer`): a follower whose
/// limiter runs another policy of the generation the registry holds switches to the registry's
/// one, at start, so that every instance of the fleet enforces the published policy.
mod same_generation {

    use std::sync::Arc;
    use std::time::Duration;

    use tollgate::redis::{RedisRegistry, RedisStore};
    use tollgate::registry::PolicyFollower;
    use tollgate::{FailureMode, Limiter, Policy};
    use tollgate_testkit::server::RedisServer;

    const TIMEOUT: Duration = Duration::from_secs(2);

    #[tokio::test]
    async fn a_follower_takes_the_published_policy_of_its_own_generation() {
        let server = RedisServer::start();
        let registry = RedisRegistry::connect(&server.url(), "tollgate:", TIMEOUT)
            .await
            .unwrap();
        let published: Policy = "fixed-window:limit=10,window=30d".parse().unwrap();
        let local: Policy = "fixed-window:limit=3,window=30d".parse().unwrap();
        assert_eq!(published.generation(), local.generation());
        registry.publish("api", &published).await.unwrap();
        let store = RedisStore::builder(server.url())
            .timeout(TIMEOUT)
            .build()
            .await
            .unwrap();
        let limiter = Limiter::builder("api", local)
            .store(Arc::new(store))
            .failure_mode(FailureMode::Closed)
            .build()
            .unwrap();
        let follower = PolicyFollower::start(
            registry,
            "api",
            std::slice::from_ref(&limiter),
            Duration::from_millis(50),
        )
        .await
        .unwrap();
        // At start, and still after several polls: a negative check, so a fixed window, six
        // 50 ms polls long (one that switched would do so at the first).
        assert_eq!(limiter.policy(), published, "at start");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(limiter.policy(), published, "after polls");
        assert_eq!(follower.current(), published);
        let d = limiter.check(["k"], 1).await.unwrap();
        assert_eq!((d.limit, d.remaining), (10, 9));
    }
}

/// `changed` waits for a change of the followed policy after `start`: the policy the follower
/// already follows when `start` returns ([`PolicyFollower::current`], here a publication newer
/// than the limiter's, taken at start) is not a change, so the first `changed` returns the next
/// publication, not the one `start` took.
#[tokio::test]
async fn changed_after_start_waits_for_a_new_publication() {
    let server = RedisServer::start();
    let g1 = spec("fixed-window:limit=10,window=1h,generation=1,transition=reset");
    let g2 = spec("fixed-window:limit=5,window=1h,generation=2,transition=carry");
    let reg = registry(&server).await;
    reg.publish("api", &g2).await.unwrap();
    let limiter = instance(&server, g1).await;
    let mut follower = follow(
        &server,
        std::slice::from_ref(&limiter),
        Duration::from_secs(600),
    )
    .await;
    assert_eq!((follower.current(), limiter.policy()), (g2, g2));
    let g3 = spec("fixed-window:limit=8,window=1h,generation=3,transition=carry");
    reg.publish("api", &g3).await.unwrap();
    // By notification (the poll is 10 minutes away).
    let first = tokio::time::timeout(Duration::from_secs(5), follower.changed())
        .await
        .expect("no change within 5 s");
    assert_eq!(
        first, g3,
        "the first changed() after start reported the policy start had already taken"
    );
}

/// A publication that arrives between `start` and the first `changed` is not missed: that
/// `changed` returns it at once.
#[tokio::test]
async fn changed_reports_a_publication_that_arrived_before_it_was_called() {
    let server = RedisServer::start();
    let g1 = spec("fixed-window:limit=10,window=1h,generation=1,transition=reset");
    let reg = registry(&server).await;
    reg.publish("api", &g1).await.unwrap();
    let limiter = instance(&server, g1).await;
    let mut follower = follow(
        &server,
        std::slice::from_ref(&limiter),
        Duration::from_secs(600),
    )
    .await;
    let g2 = spec("fixed-window:limit=5,window=1h,generation=2,transition=carry");
    reg.publish("api", &g2).await.unwrap();
    // `current` does not mark the change seen: wait for it (by notification) without `changed`.
    let started = Instant::now();
    for _ in 0..500 {
        if follower.current() == g2 || started.elapsed() > Duration::from_secs(5) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(follower.current(), g2, "no switch within 5 s");
    // Ready at its first poll: the change happened before the call.
    let seen = tokio::time::timeout(Duration::ZERO, follower.changed())
        .await
        .expect("the publication made before changed() was called was missed");
    assert_eq!(seen, g2);
}

/// A follower that never polls (`Duration::MAX`: it relies on notifications) starts and
/// follows a publication; its bound saturates. Its start panicked adding the registry's
/// timeout to the interval (found by a review), where the crate's other durations accept an
/// unbounded value.
#[tokio::test]
async fn a_follower_with_an_unbounded_poll_interval_follows_notifications() {
    let server = RedisServer::start();
    let limiter = instance(&server, spec("fixed-window:limit=10,window=30d")).await;
    let follower = follow(&server, std::slice::from_ref(&limiter), Duration::MAX).await;
    assert_eq!(follower.bound(), Duration::MAX);
    let g1 = spec("fixed-window:limit=4,window=30d,generation=1,transition=carry");
    registry(&server).await.publish("api", &g1).await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || limiter.policy() == g1).await,
        "followed by notification: {}",
        limiter.policy()
    );
}

/// A follower relying on notifications alone (`Duration::MAX`: no poll) whose subscription is
/// lost subscribes again on its own back-off and reads what was published meanwhile. Before,
/// it waited for the next poll to subscribe again, ten years away: deaf for good.
#[tokio::test]
async fn a_follower_relying_on_notifications_subscribes_again_after_losing_its_subscription() {
    let server = RedisServer::start();
    let g1 = spec("fixed-window:limit=10,window=30d,generation=1,transition=reset");
    registry(&server).await.publish("api", &g1).await.unwrap();
    let l = instance(&server, g1).await;
    let mut f = follow(&server, std::slice::from_ref(&l), Duration::MAX).await;
    let g2 = spec("fixed-window:limit=5,window=30d,generation=2,transition=carry");
    registry(&server).await.publish("api", &g2).await.unwrap();
    converge(std::slice::from_mut(&mut f), 2, Duration::from_secs(5)).await;

    // Lost, and a publication made before it is back.
    let killed: u64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "pubsub"])
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    assert_eq!(killed, 1);
    let g3 = spec("fixed-window:limit=8,window=30d,generation=3,transition=carry");
    registry(&server).await.publish("api", &g3).await.unwrap();
    let took = converge(std::slice::from_mut(&mut f), 3, Duration::from_secs(5)).await;
    eprintln!("generation 3, published while the subscription was down, taken in {took:?}");
    // And the new subscription carries the next one.
    let g4 = spec("fixed-window:limit=9,window=30d,generation=4,transition=carry");
    let subscribed = eventually(Duration::from_secs(5), || {
        let channel = "tollgate:registry";
        redis::cmd("PUBSUB")
            .arg(&["NUMSUB", channel])
            .query::<(String, u64)>(&mut server.client().get_connection().unwrap())
            .is_ok_and(|(_, n)| n == 1)
    })
    .await;
    assert!(subscribed, "no new subscription");
    registry(&server).await.publish("api", &g4).await.unwrap();
    converge(std::slice::from_mut(&mut f), 4, Duration::from_secs(5)).await;
    assert_eq!(l.policy(), g4);
}

/// A single server's store builder gives a registry on its URL, under the builder's prefix.
#[tokio::test]
async fn a_store_builder_gives_a_registry_on_its_server_and_prefix() {
    let server = RedisServer::start();
    let builder = tollgate::redis::RedisStore::builder(server.url()).prefix("svc:");
    let reg = builder.build_registry().await.unwrap();
    assert_eq!(reg.key(), "svc:registry");
    let g1 = spec("fixed-window:limit=10,window=1m,generation=1,transition=reset");
    assert_eq!(reg.publish("api", &g1).await.unwrap(), Published::Stored);
    let by_url = RedisRegistry::connect(&server.url(), "svc:", TIMEOUT)
        .await
        .unwrap();
    assert_eq!(by_url.get("api").await.unwrap(), Some(g1));
    assert!(
        tollgate::redis::RedisStore::builder(server.url())
            .prefix("bad prefix")
            .build_registry()
            .await
            .is_err()
    );
}
