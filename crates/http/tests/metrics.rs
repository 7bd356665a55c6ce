//! Degraded and bypassed decisions are invisible to clients but counted for operators:
//! `tollgate_http_responses_total{route, status, enforcement}`. A local store that refuses
//! every key (`max_keys(0)`, classified as unavailable) stands in for a store that is down.

use std::future::poll_fn;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tollgate::{FailureMode, Limiter, LocalStore, Policy, Store};
use tollgate_http::{RateLimitLayer, RouteKey};
use tower::Service;

#[test]
fn non_shared_decisions_are_counted_not_shown() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let up: Arc<dyn Store> = Arc::new(LocalStore::new());
    let down: Arc<dyn Store> = Arc::new(LocalStore::builder().max_keys(0).build());
    let policy = Policy::fixed_window(5, Duration::from_secs(60)).unwrap();
    let mut app = Router::new();
    for (name, store, mode) in [
        ("shared", &up, FailureMode::Closed),
        ("open", &down, FailureMode::Open),
        ("fallback", &down, FailureMode::degraded(1)),
        ("closed", &down, FailureMode::Closed),
    ] {
        let limiter = Limiter::builder(name, policy)
            .store(store.clone())
            .failure_mode(mode)
            .build()
            .unwrap();
        app = app.route(
            &format!("/{name}"),
            get(|| async { "ok" }).route_layer(RateLimitLayer::new(limiter, RouteKey)),
        );
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut statuses = Vec::new();
    // The local recorder is thread-local: run everything on this thread inside it.
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            for name in ["shared", "open", "fallback", "closed"] {
                poll_fn(|cx| Service::<Request<Body>>::poll_ready(&mut app, cx))
                    .await
                    .unwrap();
                let req = Request::get(format!("/{name}"))
                    .body(Body::empty())
                    .unwrap();
                let resp = app.call(req).await.unwrap();
                for (field, value) in resp.headers() {
                    let text = format!("{field}: {value:?}").to_ascii_lowercase();
                    assert!(
                        !text.contains("degraded") && !text.contains("bypass"),
                        "{name}: {text}"
                    );
                }
                statuses.push(resp.status());
            }
        });
    });
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::SERVICE_UNAVAILABLE
        ]
    );
    let snapshot = snapshotter.snapshot().into_vec();
    let count = |route: &str, status: &str, enforcement: &str| {
        snapshot.iter().find_map(|(ck, _, _, v)| {
            let key = ck.key();
            let label = |k: &str| {
                key.labels()
                    .find(|l| l.key() == k)
                    .map(|l| l.value().to_owned())
            };
            (key.name() == "tollgate_http_responses_total"
                && label("route").as_deref() == Some(route)
                && label("status").as_deref() == Some(status)
                && label("enforcement").as_deref() == Some(enforcement))
            .then_some(match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
        })
    };
    assert_eq!(count("shared", "200", "shared"), Some(1));
    assert_eq!(count("open", "200", "bypassed"), Some(1));
    assert_eq!(count("fallback", "200", "degraded"), Some(1));
    assert_eq!(count("closed", "503", "none"), Some(1));
}
