//! The bytes of one bucket in Redis: a [`Record`] (generation, pending deferral, parameters,
//! state) as the scripts write it. Compact by design — an idle token bucket is about 25 bytes,
//! which keeps the value in one 48-byte embedded-string allocation.
//!
//! Layout: MessagePack unsigned integers one after the other, each in its smallest encoding
//! (`cmsgpack.pack(a, b, ...)` in the scripts: 1 byte below 128, then 2, 3, 5 or 9 bytes): the
//! tag (1 token bucket, 2 fixed window, 3 sliding log), generation, pending (0 = none, else
//! the deferring generation + 1), the parameters, then the state — token bucket: capacity,
//! unit, rate, max_elapsed_us (0 = none), level_units, updated_us; fixed window: limit,
//! window_us, window_start_us, count; sliding log: limit, window_us, then `(time_us, cost)`
//! pairs as little-endian doubles (16 bytes each, so a script keeps a suffix of the log by
//! slicing). MessagePack rather than a hand-rolled varint because a script decodes it in one C
//! call (`cmsgpack.unpack`): decoding varints byte by byte in Lua cost more than the whole
//! rest of the decision (BENCHMARKS.md).
//!
//! The scripts are the writers; this module lets tests and tools read (and compare) what they
//! wrote. [`decode`] refuses anything malformed, as the scripts do (they treat it as a missing
//! bucket).

/// The longest value the scripts decode as a record (prelude.lua's `MAX_RECORD`): a sliding
/// log of 1,000 entries and its header fit; anything longer is a missing bucket.
pub const MAX_RECORD: usize = 16_384;

use std::collections::VecDeque;
use std::time::Duration;

use tollgate_core::algorithm::{
    FixedWindowState, Record, SlidingLogState, State, TokenBucketState,
};
use tollgate_core::{Algorithm, FixedWindow, Rate, SlidingLog, TokenBucket};

/// `n` as a MessagePack unsigned integer in its smallest encoding, as Redis's `cmsgpack.pack`
/// writes an integral number (positive fixint, then uint 8/16/32/64): the bytes and how many
/// of them are used.
pub(crate) fn uint(n: u64) -> ([u8; 9], usize) {
    let mut b = [0; 9];
    let len = if n < 0x80 {
        b[0] = n as u8;
        1
    } else if n <= 0xff {
        b[..2].copy_from_slice(&[0xcc, n as u8]);
        2
    } else if n <= 0xffff {
        b[0] = 0xcd;
        b[1..3].copy_from_slice(&(n as u16).to_be_bytes());
        3
    } else if n <= 0xffff_ffff {
        b[0] = 0xce;
        b[1..5].copy_from_slice(&(n as u32).to_be_bytes());
        5
    } else {
        b[0] = 0xcf;
        b[1..].copy_from_slice(&n.to_be_bytes());
        9
    };
    (b, len)
}

/// Appends `n` as [`uint`] encodes it.
fn put(out: &mut Vec<u8>, n: u64) {
    let (b, len) = uint(n);
    out.extend_from_slice(&b[..len]);
}

/// Reads one MessagePack unsigned integer at `pos` (any of its encodings, as
/// `cmsgpack.unpack` accepts them), or `None` for anything else.
pub(crate) fn get(raw: &[u8], pos: &mut usize) -> Option<u64> {
    let tag = *raw.get(*pos)?;
    let width = match tag {
        0x00..=0x7f => {
            *pos += 1;
            return Some(u64::from(tag));
        }
        0xcc => 1,
        0xcd => 2,
        0xce => 4,
        0xcf => 8,
        _ => return None,
    };
    let bytes = raw.get(*pos + 1..*pos + 1 + width)?;
    *pos += 1 + width;
    Some(bytes.iter().fold(0, |n, &b| (n << 8) | u64::from(b)))
}

/// `raw` read as MessagePack unsigned integers one after the other (any of their encodings),
/// or `None` if it holds anything else: how the scripts' argument reads (see
/// [`crate::scripts::args`]), for tools that print it.
///
/// ```
/// assert_eq!(tollgate_redis::record::uints(&[1, 0xcd, 0x4e, 0x20]), Some(vec![1, 20000]));
/// assert_eq!(tollgate_redis::record::uints(&[0xcd, 0x4e]), None);
/// ```
pub fn uints(raw: &[u8]) -> Option<Vec<u64>> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < raw.len() {
        out.push(get(raw, &mut pos)?);
    }
    Some(out)
}

/// The bytes a script writes for `record`.
///
/// # Panics
/// If the record's parameters and state are of different algorithms.
pub fn encode(record: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(24);
    let (tag, params, n) = tag_and_params(&record.params).expect("an algorithm without a script");
    put(&mut out, tag);
    put(&mut out, record.generation);
    put(&mut out, record.pending.map_or(0, |p| p + 1));
    for &p in &params[..n] {
        put(&mut out, p);
    }
    match (&record.params, &record.state) {
        (Algorithm::TokenBucket(_), State::TokenBucket(s)) => {
            put(&mut out, s.level);
            put(&mut out, s.updated);
        }
        (Algorithm::FixedWindow(_), State::FixedWindow(s)) => {
            put(&mut out, s.window_start);
            put(&mut out, s.count);
        }
        (Algorithm::SlidingLog(_), State::SlidingLog(s)) => {
            for &(t, c) in &s.entries {
                out.extend_from_slice(&(t as f64).to_le_bytes());
                out.extend_from_slice(&(c as f64).to_le_bytes());
            }
        }
        _ => panic!("a record whose parameters and state disagree"),
    }
    out
}

/// A record's tag and parameters in record order (the head after the generation and pending
/// mark), the first `n` of the array used: shared by [`encode`] and the scripts' argument
/// ([`crate::scripts::args`]), whose head must be the record's first bytes. `None` for an
/// algorithm without a script.
pub(crate) fn tag_and_params(params: &Algorithm) -> Option<(u64, [u64; 4], usize)> {
    Some(match params {
        Algorithm::TokenBucket(p) => (
            1,
            [
                p.capacity,
                p.unit,
                p.rate,
                p.max_elapsed_micros.unwrap_or(0),
            ],
            4,
        ),
        Algorithm::FixedWindow(p) => (2, [p.limit, p.window_micros, 0, 0], 2),
        Algorithm::SlidingLog(p) => (3, [p.limit, p.window_micros, 0, 0], 2),
        _ => return None,
    })
}

/// Reads a record, or `None` for bytes a script would treat as a missing bucket.
pub fn decode(raw: &[u8]) -> Option<Record> {
    // as the scripts: a value longer than any record is not one (`MAX_RECORD` in prelude.lua)
    if raw.len() > MAX_RECORD {
        return None;
    }
    let mut pos = 0;
    let mut next = || get(raw, &mut pos);
    let tag = next()?;
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
        // tag, generation, pending, capacity, unit (uint32: 5), rate, max, level (5),
        // updated (uint64: 9)
        assert_eq!(bytes.len(), 25);
        assert_eq!(bytes[..4], [1, 3, 5, 100]);
        assert_eq!(decode(&bytes), Some(r));
        assert_eq!(decode(&bytes[..24]), None);
        assert_eq!(decode(&[0xff; 16]), None);
        assert_eq!(decode(b"x"), None);
    }
}
