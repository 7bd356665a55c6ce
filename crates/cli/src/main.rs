//! The `tollgate` command: check one decision, run a bounded load from several simulated
//! instances, serve a demo.

mod compare;
mod load;
mod policy;
mod serve;
mod target;

use std::io::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use tollgate::{FailureMode, Key, Limiter, LocalStore, Policy, Store};

/// Writes one line to standard output: [`write_stdout`] with a newline.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// Standard output's reader went away (`tollgate load ... | head -1`): the command stops
/// writing and exits quietly, as `ls | head` does, instead of panicking in `println!`.
#[derive(Debug, thiserror::Error)]
#[error("standard output was closed by its reader")]
pub(crate) struct StdoutClosed;

/// Writes to standard output, flushed. A reader that has closed the pipe is [`StdoutClosed`];
/// any other failure is an error like any other.
pub(crate) fn write_stdout(text: std::fmt::Arguments<'_>) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_fmt(text).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        result => result.context("writing to standard output"),
    }
}

/// One rate-limit quota across every instance of a service.
#[derive(Parser, Debug)]
#[command(name = "tollgate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Make one decision and print it as JSON. Without a Redis, on a fresh in-process store:
    /// every invocation starts from a full bucket.
    Check(CheckArgs),
    /// Run a bounded load from several independent limiter instances and print a summary.
    Load(load::LoadArgs),
    /// Serve a demo HTTP service whose routes are rate-limited by a policy file.
    Serve(serve::ServeArgs),
    /// Publish and show policies in the Redis policy registry.
    Policy(policy::PolicyArgs),
    /// Run a script bare by EVALSHA as redis-benchmark would (connections × pipeline, random
    /// keys) and print requests/s: tollgate's script for a policy, or any script file, so two
    /// scripts' ceilings are measured by one client.
    Ceiling(compare::CeilingArgs),
}

/// Where buckets live.
#[derive(Args, Debug, Clone)]
pub(crate) struct StoreArgs {
    #[command(flatten)]
    pub(crate) target: target::RedisTarget,
    /// Key prefix in Redis (with --redis, --sentinel or --cluster).
    #[arg(long, default_value = "tollgate:", requires = "redis_target")]
    prefix: String,
    /// Use a bb8 connection pool of this size, at least 1 (default: the store's default
    /// pool, 4; with --redis: a Sentinel store keeps one multiplexed connection to the
    /// primary, a Cluster store one per node).
    #[arg(long, value_name = "SIZE", conflicts_with_all = ["multiplexed", "sentinel", "cluster"], requires = "redis", value_parser = clap::value_parser!(u32).range(1..))]
    pool: Option<u32>,
    /// Use one multiplexed connection (redis-rs's ConnectionManager) instead of a pool (with
    /// --redis).
    #[arg(long, requires = "redis", conflicts_with_all = ["sentinel", "cluster"])]
    multiplexed: bool,
    /// Per-call deadline, above zero.
    #[arg(long, default_value = "250ms", value_parser = deadline)]
    timeout: Duration,
}

/// Parses a deadline (`250ms`, `2s`): above zero, since a zero deadline fails every Redis call
/// (or, as a timer tick decides, only some of them).
pub(crate) fn deadline(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("a deadline must be above zero (a zero deadline fails every call)".into());
    }
    Ok(d)
}

impl StoreArgs {
    /// A fresh store handle: each call is a separate "instance" with its own connections.
    pub(crate) async fn connect(&self) -> Result<Arc<dyn Store>> {
        self.open(false).await
    }

    /// As [`StoreArgs::connect`], with every connection of the store made now (all of a
    /// pool's, each answering a `PING`): a load run times decisions, not connects.
    pub(crate) async fn connect_all(&self) -> Result<Arc<dyn Store>> {
        self.open(true).await
    }

    async fn open(&self, connect_all: bool) -> Result<Arc<dyn Store>> {
        let Some(builder) = self.redis_builder()? else {
            return Ok(Arc::new(LocalStore::new()));
        };
        let connecting = || format!("connecting to {}", self.target.describe());
        let store = builder.build().await.with_context(connecting)?;
        if connect_all {
            store.connect_all().await.with_context(connecting)?;
        }
        Ok(Arc::new(store))
    }

    /// As [`StoreArgs::connect`], for a long-running server: a Redis that cannot be reached
    /// (or answers too late) at startup is not fatal. It is logged, and the store connects
    /// when Redis answers; until then each limiter applies its failure mode, as it does when
    /// Redis goes away later. A configuration that can never work is still an error, and so
    /// is a Cluster that cannot be reached (its slot map is read when the store is made).
    pub(crate) async fn connect_or_defer(&self) -> Result<Arc<dyn Store>> {
        // a URL that can never work is an error now, not a Redis "that cannot be reached yet"
        let Some(builder) = self.redis_builder()? else {
            return self.connect().await;
        };
        match builder.clone().build().await {
            Ok(store) => Ok(Arc::new(store)),
            Err(error) if error.class() == tollgate::ErrorClass::Unavailable => {
                // The URL is not logged: it may carry a password.
                tracing::warn!(
                    %error,
                    "Redis cannot be reached at startup; serving with each route's failure mode until it answers"
                );
                let store = builder.build_lazy().await.with_context(|| {
                    format!("configuring the store for {}", self.target.describe())
                })?;
                Ok(Arc::new(store))
            }
            Err(error) => {
                Err(error).with_context(|| format!("connecting to {}", self.target.describe()))
            }
        }
    }

    fn redis_builder(&self) -> Result<Option<tollgate::redis::RedisStoreBuilder>> {
        let Some(builder) = self.target.builder()? else {
            return Ok(None);
        };
        let builder = builder.prefix(self.prefix.clone()).timeout(self.timeout);
        Ok(Some(match (self.pool, self.multiplexed) {
            (Some(size), _) => builder.pool(size),
            (None, true) => builder.multiplexed(),
            (None, false) => builder,
        }))
    }

    pub(crate) fn label(&self) -> &'static str {
        self.target.label()
    }
}

#[derive(Args, Debug)]
struct CheckArgs {
    /// The policy, e.g. `token-bucket:capacity=10,rate=2`, `fixed-window:limit=100,window=1m`,
    /// `sliding-log:limit=20,window=10s`.
    #[arg(long)]
    policy: Policy,
    /// The bucket: `namespace:identity` (e.g. `user:1`) or a bare namespace for a global bucket.
    #[arg(long)]
    key: String,
    /// The request's cost.
    #[arg(long, default_value_t = 1)]
    cost: u64,
    #[command(flatten)]
    store: StoreArgs,
}

/// Parses `namespace:identity` into a [`Key`]; the identity is escaped, never trusted.
pub(crate) fn parse_key(text: &str) -> Result<Key> {
    Ok(match text.split_once(':') {
        Some((ns, id)) => Key::new(ns, [id])?,
        None => Key::new(text, std::iter::empty::<&[u8]>())?,
    })
}

pub(crate) fn decision_json(d: &tollgate::Decision) -> serde_json::Value {
    serde_json::json!({
        "allowed": d.allowed,
        "limit": d.limit,
        "remaining": d.remaining,
        "retry_after_us": d.retry_after.map(|r| r.as_micros() as u64),
        "retry_after_secs": d.retry_after_secs(),
        "reset_after_us": d.reset_after.as_micros() as u64,
        "reset_after_secs": d.reset_after_secs(),
        "enforcement": d.enforcement.as_str(),
    })
}

async fn check(args: CheckArgs) -> Result<()> {
    let key = parse_key(&args.key)?;
    let store = args.store.connect().await?;
    let limiter = Limiter::builder(key.as_str().split(':').next().unwrap_or("cli"), args.policy)
        .store(store)
        .failure_mode(FailureMode::Closed)
        .timeout(args.store.timeout)
        .build()?;
    let decision = limiter
        .check_key(&key, args.cost)
        .await
        .context("no decision")?;
    let mut out = decision_json(&decision);
    out["key"] = key.as_str().into();
    out["policy"] = args.policy.to_spec().into();
    out["store"] = args.store.label().into();
    outln!("{}", serde_json::to_string_pretty(&out)?)
}

/// Prints `error` on standard error: its message, then each cause whose text the message
/// before it does not already hold. The library's errors name their cause in their own
/// message too ("invalid request: cost 11 exceeds …" caused by "cost 11 exceeds …"), which
/// anyhow's report printed twice.
fn report(error: &anyhow::Error) {
    use std::fmt::Write as _;
    let mut text = format!("Error: {error}\n");
    let mut shown = error.to_string();
    let causes: Vec<String> = error
        .chain()
        .skip(1)
        .map(ToString::to_string)
        .filter(|cause| {
            let repeated = shown.contains(cause.as_str());
            shown.clone_from(cause);
            !repeated
        })
        .collect();
    // writing to a String cannot fail
    match causes.as_slice() {
        [] => {}
        [one] => {
            let _ = write!(text, "\nCaused by:\n    {one}\n");
        }
        many => {
            text.push_str("\nCaused by:\n");
            for (i, cause) in many.iter().enumerate() {
                let _ = writeln!(text, "    {i}: {cause}");
            }
        }
    }
    let backtrace = error.backtrace();
    if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
        let _ = write!(text, "\nStack backtrace:\n{backtrace}\n");
    }
    // nowhere left to report a failure to write the report
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        // the reader has what it wanted: nothing to report
        Err(e) if e.chain().any(<dyn std::error::Error>::is::<StdoutClosed>) => ExitCode::SUCCESS,
        Err(e) => {
            report(&e);
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Command::Load(load::LoadArgs {
        threads: Some(n), ..
    }) = &cli.command
    {
        runtime.worker_threads(usize::from(*n));
    }
    let runtime = runtime.enable_all().build()?;
    runtime.block_on(async move {
        match cli.command {
            Command::Check(args) => check(args).await,
            Command::Load(args) => load::run(args).await,
            Command::Serve(args) => serve::run(args).await,
            Command::Policy(args) => policy::run(args).await,
            Command::Ceiling(args) => compare::ceiling(args).await,
        }
    })
}
