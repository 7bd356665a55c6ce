//! How much of the quota a request consumes: a [`CostFn`] reads it from the request — a
//! fixed cost, or a number the client declares in a header within configured bounds (the
//! items in a batch, the pages of an export).
//!
//! A cost above the route's capacity is not refused here: the limiter refuses it as invalid
//! input, never a 429, since waiting would not help. The layer answers 413 when the request
//! decided its cost, and 500 (logged at error) for a [fixed](CostFn::is_fixed) cost: that is
//! the server's own configuration, not the client's error. A fixed cost cannot be checked
//! once when the layer is built, as the limiter's policy may change under it later
//! ([`Limiter::set_policy`](tollgate::Limiter::set_policy), a policy registry); the policy
//! file checks its routes' fixed costs when it is loaded.
//!
//! ```
//! use axum::http::Request;
//! use tollgate_http::{CostFn, HeaderCost};
//!
//! let cost = HeaderCost::new("x-cost".parse().unwrap(), 1, 1, 100).unwrap();
//! let req = Request::builder().header("x-cost", "7").body(()).unwrap();
//! assert_eq!(cost.cost(&req).unwrap(), 7);
//! assert_eq!(cost.cost(&Request::new(())).unwrap(), 1); // the default
//! let req = Request::builder().header("x-cost", "101").body(()).unwrap();
//! assert_eq!(cost.cost(&req).unwrap_err().status().as_u16(), 400);
//! ```

use axum::http::{HeaderName, Request, StatusCode};

use crate::key::Rejection;

/// Reads the cost of a request (at least 1).
pub trait CostFn: Clone + Send + Sync + 'static {
    /// The cost of `request`, or why it is refused. A cost of 0 breaks the contract: the
    /// layer answers it 500 (the server's misconfiguration, e.g. `FixedCost(0)`), not 400.
    fn cost<B>(&self, request: &Request<B>) -> Result<u64, Rejection>;

    /// Whether the cost is the server's own configuration, the same for every request
    /// ([`FixedCost`], [`CostSource::Fixed`]). A fixed cost above the policy's capacity is then
    /// the server's misconfiguration: the layer answers 500 and logs it at error, rather than
    /// the 413 a request whose content decided its cost gets. `false` unless overridden.
    fn is_fixed(&self) -> bool {
        false
    }

    /// Whether `request`'s cost is the server's choice rather than the request's: always for a
    /// fixed cost, and for a [`HeaderCost`] when the request declares none (its `default`). A
    /// cost the server chose above the policy's capacity (a policy shrunk below it since the
    /// route was configured) is the server's misconfiguration, answered 500, never a 413 that
    /// blames a client for a cost it did not choose. [`CostFn::is_fixed`] unless overridden.
    fn chosen_by_server<B>(&self, request: &Request<B>) -> bool {
        let _ = request;
        self.is_fixed()
    }
}

/// Every request costs the same (1 by default; 0 is a misconfiguration, answered 500).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedCost(pub u64);

impl Default for FixedCost {
    fn default() -> Self {
        Self(1)
    }
}

impl CostFn for FixedCost {
    fn cost<B>(&self, _: &Request<B>) -> Result<u64, Rejection> {
        Ok(self.0)
    }

    fn is_fixed(&self) -> bool {
        true
    }
}

/// Why a [`HeaderCost`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cost bounds must satisfy 1 <= min <= default <= max, got min={min}, default={default}, max={max}"
)]
pub struct CostBoundsError {
    /// The lower bound.
    pub min: u64,
    /// The default.
    pub default: u64,
    /// The upper bound.
    pub max: u64,
}

/// The cost a client declares in a header, an integer in `min..=max`; `default` when the
/// header is absent. A value that is not an integer or is out of bounds is refused with 400.
#[derive(Debug, Clone)]
pub struct HeaderCost {
    name: HeaderName,
    default: u64,
    min: u64,
    max: u64,
}

impl HeaderCost {
    /// A cost read from header `name`, with its default and bounds (`1 <= min <= default <=
    /// max`).
    pub fn new(
        name: HeaderName,
        default: u64,
        min: u64,
        max: u64,
    ) -> Result<Self, CostBoundsError> {
        if min == 0 || min > default || default > max {
            return Err(CostBoundsError { min, default, max });
        }
        Ok(Self {
            name,
            default,
            min,
            max,
        })
    }

    /// The header's name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    /// The cost when the header is absent.
    pub fn default_cost(&self) -> u64 {
        self.default
    }

    /// The accepted bounds.
    pub fn bounds(&self) -> (u64, u64) {
        (self.min, self.max)
    }
}

impl CostFn for HeaderCost {
    fn chosen_by_server<B>(&self, request: &Request<B>) -> bool {
        !request.headers().contains_key(&self.name)
    }

    fn cost<B>(&self, request: &Request<B>) -> Result<u64, Rejection> {
        let mut values = request.headers().get_all(&self.name).iter();
        let Some(value) = values.next() else {
            return Ok(self.default);
        };
        // Two declarations of one cost: whichever the handler reads, charging the other
        // could be charging less than the request uses.
        if values.next().is_some() {
            return Err(Rejection::new(
                StatusCode::BAD_REQUEST,
                format!("{} must be given once", self.name),
            ));
        }
        value
            .to_str()
            .ok()
            .map(str::trim)
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|c| (self.min..=self.max).contains(c))
            .ok_or_else(|| {
                Rejection::new(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "{} must be an integer from {} to {}",
                        self.name, self.min, self.max
                    ),
                )
            })
    }
}

/// A cost function chosen at run time, as the policy file's `cost` field does.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum CostSource {
    /// `cost = N`.
    Fixed(FixedCost),
    /// `cost = { header = "x-cost", default = 1, min = 1, max = 100 }`.
    Header(HeaderCost),
}

impl Default for CostSource {
    fn default() -> Self {
        Self::Fixed(FixedCost::default())
    }
}

impl CostFn for CostSource {
    fn cost<B>(&self, request: &Request<B>) -> Result<u64, Rejection> {
        match self {
            Self::Fixed(c) => c.cost(request),
            Self::Header(c) => c.cost(request),
        }
    }

    fn is_fixed(&self) -> bool {
        match self {
            Self::Fixed(c) => c.is_fixed(),
            Self::Header(c) => c.is_fixed(),
        }
    }

    fn chosen_by_server<B>(&self, request: &Request<B>) -> bool {
        match self {
            Self::Fixed(c) => c.chosen_by_server(request),
            Self::Header(c) => c.chosen_by_server(request),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked_at_construction() {
        let name = HeaderName::from_static("x-cost");
        assert!(HeaderCost::new(name.clone(), 1, 0, 5).is_err());
        assert!(HeaderCost::new(name.clone(), 6, 1, 5).is_err());
        assert!(HeaderCost::new(name.clone(), 1, 2, 5).is_err());
        assert!(HeaderCost::new(name, 5, 5, 5).is_ok());
    }

    #[test]
    fn unparsable_values_are_refused() {
        let cost = HeaderCost::new(HeaderName::from_static("x-cost"), 1, 1, 10).unwrap();
        for bad in ["0", "-1", "1.5", "ten", "", "+5", "5, 7"] {
            let req = Request::builder().header("x-cost", bad).body(()).unwrap();
            assert_eq!(
                cost.cost(&req).unwrap_err().status(),
                StatusCode::BAD_REQUEST,
                "{bad:?}"
            );
        }
    }

    /// Repeated, the header declared two costs: the first was charged, while a handler
    /// reading the last (or every) value did the work of the other, up to `max` for the price
    /// of 1.
    #[test]
    fn a_cost_given_twice_is_refused() {
        let cost = HeaderCost::new(HeaderName::from_static("x-cost"), 1, 1, 100).unwrap();
        let req = Request::builder()
            .header("x-cost", "1")
            .header("x-cost", "100")
            .body(())
            .unwrap();
        let refused = cost.cost(&req).unwrap_err();
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        let req = Request::builder().header("x-cost", " 7 ").body(()).unwrap();
        assert_eq!(cost.cost(&req).unwrap(), 7);
    }
}
