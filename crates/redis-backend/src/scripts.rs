//! The Lua script and how a request becomes its argument. One script runs every algorithm, so
//! one key holds a bucket whatever its algorithm and the newest generation governs across
//! algorithms; each algorithm's block is the Redis twin of one function in
//! `tollgate_core::algorithm`, and a differential test on a shared clock holds them equal.
//!
//! The script is `scripts/prelude.lua` (the argument and record layouts, the helpers of the
//! rare paths and the policy-change rules, including `cross`, which settles who governs a record
//! of another algorithm), then, picked by the argument's tag, the algorithm's own block followed
//! by `scripts/epilogue.lua` (the record's write and the reply), in a loop of at most two
//! passes: the second runs when a stored record of another algorithm governs, as a caller of
//! that record's own policy, on the same `TIME` and record, in the same execution. It takes
//! `KEYS[1]` = the bucket
//! key and one argument, `ARGV[1]` = [`Args`]: MessagePack unsigned integers, each in its
//! smallest encoding — the *head* of the record the caller would write (the algorithm's tag,
//! the policy's generation, 0 for no pending deferral, the policy's parameters: exactly the
//! first bytes of [`crate::record::encode`]'s output), then the transition rule (0 reset,
//! 1 carry, 2 proportional, 3 defer until expiry), `cost` and `commit` (1 = acquire, 0 = peek,
//! which never writes). Whenever the caller's generation and parameters govern with no
//! deferral pending, a script writes the head's bytes as they are followed by the new state, so
//! only the state is encoded; and one argument rather than eight spares Redis about a thousand
//! instructions per argument per call (see BENCHMARKS.md). It replies one string of five
//! little-endian `i64` ([`reply`]): allowed (1/0), remaining, retry_after_us (-1 when allowed),
//! reset_after_us, limit — where `limit` is that of the policy that governed (a newer stored one
//! may govern an older caller); `allowed` is -1 when the cost is above that limit (nothing
//! written). A string, because Redis turns a table reply into an array at ~4,000 instructions
//! more; and nearly every admission (the caller's own parameters governed, remaining below
//! 2^16, reset_after_us below 2^37) as one integer, `remaining * 2^37 + reset_after_us`, which
//! spares Redis building that string (~2,500 instructions). An argument it refuses gives an error reply starting `ERR tollgate:`, having written
//! nothing; a value that is not a number, or bytes that are not MessagePack (neither of which
//! this module sends), may instead raise a plain Lua error, also before anything is written
//! (the checks run inline, without a pcall).
//!
//! Each bucket is one STRING, a [`crate::record`]: MessagePack integers for the tag, the
//! generation, the pending deferral, the parameters and the state:
//!
//! | script | parameters | state |
//! |---|---|---|
//! | `token_bucket` (tag 1) | capacity, unit, rate, max_elapsed_us (0 = none) | level_units, updated_us |
//! | `fixed_window` (tag 2) | limit, window_us | window_start_us, count |
//! | `sliding_log` (tag 3) | limit, window_us | `(time_us, cost)` pairs, `struct.pack('<dd')`, oldest first (16 bytes each, at most 1000) |

use std::fmt;
use std::sync::LazyLock;

use tollgate_core::{Algorithm, Policy, StoreError};

/// One algorithm's script: its source and the SHA1 that `EVALSHA` calls it by.
#[derive(Debug)]
pub struct Script {
    name: &'static str,
    suffix: &'static str,
    source: &'static str,
    sha: String,
}

impl Script {
    fn new(name: &'static str, suffix: &'static str, source: &'static str) -> Self {
        let sha = redis::Script::new(source).get_hash().to_owned();
        Self {
            name,
            suffix,
            source,
            sha,
        }
    }

    /// The script's stable name (`tollgate`: one script runs every algorithm).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The suffix of the Redis keys this script writes: empty, since one key holds a bucket
    /// whatever its algorithm (`<prefix>{<key>}`). Kept for callers that built keys from it;
    /// earlier versions wrote `:tb`, `:fw` and `:sl` keys, which simply expire.
    pub fn key_suffix(&self) -> &'static str {
        self.suffix
    }

    /// The Lua source.
    pub fn source(&self) -> &'static str {
        self.source
    }

    /// The lower-case hex SHA1 of the source, as `EVALSHA` and `SCRIPT LOAD` use it.
    pub fn sha(&self) -> &str {
        &self.sha
    }
}

/// The one script: the prelude, then each algorithm's block followed by the epilogue, picked
/// by the argument's tag (its first byte), inside a loop of at most two passes (the second
/// when a stored record of another algorithm governs the caller: see the prelude).
static SCRIPTS: LazyLock<[Script; 1]> = LazyLock::new(|| {
    [Script::new(
        "tollgate",
        "",
        concat!(
            include_str!("../scripts/prelude.lua"),
            "for _ = 1, 2 do\nlocal tag = arg and string.byte(arg)\nif tag == 2 then\n",
            include_str!("../scripts/fixed_window.lua"),
            include_str!("../scripts/epilogue.lua"),
            "elseif tag == 3 then\n",
            include_str!("../scripts/sliding_log.lua"),
            include_str!("../scripts/epilogue.lua"),
            "else\n",
            include_str!("../scripts/token_bucket.lua"),
            include_str!("../scripts/epilogue.lua"),
            "end\nend\nreturn redis.error_reply('ERR tollgate bug: redirected twice')\n"
        ),
    )]
});

/// Every script: one, which runs every algorithm.
pub fn all() -> &'static [Script; 1] {
    &SCRIPTS
}

/// The script that implements `policy`'s algorithm.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::Policy;
/// let p = Policy::fixed_window(10, Duration::from_secs(1)).unwrap();
/// let script = tollgate_redis::scripts::for_policy(&p);
/// assert_eq!(script.name(), "tollgate");
/// assert_eq!(script.sha().len(), 40);
/// ```
///
/// # Panics
/// If this version has no script for the policy's algorithm (`Algorithm` is non-exhaustive);
/// [`try_for_policy`] returns `None` instead.
pub fn for_policy(policy: &Policy) -> &'static Script {
    try_for_policy(policy).unwrap_or_else(|| panic!("{}", unsupported(policy)))
}

/// The script that implements `policy`'s algorithm, or `None` for an algorithm this version
/// has no script for.
pub fn try_for_policy(policy: &Policy) -> Option<&'static Script> {
    match policy.algorithm() {
        Algorithm::TokenBucket(_) | Algorithm::FixedWindow(_) | Algorithm::SlidingLog(_) => {
            Some(&SCRIPTS[0])
        }
        _ => None,
    }
}

/// The script's argument for one request: the head of the record the policy writes (tag,
/// generation, 0, parameters), then its transition code, `cost` and `commit`, as MessagePack
/// integers (see the module docs).
///
/// ```
/// use tollgate_core::{Policy, Rate};
/// let p = Policy::token_bucket(10, Rate::per_second(2)).unwrap().with_generation(4);
/// // tag 1, generation 4, no pending, capacity 10, unit 500000 (uint32), rate 1, no max_elapsed;
/// // then transition 1 (carry), cost 3, commit 1
/// assert_eq!(
///     tollgate_redis::scripts::args(&p, 3, true).as_bytes(),
///     &[1, 4, 0, 10, 0xce, 0, 7, 0xa1, 0x20, 1, 0, 1, 3, 1]
/// );
/// ```
///
/// # Panics
/// As [`for_policy`]; [`try_args`] returns `None` instead.
pub fn args(policy: &Policy, cost: u64, commit: bool) -> Args {
    try_args(policy, cost, commit).unwrap_or_else(|| panic!("{}", unsupported(policy)))
}

/// The script's argument for one request, or `None` for an algorithm without a script.
pub fn try_args(policy: &Policy, cost: u64, commit: bool) -> Option<Args> {
    let (tag, params, n) = crate::record::tag_and_params(policy.algorithm())?;
    let mut a = Args::default();
    a.head(tag, policy.generation(), &params[..n]);
    a.push(policy.transition().code());
    a.push(cost);
    a.push(u64::from(commit));
    Some(a)
}

/// The integer reply's split: `remaining * PACKED + reset_after_us` (see [`reply`]).
const PACKED: i64 = 1 << 37;

/// A script's reply — allowed, remaining, retry_after_us, reset_after_us, limit — from what it
/// returns: either one string of five little-endian `i64`, or, for an admission under the
/// caller's own parameters whose remaining is below 2^16 and reset_after_us below 2^37, one
/// integer `remaining * 2^37 + reset_after_us` (Redis builds the string at ~2,500 instructions
/// more), completed with `limit`, the caller's own [`Policy::limit`]. `None` for anything
/// else.
///
/// ```
/// use redis::Value;
/// let mut raw = Vec::new();
/// for n in [0i64, 0, 250_000, 1_000_000, 10] {
///     raw.extend_from_slice(&n.to_le_bytes());
/// }
/// let reply = tollgate_redis::scripts::reply;
/// assert_eq!(reply(&Value::BulkString(raw.clone()), 10), Some([0, 0, 250_000, 1_000_000, 10]));
/// assert_eq!(reply(&Value::BulkString(raw[1..].to_vec()), 10), None);
/// assert_eq!(reply(&Value::Int((9 << 37) + 100_000), 10), Some([1, 9, -1, 100_000, 10]));
/// assert_eq!(reply(&Value::Int(-1), 10), None);
/// ```
pub fn reply(value: &redis::Value, limit: u64) -> Option<[i64; 5]> {
    match value {
        redis::Value::Int(n) if *n >= 0 => {
            Some([1, n / PACKED, -1, n % PACKED, i64::try_from(limit).ok()?])
        }
        redis::Value::BulkString(raw) if raw.len() == 40 => {
            let mut out = [0; 5];
            for (o, b) in out.iter_mut().zip(raw.chunks_exact(8)) {
                *o = i64::from_le_bytes(b.try_into().ok()?);
            }
            Some(out)
        }
        _ => None,
    }
}

/// The error for a policy whose algorithm has no script here.
pub(crate) fn unsupported(policy: &Policy) -> StoreError {
    StoreError::Script(format!(
        "the Redis store has no script for algorithm {}",
        policy.algorithm().name()
    ))
}

/// A script's argument: at most 12 MessagePack integers of at most 9 bytes each, held inline
/// (no allocation).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Args {
    bytes: [u8; 108],
    len: usize,
    head: usize,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            bytes: [0; 108],
            len: 0,
            head: 0,
        }
    }
}

impl fmt::Debug for Args {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Args({:02x?})", self.as_bytes())
    }
}

impl Args {
    fn push(&mut self, n: u64) {
        let (b, len) = crate::record::uint(n);
        self.bytes[self.len..self.len + len].copy_from_slice(&b[..len]);
        self.len += len;
    }

    /// The record's head: tag, generation, 0 (no pending deferral), the parameters.
    fn head(&mut self, tag: u64, generation: u64, params: &[u64]) {
        self.push(tag);
        self.push(generation);
        self.push(0);
        for &p in params {
            self.push(p);
        }
        self.head = self.len;
    }

    /// The argument's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// The head: the first bytes of the record the policy writes.
    pub fn head_bytes(&self) -> &[u8] {
        &self.bytes[..self.head]
    }
}

impl redis::ToRedisArgs for Args {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        out.write_arg(self.as_bytes());
    }
}

/// The Redis key of one bucket: `<prefix>{<key>}`, whatever the algorithm (one record per
/// bucket, so the newest generation governs across algorithms), written straight into a
/// command buffer without an intermediate `String`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BucketKey<'a> {
    pub(crate) prefix: &'a str,
    pub(crate) key: &'a str,
}

impl BucketKey<'_> {
    /// The key's text in order: `<prefix>`, `{`, `<key>`, `}` (the one layout both the command
    /// argument and `Display` write).
    fn pieces(&self) -> [&str; 4] {
        [self.prefix, "{", self.key, "}"]
    }
}

impl fmt::Display for BucketKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.pieces()
            .iter()
            .try_for_each(|piece| f.write_str(piece))
    }
}

impl redis::ToRedisArgs for BucketKey<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        use std::io::Write as _;
        let mut w = out.writer_for_next_arg();
        // Plain copies, not `write!`: the formatting machinery around the same copies showed in
        // perf profiles of `tollgate load`. Writing into an in-memory command buffer cannot fail.
        for piece in self.pieces() {
            let _ = w.write_all(piece.as_bytes());
        }
    }
}

/// How a script is invoked: by hash (the hot path), or with its source (after NOSCRIPT,
/// which also puts it back in the server's cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    EvalSha,
    Eval,
}

/// One script invocation, ready to become an `EVALSHA` or `EVAL` command.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Invocation<'a> {
    pub(crate) script: &'static Script,
    pub(crate) key: BucketKey<'a>,
    pub(crate) args: Args,
    pub(crate) cost: u64,
    /// The policy's own limit, which an integer reply leaves out ([`reply`]).
    pub(crate) limit: u64,
}

impl<'a> Invocation<'a> {
    pub(crate) fn new(
        prefix: &'a str,
        key: &'a str,
        policy: &Policy,
        cost: u64,
        commit: bool,
    ) -> Result<Self, StoreError> {
        let (Some(script), Some(args)) = (try_for_policy(policy), try_args(policy, cost, commit))
        else {
            return Err(unsupported(policy));
        };
        Ok(Self {
            script,
            key: BucketKey { prefix, key },
            args,
            cost,
            limit: policy.limit(),
        })
    }

    pub(crate) fn cmd(&self, call: Call) -> redis::Cmd {
        let key_len = self.key.prefix.len() + self.key.key.len() + 2;
        let mut cmd = redis::Cmd::with_capacity(5, 64 + key_len + self.args.len);
        self.write(&mut cmd, call);
        cmd
    }

    /// The `EVALSHA` command of a single call, built in the buffers of one that an earlier
    /// call on this thread gave back ([`SpareCmd`]), so that a decision does not allocate
    /// them afresh.
    pub(crate) fn evalsha(&self) -> SpareCmd {
        let mut cmd = SPARE
            .take()
            .unwrap_or_else(|| redis::Cmd::with_capacity(5, 128));
        cmd.clear();
        self.write(&mut cmd, Call::EvalSha);
        SpareCmd(Some(cmd))
    }

    fn write(&self, cmd: &mut redis::Cmd, call: Call) {
        match call {
            Call::EvalSha => cmd.arg("EVALSHA").arg(self.script.sha.as_str()),
            Call::Eval => cmd.arg("EVAL").arg(self.script.source),
        };
        cmd.arg(1).arg(self.key).arg(self.args);
    }
}

thread_local! {
    /// One `EVALSHA` command's buffers per thread, kept between calls ([`Invocation::evalsha`]).
    static SPARE: std::cell::Cell<Option<redis::Cmd>> = const { std::cell::Cell::new(None) };
}

/// A command whose buffers go back to this thread's spare slot when it is dropped (the thread
/// that drops it, which on a multi-thread runtime may be another than the one that built it;
/// each thread holds at most one, of the size of the longest `EVALSHA` it built: the prefix, a
/// [`tollgate_core::Key`] of at most ~1 KiB encoded, and ~160 bytes).
pub(crate) struct SpareCmd(Option<redis::Cmd>);

impl std::ops::Deref for SpareCmd {
    type Target = redis::Cmd;

    fn deref(&self) -> &redis::Cmd {
        self.0.as_ref().expect("a command until dropped")
    }
}

impl Drop for SpareCmd {
    fn drop(&mut self) {
        if let Some(cmd) = self.0.take() {
            // `try_with`: a command dropped while the thread's locals are torn down is freed.
            let _ = SPARE.try_with(|spare| spare.set(Some(cmd)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tollgate_core::Rate;

    #[test]
    fn shas_match_the_sources() {
        for s in all() {
            assert_eq!(s.sha(), redis::Script::new(s.source()).get_hash());
            assert!(s.source().contains("redis.call('TIME')"));
        }
    }

    #[test]
    fn bucket_key_puts_the_whole_identity_in_the_hash_tag() {
        let k = BucketKey {
            prefix: "tollgate:",
            key: "login:alice%40x",
        };
        assert_eq!(k.to_string(), "tollgate:{login:alice%40x}");
        let packed = redis::Cmd::new().arg(k).get_packed_command();
        // one argument, its length prefix included
        assert!(packed.ends_with(b"\r\n$26\r\ntollgate:{login:alice%40x}\r\n"));
    }

    /// Decodes MessagePack unsigned integers (as the scripts' cmsgpack does).
    fn ints(raw: &[u8]) -> Vec<u64> {
        let mut pos = 0;
        let mut out = Vec::new();
        while pos < raw.len() {
            out.push(crate::record::get(raw, &mut pos).expect("an unsigned integer"));
        }
        out
    }

    #[test]
    fn args_carry_the_record_head_then_transition_cost_and_commit() {
        let p = Policy::token_bucket(7, Rate::new(7, Duration::from_secs(3)))
            .unwrap()
            .with_max_elapsed(Duration::from_secs(2))
            .unwrap();
        let a = args(&p, 2, false);
        assert_eq!(
            ints(a.as_bytes()),
            [1, 0, 0, 7, 3_000_000, 7, 2_000_000, 1, 2, 0]
        );
        assert_eq!(ints(a.head_bytes()), [1, 0, 0, 7, 3_000_000, 7, 2_000_000]);
        let p = Policy::sliding_log(5, Duration::from_millis(1500))
            .unwrap()
            .with_generation(300)
            .with_transition(tollgate_core::Transition::DeferUntilExpiry);
        assert_eq!(
            ints(args(&p, 5, true).as_bytes()),
            [3, 300, 0, 5, 1_500_000, 3, 5, 1]
        );
        let p = Policy::fixed_window(u64::from(u32::MAX) + 1, Duration::from_secs(1)).unwrap();
        assert_eq!(
            ints(args(&p, 70_000, true).as_bytes()),
            [2, 0, 0, 1 << 32, 1_000_000, 1, 70_000, 1]
        );
    }

    #[test]
    fn the_head_is_the_start_of_the_record_the_policy_writes() {
        use tollgate_core::algorithm::{Record, State, TokenBucketState};
        let p = Policy::token_bucket(100, Rate::per_second(50))
            .unwrap()
            .with_generation(1 << 40);
        let record = Record {
            generation: p.generation(),
            params: p.algorithm().normalized(),
            pending: None,
            state: State::TokenBucket(TokenBucketState {
                level: 99,
                updated: 1_700_000_000_000_000,
            }),
        };
        let bytes = crate::record::encode(&record);
        let a = args(&p, 1, true);
        assert!(bytes.starts_with(a.head_bytes()), "{a:?} vs {bytes:02x?}");
        assert_eq!(bytes.len(), a.head_bytes().len() + 1 + 9);
    }

    #[test]
    fn evalsha_and_eval_commands_share_keys_and_args() {
        let p = Policy::fixed_window(3, Duration::from_secs(1)).unwrap();
        let inv = Invocation::new("t:", "k", &p, 1, true).unwrap();
        let sha = inv.cmd(Call::EvalSha).get_packed_command();
        assert!(String::from_utf8_lossy(&sha).contains(all()[0].sha()));
        assert!(sha.ends_with(
            b"$5\r\nt:{k}\r\n$12\r\n\x02\x00\x00\x03\xce\x00\x0f\x42\x40\x01\x01\x01\r\n"
        ));
        let eval = String::from_utf8_lossy(&inv.cmd(Call::Eval).get_packed_command()).into_owned();
        assert!(eval.contains("tollgate fixed window"));
    }
}
