//! Under an outage every request is decided without the shared store; operators hear of it
//! once per change of enforcement (a warning when a route starts deciding without the shared
//! store, a note when it is back), not once per request, while the metrics still count every
//! response. The store is a real `LocalStore` behind a switch that makes it answer
//! "unavailable", with a circuit breaker that never opens, so every request meets the outage.

use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tollgate::{
    BreakerConfig, Decision, FailureMode, Key, Limiter, LocalStore, Policy, Store, StoreError,
};
use tollgate_http::{RateLimitLayer, RouteKey};
use tower::Service;

/// A local store that answers "unavailable" while `down` is set.
struct Switched {
    inner: LocalStore,
    down: Arc<AtomicBool>,
}

impl Switched {
    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable {
                message: "switched off by the test".into(),
                source: None,
            });
        }
        Ok(())
    }
}

#[async_trait]
impl Store for Switched {
    async fn acquire(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.check()?;
        self.inner.acquire(key, policy, cost).await
    }

    async fn peek(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.check()?;
        self.inner.peek(key, policy, cost).await
    }

    async fn reset(&self, key: &Key, policy: &Policy) -> Result<(), StoreError> {
        self.check()?;
        self.inner.reset(key, policy).await
    }
}

/// A degraded and a fail-open route on `store`, with breakers that never open.
fn app(store: &Arc<dyn Store>) -> Router {
    let policy = Policy::fixed_window(1_000, Duration::from_secs(3600)).unwrap();
    let mut app = Router::new();
    for (name, mode) in [
        ("fallback", FailureMode::degraded(1)),
        ("open", FailureMode::Open),
    ] {
        let limiter = Limiter::builder(name, policy)
            .store(store.clone())
            .failure_mode(mode)
            .breaker(BreakerConfig {
                failure_threshold: u32::MAX,
                probe_interval: Duration::from_secs(3600),
            })
            .build()
            .unwrap();
        app = app.route(
            &format!("/{name}"),
            get(|| async { "ok" }).route_layer(RateLimitLayer::new(limiter, RouteKey)),
        );
    }
    app
}

#[test]
fn an_outage_is_logged_once_per_change_not_once_per_request() {
    let (lines, _logs) = tollgate_testkit::logs::capture();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();

    let down = Arc::new(AtomicBool::new(true));
    let store: Arc<dyn Store> = Arc::new(Switched {
        inner: LocalStore::new(),
        down: down.clone(),
    });
    let mut app = app(&store);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let mut send = async |name: &str, n: usize| {
                for _ in 0..n {
                    poll_fn(|cx| Service::<Request<Body>>::poll_ready(&mut app, cx))
                        .await
                        .unwrap();
                    let req = Request::get(format!("/{name}"))
                        .body(Body::empty())
                        .unwrap();
                    assert_eq!(app.call(req).await.unwrap().status(), StatusCode::OK);
                }
            };
            for name in ["fallback", "open"] {
                send(name, 50).await;
            }
            down.store(false, Ordering::SeqCst);
            for name in ["fallback", "open"] {
                send(name, 5).await;
            }
            down.store(true, Ordering::SeqCst);
            for name in ["fallback", "open"] {
                send(name, 50).await;
            }
        });
    });

    for (name, enforcement) in [("fallback", "degraded"), ("open", "bypassed")] {
        let logged = lines.matching(&["tollgate_http", &format!("route=\"{name}\"")]);
        eprintln!(
            "{name}: {} lines from the layer for 105 requests",
            logged.len()
        );
        for l in &logged {
            eprintln!("  {l}");
        }
        // Down, back, down again: three changes, three lines.
        assert_eq!(logged.len(), 3, "{name}: {logged:#?}");
        assert!(
            logged[0].contains("WARN") && logged[0].contains(enforcement),
            "{name}"
        );
        assert!(logged[1].contains("shared"), "{name}");
        assert!(
            logged[2].contains("WARN") && logged[2].contains(enforcement),
            "{name}"
        );
    }
    // Every response is still counted.
    let snapshot = snapshotter.snapshot().into_vec();
    let count = |route: &str, enforcement: &str| {
        snapshot.iter().find_map(|(key, _, _, value)| {
            let labels: Vec<_> = key.key().labels().map(|l| (l.key(), l.value())).collect();
            let matches = key.key().name() == "tollgate_http_responses_total"
                && labels.contains(&("route", route))
                && labels.contains(&("enforcement", enforcement));
            match (matches, value) {
                (true, DebugValue::Counter(n)) => Some(*n),
                _ => None,
            }
        })
    };
    assert_eq!(count("fallback", "degraded"), Some(100));
    assert_eq!(count("open", "bypassed"), Some(100));
    assert_eq!(count("fallback", "shared"), Some(5));
}
