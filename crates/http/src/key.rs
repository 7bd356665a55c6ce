//! Which bucket a request draws from: a [`KeyExtractor`] reads the identity (client IP, a
//! header, the authenticated user, the route) from the request. The identity is arbitrary
//! client-controlled bytes; the limiter escapes or hashes it into a [`Key`](tollgate::Key).
//!
//! ```
//! use axum::http::Request;
//! use tollgate_http::{HeaderKey, KeyExtractor};
//!
//! let key = HeaderKey::new("x-api-key".parse().unwrap());
//! let req = Request::builder().header("x-api-key", "k-123").body(()).unwrap();
//! assert_eq!(key.extract(&req).unwrap(), b"k-123");
//! let anonymous = Request::new(());
//! assert_eq!(key.extract(&anonymous).unwrap_err().status().as_u16(), 400);
//! ```

use std::borrow::Cow;

use axum::extract::MatchedPath;
use axum::http::{HeaderName, HeaderValue, Request, StatusCode};

use crate::client_ip::ClientIpKey;

/// A request the rate-limit layer refuses before asking the limiter: no key could be found,
/// or the cost is unreadable. Answered with its status and message, never with 429.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    status: StatusCode,
    message: Cow<'static, str>,
    challenge: Option<HeaderValue>,
}

impl Rejection {
    /// A rejection answered with `status` and a one-line `message`.
    pub fn new(status: StatusCode, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            message: message.into(),
            challenge: None,
        }
    }

    /// The same rejection answered with a `WWW-Authenticate: challenge` field, which RFC 9110
    /// (15.5.2) requires of every 401.
    #[must_use]
    pub fn with_challenge(mut self, challenge: HeaderValue) -> Self {
        self.challenge = Some(challenge);
        self
    }

    /// The `WWW-Authenticate` challenge it is answered with, if any.
    pub fn challenge(&self) -> Option<&HeaderValue> {
        self.challenge.as_ref()
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The message sent as the body.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// Reads the identity of a request's bucket.
///
/// Implement it for your own keys (tenant id from a JWT claim, ...); the built-in ones are
/// [`ClientIpKey`], [`HeaderKey`], [`UserKey`] and [`RouteKey`], and [`KeySource`] chooses
/// among them at run time (as the policy file does).
pub trait KeyExtractor: Clone + Send + Sync + 'static {
    /// The identity of `request`'s bucket (non-empty), or why the request is refused.
    fn extract<B>(&self, request: &Request<B>) -> Result<Vec<u8>, Rejection>;
}

/// Keys a request by the value of one header (an API key, a tenant id). A request without
/// it, with an empty value, or with the header given more than once is refused with 400: of
/// repeated values, the one the limiter keyed by need not be the one the application reads,
/// so a client could vary the first and spend a fresh quota each time.
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: HeaderName,
}

impl HeaderKey {
    /// Keys by the header `name`.
    pub fn new(name: HeaderName) -> Self {
        Self { name }
    }

    /// The header's name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }
}

impl KeyExtractor for HeaderKey {
    fn extract<B>(&self, request: &Request<B>) -> Result<Vec<u8>, Rejection> {
        let mut values = request.headers().get_all(&self.name).iter();
        match (values.next(), values.next()) {
            (Some(v), None) if !v.is_empty() => Ok(v.as_bytes().to_vec()),
            (Some(_), Some(_)) => Err(Rejection::new(
                StatusCode::BAD_REQUEST,
                format!("{} header given more than once", self.name),
            )),
            _ => Err(Rejection::new(
                StatusCode::BAD_REQUEST,
                format!("missing {} header", self.name),
            )),
        }
    }
}

/// The authenticated user of a request, put in its extensions by your authentication layer
/// (which must run before the rate-limit layer), and read by [`UserKey`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AuthenticatedUser(pub String);

/// Keys a request by its [`AuthenticatedUser`] extension. A request without one is refused
/// with 401 and a `WWW-Authenticate` challenge (RFC 9110 requires one on every 401):
/// `Bearer` unless another is set ([`UserKey::with_challenge`]).
///
/// ```
/// use axum::http::{HeaderValue, Request};
/// use tollgate_http::{AuthenticatedUser, KeyExtractor, UserKey};
///
/// let mut req = Request::new(());
/// let refused = UserKey::new().extract(&req).unwrap_err();
/// assert_eq!(refused.status().as_u16(), 401);
/// assert_eq!(refused.challenge().unwrap(), "Bearer");
/// let basic = UserKey::with_challenge(HeaderValue::from_static("Basic realm=\"api\""));
/// assert_eq!(basic.extract(&req).unwrap_err().challenge().unwrap(), "Basic realm=\"api\"");
/// req.extensions_mut().insert(AuthenticatedUser("alice".into()));
/// assert_eq!(UserKey::new().extract(&req).unwrap(), b"alice");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserKey {
    challenge: HeaderValue,
}

impl UserKey {
    /// The challenge of a 401 unless another is set.
    pub const DEFAULT_CHALLENGE: &'static str = "Bearer";

    /// Refuses a request without a user with 401 and `WWW-Authenticate: Bearer`.
    pub fn new() -> Self {
        Self::with_challenge(HeaderValue::from_static(Self::DEFAULT_CHALLENGE))
    }

    /// Refuses a request without a user with 401 and `WWW-Authenticate: challenge` (the
    /// scheme, and any parameters, your authentication layer accepts).
    pub fn with_challenge(challenge: HeaderValue) -> Self {
        Self { challenge }
    }

    /// The `WWW-Authenticate` challenge of its 401.
    pub fn challenge(&self) -> &HeaderValue {
        &self.challenge
    }
}

impl Default for UserKey {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyExtractor for UserKey {
    fn extract<B>(&self, request: &Request<B>) -> Result<Vec<u8>, Rejection> {
        match request.extensions().get::<AuthenticatedUser>() {
            Some(AuthenticatedUser(user)) if !user.is_empty() => Ok(user.as_bytes().to_vec()),
            _ => Err(
                Rejection::new(StatusCode::UNAUTHORIZED, "authentication required")
                    .with_challenge(self.challenge.clone()),
            ),
        }
    }
}

/// One bucket for the whole route, shared by every client, named by axum's [`MatchedPath`]
/// (the route template, `/items/{id}`, never the request's own path).
///
/// When the router recorded no template — the layer sits outside routing (`Router::layer`
/// rather than `route_layer`), or wraps a plain tower service — every request draws from one
/// bucket named [`RouteKey::UNMATCHED`]. The request path is never used: it is chosen by the
/// client, who could otherwise mint a fresh bucket (and a fresh quota, and store memory) with
/// every path it makes up.
///
/// ```
/// use axum::http::Request;
/// use tollgate_http::{KeyExtractor, RouteKey};
///
/// let req = Request::builder().uri("/anything/the/client/likes").body(()).unwrap();
/// assert_eq!(RouteKey.extract(&req).unwrap(), RouteKey::UNMATCHED.as_bytes());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteKey;

impl RouteKey {
    /// The bucket of requests without a [`MatchedPath`]. A template always starts with `/`, so
    /// this never names a real route's bucket.
    pub const UNMATCHED: &'static str = "unmatched";
}

impl KeyExtractor for RouteKey {
    fn extract<B>(&self, request: &Request<B>) -> Result<Vec<u8>, Rejection> {
        let name = request
            .extensions()
            .get::<MatchedPath>()
            .map(MatchedPath::as_str)
            .filter(|p| !p.is_empty())
            .unwrap_or(Self::UNMATCHED);
        Ok(name.as_bytes().to_vec())
    }
}

/// A key extractor chosen at run time, as the policy file's `key` field does.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum KeySource {
    /// `key = "ip"`: the client IP.
    ClientIp(ClientIpKey),
    /// `key = "header:NAME"`: a header's value.
    Header(HeaderKey),
    /// `key = "user"`: the authenticated user.
    User(UserKey),
    /// `key = "route"`: one bucket for the route.
    Route(RouteKey),
}

impl KeyExtractor for KeySource {
    fn extract<B>(&self, request: &Request<B>) -> Result<Vec<u8>, Rejection> {
        match self {
            Self::ClientIp(k) => k.extract(request),
            Self::Header(k) => k.extract(request),
            Self::User(k) => k.extract(request),
            Self::Route(k) => k.extract(request),
        }
    }
}

impl KeySource {
    /// The policy-file spelling: `ip`, `header:NAME`, `user` or `route`.
    pub fn describe(&self) -> String {
        match self {
            Self::ClientIp(_) => "ip".into(),
            Self::Header(h) => format!("header:{}", h.name()),
            Self::User(_) => "user".into(),
            Self::Route(_) => "route".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_key_never_uses_the_request_path() {
        for uri in ["/items/42", "/items/43", "/", "/x?y=1"] {
            let req = Request::builder().uri(uri).body(()).unwrap();
            assert_eq!(RouteKey.extract(&req).unwrap(), b"unmatched", "{uri}");
        }
    }

    #[test]
    fn a_key_header_given_twice_is_refused() {
        let key = HeaderKey::new(HeaderName::from_static("x-api-key"));
        let req = Request::builder()
            .header("x-api-key", "rotating-1")
            .header("x-api-key", "real")
            .body(())
            .unwrap();
        let refused = key.extract(&req).unwrap_err();
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        let req = Request::builder()
            .header("x-api-key", "real")
            .body(())
            .unwrap();
        assert_eq!(key.extract(&req).unwrap(), b"real");
    }

    #[test]
    fn empty_header_and_empty_user_are_refused() {
        let key = HeaderKey::new(HeaderName::from_static("x-api-key"));
        let req = Request::builder().header("x-api-key", "").body(()).unwrap();
        assert_eq!(
            key.extract(&req).unwrap_err().status(),
            StatusCode::BAD_REQUEST
        );
        let mut req = Request::new(());
        req.extensions_mut()
            .insert(AuthenticatedUser(String::new()));
        assert_eq!(
            UserKey::new().extract(&req).unwrap_err().status(),
            StatusCode::UNAUTHORIZED
        );
    }
}
