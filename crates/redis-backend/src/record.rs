//! The bytes of one bucket in Redis: a [`Record`] (generation, pending deferral, parameters,
//! state) as the scripts write it. Compact by design — an idle token bucket is about 20 bytes,
//! which keeps the key in Redis's smallest embedded-string allocation.
//!
//! Layout: a tag byte (1 token bucket, 2 fixed window, 3 sliding log), then unsigned LEB128
//! varints (7 bits a byte, low first): generation, pending (0 = none, else the deferring
//! generation + 1), the parameters, then the state — token bucket: capacity, unit, rate,
//! max_elapsed_us (0 = none), level_units, updated_us; fixed window: limit, window_us,
//! window_start_us, count; sliding log: limit, window_us, then `(time_us, cost)` pairs as
//! little-endian doubles (16 bytes each, so a script keeps a suffix of the log by slicing).
//!
//! The scripts are the writers; this module lets tests and tools read (and compare) what they
//! wrote. [`decode`] refuses anything malformed, as the scripts do (they treat it as a missing
//! bucket).

use std::collections::VecDeque;
use std::time::Duration;

use tollgate_core::algorithm::{
    FixedWindowState, Record, SlidingLogState, State, TokenBucketState,
};
use tollgate_core::{Algorithm, FixedWindow, Rate, SlidingLog, TokenBucket};

fn put(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n & 0x7f) as u8 | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn get(raw: &[u8], pos: &mut usize) -> Option<u64> {
    let mut n = 0u64;
    for shift in 0..8 {
        let b = *raw.get(*pos)?;
        *pos += 1;
        n |= u64::from(b & 0x7f) << (7 * shift);
        if b < 0x80 {
            return Some(n);
        }
    }
    None
}

/// The bytes a script writes for `record`.
///
/// # Panics
/// If the record's parameters and state are of different algorithms.
pub fn encode(record: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(24);
    let tag = match record.params {
        Algorithm::TokenBucket(_) => 1,
        Algorithm::FixedWindow(_) => 2,
        Algorithm::SlidingLog(_) => 3,
        _ => unreachable!("an algorithm without a script"),
    };
    out.push(tag);
    put(&mut out, record.generation);
    put(&mut out, record.pending.map_or(0, |p| p + 1));
    match (&record.params, &record.state) {
        (Algorithm::TokenBucket(p), State::TokenBucket(s)) => {
            for n in [
                p.capacity,
                p.unit,
                p.rate,
                p.max_elapsed_micros.unwrap_or(0),
                s.level,
                s.updated,
            ] {
                put(&mut out, n);
            }
        }
        (Algorithm::FixedWindow(p), State::FixedWindow(s)) => {
            for n in [p.limit, p.window_micros, s.window_start, s.count] {
                put(&mut out, n);
            }
        }
        (Algorithm::SlidingLog(p), State::SlidingLog(s)) => {
            put(&mut out, p.limit);
            put(&mut out, p.window_micros);
            for &(t, c) in &s.entries {
                out.extend_from_slice(&(t as f64).to_le_bytes());
                out.extend_from_slice(&(c as f64).to_le_bytes());
            }
        }
        _ => panic!("a record whose parameters and state disagree"),
    }
    out
}

/// Reads a record, or `None` for bytes a script would treat as a missing bucket.
pub fn decode(raw: &[u8]) -> Option<Record> {
    let mut pos = 1;
    let mut next = || get(raw, &mut pos);
    let tag = *raw.first()?;
    let generation = next()?;
    let pending = next()?.checked_sub(1);
    let (params, state) = match tag {
        1 => {
            let [capacity, unit, rate, max, level, updated] =
                [next()?, next()?, next()?, next()?, next()?, next()?];
            let p = TokenBucket {
                capacity,
                refill: Rate::new(rate, Duration::from_micros(unit)),
                unit,
                rate,
                max_elapsed_micros: (max > 0).then_some(max),
            };
            let s = TokenBucketState { level, updated };
            (Algorithm::TokenBucket(p), State::TokenBucket(s))
        }
        2 => {
            let [limit, window_micros, window_start, count] = [next()?, next()?, next()?, next()?];
            (
                Algorithm::FixedWindow(FixedWindow {
                    limit,
                    window_micros,
                }),
                State::FixedWindow(FixedWindowState {
                    window_start,
                    count,
                }),
            )
        }
        3 => {
            let [limit, window_micros] = [next()?, next()?];
            let rest = &raw[pos..];
            if !rest.len().is_multiple_of(16) {
                return None;
            }
            let f = |b: &[u8]| f64::from_le_bytes(b.try_into().expect("8 bytes")) as u64;
            let entries: VecDeque<(u64, u64)> = rest
                .chunks_exact(16)
                .map(|e| (f(&e[..8]), f(&e[8..])))
                .collect();
            pos = raw.len();
            (
                Algorithm::SlidingLog(SlidingLog {
                    limit,
                    window_micros,
                }),
                State::SlidingLog(SlidingLogState { entries }),
            )
        }
        _ => return None,
    };
    (pos == raw.len()).then_some(Record {
        generation,
        params,
        pending,
        state,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::Policy;

    #[test]
    fn round_trips_and_stays_small() {
        let p = Policy::token_bucket(100, Rate::per_second(10)).unwrap();
        let r = Record {
            generation: 3,
            params: p.algorithm().normalized(),
            pending: Some(4),
            state: State::TokenBucket(TokenBucketState {
                level: 99 * 100_000,
                updated: 1_700_000_000_000_000,
            }),
        };
        let bytes = encode(&r);
        // tag, generation, pending, capacity, unit (3), rate, max, level (4), updated (8)
        assert_eq!(bytes.len(), 21);
        assert_eq!(decode(&bytes), Some(r));
        assert_eq!(decode(&bytes[..20]), None);
        assert_eq!(decode(&[0xff; 16]), None);
        assert_eq!(decode(b"x"), None);
    }
}
