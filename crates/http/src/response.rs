//! Every response the layer sends or decorates, built from one [`Decision`] so that the
//! status, `Retry-After` and the quota fields always agree.
//!
//! The quota fields follow the IETF httpapi draft "RateLimit header fields for HTTP"
//! (draft-ietf-httpapi-ratelimit-headers, revisions 08-11): two Structured Fields lists
//! (RFC 9651) whose items are the policy name as an sf-string.
//!
//! - `RateLimit-Policy: "login";q=5;w=60` — the quota `q` per time window `w` (seconds).
//! - `RateLimit: "login";r=4;t=12` — `r` units remain; the quota resets in `t` seconds.
//!
//! | outcome | status | `Retry-After` | `RateLimit-Policy` | `RateLimit` |
//! |---|---|---|---|---|
//! | allowed | the handler's | — | yes | yes |
//! | denied | 429 | whole seconds, rounded up | yes | yes (`r` as decided) |
//! | cost above capacity, decided by the request | 413 | — | yes | — |
//! | other invalid input, refused key or cost | 400 / 401 | — | — | — |
//! | limiter unavailable (`Closed`) | 503 | — | — | — |
//! | store error (a bug), a cost of 0 from the route's cost function, or a fixed cost above capacity | 500 | — | — | — |
//!
//! Stacked layers (a route's own inside a site-wide one) each add their member to the
//! `RateLimit` / `RateLimit-Policy` lists of an allowed response or an inner layer's 429
//! (`"login";r=0;t=2800, "site";r=98;t=40`), keep the denying layer's `Retry-After`, and add
//! nothing to an inner layer's other answers; see `docs/http.md`, "Stacked layers".
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Decision, Policy};
//! use tollgate_http::RateLimitResponses;
//!
//! let responses = RateLimitResponses::new("login", &Policy::sliding_log(5, Duration::from_secs(60)).unwrap());
//! assert_eq!(responses.policy_field(), r#""login";q=5;w=60"#);
//! let denied = Decision::shared(false, 5, 0, Some(11_200_000), 11_200_000);
//! let resp = responses.denied::<String>(&denied);
//! assert_eq!(resp.status(), 429);
//! assert_eq!(resp.headers()["retry-after"], "12");
//! assert_eq!(resp.headers()["ratelimit"], r#""login";r=0;t=12"#);
//! ```

use std::fmt::Write as _;
use std::sync::Arc;

use arc_swap::ArcSwap;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::header::{CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use tollgate::{Algorithm, Decision, Enforcement, Error, Limiter, Policy, PolicyError, StoreError};

use crate::key::Rejection;

/// `RateLimit-Policy`: the quota policy.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`: the current state of the quota.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// Legacy `X-RateLimit-Limit`.
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// Legacy `X-RateLimit-Remaining`.
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// Legacy `X-RateLimit-Reset` (seconds from now, not a timestamp).
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Builds the responses of one route from its policy name and policy.
///
/// Everything derived from the policy (`RateLimit-Policy`, the 413's `q`,
/// `X-RateLimit-Limit`) is taken from the policy in force when the response is built: a
/// builder made with [`RateLimitResponses::for_limiter`] follows [`Limiter::set_policy`] (and a
/// limiter following a policy registry). The layer itself shows the policy in force when it
/// asked the limiter, not one set while the handler ran. The rendered `RateLimit-Policy` value
/// is cached per policy, so it is formatted again only when the policy changes.
#[derive(Debug, Clone)]
pub struct RateLimitResponses {
    name: Arc<str>,
    source: PolicySource,
    rendered: Arc<ArcSwap<Rendered>>,
    legacy: bool,
}

/// Where the policy comes from.
#[derive(Debug, Clone)]
enum PolicySource {
    Fixed(Policy),
    Limiter(Limiter),
}

/// The `RateLimit-Policy` value last rendered, and the policy it was rendered from.
#[derive(Debug)]
struct Rendered {
    policy: Policy,
    field: HeaderValue,
}

impl RateLimitResponses {
    /// Responses for the policy `name` (usually the limiter's operation) enforcing `policy`,
    /// which never changes. For a limiter whose policy may change, use
    /// [`RateLimitResponses::for_limiter`].
    pub fn new(name: &str, policy: &Policy) -> Self {
        Self::build(name, PolicySource::Fixed(*policy), policy)
    }

    /// Responses for `limiter`: the policy name is its operation, and every response shows
    /// the policy in force when it is built ([`Limiter::policy`]), so the fields follow
    /// [`Limiter::set_policy`].
    pub fn for_limiter(limiter: &Limiter) -> Self {
        let policy = limiter.policy();
        Self::build(
            limiter.operation(),
            PolicySource::Limiter(limiter.clone()),
            &policy,
        )
    }

    fn build(name: &str, source: PolicySource, policy: &Policy) -> Self {
        Self {
            name: name.into(),
            source,
            rendered: Arc::new(ArcSwap::from_pointee(Rendered {
                policy: *policy,
                field: render_policy(name, policy),
            })),
            legacy: false,
        }
    }

    /// Also send `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset`
    /// (seconds from now) for clients that predate the draft. Off by default.
    #[must_use]
    pub fn legacy_headers(mut self, enabled: bool) -> Self {
        self.legacy = enabled;
        self
    }

    /// The policy name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The policy in force now.
    pub fn policy(&self) -> Policy {
        match &self.source {
            PolicySource::Fixed(p) => *p,
            PolicySource::Limiter(l) => l.policy(),
        }
    }

    /// The `RateLimit-Policy` value for the policy in force now.
    pub fn policy_field(&self) -> HeaderValue {
        self.policy_field_for(&self.policy())
    }

    /// The `RateLimit-Policy` value for `policy`, from the cache when it is the policy last
    /// rendered.
    fn policy_field_for(&self, policy: &Policy) -> HeaderValue {
        // A lock-free read on every response; a new policy is rendered once and swapped in.
        let cached = self.rendered.load();
        if cached.policy == *policy {
            return cached.field.clone();
        }
        let field = render_policy(&self.name, policy);
        self.rendered.store(Arc::new(Rendered {
            policy: *policy,
            field: field.clone(),
        }));
        field
    }

    /// The `RateLimit` value for `decision`: `r` = remaining, `t` = seconds until the bucket
    /// is back to its initial state, rounded up.
    pub fn ratelimit_field(&self, decision: &Decision) -> HeaderValue {
        let mut field = sf_string(&self.name);
        let _ = write!(
            field,
            ";r={};t={}",
            sf_integer(decision.remaining),
            sf_integer(decision.reset_after_secs())
        );
        HeaderValue::try_from(field).expect("an sf-string is a valid header")
    }

    /// Adds the quota fields of `decision` to `headers` (for an admitted request's response),
    /// for a request of cost 1; see [`RateLimitResponses::decorate_with_cost`].
    pub fn decorate(&self, decision: &Decision, headers: &mut HeaderMap) {
        self.decorate_with_cost(decision, 1, headers);
    }

    /// Adds the quota fields of `decision`, made for a request of `cost`, to `headers`.
    ///
    /// The limit (`q`, `X-RateLimit-Limit`) is the policy in force's, with one exception: a
    /// shared decision made under another limit (the store keeps the newest policy's
    /// parameters for a bucket, so an instance not yet running a newly published policy is
    /// decided under it) shows the limit that decided, without `w`, which only that policy
    /// knows — never a `q` that `r` exceeds.
    ///
    /// The client is never told how the decision was made:
    ///
    /// - A degraded decision, made against a locally scaled-down quota, shows the policy's
    ///   limit, not the local one, and its own `t`. When that `t` exceeds the policy's window
    ///   (a share floored to one token refills slower than the whole quota), `w` is left out,
    ///   so the fields never contradict each other; so it is for any decision whose `t`
    ///   exceeds the window.
    /// - A bypassed decision (fail-open: nothing was counted) is shown as the shared store
    ///   would answer this request on an untouched bucket: `r` = the limit minus `cost`, and
    ///   `t` = the time `cost` takes to refill (token bucket), the end of the current
    ///   epoch-aligned window by this host's clock (fixed window), or the window (sliding
    ///   log). Showing the full quota with `t=0` instead, as the limiter reports it, is a
    ///   value no enforced response ever carries, and would tell the client the limiter is
    ///   failing open.
    pub fn decorate_with_cost(&self, decision: &Decision, cost: u64, headers: &mut HeaderMap) {
        self.decorate_under(decision, cost, &self.policy(), headers);
    }

    /// [`RateLimitResponses::decorate_with_cost`] for a decision made under `policy`: the
    /// layer passes the policy it read before asking the limiter, so a policy change while the
    /// request is in the handler cannot put a `q` beside an `r` it never governed.
    pub(crate) fn decorate_under(
        &self,
        decision: &Decision,
        cost: u64,
        policy: &Policy,
        headers: &mut HeaderMap,
    ) {
        let fields = self.fields(decision, cost, policy);
        headers.insert(RATELIMIT_POLICY.clone(), fields.policy);
        headers.insert(RATELIMIT.clone(), fields.ratelimit);
        if self.legacy {
            fields.legacy.insert(headers);
        }
    }

    /// The layer's decoration of the response its inner service returned for a request it
    /// admitted under `policy`. Layers stack (a route's own layer inside a site-wide one), so
    /// the response may already be another layer's:
    ///
    /// - one that layer answered itself without a quota decision (400, 401, 413, 500, 503):
    ///   left as it is, without this layer's fields (a 503 under `Closed` carries none);
    /// - its 429, or a handler's response it decorated: this layer's `RateLimit` and
    ///   `RateLimit-Policy` members are appended to the lists already there (the IETF fields
    ///   are lists, one member per policy), never replacing them. `Retry-After` stays the
    ///   denying layer's. The single-valued legacy headers show one quota: on a 429 the
    ///   denying layer's (untouched, absent if it sends none); otherwise the one with the
    ///   fewest units left, on a tie the one resetting later.
    ///
    /// Anything else (the handler's own response) gets the fields as
    /// [`RateLimitResponses::decorate_with_cost`] sets them.
    pub(crate) fn decorate_response<B>(
        &self,
        decision: &Decision,
        cost: u64,
        policy: &Policy,
        response: &mut Response<B>,
    ) {
        let answered = response.extensions().get::<AnsweredByLimiter>().is_some();
        let denied = response.status() == StatusCode::TOO_MANY_REQUESTS;
        if answered && !denied {
            return;
        }
        if !answered && response.extensions().get::<CarriesQuotaFields>().is_none() {
            self.decorate_under(decision, cost, policy, response.headers_mut());
            response.extensions_mut().insert(CarriesQuotaFields);
            return;
        }
        let fields = self.fields(decision, cost, policy);
        let headers = response.headers_mut();
        append_member(headers, &RATELIMIT_POLICY, &fields.policy);
        append_member(headers, &RATELIMIT, &fields.ratelimit);
        if self.legacy && !answered && fields.legacy.more_restrictive_than(headers) {
            fields.legacy.insert(headers);
        }
    }

    /// The quota fields of `decision`, made for a request of `cost` under `policy`.
    fn fields(&self, decision: &Decision, cost: u64, policy: &Policy) -> Fields {
        let shown;
        let decision = if decision.enforcement == Enforcement::Bypassed {
            shown = untouched_bucket(policy, cost, decision);
            &shown
        } else {
            decision
        };
        // The shared store decides a bucket that a newer policy (another instance, mid
        // rollout) already wrote under that policy's parameters: show the quota that decided,
        // without a window this instance does not know, rather than one `r` may exceed.
        // A decision that leaves more than the policy's limit was made under another policy
        // (one set while this request was being decided): it is shown the same way, under
        // the limit that decided, whatever its enforcement, so `r` never exceeds `q`.
        // Likewise a decision whose reset lies beyond the policy's window (a degraded share
        // floored to one token refills slower than the whole quota; a rollout's longer
        // window): the window is left out rather than contradicted by `t`.
        let (limit, policy_field) = if (decision.enforcement == Enforcement::Shared
            && decision.limit != policy.limit())
            || decision.remaining > policy.limit()
        {
            (
                decision.limit,
                render_quota(&self.name, decision.limit, None),
            )
        } else if window_secs(policy).is_some_and(|w| decision.reset_after_secs() > w) {
            (
                policy.limit(),
                render_quota(&self.name, policy.limit(), None),
            )
        } else {
            (policy.limit(), self.policy_field_for(policy))
        };
        Fields {
            policy: policy_field,
            ratelimit: self.ratelimit_field(decision),
            legacy: Legacy {
                limit,
                remaining: decision.remaining,
                reset: decision.reset_after_secs(),
            },
        }
    }

    /// 429 for a denied `decision`: `Retry-After` in whole seconds rounded up (at least 1),
    /// the quota fields, and a one-line body.
    pub fn denied<B: From<String>>(&self, decision: &Decision) -> Response<B> {
        self.denied_under(decision, &self.policy())
    }

    /// [`RateLimitResponses::denied`] for a decision made under `policy`.
    pub(crate) fn denied_under<B: From<String>>(
        &self,
        decision: &Decision,
        policy: &Policy,
    ) -> Response<B> {
        // A denial always carries a wait; 1 s is the floor should a store ever omit it.
        let retry = decision.retry_after_secs().unwrap_or(1).max(1);
        let mut resp = text(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "rate limit exceeded for {}; retry in {retry} s\n",
                self.name
            ),
        );
        resp.headers_mut().insert(RETRY_AFTER, retry.into());
        self.decorate_under(decision, 1, policy, resp.headers_mut());
        resp
    }

    /// The answer when the limiter could not decide: 413 for a cost above the policy's
    /// capacity (with `RateLimit-Policy`, so the client sees the largest cost it may ask
    /// for), 400 for other invalid input, 503 when the store is unavailable and the route
    /// fails closed, 500 for a store error (a bug). None carries `Retry-After` or `RateLimit`.
    pub fn error<B: From<String>>(&self, error: &Error) -> Response<B> {
        match error {
            Error::Invalid(StoreError::InvalidPolicy(
                e @ PolicyError::CostAboveCapacity { max, .. },
            )) => {
                let mut resp = text(StatusCode::PAYLOAD_TOO_LARGE, format!("{e}\n"));
                // The limit that refused the cost: a newer generation stored by another
                // instance may govern with a smaller one than this instance's policy (shown
                // without `w` then, as a decision under it is).
                let policy = self.policy();
                let field = if *max == policy.limit() {
                    self.policy_field_for(&policy)
                } else {
                    render_quota(&self.name, *max, None)
                };
                resp.headers_mut().insert(RATELIMIT_POLICY.clone(), field);
                resp
            }
            Error::Invalid(e) => text(StatusCode::BAD_REQUEST, format!("{e}\n")),
            Error::Unavailable { .. } => text(
                StatusCode::SERVICE_UNAVAILABLE,
                "rate limiter unavailable\n".to_owned(),
            ),
            _ => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                "rate limiter error\n".to_owned(),
            ),
        }
    }

    /// The answer to a request refused before the limiter was asked (no key, bad cost), with
    /// its `WWW-Authenticate` challenge if it has one.
    pub fn rejected<B: From<String>>(&self, rejection: &Rejection) -> Response<B> {
        let mut response = text(rejection.status(), format!("{}\n", rejection.message()));
        if let Some(challenge) = rejection.challenge() {
            response
                .headers_mut()
                .insert(WWW_AUTHENTICATE, challenge.clone());
        }
        response
    }
}

/// Marks a response a [`RateLimitLayer`](crate::RateLimitLayer) (or this builder) answered
/// itself: a 429, or a refusal made without a quota decision. An enclosing layer adds nothing
/// to the refusals and only its own list members to the 429.
#[derive(Debug, Clone, Copy)]
struct AnsweredByLimiter;

/// Marks a handler's response a layer decorated with its quota fields: an enclosing layer
/// appends its members to them rather than replacing them.
#[derive(Debug, Clone, Copy)]
struct CarriesQuotaFields;

/// One layer's quota fields for one decision.
struct Fields {
    policy: HeaderValue,
    ratelimit: HeaderValue,
    legacy: Legacy,
}

/// The legacy `X-RateLimit-*` values of one decision.
struct Legacy {
    limit: u64,
    remaining: u64,
    reset: u64,
}

impl Legacy {
    fn insert(&self, headers: &mut HeaderMap) {
        headers.insert(X_RATELIMIT_LIMIT.clone(), self.limit.into());
        headers.insert(X_RATELIMIT_REMAINING.clone(), self.remaining.into());
        headers.insert(X_RATELIMIT_RESET.clone(), self.reset.into());
    }

    /// Whether these values are to replace the legacy headers another layer already set:
    /// fewer units left, or as few and a later reset (or none set, or unreadable).
    fn more_restrictive_than(&self, headers: &HeaderMap) -> bool {
        let number = |name: &HeaderName| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
        };
        match (number(&X_RATELIMIT_REMAINING), number(&X_RATELIMIT_RESET)) {
            (Some(remaining), Some(reset)) => {
                (self.remaining, std::cmp::Reverse(self.reset))
                    < (remaining, std::cmp::Reverse(reset))
            }
            _ => true,
        }
    }
}

/// Appends `member` to the Structured Field list `name` (joining any lines already there
/// into one, `a, b`), or sets it when absent.
fn append_member(headers: &mut HeaderMap, name: &HeaderName, member: &HeaderValue) {
    let mut list = Vec::new();
    for value in headers.get_all(name) {
        list.extend_from_slice(value.as_bytes());
        list.extend_from_slice(b", ");
    }
    list.extend_from_slice(member.as_bytes());
    let value = HeaderValue::from_bytes(&list).expect("joined header values stay valid");
    headers.insert(name.clone(), value);
}

/// 500 for a route the server set up wrong (a cost function returning 0): the request was
/// fine, so it gets no 4xx. The layer logs what was wrong; the client is not told.
pub(crate) fn misconfigured<B: From<String>>() -> Response<B> {
    text(
        StatusCode::INTERNAL_SERVER_ERROR,
        "rate limiter error\n".to_owned(),
    )
}

fn text<B: From<String>>(status: StatusCode, body: String) -> Response<B> {
    let mut resp = Response::new(B::from(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp.extensions_mut().insert(AnsweredByLimiter);
    resp
}

/// The decision a request of `cost` gets from an untouched bucket under `policy` (what a
/// bypassed `decision` is shown as).
fn untouched_bucket(policy: &Policy, cost: u64, decision: &Decision) -> Decision {
    let cost = cost.min(policy.limit());
    let reset_micros = match policy.algorithm() {
        Algorithm::TokenBucket(tb) => cost.saturating_mul(tb.unit).div_ceil(tb.rate),
        Algorithm::FixedWindow(fw) => {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
            fw.window_micros - now % fw.window_micros
        }
        Algorithm::SlidingLog(sl) => sl.window_micros,
        _ => u64::try_from(decision.reset_after.as_micros()).unwrap_or(u64::MAX),
    };
    Decision::shared(
        true,
        policy.limit(),
        policy.limit() - cost,
        None,
        reset_micros,
    )
    .with_enforcement(decision.enforcement)
}

/// The largest Structured Field integer (RFC 9651 §3.3.1: at most 15 digits).
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// `n` as a Structured Field integer: saturated at [`SF_INTEGER_MAX`], since a strict parser
/// drops a whole field holding a longer one. Policies take limits up to 2^52 (16 digits); any
/// quota that large is, to a client, unlimited all the same.
fn sf_integer(n: u64) -> u64 {
    n.min(SF_INTEGER_MAX)
}

/// `"name";q=LIMIT;w=WINDOW` for `policy`.
fn render_policy(name: &str, policy: &Policy) -> HeaderValue {
    render_quota(name, policy.limit(), window_secs(policy))
}

/// `"name";q=LIMIT[;w=WINDOW]`.
fn render_quota(name: &str, limit: u64, window_secs: Option<u64>) -> HeaderValue {
    let mut field = sf_string(name);
    let _ = write!(field, ";q={}", sf_integer(limit));
    if let Some(w) = window_secs {
        let _ = write!(field, ";w={}", sf_integer(w));
    }
    HeaderValue::try_from(field).expect("an sf-string is a valid header")
}

/// The policy's time window in whole seconds (rounded up): the window, or the time an empty
/// token bucket takes to refill.
fn window_secs(policy: &Policy) -> Option<u64> {
    let micros = match policy.algorithm() {
        Algorithm::TokenBucket(tb) => tb.fill_micros(),
        Algorithm::FixedWindow(fw) => fw.window_micros,
        Algorithm::SlidingLog(sl) => sl.window_micros,
        _ => return None,
    };
    Some(micros.div_ceil(1_000_000))
}

/// An RFC 9651 sf-string: printable ASCII in quotes, `"` and `\` escaped; anything else
/// (which a valid operation name never contains) becomes `?`.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tollgate::Rate;

    use super::*;

    /// RFC 9651 §3.3.1: an sf-integer has at most 15 digits; a strict parser drops a field
    /// holding a longer one. Policies take limits up to 2^52, which has 16.
    #[test]
    fn quota_fields_stay_valid_sf_integers_for_the_largest_limits() {
        let p = Policy::fixed_window(1 << 52, Duration::from_secs(1)).unwrap();
        let r = RateLimitResponses::new("api", &p);
        assert_eq!(r.policy_field(), r#""api";q=999999999999999;w=1"#);
        let d = Decision::shared(true, 1 << 52, (1 << 52) - 1, None, 1_000_000);
        let mut h = HeaderMap::new();
        r.decorate(&d, &mut h);
        assert_eq!(h["ratelimit"], r#""api";r=999999999999999;t=1"#);
        let mut d = Decision::shared(true, 10, 3, None, 0);
        d.reset_after = Duration::MAX;
        assert_eq!(
            r.ratelimit_field(&d),
            format!(r#""api";r=3;t={SF_INTEGER_MAX}"#).as_str()
        );
    }

    #[test]
    fn policy_field_has_quota_and_window() {
        let tb = Policy::token_bucket(10, Rate::per_second(2)).unwrap();
        assert_eq!(
            RateLimitResponses::new("search", &tb).policy_field(),
            r#""search";q=10;w=5"#
        );
        let fw = Policy::fixed_window(100, Duration::from_millis(1500)).unwrap();
        assert_eq!(
            RateLimitResponses::new("api", &fw).policy_field(),
            r#""api";q=100;w=2"#
        );
    }

    #[test]
    fn allowed_fields_and_legacy_headers_come_from_the_decision() {
        let p = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
        let r = RateLimitResponses::new("api", &p).legacy_headers(true);
        let d = Decision::shared(true, 10, 7, None, 30_000_001);
        let mut h = HeaderMap::new();
        r.decorate(&d, &mut h);
        assert_eq!(h["ratelimit"], r#""api";r=7;t=31"#);
        assert_eq!(h["x-ratelimit-limit"], "10");
        assert_eq!(h["x-ratelimit-remaining"], "7");
        assert_eq!(h["x-ratelimit-reset"], "31");
        assert!(h.get(RETRY_AFTER).is_none());
    }

    /// A newer generation stored by another instance refused the cost with its smaller limit:
    /// the 413 shows that limit, the one the request must fit, not this instance's.
    #[test]
    fn a_413_shows_the_limit_that_refused_the_cost() {
        let p = Policy::fixed_window(10, Duration::from_secs(3600)).unwrap();
        let r = RateLimitResponses::new("api", &p);
        let newer = Error::from(PolicyError::CostAboveCapacity { cost: 7, max: 5 });
        let resp = r.error::<String>(&newer);
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(resp.headers()[&RATELIMIT_POLICY], r#""api";q=5"#);
    }

    #[test]
    fn errors_never_carry_retry_after_or_quota_state() {
        let p = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
        let r = RateLimitResponses::new("api", &p);
        let too_big = Error::from(PolicyError::CostAboveCapacity { cost: 11, max: 10 });
        let resp = r.error::<String>(&too_big);
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(resp.headers().get(RETRY_AFTER).is_none());
        assert!(resp.headers().get(&RATELIMIT).is_none());
        assert_eq!(resp.headers()[&RATELIMIT_POLICY], r#""api";q=10;w=60"#);
        let zero = Error::from(PolicyError::ZeroCost);
        assert_eq!(r.error::<String>(&zero).status(), StatusCode::BAD_REQUEST);
        let down = Error::Unavailable {
            operation: "api".into(),
            source: StoreError::Timeout(Duration::from_millis(5)),
        };
        let resp = r.error::<String>(&down);
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(resp.headers().get(RETRY_AFTER).is_none());
        assert!(resp.headers().get(&RATELIMIT_POLICY).is_none());
        let bug = Error::Store(StoreError::Script("oops".into()));
        assert_eq!(
            r.error::<String>(&bug).status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn a_bypass_is_shown_as_an_untouched_bucket_would_answer() {
        let p = Policy::sliding_log(5, Duration::from_secs(60)).unwrap();
        let r = RateLimitResponses::new("api", &p).legacy_headers(true);
        let bypass = Decision::shared(true, 5, 5, None, 0).with_enforcement(Enforcement::Bypassed);
        let mut h = HeaderMap::new();
        r.decorate_with_cost(&bypass, 2, &mut h);
        assert_eq!(h["ratelimit"], r#""api";r=3;t=60"#);
        assert_eq!(h["x-ratelimit-remaining"], "3");
        assert_eq!(h["x-ratelimit-reset"], "60");
        let tb = Policy::token_bucket(10, tollgate::Rate::per_second(2)).unwrap();
        let r = RateLimitResponses::new("api", &tb);
        let mut h = HeaderMap::new();
        r.decorate(&bypass, &mut h);
        assert_eq!(h["ratelimit"], r#""api";r=9;t=1"#);
    }

    /// A decision leaving more than the shown policy's limit (made under another policy, one
    /// set while it was being decided) is shown under the limit that decided, without `w`,
    /// whatever its enforcement: never `r` above `q`.
    #[test]
    fn a_decision_under_a_larger_limit_never_shows_r_above_q() {
        let p = Policy::fixed_window(10, Duration::from_secs(3600)).unwrap();
        let r = RateLimitResponses::new("api", &p).legacy_headers(true);
        let degraded = Decision::shared(true, 100, 99, None, 1_000_000)
            .with_enforcement(Enforcement::Degraded);
        let mut h = HeaderMap::new();
        r.decorate(&degraded, &mut h);
        assert_eq!(h[&RATELIMIT], r#""api";r=99;t=1"#);
        assert_eq!(h[&RATELIMIT_POLICY], r#""api";q=100"#);
        assert_eq!(h[&X_RATELIMIT_LIMIT], "100");
        // Within the policy's limit: the policy as it is.
        let degraded =
            Decision::shared(true, 5, 4, None, 1_000_000).with_enforcement(Enforcement::Degraded);
        r.decorate(&degraded, &mut h);
        assert_eq!(h[&RATELIMIT_POLICY], r#""api";q=10;w=3600"#);
        assert_eq!(h[&X_RATELIMIT_LIMIT], "10");
    }

    #[test]
    fn sf_strings_are_escaped() {
        assert_eq!(sf_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(sf_string("é"), r#""?""#);
    }
}
