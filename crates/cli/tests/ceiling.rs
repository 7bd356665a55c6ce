//! `tollgate ceiling` as a user runs it: the built binary against a real redis-server. It must
//! send exactly the requests asked for, on random keys of the given shape, with the given
//! arguments, read every reply (nested arrays included) and report requests/s.

use std::process::Command;

use tollgate_testkit::server::RedisServer;

fn ceiling(server: &RedisServer, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["ceiling", "--redis", &server.url()])
        .args(args)
        .output()
        .expect("the tollgate binary runs")
}

/// `out`, which must be a success.
fn succeeded(out: std::process::Output) -> std::process::Output {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn a_script_file_runs_with_its_arguments_on_every_request() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("count.lua");
    // adds ARGV[1] to one counter per key and to a total; replies a nested array
    std::fs::write(
        &script,
        "redis.call('INCRBY', KEYS[1], ARGV[1]) \
         redis.call('INCRBY', 'total', ARGV[2]) \
         return {1, {'a', false}, 'b'}",
    )
    .unwrap();
    let out = succeeded(ceiling(
        &server,
        &[
            "--script",
            script.to_str().unwrap(),
            "--arg",
            "3",
            "--arg",
            "1",
            "--clients",
            "4",
            "--pipeline",
            "7",
            "--requests",
            "1001",
            "--keys",
            "50",
            "--prefix",
            "t:",
            "--json",
        ],
    ));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(s["requests"], 1001);
    assert!(s["requests_per_sec"].as_f64().unwrap() > 0.0, "{s}");
    let mut conn = server.client().get_connection().unwrap();
    let total: u64 = redis::cmd("GET").arg("total").query(&mut conn).unwrap();
    assert_eq!(total, 1001);
    let keys: Vec<String> = redis::cmd("KEYS").arg("t:*").query(&mut conn).unwrap();
    assert!(
        keys.len() > 1 && keys.len() <= 50,
        "random keys of 50: {keys:?}"
    );
    let mut sum = 0;
    for k in &keys {
        assert!(k.starts_with("t:{load:k") && k.ends_with('}'), "{k}");
        let n: u64 = redis::cmd("GET").arg(k).query(&mut conn).unwrap();
        sum += n;
    }
    assert_eq!(sum, 3 * 1001);
}

#[test]
fn tollgate_scripts_run_by_policy_and_errors_are_reported() {
    let server = RedisServer::start();
    let out = succeeded(ceiling(
        &server,
        &[
            "--policy",
            "token-bucket:capacity=10,rate=2",
            "--requests",
            "500",
            "--clients",
            "2",
        ],
    ));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("requests/s"), "{text}");
    let mut conn = server.client().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("tollgate:{load:k*}")
        .query(&mut conn)
        .unwrap();
    assert!(!keys.is_empty());

    // a script that fails is an error, not a rate
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("fail.lua");
    std::fs::write(&script, "return redis.error_reply('ERR nope')").unwrap();
    let out = ceiling(
        &server,
        &["--script", script.to_str().unwrap(), "--requests", "10"],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
    // a cost above the policy's capacity is refused before anything runs
    let out = ceiling(
        &server,
        &[
            "--policy",
            "token-bucket:capacity=10,rate=2",
            "--cost",
            "11",
        ],
    );
    assert!(!out.status.success());
    // zero clients, pipeline, requests or keys would measure nothing (or something else than
    // the report says): refused by the argument parser
    for flag in ["--clients", "--pipeline", "--requests", "--keys"] {
        let out = ceiling(
            &server,
            &["--policy", "token-bucket:capacity=10,rate=2", flag, "0"],
        );
        assert!(!out.status.success(), "{flag} 0 was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{flag}: {err}");
    }
}
