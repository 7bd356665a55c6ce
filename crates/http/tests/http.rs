//! End-to-end over real HTTP on loopback (axum server, reqwest client): the response fields
//! equal the decision, Retry-After is enough, cost above capacity is not a 429, and a store
//! outage is a 503 only where the route fails closed. The Redis cases run a real
//! redis-server (testkit) on a frozen clock the test moves; nothing sleeps.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::HeaderValue;
use axum::routing::get;
use reqwest::{Response, StatusCode};
use tollgate::{Decision, FailureMode, Key, Limiter, LocalStore, ManualClock, Policy, Rate, Store};
use tollgate_http::{
    ClientIpKey, ForwardedHeader, HeaderCost, HeaderKey, RateLimitLayer, TrustedProxies, UserKey,
};
use tollgate_testkit::server::RedisServer;

mod common;
use common::{client, header, serve};

/// 2023-11-14T22:13:20Z plus 0.3 s: not aligned to any window, so fixed windows end early.
const START_MICROS: u64 = 1_700_000_000_300_000;
const PEER: &str = "127.0.0.1";

fn policies() -> [(&'static str, Policy); 3] {
    [
        (
            "tb",
            Policy::token_bucket(5, Rate::new(2, Duration::from_secs(3))).unwrap(),
        ),
        (
            "fw",
            Policy::fixed_window(5, Duration::from_secs(4)).unwrap(),
        ),
        (
            "sl",
            Policy::sliding_log(5, Duration::from_secs(4)).unwrap(),
        ),
    ]
}

/// One route per policy at `/{name}`, keyed by client IP, cost from `x-cost`.
fn app(store: &Arc<dyn Store>, mode: impl Fn() -> FailureMode) -> Router {
    let mut app = Router::new();
    for (name, policy) in policies() {
        let limiter = Limiter::builder(name, policy)
            .store(store.clone())
            .failure_mode(mode())
            .build()
            .unwrap();
        let layer = RateLimitLayer::new(limiter, ClientIpKey::new(TrustedProxies::none()))
            .cost(HeaderCost::new("x-cost".parse().unwrap(), 1, 1, 100).unwrap())
            .legacy_headers(true);
        app = app.route(
            &format!("/{name}"),
            get(|| async { "ok" }).route_layer(layer),
        );
    }
    app
}

/// Every field of `resp` is the one `expected` implies.
fn assert_matches(resp: &Response, name: &str, policy: &Policy, expected: &Decision) {
    let what = format!("{name} {expected:?}");
    let status = if expected.allowed {
        StatusCode::OK
    } else {
        StatusCode::TOO_MANY_REQUESTS
    };
    assert_eq!(resp.status(), status, "{what}");
    let window = match name {
        "tb" => 8, // 5 tokens at 2 per 3 s: 7.5 s, rounded up
        _ => 4,
    };
    assert_eq!(
        header(resp, "ratelimit-policy"),
        Some(format!("\"{name}\";q={};w={window}", policy.limit()).as_str()),
        "{what}"
    );
    assert_eq!(
        header(resp, "ratelimit"),
        Some(
            format!(
                "\"{name}\";r={};t={}",
                expected.remaining,
                expected.reset_after_secs()
            )
            .as_str()
        ),
        "{what}"
    );
    assert_eq!(
        header(resp, "retry-after"),
        expected
            .retry_after_secs()
            .map(|s| s.to_string())
            .as_deref(),
        "{what}"
    );
    assert_eq!(
        header(resp, "x-ratelimit-remaining"),
        Some(expected.remaining.to_string().as_str())
    );
    assert_eq!(
        header(resp, "x-ratelimit-limit"),
        Some(expected.limit.to_string().as_str())
    );
    assert_eq!(
        header(resp, "x-ratelimit-reset"),
        Some(expected.reset_after_secs().to_string().as_str())
    );
}

/// Drives a mixed sequence of costs and clock steps through the server and, in lockstep, a
/// mirror LocalStore on a ManualClock at the same instant; every response must carry exactly
/// the mirror's decision. Returns how many requests were denied (so the run is known to
/// cover both outcomes).
async fn headers_agree_with_mirror(base: &str, advance: impl Fn(Duration)) -> usize {
    let http = client();
    let mirror_clock = ManualClock::new(START_MICROS);
    let mirror = LocalStore::with_clock(mirror_clock.clone());
    let steps: [(u64, u64); 14] = [
        (1, 0),
        (2, 100),
        (2, 100),
        (1, 100),
        (1, 400),
        (3, 900),
        (1, 1_300),
        (1, 0),
        (5, 2_000),
        (2, 3_700),
        (1, 10),
        (4, 1_500),
        (1, 4_100),
        (1, 0),
    ];
    let mut denied = 0;
    for (name, policy) in policies() {
        let key = Key::new(name, [PEER]).unwrap();
        for (cost, step_ms) in steps {
            advance(Duration::from_millis(step_ms));
            mirror_clock.advance(Duration::from_millis(step_ms));
            let resp = http
                .get(format!("{base}/{name}"))
                .header("x-cost", cost.to_string())
                .send()
                .await
                .unwrap();
            let expected = mirror.acquire_now(&key, &policy, cost).unwrap();
            denied += usize::from(!expected.allowed);
            assert_matches(&resp, name, &policy, &expected);
        }
    }
    denied
}

#[tokio::test]
async fn response_fields_equal_the_decision_on_the_local_store() {
    let clock = ManualClock::new(START_MICROS);
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(clock.clone()));
    let base = serve(app(&store, || FailureMode::Closed)).await;
    let denied = headers_agree_with_mirror(&base, |d| clock.advance(d)).await;
    assert!(denied >= 6, "the sequence should hit every limit: {denied}");
}

#[tokio::test]
async fn response_fields_equal_the_decision_on_redis() {
    let server = RedisServer::builder().clock_control(true).start();
    server.clock().freeze_at_micros(START_MICROS);
    let store: Arc<dyn Store> = Arc::new(
        tollgate::redis::RedisStore::builder(server.url())
            .build()
            .await
            .unwrap(),
    );
    let base = serve(app(&store, || FailureMode::Closed)).await;
    let denied = headers_agree_with_mirror(&base, |d| server.clock().advance(d)).await;
    assert!(denied >= 6, "the sequence should hit every limit: {denied}");
}

/// Exhausts each route, then behaves as a polite client: on 429, waits exactly Retry-After
/// (by moving the clock) and tries again. It must be admitted on that first retry.
async fn retry_after_is_enough(base: &str, advance: impl Fn(Duration)) {
    let http = client();
    for (name, policy) in policies() {
        // Start each route mid-way through a second, where rounding up matters.
        advance(Duration::from_millis(1_234));
        let mut retries = 0;
        for i in 0..(3 * policy.limit()) {
            let resp = http
                .get(format!("{base}/{name}"))
                .header("x-cost", "2")
                .send()
                .await
                .unwrap();
            if resp.status() == StatusCode::OK {
                continue;
            }
            assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS, "{name} #{i}");
            let wait: u64 = header(&resp, "retry-after").unwrap().parse().unwrap();
            assert!(wait >= 1);
            advance(Duration::from_secs(wait));
            let again = http
                .get(format!("{base}/{name}"))
                .header("x-cost", "2")
                .send()
                .await
                .unwrap();
            assert_eq!(
                again.status(),
                StatusCode::OK,
                "{name}: denied again after honouring Retry-After: {wait}"
            );
            retries += 1;
        }
        assert!(
            retries >= 2,
            "{name}: the run should be throttled: {retries}"
        );
    }
}

#[tokio::test]
async fn a_client_honouring_retry_after_is_admitted_local() {
    let clock = ManualClock::new(START_MICROS);
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(clock.clone()));
    let base = serve(app(&store, || FailureMode::Closed)).await;
    retry_after_is_enough(&base, |d| clock.advance(d)).await;
}

#[tokio::test]
async fn a_client_honouring_retry_after_is_admitted_redis() {
    let server = RedisServer::builder().clock_control(true).start();
    server.clock().freeze_at_micros(START_MICROS);
    let store: Arc<dyn Store> = Arc::new(
        tollgate::redis::RedisStore::builder(server.url())
            .build()
            .await
            .unwrap(),
    );
    let base = serve(app(&store, || FailureMode::Closed)).await;
    retry_after_is_enough(&base, |d| server.clock().advance(d)).await;
}

#[tokio::test]
async fn cost_above_capacity_is_413_without_retry_after_and_consumes_nothing() {
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(ManualClock::new(START_MICROS)));
    let base = serve(app(&store, || FailureMode::Closed)).await;
    let http = client();
    for (name, _) in policies() {
        let resp = http
            .get(format!("{base}/{name}"))
            .header("x-cost", "6")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE, "{name}");
        assert!(header(&resp, "retry-after").is_none());
        assert!(header(&resp, "ratelimit").is_none());
        assert!(header(&resp, "ratelimit-policy").unwrap().contains(";q=5"));
        assert!(resp.text().await.unwrap().contains("exceeds"));
        // Out of the header's bounds: refused before the limiter, also 400-class.
        let resp = http
            .get(format!("{base}/{name}"))
            .header("x-cost", "101")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{name}");
        // Nothing was consumed.
        let resp = http.get(format!("{base}/{name}")).send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert!(
            header(&resp, "ratelimit")
                .unwrap()
                .starts_with(&format!("\"{name}\";r=4;"))
        );
    }
}

#[tokio::test]
async fn store_outage_is_503_only_where_the_route_fails_closed() {
    let mut server = RedisServer::start();
    let store: Arc<dyn Store> = Arc::new(
        tollgate::redis::RedisStore::builder(server.url())
            .timeout(Duration::from_millis(200))
            .build()
            .await
            .unwrap(),
    );
    // A token bucket refilling one token an hour, so no whole token comes back within the test
    // (a minute's fixed window, aligned to the epoch on Redis's and the fallback's real clocks,
    // restarted at the top of each minute: the fallback's 429s would be 200s in a run that
    // crossed it).
    let policy = Policy::token_bucket(5, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let mut app = Router::new();
    for (name, mode) in [
        ("closed", FailureMode::Closed),
        ("open", FailureMode::Open),
        ("fallback", FailureMode::degraded(2)),
    ] {
        let limiter = Limiter::builder(name, policy)
            .store(store.clone())
            .failure_mode(mode)
            .build()
            .unwrap();
        let layer = RateLimitLayer::new(limiter, ClientIpKey::new(TrustedProxies::none()))
            .legacy_headers(true);
        app = app.route(
            &format!("/{name}"),
            get(|| async { "ok" }).route_layer(layer),
        );
    }
    let base = serve(app).await;
    let http = client();
    for name in ["closed", "open", "fallback"] {
        let resp = http.get(format!("{base}/{name}")).send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{name} before the outage");
        assert!(
            header(&resp, "ratelimit")
                .unwrap()
                .starts_with(&format!("\"{name}\";r=4;t="))
        );
    }

    server.kill();

    let resp = http.get(format!("{base}/closed")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    for field in [
        "retry-after",
        "ratelimit",
        "ratelimit-policy",
        "x-ratelimit-remaining",
    ] {
        assert!(header(&resp, field).is_none(), "503 carries {field}");
    }
    for name in ["open", "fallback"] {
        let resp = http.get(format!("{base}/{name}")).send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{name} during the outage");
        // Nothing tells the client how the decision was made.
        for (field, value) in resp.headers() {
            let text = format!("{field}: {value:?}").to_ascii_lowercase();
            assert!(
                !text.contains("degraded")
                    && !text.contains("bypass")
                    && !text.contains("enforcement"),
                "{name} leaks {text}"
            );
        }
        assert!(header(&resp, "ratelimit-policy").unwrap().contains(";q=5;"));
        // The locally scaled-down quota (5 / 2) is not shown either.
        assert_eq!(header(&resp, "x-ratelimit-limit"), Some("5"));
        assert_eq!(resp.text().await.unwrap(), "ok");
    }
    // Degraded enforces its share locally: 5 across 2 expected instances is 2 here.
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(
            http.get(format!("{base}/fallback"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(statuses, [200, 429, 429]);
}

#[tokio::test]
async fn requests_without_a_key_are_refused_before_the_limiter() {
    let store: Arc<dyn Store> = Arc::new(LocalStore::new());
    let limiter = |name: &str| {
        Limiter::builder(
            name,
            Policy::fixed_window(5, Duration::from_secs(60)).unwrap(),
        )
        .store(store.clone())
        .failure_mode(FailureMode::Closed)
        .build()
        .unwrap()
    };
    let app = Router::new()
        .route(
            "/by-header",
            get(|| async { "ok" }).route_layer(RateLimitLayer::new(
                limiter("by-header"),
                HeaderKey::new("x-api-key".parse().unwrap()),
            )),
        )
        .route(
            "/by-user",
            get(|| async { "ok" })
                .route_layer(RateLimitLayer::new(limiter("by-user"), UserKey::new())),
        )
        .route(
            "/by-basic-user",
            get(|| async { "ok" }).route_layer(RateLimitLayer::new(
                limiter("by-basic-user"),
                UserKey::with_challenge(HeaderValue::from_static("Basic realm=\"api\"")),
            )),
        );
    let base = serve(app).await;
    let http = client();
    let resp = http.get(format!("{base}/by-header")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert!(header(&resp, "ratelimit").is_none());
    let resp = http
        .get(format!("{base}/by-header"))
        .header("x-api-key", "k1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(
        header(&resp, "ratelimit")
            .unwrap()
            .starts_with("\"by-header\";r=4;t=")
    );
    // RFC 9110 15.5.2: a 401 carries a WWW-Authenticate challenge (`Bearer` by default, or the
    // one the key was given); no quota fields, as for any request refused before the limiter.
    let resp = http.get(format!("{base}/by-user")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(header(&resp, "www-authenticate"), Some("Bearer"));
    assert!(header(&resp, "ratelimit").is_none());
    let resp = http
        .get(format!("{base}/by-basic-user"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        header(&resp, "www-authenticate"),
        Some("Basic realm=\"api\"")
    );
}

#[tokio::test]
async fn forwarded_addresses_pick_the_bucket_only_behind_a_trusted_proxy() {
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(ManualClock::new(START_MICROS)));
    let policy = Policy::fixed_window(2, Duration::from_secs(60)).unwrap();
    let mut app = Router::new();
    for (name, proxies) in [
        (
            "behind-proxy",
            TrustedProxies::new(
                ["127.0.0.0/8".parse().unwrap()],
                ForwardedHeader::XForwardedFor,
            ),
        ),
        ("direct", TrustedProxies::none()),
    ] {
        let limiter = Limiter::builder(name, policy)
            .store(store.clone())
            .failure_mode(FailureMode::Closed)
            .build()
            .unwrap();
        app = app.route(
            &format!("/{name}"),
            get(|| async { "ok" })
                .route_layer(RateLimitLayer::new(limiter, ClientIpKey::new(proxies))),
        );
    }
    let base = serve(app).await;
    let http = client();
    let remaining = |resp: &Response| {
        let field = header(resp, "ratelimit").unwrap();
        field
            .split(";r=")
            .nth(1)
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    // Behind the (loopback) proxy each forwarded client has its own bucket.
    for client_ip in ["198.51.100.1", "198.51.100.2"] {
        let resp = http
            .get(format!("{base}/behind-proxy"))
            .header("x-forwarded-for", format!("6.6.6.6, {client_ip}"))
            .send()
            .await
            .unwrap();
        assert_eq!(remaining(&resp), 1, "{client_ip}");
    }
    // Without trust the header is ignored: both requests share the peer's bucket.
    let mut seen = Vec::new();
    for client_ip in ["198.51.100.1", "198.51.100.2", "198.51.100.3"] {
        let resp = http
            .get(format!("{base}/direct"))
            .header("x-forwarded-for", client_ip)
            .send()
            .await
            .unwrap();
        seen.push(resp.status().as_u16());
    }
    assert_eq!(seen, [200, 200, 429]);
}

/// A header cost's `default` is the server's choice for a request that declares no cost:
/// left above the capacity by a policy change, it is the server's misconfiguration (500), as
/// a fixed cost is, never a 413 that blames the client for a cost it did not choose (found by a
/// review: it was 413). A cost the request declares is still the client's: 413 above the
/// capacity, admitted within it.
#[tokio::test]
async fn a_header_cost_default_left_above_a_shrunk_capacity_is_the_servers_error() {
    use tollgate::Transition;
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(ManualClock::new(START_MICROS)));
    let hour = Duration::from_secs(3600);
    let api = Limiter::builder("api", Policy::fixed_window(10, hour).unwrap())
        .store(store)
        .failure_mode(FailureMode::Closed)
        .build()
        .unwrap();
    let layer = RateLimitLayer::new(api.clone(), tollgate_http::RouteKey)
        .cost(HeaderCost::new("x-cost".parse().unwrap(), 5, 1, 10).unwrap());
    let base = serve(Router::new().route("/x", get(|| async { "ok" }).route_layer(layer))).await;
    let http = client();
    let send = |cost: Option<&'static str>| {
        let mut req = http.get(format!("{base}/x"));
        if let Some(c) = cost {
            req = req.header("x-cost", c);
        }
        req.send()
    };
    assert_eq!(send(None).await.unwrap().status(), StatusCode::OK);
    api.set_policy(
        Policy::fixed_window(3, hour)
            .unwrap()
            .with_generation(1)
            .with_transition(Transition::Reset),
    );
    let resp = send(None).await.unwrap();
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(header(&resp, "retry-after").is_none());
    assert_eq!(
        send(Some("5")).await.unwrap().status(),
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(send(Some("2")).await.unwrap().status(), StatusCode::OK);
}
