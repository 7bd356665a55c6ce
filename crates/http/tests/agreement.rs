//! Responses agree with decisions on a real redis-server (testkit) under a clock the test
//! moves: `Retry-After` and `t` rounding at the edges of a second, `r` after a cost above 1,
//! header costs the layer refuses without spending quota, hostile and oversized keys, and
//! concurrent requests on one key. Nothing sleeps.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use reqwest::{Response, StatusCode};
use tollgate::{FailureMode, Limiter, Policy, Rate, Store};
use tollgate_http::{HeaderCost, HeaderKey, RateLimitLayer};
use tollgate_testkit::server::RedisServer;

mod common;
use common::{client, header, redis_store, serve};

/// A whole second, 20 s into an epoch-aligned minute (a 60 s window has 40 s left).
const START_MICROS: u64 = 1_700_000_000_000_000;

/// One route `/{name}` per policy, keyed by `x-key`, cost from `x-cost` (1 to 1000).
fn app(store: &Arc<dyn Store>, routes: &[(&str, Policy)]) -> Router {
    let mut app = Router::new();
    for (name, policy) in routes {
        let limiter = Limiter::builder(*name, *policy)
            .store(store.clone())
            .failure_mode(FailureMode::Closed)
            .build()
            .unwrap();
        let layer = RateLimitLayer::new(limiter, HeaderKey::new("x-key".parse().unwrap()))
            .cost(HeaderCost::new("x-cost".parse().unwrap(), 1, 1, 1000).unwrap())
            .legacy_headers(true);
        app = app.route(
            &format!("/{name}"),
            get(|| async { "ok" }).route_layer(layer),
        );
    }
    app
}

/// Retry-After, `t` and `X-RateLimit-Reset` are the exact wait rounded up: 1 µs, 999 ms and
/// 1 s are 1; 1.000001 s is 2; a wait of about ten years is its whole seconds plus one.
#[tokio::test]
async fn waits_are_rounded_up_to_whole_seconds() {
    let server = RedisServer::builder().clock_control(true).start();
    let clock = server.clock();
    clock.freeze_at_micros(START_MICROS);
    let store = redis_store(&server).await;
    let second = Policy::token_bucket(1, Rate::new(1, Duration::from_secs(1))).unwrap();
    let odd = Policy::token_bucket(1, Rate::new(1, Duration::from_micros(1_000_001))).unwrap();
    let decade = Policy::token_bucket(
        1,
        Rate::new(1, Duration::from_secs(10 * 365 * 24 * 3600 - 1)),
    )
    .unwrap();
    let base = serve(app(
        &store,
        &[("second", second), ("odd", odd), ("decade", decade)],
    ))
    .await;
    let http = client();
    let get = |route: &str, key: &str| {
        http.get(format!("{base}/{route}"))
            .header("x-key", key)
            .send()
    };
    let denied = |resp: &Response, retry: &str, what: &str| {
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS, "{what}");
        assert_eq!(header(resp, "retry-after"), Some(retry), "{what}");
        assert_eq!(header(resp, "x-ratelimit-reset"), Some(retry), "{what}");
        assert_eq!(header(resp, "x-ratelimit-remaining"), Some("0"), "{what}");
        let name = what.split(' ').next().unwrap();
        assert_eq!(
            header(resp, "ratelimit"),
            Some(format!("\"{name}\";r=0;t={retry}").as_str()),
            "{what}"
        );
    };

    // Exactly 1 s to wait.
    let resp = get("second", "exact").await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"second\";r=0;t=1"));
    denied(
        &get("second", "exact").await.unwrap(),
        "1",
        "second exact 1 s",
    );

    // 999 ms, then 1 µs.
    clock.advance(Duration::from_millis(1));
    denied(&get("second", "exact").await.unwrap(), "1", "second 999 ms");
    clock.advance(Duration::from_micros(998_999));
    denied(&get("second", "exact").await.unwrap(), "1", "second 1 µs");
    clock.advance(Duration::from_micros(1));
    let resp = get("second", "exact").await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "admitted at exactly 1 s");

    // 1.000001 s.
    assert_eq!(get("odd", "k").await.unwrap().status(), StatusCode::OK);
    denied(&get("odd", "k").await.unwrap(), "2", "odd 1.000001 s");
    clock.advance(Duration::from_secs(1));
    denied(&get("odd", "k").await.unwrap(), "1", "odd 1 µs");

    // About ten years.
    assert_eq!(get("decade", "k").await.unwrap().status(), StatusCode::OK);
    let wait = 10 * 365 * 24 * 3600 - 1;
    denied(
        &get("decade", "k").await.unwrap(),
        &wait.to_string(),
        "decade",
    );
}

/// `r` after a cost above 1 is the capacity minus the costs; refused costs (missing is the
/// default, so not refused; zero, negative, non-numeric, huge, repeated, above capacity)
/// spend nothing and carry neither `Retry-After` nor `RateLimit`.
#[tokio::test]
async fn refused_costs_spend_nothing_and_costs_above_one_show_in_r() {
    let server = RedisServer::builder().clock_control(true).start();
    server.clock().freeze_at_micros(START_MICROS);
    let store = redis_store(&server).await;
    let policy = Policy::token_bucket(10, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let base = serve(app(&store, &[("tb", policy)])).await;
    let http = client();
    let send = |cost: Option<&'static [u8]>| {
        let mut req = http.get(format!("{base}/tb")).header("x-key", "k");
        if let Some(c) = cost {
            req = req.header(
                "x-cost",
                reqwest::header::HeaderValue::from_bytes(c).unwrap(),
            );
        }
        req.send()
    };
    let resp = send(Some(b"3")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"tb\";r=7;t=10800"));
    for bad in [
        &b"0"[..],
        b"-1",
        b"ten",
        b"3.0",
        b"",
        b"18446744073709551616",
        b"99999999999999999999999",
        b"1001",
        b"\xff",
        b"0x3",
    ] {
        let resp = send(Some(bad)).await.unwrap();
        let what = String::from_utf8_lossy(bad).into_owned();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{what:?}");
        for field in ["retry-after", "ratelimit", "x-ratelimit-remaining"] {
            assert!(header(&resp, field).is_none(), "{what:?} carries {field}");
        }
    }
    // Above the capacity of 10 but within the header's bounds: 413, `q` only.
    let resp = send(Some(b"11")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(header(&resp, "retry-after").is_none());
    assert!(header(&resp, "ratelimit").is_none());
    assert_eq!(
        header(&resp, "ratelimit-policy"),
        Some("\"tb\";q=10;w=36000")
    );
    // Nothing was spent by any of them.
    let resp = send(None).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"tb\";r=6;t=14400"));
    // A cost of 7 with 6 left: denied, r stays 6.
    let resp = send(Some(b"7")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&resp, "retry-after"), Some("3600"));
    assert_eq!(header(&resp, "ratelimit"), Some("\"tb\";r=6;t=14400"));
}

/// Keys made of hostile bytes each get their own bucket; an oversized one is a 400 that
/// spends nothing, never a 500 and never another key's bucket.
#[tokio::test]
async fn hostile_and_oversized_keys_neither_fail_nor_share() {
    let server = RedisServer::builder().clock_control(true).start();
    server.clock().freeze_at_micros(START_MICROS);
    let store = redis_store(&server).await;
    let policy = Policy::fixed_window(2, Duration::from_secs(60)).unwrap();
    let base = serve(app(&store, &[("fw", policy)])).await;
    let http = client();
    let keys: [&[u8]; 8] = [
        b"{a}",
        b"a",
        b"a:b",
        b"a\\:b",
        b"\xff\xfe",
        b"tb:{x}:y",
        b"*",
        b"a b",
    ];
    for key in keys {
        let resp = http
            .get(format!("{base}/fw"))
            .header(
                "x-key",
                reqwest::header::HeaderValue::from_bytes(key).unwrap(),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{key:?}");
        assert_eq!(
            header(&resp, "ratelimit"),
            Some("\"fw\";r=1;t=40"),
            "{key:?} shares a bucket"
        );
    }
    let huge = "a".repeat(64 * 1024 + 1);
    for _ in 0..3 {
        let resp = http
            .get(format!("{base}/fw"))
            .header("x-key", &huge)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
        assert!(header(&resp, "ratelimit").is_none());
    }
    // Its 64 KiB prefix, a valid key, has its whole quota.
    let resp = http
        .get(format!("{base}/fw"))
        .header("x-key", &huge[1..])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "ratelimit"), Some("\"fw\";r=1;t=40"));
}

/// 64 concurrent requests, one key, a capacity of 10: exactly 10 admitted, each remaining
/// value shown once.
#[tokio::test]
async fn concurrent_requests_on_one_key_are_admitted_once_per_unit() {
    let server = RedisServer::builder().clock_control(true).start();
    server.clock().freeze_at_micros(START_MICROS);
    let store = redis_store(&server).await;
    let policy = Policy::token_bucket(10, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let base = serve(app(&store, &[("tb", policy)])).await;
    let http = client();
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let req = http.get(format!("{base}/tb")).header("x-key", "hot").send();
        tasks.push(tokio::spawn(req));
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
            StatusCode::TOO_MANY_REQUESTS => denied += 1,
            other => panic!("unexpected {other}"),
        }
    }
    remaining.sort_unstable();
    assert_eq!(remaining, (0..10).collect::<Vec<u64>>());
    assert_eq!(denied, 54);
}

/// Redis is down on a degraded route (capacity 10, 2 expected instances: 5 here): a cost
/// within the share is admitted with the local numbers, one above the share but within the
/// capacity is a 429 whose fields agree with its Retry-After, one above the capacity a 413.
/// None of them names the enforcement.
#[tokio::test]
async fn a_degraded_route_answers_costs_around_its_share() {
    let mut server = RedisServer::builder().clock_control(true).start();
    server.clock().freeze_at_micros(START_MICROS);
    let store = redis_store(&server).await;
    let policy = Policy::token_bucket(10, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let limiter = Limiter::builder("tb", policy)
        .store(store)
        .timeout(Duration::from_millis(200))
        .failure_mode(FailureMode::degraded(2))
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(limiter, HeaderKey::new("x-key".parse().unwrap()))
        .cost(HeaderCost::new("x-cost".parse().unwrap(), 1, 1, 1000).unwrap())
        .legacy_headers(true);
    let base = serve(Router::new().route("/tb", get(|| async { "ok" }).route_layer(layer))).await;
    server.kill();
    let http = client();
    let send = |cost: &str| {
        http.get(format!("{base}/tb"))
            .header("x-key", "k")
            .header("x-cost", cost)
            .send()
    };
    let mut seen = Vec::new();
    for cost in ["7", "3", "3", "11"] {
        let resp = send(cost).await.unwrap();
        let fields: Vec<String> = [
            "retry-after",
            "ratelimit",
            "ratelimit-policy",
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ]
        .iter()
        .map(|f| format!("{f}={:?}", header(&resp, f)))
        .collect();
        for (name, value) in resp.headers() {
            let text = format!("{name}: {value:?}").to_ascii_lowercase();
            assert!(!text.contains("degraded"), "{text}");
        }
        let status = resp.status().as_u16();
        let body = resp.text().await.unwrap();
        eprintln!("cost {cost}: {status} {fields:?} {body:?}");
        seen.push(status);
    }
    assert_eq!(seen, [429, 200, 429, 413]);
}
