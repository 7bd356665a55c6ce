//! `RedisStore::connect_all` on a pool: every connection made and answering, a refused
//! connect reported at once, and connections the server closed replaced rather than reported;
//! on a store built lazily (multiplexed, Sentinel): its connection made, or an outage reported.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::Server;
use tollgate_core::{ErrorClass, Key, Policy, Rate, Store};
use tollgate_redis::RedisStore;

/// The `CLIENT LIST TYPE normal` lines of the server on `port`, but the one asking's.
fn normal_clients(port: u16) -> Vec<String> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut conn = client.get_connection().unwrap();
    let me: i64 = redis::cmd("CLIENT").arg("ID").query(&mut conn).unwrap();
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("normal")
        .query(&mut conn)
        .unwrap();
    let mine = format!("id={me} ");
    list.lines()
        .filter(|line| !line.starts_with(&mine))
        .map(str::to_owned)
        .collect()
}

/// The ids of the server's normal clients but the one asking.
fn clients(server: &Server) -> BTreeSet<i64> {
    normal_clients(server.port())
        .iter()
        .filter_map(|line| line.strip_prefix("id=")?.split(' ').next()?.parse().ok())
        .collect()
}

/// `connect_all`, bounded by twice the connect timeout the tests build with, and how long it
/// took.
async fn timed_connect_all(
    store: &RedisStore,
) -> (Result<(), tollgate_core::StoreError>, Duration) {
    let started = Instant::now();
    let out = tokio::time::timeout(CONNECT_TIMEOUT * 2, store.connect_all())
        .await
        .expect("connect_all is bounded by the connect timeout");
    (out, started.elapsed())
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

fn policy() -> Policy {
    Policy::token_bucket(100, Rate::new(1, Duration::from_secs(3600))).unwrap()
}

#[tokio::test]
async fn every_pooled_connection_is_made_and_answers() {
    let server = Server::start();
    let store = server.pooled(4).await;
    assert_eq!(clients(&server).len(), 1, "build made one connection");
    let (out, _) = timed_connect_all(&store).await;
    out.unwrap();
    assert_eq!(clients(&server).len(), 4, "a pool of 4");
}

/// A connect the server refuses fails `connect_all` at once with its error, as it fails a call
/// waiting for a connection. Before, `connect_all` waited the whole connect timeout for the
/// connects it had asked for, and then reported whichever timer fired first: the refusal, or
/// (1 run in 20 with a 100 ms connect timeout) "timed out connecting every pooled
/// connection", an outage, for a wrong password (here: 5.0 s, the whole connect timeout, for
/// the `WRONGPASS` the next call reports in a millisecond).
#[tokio::test]
async fn a_refused_connect_fails_connect_all_at_once_with_its_error() {
    let server = Server::start();
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("pooled")
        .arg("on")
        .arg(">before")
        .arg("~*")
        .arg("+@all")
        .query(&mut server.conn())
        .unwrap();
    let store = RedisStore::builder(format!("redis://pooled:before@127.0.0.1:{}", server.port()))
        .connect_timeout(CONNECT_TIMEOUT)
        .pool(4)
        .build()
        .await
        .unwrap();
    // the password changes: the pool's one connection stays, every new one is refused
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("pooled")
        .arg("resetpass")
        .arg(">after")
        .query(&mut server.conn())
        .unwrap();
    let (out, took) = timed_connect_all(&store).await;
    let err = out.expect_err("the new connections are refused");
    assert!(
        took < CONNECT_TIMEOUT / 2,
        "connect_all took {took:?} (connect timeout {CONNECT_TIMEOUT:?}) to report {err:?}"
    );
    assert!(
        err.class() != ErrorClass::Unavailable && err.to_string().contains("WRONGPASS"),
        "a wrong password is reported as one, not as an outage: {err:?}"
    );
}

/// Connections the server closed while they sat idle in the pool are replaced, as a call
/// replaces them. Before, `connect_all` sent its `PING` on them and failed with
/// `Unavailable { "Redis: I/O error", broken pipe }` against a healthy server.
#[tokio::test]
async fn connections_the_server_closed_are_replaced() {
    let server = Server::start();
    let store = server.pooled(4).await;
    timed_connect_all(&store).await.0.unwrap();
    let before = clients(&server);
    assert_eq!(before.len(), 4);
    let killed = server.0.kill_clients();
    assert!(killed >= 4, "killed {killed}");
    let (out, _) = timed_connect_all(&store).await;
    out.expect("the closed connections are replaced");
    let after = clients(&server);
    assert_eq!(after.len(), 4, "a pool of 4 again: {after:?}");
    assert!(after.is_disjoint(&before), "{before:?} -> {after:?}");
    let key = Key::new("connect-all", ["k"]).unwrap();
    store.acquire(&key, &policy(), 1).await.unwrap();
    assert_eq!(clients(&server), after, "the call used the new connections");
}

/// On a store built lazily ([`build_lazy`](tollgate_redis::RedisStoreBuilder::build_lazy)),
/// whose multiplexed connection connects on its first call, `connect_all` makes it. Before,
/// it returned `Ok` and made nothing (0 connections after it), and returned `Ok` for a server
/// that was not there: only `build` connects the multiplexed connection, as its rustdoc
/// assumed.
#[tokio::test]
async fn a_lazily_built_multiplexed_store_connects() {
    let server = Server::start();
    let store = RedisStore::builder(server.url())
        .connect_timeout(CONNECT_TIMEOUT)
        .multiplexed()
        .build_lazy()
        .await
        .unwrap();
    assert!(clients(&server).is_empty(), "lazy: nothing connected yet");
    timed_connect_all(&store).await.0.unwrap();
    assert_eq!(clients(&server).len(), 1, "the multiplexed connection");

    let port = server.port();
    drop(server);
    let gone = RedisStore::builder(format!("redis://127.0.0.1:{port}"))
        .connect_timeout(CONNECT_TIMEOUT)
        .multiplexed()
        .build_lazy()
        .await
        .unwrap();
    let (out, _) = timed_connect_all(&gone).await;
    let err = out.expect_err("no server on the port");
    assert_eq!(err.class(), ErrorClass::Unavailable, "{err:?}");
}

/// The normal clients connected to `port` but the one asking and the sentinels' (each
/// sentinel names its connections `sentinel-<id>-cmd`); a replica's link is not `normal`.
fn store_clients_on(port: u16) -> usize {
    normal_clients(port)
        .iter()
        .filter(|line| {
            !line
                .split(' ')
                .any(|field| field.starts_with("name=sentinel-"))
        })
        .count()
}

/// A Sentinel store built lazily asks the sentinels for the primary and connects to it in
/// `connect_all`, as a multiplexed one does; before `connect_all` nothing is connected to the
/// primary but the sentinels. With every sentinel gone, `connect_all` fails as unavailable
/// within its bound instead of returning `Ok`.
#[tokio::test]
async fn a_lazily_built_sentinel_store_connects_to_the_primary() {
    let mut topology = tollgate_testkit::sentinel::SentinelCluster::start("connect-all");
    let primary = topology.primary_port();
    let lazy = || {
        RedisStore::sentinel(topology.master_name(), topology.sentinel_urls())
            .connect_timeout(CONNECT_TIMEOUT)
            .build_lazy()
    };
    let store = lazy().await.unwrap();
    assert_eq!(store_clients_on(primary), 0, "lazy: nothing connected yet");
    timed_connect_all(&store).await.0.unwrap();
    assert!(
        store_clients_on(primary) >= 1,
        "connect_all connected to the primary"
    );
    let key = Key::new("connect-all", ["sentinel"]).unwrap();
    assert!(store.acquire(&key, &policy(), 1).await.unwrap().allowed);

    let gone = lazy().await.unwrap();
    for i in 0..topology.sentinels().len() {
        topology.sentinel_mut(i).kill();
    }
    let (out, took) = timed_connect_all(&gone).await;
    let err = out.expect_err("no sentinel answers");
    assert_eq!(err.class(), ErrorClass::Unavailable, "{err:?}");
    assert!(took <= CONNECT_TIMEOUT + Duration::from_secs(1), "{took:?}");
}
