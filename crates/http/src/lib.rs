//! tollgate in front of an axum or tower service: a [`RateLimitLayer`] per route, keyed by
//! client IP, a header, the authenticated user or the route, weighted by a cost, and answered
//! with responses whose status, `Retry-After` and IETF `RateLimit` / `RateLimit-Policy` fields
//! all come from the same [`Decision`](tollgate::Decision).
//!
//! - [`layer`]: the tower `Layer` / `Service`.
//! - [`key`] and [`client_ip`]: which bucket a request draws from (proxy-aware client IP).
//! - [`cost`]: how much of the quota a request consumes.
//! - [`response`]: 429 / 413 / 503 and the quota fields.
//! - [`config`]: the TOML policy file and its built-in default.
//!
//! ```
//! use std::sync::Arc;
//! use axum::{Router, routing::get};
//! use tollgate::{FailureMode, Limiter, LocalStore, Policy, Rate};
//! use tollgate_http::{HeaderCost, HeaderKey, RateLimitLayer};
//!
//! let limiter = Limiter::builder("search", Policy::token_bucket(10, Rate::per_second(1)).unwrap())
//!     .store(Arc::new(LocalStore::new()))
//!     .failure_mode(FailureMode::degraded(2))
//!     .build()
//!     .unwrap();
//! let layer = RateLimitLayer::new(limiter, HeaderKey::new("x-api-key".parse().unwrap()))
//!     .cost(HeaderCost::new("x-cost".parse().unwrap(), 1, 1, 100).unwrap());
//! let app: Router = Router::new().route("/api/search", get(|| async { "results" }).route_layer(layer));
//! ```
//!
//! See `docs/http.md` in the repository for the full behaviour, status codes and policy file.

pub mod client_ip;
pub mod config;
pub mod cost;
pub mod key;
pub mod layer;
pub mod response;

pub use client_ip::{
    Cidr, CidrError, ClientIpKey, ForwardedHeader, PrefixLenError, TrustedProxies,
};
pub use config::{
    BUILTIN_POLICY_FILE, ConfigError, FailureChoice, PolicyFile, RouteConfig, RouteLayer,
};
pub use cost::{CostBoundsError, CostFn, CostSource, FixedCost, HeaderCost};
pub use key::{
    AuthenticatedUser, HeaderKey, KeyExtractor, KeySource, Rejection, RouteKey, UserKey,
};
pub use layer::{RateLimit, RateLimitLayer};
pub use response::RateLimitResponses;
