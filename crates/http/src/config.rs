//! The policy file: routes, their keys, costs, policies and failure modes in TOML, validated
//! up front with errors that name the field and the line. [`PolicyFile::builtin`] is the
//! demo's default (`policies/default.toml` in this crate).
//!
//! ```
//! use tollgate_http::PolicyFile;
//!
//! let file = PolicyFile::parse(r#"
//! [[route]]
//! name = "login"
//! path = "/login"
//! method = "POST"
//! key = "ip"
//! policy = "sliding-log:limit=5,window=1m"
//! failure_mode = "closed"
//! "#).unwrap();
//! assert_eq!(file.routes[0].policy.limit(), 5);
//!
//! let err = PolicyFile::parse(r#"
//! [[route]]
//! name = "login"
//! path = "/login"
//! key = "ip"
//! policy = "sliding-log:limit=0,window=1m"
//! failure_mode = "closed"
//! "#).unwrap_err();
//! assert_eq!((err.line, err.field.as_str()), (6, "route[0].policy"));
//! ```
//!
//! Every field of a `[[route]]`:
//!
//! | field | required | meaning |
//! |---|---|---|
//! | `name` | yes | policy name in the response fields and key namespace: `[a-z0-9_.-]`, unique |
//! | `path` | yes | axum route path, e.g. `/items/{id}`; refused if axum would not route it, or it conflicts with an earlier route's |
//! | `method` | no | only this method is limited and served (one axum routes: `GET`, `HEAD`, `POST`, `PUT`, `DELETE`, `PATCH`, `OPTIONS`, `TRACE`, `CONNECT`); any method if absent |
//! | `key` | yes | `"ip"`, `"header:NAME"`, `"user"` or `"route"` |
//! | `cost` | no | an integer (default 1) or `{ header = "x-cost", default = 1, min = 1, max = 100 }` |
//! | `policy` | yes | a policy spec, e.g. `"token-bucket:capacity=10,rate=2"` |
//! | `failure_mode` | yes | `"open"`, `"closed"` or `"degraded"` |
//! | `expected_instances` | with `degraded` | the instances sharing the quota: each enforces the quota divided by this while the store is down; refused with `open` or `closed` |
//! | `timeout` | no | deadline of one store call, a duration with its unit as policy windows take it, e.g. `"100ms"`, `"1s 500ms"`, `"1h"` (default 250 ms) |
//! | `challenge` | no | with `key = "user"`: the `WWW-Authenticate` challenge of the 401 a request without a user gets, e.g. `"Basic realm=\"api\""` (default `"Bearer"`) |
//!
//! Top level: `legacy_headers = true|false`, a `[proxies]` table with `trusted = [CIDR...]`
//! and `header = "x-forwarded-for" | "forwarded"`, and a `[client_ip]` table with
//! `ipv6_prefix` (0-128, default 64) and `ipv4_prefix` (0-32, default 32): how `key = "ip"`
//! groups client addresses into buckets (see [`ClientIpKey`]).

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, Method};
use axum::routing::MethodFilter;
use serde::Deserialize;
use tollgate::{FailureMode, Key, Limiter, LimiterBuilder, Policy, Store};
use toml::Spanned;

use crate::client_ip::{Cidr, ClientIpKey, ForwardedHeader, TrustedProxies};
use crate::cost::{CostSource, FixedCost, HeaderCost};
use crate::key::{HeaderKey, KeySource, RouteKey, UserKey};
use crate::layer::RateLimitLayer;

/// The methods a route's `method` may name: those axum routes by (`MethodFilter`).
const ROUTABLE_METHODS: &str = "GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS, TRACE, CONNECT";

/// The layer a policy-file route gets.
pub type RouteLayer = RateLimitLayer<KeySource, CostSource>;

/// The built-in policy file: three routes, each under a different algorithm.
pub const BUILTIN_POLICY_FILE: &str = include_str!("../policies/default.toml");

/// Why a policy file was refused: where, which field, and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}, column {column}: {}{message}", field_prefix(field))]
pub struct ConfigError {
    /// 1-based line of the offending value.
    pub line: usize,
    /// 1-based column of the offending value.
    pub column: usize,
    /// The field, e.g. `route[1].policy` (empty when the file does not parse as TOML at all).
    pub field: String,
    /// What was wrong.
    pub message: String,
}

fn field_prefix(field: &str) -> String {
    if field.is_empty() {
        String::new()
    } else {
        format!("{field}: ")
    }
}

/// What a route does when its store cannot answer; becomes a [`FailureMode`] (a fresh local
/// store per route for `Degraded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureChoice {
    /// `failure_mode = "open"`.
    Open,
    /// `failure_mode = "closed"`.
    Closed,
    /// `failure_mode = "degraded"` with `expected_instances` (required).
    Degraded {
        /// Instances sharing the quota.
        expected_instances: u32,
    },
}

impl FailureChoice {
    /// The failure mode.
    pub fn to_mode(self) -> FailureMode {
        match self {
            Self::Open => FailureMode::Open,
            Self::Closed => FailureMode::Closed,
            Self::Degraded { expected_instances } => FailureMode::degraded(expected_instances),
        }
    }
}

/// `open`, `closed` or `degraded(expected_instances=N)` (the demo lists its routes so).
impl fmt::Display for FailureChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Open => f.write_str("open"),
            Self::Closed => f.write_str("closed"),
            Self::Degraded { expected_instances } => {
                write!(f, "degraded(expected_instances={expected_instances})")
            }
        }
    }
}

/// One validated `[[route]]`.
#[derive(Debug, Clone)]
pub struct RouteConfig {
    /// Policy name and key namespace.
    pub name: String,
    /// The axum route path.
    pub path: String,
    /// The method, or `None` for any.
    pub method: Option<Method>,
    /// The key extractor.
    pub key: KeySource,
    /// The cost function.
    pub cost: CostSource,
    /// The policy.
    pub policy: Policy,
    /// The policy as written in the file.
    pub policy_spec: String,
    /// The failure mode.
    pub failure: FailureChoice,
    /// Store-call deadline, if set.
    pub timeout: Option<Duration>,
    /// Line of the route's `name` in the file.
    pub line: usize,
}

impl RouteConfig {
    /// A limiter builder with this route's name, policy, failure mode and timeout, on `store`.
    pub fn limiter(&self, store: Arc<dyn Store>) -> LimiterBuilder {
        let builder = Limiter::builder(self.name.clone(), self.policy)
            .store(store)
            .failure_mode(self.failure.to_mode());
        match self.timeout {
            Some(t) => builder.timeout(t),
            None => builder,
        }
    }

    /// The route's layer around `limiter`.
    pub fn layer(&self, limiter: Limiter, legacy_headers: bool) -> RouteLayer {
        RateLimitLayer::new(limiter, self.key.clone())
            .cost(self.cost.clone())
            .legacy_headers(legacy_headers)
    }
}

/// A validated policy file.
#[derive(Debug, Clone)]
pub struct PolicyFile {
    /// Send the legacy `X-RateLimit-*` headers too.
    pub legacy_headers: bool,
    /// Proxies whose forwarding headers are believed.
    pub proxies: TrustedProxies,
    /// The routes, in file order.
    pub routes: Vec<RouteConfig>,
}

impl PolicyFile {
    /// The built-in file ([`BUILTIN_POLICY_FILE`]).
    pub fn builtin() -> Self {
        Self::parse(BUILTIN_POLICY_FILE).expect("the built-in policy file is valid")
    }

    /// Parses and validates `text`.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| {
            let span = e.span().unwrap_or(0..0);
            locate(text, &span, &key_on_line(text, span.start), e.message())
        })?;
        Validator { text }.file(raw)
    }

    /// Layers for every route, each with its own [`Limiter`] on `store` (see
    /// [`RouteConfig::limiter`] to adjust a limiter first), in file order.
    pub fn layers(
        &self,
        store: &Arc<dyn Store>,
    ) -> Result<Vec<(RouteConfig, RouteLayer)>, tollgate::Error> {
        self.routes
            .iter()
            .map(|route| {
                let limiter = route.limiter(store.clone()).build()?;
                Ok((route.clone(), route.layer(limiter, self.legacy_headers)))
            })
            .collect()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    legacy_headers: bool,
    #[serde(default)]
    proxies: Option<RawProxies>,
    #[serde(default)]
    client_ip: Option<RawClientIp>,
    #[serde(default, rename = "route")]
    routes: Vec<RawRoute>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProxies {
    #[serde(default)]
    trusted: Vec<Spanned<String>>,
    #[serde(default)]
    header: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClientIp {
    #[serde(default)]
    ipv4_prefix: Option<Spanned<i64>>,
    #[serde(default)]
    ipv6_prefix: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    name: Spanned<String>,
    path: Spanned<String>,
    #[serde(default)]
    method: Option<Spanned<String>>,
    key: Spanned<String>,
    #[serde(default)]
    cost: Option<Spanned<toml::Value>>,
    policy: Spanned<String>,
    failure_mode: Spanned<String>,
    #[serde(default)]
    expected_instances: Option<Spanned<i64>>,
    #[serde(default)]
    timeout: Option<Spanned<String>>,
    #[serde(default)]
    challenge: Option<Spanned<String>>,
}

struct Validator<'a> {
    text: &'a str,
}

impl Validator<'_> {
    fn err<T>(
        &self,
        span: &Range<usize>,
        field: &str,
        message: impl fmt::Display,
    ) -> Result<T, ConfigError> {
        Err(locate(self.text, span, field, &message.to_string()))
    }

    fn file(&self, raw: RawFile) -> Result<PolicyFile, ConfigError> {
        let proxies = match raw.proxies {
            None => TrustedProxies::none(),
            Some(p) => self.proxies(&p)?,
        };
        let client_ip = self.client_ip(raw.client_ip.as_ref(), &proxies)?;
        let mut routes = Vec::with_capacity(raw.routes.len());
        let mut names = HashSet::new();
        // (path, method) pairs taken; a route without a method takes every method.
        let mut taken: Vec<(String, Option<Method>)> = Vec::new();
        // Every distinct path, as axum will route it (axum 0.8 routes with this matchit):
        // a path it cannot insert would panic `Router::route` when the routes are served.
        let mut paths = matchit::Router::new();
        for (i, raw_route) in raw.routes.iter().enumerate() {
            let route = self.route(i, raw_route, &client_ip)?;
            if !names.insert(route.name.clone()) {
                return self.err(
                    &raw_route.name.span(),
                    &format!("route[{i}].name"),
                    format_args!("route name {:?} is used twice", route.name),
                );
            }
            // The same path again (another method) is one axum route: checked below.
            if !taken.iter().any(|(path, _)| *path == route.path)
                && let Err(e) = paths.insert(route.path.clone(), ())
            {
                return self.err(
                    &raw_route.path.span(),
                    &format!("route[{i}].path"),
                    path_error(&route.path, &e, &routes),
                );
            }
            let clash = taken.iter().any(|(path, method)| {
                *path == route.path
                    && (method.is_none() || route.method.is_none() || *method == route.method)
            });
            if clash {
                let span = raw_route
                    .method
                    .as_ref()
                    .map_or_else(|| raw_route.path.span(), Spanned::span);
                return self.err(
                    &span,
                    &format!("route[{i}].path"),
                    format_args!(
                        "{} {} is already limited by an earlier route",
                        route.method.as_ref().map_or("*", Method::as_str),
                        route.path
                    ),
                );
            }
            taken.push((route.path.clone(), route.method.clone()));
            routes.push(route);
        }
        Ok(PolicyFile {
            legacy_headers: raw.legacy_headers,
            proxies,
            routes,
        })
    }

    /// The `key = "ip"` extractor: `proxies`, and the prefix lengths of `[client_ip]`.
    fn client_ip(
        &self,
        raw: Option<&RawClientIp>,
        proxies: &TrustedProxies,
    ) -> Result<ClientIpKey, ConfigError> {
        let mut key = ClientIpKey::new(proxies.clone());
        let Some(raw) = raw else {
            return Ok(key);
        };
        for (field, value, max) in [
            ("client_ip.ipv4_prefix", &raw.ipv4_prefix, 32),
            ("client_ip.ipv6_prefix", &raw.ipv6_prefix, 128),
        ] {
            let Some(value) = value else { continue };
            let len = match u8::try_from(*value.get_ref()) {
                Ok(len) if len <= max => len,
                _ => {
                    return self.err(
                        &value.span(),
                        field,
                        format_args!("prefix length must be 0 to {max}, got {}", value.get_ref()),
                    );
                }
            };
            key = if max == 32 {
                key.ipv4_prefix(len)
            } else {
                key.ipv6_prefix(len)
            }
            .expect("checked above");
        }
        Ok(key)
    }

    fn proxies(&self, raw: &RawProxies) -> Result<TrustedProxies, ConfigError> {
        let mut nets = Vec::new();
        for (i, net) in raw.trusted.iter().enumerate() {
            match net.get_ref().parse::<Cidr>() {
                Ok(cidr) => nets.push(cidr),
                Err(e) => return self.err(&net.span(), &format!("proxies.trusted[{i}]"), e),
            }
        }
        let header = match &raw.header {
            None => ForwardedHeader::default(),
            Some(h) => match h.get_ref().to_ascii_lowercase().as_str() {
                "x-forwarded-for" => ForwardedHeader::XForwardedFor,
                "forwarded" => ForwardedHeader::Forwarded,
                other => {
                    return self.err(
                        &h.span(),
                        "proxies.header",
                        format_args!("{other:?} is not \"x-forwarded-for\" or \"forwarded\""),
                    );
                }
            },
        };
        Ok(TrustedProxies::new(nets, header))
    }

    fn route(
        &self,
        i: usize,
        raw: &RawRoute,
        client_ip: &ClientIpKey,
    ) -> Result<RouteConfig, ConfigError> {
        let field = |name: &str| format!("route[{i}].{name}");

        let name = raw.name.get_ref().clone();
        if let Err(e) = Key::new(&name, std::iter::empty::<&[u8]>()) {
            return self.err(&raw.name.span(), &field("name"), e);
        }

        let path = raw.path.get_ref().clone();
        if !path.starts_with('/')
            || path
                .split('/')
                .any(|s| s.starts_with(':') || s.starts_with('*'))
        {
            return self.err(
                &raw.path.span(),
                &field("path"),
                format_args!(
                    "{path:?} must start with / and write parameters as {{name}} or {{*rest}}"
                ),
            );
        }

        let method = match &raw.method {
            None => None,
            Some(m) => match Method::from_bytes(m.get_ref().to_ascii_uppercase().as_bytes()) {
                // Only a method axum can route: the server builds each route with its
                // `MethodFilter`, which a token such as PURGE has none of.
                Ok(method)
                    if !m.get_ref().is_empty()
                        && MethodFilter::try_from(method.clone()).is_ok() =>
                {
                    Some(method)
                }
                Ok(method) if !m.get_ref().is_empty() => {
                    return self.err(
                        &m.span(),
                        &field("method"),
                        format_args!(
                            "{:?} cannot be routed; a route's method is one of {ROUTABLE_METHODS}, or leave it out to serve every method",
                            method.as_str()
                        ),
                    );
                }
                _ => {
                    return self.err(
                        &m.span(),
                        &field("method"),
                        format_args!("{:?} is not an HTTP method", m.get_ref()),
                    );
                }
            },
        };

        let key = self.key(&raw.key, &field("key"), client_ip)?;
        let key = match (&raw.challenge, key) {
            (None, key) => key,
            (Some(c), KeySource::User(_)) => match HeaderValue::from_str(c.get_ref().trim()) {
                Ok(v) if !v.is_empty() => KeySource::User(UserKey::with_challenge(v)),
                _ => {
                    return self.err(
                        &c.span(),
                        &field("challenge"),
                        format_args!(
                            "{:?} is not a WWW-Authenticate challenge such as \"Bearer\" or \"Basic realm=\\\"api\\\"\"",
                            c.get_ref()
                        ),
                    );
                }
            },
            (Some(c), _) => {
                return self.err(
                    &c.span(),
                    &field("challenge"),
                    "only a route keyed by \"user\" answers 401 with a challenge",
                );
            }
        };

        let policy = match raw.policy.get_ref().parse::<Policy>() {
            Ok(p) => p,
            Err(e) => return self.err(&raw.policy.span(), &field("policy"), e),
        };

        let cost = match &raw.cost {
            None => CostSource::default(),
            Some(c) => self.cost(c, &field("cost"), &policy)?,
        };

        let failure = self.failure(raw, &field)?;
        let timeout = self.timeout(raw.timeout.as_ref(), &field("timeout"))?;

        Ok(RouteConfig {
            name,
            path,
            method,
            key,
            cost,
            policy,
            policy_spec: raw.policy.get_ref().clone(),
            failure,
            timeout,
            line: line_col(self.text, raw.name.span().start).0,
        })
    }

    fn failure(
        &self,
        raw: &RawRoute,
        field: &dyn Fn(&str) -> String,
    ) -> Result<FailureChoice, ConfigError> {
        let mode = raw.failure_mode.get_ref().as_str();
        match (mode, &raw.expected_instances) {
            ("open", None) => Ok(FailureChoice::Open),
            ("closed", None) => Ok(FailureChoice::Closed),
            // No default: the count decides how much of the quota each instance enforces on
            // its own, so a missing one would silently be the whole quota on every instance.
            ("degraded", None) => self.err(
                &raw.failure_mode.span(),
                &field("expected_instances"),
                "required with failure_mode = \"degraded\": the number of instances sharing \
                 the quota (each enforces its share locally while the store is down)",
            ),
            ("degraded", Some(n)) => match u32::try_from(*n.get_ref()) {
                Ok(n) if n >= 1 => Ok(FailureChoice::Degraded {
                    expected_instances: n,
                }),
                _ => self.err(
                    &n.span(),
                    &field("expected_instances"),
                    format_args!(
                        "must be an integer from 1 to {}, got {}",
                        u32::MAX,
                        n.get_ref()
                    ),
                ),
            },
            ("open" | "closed", Some(n)) => self.err(
                &n.span(),
                &field("expected_instances"),
                "only applies with failure_mode = \"degraded\"",
            ),
            (other, _) => self.err(
                &raw.failure_mode.span(),
                &field("failure_mode"),
                format_args!("{other:?} is not \"open\", \"closed\" or \"degraded\""),
            ),
        }
    }

    fn timeout(
        &self,
        raw: Option<&Spanned<String>>,
        field: &str,
    ) -> Result<Option<Duration>, ConfigError> {
        let timeout = match raw {
            None => None,
            Some(t) => match humantime::parse_duration(t.get_ref().trim()).ok() {
                Some(d) if !d.is_zero() => Some(d),
                _ => {
                    return self.err(
                        &t.span(),
                        field,
                        format_args!(
                            "{:?} is not a duration such as \"250ms\" or \"1s\"",
                            t.get_ref()
                        ),
                    );
                }
            },
        };
        Ok(timeout)
    }

    fn key(
        &self,
        raw: &Spanned<String>,
        field: &str,
        client_ip: &ClientIpKey,
    ) -> Result<KeySource, ConfigError> {
        let text = raw.get_ref().as_str();
        Ok(match text {
            "ip" => KeySource::ClientIp(client_ip.clone()),
            "user" => KeySource::User(UserKey::new()),
            "route" => KeySource::Route(RouteKey),
            _ => match text
                .strip_prefix("header:")
                .map(|h| HeaderName::from_bytes(h.trim().as_bytes()))
            {
                Some(Ok(name)) => KeySource::Header(HeaderKey::new(name)),
                _ => {
                    return self.err(
                        &raw.span(),
                        field,
                        format_args!(
                            "{text:?} is not \"ip\", \"user\", \"route\" or \"header:NAME\""
                        ),
                    );
                }
            },
        })
    }

    fn cost(
        &self,
        raw: &Spanned<toml::Value>,
        field: &str,
        policy: &Policy,
    ) -> Result<CostSource, ConfigError> {
        let span = raw.span();
        let limit = policy.limit();
        match raw.get_ref() {
            toml::Value::Integer(n) => match u64::try_from(*n) {
                Ok(n) if (1..=limit).contains(&n) => Ok(CostSource::Fixed(FixedCost(n))),
                _ => self.err(
                    &span,
                    field,
                    format_args!(
                        "a fixed cost must be from 1 to the policy's limit {limit}, got {n}"
                    ),
                ),
            },
            toml::Value::Table(t) => {
                let mut header = None;
                let mut numbers = [("default", 1_u64), ("min", 1), ("max", limit)];
                for (k, v) in t {
                    match (k.as_str(), v) {
                        ("header", toml::Value::String(h)) => {
                            match HeaderName::from_bytes(h.as_bytes()) {
                                Ok(name) => header = Some(name),
                                Err(_) => {
                                    return self.err(
                                        &span,
                                        &format!("{field}.header"),
                                        format_args!("{h:?} is not a header name"),
                                    );
                                }
                            }
                        }
                        (name @ ("default" | "min" | "max"), toml::Value::Integer(n)) => {
                            let Ok(n) = u64::try_from(*n) else {
                                return self.err(
                                    &span,
                                    &format!("{field}.{name}"),
                                    format_args!("must not be negative, got {n}"),
                                );
                            };
                            if let Some(slot) = numbers.iter_mut().find(|(k, _)| *k == name) {
                                slot.1 = n;
                            }
                        }
                        (name, _) => return self.err(
                            &span,
                            &format!("{field}.{name}"),
                            "expected header = \"NAME\" (a string) and integers default, min, max",
                        ),
                    }
                }
                let Some(header) = header else {
                    return self.err(
                        &span,
                        &format!("{field}.header"),
                        "missing: the header the cost is read from",
                    );
                };
                let [(_, default), (_, min), (_, max)] = numbers;
                if default > limit {
                    // The server's own choice of cost (for a request without the header) could
                    // never pass: a misconfiguration, not each such request's 413. (`min` is at
                    // most `default`, checked below.)
                    return self.err(
                        &span,
                        &format!("{field}.default"),
                        format_args!("must be at most the policy's limit {limit}, got {default}"),
                    );
                }
                HeaderCost::new(header, default, min, max)
                    .map(CostSource::Header)
                    .or_else(|e| self.err(&span, field, e))
            }
            other => self.err(
                &span,
                field,
                format_args!("expected an integer or a table, got {}", other.type_str()),
            ),
        }
    }
}

/// Why `path` cannot be routed next to the earlier `routes` (matchit's reason, in words
/// naming the earlier route where there is one).
fn path_error(path: &str, error: &matchit::InsertError, routes: &[RouteConfig]) -> String {
    match error {
        matchit::InsertError::Conflict { with } => {
            let earlier = routes
                .iter()
                .position(|r| r.path == *with)
                .map_or_else(String::new, |j| {
                    format!("route[{j}] ({:?}) at ", routes[j].name)
                });
            format!(
                "{path:?} conflicts with the path of an earlier route, {earlier}{with:?}: \
                 axum cannot route both (parameters in the same place must have the same \
                 name, and a catch-all cannot sit beside a parameter)"
            )
        }
        other => format!(
            "{path:?} is not a route path axum accepts: {other} (write parameters as \
             {{name}}, one per segment, or {{*rest}} at the end; literal braces as {{{{ and }}}})"
        ),
    }
}

fn locate(text: &str, span: &Range<usize>, field: &str, message: &str) -> ConfigError {
    let (line, column) = line_col(text, span.start);
    ConfigError {
        line,
        column,
        field: field.to_owned(),
        message: message.trim().to_owned(),
    }
}

/// 1-based line and column (in characters) of byte `offset`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

/// The key assigned on the line holding `offset` (`key = ...`), for errors from the TOML
/// deserializer, which give a span but not always the field.
fn key_on_line(text: &str, offset: usize) -> String {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    let line = &text[start..end];
    match line.split_once('=') {
        Some((k, _)) if !k.trim().starts_with('[') && !k.trim().starts_with('#') => {
            k.trim().to_owned()
        }
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_choice_displays_its_mode_and_instances() {
        assert_eq!(FailureChoice::Open.to_string(), "open");
        assert_eq!(FailureChoice::Closed.to_string(), "closed");
        assert_eq!(
            FailureChoice::Degraded {
                expected_instances: 3
            }
            .to_string(),
            "degraded(expected_instances=3)"
        );
    }

    const ROUTE: &str = r#"
[[route]]
name = "api"
path = "/api"
key = "route"
policy = "fixed-window:limit=10,window=1s"
failure_mode = "closed"
"#;

    fn with(line: &str) -> String {
        format!("{ROUTE}{line}\n")
    }

    fn error(text: &str) -> ConfigError {
        PolicyFile::parse(text).unwrap_err()
    }

    /// A method `Method` parses but axum cannot route (no `MethodFilter`): refused where it
    /// is written, rather than failing later when the server builds its routes.
    #[test]
    fn methods_axum_cannot_route_are_refused() {
        let text = "[[route]]\nname = \"api\"\npath = \"/api\"\nkey = \"route\"\nmethod = \"PURGE\"\npolicy = \"fixed-window:limit=10,window=1s\"\nfailure_mode = \"closed\"\n";
        assert_eq!(text.lines().nth(4), Some("method = \"PURGE\""));
        let e = error(text);
        assert_eq!(
            (e.line, e.column, e.field.as_str()),
            (5, 10, "route[0].method"),
            "{e}"
        );
        assert!(e.message.contains("PURGE"), "{e}");
        assert!(e.message.contains("GET"), "{e}");
        for routable in [
            "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "get",
        ] {
            let file = PolicyFile::parse(&text.replace("PURGE", routable))
                .unwrap_or_else(|e| panic!("{routable}: {e}"));
            assert_eq!(
                file.routes[0].method.as_ref().map(Method::as_str),
                Some(routable.to_ascii_uppercase().as_str())
            );
        }
    }

    #[test]
    fn builtin_file_has_a_route_per_algorithm() {
        let file = PolicyFile::builtin();
        let algorithms: HashSet<_> = file
            .routes
            .iter()
            .map(|r| r.policy.algorithm().name())
            .collect();
        assert_eq!(algorithms.len(), 3, "{algorithms:?}");
        assert!(file.legacy_headers);
    }

    /// A degraded route must say how many instances share its quota: there is no default,
    /// which would have every instance enforce the whole quota on its own during an outage.
    #[test]
    fn a_degraded_route_without_expected_instances_is_refused() {
        let degraded = ROUTE.replace("\"closed\"", "\"degraded\"");
        assert_eq!(degraded.lines().nth(6), Some("failure_mode = \"degraded\""));
        let e = error(&degraded);
        assert_eq!(
            (e.line, e.column, e.field.as_str()),
            (7, 16, "route[0].expected_instances"),
            "{e}"
        );
        assert!(
            e.message
                .starts_with("required with failure_mode = \"degraded\""),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "line 7, column 16: route[0].expected_instances: {}",
                e.message
            )
        );

        let file = PolicyFile::parse(&format!("{degraded}expected_instances = 3\n")).unwrap();
        assert_eq!(
            file.routes[0].failure,
            FailureChoice::Degraded {
                expected_instances: 3
            }
        );
        let e = error(&format!("{degraded}expected_instances = 0\n"));
        assert_eq!(
            (e.line, e.field.as_str()),
            (8, "route[0].expected_instances"),
            "{e}"
        );
    }

    #[test]
    fn errors_name_the_field_and_the_line() {
        let e = error(&ROUTE.replace("limit=10", "limit=0"));
        assert_eq!((e.line, e.field.as_str()), (6, "route[0].policy"), "{e}");
        assert!(e.message.contains("limit must be at least 1"), "{e}");

        let e = error(&ROUTE.replace("\"route\"", "\"cookie\""));
        assert_eq!((e.line, e.field.as_str()), (5, "route[0].key"), "{e}");

        let e = error(&ROUTE.replace("closed", "maybe"));
        assert_eq!(
            (e.line, e.field.as_str()),
            (7, "route[0].failure_mode"),
            "{e}"
        );

        let e = error(&with("expected_instances = 3"));
        assert_eq!(
            (e.line, e.field.as_str()),
            (8, "route[0].expected_instances"),
            "{e}"
        );

        let e = error(&with("cost = 11"));
        assert_eq!((e.line, e.field.as_str()), (8, "route[0].cost"), "{e}");

        let e = error(&with("cost = { header = \"x-cost\", min = 5, max = 2 }"));
        assert_eq!((e.line, e.field.as_str()), (8, "route[0].cost"), "{e}");

        // the server's own cost, for a request without the header, must fit
        let e = error(&with(
            "cost = { header = \"x-cost\", default = 20, max = 50 }",
        ));
        assert_eq!(
            (e.line, e.field.as_str()),
            (8, "route[0].cost.default"),
            "{e}"
        );
        assert!(e.message.contains("at most the policy's limit 10"), "{e}");

        let e = error(&with("method = \"GE T\""));
        assert_eq!((e.line, e.field.as_str()), (8, "route[0].method"), "{e}");

        let e = error(&ROUTE.replace("\"api\"", "\"API\""));
        assert_eq!((e.line, e.field.as_str()), (3, "route[0].name"), "{e}");
        assert_eq!(
            e.to_string(),
            format!("line 3, column 8: route[0].name: {}", e.message)
        );
    }

    #[test]
    fn serde_errors_name_the_field_and_the_line() {
        let e = error(&with("burst = 3"));
        assert_eq!(e.line, 8, "{e}");
        assert!(e.message.contains("burst"), "{e}");
        let e = error(&ROUTE.replace("\"closed\"", "3"));
        assert_eq!((e.line, e.field.as_str()), (7, "failure_mode"), "{e}");
        let e = error(&ROUTE.replace("policy = \"fixed-window:limit=10,window=1s\"\n", ""));
        assert!(e.message.contains("missing field `policy`"), "{e}");
        let e = error("legacy_headers = \n");
        assert_eq!(e.line, 1, "{e}");
    }

    #[test]
    fn overlapping_routes_and_names_are_refused() {
        let twice = format!("{ROUTE}{}", ROUTE.replace("\"api\"\n", "\"api2\"\n"));
        let e = error(&twice);
        assert_eq!((e.line, e.field.as_str()), (11, "route[1].path"), "{e}");
        let same_name = format!("{ROUTE}{}", ROUTE.replace("\"/api\"", "\"/other\""));
        assert_eq!(error(&same_name).field, "route[1].name");
        let get = with("method = \"get\"");
        let post = ROUTE.replace("\"api\"\n", "\"api2\"\n") + "method = \"POST\"\n";
        let file = PolicyFile::parse(&format!("{get}{post}")).unwrap();
        assert_eq!(file.routes[0].method, Some(Method::GET));
        assert_eq!(file.routes[1].line, 11);
    }

    /// `ROUTE` as route `name` at `path`, with `extra` lines appended.
    fn route_at(name: &str, path: &str, extra: &str) -> String {
        ROUTE
            .replace("\"api\"\n", &format!("{name:?}\n"))
            .replace("\"/api\"", &format!("{path:?}"))
            + extra
    }

    #[test]
    fn paths_that_conflict_as_axum_routes_are_refused() {
        // Different strings, one route to axum: `app.route` would panic on the second.
        let file = format!(
            "{}{}",
            route_at("by_id", "/items/{id}", ""),
            route_at("by_name", "/items/{name}", "")
        );
        let e = error(&file);
        assert_eq!(
            (e.line, e.column, e.field.as_str()),
            (11, 8, "route[1].path"),
            "{e}"
        );
        assert!(
            e.message.contains("\"/items/{name}\"")
                && e.message.contains("route[0] (\"by_id\")")
                && e.message.contains("\"/items/{id}\""),
            "{e}"
        );

        // A parameter beside a catch-all at the same place: matchit names the earlier one.
        let file = format!(
            "{}{}",
            route_at("one", "/files/{name}", ""),
            route_at("all", "/files/{*rest}", "")
        );
        let e = error(&file);
        assert_eq!((e.line, e.field.as_str()), (11, "route[1].path"), "{e}");
        assert!(e.message.contains("\"/files/{name}\""), "{e}");
    }

    #[test]
    fn paths_axum_cannot_route_are_refused() {
        for (path, reason) in [
            ("/items/{id", "valid name"),
            ("/items/id}", "valid name"),
            ("/items/{}", "valid name"),
            ("/files/{*rest}/more", "only allowed at the end"),
            ("/items/{a}{b}", "one parameter"),
        ] {
            let e = error(&route_at("items", path, ""));
            assert_eq!(
                (e.line, e.column, e.field.as_str()),
                (4, 8, "route[0].path"),
                "{path}: {e}"
            );
            assert!(
                e.message.contains(&format!("{path:?}")) && e.message.contains(reason),
                "{path}: {e}"
            );
        }
        // Escaped braces are literal, and fine.
        let file = PolicyFile::parse(&route_at("braces", "/a{{b}}", "")).unwrap();
        assert_eq!(file.routes[0].path, "/a{{b}}");
    }

    #[test]
    fn one_path_may_take_several_methods() {
        let file = format!(
            "{}{}{}",
            route_at("read", "/items/{id}", "method = \"GET\"\n"),
            route_at("write", "/items/{id}", "method = \"PUT\"\n"),
            route_at("other", "/items/{id}/tags", ""),
        );
        let file = PolicyFile::parse(&file).unwrap();
        let methods: Vec<_> = file.routes.iter().map(|r| r.method.clone()).collect();
        assert_eq!(methods, [Some(Method::GET), Some(Method::PUT), None]);
        // The (path, method) check still holds on top of the router's.
        let twice = format!(
            "{}{}",
            route_at("read", "/items/{id}", "method = \"GET\"\n"),
            route_at("all", "/items/{id}", ""),
        );
        let e = error(&twice);
        assert_eq!((e.field.as_str(), e.line), ("route[1].path", 12), "{e}");
        assert!(e.message.contains("already limited"), "{e}");
    }

    #[test]
    fn proxies_are_validated() {
        let e = error("[proxies]\ntrusted = [\"10.0.0.0/8\", \"10.0.0.0/40\"]\n");
        assert_eq!((e.line, e.field.as_str()), (2, "proxies.trusted[1]"), "{e}");
        let e = error("[proxies]\nheader = \"x-real-ip\"\n");
        assert_eq!((e.line, e.field.as_str()), (2, "proxies.header"), "{e}");
        let ok =
            PolicyFile::parse("[proxies]\ntrusted = [\"10.0.0.0/8\"]\nheader = \"Forwarded\"\n")
                .unwrap();
        assert_eq!(ok.proxies.header(), ForwardedHeader::Forwarded);
    }

    #[test]
    fn client_ip_prefixes_are_validated() {
        let prefixes = |file: &PolicyFile| match &file.routes[0].key {
            KeySource::ClientIp(k) => k.prefixes(),
            other => panic!("{other:?}"),
        };
        let ip_route = ROUTE.replace("\"route\"", "\"ip\"");
        assert_eq!(prefixes(&PolicyFile::parse(&ip_route).unwrap()), (32, 64));
        let file = PolicyFile::parse(&format!(
            "[client_ip]\nipv6_prefix = 56\nipv4_prefix = 24\n{ip_route}"
        ))
        .unwrap();
        assert_eq!(prefixes(&file), (24, 56));
        let e = error(&format!("[client_ip]\nipv6_prefix = 129\n{ip_route}"));
        assert_eq!(
            (e.line, e.field.as_str()),
            (2, "client_ip.ipv6_prefix"),
            "{e}"
        );
        let e = error(&format!("[client_ip]\nipv4_prefix = -1\n{ip_route}"));
        assert_eq!(
            (e.line, e.field.as_str()),
            (2, "client_ip.ipv4_prefix"),
            "{e}"
        );
        let e = error(&format!("[client_ip]\nipv4 = 24\n{ip_route}"));
        assert_eq!(e.line, 2, "{e}");
    }

    #[test]
    fn timeouts_and_header_costs_parse() {
        let f = PolicyFile::parse(&with(
            "timeout = \"100ms\"\ncost = { header = \"x-cost\", max = 4 }",
        ))
        .unwrap();
        assert_eq!(f.routes[0].timeout, Some(Duration::from_millis(100)));
        let CostSource::Header(c) = &f.routes[0].cost else {
            panic!()
        };
        assert_eq!((c.default_cost(), c.bounds()), (1, (1, 4)));
        assert_eq!(error(&with("timeout = \"soon\"")).field, "route[0].timeout");
        // the durations policy windows take (humantime), not a subset of them
        for (text, want) in [
            ("1h", Duration::from_secs(3600)),
            ("1s 500ms", Duration::from_millis(1500)),
            ("2min", Duration::from_secs(120)),
            (" 250ms ", Duration::from_millis(250)),
        ] {
            let f = PolicyFile::parse(&with(&format!("timeout = \"{text}\""))).unwrap();
            assert_eq!(f.routes[0].timeout, Some(want), "{text}");
        }
        for bad in ["0s", "", "-1s", "5"] {
            let field = error(&with(&format!("timeout = \"{bad}\""))).field;
            assert_eq!(field, "route[0].timeout", "{bad:?}");
        }
    }

    /// A route keyed by user answers a request without one with 401 and a challenge: `Bearer`
    /// unless the route names another; only such a route takes one.
    #[test]
    fn a_user_route_takes_a_challenge() {
        let user = ROUTE.replace("key = \"route\"", "key = \"user\"");
        let challenge = |file: &PolicyFile| match &file.routes[0].key {
            KeySource::User(k) => k.challenge().to_str().unwrap().to_owned(),
            other => panic!("{}", other.describe()),
        };
        assert_eq!(challenge(&PolicyFile::parse(&user).unwrap()), "Bearer");
        let basic = format!("{user}challenge = 'Basic realm=\"api\"'\n");
        assert_eq!(
            challenge(&PolicyFile::parse(&basic).unwrap()),
            "Basic realm=\"api\""
        );
        for bad in ["", "  ", "Bearer\\nx"] {
            let e = error(&format!("{user}challenge = \"{bad}\"\n"));
            assert_eq!((e.line, e.field.as_str()), (8, "route[0].challenge"), "{e}");
        }
        let e = error(&with("challenge = \"Bearer\""));
        assert_eq!(e.field, "route[0].challenge", "{e}");
        assert!(e.message.contains("only a route keyed by \"user\""), "{e}");
    }
}
