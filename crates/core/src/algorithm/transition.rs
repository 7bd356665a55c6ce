//! Moving a live bucket to a newer policy: the state written under old parameters, converted
//! for new ones by a [`Transition`] rule, at the instant the newer policy first meets it. The
//! Redis scripts implement the same conversions (a differential test holds them equal).
//!
//! Every conversion first brings the bucket up to `max(now, its stored time)` under the old
//! parameters (they governed until then), then converts:
//!
//! | rule | token bucket (level) | fixed window (count) | sliding log (entries) |
//! |---|---|---|---|
//! | `Reset` | full | 0 | none |
//! | `Carry` | same tokens in new units, at most the new capacity | same count | the entries live under the old window |
//! | `Proportional` | `level · cap_new / cap_old` | keeps `remaining / limit` | live entries rescaled to keep `remaining / limit` |
//!
//! Across algorithms (a newer generation of another algorithm, or the same generation: see
//! [`super::apply`]) the old bucket's *use* at `max(now, its stored time)` carries: a token
//! bucket's capacity minus its refilled level, a live window's count, a log's live costs.
//!
//! | rule | to a token bucket | to a fixed window | to a sliding log |
//! |---|---|---|---|
//! | `Reset` | full | 0 | none |
//! | `Carry` | the requests used (rounded up) taken from the new capacity | count = requests used, at most the limit | one entry of that cost at that time |
//! | `Proportional` | the available fraction of the new capacity (rounded down) | count keeping `remaining / limit` | one entry keeping `remaining / limit` |
//!
//! All rounding goes against the caller (never admits more than the exact fraction), and uses
//! [`muldiv`], exact for every value a valid policy can produce. A fixed window moves to the
//! new window containing the bucket's time. `DeferUntilExpiry` converts nothing: the stored
//! parameters keep governing (see [`super::apply`]).

use std::collections::VecDeque;

use crate::{Algorithm, Transition};

use super::{FixedWindowState, SlidingLogState, State, TokenBucketState, token_bucket};

/// `min(floor(a · b / c), max)`, exact (computed in 128 bits). The scripts compute the same
/// with doubles, bit by bit when `a · b` exceeds 2^52.
///
/// # Panics
/// If `c` is 0.
///
/// ```
/// use tollgate_core::algorithm::muldiv;
/// assert_eq!(muldiv(7, 3, 2, 100), 10);
/// assert_eq!(muldiv(1 << 52, 1 << 52, 3, 5), 5);
/// assert_eq!(muldiv((1 << 52) - 1, (1 << 52) - 3, (1 << 52) - 1, u64::MAX), (1 << 52) - 3);
/// ```
pub fn muldiv(a: u64, b: u64, c: u64, max: u64) -> u64 {
    let q = u128::from(a) * u128::from(b) / u128::from(c);
    q.min(u128::from(max)) as u64
}

/// The state that `to` starts from after `rule`, given the state `from` wrote (of the same
/// algorithm or another). `rule` is never `DeferUntilExpiry` here.
///
/// A sliding log keeps its time in its entries, so a log left empty (a `Reset`, nothing used)
/// would have none: with the clock stepped back behind the old bucket's effective time, its
/// first entry would be written at the stepped-back time, and live a window from there — the
/// clock's return would credit a second allowance. So an empty log converted behind that
/// time holds a marker of cost 0 at it: the decision takes its time from it, and an admission
/// merges into it (the scripts keep the same time in a local; the record written is the same).
pub(crate) fn convert(
    rule: Transition,
    from: &Algorithm,
    state: &State,
    to: &Algorithm,
    now: u64,
) -> State {
    let mut converted = convert_at(rule, from, state, to, now);
    if let State::SlidingLog(log) = &mut converted
        && log.entries.is_empty()
        && let Some(u) = usage(from, state, now)
        && u.eff > now
    {
        log.entries.push_back((u.eff, 0));
    }
    converted
}

/// [`convert`] before an empty log is given its time.
fn convert_at(
    rule: Transition,
    from: &Algorithm,
    state: &State,
    to: &Algorithm,
    now: u64,
) -> State {
    match (from, state, to) {
        (Algorithm::TokenBucket(o), State::TokenBucket(s), Algorithm::TokenBucket(n)) => {
            let eff = now.max(s.updated);
            let old = token_bucket::level_at(o, s.level, s.updated, eff);
            let cap = n.capacity_units();
            let level = match rule {
                Transition::Carry => muldiv(old, n.unit, o.unit, cap),
                Transition::Proportional => muldiv(old, cap, o.capacity_units(), cap),
                _ => cap,
            };
            State::TokenBucket(TokenBucketState {
                level,
                updated: eff,
            })
        }
        (Algorithm::FixedWindow(o), State::FixedWindow(s), Algorithm::FixedWindow(n)) => {
            let live = s.window_start >= now - now % o.window_micros;
            let (eff, used) = if live {
                (now.max(s.window_start), s.count)
            } else {
                (now, 0)
            };
            let count = match rule {
                Transition::Carry => used,
                Transition::Proportional => {
                    n.limit - muldiv(o.limit - used.min(o.limit), n.limit, o.limit, n.limit)
                }
                _ => 0,
            };
            State::FixedWindow(FixedWindowState {
                window_start: eff - eff % n.window_micros,
                count,
            })
        }
        (Algorithm::SlidingLog(o), State::SlidingLog(s), Algorithm::SlidingLog(n)) => {
            let eff = s.entries.back().map_or(now, |&(t, _)| now.max(t));
            let live = s
                .entries
                .iter()
                .copied()
                // eff is at least every entry's time: no sum near the end of u64 to overflow
                .filter(|&(t, _)| eff - t < o.window_micros);
            let entries = match rule {
                Transition::Carry => live.collect(),
                Transition::Proportional => rescale(live.collect(), o.limit, n.limit),
                _ => VecDeque::new(),
            };
            State::SlidingLog(SlidingLogState { entries })
        }
        // Across algorithms: `Carry` and `Proportional` go through the old bucket's use
        // (`across`); `Reset` starts fresh at the old bucket's effective time, `max(now, its
        // stored time)`, so a clock stepped back cannot move the bucket's time back and credit
        // a second fresh allowance when it returns; a state that does not match its
        // parameters starts fresh at `now`, as a missing bucket would.
        _ => match (rule, usage(from, state, now)) {
            (Transition::Carry | Transition::Proportional, Some(used)) => across(rule, used, to),
            (_, Some(used)) => fresh(to, used.eff),
            (_, None) => fresh(to, now),
        },
    }
}

/// A fresh bucket of `to` at `now`: what a missing bucket decides on (a sliding log keeps no
/// time when empty: [`convert`] gives it its time).
fn fresh(to: &Algorithm, now: u64) -> State {
    match to {
        Algorithm::TokenBucket(n) => State::TokenBucket(TokenBucketState {
            level: n.capacity_units(),
            updated: now,
        }),
        Algorithm::FixedWindow(n) => State::FixedWindow(FixedWindowState {
            window_start: now - now % n.window_micros,
            count: 0,
        }),
        _ => State::SlidingLog(SlidingLogState::default()),
    }
}

/// What a bucket has used at `max(now, its stored time)`, under its own parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Usage {
    /// `max(now, the stored time)`: a token bucket's `updated`, a fixed window's start, a
    /// sliding log's newest entry.
    eff: u64,
    /// Used, in `unit`s: a token bucket's capacity minus its level (refilled to `eff`); a live
    /// window's count, or the live entries' costs, at most the limit.
    used: u64,
    /// The whole limit in `unit`s (`used <= total`).
    total: u64,
    /// Units per request: a token bucket's unit, 1 for the windows.
    unit: u64,
}

impl Usage {
    /// Whole requests still available (what a decision's `remaining` says).
    pub(crate) fn remaining(&self) -> u64 {
        (self.total - self.used) / self.unit
    }
}

pub(crate) fn usage(from: &Algorithm, state: &State, now: u64) -> Option<Usage> {
    Some(match (from, state) {
        (Algorithm::TokenBucket(o), State::TokenBucket(s)) => {
            let eff = now.max(s.updated);
            let total = o.capacity_units();
            let level = token_bucket::level_at(o, s.level, s.updated, eff);
            Usage {
                eff,
                used: total - level,
                total,
                unit: o.unit,
            }
        }
        (Algorithm::FixedWindow(o), State::FixedWindow(s)) => {
            let live = s.window_start >= now - now % o.window_micros;
            Usage {
                eff: now.max(s.window_start),
                used: if live { s.count.min(o.limit) } else { 0 },
                total: o.limit,
                unit: 1,
            }
        }
        (Algorithm::SlidingLog(o), State::SlidingLog(s)) => {
            let eff = s.entries.back().map_or(now, |&(t, _)| now.max(t));
            let live: u64 = s
                .entries
                .iter()
                .filter(|&&(t, _)| eff - t < o.window_micros)
                .map(|&(_, c)| c)
                .sum();
            Usage {
                eff,
                used: live.min(o.limit),
                total: o.limit,
                unit: 1,
            }
        }
        _ => return None,
    })
}

/// A bucket of `to` at the old bucket's effective time, from what the old one used: `Carry`
/// keeps the requests used (rounded up to whole requests), at most the new limit;
/// `Proportional` keeps the fraction of the limit still available (rounded down). A token
/// bucket holds the rest as its level; a fixed window counts the use in the window containing
/// that time; a sliding log holds it as one entry at that time (0: none).
fn across(rule: Transition, u: Usage, to: &Algorithm) -> State {
    let (total, unit) = match to {
        Algorithm::TokenBucket(n) => (n.capacity_units(), n.unit),
        Algorithm::FixedWindow(n) => (n.limit, 1),
        Algorithm::SlidingLog(n) => (n.limit, 1),
    };
    let used = if rule == Transition::Carry {
        muldiv(u.used.div_ceil(u.unit), unit, 1, total)
    } else {
        total - muldiv(u.total - u.used, total, u.total, total)
    };
    match to {
        Algorithm::TokenBucket(_) => State::TokenBucket(TokenBucketState {
            level: total - used,
            updated: u.eff,
        }),
        Algorithm::FixedWindow(n) => State::FixedWindow(FixedWindowState {
            window_start: u.eff - u.eff % n.window_micros,
            count: used,
        }),
        Algorithm::SlidingLog(_) => State::SlidingLog(SlidingLogState {
            entries: if used > 0 {
                VecDeque::from([(u.eff, used)])
            } else {
                VecDeque::new()
            },
        }),
    }
}

/// Rescales a log's entries so that their sum keeps the fraction of the limit still available
/// (rounded down): each cost scaled down by `used_new / used_old`, rounded down, the rounding
/// added to the newest entry (it stays longest, so the rounding never frees allowance early),
/// entries of cost 0 dropped.
fn rescale(mut entries: VecDeque<(u64, u64)>, old: u64, new: u64) -> VecDeque<(u64, u64)> {
    let used: u64 = entries.iter().map(|e| e.1).sum();
    if used == 0 {
        return entries;
    }
    let target = new - muldiv(old - used.min(old), new, old, new);
    let mut sum = 0;
    for e in &mut entries {
        e.1 = muldiv(e.1, target, used, target);
        sum += e.1;
    }
    if let Some(last) = entries.back_mut() {
        last.1 += target - sum;
    }
    entries.retain(|e| e.1 > 0);
    entries
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Policy;
    use std::time::Duration;

    fn alg(p: &Policy) -> Algorithm {
        p.algorithm().normalized()
    }

    #[test]
    fn carry_converts_tokens_between_units_and_clamps() {
        // 10 tokens at 7 per 3 s (unit 3e6) → capacity 4 at 1/s (unit 1e6)
        let old = Policy::token_bucket(10, crate::Rate::new(7, Duration::from_secs(3))).unwrap();
        let new = Policy::token_bucket(4, crate::Rate::per_second(1)).unwrap();
        let state = State::TokenBucket(TokenBucketState {
            level: 3 * 3_000_000 + 1_500_000, // 3.5 tokens
            updated: 100,
        });
        let at = |rule| match convert(rule, &alg(&old), &state, &alg(&new), 100) {
            State::TokenBucket(s) => s.level,
            _ => unreachable!(),
        };
        assert_eq!(at(Transition::Carry), 3_500_000);
        assert_eq!(at(Transition::Proportional), 1_400_000); // 35 % of 4 tokens
        assert_eq!(at(Transition::Reset), 4_000_000);
    }

    #[test]
    fn proportional_log_keeps_the_available_fraction() {
        let o = Policy::sliding_log(10, Duration::from_secs(10)).unwrap();
        let n = Policy::sliding_log(4, Duration::from_secs(10)).unwrap();
        let s = State::SlidingLog(SlidingLogState {
            entries: VecDeque::from([(1, 3), (2, 2), (3, 1)]),
        });
        // 6 of 10 used: 40 % available → 1 of 4 available (1.6 rounded down), 3 used; each cost
        // halved and rounded down (3,2,1 → 1,1,0), the 1 left over on the newest
        let State::SlidingLog(p) = convert(Transition::Proportional, &alg(&o), &s, &alg(&n), 5)
        else {
            unreachable!()
        };
        assert_eq!(p.entries, VecDeque::from([(1, 1), (2, 1), (3, 1)]));
    }

    #[test]
    fn across_algorithms_carry_keeps_the_use_and_proportional_the_fraction() {
        let tb = Policy::token_bucket(10, crate::Rate::per_second(1)).unwrap();
        let fw = Policy::fixed_window(4, Duration::from_secs(10)).unwrap();
        let sl = Policy::sliding_log(4, Duration::from_secs(10)).unwrap();
        let t = 1_700_000_000_000_000;
        // 3.5 of 10 tokens left at t: 6.5 used
        let bucket = State::TokenBucket(TokenBucketState {
            level: 3_500_000,
            updated: t,
        });
        let window = |rule| match convert(rule, &alg(&tb), &bucket, &alg(&fw), t) {
            State::FixedWindow(s) => (s.window_start, s.count),
            _ => unreachable!(),
        };
        // carry: 7 requests used (rounded up), at most 4; proportional: 35 % of 4 left → 1
        assert_eq!(window(Transition::Carry), (t, 4));
        assert_eq!(window(Transition::Proportional), (t, 3));
        assert_eq!(window(Transition::Reset), (t, 0));
        let State::SlidingLog(log) =
            convert(Transition::Proportional, &alg(&tb), &bucket, &alg(&sl), t)
        else {
            unreachable!()
        };
        assert_eq!(log.entries, VecDeque::from([(t, 3)]));
        // a live window of 10 with 3 used, into a token bucket of 4 at 1/s
        let ten = Policy::fixed_window(10, Duration::from_secs(10)).unwrap();
        let four = Policy::token_bucket(4, crate::Rate::per_second(1)).unwrap();
        let counted = State::FixedWindow(FixedWindowState {
            window_start: t,
            count: 3,
        });
        let level = |rule| match convert(rule, &alg(&ten), &counted, &alg(&four), t + 5) {
            State::TokenBucket(s) => (s.level, s.updated),
            _ => unreachable!(),
        };
        assert_eq!(level(Transition::Carry), (1_000_000, t + 5));
        assert_eq!(level(Transition::Proportional), (2_800_000, t + 5));
        assert_eq!(level(Transition::Reset), (4_000_000, t + 5));
    }

    #[test]
    fn muldiv_is_exact_at_the_extremes() {
        let m = 1u64 << 52;
        assert_eq!(muldiv(m, m, m, u64::MAX), m);
        assert_eq!(muldiv(m - 1, m - 1, m, u64::MAX), m - 2);
        assert_eq!(muldiv(0, m, 1, 7), 0);
    }
}
