//! `tollgate load --redis URL --compare-redis-benchmark`: runs the very script, argument, key
//! shape and visiting order tollgate used (request n on `load:k<n mod KEYS>`), on the same
//! server, right after tollgate's own run and on keys of its own ([`RunPrefixes`]), the way
//! `redis-benchmark -c C -P P` would (C connections, each sending P `EVALSHA` at a time and
//! waiting for their replies, no limiter code), and reports tollgate's answered decisions/s as
//! a ratio of that ceiling. redis-benchmark itself cannot run it: the script's one argument is
//! binary (MessagePack, see `tollgate_redis::scripts`) and redis-benchmark cuts an argument at
//! its first NUL byte, so the same loop is driven here over raw connections. On a shared, noisy
//! machine only ratios measured in one run mean anything.
//!
//! `tollgate ceiling` runs the same driver alone, on tollgate's script for a policy or on any
//! script file with its own arguments (the source text's token bucket, say), so that two
//! scripts' ceilings are measured by one client.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tollgate::Policy;
use tollgate::redis::{RedisStore, scripts};

/// Most connections `tollgate ceiling` opens.
const MAX_CLIENTS: u64 = 10_000;
/// Most commands `tollgate ceiling` pipelines on one connection (built in one buffer).
const MAX_PIPELINE: u64 = 10_000;

/// One ceiling measurement.
#[derive(Debug, Serialize)]
pub(crate) struct Ceiling {
    /// Concurrent clients (`-c`).
    pub clients: usize,
    /// Commands pipelined per client (`-P`).
    pub pipeline: usize,
    /// Requests sent (`-n`).
    pub requests: u64,
    /// Requests per second over the run.
    pub requests_per_sec: f64,
    /// tollgate's answered decisions/s (errors excluded) divided by this ceiling; `null` when
    /// the run's rate was withheld (some decisions were not the store's).
    pub tollgate_ratio: Option<f64>,
}

struct Endpoint {
    host: String,
    port: u16,
    user: Option<String>,
    password: Option<String>,
    db: i64,
}

/// Where and as whom the ceiling driver connects: the URL as redis-rs reads it for the load
/// itself (credentials percent-decoded, the database of its path, IPv6 hosts, parameters), so
/// both runs reach the same server and database as the same user.
fn endpoint(url: &str) -> Result<Endpoint> {
    use redis::IntoConnectionInfo as _;
    let info = url.into_connection_info().context("the Redis URL")?;
    let redis::ConnectionAddr::Tcp(host, port) = info.addr() else {
        bail!("--compare-redis-benchmark needs a redis:// URL (its ceiling driver has no TLS)");
    };
    let settings = info.redis_settings();
    Ok(Endpoint {
        host: host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned(),
        port: *port,
        user: settings.username().map(str::to_owned),
        password: settings.password().map(str::to_owned),
        db: settings.db(),
    })
}

/// Key prefixes of one `--compare-redis-benchmark` invocation: `<prefix>cmp<nonce>.<run>:`,
/// `run` 0 for tollgate's own run, 1 and 2 for the ceiling at `-P 1` and `-P 16`. Each run
/// starts on keys that no other run touched (a sliding log keeps every admission of its window,
/// so a key visited by an earlier run costs more), and all three keys are equally long. A
/// prefix rather than flushing between runs: the tool does not own the server.
pub(crate) struct RunPrefixes {
    base: String,
    nonce: String,
}

impl RunPrefixes {
    /// Prefixes under `base`, unique to this invocation (the time in microseconds, in hex).
    pub(crate) fn new(base: &str) -> Result<Self> {
        let micros = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let out = Self {
            base: base.to_owned(),
            nonce: format!("{micros:013x}"),
        };
        let longest = out.get(2).len();
        if longest > tollgate::redis::MAX_PREFIX_LEN {
            bail!(
                "--prefix {base}: --compare-redis-benchmark adds {} bytes to it for each run, \
                 and a prefix has at most {} bytes",
                longest - base.len(),
                tollgate::redis::MAX_PREFIX_LEN
            );
        }
        Ok(out)
    }

    /// The prefix of run `run` (0: tollgate's, 1: `-P 1`, 2: `-P 16`).
    pub(crate) fn get(&self, run: usize) -> String {
        format!("{}cmp{}.{run}:", self.base, self.nonce)
    }
}

/// Runs the script tollgate used for `policy` bare, with `clients` connections and `requests`
/// requests visiting the keys of the load run (`load:k0` … `load:k<keys-1>`, request `n` on key
/// `n mod keys`, as `tollgate load` visits them), once for each pipeline depth (1 and 16), each
/// on keys of its own (`prefixes.get(1)`, `prefixes.get(2)`).
#[allow(clippy::too_many_arguments)] // one call site, every value named there
pub(crate) async fn run(
    url: &str,
    prefixes: &RunPrefixes,
    policy: &Policy,
    cost: u64,
    keys: usize,
    clients: usize,
    requests: u64,
    tollgate_rate: Option<f64>,
) -> Result<Vec<Ceiling>> {
    let ep = Arc::new(endpoint(url)?);
    let mut out = Vec::new();
    for (run, pipeline) in [(1, 1usize), (2, 16)] {
        let bare = Arc::new(Bare::for_policy(url, &prefixes.get(run), policy, cost).await?);
        let rps = drive(
            &ep,
            &bare,
            Visit::RoundRobin,
            keys,
            clients,
            pipeline,
            requests,
        )
        .await?;
        out.push(Ceiling {
            clients,
            pipeline,
            requests,
            requests_per_sec: rps,
            tollgate_ratio: tollgate_rate.map(|rate| rate / rps),
        });
    }
    Ok(out)
}

/// Which key each request of the ceiling driver visits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Visit {
    /// Request `n` on `load:k<n mod keys>`: the keys and order of `tollgate load`.
    RoundRobin,
    /// A random key `load:k<12 digits>` below `keys`, as redis-benchmark's `-r` and
    /// `__rand_int__` (`tollgate ceiling`, set beside redis-benchmark runs).
    Random,
}

/// The bucket id (`load:k…`) request `n` visits under `visit`; `rng` is the connection's
/// random state, advanced for [`Visit::Random`].
fn visit_id(visit: Visit, n: u64, keys: u64, rng: &mut u64) -> String {
    match visit {
        Visit::RoundRobin => format!("load:k{}", n % keys),
        Visit::Random => {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            format!("load:k{:012}", *rng % keys)
        }
    }
}

/// Runs `requests` commands of `bare` on the keys `visit` picks among `keys` over `clients`
/// connections, `pipeline` at a time on each; returns requests per second.
async fn drive(
    ep: &Arc<Endpoint>,
    bare: &Arc<Bare>,
    visit: Visit,
    keys: usize,
    clients: usize,
    pipeline: usize,
    requests: u64,
) -> Result<f64> {
    let left = Arc::new(AtomicU64::new(requests));
    // Every connection is opened (and authenticated, its database selected) before the clock
    // starts, as redis-benchmark does: the rate is of requests, not of connecting.
    let mut connecting = Vec::new();
    for _ in 0..clients.max(1) {
        let ep = ep.clone();
        connecting.push(tokio::spawn(async move { connect(&ep).await }));
    }
    let mut conns = Vec::with_capacity(connecting.len());
    for c in connecting {
        conns.push(c.await.context("a ceiling client panicked")??);
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (c, conn) in conns.into_iter().enumerate() {
        let (bare, left) = (bare.clone(), left.clone());
        let job = Job {
            visit,
            keys: keys.max(1) as u64,
            pipeline: pipeline.max(1),
            requests,
            seed: c as u64,
        };
        tasks.push(tokio::spawn(async move {
            client(conn, &bare, job, &left).await
        }));
    }
    for t in tasks {
        t.await.context("a ceiling client panicked")??;
    }
    Ok(requests as f64 / start.elapsed().as_secs_f64())
}

/// What one ceiling connection sends.
#[derive(Clone, Copy)]
struct Job {
    visit: Visit,
    keys: u64,
    pipeline: usize,
    /// Requests of the whole run (request numbers are `requests - left`).
    requests: u64,
    /// The connection's random seed ([`Visit::Random`]).
    seed: u64,
}

/// A script run bare: `EVALSHA sha 1 <prefix>{<id>}:<suffix> args…`, the script already in
/// the server's cache. The ceiling drivers here and `tollgate load --bare-script` /
/// `--eval-file` send it.
pub(crate) struct Bare {
    sha: String,
    prefix: String,
    suffix: &'static str,
    pub(crate) args: Vec<Vec<u8>>,
    /// For tollgate's script, the policy's limit: its reply is a decision
    /// ([`scripts::reply`]); `None` for a script from a file, whose reply means nothing here.
    pub(crate) decides: Option<u64>,
}

impl Bare {
    /// tollgate's script for `policy`, with the argument a decision of `cost` sends; loads
    /// tollgate's scripts into the cache of the server at `url`.
    pub(crate) async fn for_policy(
        url: &str,
        prefix: &str,
        policy: &Policy,
        cost: u64,
    ) -> Result<Self> {
        RedisStore::builder(url)
            .build()
            .await?
            .load_scripts()
            .await?;
        let script = scripts::for_policy(policy);
        Ok(Self {
            sha: script.sha().to_owned(),
            prefix: prefix.to_owned(),
            suffix: script.key_suffix(),
            args: vec![scripts::args(policy, cost, true).as_bytes().to_vec()],
            decides: Some(policy.limit()),
        })
    }

    /// The Lua script in the file at `path` with `args`, on the keys the store's decisions use;
    /// loads it into the cache of the server at `url`. `option` names the command-line option
    /// the path came from, for the error.
    pub(crate) async fn from_file(
        url: &str,
        prefix: &str,
        path: &std::path::Path,
        option: &str,
        args: Vec<Vec<u8>>,
    ) -> Result<Self> {
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("{option} {}", path.display()))?;
        let mut conn = tollgate::redis::client_for(url)?
            .get_multiplexed_async_connection()
            .await?;
        let sha = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(source)
            .query_async(&mut conn)
            .await?;
        Ok(Self {
            sha,
            prefix: prefix.to_owned(),
            // the store's key shape (`<prefix>{<id>}`: one key per bucket, whatever the
            // algorithm), so a floor runs on the keys the decisions use
            suffix: scripts::all()[0].key_suffix(),
            args,
            decides: None,
        })
    }

    /// The SHA to send.
    pub(crate) fn sha(&self) -> &str {
        &self.sha
    }

    /// The key of bucket `id` (tollgate's script: `<prefix>{<id>}`, as the store names it).
    pub(crate) fn key(&self, id: impl std::fmt::Display) -> String {
        if self.suffix.is_empty() {
            format!("{}{{{id}}}", self.prefix)
        } else {
            format!("{}{{{id}}}:{}", self.prefix, self.suffix)
        }
    }
}

/// `tollgate ceiling`: what Redis does with a script and nothing else in the way.
#[derive(Args, Debug)]
pub(crate) struct CeilingArgs {
    /// The Redis server (redis:// only: the driver has no TLS).
    #[arg(long, value_name = "URL", required_unless_present_any = ["print_script", "print_arg"])]
    redis: Option<String>,
    /// Run tollgate's script for this policy, with the argument a decision sends.
    #[arg(long, conflicts_with = "script", required_unless_present = "script")]
    policy: Option<Policy>,
    /// Cost of every request (with `--policy`).
    #[arg(long, default_value_t = 1, requires = "policy")]
    cost: u64,
    /// Run the Lua script in this file instead, with `--arg`s as its arguments.
    #[arg(long, value_name = "PATH")]
    script: Option<std::path::PathBuf>,
    /// An argument of `--script`'s script (repeat for more, in order).
    #[arg(long = "arg", value_name = "ARG", requires = "script")]
    args: Vec<String>,
    /// Connections (redis-benchmark's `-c`), 1 to 10,000.
    #[arg(long, default_value_t = 64, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_CLIENTS))]
    clients: usize,
    /// Commands sent at a time on each connection (`-P`), 1 to 10,000 (each connection builds
    /// its round's commands in one buffer).
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_PIPELINE))]
    pipeline: usize,
    /// Requests in all (`-n`), at least 1.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    requests: u64,
    /// Distinct keys, picked at random (`-r`), at least 1.
    #[arg(long, default_value_t = 100_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    keys: usize,
    /// Key prefix (the key is `<prefix>{load:k<12 digits>}`, as the store shapes it).
    #[arg(long, default_value = "tollgate:")]
    prefix: String,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    /// Print the Lua source of tollgate's script for `--policy` (as the store loads it) and
    /// exit, for tools that run it outside tollgate (`benches/scripts/script-cost.sh`).
    #[arg(long, requires = "policy")]
    print_script: bool,
    /// Print the argument a decision of `--cost` under `--policy` sends (the store's bytes) as
    /// `mp:<integer>,…`, the notation of `benches/scripts/pipeline.py` (each integer in
    /// MessagePack's smallest encoding, as the store writes them), and exit.
    #[arg(long, requires = "policy", conflicts_with = "print_script")]
    print_arg: bool,
}

/// `bytes`, a run of MessagePack unsigned integers (the script's argument), as `mp:a,b,…`;
/// `None` if they are anything else.
fn mp_notation(bytes: &[u8]) -> Option<String> {
    let ints = tollgate::redis::record::uints(bytes)?;
    let ints: Vec<String> = ints.iter().map(u64::to_string).collect();
    Some(format!("mp:{}", ints.join(",")))
}

/// Runs `tollgate ceiling`.
pub(crate) async fn ceiling(args: CeilingArgs) -> Result<()> {
    if args.print_script {
        let policy = args
            .policy
            .as_ref()
            .context("--print-script needs --policy")?;
        crate::write_stdout(format_args!("{}", scripts::for_policy(policy).source()))?;
        return Ok(());
    }
    if args.print_arg {
        let policy = args.policy.as_ref().context("--print-arg needs --policy")?;
        policy.check_cost(args.cost)?;
        let arg = scripts::args(policy, args.cost, true);
        let text = mp_notation(arg.as_bytes())
            .with_context(|| format!("the store's argument is not integers: {arg:?}"))?;
        crate::outln!("{text}")?;
        return Ok(());
    }
    let url = args.redis.as_deref().context("give --redis")?;
    let ep = Arc::new(endpoint(url)?);
    let bare = if let Some(path) = &args.script {
        let script_args = args.args.iter().map(|a| a.clone().into_bytes()).collect();
        Bare::from_file(url, &args.prefix, path, "--script", script_args).await?
    } else {
        let policy = args.policy.as_ref().context("give --policy or --script")?;
        policy.check_cost(args.cost)?;
        Bare::for_policy(url, &args.prefix, policy, args.cost).await?
    };
    let bare = Arc::new(bare);
    let rps = drive(
        &ep,
        &bare,
        Visit::Random,
        args.keys,
        args.clients,
        args.pipeline,
        args.requests,
    )
    .await?;
    let script = args.script.as_ref().map_or_else(
        || {
            format!(
                "tollgate {}",
                args.policy
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default()
            )
        },
        |p| p.display().to_string(),
    );
    if args.json {
        let out = serde_json::json!({
            "script": script,
            "clients": args.clients,
            "pipeline": args.pipeline,
            "requests": args.requests,
            "keys": args.keys,
            "requests_per_sec": rps,
        });
        crate::outln!("{out}")?;
    } else {
        crate::outln!(
            "{script}: EVALSHA -c {} -P {} -n {} -r {}: {rps:.0} requests/s",
            args.clients,
            args.pipeline,
            args.requests,
            args.keys
        )?;
    }
    Ok(())
}

/// One ceiling connection to `ep`, authenticated and on its database, ready to send.
async fn connect(ep: &Endpoint) -> Result<BufReader<TcpStream>> {
    let stream = TcpStream::connect((ep.host.as_str(), ep.port))
        .await
        .with_context(|| format!("connecting to {}:{}", ep.host, ep.port))?;
    stream.set_nodelay(true)?;
    let mut conn = BufReader::new(stream);
    let mut line = Vec::new();
    if let Some(password) = &ep.password {
        let mut auth = vec!["AUTH".as_bytes()];
        if let Some(user) = &ep.user {
            auth.push(user.as_bytes());
        }
        auth.push(password.as_bytes());
        let mut buf = Vec::new();
        command(&mut buf, &auth);
        conn.get_mut().write_all(&buf).await?;
        line.clear();
        conn.read_until(b'\n', &mut line).await?;
        if !line.starts_with(b"+OK") {
            bail!("AUTH failed: {}", String::from_utf8_lossy(&line).trim_end());
        }
    }
    if ep.db != 0 {
        let db = ep.db.to_string();
        let mut buf = Vec::new();
        command(&mut buf, &[b"SELECT".as_slice(), db.as_bytes()]);
        conn.get_mut().write_all(&buf).await?;
        line.clear();
        conn.read_until(b'\n', &mut line).await?;
        if !line.starts_with(b"+OK") {
            bail!(
                "SELECT {db} failed: {}",
                String::from_utf8_lossy(&line).trim_end()
            );
        }
    }
    Ok(conn)
}

/// One connection: `pipeline` commands at a time, each on the key `job.visit` picks, until
/// `left` runs out.
async fn client(
    mut conn: BufReader<TcpStream>,
    bare: &Bare,
    job: Job,
    left: &AtomicU64,
) -> Result<()> {
    let Job {
        visit,
        keys,
        pipeline,
        requests,
        seed,
    } = job;
    let mut line = Vec::new();
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let (mut buf, mut body) = (Vec::new(), Vec::new());
    loop {
        let Ok(before) = left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
            l.checked_sub((pipeline as u64).min(l)).filter(|_| l > 0)
        }) else {
            return Ok(());
        };
        let n = (pipeline as u64).min(before);
        let first = requests - before;
        buf.clear();
        for i in first..first + n {
            let key = bare.key(visit_id(visit, i, keys, &mut rng));
            let mut parts: Vec<&[u8]> = vec![b"EVALSHA", bare.sha.as_bytes(), b"1", key.as_bytes()];
            parts.extend(bare.args.iter().map(Vec::as_slice));
            command(&mut buf, &parts);
        }
        conn.get_mut().write_all(&buf).await?;
        for _ in 0..n {
            skip_reply(&mut conn, &mut line, &mut body).await?;
        }
    }
}

/// Reads one reply (RESP2: a status, an integer, a bulk string or nil, or an array of them,
/// nested) and drops it; an error reply is an error.
async fn skip_reply(
    conn: &mut BufReader<TcpStream>,
    line: &mut Vec<u8>,
    body: &mut Vec<u8>,
) -> Result<()> {
    let mut pending = 1u64;
    while pending > 0 {
        pending -= 1;
        line.clear();
        conn.read_until(b'\n', line).await?;
        let count = || -> Result<i64> { Ok(std::str::from_utf8(&line[1..])?.trim_end().parse()?) };
        match line.first() {
            Some(b'+' | b':') => {}
            Some(b'$') => {
                if let Ok(len) = usize::try_from(count()?) {
                    body.resize(len + 2, 0);
                    conn.read_exact(body).await?;
                }
            }
            Some(b'*') => pending += u64::try_from(count()?).unwrap_or(0),
            Some(b'-') => bail!("the script failed: {}", String::from_utf8_lossy(line)),
            _ => bail!("unexpected reply: {}", String::from_utf8_lossy(line)),
        }
    }
    Ok(())
}

/// Appends one command in the Redis protocol.
fn command(buf: &mut Vec<u8>, parts: &[&[u8]]) {
    buf.extend_from_slice(format!("*{}\r\n", parts.len()).as_bytes());
    for p in parts {
        buf.extend_from_slice(format!("${}\r\n", p.len()).as_bytes());
        buf.extend_from_slice(p);
        buf.extend_from_slice(b"\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints_and_writes_commands() {
        let e = endpoint("redis://u:p@127.0.0.1:7001/0").unwrap();
        assert_eq!(
            (
                e.host.as_str(),
                e.port,
                e.user.as_deref(),
                e.password.as_deref()
            ),
            ("127.0.0.1", 7001, Some("u"), Some("p"))
        );
        let e = endpoint("redis://:secret@localhost").unwrap();
        assert_eq!(
            (e.port, e.user, e.password.as_deref()),
            (6379, None, Some("secret"))
        );
        let mut buf = Vec::new();
        command(&mut buf, &[b"GET", b"a\0b"]);
        assert_eq!(buf, b"*2\r\n$3\r\nGET\r\n$3\r\na\0b\r\n");
    }

    /// The comparison's ceiling visits the load run's keys in its order: request `n` on
    /// `load:k<n mod keys>`, the id `tollgate load` gives request `n` (before: a random
    /// `load:k<12 digits>`, with repeats).
    #[test]
    fn the_ceiling_visits_the_load_runs_keys_in_order() {
        let mut rng = 1;
        for n in 0..250 {
            let id = visit_id(Visit::RoundRobin, n, 100, &mut rng);
            let key = crate::load::load_key((n % 100) as usize).unwrap();
            assert_eq!(id, key.as_str(), "request {n}");
        }
        assert_eq!(rng, 1, "round-robin draws nothing");
        // three runs, three prefixes of one length, none a prefix of another's keys
        let p = RunPrefixes::new("tollgate:").unwrap();
        let all = [p.get(0), p.get(1), p.get(2)];
        assert!(
            all.iter()
                .all(|x| x.len() == all[0].len() && x.starts_with("tollgate:cmp"))
        );
        assert!(all[0] != all[1] && all[1] != all[2] && all[0] != all[2]);
        assert!(RunPrefixes::new(&"p".repeat(60)).is_err());
    }
}
