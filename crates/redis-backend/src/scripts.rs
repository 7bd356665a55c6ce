//! The Lua scripts, one per algorithm, and how a request becomes their arguments. Each script
//! is the Redis twin of one function in `tollgate_core::algorithm`; a differential test on a
//! shared clock holds them equal.
//!
//! Every script is `scripts/prelude.lua` (argument checks, the record codec, exact integer
//! helpers and the policy-change rules) followed by the algorithm's own file. It takes
//! `KEYS[1]` = the bucket key and `ARGV` = the policy's integer parameters, its generation and
//! transition rule (0 reset, 1 carry, 2 proportional, 3 defer until expiry), then `cost`, then
//! `commit` (1 = acquire, 0 = peek, which never writes). It replies `{allowed (1/0),
//! remaining, retry_after_us (-1 when allowed), reset_after_us, limit}` where `limit` is that
//! of the policy that governed (a newer stored one may govern an older caller); `allowed` is
//! -1 when the cost is above that limit (nothing written). An argument it refuses gives an
//! error reply starting `ERR tollgate:`, having written nothing.
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

    /// The algorithm's stable name (`token_bucket`, `fixed_window`, `sliding_log`).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The suffix of the Redis keys this script writes (`tb`, `fw`, `sl`).
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

static SCRIPTS: LazyLock<[Script; 3]> = LazyLock::new(|| {
    [
        Script::new(
            "token_bucket",
            "tb",
            concat!(
                include_str!("../scripts/prelude.lua"),
                include_str!("../scripts/token_bucket.lua")
            ),
        ),
        Script::new(
            "fixed_window",
            "fw",
            concat!(
                include_str!("../scripts/prelude.lua"),
                include_str!("../scripts/fixed_window.lua")
            ),
        ),
        Script::new(
            "sliding_log",
            "sl",
            concat!(
                include_str!("../scripts/prelude.lua"),
                include_str!("../scripts/sliding_log.lua")
            ),
        ),
    ]
});

/// Every script, in a fixed order (token bucket, fixed window, sliding log).
pub fn all() -> &'static [Script; 3] {
    &SCRIPTS
}

/// The script that implements `policy`'s algorithm.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::Policy;
/// let p = Policy::fixed_window(10, Duration::from_secs(1)).unwrap();
/// let script = tollgate_redis::scripts::for_policy(&p);
/// assert_eq!(script.name(), "fixed_window");
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
        Algorithm::TokenBucket(_) => Some(&SCRIPTS[0]),
        Algorithm::FixedWindow(_) => Some(&SCRIPTS[1]),
        Algorithm::SlidingLog(_) => Some(&SCRIPTS[2]),
        _ => None,
    }
}

/// The script's `ARGV` for one request: the policy's parameters, its generation and
/// transition code, then `cost`, then `commit`.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::{Policy, Rate};
/// let p = Policy::token_bucket(10, Rate::per_second(2)).unwrap().with_generation(4);
/// assert_eq!(tollgate_redis::scripts::args(&p, 3, true).as_slice(), &[10, 500_000, 1, 0, 4, 1, 3, 1]);
/// ```
///
/// # Panics
/// As [`for_policy`]; [`try_args`] returns `None` instead.
pub fn args(policy: &Policy, cost: u64, commit: bool) -> Args {
    try_args(policy, cost, commit).unwrap_or_else(|| panic!("{}", unsupported(policy)))
}

/// The script's `ARGV` for one request, or `None` for an algorithm without a script.
pub fn try_args(policy: &Policy, cost: u64, commit: bool) -> Option<Args> {
    let commit = u64::from(commit);
    let (generation, rule) = (policy.generation(), policy.transition().code());
    Some(match policy.algorithm() {
        Algorithm::TokenBucket(tb) => Args::new(&[
            tb.capacity,
            tb.unit,
            tb.rate,
            tb.max_elapsed_micros.unwrap_or(0),
            generation,
            rule,
            cost,
            commit,
        ]),
        Algorithm::FixedWindow(fw) => {
            Args::new(&[fw.limit, fw.window_micros, generation, rule, cost, commit])
        }
        Algorithm::SlidingLog(sl) => {
            Args::new(&[sl.limit, sl.window_micros, generation, rule, cost, commit])
        }
        _ => return None,
    })
}

/// The error for a policy whose algorithm has no script here.
pub(crate) fn unsupported(policy: &Policy) -> StoreError {
    StoreError::Script(format!(
        "the Redis store has no script for algorithm {}",
        policy.algorithm().name()
    ))
}

/// A script's integer arguments, held inline (no allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Args {
    values: [u64; 8],
    len: usize,
}

impl Args {
    fn new(values: &[u64]) -> Self {
        let mut out = Self {
            values: [0; 8],
            len: values.len(),
        };
        out.values[..values.len()].copy_from_slice(values);
        out
    }

    /// The arguments in order.
    pub fn as_slice(&self) -> &[u64] {
        &self.values[..self.len]
    }
}

/// The Redis key of one bucket: `<prefix>{<key>}:<suffix>`, written straight into a command
/// buffer without an intermediate `String`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BucketKey<'a> {
    pub(crate) prefix: &'a str,
    pub(crate) key: &'a str,
    pub(crate) suffix: &'a str,
}

impl fmt::Display for BucketKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{{{}}}:{}", self.prefix, self.key, self.suffix)
    }
}

impl redis::ToRedisArgs for BucketKey<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        use std::io::Write as _;
        let mut w = out.writer_for_next_arg();
        // Writing into an in-memory command buffer cannot fail.
        let _ = write!(w, "{}{{{}}}:{}", self.prefix, self.key, self.suffix);
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
            key: BucketKey {
                prefix,
                key,
                suffix: script.suffix,
            },
            args,
            cost,
        })
    }

    pub(crate) fn cmd(&self, call: Call) -> redis::Cmd {
        let key_len = self.key.prefix.len() + self.key.key.len() + 6;
        let mut cmd =
            redis::Cmd::with_capacity(3 + self.args.len, 64 + key_len + 17 * self.args.len);
        match call {
            Call::EvalSha => cmd.arg("EVALSHA").arg(self.script.sha.as_str()),
            Call::Eval => cmd.arg("EVAL").arg(self.script.source),
        };
        cmd.arg(1).arg(self.key);
        for &a in self.args.as_slice() {
            cmd.arg(a);
        }
        cmd
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
            suffix: "tb",
        };
        assert_eq!(k.to_string(), "tollgate:{login:alice%40x}:tb");
        let packed = redis::Cmd::new().arg(k).get_packed_command();
        assert!(packed.ends_with(b"tollgate:{login:alice%40x}:tb\r\n"));
    }

    #[test]
    fn args_carry_every_parameter_cost_and_commit() {
        let p = Policy::token_bucket(7, Rate::new(7, Duration::from_secs(3)))
            .unwrap()
            .with_max_elapsed(Duration::from_secs(2))
            .unwrap();
        assert_eq!(
            args(&p, 2, false).as_slice(),
            &[7, 3_000_000, 7, 2_000_000, 0, 1, 2, 0]
        );
        let p = Policy::sliding_log(5, Duration::from_millis(1500))
            .unwrap()
            .with_generation(3)
            .with_transition(tollgate_core::Transition::DeferUntilExpiry);
        assert_eq!(args(&p, 5, true).as_slice(), &[5, 1_500_000, 3, 3, 5, 1]);
    }

    #[test]
    fn evalsha_and_eval_commands_share_keys_and_args() {
        let p = Policy::fixed_window(3, Duration::from_secs(1)).unwrap();
        let inv = Invocation::new("t:", "k", &p, 1, true).unwrap();
        let sha = String::from_utf8(inv.cmd(Call::EvalSha).get_packed_command()).unwrap();
        assert!(sha.contains(all()[1].sha()));
        assert!(
            sha.ends_with("$8\r\nt:{k}:fw\r\n$1\r\n3\r\n$7\r\n1000000\r\n$1\r\n0\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n1\r\n")
        );
        let eval = String::from_utf8(inv.cmd(Call::Eval).get_packed_command()).unwrap();
        assert!(eval.contains("tollgate fixed window"));
    }
}
