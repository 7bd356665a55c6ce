//! Least privilege: tollgate under a Redis ACL user that may touch only its key prefix and run
//! only the commands it needs, against a real redis-server. Redis checks the commands a script
//! calls (`TIME`, `GET`, `SET`, and `PEXPIRETIME` while a policy change is deferred) against
//! the calling user too, so they are part of the set.
//!
//! A user missing any of those rights gets a loud [`StoreError::Script`]: a misconfiguration,
//! never mistaken for an outage, so a [`Limiter`] reports it as [`Error::Store`] instead of
//! switching to its failure mode (no `Bypassed` or `Degraded` decision hides it).
//!
//! Behind Sentinel and on a Cluster the same user needs a few rights more
//! ([`SENTINEL_RULES`], [`CLUSTER_RULES`]), proven on real topologies, each shown needed. One
//! missing there is not loud: without `+asking`, a key a slot migration already moved is
//! `Unavailable` until the migration ends.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{eventually, until};

use tollgate::{BreakerState, Error, FailureMode, Limiter};
use tollgate_core::{Acquire, ErrorClass, Key, Policy, Rate, Store, StoreError, Transition};
use tollgate_redis::RedisStore;
use tollgate_testkit::cluster::RedisCluster;
use tollgate_testkit::sentinel::SentinelCluster;
use tollgate_testkit::server::RedisServer;

const USER: &str = "tollgate";
const PASSWORD: &str = "s3cret-for-tests";

/// The documented ACL rules (docs/security.md), after `ACL SETUSER tollgate`.
const RULES: &[&str] = &[
    "reset",
    "on",
    ">s3cret-for-tests",
    "~tollgate:*",
    "resetchannels",
    "-@all",
    "+evalsha",
    "+eval",
    "+script|load",
    "+del",
    "+get",
    "+set",
    "+time",
    "+pexpiretime",
    "+ping",
    "+multi",
    "+exec",
];

/// The documented rules added behind Sentinel, on every data node (docs/security.md): redis-rs
/// checks with `ROLE` that the node the sentinels name is a primary.
const SENTINEL_RULES: &[&str] = &["+role"];

/// The documented rules of a sentinel-side user (docs/security.md), on every sentinel, after
/// `ACL SETUSER tollgate on >PASSWORD resetchannels -@all`: redis-rs checks with `ROLE` that
/// each sentinel is one and finds the primary with `SENTINEL MASTERS`; the store's watch of each
/// sentinel subscribes to `+switch-master`, asks `SENTINEL GET-MASTER-ADDR-BY-NAME` and `PING`s
/// it every 5 s.
const SENTINEL_SIDE_RULES: &[&str] = &[
    "+role",
    "+sentinel|masters",
    "+sentinel|get-master-addr-by-name",
    "+subscribe",
    "&+switch-master",
    "+ping",
];

/// The documented rules added on a Cluster, on every node (docs/security.md): the slot map
/// (`CLUSTER SLOTS`) and following an `ASK` (`ASKING`).
const CLUSTER_RULES: &[&str] = &["+cluster|slots", "+asking"];

const HOUR: Duration = Duration::from_secs(3600);
/// The fixed window's length: Redis's clock is the real one here, and fixed windows are aligned
/// to the epoch (`floor(now / window)`), so an hour's window restarted at the top of the hour and
/// broke the exact counts of a run that crossed it; a boundary within a 30-day window is ~1e-6
/// likely.
const MONTH: Duration = Duration::from_secs(30 * 24 * 3600);

fn admin(server: &RedisServer) -> redis::Connection {
    server.client().get_connection().unwrap()
}

/// Replaces the user's rules with `rules`.
fn set_user(server: &RedisServer, rules: &[&str]) {
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg(USER)
        .arg(rules)
        .exec(&mut admin(server))
        .unwrap();
}

/// The documented rules with `drop` removed and `extra` appended.
fn rules_without(drop: &str, extra: &[&'static str]) -> Vec<&'static str> {
    let mut rules: Vec<&str> = RULES.iter().copied().filter(|r| *r != drop).collect();
    rules.extend_from_slice(extra);
    rules
}

/// The documented rules with `extra` appended.
fn rules_with(extra: &[&'static str]) -> Vec<&'static str> {
    RULES.iter().chain(extra).copied().collect()
}

/// The documented rules plus the documented topology rules `topology` but `drop`.
fn rules_with_all_but(topology: &[&'static str], drop: &str) -> Vec<&'static str> {
    let rest: Vec<&'static str> = topology.iter().copied().filter(|r| *r != drop).collect();
    rules_with(&rest)
}

fn acl_log_reset(server: &RedisServer) {
    redis::cmd("ACL")
        .arg("LOG")
        .arg("RESET")
        .exec(&mut admin(server))
        .unwrap();
}

fn url(server: &RedisServer) -> String {
    format!("redis://{USER}:{PASSWORD}@127.0.0.1:{}", server.port())
}

async fn store(server: &RedisServer, pooled: bool) -> Result<RedisStore, StoreError> {
    let b = RedisStore::builder(url(server)).timeout(Duration::from_secs(5));
    if pooled { b.pool(2) } else { b }.build().await
}

fn policies() -> [Policy; 3] {
    policies_of(3)
}

fn policies_of(limit: u64) -> [Policy; 3] {
    [
        Policy::token_bucket(limit, Rate::new(1, HOUR)).unwrap(),
        Policy::fixed_window(limit, MONTH).unwrap(),
        Policy::sliding_log(limit, HOUR).unwrap(),
    ]
}

/// A policy change under `DeferUntilExpiry`, for every algorithm: the bucket is written at
/// generation 1, then a generation-2 caller (another limit) finds it and defers to it: the
/// old parameters govern until the key expires, which the script reads with `PEXPIRETIME`
/// (when the deferral starts, and on every call while it is pending).
async fn defer(store: &RedisStore) {
    let k = Key::new("acl", ["deferred"]).unwrap();
    for (old, new) in policies().into_iter().zip(policies_of(5)) {
        let old = old.with_generation(1);
        let new = new
            .with_generation(2)
            .with_transition(Transition::DeferUntilExpiry);
        let d = store.acquire(&k, &old, 1).await.unwrap();
        assert_eq!((d.allowed, d.limit, d.remaining), (true, 3, 2), "{old}");
        for remaining in [1, 0] {
            let d = store.acquire(&k, &new, 1).await.unwrap_or_else(|e| {
                panic!("{new}: a deferral under the documented ACL rules: {e}")
            });
            assert_eq!(
                (d.allowed, d.limit, d.remaining),
                (true, 3, remaining),
                "{new}: generation 1 governs until the bucket expires"
            );
        }
        store.reset(&k, &new).await.unwrap();
    }
}

/// Denials Redis logged for this user, as `(reason, object)`; `CLIENT SETINFO` (sent by
/// redis-rs on connect, its result ignored) is left out.
fn acl_denials(server: &RedisServer) -> Vec<(String, String)> {
    let entries: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query(&mut admin(server))
        .unwrap();
    let mut out = Vec::new();
    for entry in entries {
        let fields: Vec<(String, redis::Value)> = match redis::from_redis_value(entry) {
            Ok(map) => map,
            Err(_) => continue,
        };
        let get = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| redis::from_redis_value::<String>(v.clone()).ok())
                .unwrap_or_default()
        };
        if get("username") == USER && !get("object").starts_with("client") {
            out.push((get("reason"), get("object")));
        }
    }
    out
}

/// Acquire, peek, batch and reset for every algorithm, with the script cache lost (`flush`
/// empties it wherever the keys live) before a single and a batched call.
async fn exercise(store: &RedisStore, flush: &dyn Fn()) {
    let k = Key::new("acl", ["alice"]).unwrap();
    let other = Key::new("acl", ["bob"]).unwrap();
    for p in &policies() {
        assert!(store.acquire(&k, p, 2).await.unwrap().allowed, "{p}");
        // remaining is what is left after the request peeked at.
        assert_eq!(store.peek(&k, p, 1).await.unwrap().remaining, 0, "{p}");
        let batch = [
            Acquire {
                key: &k,
                policy: p,
                cost: 1,
            },
            Acquire {
                key: &other,
                policy: p,
                cost: 3,
            },
        ];
        let ds: Vec<_> = store.acquire_many(&batch).await.unwrap();
        let ds: Vec<_> = ds.into_iter().map(Result::unwrap).collect();
        assert_eq!((ds[0].remaining, ds[1].remaining), (0, 0), "{p}");
        store.reset(&k, p).await.unwrap();
        assert_eq!(store.peek(&k, p, 1).await.unwrap().remaining, 2, "{p}");
        // A batch naming a key twice: one transaction (`MULTI` … `EXEC`), decided in order.
        let twice = [
            Acquire {
                key: &k,
                policy: p,
                cost: 2,
            },
            Acquire {
                key: &k,
                policy: p,
                cost: 2,
            },
        ];
        let ds: Vec<_> = store.acquire_many(&twice).await.unwrap();
        let ds: Vec<_> = ds.into_iter().map(Result::unwrap).collect();
        assert!(ds[0].allowed && !ds[1].allowed, "{p}: {ds:?}");
        store.reset(&k, p).await.unwrap();
        // The script cache is lost (restart, failover, SCRIPT FLUSH): EVAL reloads it.
        flush();
        assert!(store.acquire(&k, p, 3).await.unwrap().allowed, "{p}");
        flush();
        let ds: Vec<_> = store.acquire_many(&batch).await.unwrap();
        let ds: Vec<_> = ds.into_iter().map(Result::unwrap).collect();
        assert!(!ds[0].allowed && !ds[1].allowed, "{p}: {ds:?}");
        store.reset(&k, p).await.unwrap();
        store.reset(&other, p).await.unwrap();
    }
}

#[tokio::test]
async fn tollgate_works_under_the_least_privilege_acl_user() {
    let server = RedisServer::start();
    set_user(&server, RULES);
    for pooled in [false, true] {
        let store = store(&server, pooled)
            .await
            .expect("build under the ACL user");
        exercise(&store, &|| server.script_flush()).await;
        defer(&store).await;
        let limiter = Limiter::builder("acl", policies()[0])
            .store(Arc::new(store))
            .failure_mode(FailureMode::Closed)
            .build()
            .unwrap();
        let d = limiter.check(["carol"], 1).await.unwrap();
        assert_eq!(d.enforcement, tollgate::Enforcement::Shared);
        limiter.reset(["carol"]).await.unwrap();
    }
    assert_eq!(acl_denials(&server), vec![], "ACL LOG has denials");
    // The user cannot read or write outside the prefix, nor run anything else.
    let client = redis::Client::open(url(&server)).unwrap();
    let mut conn = client.get_connection().unwrap();
    for cmd in [
        redis::cmd("GET").arg("other:key").clone(),
        redis::cmd("SET").arg("tollgate-x").arg("1").clone(),
        redis::cmd("KEYS").arg("*").clone(),
        redis::cmd("FLUSHALL").clone(),
        redis::cmd("CONFIG").arg("GET").arg("*").clone(),
        redis::cmd("SCRIPT").arg("FLUSH").clone(),
    ] {
        let err = cmd.exec(&mut conn).unwrap_err();
        assert_eq!(err.code(), Some("NOPERM"), "{cmd:?}: {err}");
    }
}

/// How the store's owner sees one missing right.
struct Revoked {
    label: &'static str,
    rules: Vec<&'static str>,
    /// The scripts must be missing from the cache (for the EVAL right).
    flush_scripts: bool,
}

fn revocations() -> Vec<Revoked> {
    let case = |label, drop, extra: &[&'static str], flush_scripts| Revoked {
        label,
        rules: rules_without(drop, extra),
        flush_scripts,
    };
    vec![
        case("no EVALSHA", "+evalsha", &[], false),
        case("no EVAL, after SCRIPT FLUSH", "+eval", &[], true),
        case("no TIME inside the script", "+time", &[], false),
        case("no GET inside the script", "+get", &[], false),
        case("no SET inside the script", "+set", &[], false),
        case(
            "keys outside the prefix only",
            "~tollgate:*",
            &["~other:*"],
            false,
        ),
    ]
}

#[tokio::test]
async fn a_missing_right_is_a_loud_store_error_not_a_failure_mode_switch() {
    let server = RedisServer::start();
    let p = policies()[1];
    for case in revocations() {
        set_user(&server, RULES);
        let store = Arc::new(store(&server, false).await.unwrap());
        set_user(&server, &case.rules);
        if case.flush_scripts {
            server.script_flush();
        }
        let label = case.label;
        let k = Key::new("acl", ["dave"]).unwrap();
        let err = store.acquire(&k, &p, 1).await.unwrap_err();
        assert_eq!(err.class(), ErrorClass::Script, "{label}: {err}");
        let message = err.to_string().to_lowercase();
        assert!(
            message.contains("perm") || message.contains("can't"),
            "{label}: the message names the permission problem: {err}"
        );
        let batch = [Acquire {
            key: &k,
            policy: &p,
            cost: 1,
        }];
        let mut results = store.acquire_many(&batch).await.unwrap();
        let err = results.remove(0).unwrap_err();
        assert_eq!(err.class(), ErrorClass::Script, "{label} (batch): {err}");

        for mode in [FailureMode::Open, FailureMode::degraded(2)] {
            let mode_name = mode.as_str();
            let limiter = Limiter::builder("acl", p)
                .store(store.clone())
                .failure_mode(mode)
                .build()
                .unwrap();
            for _ in 0..10 {
                match limiter.check(["dave"], 1).await {
                    Err(Error::Store(e)) => assert_eq!(e.class(), ErrorClass::Script),
                    other => panic!("{label}, {mode_name}: expected Error::Store, got {other:?}"),
                }
            }
            match limiter
                .check_many(std::slice::from_ref(&k), 1)
                .await
                .map(|mut r| r.remove(0))
            {
                Ok(Err(Error::Store(e))) => assert_eq!(e.class(), ErrorClass::Script),
                other => {
                    panic!("{label}, {mode_name} (batch): expected Error::Store, got {other:?}")
                }
            }
            assert_eq!(
                limiter.breaker_state(),
                BreakerState::Closed,
                "{label}, {mode_name}: a permission error is not an outage"
            );
        }
    }
    // Without DEL, reset is refused loudly too.
    set_user(&server, RULES);
    let store = Arc::new(store(&server, false).await.unwrap());
    set_user(&server, &rules_without("+del", &[]));
    let limiter = Limiter::builder("acl", p)
        .store(store)
        .failure_mode(FailureMode::Open)
        .build()
        .unwrap();
    assert!(
        matches!(limiter.reset(["dave"]).await, Err(Error::Store(ref e)) if e.class() == ErrorClass::Script)
    );
}

#[tokio::test]
async fn building_without_script_load_or_with_a_wrong_password_fails_loudly() {
    let server = RedisServer::start();
    set_user(&server, &rules_without("+script|load", &[]));
    let err = store(&server, false).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::Script, "no SCRIPT LOAD: {err}");

    set_user(&server, RULES);
    let wrong = format!("redis://{USER}:wrong@127.0.0.1:{}", server.port());
    let err = RedisStore::builder(wrong).build().await.unwrap_err();
    assert_ne!(
        err.class(),
        ErrorClass::Unavailable,
        "a wrong password is a misconfiguration, not an outage: {err}"
    );
}

/// Credentials revoked while the service runs (`ACL DELUSER` closes the user's connections;
/// the store reconnects and its AUTH is refused) must not look like an outage for long: a
/// fail-open limiter would otherwise stop enforcing anything, silently. The calls caught by the
/// dropped connection itself are unavailable (nothing tells them apart from a network failure);
/// once the reconnect's AUTH is refused, every call is a loud store error.
#[tokio::test]
async fn credentials_revoked_at_runtime_are_not_an_outage() {
    let server = RedisServer::start();
    set_user(&server, RULES);
    let store = Arc::new(store(&server, false).await.unwrap());
    let limiter = Limiter::builder("acl", policies()[1])
        .store(store)
        .failure_mode(FailureMode::Open)
        .build()
        .unwrap();
    assert!(limiter.check(["erin"], 1).await.unwrap().allowed);
    redis::cmd("ACL")
        .arg("DELUSER")
        .arg(USER)
        .exec(&mut admin(&server))
        .unwrap();
    let call = async || match limiter.check(["erin"], 1).await {
        Ok(d) => format!("Ok({:?})", d.enforcement),
        Err(Error::Store(e)) => format!("Store({:?})", e.class()),
        Err(e) => format!("{e}"),
    };
    // Calls, 10 ms apart, until the reconnect's AUTH is refused (the first loud error; at
    // most 5 s and 500 calls), then 5 calls more. (Before: ten calls 50 ms apart, of which
    // the last five had to be loud, a time the reconnect was assumed to take.)
    let loud = "Store(Script)";
    let bound = Duration::from_secs(5);
    let started = std::time::Instant::now();
    let mut outcomes = Vec::new();
    let mut loud_from = None;
    for i in 0..500 {
        outcomes.push(call().await);
        if outcomes[i] == loud {
            loud_from = Some(i);
            break;
        }
        if started.elapsed() >= bound {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let loud_from = loud_from.unwrap_or_else(|| {
        panic!(
            "no loud error within {bound:?} ({} calls) after the user was deleted: {outcomes:?}",
            outcomes.len()
        )
    });
    for _ in 0..5 {
        outcomes.push(call().await);
    }
    let bypassed = outcomes.iter().filter(|o| o.contains("Bypassed")).count();
    assert!(
        bypassed <= 3 && outcomes[loud_from..].iter().all(|o| o == loud),
        "after the user is deleted: {outcomes:?}"
    );
    println!("calls after ACL DELUSER: {outcomes:?}");
}

// ---------------------------------------------------------------------------------------------
// Sentinel and Cluster

/// `ROLE`'s first field (`master`, `slave`) of `server`, as the default user.
fn role(server: &RedisServer) -> Option<String> {
    let mut conn = server
        .client()
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()?;
    let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut conn).ok()?;
    redis::from_redis_value(role.first()?.clone()).ok()
}

fn sentinel_store(topology: &SentinelCluster) -> tollgate_redis::RedisStoreBuilder {
    RedisStore::sentinel(topology.master_name(), topology.sentinel_urls())
        .primary_credentials(USER, PASSWORD)
        .timeout(Duration::from_secs(5))
}

/// Behind Sentinel: the data nodes (primary and replica) have the user with the documented
/// rules plus [`SENTINEL_RULES`] (`ACL SETUSER` is not replicated: it is set on each); the
/// sentinels keep their `default` user (the sentinel URLs carry only the sentinels' own
/// credentials). The store decides, reloads its scripts and follows a `SENTINEL FAILOVER` with
/// nothing in `ACL LOG`; without a rule of [`SENTINEL_RULES`] it cannot resolve the primary.
#[tokio::test]
async fn behind_sentinel_the_data_nodes_need_exactly_the_documented_rules() {
    let topology = SentinelCluster::start("acl");
    let set_all = |rules: &[&str]| {
        for server in topology.data_servers() {
            set_user(server, rules);
        }
    };
    let reset_logs = || topology.data_servers().iter().for_each(acl_log_reset);

    // Each rule is needed: redis-rs asks the named node `ROLE`, then, refused, `INFO
    // replication`; both refused, it reports `ROLE`'s refusal and `build` fails loudly.
    for drop in SENTINEL_RULES {
        set_all(&rules_with_all_but(SENTINEL_RULES, drop));
        let err = sentinel_store(&topology).build().await.unwrap_err();
        assert_refused(&err, drop.trim_start_matches('+'));
        let primary = &topology.data_servers()[topology.current_primary_index()];
        let denied = acl_denials(primary);
        for command in ["role", "info"] {
            assert!(
                denied.contains(&("command".to_owned(), command.to_owned())),
                "without {drop}: {denied:?}"
            );
        }
        reset_logs();
    }
    // `+info` in place of `+role` would do too (the fallback), but opens the whole of `INFO`.
    set_all(&rules_with(&["+info"]));
    let store = sentinel_store(&topology)
        .build()
        .await
        .expect("build with +info instead of +role");
    let k = Key::new("acl", ["info"]).unwrap();
    assert!(store.acquire(&k, &policies()[1], 1).await.unwrap().allowed);
    drop(store);
    reset_logs();

    set_all(&rules_with(SENTINEL_RULES));
    let store = sentinel_store(&topology)
        .build()
        .await
        .expect("build behind Sentinel under the documented rules");
    let primary = &topology.data_servers()[topology.current_primary_index()];
    exercise(&store, &|| primary.script_flush()).await;
    defer(&store).await;

    // A failover: the store meets the old primary (now read-only), asks the sentinels again,
    // checks the promoted replica's ROLE and reloads its scripts there (`EVAL`).
    let k = Key::new("acl", ["failover"]).unwrap();
    let p = policies()[1];
    assert_eq!(store.acquire(&k, &p, 1).await.unwrap().remaining, 2);
    topology.wait_replica_synced(Duration::from_secs(10));
    let old = topology.current_primary_index();
    let sentinel = &topology.sentinels()[0];
    // Refused (NOGOODSLAVE) until the sentinel has a fresh view of the replica's link.
    until(
        Duration::from_secs(15),
        "SENTINEL FAILOVER accepted",
        || {
            redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(topology.master_name())
                .exec(&mut admin(sentinel))
                .is_ok()
        },
    );
    until(Duration::from_secs(20), "the roles swap", || {
        let data = topology.data_servers();
        topology.current_primary_index() != old
            && role(&data[1 - old]).as_deref() == Some("master")
            && role(&data[old]).as_deref() == Some("slave")
    });
    let start = std::time::Instant::now();
    let d = loop {
        match store.acquire(&k, &p, 1).await {
            Ok(d) => break d,
            Err(e) => {
                assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "no recovery: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(d.remaining, 1, "the bucket survived the failover");
    exercise(&store, &|| topology.data_servers()[1 - old].script_flush()).await;

    for (index, server) in topology.data_servers().iter().enumerate() {
        assert_eq!(
            acl_denials(server),
            vec![],
            "ACL LOG of data server {index} has denials"
        );
    }
}

/// [`SENTINEL_SIDE_RULES`] but `without`.
fn sentinel_rules_without(without: &str) -> Vec<&'static str> {
    SENTINEL_SIDE_RULES
        .iter()
        .copied()
        .filter(|r| *r != without)
        .collect()
}

/// Sets the sentinel-side user on every sentinel of `topology` with `rules` (and empties their
/// `ACL LOG`), and returns the sentinel URLs that log in as it.
fn set_sentinel_user(topology: &SentinelCluster, rules: &[&str]) -> Vec<String> {
    let mut urls = Vec::new();
    for sentinel in topology.sentinels() {
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(USER)
            .arg(&["reset", "on", ">s3cret-for-tests", "resetchannels", "-@all"][..])
            .arg(rules)
            .exec(&mut admin(sentinel))
            .unwrap();
        acl_log_reset(sentinel);
        urls.push(format!(
            "redis://{USER}:{PASSWORD}@127.0.0.1:{}",
            sentinel.port()
        ));
    }
    urls
}

/// The last command of each sentinel's subscribed clients (`CLIENT LIST`: `cmd=` where `sub=`
/// is above 0): the store's watches.
fn watch_commands(topology: &SentinelCluster) -> Vec<Vec<String>> {
    topology
        .sentinels()
        .iter()
        .map(|sentinel| {
            let list: String = redis::cmd("CLIENT")
                .arg("LIST")
                .query(&mut admin(sentinel))
                .unwrap();
            list.lines()
                .filter(|line| {
                    line.split(' ')
                        .any(|f| f.starts_with("sub=") && f != "sub=0")
                })
                .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("cmd=")))
                .map(str::to_owned)
                .collect()
        })
        .collect()
}

/// A sentinel-side ACL user with exactly [`SENTINEL_SIDE_RULES`] (docs/security.md) on every
/// sentinel: the store builds, decides, and its watch of each sentinel subscribes, asks
/// `SENTINEL GET-MASTER-ADDR-BY-NAME` and `PING`s, with nothing in any sentinel's `ACL LOG`.
/// Each rule is needed: without `+role` or `+sentinel|masters` `build` fails loudly; without a
/// watch's rule the store builds and decides, and the sentinels log the watch's refusal. (The
/// doc listed `GET-MASTER-ADDR-BY-NAME`, `SUBSCRIBE +switch-master` and `PING` alone, under
/// which `build` failed: `NoPerm: this user has no permissions to run the 'role' command`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_side_user_needs_exactly_the_documented_rights() {
    let topology = tokio::task::block_in_place(|| SentinelCluster::start("sentinelside"));
    let store = |urls: Vec<String>| {
        RedisStore::sentinel(topology.master_name(), urls)
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(5))
    };
    let k = Key::new("acl", ["sentinel-side"]).unwrap();
    let denied_on_every_sentinel = |reason: &str, object: &str| {
        topology
            .sentinels()
            .iter()
            .all(|sentinel| acl_denials(sentinel).contains(&(reason.to_owned(), object.to_owned())))
    };

    for (without, command) in [("+role", "role"), ("+sentinel|masters", "sentinel|masters")] {
        let urls = set_sentinel_user(&topology, &sentinel_rules_without(without));
        let err = store(urls).build().await.unwrap_err();
        assert_refused(&err, command);
    }
    for (without, reason, object) in [
        (
            "+sentinel|get-master-addr-by-name",
            "command",
            "sentinel|get-master-addr-by-name",
        ),
        ("+subscribe", "command", "subscribe"),
        ("&+switch-master", "channel", "+switch-master"),
    ] {
        let urls = set_sentinel_user(&topology, &sentinel_rules_without(without));
        let s = store(urls)
            .build()
            .await
            .expect("the store builds without a watch's right");
        s.acquire(&k, &policies()[0], 1).await.expect("a decision");
        assert!(
            eventually(Duration::from_secs(5), || denied_on_every_sentinel(
                reason, object
            ))
            .await,
            "without {without}: the sentinels' ACL LOG: {:?}",
            topology
                .sentinels()
                .iter()
                .map(acl_denials)
                .collect::<Vec<_>>()
        );
        drop(s);
    }

    let urls = set_sentinel_user(&topology, SENTINEL_SIDE_RULES);
    let s = store(urls)
        .build()
        .await
        .expect("build under the documented sentinel-side rules");
    s.acquire(&k, &policies()[0], 1).await.expect("a decision");
    for command in ["sentinel|get-master-addr-by-name", "ping"] {
        // the watch asks on subscribing, then PINGs every 5 s
        assert!(
            eventually(Duration::from_secs(8), || watch_commands(&topology)
                .iter()
                .all(|cmds| cmds.iter().any(|c| c == command)))
            .await,
            "each sentinel's watch ran {command}: {:?}",
            watch_commands(&topology)
        );
    }
    for (index, sentinel) in topology.sentinels().iter().enumerate() {
        assert_eq!(
            acl_denials(sentinel),
            vec![],
            "ACL LOG of sentinel {index} has denials"
        );
    }
}

/// `err` is the loud refusal of `command` (`NOPERM`, a `Script`-class error).
fn assert_refused(err: &StoreError, command: &str) {
    assert_eq!(err.class(), ErrorClass::Script, "{err}");
    assert!(
        err.to_string()
            .contains(&format!("no permissions to run the '{command}' command")),
        "{err}"
    );
}

fn cluster_store(cluster: &RedisCluster) -> tollgate_redis::RedisStoreBuilder {
    RedisStore::cluster(cluster.nodes().iter().map(url)).timeout(Duration::from_secs(5))
}

/// On a Cluster: every node has the user with the documented rules plus [`CLUSTER_RULES`]
/// (given to the store in the node URLs). The store decides, reloads its scripts, follows a
/// slot migration's `ASK` (the bucket already moved to the importing node) and then its `MOVED`,
/// with nothing in `ACL LOG`; without a rule of [`CLUSTER_RULES`] it fails loudly.
#[tokio::test]
async fn on_a_cluster_every_node_needs_exactly_the_documented_rules() {
    let cluster = RedisCluster::start(3);
    let set_all = |rules: &[&str]| {
        for node in cluster.nodes() {
            set_user(node, rules);
        }
    };
    let flush_all = || cluster.nodes().iter().for_each(RedisServer::script_flush);
    let reset_logs = || cluster.nodes().iter().for_each(acl_log_reset);

    set_all(&rules_with(CLUSTER_RULES));
    let store = cluster_store(&cluster)
        .build()
        .await
        .expect("build on the cluster under the documented rules");
    exercise(&store, &flush_all).await;
    defer(&store).await;

    // The ASK window: the bucket moved to the importing node, the source answers ASK.
    let k = Key::new("acl", ["migrating"]).unwrap();
    let slot = RedisCluster::slot_of("tollgate:{acl:migrating}");
    let p = policies()[1];
    assert_eq!(store.acquire(&k, &p, 1).await.unwrap().remaining, 2);
    let from = cluster.node_for_slot(slot);
    let to = (from + 1) % cluster.nodes().len();
    let migration = cluster.begin_slot_migration(slot, from, to, 100);
    assert_eq!(migration.keys_moved(), 1);
    assert_eq!(store.acquire(&k, &p, 1).await.unwrap().remaining, 1);
    assert_eq!(store.peek(&k, &p, 1).await.unwrap().remaining, 0);
    let batch = [Acquire {
        key: &k,
        policy: &p,
        cost: 1,
    }];
    let d = store.acquire_many(&batch).await.unwrap().remove(0).unwrap();
    assert!(d.allowed && d.remaining == 0, "{d:?}");
    // NOSCRIPT on the importing node: EVAL, after ASKING.
    cluster.nodes()[to].script_flush();
    assert!(!store.acquire(&k, &p, 1).await.unwrap().allowed);
    store.reset(&k, &p).await.unwrap();
    assert_eq!(store.peek(&k, &p, 1).await.unwrap().remaining, 2);
    assert_eq!(store.acquire(&k, &p, 1).await.unwrap().remaining, 2);
    migration.finish();
    // The slot moved: MOVED, and the slot map is read again.
    assert_eq!(store.acquire(&k, &p, 1).await.unwrap().remaining, 1);
    exercise(&store, &flush_all).await;
    for (index, node) in cluster.nodes().iter().enumerate() {
        assert_eq!(
            acl_denials(node),
            vec![],
            "ACL LOG of node {index} has denials"
        );
    }

    // Without `+cluster|slots` the slot map cannot be read: `build` fails, and a running store
    // fails at the first `MOVED` (it reads the map again).
    set_all(&rules_with_all_but(CLUSTER_RULES, "+cluster|slots"));
    let err = cluster_store(&cluster).build().await.unwrap_err();
    assert_refused(&err, "cluster|slots");
    cluster.migrate_slot(slot, to, from);
    let err = store.acquire(&k, &p, 1).await.unwrap_err();
    assert_refused(&err, "cluster|slots");
    reset_logs();

    // Without `+asking`, the store builds and decides, but a key already moved to the
    // importing node cannot be reached during a migration: `ASKING` is refused, the importing
    // node answers `MOVED` back to the source, and the call fails. Not loudly: the error is
    // `Unavailable` ("key moved"), so a fail-open limiter bypasses such keys, and a degraded
    // one enforces them locally, for as long as the migration lasts.
    set_all(&rules_with_all_but(CLUSTER_RULES, "+asking"));
    let store = cluster_store(&cluster)
        .build()
        .await
        .expect("build without +asking");
    assert!(store.acquire(&k, &p, 1).await.unwrap().allowed);
    let migration = cluster.begin_slot_migration(slot, from, to, 100);
    assert_eq!(migration.keys_moved(), 1);
    let err = store.acquire(&k, &p, 1).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::Unavailable, "{err}");
    assert!(err.to_string().contains("moved"), "{err}");
    let denied = acl_denials(&cluster.nodes()[to]);
    assert!(
        denied.contains(&("command".to_owned(), "asking".to_owned())),
        "{denied:?}"
    );
    migration.finish();
    assert!(store.acquire(&k, &p, 1).await.is_ok());
}

/// `total_connections_received` of `sentinel`, asked on `conn`.
fn connections_received(conn: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(conn).unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("INFO stats names total_connections_received")
}

/// The sentinels with a command link to `sentinel` (`CLIENT LIST`: distinct clients named
/// `sentinel-<run id>-cmd`).
fn peer_links(sentinel: &RedisServer) -> usize {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut admin(sentinel))
        .unwrap();
    list.lines()
        .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("name=")))
        .filter(|name| name.starts_with("sentinel-") && name.ends_with("-cmd"))
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

/// A sentinel that refuses the watch's catch-up question (`SENTINEL GET-MASTER-ADDR-BY-NAME`:
/// a user without that right) is still watched on the one connection subscribed to
/// `+switch-master`. The watch took the refusal for a lost connection and connected again
/// every 100 ms, without end (before: ~10 connections a second to each sentinel, each one
/// more `ACL LOG` entry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_refusing_the_catch_up_question_is_watched_on_one_connection() {
    let topology = tokio::task::block_in_place(|| SentinelCluster::start("sentinelcatchup"));
    let urls = set_sentinel_user(
        &topology,
        &sentinel_rules_without("+sentinel|get-master-addr-by-name"),
    );
    let store = RedisStore::sentinel(topology.master_name(), urls)
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("the store builds without the watch's catch-up right");
    let k = Key::new("acl", ["catch-up"]).unwrap();
    store
        .acquire(&k, &policies()[0], 1)
        .await
        .expect("a decision");
    // The watches have subscribed and been refused their question, and the sentinels have
    // linked up: each sentinel's command link to each other one is made a moment after
    // `SentinelCluster::start` returns (it waits until they know of each other, not until
    // they are connected), ~2.3 s into the test, and those links are connections to the
    // sentinels too. (The window below counted [0, 1, 2] such connections when it started
    // on the watches alone.)
    let settled = eventually(Duration::from_secs(10), || {
        topology.sentinels().iter().all(|sentinel| {
            acl_denials(sentinel).contains(&(
                "command".to_owned(),
                "sentinel|get-master-addr-by-name".to_owned(),
            )) && peer_links(sentinel) == topology.sentinels().len() - 1
        }) && watch_commands(&topology)
            .iter()
            .all(|cmds| !cmds.is_empty())
    })
    .await;
    assert!(
        settled,
        "each sentinel refused its watch's question, is watched and linked to the others: \
         ACL LOG {:?}, watches {:?}, sentinel links {:?}",
        topology
            .sentinels()
            .iter()
            .map(acl_denials)
            .collect::<Vec<_>>(),
        watch_commands(&topology),
        topology
            .sentinels()
            .iter()
            .map(peer_links)
            .collect::<Vec<_>>()
    );
    let mut conns: Vec<redis::Connection> = topology.sentinels().iter().map(admin).collect();
    let before: Vec<u64> = conns.iter_mut().map(connections_received).collect();
    // A negative check, so a fixed window: (almost) no new connections in it. The bug
    // reconnected every 100 ms, ~20 connections to each sentinel in 2 s.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after: Vec<u64> = conns.iter_mut().map(connections_received).collect();
    let new: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert!(
        new.iter().all(|&n| n <= 1),
        "connections made to each sentinel in 2 s: {new:?}"
    );
    // and each is watched, subscribed
    assert!(
        watch_commands(&topology)
            .iter()
            .all(|cmds| !cmds.is_empty()),
        "each sentinel is watched: {:?}",
        watch_commands(&topology)
    );
    drop(store);
}
