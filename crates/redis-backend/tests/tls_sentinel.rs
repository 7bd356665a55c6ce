//! A Sentinel store whose data nodes are reached over TLS: the sentinel monitors the nodes'
//! TLS ports (`tls-replication yes`), and `primary_tls()` makes the store connect to the
//! address it reports over verified TLS, before and after a failover.
//!
//! One test, because the trusted roots come from the process-wide `SSL_CERT_FILE`.
#![cfg(feature = "tls")]
#![allow(unsafe_code)] // set_var before any other thread reads the environment

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::until;

use tollgate_core::{ErrorClass, Key, Policy, Rate, Store};
use tollgate_redis::RedisStore;
use tollgate_testkit::server::RedisServer;
use tollgate_testkit::tls;

const MASTER: &str = "tls-primary";
const HOST: &str = "127.0.0.1";

/// A data node listening on a plain port (for the test's own probes) and on a TLS port,
/// replicating over TLS and announcing its TLS port, so the sentinel reports that one.
fn data_node(d: &Path, replica_of: Option<u16>) -> (RedisServer, u16) {
    let port = tls::free_port();
    let mut args = tls::server_args(d, port, "node", "ca");
    for arg in [
        "--tls-replication",
        "yes",
        "--repl-diskless-sync-delay",
        "0",
        "--replica-announce-ip",
        HOST,
        "--replica-announce-port",
    ] {
        args.push(arg.to_owned());
    }
    args.push(port.to_string());
    if let Some(primary) = replica_of {
        args.extend([
            "--replicaof".to_owned(),
            HOST.to_owned(),
            primary.to_string(),
        ]);
    }
    // a config file lets Sentinel's CONFIG REWRITE after a failover succeed
    let server = RedisServer::builder()
        .config_file("")
        .extra_args(args)
        .start();
    (server, port)
}

fn query<T: redis::FromRedisValue>(server: &RedisServer, cmd: &redis::Cmd) -> Option<T> {
    let mut conn = server
        .client()
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()?;
    cmd.query(&mut conn).ok()
}

/// The port the sentinel reports for the primary.
fn reported_primary(sentinel: &RedisServer) -> Option<u16> {
    let (_, port): (String, u16) = query(
        sentinel,
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(MASTER),
    )?;
    Some(port)
}

/// A primary and its replica over TLS, and a sentinel monitoring the primary's TLS port,
/// once the replica is in sync and the sentinel knows it: (primary, replica, the replica's
/// TLS port, sentinel).
fn topology(d: &Path) -> (RedisServer, RedisServer, u16, RedisServer) {
    let (primary, primary_tls) = data_node(d, None);
    let (replica, replica_tls) = data_node(d, Some(primary_tls));
    until(
        Duration::from_secs(10),
        "the replica syncs over TLS",
        || {
            query::<String>(&replica, redis::cmd("INFO").arg("replication"))
                .is_some_and(|info| info.contains("master_link_status:up"))
        },
    );
    let path = |f: &str| d.join(f).to_string_lossy().into_owned();
    let sentinel = RedisServer::builder()
        .config_file(format!(
            "sentinel monitor {MASTER} {HOST} {primary_tls} 1\n\
             sentinel down-after-milliseconds {MASTER} 1000\n\
             sentinel failover-timeout {MASTER} 3000\n\
             tls-replication yes\n\
             tls-cert-file {}\n\
             tls-key-file {}\n\
             tls-ca-cert-file {}\n",
            path("node.pem"),
            path("node.key"),
            path("ca.pem"),
        ))
        .extra_args(["--sentinel"])
        .start();
    until(
        Duration::from_secs(15),
        "the sentinel knows the replica's TLS port",
        || {
            query::<Vec<Vec<String>>>(
                &sentinel,
                redis::cmd("SENTINEL").arg("replicas").arg(MASTER),
            )
            .is_some_and(|replicas| {
                replicas.iter().any(|fields| {
                    fields
                        .windows(2)
                        .any(|kv| kv[0] == "port" && kv[1] == replica_tls.to_string())
                })
            })
        },
    );

    (primary, replica, replica_tls, sentinel)
}

#[test]
fn a_sentinel_store_reaches_tls_data_nodes_before_and_after_a_failover() {
    let certs = tempfile::tempdir().unwrap();
    let d = certs.path();
    tls::make_loopback_certs(d, "node");
    // SAFETY: no other thread exists yet in this test binary's only test.
    unsafe { std::env::set_var("SSL_CERT_FILE", d.join("ca.pem")) };

    let (primary, replica, replica_tls, sentinel) = topology(d);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // A token bucket refilling one token an hour: no whole token within the test, failover
        // included (an hour's fixed window, aligned to the epoch on Redis's real clock,
        // restarted at the top of the hour and broke the count of a run that crossed it).
        let p = Policy::token_bucket(10, Rate::new(1, Duration::from_secs(3600))).unwrap();
        let k = Key::global("sentinel-tls");
        let store = RedisStore::sentinel(MASTER, [sentinel.url()])
            .primary_tls()
            .timeout(Duration::from_secs(2))
            .build()
            .await
            .expect("a Sentinel store over TLS");
        assert_eq!(store.acquire(&k, &p, 1).await.unwrap().remaining, 9);

        // Without TLS the store cannot use the port the sentinel reports: it speaks only TLS.
        let plain = RedisStore::sentinel(MASTER, [sentinel.url()])
            .timeout(Duration::from_millis(500))
            .connect_timeout(Duration::from_millis(500))
            .build()
            .await;
        let refused = match plain {
            Ok(plain) => plain.acquire(&k, &p, 1).await.unwrap_err(),
            Err(e) => e,
        };
        assert_eq!(refused.class(), ErrorClass::Unavailable, "{refused}");

        // The bucket reaches the replica, then the sentinel promotes it.
        // (WAIT on a connection of the test's own would not wait for the store's write.)
        until(
            Duration::from_secs(5),
            "the bucket reaches the replica",
            || query::<i64>(&replica, &redis::cmd("DBSIZE")) == Some(1),
        );
        // Refused (NOGOODSLAVE) until the sentinel has a fresh view of the replica's link.
        until(
            Duration::from_secs(15),
            "SENTINEL FAILOVER accepted",
            || {
                query::<String>(
                    &sentinel,
                    redis::cmd("SENTINEL").arg("failover").arg(MASTER),
                )
                .is_some()
            },
        );
        let role = |server: &RedisServer| {
            query::<Vec<redis::Value>>(server, &redis::cmd("ROLE"))
                .and_then(|role| redis::from_redis_value::<String>(role.first()?.clone()).ok())
        };
        // Until the sentinel has turned the old primary into a replica, it still takes
        // writes, which its resync then drops (asynchronous replication: see the README);
        // the test waits that window out.
        until(
            Duration::from_secs(15),
            "the sentinel swaps the roles",
            || {
                reported_primary(&sentinel) == Some(replica_tls)
                    && role(&replica).as_deref() == Some("master")
                    && role(&primary).as_deref() == Some("slave")
            },
        );

        // The store follows over TLS: the next decisions come from the new primary, which
        // holds the bucket (a call or two may meet the old primary, now read-only, first).
        let start = Instant::now();
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
        assert_eq!(d.remaining, 8, "the replicated bucket, on the new primary");
        assert_eq!(
            query::<i64>(&replica, &redis::cmd("DBSIZE")),
            Some(1),
            "written on the promoted replica"
        );
    });
    drop(primary);
}
