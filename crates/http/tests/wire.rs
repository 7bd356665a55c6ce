//! What the client sees, request by request, through the layer in process (no sockets): the
//! policy fields follow the limiter's policy, client-IP buckets group IPv6 by prefix, route
//! keys stay bounded, and a degraded or bypassed decision looks like any other. Stores are
//! real `LocalStore`s on a `ManualClock`; a store that refuses every key (`max_keys(0)`,
//! classified as unavailable) stands in for one that is down. Nothing sleeps.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::routing::get;
use tollgate::{FailureMode, Limiter, LocalStore, ManualClock, Policy, Store, Transition};
use tollgate_http::{HeaderCost, RateLimitLayer, RouteKey};
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
