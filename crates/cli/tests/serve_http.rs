//! `tollgate serve`'s answers beyond the plain request: HEAD, OPTIONS and unknown routes, a
//! SIGTERM while a request waits on Redis, an outage and recovery on a degraded route, and
//! concurrent requests on one key (admissions counted). Real redis-servers (testkit) on a
//! frozen clock the test moves.

use std::time::Duration;

use reqwest::{Method, StatusCode};

mod common;
use common::{START_MICROS, Serve, client, frozen_redis, header, write_config};

const CONFIG: &str = r#"
legacy_headers = true

[[route]]
name = "get"
path = "/get"
method = "GET"
key = "route"
policy = "token-bucket:capacity=10,rate=1,period=1h"
failure_mode = "closed"

[[route]]
name = "fallback"
path = "/fallback"
key = "route"
policy = "token-bucket:capacity=4,rate=1,period=1h"
failure_mode = "degraded"
expected_instances = 2
"#;

/// HEAD on a GET route is the GET (limited, fields, no body); OPTIONS on it is a 405 and an
/// unknown path a 404, neither spending quota nor carrying quota fields.
#[tokio::test]
async fn head_options_and_unknown_routes() {
    let redis = frozen_redis();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), CONFIG);
    let serve = Serve::start(&["--config", &config, "--redis", &redis.url()]);
    let http = client();
    let resp = http.get(serve.url("/get")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"get\";r=9;t=3600"));
    let resp = http.head(serve.url("/get")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"get\";r=8;t=7200"));
    assert_eq!(
        header(&resp, "ratelimit-policy"),
        Some("\"get\";q=10;w=36000")
    );
    assert!(resp.bytes().await.unwrap().is_empty());
    for (method, path, status) in [
        (Method::OPTIONS, "/get", StatusCode::METHOD_NOT_ALLOWED),
        (Method::POST, "/get", StatusCode::METHOD_NOT_ALLOWED),
        (Method::GET, "/nowhere", StatusCode::NOT_FOUND),
        (Method::HEAD, "/nowhere", StatusCode::NOT_FOUND),
        (Method::GET, "/get/extra", StatusCode::NOT_FOUND),
    ] {
        let resp = http
            .request(method.clone(), serve.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), status, "{method} {path}");
        for field in ["ratelimit", "ratelimit-policy", "retry-after"] {
            assert!(
                header(&resp, field).is_none(),
                "{method} {path} carries {field}"
            );
        }
    }
    let resp = http.get(serve.url("/get")).send().await.unwrap();
    assert_eq!(header(&resp, "ratelimit"), Some("\"get\";r=7;t=10800"));
    // A route without a method limits every method, OPTIONS included.
    let resp = http
        .request(Method::OPTIONS, serve.url("/fallback"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"fallback\";r=3;t=3600"));
}

/// SIGTERM while a request waits on a slow Redis: the request is answered in full (decided,
/// with its fields), then the server exits cleanly; new connections are refused.
#[tokio::test]
async fn sigterm_mid_request_answers_it_then_exits() {
    let redis = frozen_redis();
    let proxy = tollgate_testkit::proxy::FaultProxy::start(redis.port());
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), CONFIG);
    let mut serve = Serve::start(&[
        "--config",
        &config,
        "--redis",
        &proxy.url(),
        "--timeout",
        "5s",
    ]);
    let http = client();
    assert_eq!(
        http.get(serve.url("/get")).send().await.unwrap().status(),
        StatusCode::OK
    );
    proxy.set_latency(Duration::from_millis(600)); // each way
    let in_flight = tokio::spawn(http.get(serve.url("/get")).send());
    // Bounded wait until the request has reached the proxy (its round trip is 1.2 s).
    let before = proxy.stats().bytes_to_target;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while proxy.stats().bytes_to_target == before {
        assert!(
            std::time::Instant::now() < deadline,
            "request never reached Redis"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tollgate_testkit::server::sigterm(serve.child.id());
    let resp = in_flight.await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"get\";r=8;t=7200"));
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = serve.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "serve still running 10 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
}

/// A degraded route through a Redis outage and back: shared, then its local share (2 of 4)
/// with 429s that carry Retry-After and fields agreeing with it, then shared again.
#[tokio::test]
async fn a_degraded_route_through_an_outage_and_recovery() {
    let mut redis = frozen_redis();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), CONFIG);
    let serve = Serve::start(&[
        "--config",
        &config,
        "--redis",
        &redis.url(),
        "--timeout",
        "200ms",
    ]);
    let http = client();
    let resp = http.get(serve.url("/fallback")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"fallback\";r=3;t=3600"));

    redis.kill();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let resp = http.get(serve.url("/fallback")).send().await.unwrap();
        statuses.push(resp.status().as_u16());
        assert_eq!(
            header(&resp, "ratelimit-policy").map(|p| p.starts_with("\"fallback\";q=4")),
            Some(true)
        );
        assert_eq!(header(&resp, "x-ratelimit-limit"), Some("4"));
        if resp.status() == StatusCode::TOO_MANY_REQUESTS {
            let retry: u64 = header(&resp, "retry-after").unwrap().parse().unwrap();
            assert!(retry >= 1);
            assert_eq!(header(&resp, "x-ratelimit-remaining"), Some("0"));
            let t: u64 = header(&resp, "x-ratelimit-reset").unwrap().parse().unwrap();
            assert!(t >= retry, "t={t} < Retry-After={retry}");
            let body = resp.text().await.unwrap();
            assert_eq!(
                body,
                format!("rate limit exceeded for fallback; retry in {retry} s\n")
            );
        }
    }
    assert_eq!(statuses, [200, 200, 429, 429]);

    redis.restart();
    redis.clock().freeze_at_micros(START_MICROS);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let resp = http.get(serve.url("/get")).send().await.unwrap();
        if resp.status() == StatusCode::OK {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still not shared");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The restarted Redis lost the bucket: a full one, shared again.
    let resp = http.get(serve.url("/fallback")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"fallback\";r=3;t=3600"));
}

/// 60 concurrent requests on one key across two serve processes sharing Redis: exactly the
/// capacity is admitted, each remaining value once.
#[tokio::test]
async fn concurrent_requests_across_processes_are_admitted_once_per_unit() {
    let redis = frozen_redis();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), CONFIG);
    let a = Serve::start(&["--config", &config, "--redis", &redis.url()]);
    let b = Serve::start(&["--config", &config, "--redis", &redis.url()]);
    let http = client();
    let mut tasks = Vec::new();
    for i in 0..60 {
        let serve = if i % 2 == 0 { &a } else { &b };
        tasks.push(tokio::spawn(http.get(serve.url("/get")).send()));
    }
    let mut remaining = Vec::new();
    let mut denied = 0;
    for task in tasks {
        let resp = task.await.unwrap().unwrap();
        match resp.status() {
            StatusCode::OK => remaining.push(
                header(&resp, "x-ratelimit-remaining")
                    .unwrap()
                    .parse::<u64>()
                    .unwrap(),
            ),
            StatusCode::TOO_MANY_REQUESTS => {
                denied += 1;
                assert_eq!(header(&resp, "retry-after"), Some("3600"));
            }
            other => panic!("unexpected {other}"),
        }
    }
    remaining.sort_unstable();
    assert_eq!(remaining, (0..10).collect::<Vec<u64>>());
    assert_eq!(denied, 50);
}
