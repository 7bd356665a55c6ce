//! Policies: an algorithm with its parameters, validated at construction so that every
//! `Policy` value is usable. Invalid parameters are a [`PolicyError`], never a panic.

use std::fmt::{self, Write as _};
use std::time::Duration;

/// Largest integer that every number in a bucket's state may reach. Lua (and so Redis scripts)
/// computes in IEEE doubles, which are exact for integers up to 2^53; staying one bit below
/// keeps every intermediate sum exact as well.
pub const MAX_EXACT: u64 = 1 << 52;

/// Longest window or refill period a policy accepts: ten years.
pub const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Largest limit of a sliding log. Its state holds up to `limit` entries and every call walks
/// them, so the bound keeps each call's work (and Redis's time inside the script) small.
pub const MAX_SLIDING_LOG_LIMIT: u64 = 1_000;

/// Why a policy or a request against it is invalid.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// A count parameter (capacity, limit, refill tokens) was zero.
    #[error("{field} must be at least 1, got 0")]
    Zero {
        /// The parameter's name.
        field: &'static str,
    },
    /// A duration parameter was zero or shorter than the resolution it needs.
    #[error("{field} must be at least {min:?}, got {got:?}")]
    DurationTooShort {
        /// The parameter's name.
        field: &'static str,
        /// The shortest accepted value.
        min: Duration,
        /// The value given.
        got: Duration,
    },
    /// A duration parameter was longer than [`MAX_DURATION`].
    #[error("{field} must be at most {max:?}, got {got:?}")]
    DurationTooLong {
        /// The parameter's name.
        field: &'static str,
        /// The longest accepted value.
        max: Duration,
        /// The value given.
        got: Duration,
    },
    /// A duration parameter was not a whole number of microseconds, the resolution of every
    /// decision (Redis `TIME`): rounding it would change the rate or window, and the policy's
    /// spec would no longer round-trip.
    #[error("{field} must be a whole number of microseconds, got {got:?}")]
    NotWholeMicros {
        /// The parameter's name.
        field: &'static str,
        /// The value given.
        got: Duration,
    },
    /// A count parameter was larger than the algorithm can represent exactly.
    #[error("{field} must be at most {max}, got {got}")]
    TooLarge {
        /// The parameter's name.
        field: &'static str,
        /// The largest accepted value.
        max: u64,
        /// The value given.
        got: u64,
    },
    /// A rate in tokens per second (given as a number, [`Rate::per_second_f64`] or a policy
    /// spec's `rate=`) above the largest a policy holds exactly.
    #[error("{field} must be at most {max} per second, got {}", Number(*.got))]
    RateTooLarge {
        /// The parameter's name.
        field: &'static str,
        /// The largest accepted rate, in tokens per second.
        max: u64,
        /// The rate given.
        got: f64,
    },
    /// A fractional rate that is not a whole number of thousandths of a token per second
    /// (rounding it would admit more, or less, than asked).
    #[error(
        "{field} must be a whole number of thousandths per second (at least 0.001), got {got}; give a count per period (Rate::new, period=) for another rate"
    )]
    NotWholeThousandths {
        /// The parameter's name.
        field: &'static str,
        /// The value given.
        got: f64,
    },
    /// A floating-point parameter was NaN, infinite, zero or negative.
    #[error("{field} must be a finite number greater than 0, got {got}")]
    NotPositiveFinite {
        /// The parameter's name.
        field: &'static str,
        /// The value given.
        got: f64,
    },
    /// The combination of parameters would overflow exact integer arithmetic.
    #[error("parameters overflow exact arithmetic: {0}")]
    Overflow(String),
    /// A request's cost was 0.
    #[error("cost must be at least 1, got 0")]
    ZeroCost,
    /// A request's cost is above what the policy can ever admit at once; it could never pass.
    #[error("cost {cost} exceeds the policy's maximum burst of {max}")]
    CostAboveCapacity {
        /// The cost asked for.
        cost: u64,
        /// The policy's capacity or limit.
        max: u64,
    },
}

/// A number in an error message: as written for an ordinary size, in exponent form past
/// 10^16 (`1e300`, not its 301 digits).
struct Number(f64);

impl fmt::Display for Number {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.abs() < 1e16 {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{:e}", self.0)
        }
    }
}

/// A refill rate: `tokens` every `period`. Kept as an exact ratio of integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    tokens: u64,
    period: Duration,
}

impl Rate {
    /// `tokens` every `period`. Validated when a policy is built from it.
    pub const fn new(tokens: u64, period: Duration) -> Self {
        Self { tokens, period }
    }

    /// `tokens` per second.
    pub const fn per_second(tokens: u64) -> Self {
        Self::new(tokens, Duration::from_secs(1))
    }

    /// `tokens` per minute.
    pub const fn per_minute(tokens: u64) -> Self {
        Self::new(tokens, Duration::from_secs(60))
    }

    /// A fractional rate in tokens per second: a whole number of thousandths of a token per
    /// second (`0.5`, `2.25`, `0.001`), that is the double nearest such a number; any other is
    /// refused rather than rounded, whatever its size (`1000000.0009`). Below 2^52 thousandths
    /// each has its own double, so the rate is exactly the one the caller's decimal names.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate_core::Rate;
    /// assert_eq!(Rate::per_second_f64(0.5).unwrap(), Rate::new(500, Duration::from_secs(1000)));
    /// assert!(Rate::per_second_f64(f64::NAN).is_err());
    /// // not rounded to 0.002, which would admit a third more than asked
    /// assert!(Rate::per_second_f64(0.0015).is_err());
    /// ```
    pub fn per_second_f64(rate: f64) -> Result<Self, PolicyError> {
        if !rate.is_finite() || rate <= 0.0 {
            return Err(PolicyError::NotPositiveFinite {
                field: "rate",
                got: rate,
            });
        }
        // A whole number of thousandths `m`: `rate` is the double nearest `m / 1000`, the one
        // a decimal with at most three fractional digits parses to (0.003 * 1000 is
        // 2.9999999999999996, yet 3.0 / 1000.0 is 0.003). Below 2^52 thousandths every such
        // number has its own double, so this is exact; anything else would be rounded to a
        // rate faster or slower than asked (0.0015 to 0.002, 1000000.0009 to 1000000.001). A
        // relative tolerance (it was 1e-9) let large rates through with their fraction rounded.
        let scaled = rate * 1000.0;
        if scaled >= MAX_EXACT as f64 {
            return Err(PolicyError::RateTooLarge {
                field: "rate",
                max: MAX_EXACT / 1000,
                got: rate,
            });
        }
        // `scaled` is within one `m` of the product's rounding of `m`: try its neighbours too
        let near = scaled.round() as u64;
        match (near.saturating_sub(1)..=near + 1)
            // the same double, bit for bit (`rate` is positive and finite): equality is the test
            .find(|&m| {
                (1..MAX_EXACT).contains(&m) && (m as f64 / 1000.0).to_bits() == rate.to_bits()
            }) {
            Some(milli) => Ok(Self::new(milli, Duration::from_secs(1000))),
            None => Err(PolicyError::NotWholeThousandths {
                field: "rate",
                got: rate,
            }),
        }
    }

    /// Tokens added per period.
    pub const fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The period over which `tokens` are added.
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// Tokens per second as a float (for display only).
    pub fn as_per_second(&self) -> f64 {
        self.tokens as f64 / self.period.as_secs_f64()
    }
}

/// Token bucket parameters in the exact integer form the maths uses.
///
/// Tokens are kept in *units*: one token is `unit` units and the bucket gains `rate` units per
/// microsecond, so refill is integer arithmetic with no rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenBucket {
    /// Maximum tokens the bucket holds (the largest burst).
    pub capacity: u64,
    /// The refill rate as given.
    pub refill: Rate,
    /// Units per token.
    pub unit: u64,
    /// Units added per microsecond.
    pub rate: u64,
    /// Optional cap on the elapsed time credited by a single call, in microseconds.
    pub max_elapsed_micros: Option<u64>,
}

impl TokenBucket {
    /// Capacity in units.
    pub const fn capacity_units(&self) -> u64 {
        self.capacity * self.unit
    }

    /// Microseconds an empty bucket takes to refill completely.
    pub const fn fill_micros(&self) -> u64 {
        self.capacity_units().div_ceil(self.rate)
    }
}

/// Fixed window parameters: `limit` per window aligned to the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    /// Cost admitted per window.
    pub limit: u64,
    /// Window length in microseconds.
    pub window_micros: u64,
}

/// Sliding log parameters: `limit` in any window of `window_micros` ending now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingLog {
    /// Cost admitted in any window.
    pub limit: u64,
    /// Window length in microseconds.
    pub window_micros: u64,
}

/// The algorithm a policy uses, with its validated parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// Capacity and a refill rate: smooth, allows bursts up to capacity.
    TokenBucket(TokenBucket),
    /// A limit per epoch-aligned window: simple, allows up to twice the limit across a boundary.
    FixedWindow(FixedWindow),
    /// An exact limit over any window ending now: precise, state grows with the limit.
    SlidingLog(SlidingLog),
}

impl Algorithm {
    /// A stable short name ("token_bucket", "fixed_window", "sliding_log").
    pub fn name(&self) -> &'static str {
        match self {
            Self::TokenBucket(_) => "token_bucket",
            Self::FixedWindow(_) => "fixed_window",
            Self::SlidingLog(_) => "sliding_log",
        }
    }
}

/// How a bucket already written under other parameters moves to a newer policy. Chosen per
/// policy; the transition happens inside the same atomic step as the decision that meets the
/// bucket first (see `docs/policy-changes.md`).
///
/// A bucket records the generation and parameters that last wrote it. A caller whose policy is
/// *newer* (a higher generation, or the same generation with other parameters) applies its
/// rule; a caller whose policy is *older* is decided under the stored, newer parameters, so a
/// fleet in mid-rollout enforces one policy per bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Transition {
    /// A fresh bucket under the new parameters (full token bucket, empty window or log).
    Reset,
    /// Keep what was used and reinterpret it under the new parameters: tokens are converted to
    /// the new units and clamped to the new capacity; a window keeps its count; a log keeps its
    /// live entries. The default of [`Policy`]'s constructors (generation 0): an in-place edit
    /// of a policy behaves as it always did.
    #[default]
    Carry,
    /// Keep the fraction of the limit still available, rounded down.
    Proportional,
    /// The old parameters keep governing the bucket until it expires (its expiry no longer
    /// moves), then the new ones apply to a fresh bucket.
    DeferUntilExpiry,
}

impl Transition {
    /// Every rule, in code order.
    pub const ALL: [Self; 4] = [
        Self::Reset,
        Self::Carry,
        Self::Proportional,
        Self::DeferUntilExpiry,
    ];

    /// A stable name as written in a policy spec (`reset`, `carry`, `proportional`,
    /// `defer-until-expiry`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reset => "reset",
            Self::Carry => "carry",
            Self::Proportional => "proportional",
            Self::DeferUntilExpiry => "defer-until-expiry",
        }
    }

    /// The rule's number in a Redis script's arguments (0 to 3).
    pub fn code(self) -> u64 {
        match self {
            Self::Reset => 0,
            Self::Carry => 1,
            Self::Proportional => 2,
            Self::DeferUntilExpiry => 3,
        }
    }

    /// Parses a rule name (`defer` is accepted for `defer-until-expiry`).
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "reset" => Self::Reset,
            "carry" => Self::Carry,
            "proportional" => Self::Proportional,
            "defer-until-expiry" | "defer" => Self::DeferUntilExpiry,
            _ => return None,
        })
    }
}

impl fmt::Display for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An algorithm with validated parameters, a generation, a [`Transition`] rule and a
/// fingerprint.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::{Policy, PolicyError, Rate};
///
/// let p = Policy::fixed_window(100, Duration::from_secs(60)).unwrap().with_generation(2);
/// assert_eq!(p.limit(), 100);
/// assert_eq!(p.generation(), 2);
/// assert_eq!(p.check_cost(101), Err(PolicyError::CostAboveCapacity { cost: 101, max: 100 }));
/// assert!(Policy::token_bucket(0, Rate::per_second(1)).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Policy {
    algorithm: Algorithm,
    generation: u64,
    transition: Transition,
}

const MIN_WINDOW: Duration = Duration::from_millis(1);

fn check_duration(field: &'static str, d: Duration, min: Duration) -> Result<u64, PolicyError> {
    if d < min {
        return Err(PolicyError::DurationTooShort { field, min, got: d });
    }
    if d > MAX_DURATION {
        return Err(PolicyError::DurationTooLong {
            field,
            max: MAX_DURATION,
            got: d,
        });
    }
    if !d.subsec_nanos().is_multiple_of(1_000) {
        return Err(PolicyError::NotWholeMicros { field, got: d });
    }
    Ok(d.as_micros() as u64)
}

fn check_count(field: &'static str, n: u64, max: u64) -> Result<u64, PolicyError> {
    if n == 0 {
        return Err(PolicyError::Zero { field });
    }
    if n > max {
        return Err(PolicyError::TooLarge { field, max, got: n });
    }
    Ok(n)
}

impl Policy {
    /// A token bucket holding up to `capacity` tokens, refilled at `refill`.
    pub fn token_bucket(capacity: u64, refill: Rate) -> Result<Self, PolicyError> {
        let capacity = check_count("capacity", capacity, MAX_EXACT)?;
        let tokens = check_count("refill tokens", refill.tokens, MAX_EXACT)?;
        let period = check_duration("refill period", refill.period, Duration::from_micros(1))?;
        let g = crate::algorithm::gcd(tokens, period);
        let (unit, rate) = (period / g, tokens / g);
        let cap_units = capacity
            .checked_mul(unit)
            .and_then(|c| c.checked_add(rate))
            .filter(|&c| c <= MAX_EXACT)
            .ok_or_else(|| {
                PolicyError::Overflow(format!(
                    "capacity {capacity} at {tokens} tokens per {period}us needs {capacity}x{unit} units, above 2^52"
                ))
            })?;
        debug_assert!(cap_units > 0);
        Ok(Self {
            algorithm: Algorithm::TokenBucket(TokenBucket {
                capacity,
                refill,
                unit,
                rate,
                max_elapsed_micros: None,
            }),
            generation: 0,
            transition: Transition::Carry,
        })
    }

    /// A fixed window admitting `limit` per `window`, windows aligned to the Unix epoch.
    pub fn fixed_window(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        let limit = check_count("limit", limit, MAX_EXACT)?;
        let window_micros = check_duration("window", window, MIN_WINDOW)?;
        Ok(Self {
            algorithm: Algorithm::FixedWindow(FixedWindow {
                limit,
                window_micros,
            }),
            generation: 0,
            transition: Transition::Carry,
        })
    }

    /// A sliding log admitting `limit` in any `window` ending now.
    pub fn sliding_log(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        let limit = check_count("limit", limit, MAX_SLIDING_LOG_LIMIT)?;
        let window_micros = check_duration("window", window, MIN_WINDOW)?;
        Ok(Self {
            algorithm: Algorithm::SlidingLog(SlidingLog {
                limit,
                window_micros,
            }),
            generation: 0,
            transition: Transition::Carry,
        })
    }

    /// The same policy with another generation. A generation above [`MAX_EXACT`] is refused
    /// when the policy is used (see [`Policy::check_cost`]), and its [`Policy::to_spec`] does
    /// not parse back (the spec parser refuses it too).
    #[must_use]
    pub fn with_generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self
    }

    /// The same policy with another rule for moving live buckets to it (default
    /// [`Transition::Carry`]).
    #[must_use]
    pub fn with_transition(mut self, transition: Transition) -> Self {
        self.transition = transition;
        self
    }

    /// How a live bucket written by an older policy moves to this one.
    pub const fn transition(&self) -> Transition {
        self.transition
    }

    /// For a token bucket, caps the elapsed time one call may credit, so that a forward clock
    /// jump buys at most `cap` worth of tokens — while the bucket's key lives. A jump past the
    /// key's expiry (an emptied bucket's refill time at the full rate) finds a missing bucket,
    /// which is full: what the full refill would give without the cap (docs/clock.md, rule 5).
    /// Ignored by other algorithms.
    ///
    /// The cap cannot tell a clock jump from a quiet spell, so a real wait longer than `cap` is
    /// also credited only `cap` per call. `retry_after` accounts for it: it never exceeds `cap`
    /// (plus however far the clock reads behind the bucket's stored time, after a step back:
    /// waits are instants; and but for a deferred raise's cost that only the new limit admits,
    /// which waits for the bucket's expiry), and a client that follows it call after call is
    /// admitted at the earliest instant the rate allows. An idle bucket still expires (and so reads full) after `reset_after`.
    pub fn with_max_elapsed(mut self, cap: Duration) -> Result<Self, PolicyError> {
        let micros = check_duration("max elapsed", cap, Duration::from_micros(1))?;
        if let Algorithm::TokenBucket(tb) = &mut self.algorithm {
            tb.max_elapsed_micros = Some(micros);
        }
        Ok(self)
    }

    /// The algorithm and its parameters.
    pub const fn algorithm(&self) -> &Algorithm {
        &self.algorithm
    }

    /// The generation this policy was published as.
    pub const fn generation(&self) -> u64 {
        self.generation
    }

    /// The largest cost one request may have: capacity or limit.
    pub const fn limit(&self) -> u64 {
        self.algorithm.limit()
    }

    /// Checks a request's cost: at least 1 and at most [`Policy::limit`]; and that the
    /// generation is at most [`MAX_EXACT`] (so the Redis scripts hold it exactly).
    pub const fn check_cost(&self, cost: u64) -> Result<(), PolicyError> {
        if self.generation > MAX_EXACT {
            return Err(PolicyError::TooLarge {
                field: "generation",
                max: MAX_EXACT,
                got: self.generation,
            });
        }
        if cost == 0 {
            return Err(PolicyError::ZeroCost);
        }
        let max = self.limit();
        if cost > max {
            return Err(PolicyError::CostAboveCapacity { cost, max });
        }
        Ok(())
    }

    /// A stable 64-bit fingerprint of the algorithm and parameters (not the generation, nor the
    /// transition rule):
    /// FNV-1a over a canonical encoding, equal across processes and versions.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::default();
        match &self.algorithm {
            Algorithm::TokenBucket(tb) => {
                h.write(b"tb");
                h.u64(tb.capacity);
                h.u64(tb.unit);
                h.u64(tb.rate);
                h.u64(tb.max_elapsed_micros.unwrap_or(0));
            }
            Algorithm::FixedWindow(fw) => {
                h.write(b"fw");
                h.u64(fw.limit);
                h.u64(fw.window_micros);
            }
            Algorithm::SlidingLog(sl) => {
                h.write(b"sl");
                h.u64(sl.limit);
                h.u64(sl.window_micros);
            }
        }
        h.0
    }
}

impl Policy {
    /// The policy as a spec that parses back to an equal policy (the form the registry
    /// stores): `token-bucket:capacity=10,rate=7,period=3000000us,generation=2,transition=carry`.
    ///
    /// ```
    /// use tollgate_core::{Policy, Transition};
    /// let p: Policy = "sliding-log:limit=5,window=2s,generation=3,transition=proportional".parse().unwrap();
    /// assert_eq!(p.to_spec().parse::<Policy>().unwrap(), p);
    /// assert_eq!(p.transition(), Transition::Proportional);
    /// ```
    pub fn to_spec(&self) -> String {
        let head = match &self.algorithm {
            Algorithm::TokenBucket(tb) => {
                let mut s = format!(
                    "token-bucket:capacity={},rate={},period={}us",
                    tb.capacity,
                    tb.refill.tokens,
                    tb.refill.period.as_micros()
                );
                if let Some(m) = tb.max_elapsed_micros {
                    let _ = write!(s, ",max-elapsed={m}us");
                }
                s
            }
            Algorithm::FixedWindow(fw) => {
                format!(
                    "fixed-window:limit={},window={}us",
                    fw.limit, fw.window_micros
                )
            }
            Algorithm::SlidingLog(sl) => {
                format!(
                    "sliding-log:limit={},window={}us",
                    sl.limit, sl.window_micros
                )
            }
        };
        format!(
            "{head},generation={},transition={}",
            self.generation, self.transition
        )
    }
}

impl Algorithm {
    /// The same parameters in their canonical form: a token bucket's refill is rewritten as
    /// `rate` tokens every `unit` microseconds (the reduced ratio the maths uses), so two
    /// algorithms are equal exactly when they decide alike. This is the form a bucket stores.
    #[must_use]
    pub fn normalized(&self) -> Self {
        match *self {
            Self::TokenBucket(tb) => Self::TokenBucket(TokenBucket {
                refill: Rate::new(tb.rate, Duration::from_micros(tb.unit)),
                ..tb
            }),
            other => other,
        }
    }

    /// The largest cost one request may have: capacity or limit.
    pub const fn limit(&self) -> u64 {
        match self {
            Self::TokenBucket(tb) => tb.capacity,
            Self::FixedWindow(fw) => fw.limit,
            Self::SlidingLog(sl) => sl.limit,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.algorithm {
            Algorithm::TokenBucket(tb) => write!(
                f,
                "token-bucket:capacity={},rate={}/{}us",
                tb.capacity,
                tb.refill.tokens,
                tb.refill.period.as_micros()
            ),
            Algorithm::FixedWindow(fw) => {
                write!(
                    f,
                    "fixed-window:limit={},window={}us",
                    fw.limit, fw.window_micros
                )
            }
            Algorithm::SlidingLog(sl) => {
                write!(
                    f,
                    "sliding-log:limit={},window={}us",
                    sl.limit, sl.window_micros
                )
            }
        }?;
        write!(f, ",generation={}", self.generation)?;
        if self.transition != Transition::Carry {
            write!(f, ",transition={}", self.transition)?;
        }
        Ok(())
    }
}

struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn u64(&mut self, v: u64) {
        self.write(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fractional rate is a whole number of thousandths per second, or refused: it was
    /// rounded to the nearest thousandth, so `rate=0.0005` ran at 0.001/s (twice as asked)
    /// and `0.0004` was refused as "not greater than 0".
    #[test]
    fn fractional_rates_are_whole_thousandths_or_refused() {
        for ok in [0.001, 0.003, 0.5, 2.25, 0.3, 1.001] {
            let rate = Rate::per_second_f64(ok).unwrap();
            assert!((rate.as_per_second() - ok).abs() < 1e-12, "{ok}");
        }
        for bad in [0.0005, 0.0015, 0.0025, 1.0006, 0.0004] {
            assert!(
                matches!(
                    Rate::per_second_f64(bad),
                    Err(PolicyError::NotWholeThousandths { field: "rate", .. })
                ),
                "{bad}"
            );
        }
        let refused = "token-bucket:capacity=1,rate=0.0015".parse::<Policy>();
        assert!(refused.is_err(), "{refused:?}");
    }

    /// A large rate with a fraction finer than a thousandth was accepted and rounded: the
    /// check allowed a relative error of 1e-9, far above a double's representation error, so
    /// `1000000.0009` ran at 1000000.001 tokens/s (faster than asked) and `1000000000.0004`
    /// at 1000000000/s. Every whole number of thousandths below 2^52 is still exact.
    #[test]
    fn large_rates_finer_than_a_thousandth_are_refused() {
        for bad in [
            1_000_000.000_9,
            1_000_000.000_4,
            5_000_000.004_2,
            123_456_789.123_4,
            1_000_000_000.000_4,
        ] {
            assert!(
                matches!(
                    Rate::per_second_f64(bad),
                    Err(PolicyError::NotWholeThousandths { field: "rate", .. })
                ),
                "{bad}: {:?}",
                Rate::per_second_f64(bad)
            );
        }
        // whole thousandths, from the smallest to the largest accepted, with their neighbours
        let mut milli: Vec<u64> = (1..2_000).collect();
        for top in [1u64 << 20, 1 << 33, 1 << 42, 1 << 51, MAX_EXACT - 1] {
            milli.extend(top - 1_000..top);
        }
        milli.extend([999_999_999, 1_000_000_001, 123_456_789_123]);
        for m in milli {
            let rate = m as f64 / 1000.0;
            assert_eq!(
                Rate::per_second_f64(rate),
                Ok(Rate::new(m, Duration::from_secs(1000))),
                "{m} thousandths"
            );
        }
    }

    #[test]
    fn rejects_zero_nan_and_overflowing_parameters() {
        assert_eq!(
            Policy::token_bucket(0, Rate::per_second(1)),
            Err(PolicyError::Zero { field: "capacity" })
        );
        assert!(matches!(
            Policy::token_bucket(1, Rate::new(1, Duration::ZERO)),
            Err(PolicyError::DurationTooShort { .. })
        ));
        assert!(matches!(
            Policy::token_bucket(u64::MAX, Rate::per_second(1)),
            Err(PolicyError::TooLarge { .. })
        ));
        assert!(matches!(
            Policy::token_bucket(1 << 40, Rate::new(1, Duration::from_secs(3600))),
            Err(PolicyError::Overflow(_))
        ));
        assert!(matches!(
            Policy::fixed_window(10, Duration::from_secs(400 * 365 * 86_400)),
            Err(PolicyError::DurationTooLong { .. })
        ));
        assert!(matches!(
            Policy::sliding_log(MAX_SLIDING_LOG_LIMIT + 1, Duration::from_secs(1)),
            Err(PolicyError::TooLarge { .. })
        ));
        // a period with a sub-microsecond part would be truncated (1999 ns as 1 µs: twice the
        // rate) and its spec would not parse back to an equal policy
        assert_eq!(
            Policy::token_bucket(10, Rate::new(1, Duration::from_nanos(1999))),
            Err(PolicyError::NotWholeMicros {
                field: "refill period",
                got: Duration::from_nanos(1999)
            })
        );
        assert!(matches!(
            Policy::fixed_window(10, Duration::from_nanos(1_000_000_500)),
            Err(PolicyError::NotWholeMicros {
                field: "window",
                ..
            })
        ));
        assert!(Policy::token_bucket(10, Rate::new(1, Duration::from_nanos(2000))).is_ok());
        assert!(Rate::per_second_f64(-1.0).is_err());
        assert!(Rate::per_second_f64(f64::INFINITY).is_err());
        assert!(Rate::per_second_f64(0.0001).is_err());
    }

    #[test]
    fn reduces_rate_to_smallest_exact_units() {
        let p = Policy::token_bucket(10, Rate::per_second(2)).unwrap();
        let Algorithm::TokenBucket(tb) = p.algorithm() else {
            unreachable!()
        };
        assert_eq!((tb.unit, tb.rate), (500_000, 1));
        assert_eq!(tb.fill_micros(), 5_000_000);
    }

    #[test]
    fn fingerprint_ignores_generation_and_tracks_parameters() {
        let a = Policy::fixed_window(10, Duration::from_secs(1)).unwrap();
        let b = a.with_generation(7);
        let c = Policy::fixed_window(11, Duration::from_secs(1)).unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
    }

    #[test]
    fn cost_checks() {
        let p = Policy::sliding_log(5, Duration::from_secs(1)).unwrap();
        assert_eq!(p.check_cost(0), Err(PolicyError::ZeroCost));
        assert_eq!(p.check_cost(5), Ok(()));
        assert_eq!(
            p.check_cost(6),
            Err(PolicyError::CostAboveCapacity { cost: 6, max: 5 })
        );
    }
}
