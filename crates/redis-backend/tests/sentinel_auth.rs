//! A Sentinel store in front of password-protected data nodes, against real processes (a
//! primary, its replica and 3 sentinels on loopback, then `requirepass` on both data nodes,
//! `masterauth` for their replication and the sentinels' `auth-pass`): with the primary's
//! credentials the store builds, decides on the database it was given and follows a failover
//! to the promoted replica; without them, or with a wrong password, `build` fails loudly (a
//! `Script`-class error that says the authentication failed, never `Unavailable`), and no
//! password shows in the builder's `Debug`.

use std::time::{Duration, Instant};

use tollgate_core::{ErrorClass, Key, Policy, Rate, Store, StoreError};
use tollgate_redis::{RedisStore, RedisStoreBuilder};
use tollgate_testkit::sentinel::SentinelCluster;

const MASTER: &str = "tollgate";
/// The data nodes' `requirepass` (the `default` user's password).
const PASSWORD: &str = "s3cret-primary-pw";
/// An ACL user on both data nodes, for `primary_credentials`.
const USER: &str = "limiter";
const USER_PASSWORD: &str = "s3cret-acl-pw";
const HOUR: Duration = Duration::from_secs(3600);

/// A connection to `server` as the `default` user, authenticated once the password is set.
fn admin(
    server: &tollgate_testkit::server::RedisServer,
    password: Option<&str>,
) -> redis::Connection {
    let mut conn = server.client().get_connection().unwrap();
    if let Some(password) = password {
        redis::cmd("AUTH").arg(password).exec(&mut conn).unwrap();
    }
    conn
}

/// The sentinel topology with both data nodes behind `PASSWORD` (and an ACL user), replication
/// and the sentinels authenticated to them.
fn protected_topology() -> SentinelCluster {
    let topology = SentinelCluster::start(MASTER);
    for server in topology.data_servers() {
        let mut conn = admin(server, None);
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(USER)
            .arg(&["on", &format!(">{USER_PASSWORD}"), "~*", "&*", "+@all"])
            .exec(&mut conn)
            .unwrap();
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("masterauth")
            .arg(PASSWORD)
            .exec(&mut conn)
            .unwrap();
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("requirepass")
            .arg(PASSWORD)
            .exec(&mut conn)
            .unwrap();
    }
    for sentinel in topology.sentinels() {
        redis::cmd("SENTINEL")
            .arg("SET")
            .arg(MASTER)
            .arg("auth-pass")
            .arg(PASSWORD)
            .exec(&mut admin(sentinel, None))
            .unwrap();
    }
    // The data nodes now refuse an unauthenticated caller.
    let err = redis::cmd("GET")
        .arg("x")
        .exec(
            &mut topology.data_servers()[0]
                .client()
                .get_connection()
                .unwrap(),
        )
        .unwrap_err();
    assert_eq!(err.code(), Some("NOAUTH"), "{err}");
    topology
}

fn sentinel(topology: &SentinelCluster) -> RedisStoreBuilder {
    RedisStore::sentinel(MASTER, topology.sentinel_urls()).timeout(Duration::from_secs(2))
}

fn key() -> Key {
    Key::new("sentinel-auth", ["alice"]).unwrap()
}

fn policy() -> Policy {
    Policy::token_bucket(10, Rate::new(1, HOUR)).unwrap()
}

/// How many keys database `db` of data server `index` holds.
fn dbsize(topology: &SentinelCluster, index: usize, db: i64) -> i64 {
    let mut conn = admin(&topology.data_servers()[index], Some(PASSWORD));
    redis::cmd("SELECT").arg(db).exec(&mut conn).unwrap();
    redis::cmd("DBSIZE").query(&mut conn).unwrap()
}

fn assert_refused(err: &StoreError, what: &str) {
    assert_eq!(
        err.class(),
        ErrorClass::Script,
        "{what}: a misconfiguration, not an outage: {err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("authentication") && message.contains("primary_password"),
        "{what}: the message says the authentication failed and how to give the credentials: {message}"
    );
}

#[tokio::test]
async fn a_password_protected_primary_needs_its_credentials() {
    let topology = protected_topology();

    // Without the primary's credentials: a loud, clear error.
    let err = sentinel(&topology).build().await.unwrap_err();
    assert_refused(&err, "no credentials");
    println!("without credentials: {err}");
    let err = sentinel(&topology)
        .primary_password("wrong")
        .build()
        .await
        .unwrap_err();
    assert_refused(&err, "a wrong password");
    println!("with a wrong password: {err}");

    // With them, the store builds and decides.
    let builder = sentinel(&topology).primary_password(PASSWORD);
    let shown = format!("{builder:?}");
    assert!(
        !shown.contains(PASSWORD),
        "Debug shows the password: {shown}"
    );
    let store = builder
        .build()
        .await
        .expect("build with the primary's password");
    let d = store.acquire(&key(), &policy(), 3).await.unwrap();
    assert!(d.allowed && d.remaining == 7, "{d:?}");
    assert_eq!(store.peek(&key(), &policy(), 1).await.unwrap().remaining, 6);
    assert_eq!(dbsize(&topology, 0, 0), 1, "the bucket is in database 0");

    // An ACL user and another database.
    let builder = sentinel(&topology)
        .primary_credentials(USER, USER_PASSWORD)
        .primary_db(3)
        .prefix("acl-user:");
    let shown = format!("{builder:?}");
    assert!(
        !shown.contains(USER_PASSWORD) && shown.contains(USER),
        "Debug shows the password, or not the user: {shown}"
    );
    let store = builder.build().await.expect("build as the ACL user");
    let d = store.acquire(&key(), &policy(), 1).await.unwrap();
    assert!(d.allowed && d.remaining == 9, "{d:?}");
    assert_eq!(dbsize(&topology, 0, 3), 1, "the bucket is in database 3");
    assert_eq!(
        dbsize(&topology, 0, 0),
        1,
        "database 0 holds only the first bucket"
    );
    let err = sentinel(&topology)
        .primary_credentials(USER, "wrong")
        .build()
        .await
        .unwrap_err();
    assert_refused(&err, "an ACL user with a wrong password");
}

/// The credentials apply to the replica the sentinels promote: after the primary is killed,
/// the store finds the new primary and authenticates to it by itself.
#[tokio::test]
async fn the_credentials_follow_a_failover() {
    let mut topology = protected_topology();
    let store = sentinel(&topology)
        .primary_password(PASSWORD)
        .build()
        .await
        .expect("build with the primary's password");
    assert!(store.acquire(&key(), &policy(), 1).await.unwrap().allowed);

    assert_eq!(topology.kill_primary(), 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    let decided = loop {
        match store.acquire(&key(), &policy(), 1).await {
            Ok(d) => break d,
            Err(e) => {
                assert_eq!(
                    e.class(),
                    ErrorClass::Unavailable,
                    "during the failover: {e}"
                );
                assert!(
                    Instant::now() < deadline,
                    "no decision within 30 s of the kill: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(decided.allowed, "{decided:?}");
    assert_eq!(topology.current_primary_index(), 1);
    assert_eq!(
        dbsize(&topology, 1, 0),
        1,
        "the promoted replica holds the bucket"
    );
}
