//! A cost above the policy's capacity can never pass. When the request decided it (a cost the
//! client declares, or any per-request cost function) that is the client's error, 413; when
//! it is the route's own fixed cost it is the server's misconfiguration: 500, logged at error,
//! including after a policy change lowers the capacity under a fixed cost that used to fit.
//! Alone in its test binary: a thread-scoped subscriber misses events whose callsite another
//! test's thread registers first (tracing's callsite interest is process-wide).

use std::future::poll_fn;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use tollgate::{FailureMode, Limiter, LocalStore, Policy};
use tollgate_http::{CostFn, CostSource, FixedCost, RateLimitLayer, Rejection, RouteKey};
use tower::Service;

/// A per-request cost function of the application's own: the number of items the request
/// names. It does not claim to be fixed, so its cost is the request's.
#[derive(Clone)]
struct Items;

impl CostFn for Items {
    fn cost<B>(&self, request: &Request<B>) -> Result<u64, Rejection> {
        Ok(request
            .headers()
            .get("x-items")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1))
    }
}

fn limiter(name: &str, limit: u64) -> Limiter {
    Limiter::builder(
        name,
        Policy::fixed_window(limit, Duration::from_secs(3600)).unwrap(),
    )
    .store(Arc::new(LocalStore::new()))
    .failure_mode(FailureMode::Closed)
    .build()
    .unwrap()
}

#[test]
fn a_fixed_cost_above_capacity_is_a_500_and_a_request_cost_above_it_a_413() {
    let (lines, _logs) = tollgate_testkit::logs::capture();

    let later = limiter("later", 10);
    let handler = || get(|| async { "ok" });
    let mut app = Router::new()
        .route(
            "/fixed",
            handler().route_layer(
                RateLimitLayer::new(limiter("fixed", 10), RouteKey).cost(FixedCost(11)),
            ),
        )
        .route(
            "/source",
            handler().route_layer(
                RateLimitLayer::new(limiter("source", 10), RouteKey)
                    .cost(CostSource::Fixed(FixedCost(11))),
            ),
        )
        .route(
            "/later",
            handler().route_layer(RateLimitLayer::new(later.clone(), RouteKey).cost(FixedCost(5))),
        )
        .route(
            "/custom",
            handler().route_layer(RateLimitLayer::new(limiter("custom", 10), RouteKey).cost(Items)),
        );

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut status = |path: &str, items: u64| {
        runtime.block_on(async {
            poll_fn(|cx| Service::<Request<Body>>::poll_ready(&mut app, cx))
                .await
                .unwrap();
            let req = Request::get(path)
                .header("x-items", items.to_string())
                .body(Body::empty())
                .unwrap();
            let resp = app.call(req).await.unwrap();
            eprintln!("{path} (x-items {items}): {}", resp.status());
            resp.status()
        })
    };

    // The server's own configuration: 500, never the client's 413; logged once for the
    // spell, not on every request.
    for _ in 0..20 {
        assert_eq!(status("/fixed", 1), StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(status("/source", 1), StatusCode::INTERNAL_SERVER_ERROR);
    // A fixed cost that fitted, until the policy in force shrank under it.
    assert_eq!(status("/later", 1), StatusCode::OK);
    later.set_policy(Policy::fixed_window(3, Duration::from_secs(3600)).unwrap());
    assert_eq!(status("/later", 1), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(status("/later", 1), StatusCode::INTERNAL_SERVER_ERROR);
    // fixed again, then broken again: a new spell, logged again
    later.set_policy(Policy::fixed_window(10, Duration::from_secs(3600)).unwrap());
    assert_eq!(status("/later", 1), StatusCode::OK);
    later.set_policy(Policy::fixed_window(3, Duration::from_secs(3600)).unwrap());
    assert_eq!(status("/later", 1), StatusCode::INTERNAL_SERVER_ERROR);
    // The request's content decided its cost: 413, and nothing logged at error.
    assert_eq!(status("/custom", 11), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(status("/custom", 10), StatusCode::OK);

    for (route, spells) in [("fixed", 1), ("source", 1), ("later", 2)] {
        let errors = lines.matching(&["ERROR", "tollgate_http", &format!("route=\"{route}\"")]);
        eprintln!("{route}: {errors:#?}");
        assert_eq!(errors.len(), spells, "{route}: {errors:#?}");
        assert!(errors[0].contains("own cost"), "{}", errors[0]);
    }
    assert!(
        lines
            .matching(&["ERROR", "tollgate_http", "route=\"custom\""])
            .is_empty()
    );
}

/// `HeaderCost::new(name, default, min, max)`: a declared cost outside `min..=max` is refused
/// with 400 — below `min` too, or a client declares a cost of 1 on a route whose operator set
/// every request to cost at least `min`, and is charged less than the work it asks for.
mod declared_cost_bounds {

    use axum::http::{HeaderName, Request, StatusCode};
    use tollgate_http::{CostFn, HeaderCost};

    #[test]
    fn a_declared_cost_outside_the_bounds_is_refused_at_both_ends() {
        let cost = HeaderCost::new(HeaderName::from_static("x-cost"), 5, 5, 10).unwrap();
        let with = |v: &str| Request::builder().header("x-cost", v).body(()).unwrap();
        for below in ["1", "2", "4"] {
            let refused = cost.cost(&with(below)).unwrap_err();
            assert_eq!(
                refused.status(),
                StatusCode::BAD_REQUEST,
                "{below} is below min 5"
            );
        }
        for above in ["11", "1000"] {
            let refused = cost.cost(&with(above)).unwrap_err();
            assert_eq!(
                refused.status(),
                StatusCode::BAD_REQUEST,
                "{above} is above max 10"
            );
        }
        for inside in [5, 7, 10] {
            assert_eq!(cost.cost(&with(&inside.to_string())).unwrap(), inside);
        }
        assert_eq!(
            cost.cost(&Request::new(())).unwrap(),
            5,
            "absent: the default"
        );
    }
}
