//! `tollgate policy publish|show` as a user runs it: the built binary against a real
//! redis-server.

use std::process::{Command, Output};

use tollgate_testkit::server::RedisServer;

mod common;
use common::json;

/// A `check` of one key under a small token bucket, for tests that add flags to it.
const CHECK: [&str; 5] = [
    "check",
    "--policy",
    "token-bucket:capacity=10,rate=2",
    "--key",
    "user:1",
];

fn tollgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .expect("the tollgate binary runs")
}

#[test]
fn publish_and_show_through_the_binary() {
    let server = RedisServer::start();
    let url = server.url();
    let publish = |name: &str, policy: &str| {
        tollgate(&[
            "policy", "publish", "--redis", &url, "--name", name, "--policy", policy,
        ])
    };
    let out = json(&publish(
        "login",
        "token-bucket:capacity=10,rate=2,generation=1,transition=reset",
    ));
    assert_eq!(out["published"], true);
    assert_eq!(out["generation"], 1);
    let out = json(&publish(
        "login",
        "token-bucket:capacity=20,rate=2,generation=2,transition=proportional",
    ));
    assert_eq!(out["transition"], "proportional");
    json(&publish("search", "sliding-log:limit=5,window=10s"));

    // Going back a generation is refused, and so is a generation without a rule.
    let stale = publish(
        "login",
        "token-bucket:capacity=99,rate=2,generation=1,transition=carry",
    );
    assert!(!stale.status.success());
    assert!(String::from_utf8_lossy(&stale.stderr).contains("already at generation 2"));
    let implicit = publish("login", "token-bucket:capacity=99,rate=2,generation=3");
    assert!(!implicit.status.success());
    assert!(String::from_utf8_lossy(&implicit.stderr).contains("transition"));

    let one = json(&tollgate(&[
        "policy", "show", "--redis", &url, "--name", "login",
    ]));
    assert_eq!(one[0]["limit"], 20);
    assert_eq!(
        one[0]["spec"],
        "token-bucket:capacity=20,rate=2,period=1000000us,generation=2,transition=proportional"
    );
    let all = json(&tollgate(&["policy", "show", "--redis", &url]));
    let names: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["login", "search"]);
    let missing = tollgate(&["policy", "show", "--redis", &url, "--name", "nope"]);
    assert!(!missing.status.success());
}

/// `tollgate check` prints the policy it decided under in the spec form `--policy` reads, so
/// the printed policy can be given back to it (it printed `rate=2/1000000us`, which
/// `--policy` refused).
#[test]
fn check_prints_a_policy_its_own_flag_reads_back() {
    let server = RedisServer::start();
    let url = server.url();
    for policy in [
        "token-bucket:capacity=10,rate=2",
        "token-bucket:capacity=7,rate=7,period=3s,max-elapsed=2s,generation=4,transition=proportional",
        "fixed-window:limit=100,window=1m",
        "sliding-log:limit=20,window=10s,generation=2,transition=carry",
    ] {
        for store in [&["--redis", url.as_str()][..], &[][..]] {
            let mut args = vec!["check", "--key", "user:1", "--policy", policy];
            args.extend_from_slice(store);
            let out = json(&tollgate(&args));
            assert_eq!(out["allowed"], true, "{out}");
            let printed = out["policy"].as_str().expect("a policy string").to_owned();
            let mut again = vec!["check", "--key", "user:1", "--policy", printed.as_str()];
            again.extend_from_slice(store);
            let out = json(&tollgate(&again));
            assert_eq!(out["policy"], printed.as_str(), "{policy}");
        }
    }
}

/// `policy show` lists every entry when one cannot be read by this version (a rolling
/// upgrade's newer algorithm), that one with why (it failed as a whole: `Corrupt`).
#[test]
fn show_lists_every_entry_and_why_one_is_unreadable() {
    let server = RedisServer::start();
    let url = server.url();
    let out = json(&tollgate(&[
        "policy",
        "publish",
        "--redis",
        &url,
        "--name",
        "login",
        "--policy",
        "fixed-window:limit=10,window=1h,generation=1,transition=carry",
    ]));
    assert_eq!(out["published"], true);
    let mut conn = server.client().get_connection().unwrap();
    let _: () = redis::cmd("HSET")
        .arg("tollgate:registry")
        .arg("api")
        .arg("3 leaky-bucket:capacity=5,leak=1")
        .query(&mut conn)
        .unwrap();
    let out = json(&tollgate(&["policy", "show", "--redis", &url]));
    let entries = out.as_array().expect("a list");
    assert_eq!(entries.len(), 2, "{out}");
    assert_eq!(entries[0]["name"], "api");
    assert!(
        entries[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("leaky-bucket")),
        "{out}"
    );
    assert_eq!(entries[1]["name"], "login");
    assert_eq!(entries[1]["generation"], 1);
}

/// A zero deadline or pool is refused, naming the flag. Before, each was taken: `--timeout 0s`
/// made every Redis call a race against the timer's next tick (`check --redis` failed with
/// "store call timed out after 0ns", `policy show` succeeded, and on the local store `check`
/// succeeded: exit 0), and `--pool 0` was silently a pool of 1 (exit 0).
#[test]
fn a_zero_deadline_or_pool_is_refused() {
    let server = RedisServer::start();
    let url = server.url();
    let check = CHECK;
    for (args, flag) in [
        (vec!["--timeout", "0s"], "--timeout"),
        (vec!["--timeout", "0ms", "--redis", &url], "--timeout"),
        (vec!["--pool", "0", "--redis", &url], "--pool"),
    ] {
        let mut all = check.to_vec();
        all.extend_from_slice(&args);
        let out = tollgate(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
    for cmd in [
        &["show"][..],
        &[
            "publish",
            "--name",
            "a",
            "--policy",
            "fixed-window:limit=1,window=1s",
        ][..],
    ] {
        let mut all = vec!["policy"];
        all.extend_from_slice(cmd);
        all.extend_from_slice(&["--redis", &url, "--timeout", "0s"]);
        let out = tollgate(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cmd:?}: {stderr}");
        assert!(stderr.contains("--timeout"), "{cmd:?}: {stderr}");
    }
    // nothing was published
    let out = tollgate(&["policy", "show", "--redis", &url]);
    assert_eq!(json(&out), serde_json::json!([]));
    // the smallest deadline and pool still decide
    let mut all = check.to_vec();
    all.extend_from_slice(&["--timeout", "1s", "--pool", "1", "--redis", &url]);
    assert_eq!(json(&tollgate(&all))["allowed"], true);
}

/// Redis connection flags without `--redis` are refused, naming `--redis`: before, `--pool`,
/// `--multiplexed` and `--prefix` were silently ignored on the embedded local store (exit 0), so
/// a run the operator meant for Redis measured the local store instead. The local store still
/// runs with none of them; `--timeout` applies to both stores.
#[test]
fn redis_flags_without_redis_are_refused() {
    let check = CHECK;
    for args in [
        &["--pool", "4"][..],
        &["--multiplexed"][..],
        &["--prefix", "other:"][..],
    ] {
        let mut all = check.to_vec();
        all.extend_from_slice(args);
        let out = tollgate(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("--redis"), "{args:?}: {stderr}");
    }
    let mut all = check.to_vec();
    all.extend_from_slice(&["--timeout", "1s"]);
    assert_eq!(json(&tollgate(&all))["allowed"], true);
    assert_eq!(json(&tollgate(&check))["allowed"], true);
}
