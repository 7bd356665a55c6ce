//! The textual form of a policy, as written on a command line or in a policy file:
//! `token-bucket:capacity=10,rate=2`, `fixed-window:limit=100,window=1m`,
//! `sliding-log:limit=20,window=10s`.
//!
//! Every algorithm also takes `generation=N` and `transition=reset|carry|proportional|defer`
//! (see [`Transition`]). A spec with a generation above 0 must name its transition: a
//! published policy change says how live buckets move to it, never by default. Without a
//! generation the rule defaults to `carry`, how an in-place edit has always behaved.

use std::str::FromStr;
use std::time::Duration;

use crate::{MAX_EXACT, Policy, PolicyError, Rate, Transition};

/// Why a policy spec could not be parsed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The algorithm name before `:` is not one of the known ones.
    #[error("unknown algorithm {0:?}: expected token-bucket, fixed-window or sliding-log")]
    UnknownAlgorithm(String),
    /// A `name=value` pair was malformed.
    #[error("malformed parameter {0:?}: expected name=value")]
    Malformed(String),
    /// A parameter name is not used by this algorithm.
    #[error("unknown parameter {name:?} for {algorithm}")]
    UnknownParameter {
        /// The algorithm.
        algorithm: &'static str,
        /// The parameter given.
        name: String,
    },
    /// A parameter appeared twice.
    #[error("parameter {0:?} given twice")]
    Duplicate(String),
    /// A required parameter is missing.
    #[error("missing parameter {name:?} for {algorithm}")]
    Missing {
        /// The algorithm.
        algorithm: &'static str,
        /// The missing parameter.
        name: &'static str,
    },
    /// A value could not be parsed.
    #[error("invalid value {value:?} for {name}: {reason}")]
    BadValue {
        /// The parameter.
        name: String,
        /// The value given.
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The values parsed but do not make a valid policy.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

struct Params<'a> {
    algorithm: &'static str,
    pairs: Vec<(&'a str, &'a str)>,
}

impl<'a> Params<'a> {
    fn parse(algorithm: &'static str, body: &'a str, allowed: &[&str]) -> Result<Self, SpecError> {
        let mut pairs: Vec<(&str, &str)> = Vec::new();
        for item in body.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = item
                .split_once('=')
                .map(|(n, v)| (n.trim(), v.trim()))
                .filter(|(n, v)| !n.is_empty() && !v.is_empty())
                .ok_or_else(|| SpecError::Malformed(item.to_owned()))?;
            if !allowed.contains(&name) {
                return Err(SpecError::UnknownParameter {
                    algorithm,
                    name: name.to_owned(),
                });
            }
            if pairs.iter().any(|(n, _)| *n == name) {
                return Err(SpecError::Duplicate(name.to_owned()));
            }
            pairs.push((name, value));
        }
        Ok(Self { algorithm, pairs })
    }

    fn get(&self, name: &str) -> Option<&'a str> {
        self.pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }

    fn require(&self, name: &'static str) -> Result<&'a str, SpecError> {
        self.get(name).ok_or(SpecError::Missing {
            algorithm: self.algorithm,
            name,
        })
    }

    fn count(&self, name: &'static str) -> Result<u64, SpecError> {
        let v = self.require(name)?;
        v.parse::<u64>().map_err(|e| bad(name, v, &e))
    }

    fn duration(&self, name: &'static str) -> Result<Option<Duration>, SpecError> {
        self.get(name).map(|v| parse_duration(name, v)).transpose()
    }

    fn generation(&self) -> Result<u64, SpecError> {
        let g = self
            .get("generation")
            .map_or(Ok(0), |v| v.parse().map_err(|e| bad("generation", v, &e)))?;
        if g > MAX_EXACT {
            return Err(PolicyError::TooLarge {
                field: "generation",
                max: MAX_EXACT,
                got: g,
            }
            .into());
        }
        Ok(g)
    }

    /// Applies `generation` and `transition`; a generation above 0 needs an explicit rule.
    fn versioned(&self, policy: Policy) -> Result<Policy, SpecError> {
        let generation = self.generation()?;
        let transition = match self.get("transition") {
            Some(v) => Transition::parse(v).ok_or_else(|| {
                bad(
                    "transition",
                    v,
                    &"expected reset, carry, proportional or defer-until-expiry",
                )
            })?,
            None if generation > 0 => {
                return Err(SpecError::Missing {
                    algorithm: self.algorithm,
                    name: "transition",
                });
            }
            None => Transition::Carry,
        };
        Ok(policy
            .with_generation(generation)
            .with_transition(transition))
    }
}

fn bad(name: &str, value: &str, reason: &dyn std::fmt::Display) -> SpecError {
    SpecError::BadValue {
        name: name.to_owned(),
        value: value.to_owned(),
        reason: reason.to_string(),
    }
}

/// Parses `500ms`, `10s`, `1m`, `2h 30m` (humantime) or a bare number of seconds.
fn parse_duration(name: &str, v: &str) -> Result<Duration, SpecError> {
    if let Ok(secs) = v.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(v).map_err(|e| bad(name, v, &e))
}

/// A rate in tokens per second written as a decimal (`0.5`, `2.250`, `+1.5`, `1.5e3`), read
/// exactly from its text: a whole number of thousandths, or refused. Through a double, a
/// fraction finer than a thousandth can read as a whole one (`4503599627370.4951` parses to the
/// double of `4503599627370.495`). `None` for any other form (a minus sign, `inf`, a number
/// beyond a double's range such as `1e400`), left to [`Rate::per_second_f64`].
fn decimal_rate(text: &str) -> Option<Result<Rate, PolicyError>> {
    // beyond a double's range: "not a positive finite number", as before
    if !text.parse::<f64>().is_ok_and(f64::is_finite) {
        return None;
    }
    let unsigned = text.strip_prefix('+').unwrap_or(text);
    let (mantissa, exp) = match unsigned.find(['e', 'E']) {
        Some(at) => (
            &unsigned[..at],
            unsigned[at + 1..]
                .parse::<i32>()
                .ok()
                .filter(|e| e.abs() <= 400)?,
        ),
        None => (unsigned, 0),
    };
    let (whole, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (whole.is_empty() && frac.is_empty()) || !digits(whole) || !digits(frac) {
        return None;
    }
    let got = || text.parse::<f64>().unwrap_or(f64::NAN);
    // the value is `all` x 10^(exp - frac.len()): in thousandths, `all` shifted by `shift`
    let all = format!("{whole}{frac}");
    let all = all.trim_start_matches('0');
    let shift = i64::from(exp) + 3 - i64::try_from(frac.len()).ok()?;
    let kept = if let Ok(cut) = usize::try_from(-shift) {
        let (head, rest) = all.split_at(all.len().saturating_sub(cut));
        if rest.bytes().any(|b| b != b'0') {
            return Some(Err(PolicyError::NotWholeThousandths {
                field: "rate",
                got: got(),
            }));
        }
        head.to_owned()
    } else if all.is_empty() {
        String::new()
    } else {
        format!("{all}{}", "0".repeat(usize::try_from(shift).ok()?))
    };
    let milli = if kept.is_empty() {
        Some(0)
    } else {
        kept.parse::<u64>().ok()
    };
    Some(match milli {
        Some(0) => Err(PolicyError::NotPositiveFinite {
            field: "rate",
            got: 0.0,
        }),
        Some(m) if m < MAX_EXACT => Ok(Rate::new(m, Duration::from_secs(1000))),
        _ => Err(PolicyError::RateTooLarge {
            field: "rate",
            max: MAX_EXACT / 1000,
            got: got(),
        }),
    })
}

impl FromStr for Policy {
    type Err = SpecError;

    /// Parses a policy spec.
    ///
    /// ```
    /// use tollgate_core::Policy;
    /// let p: Policy = "token-bucket:capacity=10,rate=2".parse().unwrap();
    /// assert_eq!(p.limit(), 10);
    /// let p: Policy = "token-bucket:capacity=5,rate=0.5,max-elapsed=30s,generation=3,transition=carry".parse().unwrap();
    /// assert_eq!(p.generation(), 3);
    /// // a published generation must say how live buckets move to it
    /// assert!("token-bucket:capacity=5,rate=1,generation=3".parse::<Policy>().is_err());
    /// let p: Policy = "fixed-window:limit=100,window=1m".parse().unwrap();
    /// assert_eq!(p.limit(), 100);
    /// assert!("sliding-log:limit=0,window=1s".parse::<Policy>().is_err());
    /// assert!("token-bucket:capacity=10,rate=NaN".parse::<Policy>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (alg, body) = s.split_once(':').unwrap_or((s, ""));
        let policy = match alg.trim() {
            "token-bucket" | "token_bucket" | "tb" => {
                let p = Params::parse(
                    "token-bucket",
                    body,
                    &[
                        "capacity",
                        "rate",
                        "period",
                        "max-elapsed",
                        "generation",
                        "transition",
                    ],
                )?;
                let capacity = p.count("capacity")?;
                let rate_text = p.require("rate")?;
                let rate = match p.duration("period")? {
                    Some(period) => {
                        let tokens = rate_text
                            .parse::<u64>()
                            .map_err(|e| bad("rate", rate_text, &e))?;
                        Rate::new(tokens, period)
                    }
                    None => {
                        if let Ok(n) = rate_text.parse::<u64>() {
                            Rate::per_second(n)
                        } else if let Some(rate) = decimal_rate(rate_text) {
                            rate?
                        } else {
                            let f = rate_text
                                .parse::<f64>()
                                .map_err(|e| bad("rate", rate_text, &e))?;
                            Rate::per_second_f64(f)?
                        }
                    }
                };
                let mut policy = Policy::token_bucket(capacity, rate)?;
                if let Some(cap) = p.duration("max-elapsed")? {
                    policy = policy.with_max_elapsed(cap)?;
                }
                p.versioned(policy)?
            }
            "fixed-window" | "fixed_window" | "fw" => {
                let p = Params::parse(
                    "fixed-window",
                    body,
                    &["limit", "window", "generation", "transition"],
                )?;
                let window = p.duration("window")?.ok_or(SpecError::Missing {
                    algorithm: "fixed-window",
                    name: "window",
                })?;
                p.versioned(Policy::fixed_window(p.count("limit")?, window)?)?
            }
            "sliding-log" | "sliding_log" | "sl" => {
                let p = Params::parse(
                    "sliding-log",
                    body,
                    &["limit", "window", "generation", "transition"],
                )?;
                let window = p.duration("window")?.ok_or(SpecError::Missing {
                    algorithm: "sliding-log",
                    name: "window",
                })?;
                p.versioned(Policy::sliding_log(p.count("limit")?, window)?)?
            }
            other => return Err(SpecError::UnknownAlgorithm(other.to_owned())),
        };
        Ok(policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Algorithm;

    #[test]
    fn names_the_offending_parameter() {
        let e = "token-bucket:capacity=10".parse::<Policy>().unwrap_err();
        assert_eq!(
            e,
            SpecError::Missing {
                algorithm: "token-bucket",
                name: "rate"
            }
        );
        let e = "fixed-window:limit=10,window=1s,burst=3"
            .parse::<Policy>()
            .unwrap_err();
        assert!(matches!(e, SpecError::UnknownParameter { .. }));
        let e = "fixed-window:limit=-1,window=1s"
            .parse::<Policy>()
            .unwrap_err();
        assert!(matches!(e, SpecError::BadValue { .. }));
        let e = "leaky:limit=1".parse::<Policy>().unwrap_err();
        assert!(matches!(e, SpecError::UnknownAlgorithm(_)));
        let e = "fixed-window:limit=1,limit=2,window=1s"
            .parse::<Policy>()
            .unwrap_err();
        assert!(matches!(e, SpecError::Duplicate(_)));
    }

    #[test]
    fn a_generation_needs_an_explicit_transition() {
        let e = "fixed-window:limit=1,window=1s,generation=2"
            .parse::<Policy>()
            .unwrap_err();
        assert_eq!(
            e,
            SpecError::Missing {
                algorithm: "fixed-window",
                name: "transition"
            }
        );
        let p: Policy = "fixed-window:limit=1,window=1s".parse().unwrap();
        assert_eq!(p.transition(), Transition::Carry);
        let p: Policy = "sl:limit=1,window=1s,generation=2,transition=defer"
            .parse()
            .unwrap();
        assert_eq!(p.transition(), Transition::DeferUntilExpiry);
        assert!(matches!(
            "fw:limit=1,window=1s,generation=1,transition=maybe".parse::<Policy>(),
            Err(SpecError::BadValue { .. })
        ));
        assert!(matches!(
            "fw:limit=1,window=1s,generation=9007199254740992,transition=reset".parse::<Policy>(),
            Err(SpecError::Policy(PolicyError::TooLarge { .. }))
        ));
    }

    #[test]
    fn to_spec_round_trips_every_algorithm_and_rule() {
        for text in [
            "token-bucket:capacity=7,rate=7,period=3s,max-elapsed=2s,generation=4,transition=proportional",
            "token-bucket:capacity=10,rate=0.5",
            "fixed-window:limit=100,window=1m,generation=1,transition=reset",
            "sliding-log:limit=20,window=1500ms,generation=9,transition=defer-until-expiry",
        ] {
            let p: Policy = text.parse().unwrap();
            assert_eq!(p.to_spec().parse::<Policy>().unwrap(), p, "{text}");
        }
    }

    /// `rate=text` in a token-bucket spec is refused with an error `expected` accepts.
    fn assert_rate_refused(text: &str, expected: impl Fn(&PolicyError) -> bool) {
        let spec = format!("token-bucket:capacity=10,rate={text}");
        let got = spec.parse::<Policy>();
        assert!(
            matches!(&got, Err(SpecError::Policy(e)) if expected(e)),
            "{spec}: {got:?}"
        );
    }

    /// A rate too large is reported as given, not as a number the caller never wrote (it was
    /// "got 18446744073709551615" for `1e300`, and "at most 4503599627370, got 4503599627370"
    /// for `4503599627370.5`).
    #[test]
    fn a_rate_too_large_is_reported_as_given() {
        for (text, shown) in [
            ("1e300", "got 1e300"),
            ("99999999999999999999", "got 1e20"),
            ("4503599627370.5", "got 4503599627370.5"),
            ("4.503599627370496e12", "got 4503599627370.496"),
        ] {
            let spec = format!("token-bucket:capacity=10,rate={text}");
            let message = spec.parse::<Policy>().unwrap_err().to_string();
            assert_eq!(
                message,
                format!("rate must be at most 4503599627370 per second, {shown}"),
                "{spec}"
            );
        }
        let message = Rate::per_second_f64(1e300).unwrap_err().to_string();
        assert_eq!(
            message,
            "rate must be at most 4503599627370 per second, got 1e300"
        );
    }

    /// A rate's refusal for a fraction finer than a thousandth.
    fn is_finer_than_a_thousandth(e: &PolicyError) -> bool {
        matches!(e, PolicyError::NotWholeThousandths { field: "rate", .. })
    }

    /// `rate=text` in a token-bucket spec reads as `milli` thousandths of a token per second.
    fn assert_rate_reads_as(text: &str, milli: u64) {
        let p: Policy = format!("token-bucket:capacity=1,rate={text}")
            .parse()
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        let Algorithm::TokenBucket(tb) = p.algorithm() else {
            unreachable!()
        };
        assert_eq!(
            tb.refill,
            Rate::new(milli, Duration::from_secs(1000)),
            "{text}"
        );
    }

    /// A rate written with a fraction finer than a thousandth is refused, read from its text:
    /// it was rounded (through a double whose check allowed a relative error of 1e-9), so
    /// `rate=1000000.0009` ran at 1000000.001 tokens/s, faster than written. Whole thousandths
    /// are read exactly, up to the largest accepted rate.
    #[test]
    fn rates_finer_than_a_thousandth_are_refused_from_their_text() {
        for text in [
            "1000000.0009",
            "1000000000.0004",
            "123456789.1234",
            "4503599627370.4951",
            "0.0015",
            "1.00000000000000001",
        ] {
            assert_rate_refused(text, is_finer_than_a_thousandth);
        }
        for (text, milli) in [
            ("0.5", 500),
            ("2.250", 2_250),
            ("1.0000", 1_000),
            ("1000000.001", 1_000_000_001),
            ("4503599627370.495", 4_503_599_627_370_495),
        ] {
            assert_rate_reads_as(text, milli);
        }
    }

    /// A sign or an exponent does not let a rate finer than a thousandth through: before, only
    /// a plain decimal was read from its text, and `+1.00000000000000001`,
    /// `+4503599627370.4951` and `4.5035996273704951e12` went through a double, rounded to a
    /// whole number of thousandths (1/s; 4503599627370.495/s) where the same rate written plainly
    /// is refused.
    #[test]
    fn signed_and_exponent_rates_are_read_exactly_too() {
        for text in [
            "+1.00000000000000001",
            "+4503599627370.4951",
            "4.5035996273704951e12",
            "+1000000.0009",
            "1.0000000009e6",
            "1.5e-3",
            "1e-4",
            "0.00000000000000000000001e-3",
        ] {
            assert_rate_refused(text, is_finer_than_a_thousandth);
        }
        for (text, milli) in [
            ("+0.5", 500),
            ("1e3", 1_000_000),
            ("1E-3", 1),
            ("1.5e3", 1_500_000),
            ("2.5E-1", 250),
            ("+.5e1", 5_000),
            ("5.", 5_000),
            (".5", 500),
            ("0.0010", 1),
            ("0.1e1", 1_000),
            ("4.503599627370495e12", 4_503_599_627_370_495),
            ("+4503599627370.495000", 4_503_599_627_370_495),
        ] {
            assert_rate_reads_as(text, milli);
        }
        for text in ["4.503599627370496e12", "1e300", "+99999999999999999999.5"] {
            assert_rate_refused(text, |e| {
                matches!(e, PolicyError::RateTooLarge { field: "rate", .. })
            });
        }
        for text in ["0e5", "+0.000", "-1.5", "inf", "1e", "e5"] {
            let spec = format!("token-bucket:capacity=10,rate={text}");
            assert!(spec.parse::<Policy>().is_err(), "{spec}");
        }
    }

    #[test]
    fn parses_rates_with_periods() {
        let p: Policy = "token-bucket:capacity=7,rate=7,period=3s".parse().unwrap();
        assert_eq!(
            p.to_string(),
            "token-bucket:capacity=7,rate=7/3000000us,generation=0"
        );
    }
}
