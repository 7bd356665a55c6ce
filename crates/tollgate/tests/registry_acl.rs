//! docs/security.md's registry rights, each role set up as an ACL user on a real redis-server
//! and exercised: publishing (through the missing-script reload), following (a publication
//! switches it; its subscription's PING checks answered), listing, and a follower's reset
//! announcement. The server's ACL LOG stays empty: no command the roles need is missing.
//! (Written from a review's probe, which passed.)

use std::sync::Arc;
use std::time::Duration;

use tollgate::redis::{Published, RedisRegistry};
use tollgate::registry::PolicyFollower;
use tollgate::{FailureMode, Limiter, LocalStore, Policy};
use tollgate_testkit::server::RedisServer;
use tollgate_testkit::wait::eventually;

const TIMEOUT: Duration = Duration::from_secs(2);
const PW: &str = "pw-for-tests";

fn admin(server: &RedisServer) -> redis::Connection {
    server.client().get_connection().unwrap()
}

fn set_user(server: &RedisServer, user: &str, rules: &str) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER")
        .arg(user)
        .arg("reset")
        .arg("on")
        .arg(format!(">{PW}"));
    for r in rules.split_whitespace() {
        cmd.arg(r);
    }
    cmd.exec(&mut admin(server)).unwrap();
}

fn acl_log(server: &RedisServer) -> Vec<String> {
    let entries: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query(&mut admin(server))
        .unwrap();
    entries.into_iter().map(|e| format!("{e:?}")).collect()
}

fn url(server: &RedisServer, user: &str) -> String {
    format!("redis://{user}:{PW}@127.0.0.1:{}", server.port())
}

async fn registry(server: &RedisServer, user: &str) -> RedisRegistry {
    RedisRegistry::connect(&url(server, user), "tollgate:", TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{user}: connect: {e}"))
}

fn spec(text: &str) -> Policy {
    text.parse().unwrap()
}

fn limiter(policy: Policy) -> Limiter {
    Limiter::builder("api", policy)
        .store(Arc::new(LocalStore::new()))
        .failure_mode(FailureMode::Closed)
        .build()
        .unwrap()
}

/// The documented rights (docs/security.md, the registry table) for each role.
const PUBLISHER: &str =
    "~tollgate:* resetchannels &tollgate:registry -@all +evalsha +script|load +hget +hset +publish";
const FOLLOWER: &str = "~tollgate:* resetchannels &tollgate:registry -@all +hget +subscribe +ping";
const LISTER: &str =
    "~tollgate:* resetchannels &tollgate:registry -@all +hget +subscribe +ping +hgetall";
const RESETTER: &str =
    "~tollgate:* resetchannels &tollgate:registry -@all +hget +subscribe +ping +publish";

#[tokio::test]
async fn the_registry_works_under_the_documented_rights() {
    let server = RedisServer::start();
    set_user(&server, "publisher", PUBLISHER);
    set_user(&server, "follower", FOLLOWER);
    set_user(&server, "lister", LISTER);
    set_user(&server, "resetter", RESETTER);

    let g1 = spec("fixed-window:limit=10,window=1m,generation=1,transition=carry");
    let g2 = spec("fixed-window:limit=5,window=1m,generation=2,transition=carry");

    let publisher = registry(&server, "publisher").await;
    assert_eq!(
        publisher
            .publish("api", &g1)
            .await
            .expect("publish under the publisher's rights"),
        Published::Stored
    );

    // A follower under its documented rights.
    let l = limiter(spec("fixed-window:limit=10,window=1m"));
    let follower = PolicyFollower::start(
        registry(&server, "follower").await,
        "api",
        std::slice::from_ref(&l),
        Duration::from_millis(100),
    )
    .await
    .expect("a follower under its documented rights starts");
    assert_eq!(l.policy(), g1);

    assert_eq!(
        publisher.publish("api", &g2).await.unwrap(),
        Published::Stored
    );
    assert!(
        eventually(Duration::from_secs(3), || l.policy() == g2).await,
        "the follower switched to generation 2: {}",
        l.policy()
    );
    // Polls with a live subscription check it with PING: wait for a few of them.
    let pings = ping_calls(&server);
    assert!(
        eventually(Duration::from_secs(3), || ping_calls(&server) >= pings + 2).await,
        "the follower checked its subscription"
    );

    // Listing under the documented rights.
    let lister = registry(&server, "lister").await;
    let listed = lister.list().await.expect("list under +hgetall");
    assert_eq!(listed.len(), 1);

    // A follower that resets keys: also +publish.
    let rl = limiter(spec("fixed-window:limit=10,window=1m"));
    let resetting = PolicyFollower::start(
        registry(&server, "resetter").await,
        "api",
        std::slice::from_ref(&rl),
        Duration::from_millis(100),
    )
    .await
    .unwrap();
    resetting
        .reset(&rl, ["k"])
        .await
        .expect("reset + announce under +publish");

    drop(follower);
    drop(resetting);
    let log = acl_log(&server);
    assert!(
        log.is_empty(),
        "commands refused under the documented rights: {log:#?}"
    );
}

/// PING calls the server has executed (INFO commandstats).
fn ping_calls(server: &RedisServer) -> u64 {
    server.command_stats(&["ping"]).calls
}
