//! A fleet rolling a policy out through the registry, against a real redis-server: several
//! instances (each its own store, registry connection and follower) in one process. Whatever
//! is written to the registry — two publishers racing, a hand edit, a value that is not text —
//! the instances end on one policy within a bounded time, the registry's.

mod common;

use std::time::Duration;

use tollgate::redis::{Published, RedisRegistry, RegistryError};
use tollgate::registry::PolicyFollower;
use tollgate::{FailureMode, Limiter, Policy};
use tollgate_testkit::server::RedisServer;

const TIMEOUT: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(100);

/// Generation `g` of a fixed window of `limit` per 30 days (no window ends within a test).
fn generation(g: u64, limit: u64) -> Policy {
    format!("fixed-window:limit={limit},window=30d,generation={g},transition=carry")
        .parse()
        .unwrap()
}

async fn registry(server: &RedisServer) -> RedisRegistry {
    RedisRegistry::connect(&server.url(), "tollgate:", TIMEOUT)
        .await
        .unwrap()
}

/// An instance: a limiter named "api" on its own store.
async fn instance(server: &RedisServer, policy: Policy) -> Limiter {
    common::api_builder(server.url(), policy, FailureMode::Closed)
        .await
        .build()
        .unwrap()
}

/// A follower of "api" for `limiter`, on its own registry connection, polling every `POLL`.
async fn follow(server: &RedisServer, limiter: &Limiter) -> Result<PolicyFollower, RegistryError> {
    PolicyFollower::start(
        registry(server).await,
        "api",
        std::slice::from_ref(limiter),
        POLL,
    )
    .await
}

/// HGET calls the server has executed (INFO commandstats).
fn hget_calls(server: &RedisServer) -> u64 {
    server.command_stats(&["hget"]).calls
}

/// Writes `value` as the entry of "api", as a hand edit would.
fn hset(server: &RedisServer, value: &[u8]) {
    let mut conn = server.client().get_connection().unwrap();
    let _: () = redis::cmd("HSET")
        .arg("tollgate:registry")
        .arg("api")
        .arg(value)
        .query(&mut conn)
        .unwrap();
}

/// Waits (at most `within`, checking every 10 ms) until every limiter runs `policy`.
async fn converge(limiters: &[&Limiter], policy: Policy, within: Duration) {
    let converged = tokio::time::timeout(within, async {
        while limiters.iter().any(|l| l.policy() != policy) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let now: Vec<String> = limiters.iter().map(|l| l.policy().to_string()).collect();
    assert!(
        converged.is_ok(),
        "not every instance runs {policy} within {within:?}: {now:?}"
    );
}

/// A hand-written entry filed under generation 1 whose spec says generation 9: the followers
/// took generation 9, the registry still held 1, so it accepted generation 2 and announced it,
/// and every instance that had taken 9 ignored it for good. The entry is unreadable now; the
/// instances keep generation 1 (logged), and follow generation 2.
#[tokio::test]
async fn an_entry_filed_under_another_generation_does_not_split_the_fleet() {
    let server = RedisServer::start();
    let reg = registry(&server).await;
    reg.publish("api", &generation(1, 10)).await.unwrap();
    let a = instance(&server, generation(0, 10)).await;
    let fa = follow(&server, &a).await.unwrap();
    assert_eq!(a.policy(), generation(1, 10));
    hset(
        &server,
        format!("1 {}", generation(9, 3).to_spec()).as_bytes(),
    );
    let b = instance(&server, generation(0, 10)).await;
    let fb = follow(&server, &b).await.unwrap();
    assert_eq!(
        b.policy(),
        generation(0, 10),
        "an instance started on an entry the registry files under another generation"
    );
    assert!(matches!(
        reg.get("api").await,
        Err(RegistryError::Corrupt { .. })
    ));
    reg.publish("api", &generation(2, 5)).await.unwrap();
    converge(&[&a, &b], generation(2, 5), fa.bound() * 5).await;
    drop((fa, fb));
}

/// A value that is not UTF-8 kept an instance from starting: `PolicyFollower::start` failed
/// with `Store(Script("Incompatible type - Cannot convert from UTF-8 ..."))`. It starts on its
/// limiter's policy now, as over any unreadable entry, and follows the next publication.
#[tokio::test]
async fn an_instance_starts_over_an_entry_that_is_not_text() {
    let server = RedisServer::start();
    hset(&server, b"\xff\xfe 3 fixed-window");
    let a = instance(&server, generation(0, 10)).await;
    let fa = follow(&server, &a)
        .await
        .expect("started on the limiter's policy");
    assert_eq!(a.policy(), generation(0, 10));
    registry(&server)
        .await
        .publish("api", &generation(1, 4))
        .await
        .unwrap();
    converge(&[&a], generation(1, 4), fa.bound() * 5).await;
}

/// Hostile values written by hand over a published generation 3: each is a typed `Corrupt`
/// error from the registry, and the instances keep generation 3 (never a panic, never a policy
/// of limit 0 or of a size the maths cannot hold). The values that do not parse were refused
/// before too; the last three (no generation before the spec, or not a number) were applied.
#[tokio::test]
async fn hostile_entries_are_refused_and_the_last_good_policy_kept() {
    let server = RedisServer::start();
    let reg = registry(&server).await;
    let good = generation(3, 10);
    reg.publish("api", &good).await.unwrap();
    let a = instance(&server, generation(0, 10)).await;
    let fa = follow(&server, &a).await.unwrap();
    assert_eq!(a.policy(), good);
    let hostile = [
        "garbage",
        "",
        "4",
        "4 ",
        "4 fixed-window:limit=99999999999999999999999,window=1h,generation=4,transition=carry",
        "4 fixed-window:limit=0,window=1h,generation=4,transition=carry",
        "4 token-bucket:capacity=5,rate=NaN,generation=4,transition=carry",
        "4 token-bucket:capacity=5,rate=inf,generation=4,transition=carry",
        "4 token-bucket:capacity=4503599627370496,rate=1,generation=4,transition=carry",
        "4 leaky-bucket:capacity=5,leak=1,generation=4,transition=carry",
        "4 fixed-window:limit=7,window=0s,generation=4,transition=carry",
        "4 fixed-window:limit=7,window=1h,generation=4,transition=carry,limit=8",
        "4 fixed-window:limit=7,window=1h,generation=4",
        "fixed-window:limit=7,window=1h,generation=4,transition=carry",
        "x fixed-window:limit=7,window=1h,generation=4,transition=carry",
    ];
    for value in hostile {
        hset(&server, value.as_bytes());
        let got = reg.get("api").await;
        assert!(
            matches!(got, Err(RegistryError::Corrupt { .. })),
            "{value:?}: {got:?}"
        );
        // The follower reads the entry by HGET: one more executed after this value was
        // written (and after the check's own) is a poll that met it. Each value must reach
        // the follower's apply path, not only the last one (all were written within a poll
        // interval before, so the follower met one of the fifteen).
        let seen = hget_calls(&server);
        assert!(
            tollgate_testkit::wait::eventually(fa.bound() * 3, || hget_calls(&server) > seen).await,
            "{value:?}: no poll met it within {:?}",
            fa.bound() * 3
        );
        assert_eq!(a.policy(), good, "{value:?}");
    }
    let g4 = generation(4, 7);
    reg.publish("api", &g4).await.unwrap();
    converge(&[&a], g4, fa.bound() * 5).await;
}

/// Two publishers racing (two registry connections, as two `policy publish` at once), 30
/// rounds: the same generation with two policies stores exactly one (the other `Conflict`);
/// two new generations at once end on the higher one, whichever lands first; and an instance
/// follows the last. Holds as it was, pinned.
#[tokio::test]
async fn racing_publishers_store_one_policy_per_generation_and_never_go_back() {
    let server = RedisServer::start();
    let (first, second) = (registry(&server).await, registry(&server).await);
    let inst = instance(&server, generation(0, 10)).await;
    let follower = follow(&server, &inst).await.unwrap();
    for round in 0..30 {
        let g = 3 * round + 1;
        let (x, y) = (generation(g, 10), generation(g, 11));
        let (rx, ry) = tokio::join!(first.publish("api", &x), second.publish("api", &y));
        let stored = first.get("api").await.unwrap().unwrap();
        match (&rx, &ry) {
            (Ok(_), Err(RegistryError::Conflict { .. })) => assert_eq!(stored, x),
            (Err(RegistryError::Conflict { .. }), Ok(_)) => assert_eq!(stored, y),
            other => panic!("generation {g}: {other:?}"),
        }
        let (x, y) = (generation(g + 1, 10), generation(g + 2, 10));
        let (rx, ry) = tokio::join!(first.publish("api", &x), second.publish("api", &y));
        assert!(ry.is_ok(), "{ry:?}");
        assert!(
            rx.is_ok() || matches!(rx, Err(RegistryError::Stale { stored, .. }) if stored == g + 2),
            "{rx:?}"
        );
        assert_eq!(first.get("api").await.unwrap().unwrap(), y);
    }
    converge(&[&inst], generation(90, 10), follower.bound() * 5).await;
}

/// An instance still on generation 1 after generation 2 wrote a bucket is decided under
/// generation 2, and its decision says so: the limit is generation 2's. Holds, pinned.
#[tokio::test]
async fn a_lagging_instance_is_decided_under_the_newer_generation_and_says_so() {
    let server = RedisServer::start();
    let lagging = instance(&server, generation(1, 10)).await;
    let switched = instance(&server, generation(2, 4)).await;
    assert_eq!(lagging.check(["k"], 1).await.unwrap().limit, 10);
    let d = switched.check(["k"], 1).await.unwrap();
    assert_eq!((d.limit, d.remaining), (4, 2));
    let d = lagging.check(["k"], 1).await.unwrap();
    assert_eq!((d.allowed, d.limit, d.remaining), (true, 4, 1));
    lagging.check(["k"], 1).await.unwrap();
    let d = lagging.check(["k"], 1).await.unwrap();
    assert_eq!((d.allowed, d.limit, d.remaining), (false, 4, 0));
}

/// The registry's server restarts empty under a fleet on generation 5, and someone publishes
/// generation 1 there (the registry, empty, accepts it). Before, the instances on generation 5
/// refused it (older) and an instance started afterwards took it: two policies in the fleet
/// for good, and a registry that no longer named the generation the buckets carry. A follower
/// that finds the registry without the newest generation it took from it (nothing, or an older
/// one) publishes that one again, so every instance, new ones too, ends on generation 5, and a
/// later publication of an older generation is refused as `Stale`.
#[tokio::test]
async fn a_registry_restarted_empty_gets_the_fleets_generation_back() {
    let mut server = RedisServer::start();
    let g5 = generation(5, 10);
    registry(&server).await.publish("api", &g5).await.unwrap();
    let a = instance(&server, generation(0, 10)).await;
    // A polls every second: B starts, and takes generation 1, well before A's next poll.
    let fa = PolicyFollower::start(
        registry(&server).await,
        "api",
        std::slice::from_ref(&a),
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    assert_eq!(a.policy(), g5);
    server.restart();
    let reg = registry(&server).await;
    let g1 = generation(1, 4);
    // Stored, or refused as stale if the follower put generation 5 back first.
    let published = reg.publish("api", &g1).await;
    assert!(
        matches!(
            published,
            Ok(_) | Err(RegistryError::Stale { stored: 5, .. })
        ),
        "{published:?}"
    );
    let b = instance(&server, generation(0, 10)).await;
    let fb = follow(&server, &b).await.unwrap();
    let at_start = b.policy();
    let started = std::time::Instant::now();
    converge(&[&a, &b], g5, fa.bound() * 3).await;
    eprintln!(
        "B started on {at_start}; every instance on generation 5 {:?} later (A's bound {:?})",
        started.elapsed(),
        fa.bound()
    );
    tokio::time::timeout(fa.bound() * 3, async {
        while reg.get("api").await.ok().flatten() != Some(g5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the registry holds generation 5 again");
    assert!(matches!(
        reg.publish("api", &g1).await,
        Err(RegistryError::Stale {
            stored: 5,
            offered: 1,
            ..
        })
    ));
    // Flushed under live subscriptions (no reconnection to notice): generation 1 is stored
    // and announced, and the followers, reading it, put generation 5 back (or a follower's
    // poll between the flush and the publication put it back first, and 1 is refused).
    let _: () = redis::cmd("FLUSHALL")
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    let published = reg.publish("api", &g1).await;
    assert!(
        matches!(
            published,
            Ok(Published::Stored) | Err(RegistryError::Stale { stored: 5, .. })
        ),
        "{published:?}"
    );
    let c = instance(&server, generation(0, 10)).await;
    let fc = follow(&server, &c).await.unwrap();
    let started = std::time::Instant::now();
    converge(&[&a, &b, &c], g5, fa.bound() * 3).await;
    eprintln!(
        "after a flush, every instance on generation 5 {:?} after C started",
        started.elapsed()
    );
    assert_eq!(reg.get("api").await.unwrap(), Some(g5));
    drop((fa, fb, fc));
}
