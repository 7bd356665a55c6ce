//! The tower [`Layer`] and [`Service`]: one [`Limiter`] (policy, store, failure mode) guarding
//! the services it wraps, keyed by a [`KeyExtractor`] and weighted by a [`CostFn`].
//!
//! Put one layer on each route that needs its own quota:
//!
//! ```
//! use std::sync::Arc;
//! use axum::{Router, routing::post};
//! use tollgate::{FailureMode, Limiter, LocalStore, Policy};
//! use tollgate_http::{ClientIpKey, RateLimitLayer, TrustedProxies};
//!
//! let login = Limiter::builder("login", "sliding-log:limit=5,window=1m".parse::<Policy>().unwrap())
//!     .store(Arc::new(LocalStore::new()))
//!     .failure_mode(FailureMode::Closed)
//!     .build()
//!     .unwrap();
//! let app: Router = Router::new().route(
//!     "/login",
//!     post(|| async { "welcome" })
//!         .route_layer(RateLimitLayer::new(login, ClientIpKey::new(TrustedProxies::none()))),
//! );
//! // axum::serve(listener, app.into_make_service_with_connect_info::<std::net::SocketAddr>())
//! ```
//!
//! Attach it with `route_layer` (on a `MethodRouter` or a `Router`): it then runs only for
//! requests that match a route and method, so a 404 or 405 never consumes quota. (A
//! `MethodRouter` built with `any` has no per-method routes: give it `layer` instead.)
//!
//! An admitted request reaches the inner service with its [`Decision`](tollgate::Decision) in
//! the request extensions (`axum::Extension<Decision>`), and its response gets the quota
//! fields. The other outcomes are answered by the layer itself; see [`crate::response`].
//!
//! `Degraded` and `Bypassed` decisions look like ordinary ones to the client (same fields; a
//! bypass is shown as an untouched bucket would answer, see
//! [`RateLimitResponses::decorate_with_cost`]). Operators see them in the logs (`tracing`,
//! target `tollgate_http`) once per change of a route's enforcement — a warning when it starts
//! deciding without the shared store, a note when it is back — and every one of them in
//! `tollgate_http_responses_total{route, status, enforcement}` (the limiter itself counts
//! `tollgate_decisions_total{operation, outcome, enforcement}`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::{Context, Poll};

use axum::http::{Request, Response};
use tollgate::{Enforcement, Error, Limiter, PolicyError, StoreError};
use tower::{Layer, Service};

use crate::cost::{CostFn, FixedCost};
use crate::key::KeyExtractor;
use crate::response::RateLimitResponses;

/// Rate-limits the services it wraps with one [`Limiter`]; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct RateLimitLayer<K, C = FixedCost> {
    limiter: Limiter,
    key: K,
    cost: C,
    responses: RateLimitResponses,
    enforcement: Arc<LastEnforcement>,
    /// Shared by every service the layer builds (axum may build one per request).
    misconfigured: Arc<AtomicBool>,
}

impl<K: KeyExtractor> RateLimitLayer<K, FixedCost> {
    /// Limits with `limiter`, keyed by `key`, each request costing 1. The policy name in the
    /// response fields is the limiter's operation; the policy fields (`RateLimit-Policy`, the
    /// limit) show the limiter's policy in force when the request was decided, following
    /// [`Limiter::set_policy`] from the next request on.
    pub fn new(limiter: Limiter, key: K) -> Self {
        let responses = RateLimitResponses::for_limiter(&limiter);
        Self {
            limiter,
            key,
            cost: FixedCost::default(),
            responses,
            enforcement: Arc::default(),
            misconfigured: Arc::default(),
        }
    }
}

impl<K: KeyExtractor, C: CostFn> RateLimitLayer<K, C> {
    /// Weighs each request with `cost` instead.
    pub fn cost<C2: CostFn>(self, cost: C2) -> RateLimitLayer<K, C2> {
        RateLimitLayer {
            limiter: self.limiter,
            key: self.key,
            cost,
            responses: self.responses,
            enforcement: self.enforcement,
            misconfigured: self.misconfigured,
        }
    }

    /// Also sends the legacy `X-RateLimit-*` headers (off by default).
    #[must_use]
    pub fn legacy_headers(mut self, enabled: bool) -> Self {
        self.responses = self.responses.legacy_headers(enabled);
        self
    }

    /// The limiter.
    pub fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// The response builder.
    pub fn responses(&self) -> &RateLimitResponses {
        &self.responses
    }
}

impl<S, K: KeyExtractor, C: CostFn> Layer<S> for RateLimitLayer<K, C> {
    type Service = RateLimit<S, K, C>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            shared: Arc::new(Shared {
                limiter: self.limiter.clone(),
                key: self.key.clone(),
                cost: self.cost.clone(),
                responses: self.responses.clone(),
                enforcement: self.enforcement.clone(),
                misconfigured: self.misconfigured.clone(),
            }),
        }
    }
}

/// The service built by [`RateLimitLayer`].
#[derive(Debug)]
pub struct RateLimit<S, K, C> {
    inner: S,
    shared: Arc<Shared<K, C>>,
}

impl<S: Clone, K, C> Clone for RateLimit<S, K, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

#[derive(Debug)]
struct Shared<K, C> {
    limiter: Limiter,
    key: K,
    cost: C,
    responses: RateLimitResponses,
    enforcement: Arc<LastEnforcement>,
    /// The route answered 500 for its own misconfiguration (a cost of 0, a fixed cost above
    /// the policy's capacity) since it last decided a request: logged once per such spell,
    /// not on every request (each is still counted).
    misconfigured: Arc<AtomicBool>,
}

impl<K, C> Shared<K, C> {
    /// Whether to log this misconfigured request: the first since the route last decided one.
    fn first_misconfigured(&self) -> bool {
        !self.misconfigured.swap(true, Ordering::Relaxed)
    }

    /// The route decided a request: a later misconfiguration is logged again. A plain read
    /// while nothing changes.
    fn decided(&self) {
        if self.misconfigured.load(Ordering::Relaxed) {
            self.misconfigured.store(false, Ordering::Relaxed);
        }
    }
}

/// The enforcement of a route's last decision, so that a change is logged once rather than
/// every non-shared decision (a flood under an outage). Shared by every service one layer
/// builds; the metrics still count each decision.
#[derive(Debug, Default)]
struct LastEnforcement(AtomicU8);

impl LastEnforcement {
    /// Logs when `now` differs from the last decision's enforcement: a warning when the
    /// route starts deciding without the shared store, a note when it is back. A plain read
    /// while nothing changes; of racing callers that see a change, one logs it.
    fn observe(&self, route: &str, now: Enforcement) {
        let code = match now {
            Enforcement::Shared => 0,
            Enforcement::Degraded => 1,
            _ => 2,
        };
        if self.0.load(Ordering::Relaxed) == code {
            return;
        }
        let before = match self.0.swap(code, Ordering::Relaxed) {
            previous if previous == code => return,
            0 => "shared",
            1 => "degraded",
            _ => "bypassed",
        };
        if now == Enforcement::Shared {
            tracing::info!(target: "tollgate_http", route, from = before, "decided by the shared store again");
        } else {
            tracing::warn!(
                target: "tollgate_http",
                route,
                from = before,
                enforcement = now.as_str(),
                "decided without the shared store (logged again when the enforcement changes; metrics count every decision)"
            );
        }
    }
}

/// The future of [`RateLimit`]: boxed, as it awaits the limiter and then the inner service.
pub type ResponseFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, K, C, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, C>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    K: KeyExtractor,
    C: CostFn,
    ReqB: Send + 'static,
    ResB: From<String> + Send + 'static,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<Response<ResB>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqB>) -> Self::Future {
        // Take the service that was polled ready; leave a fresh clone for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let route = shared.limiter.operation();
            let responses = &shared.responses;
            let decided = shared
                .key
                .extract(&request)
                .and_then(|key| Ok((key, shared.cost.cost(&request)?)));
            let (key, cost) = match decided {
                Ok(v) => v,
                Err(rejection) => {
                    count(route, rejection.status().as_u16(), "none");
                    return Ok(responses.rejected(&rejection));
                }
            };
            if cost == 0 {
                // The cost function broke its contract (at least 1): the server's
                // misconfiguration, so not the client's 400.
                if shared.first_misconfigured() {
                    tracing::error!(target: "tollgate_http", route, "the route's cost function returned 0 (costs are at least 1); answering 500 (logged again once the route has decided a request)");
                }
                count(route, 500, "none");
                return Ok(crate::response::misconfigured());
            }
            // The policy this request is decided under, read before the limiter reads it:
            // the response shows it even if the policy changes while the handler runs.
            let policy = responses.policy();
            let decision = match shared.limiter.check([key], cost).await {
                Ok(d) => d,
                Err(error) => {
                    if shared.cost.chosen_by_server(&request)
                        && let Some(e) = cost_above_capacity(&error)
                    {
                        // A cost the server chose (the route's fixed cost, a header cost's
                        // default) can never pass its policy (as built, or since a policy
                        // change): the server's misconfiguration, not the client's 413.
                        if shared.first_misconfigured() {
                            tracing::error!(target: "tollgate_http", route, error = %e, "the route's own cost (fixed, or its cost header's default) exceeds its policy's capacity, so no request that leaves the cost to the server can pass; answering 500 (logged again once the route has decided a request)");
                        }
                        count(route, 500, "none");
                        return Ok(crate::response::misconfigured());
                    }
                    let response = responses.error(&error);
                    tracing::debug!(target: "tollgate_http", route, status = response.status().as_u16(), %error, "rate limiter could not decide");
                    count(route, response.status().as_u16(), "none");
                    return Ok(response);
                }
            };
            shared.decided();
            shared.enforcement.observe(route, decision.enforcement);
            if !decision.allowed {
                count(route, 429, decision.enforcement.as_str());
                return Ok(responses.denied_under(&decision, &policy));
            }
            request.extensions_mut().insert(decision.clone());
            let mut response = inner.call(request).await?;
            responses.decorate_response(&decision, cost, &policy, &mut response);
            count(
                route,
                response.status().as_u16(),
                decision.enforcement.as_str(),
            );
            Ok(response)
        })
    }
}

/// The policy's refusal of a cost above its capacity, if that is what `error` is.
fn cost_above_capacity(error: &Error) -> Option<&PolicyError> {
    match error {
        Error::Invalid(StoreError::InvalidPolicy(e @ PolicyError::CostAboveCapacity { .. })) => {
            Some(e)
        }
        _ => None,
    }
}

fn count(route: &str, status: u16, enforcement: &'static str) {
    metrics::counter!(
        "tollgate_http_responses_total",
        "route" => route.to_owned(),
        "status" => status.to_string(),
        "enforcement" => enforcement
    )
    .increment(1);
}
