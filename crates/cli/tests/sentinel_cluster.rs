//! `tollgate check|load|policy|serve` with `--sentinel … --master` and with `--cluster`, as a user
//! runs them: the built binary against real processes (a primary, its replica and 3
//! sentinels; a 3-primary Cluster) on loopback. Each command decides on, or publishes to, the
//! Redis that `--redis` on the same server sees: one quota, one registry.

use std::process::{Command, Output};

use reqwest::StatusCode;
use tollgate_testkit::cluster::RedisCluster;
use tollgate_testkit::sentinel::SentinelCluster;

mod common;
use common::{Serve, client, json, write_config};

const MASTER: &str = "tollgate";
/// An ACL user on both data nodes, for `--primary-user`.
const USER: &str = "limiter";
const USER_PASSWORD: &str = "s3cret-acl-pw";
/// Two admissions per key for an hour: the third call on a key is denied.
const TWO_AN_HOUR: &str = "token-bucket:capacity=2,rate=2,period=1h";

fn tollgate(args: &[&str], password: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command.args(args).env_remove("TOLLGATE_PRIMARY_PASSWORD");
    if let Some(password) = password {
        command.env("TOLLGATE_PRIMARY_PASSWORD", password);
    }
    command.output().expect("the tollgate binary runs")
}

fn failure(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure: {out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `tollgate load` from two instances (4 tasks each) over 50 keys, 400 requests of
/// [`TWO_AN_HOUR`], on `target`: its summary, once asserted exact (2 admissions per key, every
/// other request denied, no errors).
fn load_two_instances(target: &[&str], password: Option<&str>) -> serde_json::Value {
    let load = [
        "load",
        "--policy",
        TWO_AN_HOUR,
        "--instances",
        "2",
        "--tasks",
        "4",
        "--keys",
        "50",
        "--requests",
        "400",
        "--json",
    ];
    let summary = json(&tollgate(&with(&load, target), password));
    assert_eq!(summary["errors"], 0, "{summary}");
    assert_eq!(summary["allowed"], 100, "{summary}");
    assert_eq!(summary["denied"], 300, "{summary}");
    summary
}

/// `args` followed by `extra`.
fn with<'a>(args: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    args.iter().chain(extra).copied().collect()
}

#[test]
fn sentinel_flags_reach_the_primary_with_its_credentials_and_database() {
    let topology = SentinelCluster::start(MASTER);
    for server in topology.data_servers() {
        let mut conn = server.client().get_connection().unwrap();
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(USER)
            .arg(&["on", &format!(">{USER_PASSWORD}"), "~*", "&*", "+@all"])
            .exec(&mut conn)
            .unwrap();
    }
    let sentinels = topology.sentinel_urls().join(",");
    let target = [
        "--sentinel",
        &sentinels,
        "--master",
        MASTER,
        "--primary-user",
        USER,
        "--primary-db",
        "3",
    ];
    // The same server's database 3, named directly.
    let direct = format!("redis://127.0.0.1:{}/3", topology.primary_port());

    // A registry publication lands in the primary's database 3 and reads back either way.
    let published = json(&tollgate(
        &with(
            &["policy", "publish", "--name", "login", "--policy"],
            &with(
                &["token-bucket:capacity=5,rate=1,generation=1,transition=reset"],
                &target,
            ),
        ),
        Some(USER_PASSWORD),
    ));
    assert_eq!(published["published"], true);
    let shown = json(&tollgate(
        &["policy", "show", "--redis", &direct, "--name", "login"],
        None,
    ));
    assert_eq!(shown[0]["generation"], 1);
    let shown = json(&tollgate(
        &with(&["policy", "show", "--name", "login"], &target),
        Some(USER_PASSWORD),
    ));
    assert_eq!(shown[0]["limit"], 5);

    // Decisions through the sentinels and on the server directly share one bucket.
    let check = ["check", "--policy", TWO_AN_HOUR, "--key", "user:1"];
    let first = json(&tollgate(&with(&check, &target), Some(USER_PASSWORD)));
    assert_eq!(first["allowed"], true);
    assert_eq!(first["store"], "sentinel");
    let second = json(&tollgate(&with(&check, &["--redis", &direct]), None));
    assert_eq!(
        (second["allowed"].clone(), second["remaining"].clone()),
        (true.into(), 0.into())
    );
    let third = json(&tollgate(&with(&check, &target), Some(USER_PASSWORD)));
    assert_eq!(third["allowed"], false, "{third}");

    // Two instances of `load` through the sentinels: exactly two admissions per key.
    let summary = load_two_instances(&target, Some(USER_PASSWORD));
    assert_eq!(summary["store"], "sentinel");

    // The credentials are the ones given: a wrong password, or none, is refused loudly.
    let wrong = failure(&tollgate(&with(&check, &target), Some("not-it")));
    assert!(
        wrong.contains("WRONGPASS") || wrong.contains("auth"),
        "{wrong}"
    );
    let missing = failure(&tollgate(&with(&check, &target), None));
    assert!(missing.contains("TOLLGATE_PRIMARY_PASSWORD"), "{missing}");
    // Nothing names the password.
    assert!(
        !wrong.contains(USER_PASSWORD) && !wrong.contains("not-it"),
        "{wrong}"
    );
}

#[test]
fn cluster_flags_decide_and_publish_on_the_cluster() {
    let cluster = RedisCluster::start(3);
    let urls = cluster.urls();
    // the nodes repeated as flags and joined by commas: both forms are accepted
    let target = ["--cluster", &urls[0], "--cluster", &urls[1..].join(",")];

    let check = ["check", "--policy", TWO_AN_HOUR, "--key", "user:7"];
    let answers: Vec<bool> = (0..3)
        .map(|_| {
            let out = json(&tollgate(&with(&check, &target), None));
            assert_eq!(out["store"], "cluster");
            out["allowed"].as_bool().unwrap()
        })
        .collect();
    assert_eq!(answers, [true, true, false]);

    // 50 keys over the three nodes' slots, two instances: exactly two admissions per key.
    let summary = load_two_instances(&target, None);
    assert_eq!(summary["store"], "cluster");
    // the keys really are spread: each node holds some of the buckets
    for (i, node) in cluster.nodes().iter().enumerate() {
        let mut conn = node.client().get_connection().unwrap();
        let keys: i64 = redis::cmd("DBSIZE").query(&mut conn).unwrap();
        assert!(keys > 0, "node {i} holds no bucket");
    }

    let published = json(&tollgate(
        &with(
            &[
                "policy",
                "publish",
                "--name",
                "search",
                "--policy",
                "sliding-log:limit=5,window=10s",
            ],
            &target,
        ),
        None,
    ));
    assert_eq!(published["published"], true);
    let shown = json(&tollgate(
        &with(
            &["policy", "show", "--name", "search"],
            &["--cluster", &urls[2]],
        ),
        None,
    ));
    assert_eq!(shown[0]["algorithm"], "sliding_log");
}

/// A route that admits 3 requests an hour.
const ROUTE: &str = r#"
[[route]]
name = "quota"
path = "/quota"
key = "route"
policy = "token-bucket:capacity=3,rate=3,period=1h"
failure_mode = "closed"
"#;

#[tokio::test]
async fn serve_through_sentinels_and_on_the_primary_enforce_one_quota() {
    let topology = SentinelCluster::start(MASTER);
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), ROUTE);
    let sentinels = topology.sentinel_urls().join(",");
    let primary = format!("redis://127.0.0.1:{}", topology.primary_port());
    let a = Serve::start(&[
        "--config",
        &config,
        "--sentinel",
        &sentinels,
        "--master",
        MASTER,
    ]);
    let b = Serve::start(&["--config", &config, "--redis", &primary]);
    let http = client();
    let mut statuses = Vec::new();
    for i in 0..6 {
        let server = if i % 2 == 0 { &a } else { &b };
        statuses.push(
            http.get(server.url("/quota"))
                .send()
                .await
                .unwrap()
                .status(),
        );
    }
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let denied = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((admitted, denied), (3, 3), "{statuses:?}");
}

#[test]
fn one_kind_of_redis_at_a_time() {
    let check = ["check", "--policy", TWO_AN_HOUR, "--key", "user:1"];
    for extra in [
        &[
            "--redis",
            "redis://127.0.0.1:1",
            "--cluster",
            "redis://127.0.0.1:2",
        ][..],
        &["--sentinel", "redis://127.0.0.1:1"],
        &["--master", "m"],
        &["--cluster", "redis://127.0.0.1:1", "--primary-db", "1"],
        &[
            "--sentinel",
            "redis://127.0.0.1:1",
            "--master",
            "m",
            "--pool",
            "2",
        ],
        &["--cluster", "redis://127.0.0.1:1", "--multiplexed"],
        &["--prefix", "p:"],
    ] {
        let out = tollgate(&with(&check, extra), None);
        assert_eq!(out.status.code(), Some(2), "{extra:?} was accepted");
    }
    let out = tollgate(&["policy", "show"], None);
    assert_eq!(out.status.code(), Some(2), "a registry with no Redis");
    for probe in ["--ping", "--bare-script", "--compare-redis-benchmark"] {
        let out = tollgate(
            &[
                "load",
                "--policy",
                TWO_AN_HOUR,
                "--requests",
                "1",
                "--cluster",
                "redis://127.0.0.1:1",
                probe,
            ],
            None,
        );
        assert_eq!(out.status.code(), Some(2), "{probe} on a Cluster");
    }
}
