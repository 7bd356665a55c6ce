//! Denials without the shard's lock, for a hot token bucket that has run dry.
//!
//! A token-bucket denial writes nothing: the stored state gives every later call the same
//! answer until the bucket has refilled enough. So when a call under the shard's lock leaves a
//! token bucket with less than one token, the bucket's state is published here, in a small
//! table of slots indexed by a cheap mix of the key's bytes, each slot holding the whole key
//! (up to [`MAX_KEY`] bytes, compared exactly, never by hash alone), the interned parameters'
//! index, the state and the expiry, under a sequence word (a seqlock). A later call on the same
//! key reads the slot without any lock or write and decides on that copy with the same code as
//! under the lock (`Bucket::deny_on`); when that decision is a denial that writes nothing, it
//! is the answer. Anything else (an admission, a policy change, a cap on credited time, an
//! expired bucket, a slot of another key or being written) takes the locked path.
//!
//! Exactness: once a call on a key lets its shard lock go, the key's slot holds its stored
//! state or nothing. Every call that may change a bucket, or remove it, clears the key's slot
//! under the key's shard lock (before the change on the hot path, after it on the cold ones)
//! and publishes the new state (if worth it) before letting the lock go; a bucket is swept only
//! once expired, and a copy of an expired bucket decides nothing here. A denial decided on a
//! copy read while a change was under way is the one the locked path would have given just
//! before that change: concurrent calls may be ordered either way, as under the lock, where a
//! call that read its clock earlier may also decide later. Two keys sharing a slot only evict
//! each other.
//!
//! What it buys and costs (`BENCHMARKS.md`): on one thread a hot denied key skips the shard's
//! lock and probe; on two threads its denials write no shared line at all (governor's take the
//! shard's read lock: two atomic read-modify-writes on one line per call). Every other call on
//! a key of at most [`MAX_KEY`] bytes pays a slot read before the lock and a check under it.

use std::sync::atomic::{AtomicU64, Ordering, fence};

use tollgate_core::algorithm::TokenBucketState;

/// Slots in a store's table (a power of two).
const SLOTS: usize = 256;
/// 8-byte words of key a slot holds.
const KEY_WORDS: usize = 11;
/// The longest key (in bytes) a slot holds; longer keys always take the locked path.
pub(crate) const MAX_KEY: usize = KEY_WORDS * 8;
/// A slot holding another key's state is taken over by one publication in this many.
const EVICT_EVERY: u64 = 8;

/// A published token-bucket state: what the locked path holds for the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Published {
    /// The interned parameters' index.
    pub(crate) id: u8,
    pub(crate) state: TokenBucketState,
    pub(crate) expires_at_ms: u64,
}

/// One slot, on lines of its own: an even `seq` when stable, odd while being written.
#[repr(align(128))]
#[derive(Default)]
struct Slot {
    seq: AtomicU64,
    /// 0 when empty; else the key's length << 8 | the parameters' index.
    meta: AtomicU64,
    level: AtomicU64,
    updated: AtomicU64,
    expires_at_ms: AtomicU64,
    key: [AtomicU64; KEY_WORDS],
}

impl Slot {
    /// Whether a slot whose `meta` word is `meta` holds `key`: its length (an empty slot's is
    /// 0, no key's), then its words.
    #[inline]
    fn holds(&self, meta: u64, key: &[u8]) -> bool {
        meta >> 8 == key.len() as u64 && self.holds_words(key)
    }

    /// Whether the slot's key words are `key`'s (its length already matched).
    #[inline]
    fn holds_words(&self, key: &[u8]) -> bool {
        let mut words = self.key.iter();
        let mut chunks = key.chunks_exact(8);
        for (chunk, word) in (&mut chunks).zip(&mut words) {
            if word.load(Ordering::Relaxed) != full_word(chunk) {
                return false;
            }
        }
        let rem = chunks.remainder();
        rem.is_empty()
            || words
                .next()
                .is_some_and(|w| w.load(Ordering::Relaxed) == tail_word(rem))
    }

    /// Writes `key`'s words (the slot claimed).
    fn store_key(&self, key: &[u8]) {
        let mut words = self.key.iter();
        let mut chunks = key.chunks_exact(8);
        for (chunk, word) in (&mut chunks).zip(&mut words) {
            word.store(full_word(chunk), Ordering::Relaxed);
        }
        let rem = chunks.remainder();
        if let (false, Some(word)) = (rem.is_empty(), words.next()) {
            word.store(tail_word(rem), Ordering::Relaxed);
        }
    }

    /// Claims the slot for writing: `Some(seq)` to pass to [`Slot::release`], `None` when
    /// another writer holds it (a call on another key: it leaves the slot to that key).
    fn claim(&self) -> Option<u64> {
        let seq = self.seq.load(Ordering::Relaxed);
        if seq & 1 == 1 {
            return None;
        }
        self.seq
            .compare_exchange(seq, seq + 1, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        // The data stores below stay after the claim (the crossbeam seqlock's writer order).
        fence(Ordering::Release);
        Some(seq)
    }

    fn release(&self, seq: u64) {
        self.seq.store(seq + 2, Ordering::Release);
    }
}

/// Eight bytes as one word.
#[inline]
fn full_word(chunk: &[u8]) -> u64 {
    u64::from_le_bytes(chunk.try_into().expect("8 bytes"))
}

/// The bytes of `rem` (fewer than 8) as one word, zero-padded.
#[inline]
fn tail_word(rem: &[u8]) -> u64 {
    let (mut w, mut at) = (0, 0);
    if rem.len() & 4 != 0 {
        w = u64::from(u32::from_le_bytes(rem[..4].try_into().expect("4 bytes")));
        at = 4;
    }
    if rem.len() & 2 != 0 {
        let two = u16::from_le_bytes(rem[at..at + 2].try_into().expect("2 bytes"));
        w |= u64::from(two) << (8 * at);
        at += 2;
    }
    if rem.len() & 1 != 0 {
        w |= u64::from(rem[at]) << (8 * at);
    }
    w
}

/// A key as the table sees it: its bytes and its slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HintKey<'a> {
    bytes: &'a [u8],
    slot: usize,
}

impl<'a> HintKey<'a> {
    /// `key`'s bytes and slot, or `None` for an empty key or one longer than [`MAX_KEY`]. The
    /// slot comes from the length and the last and middle bytes: a few instructions, where
    /// the map's hash takes dozens; keys that share a slot only evict each other's states (a
    /// slot compares the whole key).
    #[inline]
    pub(crate) fn new(key: &'a [u8]) -> Option<Self> {
        let n = key.len();
        if n > MAX_KEY || n == 0 {
            return None;
        }
        let mix = usize::from(key[n - 1]) ^ usize::from(key[n / 2]) << 3 ^ n << 5;
        Some(Self {
            bytes: key,
            slot: mix & (SLOTS - 1),
        })
    }
}

/// A store's table of published denials.
pub(crate) struct Hints {
    slots: Box<[Slot; SLOTS]>,
}

impl std::fmt::Debug for Hints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hints").field("slots", &SLOTS).finish()
    }
}

impl Hints {
    pub(crate) fn new() -> Self {
        Self {
            slots: Box::new(std::array::from_fn(|_| Slot::default())),
        }
    }

    fn slot(&self, key: HintKey<'_>) -> &Slot {
        &self.slots[key.slot]
    }

    /// The state published for `key`, read consistently; `None` when
    /// the slot holds another key, nothing, or is being written.
    #[inline]
    pub(crate) fn read(&self, key: HintKey<'_>) -> Option<Published> {
        let s = self.slot(key);
        let seq = s.seq.load(Ordering::Acquire);
        let meta = s.meta.load(Ordering::Relaxed);
        if seq & 1 == 1 || !s.holds(meta, key.bytes) {
            return None;
        }
        let out = Published {
            #[allow(clippy::cast_possible_truncation)]
            id: meta as u8,
            state: TokenBucketState {
                level: s.level.load(Ordering::Relaxed),
                updated: s.updated.load(Ordering::Relaxed),
            },
            expires_at_ms: s.expires_at_ms.load(Ordering::Relaxed),
        };
        fence(Ordering::Acquire);
        (s.seq.load(Ordering::Relaxed) == seq).then_some(out)
    }

    /// Publishes `p` as `key`'s stored state. Only under the key's shard lock, and only for
    /// the state the locked path holds. A slot holding another key's state is taken over only
    /// on one call in [`EVICT_EVERY`] (by the microsecond `now_us`): over many denied keys
    /// that share the table, each denial would otherwise write a slot that the next denial
    /// of another key overwrites before anyone reads it, while a hot key still gets its slot
    /// within a few calls.
    #[cold]
    pub(crate) fn publish(&self, key: HintKey<'_>, p: Published, now_us: u64) {
        let s = self.slot(key);
        let (bytes, len) = (key.bytes, key.bytes.len() as u64);
        let meta = s.meta.load(Ordering::Relaxed);
        if meta != 0 && !s.holds(meta, bytes) && !now_us.is_multiple_of(EVICT_EVERY) {
            return;
        }
        let Some(seq) = s.claim() else { return };
        s.meta
            .store((len << 8) | u64::from(p.id), Ordering::Relaxed);
        s.store_key(bytes);
        s.level.store(p.state.level, Ordering::Relaxed);
        s.updated.store(p.state.updated, Ordering::Relaxed);
        s.expires_at_ms.store(p.expires_at_ms, Ordering::Relaxed);
        s.release(seq);
    }

    /// Clears the slot if it holds `key`. Only under the key's shard lock: no other call can
    /// publish `key` meanwhile, so a slot seen holding another key (or being written, which
    /// only a call on another key can be doing) cannot come to hold `key`'s old state.
    #[allow(clippy::inline_always)] // on every admission
    #[inline(always)]
    pub(crate) fn clear(&self, key: HintKey<'_>) {
        let s = self.slot(key);
        if !s.holds(s.meta.load(Ordering::Relaxed), key.bytes) {
            return;
        }
        let Some(seq) = s.claim() else { return };
        s.meta.store(0, Ordering::Relaxed);
        s.release(seq);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use tollgate_core::algorithm::Record;
    use tollgate_core::{Key, ManualClock, Policy, Rate, StoreError};

    use super::*;
    use crate::LocalStore;
    use crate::bucket::tests::{Rng, plain_apply, random_policy};

    #[test]
    fn a_key_is_held_whole_and_compared_whole() {
        assert!(HintKey::new(&[b'k'; MAX_KEY]).is_some());
        assert!(HintKey::new(&[b'k'; MAX_KEY + 1]).is_none());
        assert!(HintKey::new(b"").is_none());
        let hints = Hints::new();
        let p = Published {
            id: 3,
            state: TokenBucketState {
                level: 7,
                updated: 11,
            },
            expires_at_ms: 13,
        };
        // every length, and keys that differ only in their last byte or in length
        for n in 1..=MAX_KEY {
            let key: Vec<u8> = (0..n).map(|i| b'a' + (i % 26) as u8).collect();
            let k = HintKey::new(&key).unwrap();
            hints.publish(k, p, 0);
            assert_eq!(hints.read(k), Some(p), "{n}");
            let mut other = key.clone();
            *other.last_mut().unwrap() ^= 1;
            assert_eq!(
                hints.read(HintKey {
                    bytes: &other,
                    slot: k.slot
                }),
                None,
                "{n}"
            );
            let longer = [key.as_slice(), b"\0"].concat();
            assert_eq!(
                hints.read(HintKey {
                    bytes: &longer,
                    slot: k.slot
                }),
                None,
                "{n}"
            );
            if n > 1 {
                let shorter = &key[..n - 1];
                assert_eq!(
                    hints.read(HintKey {
                        bytes: shorter,
                        slot: k.slot
                    }),
                    None,
                    "{n}"
                );
            }
            hints.clear(HintKey {
                bytes: &other,
                slot: k.slot,
            });
            assert_eq!(hints.read(k), Some(p), "another key's clear leaves it: {n}");
            hints.clear(k);
            assert_eq!(hints.read(k), None, "{n}");
        }
        // another key takes an occupied slot over on one call in EVICT_EVERY only; the same
        // key's state is always replaced
        let (a, b) = (HintKey::new(b"k:a").unwrap(), HintKey::new(b"k:b").unwrap());
        let b = HintKey { slot: a.slot, ..b };
        let q = Published { id: 4, ..p };
        hints.publish(a, p, 1);
        hints.publish(b, q, 1);
        assert_eq!((hints.read(a), hints.read(b)), (Some(p), None));
        hints.publish(a, q, 1);
        assert_eq!(hints.read(a), Some(q));
        hints.publish(b, q, EVICT_EVERY);
        assert_eq!((hints.read(a), hints.read(b)), (None, Some(q)));
    }

    /// A store whose hot keys are denied from their published state against the core maths on
    /// a plain map with Redis's expiry: the same decisions for every call, under token buckets
    /// prone to denials and random policies of every algorithm on the same keys (policy
    /// changes), a clock that mostly stands still or creeps (so denials repeat) and sometimes
    /// jumps or steps back, resets, and a key too long for a hint.
    #[test]
    fn a_store_with_hints_decides_exactly_as_the_core() {
        let keys = [
            Key::new("h", ["a"]).unwrap(),
            Key::new("h", ["b"]).unwrap(),
            Key::new("h", ["a-longer-key-0123456789"]).unwrap(),
            Key::new("h", ["x".repeat(MAX_KEY)]).unwrap(),
        ];
        let mut published = 0;
        for seed in 1..=1_500u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let mut now = 1_700_000_000_000_000 + rng.below(1 << 30);
            let clock = ManualClock::new(now);
            let store = LocalStore::builder().clock(clock.clone()).build();
            let mut policies = vec![
                Policy::token_bucket(1 + rng.below(3), Rate::new(1, Duration::from_secs(3600)))
                    .unwrap(),
                Policy::token_bucket(2 + rng.below(5), Rate::per_second(1 + rng.below(1_000)))
                    .unwrap()
                    .with_generation(rng.below(3)),
            ];
            if seed % 3 == 0 {
                policies.push(random_policy(&mut rng));
            }
            let mut model: HashMap<&Key, (Option<Record>, u64)> = HashMap::new();
            for step in 0..300 {
                let key = &keys[rng.below(keys.len() as u64) as usize];
                let policy = &policies[rng.below(policies.len() as u64) as usize];
                now = match rng.below(20) {
                    0 => now - rng.below(2_000_000),
                    1..=9 => now,
                    10..=16 => now + rng.below(2_000),
                    17 | 18 => now + rng.below(2_000_000),
                    _ => now + rng.below(20_000_000),
                };
                clock.set(now);
                let at = format!("seed {seed} step {step}: {key:?} at {now} under {policy}");
                if rng.below(40) == 0 {
                    store.reset_now(key);
                    model.remove(key);
                    continue;
                }
                let cost = 1 + rng.below(policy.limit().min(3));
                let got = store.acquire_now(key, policy, cost).map_err(|e| match e {
                    StoreError::InvalidPolicy(e) => e,
                    other => panic!("{at}: {other}"),
                });
                let (plain, expiry) = model.entry(key).or_insert((None, 0));
                let want = plain_apply(plain, expiry, policy, now, cost);
                assert_eq!(got, want, "{at}");
                let bytes = key.as_str().as_bytes();
                if HintKey::new(bytes).is_some_and(|k| store.hints.read(k).is_some()) {
                    published += 1;
                }
            }
        }
        assert!(published > 10_000, "hints were in play: {published}");
    }

    /// Threads hammering one key on a frozen clock admit exactly the bucket's tokens, however
    /// their denials are decided (under the lock or from the published state); after the clock
    /// moves by one token's refill, exactly one more.
    #[test]
    fn concurrent_calls_on_a_hot_key_admit_exactly_the_tokens() {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let store = LocalStore::builder().clock(clock.clone()).build();
        let key = Key::new("hot", ["k"]).unwrap();
        let policy = Policy::token_bucket(100, Rate::per_second(1)).unwrap();
        for round in 0..20 {
            let admitted = AtomicUsize::new(0);
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(|| {
                        for _ in 0..2_000 {
                            if store.acquire_now(&key, &policy, 1).unwrap().allowed {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
            let want = if round == 0 { 100 } else { 1 };
            assert_eq!(admitted.load(Ordering::Relaxed), want, "round {round}");
            clock.advance(Duration::from_secs(1));
        }
        // a reset from another thread makes the bucket full again at once
        let d = store.acquire_now(&key, &policy, 1).unwrap();
        assert!(d.allowed);
        assert!(!store.acquire_now(&key, &policy, 1).unwrap().allowed);
        let bytes = key.as_str().as_bytes();
        assert!(store.hints.read(HintKey::new(bytes).unwrap()).is_some());
        std::thread::scope(|s| {
            s.spawn(|| assert!(store.reset_now(&key)));
        });
        assert!(store.hints.read(HintKey::new(bytes).unwrap()).is_none());
        assert_eq!(store.acquire_now(&key, &policy, 1).unwrap().remaining, 99);
    }
}
