//! The server closes the store's connection while no call is in flight (Redis's idle-client
//! `timeout`, `CLIENT KILL`, a load balancer's idle cut). Redis is up and answering all along,
//! so no later call may fail as unavailable: that would apply the operation's failure mode
//! (fail open, closed or degraded) against a healthy shared store. Before the store spoke
//! RESP3 (over which redis-rs reports the close), the next call on each closed connection
//! failed with `Unavailable { "Redis: I/O error", broken pipe }` on every connection kind.

mod common;

use std::time::Duration;

use tollgate_core::{Key, Policy, Rate, Store, StoreError};
use tollgate_redis::{Notice, RedisRegistry, RedisStore};
use tollgate_testkit::server::RedisServer;

fn policy() -> Policy {
    Policy::token_bucket(1_000_000, Rate::per_second(1000)).unwrap()
}

fn key(i: usize) -> Key {
    Key::new("idle", [format!("k{i}")]).unwrap()
}

/// One warm-up call, every connection closed by the server, 300 ms idle, then 8 calls: the
/// failures among them.
async fn after_an_idle_close(server: &RedisServer, store: &RedisStore) -> Vec<StoreError> {
    store.acquire(&key(0), &policy(), 1).await.unwrap();
    let killed = tokio::task::block_in_place(|| server.kill_clients());
    assert!(killed >= 1, "killed {killed}");
    // Kept fixed: the scenario is a close heard while idle (RESP3's disconnection push), and
    // the store shows nothing outside of having heard it; 300 ms is ~1000 times a loopback
    // push's delivery. A call racing the close is another test's (the registry's, below).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut failures = Vec::new();
    for i in 0..8 {
        if let Err(e) = store.acquire(&key(i), &policy(), 1).await {
            failures.push(e);
        }
    }
    failures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_store_survives_an_idle_connection_closed_by_the_server() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .pool(4)
        .build()
        .await
        .unwrap();
    let failures = after_an_idle_close(&server, &store).await;
    assert!(failures.is_empty(), "pool: {failures:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multiplexed_store_survives_an_idle_connection_closed_by_the_server() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .multiplexed()
        .build()
        .await
        .unwrap();
    let failures = after_an_idle_close(&server, &store).await;
    assert!(failures.is_empty(), "multiplexed: {failures:?}");
}

/// `build_lazy` makes the same connection as `build`: a lazily built multiplexed store (the
/// one kind `build_lazy` builds itself) speaks RESP3 as well, so an idle close fails nothing.
/// Before, it connected over RESP2 and the first call after the close failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazily_built_multiplexed_store_survives_an_idle_connection_closed_by_the_server() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .multiplexed()
        .build_lazy()
        .await
        .unwrap();
    let failures = after_an_idle_close(&server, &store).await;
    assert!(failures.is_empty(), "lazy multiplexed: {failures:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_store_survives_an_idle_connection_closed_by_the_primary() {
    let server = RedisServer::start();
    let sentinel = RedisServer::builder()
        .config_file(format!(
            "sentinel monitor m 127.0.0.1 {} 1\nsentinel down-after-milliseconds m 60000\n",
            server.port()
        ))
        .extra_args(["--sentinel"])
        .start();
    let store = RedisStore::sentinel("m", [sentinel.url()])
        .timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let failures = after_an_idle_close(&server, &store).await;
    assert!(failures.is_empty(), "sentinel: {failures:?}");
}

/// The most common trigger: Redis's own idle-client `timeout` (1 s here), reached by moving
/// the server's clock 10 s forward rather than by waiting (a fixed 2.5 s sleep before): the
/// store's connections are closed (checked), and the next call succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_store_survives_the_servers_idle_client_timeout() {
    let server = RedisServer::builder()
        .clock_control(true)
        .extra_args(["--timeout", "1"])
        .start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .pool(4)
        .build()
        .await
        .unwrap();
    store.acquire(&key(0), &policy(), 1).await.unwrap();
    idle_out(&server).await;
    let out = store.acquire(&key(0), &policy(), 1).await;
    assert!(out.is_ok(), "pool after the server's idle timeout: {out:?}");
}

/// A URL that names RESP2 keeps it (the store then cannot hear of an idle close: the first
/// call after it fails as unavailable, as any call on a dropped connection does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_naming_resp2_is_honoured() {
    let server = RedisServer::start();
    let store = RedisStore::builder(format!("{}?protocol=resp2", server.url()))
        .timeout(Duration::from_secs(2))
        .pool(2)
        .build()
        .await
        .unwrap();
    assert!(store.acquire(&key(0), &policy(), 1).await.unwrap().allowed);
    let mut admin = server.client().get_connection().unwrap();
    let clients: String = redis::cmd("CLIENT").arg("LIST").query(&mut admin).unwrap();
    assert!(
        clients
            .lines()
            .any(|l| l.contains("resp=2") && !l.contains("cmd=client|list")),
        "{clients}"
    );
}

/// A password that merely contains the text `protocol=` (no protocol in the URL's query) still
/// gets RESP3: the whole URL was searched, the store stayed on RESP2 and failed the first call
/// after an idle close as unavailable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_containing_protocol_eq_still_gets_resp3() {
    let server = RedisServer::start();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "app", "on", ">protocol=x", "~*", "+@all"])
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    let url = format!("redis://app:protocol=x@127.0.0.1:{}/", server.port());
    let store = RedisStore::builder(url)
        .timeout(Duration::from_secs(2))
        .pool(2)
        .build()
        .await
        .unwrap();
    let failures = after_an_idle_close(&server, &store).await;
    assert!(failures.is_empty(), "pool: {failures:?}");
}

// ---------------------------------------------------------------------------------------------
// The policy registry: its connection manager, and its subscription.

/// The registry's deadline in these tests.
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(2);

async fn registry(url: &str) -> RedisRegistry {
    RedisRegistry::connect(url, "tollgate:", REGISTRY_TIMEOUT)
        .await
        .unwrap()
}

/// The ids of the clients of `kind` (`normal`, `pubsub`) connected to `server`, the caller's
/// own connection (a new one, so that the server's idle `timeout` has not closed it) excepted.
fn clients_of(server: &RedisServer, kind: &str) -> Vec<i64> {
    let mut admin = server.client().get_connection().unwrap();
    let own: i64 = redis::cmd("CLIENT").arg("ID").query(&mut admin).unwrap();
    let list: String = redis::cmd("CLIENT")
        .arg(&["LIST", "TYPE", kind])
        .query(&mut admin)
        .unwrap();
    list.lines()
        .filter_map(|l| l.strip_prefix("id=")?.split(' ').next()?.parse().ok())
        .filter(|&id| id != own)
        .collect()
}

/// Waits, at most 1 s ([`common::eventually`]), until `done` holds of the normal clients of
/// `server`; whether it did.
async fn wait_for_clients(server: &RedisServer, done: impl Fn(&[i64]) -> bool) -> bool {
    common::eventually(Duration::from_secs(1), || {
        tokio::task::block_in_place(|| done(&clients_of(server, "normal")))
    })
    .await
}

/// Moves `server`'s clock past its idle `timeout` (10 s) and waits until it has closed every
/// normal connection open before (its idle check runs on its clock).
async fn idle_out(server: &RedisServer) {
    let before = tokio::task::block_in_place(|| clients_of(server, "normal"));
    assert!(!before.is_empty());
    server.clock().advance(Duration::from_secs(10));
    let closed = wait_for_clients(server, |ids| !ids.iter().any(|id| before.contains(id))).await;
    assert!(
        closed,
        "the server did not close the idle connections {before:?}"
    );
}

/// One registry call of each kind, each the first after the server closed every normal
/// connection (`CLIENT KILL TYPE normal`) while the registry was idle: the failures among them.
/// The idle time after each close lasts until the registry has a new connection, or 1 s when
/// it makes none (over RESP2 it cannot hear of the close).
async fn registry_after_idle_closes(server: &RedisServer, reg: &RedisRegistry) -> Vec<String> {
    let mut failures = Vec::new();
    for call in ["get", "publish", "list", "announce_reset"] {
        // a working connection to close (after a failed call, the one made to replace it)
        let mut warm = reg.publish("api", &policy()).await;
        for _ in 0..3 {
            if warm.is_ok() {
                break;
            }
            warm = reg.publish("api", &policy()).await;
        }
        warm.unwrap();
        let killed = tokio::task::block_in_place(|| server.kill_clients());
        assert!(killed >= 1, "killed {killed}");
        wait_for_clients(server, |ids| !ids.is_empty()).await;
        let out = match call {
            "get" => reg.get("api").await.map(drop),
            "publish" => reg.publish("api", &policy()).await.map(drop),
            "list" => reg.list().await.map(drop),
            _ => reg.announce_reset("api", "k").await.map(drop),
        };
        if let Err(e) = out {
            failures.push(format!("{call}: {e:?}"));
        }
    }
    failures
}

/// Before the registry spoke RESP3, the first call of each kind after the close failed
/// (`Store(Unavailable { "Redis: I/O error", broken pipe })`) against a healthy Redis: a
/// follower's poll, an operator's `publish`, and a reset's announcement failed for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_survives_an_idle_connection_closed_by_the_server() {
    let server = RedisServer::start();
    let reg = registry(&server.url()).await;
    let failures = registry_after_idle_closes(&server, &reg).await;
    assert!(failures.is_empty(), "registry: {failures:?}");
}

/// The server's own idle-client `timeout` (1 s), reached by moving the server's clock 10 s
/// forward rather than by waiting: the registry's connection is closed (checked), and the
/// next call succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_survives_the_servers_idle_client_timeout() {
    let server = RedisServer::builder()
        .clock_control(true)
        .extra_args(["--timeout", "1"])
        .start();
    let reg = registry(&server.url()).await;
    reg.publish("api", &policy()).await.unwrap();
    idle_out(&server).await;
    let out = reg.get("api").await;
    assert!(
        matches!(out, Ok(Some(_))),
        "registry after the server's idle timeout: {out:?}"
    );
}

/// The registry speaks RESP3 unless its URL's query names a protocol, as the store does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_speaks_resp3_unless_the_url_names_a_protocol() {
    for (query, resp) in [("", "resp=3"), ("?protocol=resp2", "resp=2")] {
        let server = RedisServer::start();
        let reg = registry(&format!("{}{query}", server.url())).await;
        reg.get("api").await.unwrap();
        let mut admin = server.client().get_connection().unwrap();
        let clients: String = redis::cmd("CLIENT")
            .arg(&["LIST", "TYPE", "normal"])
            .query(&mut admin)
            .unwrap();
        let registry_conns: Vec<&str> =
            clients.lines().filter(|l| l.contains("cmd=hget")).collect();
        assert!(
            !registry_conns.is_empty() && registry_conns.iter().all(|l| l.contains(resp)),
            "{query:?}: {clients}"
        );
    }
}

/// A subscription the server closes (`CLIENT KILL TYPE pubsub`) ends — its next notice is
/// `None` — and no longer answers `alive`, so `PolicyFollower` resubscribes; a new
/// subscription hears the next announcement. Over either protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_closed_by_the_server_ends_and_is_not_alive() {
    for query in ["", "?protocol=resp2"] {
        let server = RedisServer::start();
        let reg = registry(&format!("{}{query}", server.url())).await;
        let mut sub = reg.subscribe().await.unwrap();
        assert!(sub.alive().await, "{query:?}");
        assert_eq!(
            reg.announce_reset("api", "k").await.unwrap(),
            1,
            "{query:?}"
        );
        let heard = tokio::time::timeout(REGISTRY_TIMEOUT, sub.next_notice()).await;
        assert!(
            matches!(heard, Ok(Some(Notice::Reset { .. }))),
            "{query:?}: {heard:?}"
        );

        let killed: i64 = redis::cmd("CLIENT")
            .arg(&["KILL", "TYPE", "pubsub"])
            .query(&mut server.client().get_connection().unwrap())
            .unwrap();
        assert_eq!(killed, 1, "{query:?}");
        let ended = tokio::time::timeout(REGISTRY_TIMEOUT, sub.next_notice()).await;
        assert!(matches!(ended, Ok(None)), "{query:?}: {ended:?}");
        assert!(!sub.alive().await, "{query:?}");

        let mut again = reg.subscribe().await.unwrap();
        assert_eq!(
            reg.announce_reset("api", "k2").await.unwrap(),
            1,
            "{query:?}"
        );
        let heard = tokio::time::timeout(REGISTRY_TIMEOUT, again.next_notice()).await;
        assert_eq!(
            heard.ok().flatten(),
            Some(Notice::Reset {
                name: "api".into(),
                key: "k2".into()
            }),
            "{query:?}"
        );
    }
}

/// Subscriptions are exempt from the server's idle `timeout` (Redis 7.0; here over RESP3, the
/// default): one idle past it still hears a publication.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_outlives_the_servers_idle_client_timeout() {
    let server = RedisServer::builder()
        .clock_control(true)
        .extra_args(["--timeout", "1"])
        .start();
    let reg = registry(&server.url()).await;
    let mut sub = reg.subscribe().await.unwrap();
    let subscribed = tokio::task::block_in_place(|| clients_of(&server, "pubsub"));
    assert_eq!(subscribed.len(), 1);
    let before = tokio::task::block_in_place(|| clients_of(&server, "normal"));
    server.clock().advance(Duration::from_secs(10));
    // the registry's normal connection is closed: the server's cron has passed its clients
    let closed = wait_for_clients(&server, |ids| !ids.iter().any(|id| before.contains(id))).await;
    assert!(
        closed,
        "the server did not close the idle connections {before:?}"
    );
    assert_eq!(
        tokio::task::block_in_place(|| clients_of(&server, "pubsub")),
        subscribed
    );
    assert!(sub.alive().await);
    // a new registry, so that this test does not depend on the closed connection's fate
    let publisher = registry(&server.url()).await;
    publisher.publish("api", &policy()).await.unwrap();
    let heard = tokio::time::timeout(REGISTRY_TIMEOUT, sub.next()).await;
    assert_eq!(heard.ok().flatten().as_deref(), Some("api"));
}

/// A registry call made right as the server closes the registry's idle connection — before
/// the close is heard — is not failed: every registry call is safe to repeat, so one that
/// finds its connection dropped is sent once more on the connection made in its place. Before,
/// such a call failed (`Store(Unavailable { "Redis: I/O error", broken pipe })`), as
/// `registry_survives_the_servers_idle_client_timeout` did in CI when the server's close and
/// the call raced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_call_racing_the_servers_close_is_sent_again() {
    let server = RedisServer::start();
    let reg = registry(&server.url()).await;
    reg.publish("api", &policy()).await.unwrap();
    let mut failures = Vec::new();
    // Rounds whose kill found no connection (the registry's had not been made again yet: a
    // CI run saw "round 12: killed 0") race nothing and are not counted; 20 that raced, out of
    // at most 40. Such a round makes a call unraced, so that the registry connects again
    // before the next: skipped with no call, a round left nothing for the next rounds' kills
    // either ("only 2 rounds raced a close", 38 of 40 killing nothing, in a flaky-test hunt).
    let mut raced = 0;
    for round in 0..40 {
        if raced == 20 {
            break;
        }
        let killed = tokio::task::block_in_place(|| server.kill_clients());
        if killed == 0 {
            if let Err(e) = reg.get("api").await {
                failures.push(format!("round {round}, unraced: {e:?}"));
            }
            continue;
        }
        raced += 1;
        // no wait: the call races the close
        let out = match round % 4 {
            0 => reg.get("api").await.map(drop),
            1 => reg.list().await.map(drop),
            2 => reg.publish("api", &policy()).await.map(drop),
            _ => reg.announce_reset("api", "k").await.map(drop),
        };
        if let Err(e) = out {
            failures.push(format!("round {round}: {e:?}"));
        }
    }
    assert!(raced >= 10, "only {raced} rounds raced a close");
    assert!(
        failures.is_empty(),
        "{} of {raced}: {failures:?}",
        failures.len()
    );
}
