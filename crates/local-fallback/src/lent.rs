//! Hot token buckets lent to a small table of slots, decided there without the shard's lock.
//!
//! A call on a key under the shard's lock that finds its token bucket hot (written within
//! [`HOT_US`] before) or run dry (less than one token left) lends the bucket to the key's slot
//! in this table: the slot then holds the key's state and the map's entry only says where it
//! is. Slots are indexed by a multiplicative hash of the key's bytes and each holds the whole
//! key (up to [`MAX_KEY`] bytes, compared exactly, never by hash alone), the interned
//! parameters' index, the state and the expiry, under a sequence word (a seqlock whose writers
//! claim it with one compare-exchange). A small table of tag words (eight more bits of each
//! lent key's hash, and its state's expiry when lent) is read first, so that a call whose slot
//! holds another key, or a lend to a slot a live state holds, does not read the slot itself.
//!
//! A later call on the key reads its slot with no lock and decides on that copy with the same
//! code as under the lock (`Bucket::decide_on`). A denial that writes nothing is the answer
//! as read (no write at all); a decision that writes (an admission) claims the slot with one
//! compare-exchange from the sequence it read — which fails if anything changed since — and
//! stores the new state: one atomic read-modify-write per admission, against two for the
//! shard's lock (and no hash, no probe). A call that raced a writer retries under the slot's
//! claim (one `fetch_or`), so that calls contending for a hot key queue rather than each losing
//! the claim again. Anything the copy cannot decide (a policy change, an expired bucket, a slot
//! of another key, a slot claimed throughout the retries) takes the locked path.
//!
//! Exactness: the slot owns a lent bucket's state, and every change to it is made by its
//! claimer alone. The locked path takes a lent bucket back (claims the slot, copies the state
//! into the map's entry, empties the slot) before anything else changes it: the decisions
//! under the shard's lock, a reset, a sweep (a peek reads the slot in place). Lending and taking back happen
//! under the key's shard lock and the slot's claim, in that order only (a slot's claim is never
//! held while waiting for anything). Another key may take a slot over only when the state in it
//! has expired: the owner's entry then finds its slot holding something else and counts as
//! missing, which is what an expired bucket is.
//!
//! What it buys and costs (`BENCHMARKS.md`): on one thread a hot key skips the map's hash, the
//! shard's lock and the probe; on two threads a hot key's denials write no shared line at all
//! and its admissions one (governor takes the shard's read lock and swaps the state: three
//! atomic read-modify-writes per call). A slot stays with its key while the state in it lives,
//! so two hot keys that share a slot do not evict each other: the second one takes the locked
//! path; a lent bucket gone cold ([`COLD_US`]) is given back on its next admission, freeing the
//! slot. Once any bucket has been lent, every other call on a key of at most [`MAX_KEY`] bytes
//! pays the slot hash and a tag read before the lock (and the slot's read when the tag
//! matches); until then none does. Under the lock, the decision notes whether the bucket may be
//! worth lending from the state it decodes anyway, so a call that lends nothing does not
//! compute its slot there either.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};

use tollgate_core::algorithm::TokenBucketState;

/// Slots in a store's table (a power of two).
const SLOTS: usize = 256;
/// 8-byte words of key a slot holds.
const KEY_WORDS: usize = 11;
/// The longest key (in bytes) a slot holds; longer keys always take the locked path.
pub(crate) const MAX_KEY: usize = KEY_WORDS * 8;
/// A bucket written within this many microseconds before a call under the shard's lock is
/// hot: that call lends it to its slot.
pub(crate) const HOT_US: u64 = 100;
/// A lent bucket not written for this many microseconds is cold: its next admission declines
/// the slot, the locked path takes the bucket back and decides it (and keeps it unless it is
/// dry), and the slot is free for a hotter key. Ten times [`HOT_US`], so that a key called at
/// a steady rate is not lent and given back in turn. Denials stay in the slot: they write
/// nothing, so a bucket denied without end is cold by its time however often it is called.
pub(crate) const COLD_US: u64 = 10 * HOT_US;
/// Attempts of a decision on a slot before the call takes the locked path: a claim lost to
/// another call, or a slot seen being written, costs one.
const ATTEMPTS: usize = 16;

/// A token-bucket state held in a slot: the state the locked path would hold for the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    /// The interned parameters' index.
    pub(crate) id: u8,
    pub(crate) state: TokenBucketState,
    pub(crate) expires_at_ms: u64,
}

/// A decision on a lent state ([`LentTable::decide`]): the decision and, if it writes, the
/// state to store; `None` for a state the locked path must decide on. Any such closure is one;
/// the store's own ([`crate::store`]) is a type whose method is always inlined, where a closure
/// may be left out of line (a call that passes the state and the decision through memory).
pub(crate) trait DecideLent<D> {
    /// The decision on `p`.
    fn decide_lent(&self, p: Held) -> Option<(D, Option<Held>)>;
}

impl<D, F: Fn(Held) -> Option<(D, Option<Held>)>> DecideLent<D> for F {
    #[inline]
    fn decide_lent(&self, p: Held) -> Option<(D, Option<Held>)> {
        self(p)
    }
}

/// One slot, on lines of its own: an even `seq` when stable, odd while claimed.
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
                .is_some_and(|w| w.load(Ordering::Relaxed) == short_word(rem))
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
            word.store(short_word(rem), Ordering::Relaxed);
        }
    }

    /// The state held, as last written (the caller validates the read by the sequence).
    #[inline]
    fn state(&self, meta: u64) -> Held {
        Held {
            #[allow(clippy::cast_possible_truncation)]
            id: meta as u8,
            state: TokenBucketState {
                level: self.level.load(Ordering::Relaxed),
                updated: self.updated.load(Ordering::Relaxed),
            },
            expires_at_ms: self.expires_at_ms.load(Ordering::Relaxed),
        }
    }

    /// Stores `p`'s state (the slot claimed).
    #[inline]
    fn store_state(&self, p: &Held) {
        self.level.store(p.state.level, Ordering::Relaxed);
        self.updated.store(p.state.updated, Ordering::Relaxed);
        self.expires_at_ms.store(p.expires_at_ms, Ordering::Relaxed);
    }

    /// Claims the slot from the even sequence `seq` read before: fails if anything was
    /// written since. A successful claim also orders every read made before it (the state
    /// the caller decided on) before the next claimer's writes.
    #[inline]
    fn claim_from(&self, seq: u64) -> bool {
        let won = self
            .seq
            .compare_exchange(seq, seq + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok();
        if won {
            // The data stores below stay after the claim (the crossbeam seqlock's writer order).
            fence(Ordering::Release);
        }
        won
    }

    /// Claims the slot, waiting while another call holds it (a claim is held for a few
    /// stores, never while waiting for anything); returns the sequence to release.
    fn claim(&self) -> u64 {
        let mut spins = 0u32;
        loop {
            if let Some(seq) = self.try_claim() {
                return seq;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // the holder may have been preempted
                std::thread::yield_now();
            }
        }
    }

    /// Claims the slot whatever its sequence, unless another call holds it (`None`): one
    /// read-modify-write, with no read before it. Setting the bit of a claimed (odd) sequence
    /// changes nothing: its holder's release clears it.
    #[inline]
    fn try_claim(&self) -> Option<u64> {
        let seq = self.seq.fetch_or(1, Ordering::AcqRel);
        if seq & 1 == 1 {
            return None;
        }
        // The data stores after it stay after the claim, as in `Slot::claim_from`.
        fence(Ordering::Release);
        Some(seq)
    }

    /// Lets a claim go with nothing written: the sequence goes back to what readers may have
    /// seen, so their reads stay valid.
    #[inline]
    fn unclaim(&self, seq: u64) {
        self.seq.store(seq, Ordering::Release);
    }

    #[inline]
    fn release(&self, seq: u64) {
        self.seq.store(seq + 2, Ordering::Release);
    }
}

/// Eight bytes as one word.
#[inline]
fn full_word(chunk: &[u8]) -> u64 {
    u64::from_le_bytes(chunk.try_into().expect("8 bytes"))
}

/// Fibonacci hashing's multiplier (2^64 / the golden ratio, odd).
const FIB: u64 = 0x9E37_79B9_7F4A_7C15;

/// 1 to 7 bytes as one word: their first and last four (overlapping), or for 1 to 3 bytes
/// their first, middle and last. For a given length the word tells the bytes apart (every
/// byte is in it), which is all a slot needs of it: a slot compares the key's length before
/// its words. The tail of a key after its whole words, and the slot hash of a short key.
#[inline]
fn short_word(key: &[u8]) -> u64 {
    let n = key.len();
    if n >= 4 {
        let four = |at: usize| {
            u64::from(u32::from_le_bytes(
                key[at..at + 4].try_into().expect("4 bytes"),
            ))
        };
        four(0) | four(n - 4) << 32
    } else {
        u64::from(key[0]) | u64::from(key[n / 2]) << 8 | u64::from(key[n - 1]) << 16
    }
}

/// A key as the table sees it: its bytes, its slot and its tag.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotKey<'a> {
    bytes: &'a [u8],
    slot: usize,
    /// The key's tag: eight more bits of its hash, never 0 ([`LentTable`]'s `tags`).
    tag: u8,
}

impl<'a> SlotKey<'a> {
    /// `key`'s bytes and slot, or `None` for an empty key or one longer than [`MAX_KEY`].
    ///
    /// The slot is the top bits of the key's words combined and multiplied by an odd constant
    /// (Fibonacci hashing; the tag is the next eight bits): every byte counts, and a key of up
    /// to 16 bytes costs two loads and one multiply. Keys that share a slot cannot both be
    /// lent (a slot compares the whole key), so keys that differ in a few characters —
    /// `user:1041`, `user:1042` — must spread: the length, last and middle bytes used before
    /// put the 90,000 keys `bench:10000`…`bench:99999` in 10 slots.
    #[inline]
    pub(crate) fn new(key: &'a [u8]) -> Option<Self> {
        let n = key.len();
        if n > MAX_KEY || n == 0 {
            return None;
        }
        // The first word and the last (overlapping the one before for a length not a multiple
        // of eight: no byte-by-byte tail), the words between folded in by multiplication; a
        // key of under eight bytes as one word. One multiply for keys of up to 16 bytes: the
        // hot key's call waits for the slot's address.
        let w = if n >= 8 {
            let mut w = full_word(&key[..8]);
            let mut at = 8;
            while at + 8 < n {
                w = w.wrapping_mul(FIB) ^ full_word(&key[at..at + 8]);
                at += 8;
            }
            w ^ full_word(&key[n - 8..]).rotate_left(29)
        } else {
            short_word(key)
        };
        let h = (w ^ n as u64).wrapping_mul(FIB);
        #[allow(clippy::cast_possible_truncation)] // the top bits, below SLOTS; then 8 bits
        Some(Self {
            bytes: key,
            slot: (h >> (64 - SLOTS.trailing_zeros())) as usize,
            tag: (h >> 48) as u8 | 1,
        })
    }
}

/// How one attempt of [`LentTable::decide`] ended.
enum Attempt<D> {
    Decided(D),
    /// The slot holds another key, or the caller declined: the locked path decides.
    Declined,
    /// A writer got in the way: try again.
    Raced,
}

/// A store's table of lent buckets.
pub(crate) struct LentTable {
    slots: Box<[Slot; SLOTS]>,
    /// For each slot, its key's tag ([`SlotKey`]) in the low byte and the expiry (ms) its
    /// state had when lent above it; 0 when empty. A hint, written under the slot's claim when
    /// the slot is lent or emptied, read first so that most calls over many keys decline from
    /// these 2 KiB instead of reading their slot's line from a 32 KiB table: a call whose key's
    /// tag is not there, and a lend to a slot that a live state holds. A stale word only
    /// declines a call the slot could have decided (the locked path then takes the bucket
    /// back), lets a call read a slot that holds another key (the whole key is compared), or
    /// skips a lend; the slot's own words decide everything else.
    tags: Box<[AtomicU64; SLOTS]>,
    /// Set by the first lend and never cleared ([`LentTable::ever_lent`]).
    ever_lent: AtomicBool,
}

impl std::fmt::Debug for LentTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentTable").field("slots", &SLOTS).finish()
    }
}

impl LentTable {
    pub(crate) fn new() -> Self {
        Self {
            slots: Box::new(std::array::from_fn(|_| Slot::default())),
            tags: Box::new(std::array::from_fn(|_| AtomicU64::new(0))),
            ever_lent: AtomicBool::new(false),
        }
    }

    /// Whether any bucket was ever lent to this table: until then every slot is empty, and a
    /// call need not compute its key's slot to find that out. A hint, read with no ordering:
    /// a call that reads `false` while its own bucket is being lent takes the locked path,
    /// which takes a lent bucket back before anything else.
    #[inline]
    pub(crate) fn ever_lent(&self) -> bool {
        self.ever_lent.load(Ordering::Relaxed)
    }

    fn slot(&self, key: SlotKey<'_>) -> &Slot {
        &self.slots[key.slot]
    }

    /// The state `key`'s slot holds for it, read consistently (waiting out a claim); `None`
    /// when the slot holds another key or nothing.
    pub(crate) fn read(&self, key: SlotKey<'_>) -> Option<Held> {
        let s = self.slot(key);
        loop {
            let seq = s.seq.load(Ordering::Acquire);
            if seq & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let meta = s.meta.load(Ordering::Relaxed);
            let out = s.holds(meta, key.bytes).then(|| s.state(meta));
            fence(Ordering::Acquire);
            if s.seq.load(Ordering::Relaxed) == seq {
                return out;
            }
        }
    }

    /// A decision on the state `key`'s slot holds, without the shard's lock. `decide` maps
    /// the state read to the decision and, if that decision writes, the state to store; it
    /// returns `None` for a state the locked path must decide on. A decision that writes
    /// nothing is returned once the read is validated; one that writes is returned once the
    /// slot was claimed from the sequence read (nothing changed since) and the new state stored.
    /// `None` when the slot does not hold `key`, `decide` declines, or the slot kept changing
    /// under the call ([`ATTEMPTS`]).
    ///
    /// The first attempt is inline and the retries out of line: in a loop, the compiler
    /// prepared every attempt's addresses and operands before the first one, ~45 instructions
    /// on every call, most of which find the slot holding another key (callgrind).
    #[inline]
    pub(crate) fn decide<D>(&self, key: SlotKey<'_>, decide: &impl DecideLent<D>) -> Option<D> {
        match self.attempt(key, decide) {
            Attempt::Decided(d) => Some(d),
            Attempt::Declined => None,
            Attempt::Raced => self.decide_again(key, decide),
        }
    }

    /// [`LentTable::decide`]'s retries, after an attempt that raced a writer: each takes the
    /// slot's claim first (one read-modify-write that brings the line over for writing), then
    /// reads and decides under it, so that calls contending for a hot key queue on the claim
    /// instead of each reading, deciding and losing the claim to the other again.
    #[cold]
    #[inline(never)]
    fn decide_again<D>(&self, key: SlotKey<'_>, decide: &impl DecideLent<D>) -> Option<D> {
        let s = self.slot(key);
        for _ in 1..ATTEMPTS {
            let Some(seq) = s.try_claim() else {
                std::hint::spin_loop();
                continue;
            };
            let meta = s.meta.load(Ordering::Relaxed);
            let decided = s
                .holds(meta, key.bytes)
                .then(|| decide.decide_lent(s.state(meta)))
                .flatten();
            return match decided {
                Some((d, Some(p))) => {
                    s.store_state(&p);
                    s.release(seq);
                    Some(d)
                }
                other => {
                    s.unclaim(seq);
                    other.map(|(d, _)| d)
                }
            };
        }
        None
    }

    /// One attempt of [`LentTable::decide`].
    #[allow(clippy::inline_always)] // see `decide`
    #[inline(always)]
    fn attempt<D>(&self, key: SlotKey<'_>, decide: &impl DecideLent<D>) -> Attempt<D> {
        #[allow(clippy::cast_possible_truncation)] // the tag byte
        if self.tags[key.slot].load(Ordering::Relaxed) as u8 != key.tag {
            return Attempt::Declined;
        }
        let s = self.slot(key);
        let seq = s.seq.load(Ordering::Acquire);
        let meta = s.meta.load(Ordering::Relaxed);
        if seq & 1 == 1 {
            return Attempt::Raced;
        }
        if !s.holds(meta, key.bytes) {
            return Attempt::Declined;
        }
        let Some((d, write)) = decide.decide_lent(s.state(meta)) else {
            return Attempt::Declined;
        };
        match write {
            None => {
                fence(Ordering::Acquire);
                if s.seq.load(Ordering::Relaxed) == seq {
                    return Attempt::Decided(d);
                }
            }
            Some(p) => {
                if s.claim_from(seq) {
                    s.store_state(&p);
                    s.release(seq);
                    return Attempt::Decided(d);
                }
            }
        }
        Attempt::Raced
    }

    /// Lends `p`, `key`'s state, to its slot: only under the key's shard lock, for a bucket
    /// not already lent, and only if the slot is empty or holds a state expired at `now_ms`
    /// (a live one stays with its key). Returns whether the slot took it; the caller's entry
    /// then stands for the slot.
    #[cold]
    pub(crate) fn lend(&self, key: SlotKey<'_>, p: &Held, now_ms: u64) -> bool {
        let s = self.slot(key);
        let seq = s.seq.load(Ordering::Acquire);
        if seq & 1 == 1 {
            return false;
        }
        if s.meta.load(Ordering::Relaxed) != 0 && now_ms <= s.expires_at_ms.load(Ordering::Relaxed)
        {
            return false;
        }
        // The claim fails if anything changed since the reads above.
        if !s.claim_from(seq) {
            return false;
        }
        if !self.ever_lent.load(Ordering::Relaxed) {
            self.ever_lent.store(true, Ordering::Relaxed);
        }
        let len = key.bytes.len() as u64;
        s.meta
            .store((len << 8) | u64::from(p.id), Ordering::Relaxed);
        s.store_key(key.bytes);
        s.store_state(p);
        self.tags[key.slot].store(p.expires_at_ms << 8 | u64::from(key.tag), Ordering::Relaxed);
        s.release(seq);
        true
    }

    /// Whether `key`'s slot may take a state at `now_ms` by its tag word: empty, or lent with
    /// a state whose expiry then has passed. A cheap test before [`LentTable::lend`], which
    /// decides on the slot itself (the state may have been written since, with a later expiry).
    #[inline]
    pub(crate) fn may_take(&self, key: SlotKey<'_>, now_ms: u64) -> bool {
        let word = self.tags[key.slot].load(Ordering::Relaxed);
        word == 0 || now_ms > word >> 8
    }

    /// Takes `key`'s lent state back, emptying its slot: only under the key's shard lock.
    /// `None` when the slot holds something else: the state expired there and another key
    /// took the slot over.
    #[cold]
    pub(crate) fn take_back(&self, key: SlotKey<'_>) -> Option<Held> {
        let s = self.slot(key);
        let seq = s.claim();
        let meta = s.meta.load(Ordering::Relaxed);
        let out = s.holds(meta, key.bytes).then(|| {
            s.meta.store(0, Ordering::Relaxed);
            self.tags[key.slot].store(0, Ordering::Relaxed);
            s.state(meta)
        });
        s.release(seq);
        out
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

    /// A held state: parameters' index, level, time, expiry.
    fn held(id: u8, level: u64, updated: u64, expires_at_ms: u64) -> Held {
        Held {
            id,
            state: TokenBucketState { level, updated },
            expires_at_ms,
        }
    }
    use crate::bucket::tests::{Rng, plain_apply, random_policy};

    /// Keys that differ in a few characters spread over the slots: the 256 slots are nearly
    /// all used by 1,000 such keys (a uniform hash leaves ~5 % of them empty), whatever the
    /// keys' length or shape.
    #[test]
    fn keys_that_differ_in_a_few_characters_spread_over_the_slots() {
        let shapes: [fn(usize) -> String; 5] = [
            |i| format!("bench:{}", i + 10_000),
            |i| format!("{i}"),
            |i| format!("api:user-{i:05}"),
            |i| format!("tenant-{i}:a-common-suffix-of-this-key"),
            |i| format!("{}:login", "x".repeat(40) + &i.to_string()),
        ];
        for shape in shapes {
            let keys: Vec<String> = (0..1_000).map(shape).collect();
            let used: std::collections::HashSet<usize> = keys
                .iter()
                .map(|k| SlotKey::new(k.as_bytes()).unwrap().slot)
                .collect();
            assert!(
                used.len() >= 230,
                "{} slots for keys like {}",
                used.len(),
                keys[7]
            );
        }
        for n in 1..=MAX_KEY {
            let key = vec![b'k'; n];
            assert!(SlotKey::new(&key).unwrap().slot < SLOTS, "{n}");
        }
    }

    #[test]
    fn a_key_is_held_whole_and_compared_whole() {
        fn at<'a>(bytes: &'a [u8], k: SlotKey<'_>) -> SlotKey<'a> {
            // the same slot and tag: only the whole key tells them apart
            SlotKey {
                bytes,
                slot: k.slot,
                tag: k.tag,
            }
        }
        assert!(SlotKey::new(&[b'k'; MAX_KEY]).is_some());
        assert!(SlotKey::new(&[b'k'; MAX_KEY + 1]).is_none());
        assert!(SlotKey::new(b"").is_none());
        let table = LentTable::new();
        let p = held(3, 7, 11, 13);
        // every length, and keys that differ only in their last byte or in length
        for n in 1..=MAX_KEY {
            let key: Vec<u8> = (0..n).map(|i| b'a' + (i % 26) as u8).collect();
            let k = SlotKey::new(&key).unwrap();
            assert!(table.lend(k, &p, 0), "{n}");
            assert_eq!(table.read(k), Some(p), "{n}");
            let mut other = key.clone();
            *other.last_mut().unwrap() ^= 1;
            let longer = [key.as_slice(), b"\0"].concat();
            let mut others = vec![other, longer];
            if n > 1 {
                others.push(key[..n - 1].to_vec());
            }
            for o in &others {
                assert_eq!(table.read(at(o, k)), None, "{n}");
                assert_eq!(table.take_back(at(o, k)), None, "{n}");
                assert!(!table.lend(at(o, k), &p, 13), "a live state stays: {n}");
            }
            assert_eq!(table.read(k), Some(p), "others leave it: {n}");
            assert_eq!(table.take_back(k), Some(p), "{n}");
            assert_eq!(table.read(k), None, "{n}");
        }
    }

    /// A slot stays with its key while the state in it lives; once that has expired another
    /// key takes it over, and the first key's owner then finds nothing to take back.
    #[test]
    fn a_live_slot_stays_with_its_key_and_an_expired_one_is_taken_over() {
        let table = LentTable::new();
        let p = held(1, 0, 5, 100);
        let a = SlotKey::new(b"k:a").unwrap();
        let b = SlotKey {
            slot: a.slot,
            tag: a.tag,
            ..SlotKey::new(b"k:b").unwrap()
        };
        assert!(table.lend(a, &p, 0));
        assert!(
            !table.lend(b, &p, 100),
            "alive through its expiry millisecond"
        );
        assert_eq!(table.read(a), Some(p));
        assert!(table.lend(b, &p, 101));
        assert_eq!((table.read(a), table.read(b)), (None, Some(p)));
        assert_eq!(table.take_back(a), None);
        assert_eq!(table.take_back(b), Some(p));
    }

    /// `decide` answers a decision that writes nothing from the state as read, stores the
    /// state of one that writes, declines for another key or when told to, and a claim that
    /// another writer got first makes it read again.
    #[test]
    fn decide_stores_what_a_decision_writes_and_nothing_else() {
        let table = LentTable::new();
        let p = held(2, 4, 9, 50);
        let k = SlotKey::new(b"k").unwrap();
        assert_eq!(
            table.decide(k, &|_: Held| Some(((), None))),
            None,
            "empty slot"
        );
        table.lend(k, &p, 0);
        let seq = table.slot(k).seq.load(Ordering::Relaxed);
        assert_eq!(
            table.decide(k, &|q: Held| Some((q.state.level, None))),
            Some(4)
        );
        assert_eq!(table.slot(k).seq.load(Ordering::Relaxed), seq, "no write");
        let q = held(2, 3, 10, 51);
        assert_eq!(
            table.decide(k, &|_: Held| Some(("took", Some(q)))),
            Some("took")
        );
        assert_eq!(table.read(k), Some(q));
        assert_eq!(table.decide(k, &|_: Held| None::<((), _)>), None);
        let other = SlotKey {
            slot: k.slot,
            tag: k.tag,
            ..SlotKey::new(b"j").unwrap()
        };
        assert_eq!(table.decide(other, &|_: Held| Some(((), None))), None);
        // the tag: set by a lend, cleared by a take-back; a key whose tag differs declines
        // before its slot is read, even a key the slot holds (a stale tag costs a locked call)
        assert_eq!(
            table.tags[k.slot].load(Ordering::Relaxed),
            50 << 8 | u64::from(k.tag)
        );
        assert!(!table.may_take(k, 50) && table.may_take(k, 51));
        let other_tag = SlotKey {
            tag: k.tag ^ 2,
            ..k
        };
        assert_eq!(table.decide(other_tag, &|_: Held| Some(((), None))), None);
        assert_eq!(table.decide(k, &|_: Held| Some(((), None))), Some(()));
        assert_eq!(table.take_back(k), Some(q));
        assert_eq!(table.tags[k.slot].load(Ordering::Relaxed), 0);
        assert!(table.lend(k, &q, 0));
        // a writer that claims between the read and the claim: the first attempt loses
        let tries = AtomicUsize::new(0);
        let got = table.decide(k, &|r: Held| {
            if tries.fetch_add(1, Ordering::Relaxed) == 0 {
                let s = table.slot(k);
                let seq = s.claim();
                s.release(seq);
            }
            Some((r.state.level, Some(p)))
        });
        assert_eq!((got, tries.load(Ordering::Relaxed)), (Some(3), 2));
        assert_eq!(table.read(k), Some(p));
        // the retry decides under the claim: a decision that writes nothing leaves the
        // sequence as it was, one that writes moves it on
        let s = table.slot(k);
        let raced = |write| {
            let first = AtomicUsize::new(0);
            table.decide(k, &|r: Held| {
                if first.fetch_add(1, Ordering::Relaxed) == 0 {
                    let seq = s.claim();
                    s.release(seq);
                }
                Some((r.state.level, write))
            })
        };
        let seq = s.seq.load(Ordering::Relaxed);
        assert_eq!(raced(None), Some(4));
        assert_eq!(
            s.seq.load(Ordering::Relaxed),
            seq + 2,
            "only the racing writer's"
        );
        assert_eq!(raced(Some(q)), Some(4));
        assert_eq!(s.seq.load(Ordering::Relaxed), seq + 6);
        assert_eq!(table.read(k), Some(q));
        // a slot claimed throughout: the call gives up and the locked path decides
        let seq = s.claim();
        assert_eq!(table.decide(k, &|_: Held| Some(((), None))), None);
        s.release(seq);
    }

    /// A store lending its hot buckets against the core maths on a plain map with Redis's
    /// expiry: the same decisions for every call, under token buckets prone to denials and
    /// random policies of every algorithm on the same keys (policy changes), a clock that
    /// mostly stands still or creeps (so calls find their bucket hot and denials repeat) and
    /// sometimes jumps or steps back, resets, and a key too long for a slot. A second set of
    /// keys shares one slot, so that each takes it over from the other once the state there
    /// has expired; its clock never steps back (a state dropped once expired, as Redis's active
    /// expiry drops it, would come back in the model).
    #[test]
    fn a_store_lending_buckets_decides_exactly_as_the_core() {
        let key = |part: &str| Key::new("h", [part]).unwrap();
        let slot_of = |k: &Key| SlotKey::new(k.as_str().as_bytes()).unwrap().slot;
        let apart = [
            key("a"),
            key("b"),
            key("a-longer-key-0123456789"),
            key(&"x".repeat(MAX_KEY)),
        ];
        let sharing: Vec<Key> = (0..)
            .map(|i| key(&format!("c{i}")))
            .filter(|k| slot_of(k) == slot_of(&apart[0]))
            .take(2)
            .chain([apart[0].clone()])
            .collect();
        let mut lent = 0;
        for seed in 1..=1_500u64 {
            let (keys, back) = if seed % 2 == 0 {
                (&apart[..], 2_000_000)
            } else {
                (&sharing[..], 0)
            };
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
                    0 => now - rng.below(back + 1),
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
                if SlotKey::new(bytes).is_some_and(|k| store.lent.read(k).is_some()) {
                    lent += 1;
                }
            }
        }
        assert!(lent > 10_000, "slots were in play: {lent}");
    }

    /// Threads hammering one key on a frozen clock admit exactly the bucket's tokens, however
    /// their calls are decided (under the lock or on the lent slot); after the clock moves by
    /// one token's refill, exactly one more.
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
        assert!(store.lent.read(SlotKey::new(bytes).unwrap()).is_some());
        std::thread::scope(|s| {
            s.spawn(|| assert!(store.reset_now(&key)));
        });
        assert!(store.lent.read(SlotKey::new(bytes).unwrap()).is_none());
        assert_eq!(store.acquire_now(&key, &policy, 1).unwrap().remaining, 99);
    }

    /// A lent bucket not written for [`COLD_US`] is given back on its next admission (and not
    /// lent again while it is called this seldom), so that its slot can go to a hotter key; a
    /// dry one stays lent however long its denials go on.
    #[test]
    fn a_cold_lent_bucket_gives_its_slot_back_and_a_dry_one_keeps_it() {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let store = LocalStore::builder().clock(clock.clone()).build();
        let lent = |key: &Key| {
            let k = SlotKey::new(key.as_str().as_bytes()).unwrap();
            store.lent.read(k).is_some()
        };
        let generous = Policy::token_bucket(100, Rate::per_second(1)).unwrap();
        let key = Key::new("cold", ["a"]).unwrap();
        store.acquire_now(&key, &generous, 1).unwrap();
        store.acquire_now(&key, &generous, 1).unwrap();
        assert!(lent(&key), "hot: lent");
        clock.advance(Duration::from_micros(COLD_US));
        assert_eq!(store.acquire_now(&key, &generous, 1).unwrap().remaining, 97);
        assert!(lent(&key), "not cold yet: decided in the slot");
        clock.advance(Duration::from_micros(COLD_US + 1));
        assert_eq!(store.acquire_now(&key, &generous, 1).unwrap().remaining, 96);
        assert!(!lent(&key), "cold: given back and kept");
        clock.advance(Duration::from_micros(COLD_US + 1));
        assert_eq!(store.acquire_now(&key, &generous, 1).unwrap().remaining, 95);
        assert!(!lent(&key), "called this seldom: not lent again");
        // a dry bucket stays lent while denied, however long
        let scarce = Policy::token_bucket(1, Rate::new(1, Duration::from_secs(3600))).unwrap();
        let dry = Key::new("cold", ["b"]).unwrap();
        assert!(store.acquire_now(&dry, &scarce, 1).unwrap().allowed);
        assert!(lent(&dry), "dry: lent");
        let slot = store
            .lent
            .slot(SlotKey::new(dry.as_str().as_bytes()).unwrap());
        let seq = slot.seq.load(Ordering::Relaxed);
        for _ in 0..3 {
            clock.advance(Duration::from_millis(10));
            assert!(!store.acquire_now(&dry, &scarce, 1).unwrap().allowed);
        }
        // decided in the slot, with no write: not taken back and lent again at each call
        assert_eq!(slot.seq.load(Ordering::Relaxed), seq);
        assert!(lent(&dry));
    }

    /// Admissions on a lent bucket racing the calls that take it back (a sweep takes every
    /// lent bucket back, a peek reads it in place) lose no update: afterwards the bucket holds
    /// exactly its capacity less the admissions. The admitting threads run until the racing
    /// thread has seen the bucket taken back and lent again many times (bounded by a count).
    #[test]
    fn admissions_racing_take_backs_lose_no_update() {
        const CAPACITY: u64 = 10_000_000;
        let clock = ManualClock::new(1_700_000_000_000_000);
        let store = LocalStore::builder().clock(clock.clone()).build();
        let key = Key::new("hot", ["k"]).unwrap();
        let policy = Policy::token_bucket(CAPACITY, Rate::per_second(1)).unwrap();
        let slot = SlotKey::new(key.as_str().as_bytes()).unwrap();
        let admitted = AtomicUsize::new(0);
        let (taken_back, lent_again) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let enough =
            || taken_back.load(Ordering::Relaxed) >= 20 && lent_again.load(Ordering::Relaxed) >= 20;
        let running = AtomicUsize::new(3);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..1_000_000 {
                        if enough() {
                            break;
                        }
                        if store.acquire_now(&key, &policy, 1).unwrap().allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    running.fetch_sub(1, Ordering::Release);
                });
            }
            s.spawn(|| {
                while running.load(Ordering::Acquire) > 0 {
                    let held = store.lent.read(slot).is_some();
                    store.sweep_expired();
                    taken_back.fetch_add(usize::from(held), Ordering::Relaxed);
                    assert!(store.peek_now(&key, &policy, 1).unwrap().remaining <= CAPACITY);
                    std::thread::yield_now();
                    let again = store.lent.read(slot).is_some();
                    lent_again.fetch_add(usize::from(again), Ordering::Relaxed);
                }
            });
        });
        let admitted = admitted.load(Ordering::Relaxed) as u64;
        assert!(admitted < CAPACITY, "{admitted}");
        // a peek of 1 reports what an admission of 1 would leave
        let left = store.peek_now(&key, &policy, 1).unwrap().remaining;
        assert_eq!(left + 1, CAPACITY - admitted, "{admitted} admitted");
        assert!(
            enough(),
            "the race happened: {taken_back:?} take-backs, {lent_again:?} lent again"
        );
    }
}
