//! What the client sees, request by request, through the layer in process (no sockets): the
//! policy fields follow the limiter's policy, client-IP buckets group IPv6 by prefix, route
//! keys stay bounded, and a degraded or bypassed decision looks like any other. Stores are
//! real `LocalStore`s on a `ManualClock`; a store that refuses every key (`max_keys(0)`,
//! classified as unavailable) stands in for one that is down. Nothing sleeps.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::routing::get;
use tollgate::{FailureMode, Limiter, LocalStore, ManualClock, Policy, Rate, Store, Transition};
use tollgate_http::{
    ClientIpKey, FixedCost, HeaderCost, HeaderKey, RateLimitLayer, RouteKey, TrustedProxies,
    UserKey,
};
use tower::ServiceExt;

/// 2023-11-14T22:13:20.3Z: 20.3 s into a 30 s window, 20.3 s into a 60 s one.
const START_MICROS: u64 = 1_700_000_000_300_000;

fn limiter(name: &str, policy: Policy, store: &Arc<dyn Store>, mode: FailureMode) -> Limiter {
    Limiter::builder(name, policy)
        .store(store.clone())
        .failure_mode(mode)
        .build()
        .unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> Response<Body> {
    app.clone().oneshot(request).await.unwrap()
}

fn get_req(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

fn from_peer(path: &str, peer: &str) -> Request<Body> {
    let mut req = get_req(path);
    req.extensions_mut()
        .insert(ConnectInfo(peer.parse::<SocketAddr>().unwrap()));
    req
}

fn field<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).map(|v| v.to_str().unwrap())
}

#[tokio::test]
async fn policy_fields_follow_set_policy() {
    let clock = ManualClock::new(START_MICROS);
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(clock.clone()));
    let first = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
    let limiter = limiter("api", first, &store, FailureMode::Closed);
    let layer = RateLimitLayer::new(limiter.clone(), RouteKey)
        .cost(HeaderCost::new("x-cost".parse().unwrap(), 1, 1, 100).unwrap())
        .legacy_headers(true);
    let app = Router::new().route("/x", get(|| async { "ok" }).route_layer(layer));

    let resp = send(&app, get_req("/x")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let h = resp.headers();
    assert_eq!(field(h, "ratelimit-policy"), Some(r#""api";q=10;w=60"#));
    assert_eq!(field(h, "ratelimit"), Some(r#""api";r=9;t=40"#));
    assert_eq!(field(h, "x-ratelimit-limit"), Some("10"));

    // A newer policy, fresh buckets: 4 per 30 s.
    let second = Policy::fixed_window(4, Duration::from_secs(30))
        .unwrap()
        .with_generation(1)
        .with_transition(Transition::Reset);
    limiter.set_policy(second);
    let resp = send(&app, get_req("/x")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let h = resp.headers();
    assert_eq!(field(h, "ratelimit-policy"), Some(r#""api";q=4;w=30"#));
    assert_eq!(field(h, "ratelimit"), Some(r#""api";r=3;t=10"#));
    assert_eq!(field(h, "x-ratelimit-limit"), Some("4"));

    // The largest cost shown by a 413 is the new policy's, too.
    let mut req = get_req("/x");
    req.headers_mut().insert("x-cost", "5".parse().unwrap());
    let resp = send(&app, req).await;
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        field(resp.headers(), "ratelimit-policy"),
        Some(r#""api";q=4;w=30"#)
    );

    // Denied under the new policy: the 429 agrees with it.
    let mut req = get_req("/x");
    req.headers_mut().insert("x-cost", "4".parse().unwrap());
    let resp = send(&app, req).await;
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let h = resp.headers();
    assert_eq!(field(h, "ratelimit-policy"), Some(r#""api";q=4;w=30"#));
    assert_eq!(field(h, "ratelimit"), Some(r#""api";r=3;t=10"#));
    assert_eq!(field(h, "x-ratelimit-limit"), Some("4"));

    // And back again: the cached field is not stale in either direction.
    let third = Policy::fixed_window(10, Duration::from_secs(60))
        .unwrap()
        .with_generation(2)
        .with_transition(Transition::Reset);
    limiter.set_policy(third);
    let resp = send(&app, get_req("/x")).await;
    let h = resp.headers();
    assert_eq!(field(h, "ratelimit-policy"), Some(r#""api";q=10;w=60"#));
    assert_eq!(field(h, "ratelimit"), Some(r#""api";r=9;t=40"#));
    assert_eq!(field(h, "x-ratelimit-limit"), Some("10"));
}

/// The parameters of a one-item quota field, without the policy name: `q=6;w=9`.
fn params<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    field(headers, name).map(|v| v.split_once(';').unwrap().1)
}

/// The integer parameter `key` of the one-item quota field `name`.
fn param(headers: &HeaderMap, name: &str, key: &str) -> u64 {
    field(headers, name)
        .unwrap()
        .split(';')
        .skip(1)
        .find_map(|p| {
            let (k, v) = p.split_once('=').unwrap();
            (k == key).then(|| v.parse().unwrap())
        })
        .unwrap()
}

/// `r` of the `RateLimit` field.
fn remaining(resp: &Response<Body>) -> u64 {
    let value = field(resp.headers(), "ratelimit").unwrap();
    value
        .split(";r=")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn ipv6_clients_are_grouped_by_prefix_and_mapped_ipv4_is_ipv4() {
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(ManualClock::new(START_MICROS)));
    let policy = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
    let by_64 = limiter("by64", policy, &store, FailureMode::Closed);
    let by_128 = limiter("by128", policy, &store, FailureMode::Closed);
    let by_v4_24 = limiter("by24", policy, &store, FailureMode::Closed);
    let app = Router::new()
        .route(
            "/64",
            get(|| async { "ok" }).route_layer(RateLimitLayer::new(
                by_64,
                ClientIpKey::new(TrustedProxies::none()),
            )),
        )
        .route(
            "/128",
            get(|| async { "ok" }).route_layer(RateLimitLayer::new(
                by_128,
                ClientIpKey::new(TrustedProxies::none())
                    .ipv6_prefix(128)
                    .unwrap(),
            )),
        )
        .route(
            "/24",
            get(|| async { "ok" }).route_layer(RateLimitLayer::new(
                by_v4_24,
                ClientIpKey::new(TrustedProxies::none())
                    .ipv4_prefix(24)
                    .unwrap(),
            )),
        );
    let mut seen = Vec::new();
    for (path, peer) in [
        // Default /64: two addresses in one /64 share a bucket, another /64 has its own.
        ("/64", "[2001:db8:1:2::1]:1000"),
        ("/64", "[2001:db8:1:2:dead:beef:0:1]:1001"),
        ("/64", "[2001:db8:1:3::1]:1002"),
        // An IPv4-mapped IPv6 peer is the IPv4 address, one bucket per address.
        ("/64", "[::ffff:192.0.2.4]:1003"),
        ("/64", "192.0.2.4:1004"),
        ("/64", "192.0.2.5:1005"),
        // /128: every address on its own.
        ("/128", "[2001:db8:1:2::1]:1006"),
        ("/128", "[2001:db8:1:2::2]:1007"),
        ("/128", "[2001:db8:1:2::1]:1008"),
        // IPv4 grouped by /24 when configured.
        ("/24", "198.51.100.1:1009"),
        ("/24", "[::ffff:198.51.100.200]:1010"),
        ("/24", "198.51.101.1:1011"),
    ] {
        let resp = send(&app, from_peer(path, peer)).await;
        assert_eq!(resp.status(), StatusCode::OK, "{path} {peer}");
        seen.push(remaining(&resp));
    }
    assert_eq!(seen, [9, 8, 9, 9, 8, 9, 9, 9, 8, 9, 8, 9]);
}

#[test]
fn prefix_lengths_are_checked() {
    let key = || ClientIpKey::new(TrustedProxies::none());
    assert_eq!(key().prefixes(), (32, 64));
    assert!(key().ipv6_prefix(129).is_err());
    assert!(key().ipv4_prefix(33).is_err());
    assert_eq!(
        key()
            .ipv6_prefix(0)
            .unwrap()
            .ipv4_prefix(0)
            .unwrap()
            .prefixes(),
        (0, 0)
    );
    let all = key().ipv6_prefix(0).unwrap();
    assert_eq!(
        all.network("2001:db8::1".parse().unwrap()).to_string(),
        "::/0"
    );
    assert_eq!(
        key()
            .network("2001:db8:a:b:c:d:e:f".parse().unwrap())
            .to_string(),
        "2001:db8:a:b::/64"
    );
}

#[tokio::test]
async fn route_keys_are_templates_never_client_paths() {
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(ManualClock::new(START_MICROS)));
    let policy = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
    // Inside routing: the template names the bucket, whatever the id.
    let templated = Router::new().route(
        "/items/{id}",
        get(|| async { "ok" }).route_layer(RateLimitLayer::new(
            limiter("items", policy, &store, FailureMode::Closed),
            RouteKey,
        )),
    );
    // A MethodRouter built with `any` takes `layer`; it still runs inside routing.
    let any_method = Router::new().route(
        "/any/{id}",
        axum::routing::any(|| async { "ok" }).layer(RateLimitLayer::new(
            limiter("any", policy, &store, FailureMode::Closed),
            RouteKey,
        )),
    );
    // Outside routing (Router::layer): no template, so one fixed bucket, not one per path.
    let outside = Router::new()
        .fallback(|| async { "ok" })
        .layer(RateLimitLayer::new(
            limiter("outside", policy, &store, FailureMode::Closed),
            RouteKey,
        ));
    let mut seen = Vec::new();
    for (app, path) in [
        (&templated, "/items/1"),
        (&templated, "/items/2"),
        (&templated, "/items/3?x=y"),
        (&any_method, "/any/1"),
        (&any_method, "/any/2"),
        (&outside, "/a"),
        (&outside, "/b/c"),
        (&outside, "/items/1"),
        (&outside, "/%2e%2e/whatever"),
    ] {
        let resp = send(app, get_req(path)).await;
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        seen.push(remaining(&resp));
    }
    assert_eq!(seen, [9, 8, 7, 9, 8, 9, 8, 7, 6]);
}

/// The header names of a response, sorted.
fn names(resp: &Response<Body>) -> Vec<String> {
    let mut names: Vec<String> = resp.headers().keys().map(ToString::to_string).collect();
    names.sort();
    names.dedup();
    names
}

/// A route per failure mode, all under `policy`: `shared` on a working store, `open` and
/// `fallback` (degraded, 2 expected instances) on a store that is down.
fn failure_mode_app(policy: Policy, clock: &ManualClock) -> Router {
    let up: Arc<dyn Store> = Arc::new(LocalStore::with_clock(clock.clone()));
    let down: Arc<dyn Store> = Arc::new(LocalStore::builder().max_keys(0).build());
    let mut app = Router::new();
    for (name, store, mode) in [
        ("shared", &up, FailureMode::Closed),
        ("open", &down, FailureMode::Open),
        ("fallback", &down, FailureMode::degraded(2)),
    ] {
        let layer = RateLimitLayer::new(limiter(name, policy, store, mode), RouteKey)
            .cost(HeaderCost::new("x-cost".parse().unwrap(), 1, 1, 100).unwrap())
            .legacy_headers(true);
        app = app.route(
            &format!("/{name}"),
            get(|| async { "ok" }).route_layer(layer),
        );
    }
    app
}

fn with_cost(path: &str, cost: u64) -> Request<Body> {
    let mut req = get_req(path);
    req.headers_mut()
        .insert("x-cost", cost.to_string().parse().unwrap());
    req
}

#[tokio::test]
async fn bypassed_and_degraded_allows_look_like_shared_ones() {
    for (algorithm, policy) in [
        (
            "token-bucket",
            Policy::token_bucket(6, Rate::new(2, Duration::from_secs(3))).unwrap(),
        ),
        (
            "fixed-window",
            Policy::fixed_window(6, Duration::from_secs(30)).unwrap(),
        ),
        (
            "sliding-log",
            Policy::sliding_log(6, Duration::from_secs(30)).unwrap(),
        ),
    ] {
        let clock = ManualClock::new(START_MICROS);
        let app = failure_mode_app(policy, &clock);
        for cost in [1, 2, 6] {
            // The shared answer on an untouched bucket: reset it by moving past its expiry.
            clock.advance(Duration::from_secs(3600));
            let shared = send(&app, with_cost("/shared", cost)).await;
            let open = send(&app, with_cost("/open", cost)).await;
            let fallback = send(&app, with_cost("/fallback", cost)).await;
            let what = format!("{algorithm} cost {cost}");
            assert_eq!(shared.status(), StatusCode::OK, "{what}");
            assert_eq!(open.status(), StatusCode::OK, "{what}");
            // Same set of fields, whatever made the decision.
            assert_eq!(names(&open), names(&shared), "{what}");
            let (sh, op) = (shared.headers(), open.headers());
            assert_eq!(
                params(op, "ratelimit-policy"),
                params(sh, "ratelimit-policy"),
                "{what}"
            );
            for name in ["x-ratelimit-limit", "x-ratelimit-remaining"] {
                assert_eq!(field(op, name), field(sh, name), "{what}: {name}");
            }
            let w = param(sh, "ratelimit-policy", "w");
            let t = param(op, "ratelimit", "t");
            if algorithm == "fixed-window" {
                // Until the current window ends by this host's clock (not the test's).
                assert!((1..=w).contains(&t), "{what}: t={t}");
                assert_eq!(
                    field(op, "x-ratelimit-reset"),
                    Some(t.to_string().as_str()),
                    "{what}"
                );
                assert_eq!(param(op, "ratelimit", "r"), 6 - cost, "{what}");
            } else {
                // Exactly what the shared store answers for an untouched bucket.
                assert_eq!(params(op, "ratelimit"), params(sh, "ratelimit"), "{what}");
                assert_eq!(
                    field(op, "x-ratelimit-reset"),
                    field(sh, "x-ratelimit-reset"),
                    "{what}"
                );
            }
            // Never the full quota with nothing to wait for, which no enforced answer carries.
            assert!(param(op, "ratelimit", "r") < 6 && t >= 1, "{what}");

            // Degraded (3 of 6 locally): same fields, the policy's limit, plausible numbers.
            if cost <= 3 {
                assert_eq!(fallback.status(), StatusCode::OK, "{what}");
                assert_eq!(names(&fallback), names(&shared), "{what}");
                let fb = fallback.headers();
                assert_eq!(
                    params(fb, "ratelimit-policy"),
                    params(sh, "ratelimit-policy"),
                    "{what}"
                );
                assert_eq!(field(fb, "x-ratelimit-limit"), Some("6"), "{what}");
                let (rem, reset) = (param(fb, "ratelimit", "r"), param(fb, "ratelimit", "t"));
                assert!(
                    rem < 6 && (1..=w).contains(&reset),
                    "{what}: r={rem} t={reset}"
                );
            }
        }
    }
}

#[tokio::test]
async fn an_instance_behind_a_rollout_shows_the_quota_that_decided() {
    // Two instances share one store; the second already runs a newer policy (10, not 4, per
    // minute). The store decides the first instance's requests under the stored, newer
    // parameters, so its fields must not claim q=4 next to r=8.
    let clock = ManualClock::new(START_MICROS);
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(clock.clone()));
    let old = Policy::fixed_window(4, Duration::from_secs(60)).unwrap();
    let new = Policy::fixed_window(10, Duration::from_secs(60))
        .unwrap()
        .with_generation(1);
    let instance = |policy| {
        let layer = RateLimitLayer::new(
            limiter("api", policy, &store, FailureMode::Closed),
            RouteKey,
        )
        .legacy_headers(true);
        Router::new().route("/x", get(|| async { "ok" }).route_layer(layer))
    };
    let (behind, ahead) = (instance(old), instance(new));
    let resp = send(&ahead, get_req("/x")).await;
    assert_eq!(
        field(resp.headers(), "ratelimit-policy"),
        Some(r#""api";q=10;w=60"#)
    );
    assert_eq!(remaining(&resp), 9);
    let resp = send(&behind, get_req("/x")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let h = resp.headers();
    assert_eq!(field(h, "ratelimit"), Some(r#""api";r=8;t=40"#));
    // The quota that decided; its window is not known here, so `w` is left out.
    assert_eq!(field(h, "ratelimit-policy"), Some(r#""api";q=10"#));
    assert_eq!(field(h, "x-ratelimit-limit"), Some("10"));
    assert_eq!(field(h, "x-ratelimit-remaining"), Some("8"));
    // Once it runs the newer policy too, the window is shown again.
    let resp = send(&ahead, get_req("/x")).await;
    assert_eq!(
        field(resp.headers(), "ratelimit-policy"),
        Some(r#""api";q=10;w=60"#)
    );
    assert_eq!(remaining(&resp), 7);
}

/// A server-side cost of 0 (`FixedCost(0)`, or any `CostFn` breaking its "at least 1"
/// contract) is the server's misconfiguration, not the client's request: 500, without quota
/// fields, and nothing consumed.
#[tokio::test]
async fn a_zero_cost_from_the_server_is_a_server_error_not_the_clients() {
    let store: Arc<dyn Store> = Arc::new(LocalStore::new());
    let policy = Policy::fixed_window(5, Duration::from_secs(60)).unwrap();
    let layer = RateLimitLayer::new(
        limiter("zero", policy, &store, FailureMode::Closed),
        RouteKey,
    )
    .cost(FixedCost(0));
    let app = Router::new().route("/zero", get(|| async { "ok" }).route_layer(layer));
    let resp = send(&app, get_req("/zero")).await;
    eprintln!("FixedCost(0) answered {}", resp.status());
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    for name in ["retry-after", "ratelimit", "ratelimit-policy"] {
        assert!(resp.headers().get(name).is_none(), "{name}");
    }
}

/// Degraded enforcement divides a policy by the expected instances; where the share floors
/// below one token (2 tokens over 4 instances), the local bucket holds 1 token refilled at a
/// quarter of the rate, so it takes longer to fill than the shared one. The fields still
/// describe one consistent quota, allowed or denied: `t` never exceeds a `w` shown beside
/// it (`w` is left out rather than contradicted, as for a rollout's quota), `t` and
/// `Retry-After` stay the decision's own, and `q` stays the policy's.
#[tokio::test]
async fn degraded_headers_stay_consistent_when_the_share_floors_below_one() {
    let down: Arc<dyn Store> = Arc::new(LocalStore::builder().max_keys(0).build());
    for (policy, requests) in [
        (Policy::token_bucket(2, Rate::per_second(1)).unwrap(), 3),
        (
            Policy::token_bucket(10, Rate::new(3, Duration::from_secs(1))).unwrap(),
            4,
        ),
        (Policy::fixed_window(3, Duration::from_secs(30)).unwrap(), 3),
        (Policy::sliding_log(3, Duration::from_secs(30)).unwrap(), 3),
    ] {
        // A fresh local store per policy (its clock is the real one; no time needs to pass).
        let mode = FailureMode::degraded(4);
        let layer = RateLimitLayer::new(limiter("floor", policy, &down, mode), RouteKey)
            .legacy_headers(true);
        let app = Router::new().route("/floor", get(|| async { "ok" }).route_layer(layer));
        for i in 0..requests {
            let resp = send(&app, get_req("/floor")).await;
            let headers = resp.headers();
            let window = params(headers, "ratelimit-policy")
                .unwrap()
                .contains(";w=")
                .then(|| param(headers, "ratelimit-policy", "w"));
            let reset = param(headers, "ratelimit", "t");
            let limit = param(headers, "ratelimit-policy", "q");
            let left = param(headers, "ratelimit", "r");
            let retry = field(headers, "retry-after").map(|v| v.parse::<u64>().unwrap());
            let what = format!(
                "{policy} #{i}: {} q={limit} w={window:?} r={left} t={reset} retry-after={retry:?}",
                resp.status()
            );
            eprintln!("{what}");
            assert!(window.is_none_or(|w| reset <= w), "{what}");
            assert!(limit == policy.limit() && left <= limit, "{what}");
            let legacy_reset = reset.to_string();
            assert_eq!(
                field(headers, "x-ratelimit-reset"),
                Some(legacy_reset.as_str())
            );
            assert!(retry.is_none_or(|r| r <= reset.max(1)), "{what}");
        }
    }
}

/// The legacy `X-RateLimit-Limit`, `-Remaining` and `-Reset` headers.
fn legacy(headers: &HeaderMap) -> [Option<&str>; 3] {
    [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ]
    .map(|n| field(headers, n))
}

/// A route's own layer (`login`, 1 per hour) inside a site-wide one (`site`, 100 per minute
/// per client address), both on one store. Each layer adds its own member to the `RateLimit` and
/// `RateLimit-Policy` lists (inner first); the outer never replaces the inner's. The 429 is
/// the inner's: its `Retry-After`, and its `r=0` beside the site's state. The single-valued
/// legacy headers show the most restrictive quota: on a 429, the one that denied; otherwise
/// the one with the fewest units left.
#[tokio::test]
async fn stacked_layers_each_add_their_fields_and_the_denying_one_stays() {
    let clock = ManualClock::new(START_MICROS);
    let store: Arc<dyn Store> = Arc::new(LocalStore::with_clock(clock.clone()));
    let hour = Duration::from_secs(3600);
    let login = limiter(
        "login",
        Policy::fixed_window(1, hour).unwrap(),
        &store,
        FailureMode::Closed,
    );
    let site = limiter(
        "site",
        Policy::fixed_window(100, Duration::from_secs(60)).unwrap(),
        &store,
        FailureMode::Closed,
    );
    let app = Router::new()
        .route(
            "/login",
            get(|| async { "ok" })
                .route_layer(RateLimitLayer::new(login, RouteKey).legacy_headers(true)),
        )
        .route("/other", get(|| async { "ok" }))
        .route(
            "/wide",
            get(|| async { "ok" }).route_layer(
                RateLimitLayer::new(
                    limiter(
                        "wide",
                        Policy::fixed_window(1000, Duration::from_secs(60)).unwrap(),
                        &store,
                        FailureMode::Closed,
                    ),
                    RouteKey,
                )
                .legacy_headers(true),
            ),
        )
        .layer(
            RateLimitLayer::new(site, ClientIpKey::new(TrustedProxies::none()))
                .legacy_headers(true),
        );
    let client = |path| from_peer(path, "192.0.2.1:1000");

    // Both answers are printed before either is checked.
    let first = send(&app, client("/login")).await;
    eprintln!("first: {} {:?}", first.status(), first.headers());
    let second = send(&app, client("/login")).await;
    eprintln!("second: {} {:?}", second.status(), second.headers());

    let (resp, h) = (&first, first.headers());
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        field(h, "ratelimit"),
        Some(r#""login";r=0;t=2800, "site";r=99;t=40"#)
    );
    assert_eq!(
        field(h, "ratelimit-policy"),
        Some(r#""login";q=1;w=3600, "site";q=100;w=60"#)
    );
    // Fewest units left: login's.
    assert_eq!(legacy(h), [Some("1"), Some("0"), Some("2800")]);

    let (resp, h) = (&second, second.headers());
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(field(h, "retry-after"), Some("2800"));
    assert_eq!(
        field(h, "ratelimit"),
        Some(r#""login";r=0;t=2800, "site";r=98;t=40"#)
    );
    assert_eq!(
        field(h, "ratelimit-policy"),
        Some(r#""login";q=1;w=3600, "site";q=100;w=60"#)
    );
    assert_eq!(legacy(h), [Some("1"), Some("0"), Some("2800")]);
    for name in [
        "ratelimit",
        "ratelimit-policy",
        "retry-after",
        "x-ratelimit-limit",
    ] {
        assert_eq!(h.get_all(name).iter().count(), 1, "{name}: one field line");
    }

    // A route without its own layer: the site's fields alone, as before.
    let resp = send(&app, client("/other")).await;
    let h = resp.headers();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(field(h, "ratelimit"), Some(r#""site";r=97;t=40"#));
    assert_eq!(field(h, "ratelimit-policy"), Some(r#""site";q=100;w=60"#));
    assert_eq!(field(h, "x-ratelimit-remaining"), Some("97"));

    // A route whose own quota is the looser one: both members, and the legacy headers are
    // the site's, which has fewer units left.
    let resp = send(&app, client("/wide")).await;
    let h = resp.headers();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        field(h, "ratelimit"),
        Some(r#""wide";r=999;t=40, "site";r=96;t=40"#)
    );
    assert_eq!(
        field(h, "ratelimit-policy"),
        Some(r#""wide";q=1000;w=60, "site";q=100;w=60"#)
    );
    assert_eq!(legacy(h), [Some("100"), Some("96"), Some("40")]);
}

/// What an inner layer answers itself without a quota decision (503 when its store is down
/// and it fails closed, 400/401 for a missing key, 413 for a cost above capacity, 500 for its
/// own misconfiguration) reaches the client as the inner layer built it: an outer layer adds
/// no quota fields to it.
#[tokio::test]
async fn an_outer_layer_adds_nothing_to_an_inner_layers_own_answers() {
    let clock = ManualClock::new(START_MICROS);
    let up: Arc<dyn Store> = Arc::new(LocalStore::with_clock(clock.clone()));
    let down: Arc<dyn Store> = Arc::new(LocalStore::builder().max_keys(0).build());
    let policy = Policy::fixed_window(5, Duration::from_secs(60)).unwrap();
    let inner =
        |name: &str, store: &Arc<dyn Store>| limiter(name, policy, store, FailureMode::Closed);
    let site = limiter(
        "site",
        Policy::fixed_window(100, Duration::from_secs(60)).unwrap(),
        &up,
        FailureMode::Closed,
    );
    let app = Router::new()
        .route(
            "/down",
            get(|| async { "ok" }).route_layer(
                RateLimitLayer::new(inner("down", &down), RouteKey).legacy_headers(true),
            ),
        )
        .route(
            "/header",
            get(|| async { "ok" }).route_layer(RateLimitLayer::new(
                inner("header", &up),
                HeaderKey::new("x-api-key".parse().unwrap()),
            )),
        )
        .route(
            "/user",
            get(|| async { "ok" })
                .route_layer(RateLimitLayer::new(inner("user", &up), UserKey::new())),
        )
        .route(
            "/cost",
            get(|| async { "ok" }).route_layer(
                RateLimitLayer::new(inner("cost", &up), RouteKey)
                    .cost(HeaderCost::new("x-cost".parse().unwrap(), 1, 1, 100).unwrap()),
            ),
        )
        .route(
            "/zero",
            get(|| async { "ok" })
                .route_layer(RateLimitLayer::new(inner("zero", &up), RouteKey).cost(FixedCost(0))),
        )
        .layer(RateLimitLayer::new(site, RouteKey).legacy_headers(true));
    let mut answers = Vec::new();
    for (req, status, policy_field) in [
        (get_req("/down"), StatusCode::SERVICE_UNAVAILABLE, None),
        (get_req("/header"), StatusCode::BAD_REQUEST, None),
        (get_req("/user"), StatusCode::UNAUTHORIZED, None),
        (
            with_cost("/cost", 50),
            StatusCode::PAYLOAD_TOO_LARGE,
            Some(r#""cost";q=5;w=60"#),
        ),
        (get_req("/zero"), StatusCode::INTERNAL_SERVER_ERROR, None),
    ] {
        let path = req.uri().path().to_owned();
        let resp = send(&app, req).await;
        eprintln!("{path}: {} {:?}", resp.status(), resp.headers());
        answers.push((path, resp, status, policy_field));
    }
    for (path, resp, status, policy_field) in answers {
        let h = resp.headers();
        assert_eq!(resp.status(), status, "{path}");
        assert_eq!(field(h, "ratelimit-policy"), policy_field, "{path}");
        for name in [
            "ratelimit",
            "retry-after",
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ] {
            assert!(h.get(name).is_none(), "{path}: {name} = {:?}", h.get(name));
        }
    }
}

/// The handler changes the limiter's policy while its request is in flight (100 per hour to
/// 10 per hour). The degraded decision was made under the old policy, so its response shows
/// that policy: never `q=10` beside `r=99`. The next request is decided and shown under the
/// new one.
#[tokio::test]
async fn a_policy_change_during_a_request_does_not_contradict_its_degraded_answer() {
    let down: Arc<dyn Store> = Arc::new(LocalStore::builder().max_keys(0).build());
    let hour = Duration::from_secs(3600);
    let api = limiter(
        "api",
        Policy::fixed_window(100, hour).unwrap(),
        &down,
        FailureMode::degraded(1),
    );
    let changes = api.clone();
    let handler = move || {
        let changes = changes.clone();
        async move {
            changes.set_policy(Policy::fixed_window(10, hour).unwrap().with_generation(1));
            "ok"
        }
    };
    let layer = RateLimitLayer::new(api, RouteKey).legacy_headers(true);
    let app = Router::new().route("/x", get(handler).route_layer(layer));

    let resp = send(&app, get_req("/x")).await;
    let h = resp.headers();
    eprintln!("{} {h:?}", resp.status());
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(param(h, "ratelimit", "r"), 99);
    assert_eq!(field(h, "ratelimit-policy"), Some(r#""api";q=100;w=3600"#));
    assert_eq!(field(h, "x-ratelimit-limit"), Some("100"));
    assert_eq!(field(h, "x-ratelimit-remaining"), Some("99"));

    let resp = send(&app, get_req("/x")).await;
    let h = resp.headers();
    eprintln!("{} {h:?}", resp.status());
    assert_eq!(params(h, "ratelimit-policy"), Some("q=10;w=3600"));
    assert!(param(h, "ratelimit", "r") < 10, "{h:?}");
    assert_eq!(field(h, "x-ratelimit-limit"), Some("10"));
}

/// `ClientIpKey::network` is public and documented "IPv4-mapped IPv6 addresses count as
/// IPv4": a caller grouping addresses itself (a peer read off a dual-stack socket) must get the
/// IPv4 block, not `::/64` — the one IPv6 block every IPv4 client would then share.
mod mapped_networks {

    use tollgate_http::{ClientIpKey, TrustedProxies};

    #[test]
    fn a_mapped_address_is_grouped_as_the_ipv4_address_it_carries() {
        let key = ClientIpKey::new(TrustedProxies::none())
            .ipv4_prefix(24)
            .unwrap();
        let mapped = key.network("::ffff:198.51.100.200".parse().unwrap());
        let plain = key.network("198.51.100.7".parse().unwrap());
        assert_eq!(mapped.to_string(), "198.51.100.0/24");
        assert_eq!(mapped, plain);
        let other = key.network("::ffff:203.0.113.9".parse().unwrap());
        assert_ne!(mapped, other, "two IPv4 networks stay apart");
    }
}
