//! The server closes the store's connection while no call is in flight (Redis's idle-client
//! `timeout`, `CLIENT KILL`, a load balancer's idle cut). Redis is up and answering all along,
//! so no later call may fail as unavailable: that would apply the operation's failure mode
//! (fail open, closed or degraded) against a healthy shared store. Before the store spoke
//! RESP3 (over which redis-rs reports the close), the next call on each closed connection
//! failed with `Unavailable { "Redis: I/O error", broken pipe }` on every connection kind.

use std::time::Duration;

use tollgate_core::{Key, Policy, Rate, Store, StoreError};
use tollgate_redis::RedisStore;
use tollgate_testkit::server::RedisServer;

fn policy() -> Policy {
    Policy::token_bucket(1_000_000, Rate::per_second(1000)).unwrap()
}

fn key(i: usize) -> Key {
    Key::new("idle", [format!("k{i}")]).unwrap()
}

/// Closes every normal client connection of `server` except the caller's.
fn kill_clients(server: &RedisServer) -> i64 {
    let mut admin = server.client().get_connection().unwrap();
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query(&mut admin)
        .unwrap()
}

/// One warm-up call, every connection closed by the server, 300 ms idle, then 8 calls: the
/// failures among them.
async fn after_an_idle_close(server: &RedisServer, store: &RedisStore) -> Vec<StoreError> {
    store.acquire(&key(0), &policy(), 1).await.unwrap();
    let killed = tokio::task::block_in_place(|| kill_clients(server));
    assert!(killed >= 1, "killed {killed}");
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

/// The most common trigger: Redis's own idle-client `timeout` (1 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_store_survives_the_servers_idle_client_timeout() {
    let server = RedisServer::builder()
        .extra_args(["--timeout", "1"])
        .start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .pool(4)
        .build()
        .await
        .unwrap();
    store.acquire(&key(0), &policy(), 1).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
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
