//! `tollgate load`: several independent limiter instances (each with its own store handle,
//! as separate service processes would have) × tasks, against one or many keys, bounded in
//! both time and count.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tollgate::{Algorithm, Decision, Enforcement, Error, FailureMode, Key, Limiter, Policy};

use crate::StoreArgs;
use crate::compare::Bare;

/// Most keys one `--batch` call decides.
const MAX_BATCH: usize = 100_000;

/// Most tasks of a run in all (`--instances` × `--tasks`): each keeps a latency histogram of
/// ~220 KB, written in full when it is made (1,024 instances of 64 tasks took 14.5 GB).
const MAX_TASKS: usize = 4096;

/// Most `--keys`: every key of a run is made before it starts (10,000,000 take ~0.6 GB).
const MAX_KEYS: usize = 10_000_000;

/// Most `--threads`: a runtime the OS cannot give its threads panics while it starts.
const MAX_THREADS: u16 = 1024;

/// Longest `--duration` (a day): a run is a measurement, and its deadline must fit an `Instant`.
const MAX_RUN: Duration = Duration::from_secs(86_400);

/// Upper bound on requests when only `--duration` is given.
const DEFAULT_MAX_REQUESTS: u64 = 100_000_000;
/// Upper bound on time when only `--requests` is given.
const DEFAULT_MAX_DURATION: Duration = Duration::from_secs(300);
/// Request numbers a task takes at a time (times `--batch`).
const CHUNK: u64 = 64;
/// Width of one slot of the summary's timeline.
const SLOT: Duration = Duration::from_secs(1);
/// Slots kept; calls after the last one count in it.
const MAX_SLOTS: usize = 3600;

/// What each limiter instance does when its store cannot answer (`--fail-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum FailMode {
    /// Admit, labelled `bypassed`.
    Open,
    /// Refuse with "limiter unavailable" (counted as `unavailable`, not as a denial).
    Closed,
    /// Decide on a per-instance local store with the quota divided by `--instances`,
    /// labelled `degraded`.
    Degraded,
}

impl FailMode {
    fn mode(self, instances: usize) -> FailureMode {
        match self {
            Self::Open => FailureMode::Open,
            Self::Closed => FailureMode::Closed,
            Self::Degraded => FailureMode::degraded(u32::try_from(instances).unwrap_or(u32::MAX)),
        }
    }
}

#[derive(Args, Debug)]
#[allow(clippy::struct_excessive_bools)] // independent command-line flags
pub(crate) struct LoadArgs {
    /// The policy, e.g. `token-bucket:capacity=100,rate=50`.
    #[arg(long)]
    policy: Policy,
    /// Independent limiter instances, each with its own store handle (1 to 4,096, and at
    /// most 4,096 tasks in all).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_TASKS as u64))]
    instances: usize,
    /// Concurrent tasks per instance (1 to 4,096; `--instances` × `--tasks` at most 4,096).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_TASKS as u64))]
    tasks: usize,
    /// Stop after this long (default 300 s if only --requests is given).
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// Stop after this many requests in total (default 100,000,000 if only --duration is given).
    #[arg(long)]
    requests: Option<u64>,
    /// Number of distinct keys, used round-robin (1 to 10,000,000).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_KEYS as u64))]
    keys: usize,
    /// Cost of every request.
    #[arg(long, default_value_t = 1)]
    cost: u64,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Give each instance a local deny cache of this many keys (zero round trips for a key
    /// denied until a known instant).
    #[arg(long, value_name = "KEYS")]
    deny_cache: Option<usize>,
    /// Decide this many keys per call (`Limiter::check_many`: one round trip on Redis), up
    /// to 100,000.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=MAX_BATCH as u64))]
    batch: u64,
    /// Measure a bare `PING` round trip instead of decisions, with the same tasks and bounds,
    /// on one multiplexed connection per instance (the store's protocol, `--timeout` as each
    /// call's deadline; not with `--pool`): the baseline for decision latency.
    #[arg(long, requires = "redis", conflicts_with_all = ["batch", "deny_cache", "pool", "sentinel", "cluster"])]
    ping: bool,
    /// Run the policy's script by a bare `EVALSHA` on the instance's connection (no limiter,
    /// breaker, deadline or decision decoding), with the same keys, tasks and bounds: with
    /// `--ping`, it splits a decision's latency into the round trip, the script's run in
    /// Redis, and tollgate's own work.
    #[arg(long, requires = "redis", conflicts_with_all = ["batch", "deny_cache", "ping", "pool", "sentinel", "cluster"])]
    bare_script: bool,
    /// Run the Lua script in this file by a bare `EVALSHA` with one key (the key a decision
    /// uses, `<prefix>{load:k<i>}`) and no arguments, instead of decisions: the latency floor of
    /// any script doing the same Redis calls (`benches/scripts/latency/`).
    #[arg(
        long,
        value_name = "PATH",
        requires = "redis",
        conflicts_with_all = ["batch", "deny_cache", "ping", "bare_script", "compare_redis_benchmark", "pool", "sentinel", "cluster"]
    )]
    eval_file: Option<std::path::PathBuf>,
    /// After the run, run the same script, argument, keys, visiting order, concurrency and
    /// number of requests bare on the same server, as redis-benchmark would (pipeline 1 and 16;
    /// redis-benchmark itself cannot send the script's binary argument), and report tollgate's
    /// ratio to it. Each of the three runs then has keys of its own:
    /// `<prefix>cmp<nonce>.<run>:{load:k<i>}` (run 0 is tollgate's), so none starts on buckets
    /// another left. Not with `--ping` or `--deny-cache`, whose runs do other work.
    #[arg(long, requires = "redis", conflicts_with_all = ["ping", "deny_cache", "sentinel", "cluster"])]
    compare_redis_benchmark: bool,
    /// Make every connection of the store's pool before the clock starts, each answering a
    /// `PING` (`RedisStore::connect_all`, as a service that calls it at startup), so that every
    /// one of them decides. Without it the pool connects on demand, as the library does in a
    /// service: a connection is made only when a call finds none idle, so on one runtime
    /// thread a pool of any size keeps the one connection it starts with, and on more threads
    /// it grows as contention asks, its connects inside the timed run (~1 ms at 64 tasks).
    /// Not with `--multiplexed`, `--ping`, `--bare-script` or `--eval-file`, which use no pool
    /// (with `--sentinel`, the primary answers a `PING` first; a Cluster's nodes are connected
    /// when the store is made in any case).
    #[arg(
        long,
        requires = "redis_target",
        conflicts_with_all = ["multiplexed", "ping", "bare_script", "eval_file"]
    )]
    connect_all: bool,
    /// What each instance does when the store cannot answer. The summary counts decisions by
    /// enforcement (`shared`, `degraded`, `bypassed`) and refusals as `unavailable`, overall
    /// and per second, so an outage during the run shows where it started and ended.
    #[arg(long, value_enum, default_value_t = FailMode::Closed)]
    fail_mode: FailMode,
    /// Worker threads of the client's runtime (tasks, connections and the ceiling driver of
    /// `--compare-redis-benchmark` all run on them); default: one per CPU. Against a Redis on
    /// the same small machine, `--threads 1` leaves the single-threaded server a core of its
    /// own (BENCHMARKS.md measures both). 1 to 1,024.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=i64::from(MAX_THREADS)))]
    pub(crate) threads: Option<u16>,
    #[command(flatten)]
    store: StoreArgs,
}

/// What each task does per iteration.
#[derive(Clone)]
enum Probe {
    /// Decisions through a limiter (one key, or a batch with `check_many`).
    Check(Limiter),
    /// A bare PING on the instance's connection.
    Ping(redis::aio::MultiplexedConnection),
    /// A script by a bare EVALSHA: the policy's (its reply read as a decision) or one from a
    /// file (its reply ignored): see [`Bare::decides`].
    Script {
        conn: redis::aio::MultiplexedConnection,
        bare: Arc<Bare>,
    },
}

/// Outcomes of one iteration.
#[derive(Default)]
struct Tally {
    allowed: u64,
    denied: u64,
    shared: u64,
    degraded: u64,
    bypassed: u64,
    /// Requests of a batch that failed on their own (the others were decided).
    unavailable: u64,
    errors: u64,
}

impl Tally {
    fn add(&mut self, d: &Decision) {
        if d.allowed {
            self.allowed += 1;
        } else {
            self.denied += 1;
        }
        match d.enforcement {
            Enforcement::Degraded => self.degraded += 1,
            Enforcement::Bypassed => self.bypassed += 1,
            _ => self.shared += 1,
        }
    }
}

impl Probe {
    /// Runs one iteration over `keys`; returns its outcomes or the limiter's error.
    async fn run(&mut self, keys: &[Key], cost: u64) -> Result<Tally, Failure> {
        let mut tally = Tally::default();
        match self {
            Self::Check(limiter) if keys.len() == 1 => {
                tally.add(&limiter.check_key(&keys[0], cost).await?);
            }
            Self::Check(limiter) => {
                for result in limiter.check_many(keys, cost).await? {
                    match result {
                        Ok(d) => tally.add(&d),
                        Err(Error::Unavailable { .. }) => {
                            tally.unavailable += 1;
                            tally.errors += 1;
                        }
                        Err(_) => tally.errors += 1,
                    }
                }
            }
            Self::Ping(conn) => {
                let () = redis::cmd("PING")
                    .query_async(conn)
                    .await
                    .map_err(|e| Failure::Other(e.to_string()))?;
                tally.allowed = 1;
                tally.shared = 1;
            }
            Self::Script { conn, bare } => {
                let reply: redis::Value = redis::cmd("EVALSHA")
                    .arg(bare.sha())
                    .arg(1)
                    .arg(bare.key(keys[0].as_str()))
                    .arg(&bare.args)
                    .query_async(conn)
                    .await
                    .map_err(|e| Failure::Other(e.to_string()))?;
                let allowed = match bare.decides {
                    None => true,
                    Some(limit) => {
                        tollgate::redis::scripts::reply(&reply, limit)
                            .ok_or_else(|| Failure::Other(format!("unexpected reply {reply:?}")))?
                            [0]
                            == 1
                    }
                };
                if allowed {
                    tally.allowed = 1;
                } else {
                    tally.denied = 1;
                }
                tally.shared = 1;
            }
        }
        Ok(tally)
    }
}

/// Why an iteration produced no decision.
enum Failure {
    /// The store could not answer and the instance fails closed.
    Unavailable(String),
    /// Anything else (a bug or a misconfiguration: reported, never a failure-mode switch).
    Other(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        match e {
            Error::Unavailable { .. } => Self::Unavailable(e.to_string()),
            e => Self::Other(e.to_string()),
        }
    }
}

/// Counts of one kind of outcome, overall.
#[derive(Default)]
struct Counts {
    allowed: AtomicU64,
    denied: AtomicU64,
    shared: AtomicU64,
    degraded: AtomicU64,
    bypassed: AtomicU64,
    unavailable: AtomicU64,
    errors: AtomicU64,
}

/// One task's outcomes not yet added to the shared [`Counts`]: tasks add theirs in batches,
/// so the counting does not contend across threads on every call.
#[derive(Default)]
struct Pending {
    allowed: u64,
    denied: u64,
    shared: u64,
    degraded: u64,
    bypassed: u64,
    unavailable: u64,
    errors: u64,
    calls: u32,
}

impl Pending {
    fn add(&mut self, outcome: &Result<Tally, Failure>, keys: u64) {
        self.calls += 1;
        match outcome {
            Ok(t) => {
                self.allowed += t.allowed;
                self.denied += t.denied;
                self.shared += t.shared;
                self.degraded += t.degraded;
                self.bypassed += t.bypassed;
                self.unavailable += t.unavailable;
                self.errors += t.errors;
            }
            Err(Failure::Unavailable(_)) => {
                self.unavailable += keys;
                self.errors += keys;
            }
            Err(Failure::Other(_)) => self.errors += keys,
        }
    }

    /// Adds these outcomes to `total` and to `slot`, and starts again from zero.
    fn flush(&mut self, total: &Counts, slot: &Counts) {
        for counts in [total, slot] {
            for (counter, n) in [
                (&counts.allowed, self.allowed),
                (&counts.denied, self.denied),
                (&counts.shared, self.shared),
                (&counts.degraded, self.degraded),
                (&counts.bypassed, self.bypassed),
                (&counts.unavailable, self.unavailable),
                (&counts.errors, self.errors),
            ] {
                if n > 0 {
                    counter.fetch_add(n, Ordering::Relaxed);
                }
            }
        }
        *self = Self::default();
    }
}

impl Counts {
    fn slot(&self, from: f64) -> Slot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Slot {
            from_secs: from,
            shared: get(&self.shared),
            degraded: get(&self.degraded),
            bypassed: get(&self.bypassed),
            unavailable: get(&self.unavailable),
            other_errors: get(&self.errors) - get(&self.unavailable),
        }
    }
}

#[derive(Default)]
struct Counters {
    issued: AtomicU64,
    total: Counts,
    /// Per [`SLOT`] of the run.
    slots: Vec<Counts>,
}

/// Decisions by enforcement and refusals.
#[derive(Debug, Serialize)]
struct Slot {
    /// Start of the slot, seconds from the start of the run.
    from_secs: f64,
    shared: u64,
    degraded: u64,
    bypassed: u64,
    /// Refused under `--fail-mode closed` because the store could not answer.
    unavailable: u64,
    /// Other errors (invalid input, script errors): never a failure-mode switch.
    other_errors: u64,
}

/// The summary printed at the end of a run.
#[derive(Debug, Serialize)]
pub(crate) struct Summary {
    store: &'static str,
    policy: String,
    instances: usize,
    tasks_per_instance: usize,
    /// Worker threads of the client's runtime.
    runtime_threads: usize,
    keys: usize,
    cost: u64,
    /// From the start of the run's first call to the end of its last (the tasks' setup and
    /// the merging of their histograms excluded): the time `decisions_per_sec` is over.
    elapsed_secs: f64,
    /// Requests issued: `allowed + denied + errors`.
    requests: u64,
    allowed: u64,
    denied: u64,
    /// Requests that got no decision (the store did not answer in time, a script error…):
    /// never counted in `decisions_per_sec` or in a ratio built on it.
    errors: u64,
    /// The failure mode every instance ran with.
    fail_mode: &'static str,
    /// Decisions by enforcement, and refusals, over the whole run.
    by_enforcement: Slot,
    /// The same per second of the run: an outage shows as the seconds where `shared` gives
    /// way to `degraded`, `bypassed` or `unavailable`.
    timeline: Vec<Slot>,
    admitted_cost: u64,
    /// Answered decisions (`allowed + denied`, errors excluded) per second of the run; `null`
    /// (withheld, see `rate_withheld`) when any decision was `degraded` or `bypassed`.
    decisions_per_sec: Option<f64>,
    /// Why `decisions_per_sec` is `null`: decisions the store did not make (local fallback,
    /// fail-open) took part in the run. They are local: nanoseconds once the breaker has
    /// opened, a deadline or a failed connect first before that; so no rate over the run
    /// measures the store. The counts by enforcement and the timeline show what happened.
    #[serde(skip_serializing_if = "Option::is_none")]
    rate_withheld: Option<String>,
    /// Keys decided per call (`--batch`); latency is per call.
    batch: u64,
    /// Latency of the calls the store decided wholly (`shared`): calls that failed, fell
    /// back (`degraded`) or were let through (`bypassed`) are not in it; `null` if there
    /// were none.
    latency_us: Option<Latency>,
    /// The longest call of the run, whatever its outcome (failed and fallen-back calls
    /// included): each is bounded by `--timeout` plus scheduling.
    slowest_call_us: f64,
    /// Most cost one shared quota could admit over the run, summed over keys. With the local
    /// store every instance has its own quota, so the fleet may admit `instances` times this.
    quota_bound_per_store: u64,
    first_error: Option<String>,
    /// The same script run bare on the same server (the redis-benchmark-style ceiling), when
    /// asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    redis_benchmark: Vec<crate::compare::Ceiling>,
}

#[derive(Debug, Serialize)]
struct Latency {
    /// Calls measured.
    calls: u64,
    p50: f64,
    p99: f64,
    p999: f64,
    max: f64,
    mean: f64,
}

/// `n`, or `u64::MAX` if it does not fit (limits and costs go up to 2^52, so products of
/// them overflow 64 bits).
fn saturate(n: u128) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Most cost one bucket can admit over `elapsed` under `policy`.
fn bucket_bound(policy: &Policy, elapsed: Duration) -> u64 {
    let us = elapsed.as_micros();
    match policy.algorithm() {
        Algorithm::TokenBucket(tb) => {
            let refill = u128::from(tb.rate) * us / u128::from(tb.unit);
            tb.capacity.saturating_add(saturate(refill))
        }
        Algorithm::FixedWindow(fw) => {
            saturate(u128::from(fw.limit) * (us / u128::from(fw.window_micros) + 2))
        }
        Algorithm::SlidingLog(sl) => {
            saturate(u128::from(sl.limit) * (us / u128::from(sl.window_micros) + 1))
        }
        _ => u64::MAX,
    }
}

#[allow(clippy::too_many_lines)] // one bounded run, read top to bottom
pub(crate) async fn run(args: LoadArgs) -> Result<()> {
    // each is at least 1 and at most MAX_TASKS (clap), so the product fits
    if args.instances * args.tasks > MAX_TASKS {
        bail!(
            "--instances {} x --tasks {} is {} tasks; a run has at most {MAX_TASKS}",
            args.instances,
            args.tasks,
            args.instances * args.tasks
        );
    }
    if args.duration.is_none() && args.requests.is_none() {
        bail!("give --duration or --requests (or both): a load run is always bounded");
    }
    args.policy.check_cost(args.cost)?;
    let max_requests = args.requests.unwrap_or(DEFAULT_MAX_REQUESTS);
    let max_duration = args.duration.unwrap_or(DEFAULT_MAX_DURATION);
    if max_duration > MAX_RUN {
        bail!(
            "--duration must be at most {}",
            humantime::format_duration(MAX_RUN)
        );
    }

    let keys: Arc<Vec<Key>> = Arc::new((0..args.keys).map(load_key).collect::<Result<_, _>>()?);
    // With a comparison, every run (this one and each ceiling) has keys of its own.
    let prefixes = if args.compare_redis_benchmark {
        Some(crate::compare::RunPrefixes::new(&args.store.prefix)?)
    } else {
        None
    };
    let mut store = args.store.clone();
    if let Some(p) = &prefixes {
        store.prefix = p.get(0);
    }
    let mut probes = Vec::with_capacity(args.instances);
    for _ in 0..args.instances {
        probes.push(
            if args.ping || args.bare_script || args.eval_file.is_some() {
                let url = store.target.redis.as_deref().unwrap_or_default();
                // the store's protocol, so the probes' round trips are the decisions'
                let mut conn = tollgate::redis::client_for(url)?
                    .get_multiplexed_async_connection()
                    .await?;
                // a probe's call has the deadline a decision has (`--timeout`), not redis-rs's
                // default
                conn.set_response_timeout(store.timeout);
                let prefix = &store.prefix;
                if args.ping {
                    Probe::Ping(conn)
                } else {
                    let bare = match &args.eval_file {
                        Some(path) => {
                            Bare::from_file(url, prefix, path, "--eval-file", Vec::new()).await?
                        }
                        None => Bare::for_policy(url, prefix, &args.policy, args.cost).await?,
                    };
                    Probe::Script {
                        conn,
                        bare: Arc::new(bare),
                    }
                }
            } else {
                // with --connect-all, every connection is made now, before the clock starts; a
                // pool otherwise connects on demand, inside the run, as it does in a service
                let connected = if args.connect_all {
                    store.connect_all().await?
                } else {
                    store.connect().await?
                };
                let mut b = Limiter::builder("load", args.policy)
                    .store(connected)
                    .failure_mode(args.fail_mode.mode(args.instances))
                    .timeout(args.store.timeout);
                if let Some(n) = args.deny_cache {
                    b = b.deny_cache(n);
                }
                Probe::Check(b.build()?)
            },
        );
    }

    let slots = (max_duration.as_secs_f64() / SLOT.as_secs_f64()).ceil() as usize;
    let counters = Arc::new(Counters {
        slots: (0..slots.clamp(1, MAX_SLOTS))
            .map(|_| Counts::default())
            .collect(),
        ..Counters::default()
    });
    let first_error = Arc::new(std::sync::Mutex::new(None::<String>));
    let progress = progress_bar(max_requests, args.json);
    // Every task's latency histogram (~220 KB, written in full) is made before the clock
    // starts: made by the tasks, 4,096 of them took ~0.13 s of a run's time in a release
    // build, between the calls of the tasks already deciding.
    let mut histograms = (0..args.instances * args.tasks)
        .map(|_| Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let deadline = started + max_duration;
    let batch = args.batch;
    let mut handles = Vec::new();
    for probe in &probes {
        for _ in 0..args.tasks {
            let mut probe = probe.clone();
            let keys = keys.clone();
            let counters = counters.clone();
            let first_error = first_error.clone();
            let cost = args.cost;
            let mut hist = histograms.pop().expect("one histogram per task");
            handles.push(tokio::spawn(async move {
                let mut picked = Vec::with_capacity(batch as usize);
                let mut iteration = 0u32;
                let mut pending = Pending::default();
                let mut current = 0;
                // the start of this task's first call and the end of its last
                let mut span: Option<(Instant, Instant)> = None;
                let mut slowest = 0u64;
                // Request numbers are taken CHUNK calls at a time, so the tasks do not contend
                // on one counter for every call; the bound stays exact.
                let (mut next, mut end) = (0u64, 0u64);
                loop {
                    if next >= end {
                        next = counters.issued.fetch_add(CHUNK * batch, Ordering::Relaxed);
                        end = next + CHUNK * batch;
                    }
                    let n = next;
                    next += batch;
                    if n >= max_requests || Instant::now() >= deadline {
                        break;
                    }
                    // A decision that needs no I/O (local store, deny cache, a degraded or
                    // bypassed call while the breaker is open) never yields by itself: let the
                    // runtime's timers and connections (reconnects, breaker probes) run.
                    iteration = iteration.wrapping_add(1);
                    if iteration.is_multiple_of(64) {
                        tokio::task::yield_now().await;
                    }
                    let last = (n + batch).min(max_requests);
                    // One key is borrowed, not cloned: cloning bumps a reference count that
                    // every task shares on a hot key.
                    let chosen: &[Key] = if batch == 1 {
                        std::slice::from_ref(&keys[(n % keys.len() as u64) as usize])
                    } else {
                        picked.clear();
                        picked.extend(
                            (n..last).map(|i| keys[(i % keys.len() as u64) as usize].clone()),
                        );
                        &picked
                    };
                    let t0 = Instant::now();
                    let result = probe.run(chosen, cost).await;
                    let t1 = Instant::now();
                    let took = t1.duration_since(t0).as_nanos().max(1) as u64;
                    slowest = slowest.max(took);
                    // only the store's decisions: a fallen-back call's time is a local
                    // decision's (after a deadline or a failed connect, until the breaker
                    // opens), not the store's
                    if let Ok(t) = &result
                        && t.degraded + t.bypassed + t.errors == 0
                    {
                        hist.saturating_record(took);
                    }
                    span = Some((span.map_or(t0, |(first, _)| first), t1));
                    if let Err(Failure::Unavailable(e) | Failure::Other(e)) = &result {
                        first_error
                            .lock()
                            .expect("poisoned")
                            .get_or_insert_with(|| e.clone());
                    }
                    let slot = ((t0.duration_since(started).as_secs_f64() / SLOT.as_secs_f64())
                        as usize)
                        .min(counters.slots.len() - 1);
                    if slot != current || pending.calls >= 256 {
                        pending.flush(&counters.total, &counters.slots[current]);
                        current = slot;
                    }
                    pending.add(&result, last - n);
                }
                pending.flush(&counters.total, &counters.slots[current]);
                (hist, span, slowest)
            }));
        }
    }
    let ticker = progress.clone().map(|bar| {
        let counters = counters.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let t = &counters.total;
                let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
                bar.set_position(get(&t.allowed) + get(&t.denied) + get(&t.errors));
                bar.set_message(format!(
                    "shared {} degraded {} bypassed {} unavailable {}",
                    get(&t.shared),
                    get(&t.degraded),
                    get(&t.bypassed),
                    get(&t.unavailable)
                ));
            }
        })
    });
    let mut hists = Vec::with_capacity(handles.len());
    let mut span: Option<(Instant, Instant)> = None;
    let mut slowest = 0u64;
    for h in handles {
        let (h, s, slow) = h.await?;
        hists.push(h);
        slowest = slowest.max(slow);
        if let Some((first, last)) = s {
            span = Some(span.map_or((first, last), |(f, l)| (f.min(first), l.max(last))));
        }
    }
    // The run's wall time (its timeline), and the time decisions were made: from the first
    // call's start to the last call's end, as the ceiling's clock runs from its clients'
    // first request to their last reply. The merging of the histograms below is not deciding.
    let wall = started.elapsed();
    let elapsed = span
        .map(|(first, last)| last.duration_since(first))
        .filter(|d| !d.is_zero())
        .unwrap_or(wall);
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    for h in hists {
        hist.add(h)?;
    }
    if let Some(t) = ticker {
        t.abort();
    }
    if let Some(bar) = progress {
        bar.finish_and_clear();
    }

    let allowed = counters.total.allowed.load(Ordering::Relaxed);
    let denied = counters.total.denied.load(Ordering::Relaxed);
    let errors = counters.total.errors.load(Ordering::Relaxed);
    let requests = allowed + denied + errors;
    let decided = allowed + denied;
    let fell_back = counters.total.degraded.load(Ordering::Relaxed)
        + counters.total.bypassed.load(Ordering::Relaxed);
    let rate_withheld = (fell_back > 0).then(|| {
        format!(
            "{fell_back} of {decided} decisions were not made by the store (degraded or bypassed)"
        )
    });
    let used =
        ((wall.as_secs_f64() / SLOT.as_secs_f64()).ceil() as usize).clamp(1, counters.slots.len());
    let timeline = counters.slots[..used]
        .iter()
        .enumerate()
        .map(|(i, c)| c.slot(i as f64 * SLOT.as_secs_f64()))
        .collect();
    let summary = Summary {
        store: if args.ping {
            "redis-ping"
        } else if args.bare_script {
            "redis-bare-evalsha"
        } else if args.eval_file.is_some() {
            "redis-eval-file"
        } else {
            args.store.label()
        },
        policy: args.policy.to_spec(),
        instances: args.instances,
        tasks_per_instance: args.tasks,
        runtime_threads: tokio::runtime::Handle::current().metrics().num_workers(),
        keys: args.keys,
        cost: args.cost,
        elapsed_secs: elapsed.as_secs_f64(),
        requests,
        allowed,
        denied,
        errors,
        fail_mode: match args.fail_mode {
            FailMode::Open => "open",
            FailMode::Closed => "closed",
            FailMode::Degraded => "degraded",
        },
        by_enforcement: counters.total.slot(0.0),
        timeline,
        admitted_cost: saturate(u128::from(allowed) * u128::from(args.cost)),
        decisions_per_sec: rate_withheld
            .is_none()
            .then(|| decided as f64 / elapsed.as_secs_f64()),
        rate_withheld,
        batch: args.batch,
        latency_us: (!hist.is_empty()).then(|| Latency {
            calls: hist.len(),
            p50: hist.value_at_quantile(0.5) as f64 / 1e3,
            p99: hist.value_at_quantile(0.99) as f64 / 1e3,
            p999: hist.value_at_quantile(0.999) as f64 / 1e3,
            max: hist.max() as f64 / 1e3,
            mean: hist.mean() / 1e3,
        }),
        slowest_call_us: slowest as f64 / 1e3,
        quota_bound_per_store: bucket_bound(&args.policy, wall).saturating_mul(args.keys as u64),
        first_error: first_error.lock().expect("poisoned").clone(),
        redis_benchmark: Vec::new(),
    };
    let mut summary = summary;
    if let Some(prefixes) = &prefixes
        && let Some(url) = &args.store.target.redis
    {
        summary.redis_benchmark = crate::compare::run(
            url,
            prefixes,
            &args.policy,
            args.cost,
            args.keys,
            args.instances * args.tasks,
            // the run's own request count, so the ceiling visits each key as often (a floor
            // of 10,000 gave a short run's sliding logs 100 entries in the ceiling against 3)
            requests.max(1),
            summary.decisions_per_sec,
        )
        .await?;
    }
    if args.json {
        crate::outln!("{}", serde_json::to_string_pretty(&summary)?)?;
    } else {
        print_human(&summary)?;
    }
    Ok(())
}

/// The key of bucket `i` of a run: `load:k<i>` (the ceiling of `--compare-redis-benchmark`
/// visits the same ids).
pub(crate) fn load_key(i: usize) -> Result<Key, tollgate::KeyError> {
    Key::new("load", [format!("k{i}")])
}

fn progress_bar(total: u64, json: bool) -> Option<ProgressBar> {
    if json || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {pos}/{len} decisions [{elapsed_precise}] {per_sec} {msg}",
        )
        .expect("valid template"),
    );
    Some(bar)
}

fn print_human(s: &Summary) -> Result<()> {
    crate::outln!(
        "store       {} ({} instance(s) x {} task(s), {} key(s), cost {}; {} runtime thread(s))",
        s.store,
        s.instances,
        s.tasks_per_instance,
        s.keys,
        s.cost,
        s.runtime_threads
    )?;
    crate::outln!("policy      {}", s.policy)?;
    crate::outln!("elapsed     {:.3} s", s.elapsed_secs)?;
    crate::outln!(
        "requests    {} (allowed {}, denied {}, errors {})",
        s.requests,
        s.allowed,
        s.denied,
        s.errors
    )?;
    let e = &s.by_enforcement;
    crate::outln!(
        "enforcement shared {}, degraded {}, bypassed {}; unavailable {}, other errors {} (--fail-mode {})",
        e.shared,
        e.degraded,
        e.bypassed,
        e.unavailable,
        e.other_errors,
        s.fail_mode
    )?;
    if s.timeline
        .iter()
        .any(|t| t.degraded + t.bypassed + t.unavailable + t.other_errors > 0)
    {
        crate::outln!("timeline    (the store did not answer every call: per second)")?;
        crate::outln!("      from s     shared   degraded   bypassed unavailable     errors")?;
        for t in &s.timeline {
            crate::outln!(
                "    {:8.0} {:10} {:10} {:10} {:11} {:10}",
                t.from_secs,
                t.shared,
                t.degraded,
                t.bypassed,
                t.unavailable,
                t.other_errors
            )?;
        }
    }
    match (s.decisions_per_sec, &s.rate_withheld) {
        (Some(rate), _) => crate::outln!(
            "throughput  {rate:.0} decisions/s (answered only: {} error(s) not counted)",
            s.errors
        )?,
        (None, why) => crate::outln!(
            "throughput  withheld: {}; no rate over such a run measures the store",
            why.as_deref().unwrap_or("no rate")
        )?,
    }
    match &s.latency_us {
        Some(l) => crate::outln!(
            "latency     p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, max {:.1} us ({} call(s) the store decided; slowest call of any kind {:.1} us)",
            l.p50,
            l.p99,
            l.p999,
            l.max,
            l.calls,
            s.slowest_call_us
        )?,
        None => crate::outln!(
            "latency     none: the store decided no call (slowest call {:.1} us)",
            s.slowest_call_us
        )?,
    }
    crate::outln!(
        "admitted    {} cost units; one shared quota allows at most {} over the run{}",
        s.admitted_cost,
        s.quota_bound_per_store,
        if s.store == "local" && s.instances > 1 {
            format!(
                " (local store: each of the {} instances has its own quota, so up to {})",
                s.instances,
                s.quota_bound_per_store.saturating_mul(s.instances as u64)
            )
        } else {
            String::new()
        }
    )?;
    if let Some(e) = &s.first_error {
        crate::outln!("first error {e}")?;
    }
    for c in &s.redis_benchmark {
        crate::outln!(
            "ceiling     bare EVALSHA, same script -c {} -P {} -n {}: {:.0} req/s; tollgate/ceiling = {}",
            c.clients,
            c.pipeline,
            c.requests,
            c.requests_per_sec,
            c.tollgate_ratio
                .map_or_else(|| "withheld".to_owned(), |r| format!("{r:.2}"))
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Limits and costs go up to 2^52, so the summary's products exceed 64 bits: the quota
    /// bound of a 1 ms window over 5 s wrapped in release builds and panicked in debug ones
    /// (`attempt to multiply with overflow`). It saturates.
    #[test]
    fn the_quota_bound_saturates() {
        let big = 1_u64 << 52;
        let fw = Policy::fixed_window(big, Duration::from_millis(1)).unwrap();
        assert_eq!(bucket_bound(&fw, Duration::from_secs(5)), u64::MAX);
        assert_eq!(bucket_bound(&fw, Duration::from_millis(2)), 4 * big);
        let sl = Policy::sliding_log(1000, Duration::from_millis(1)).unwrap();
        assert_eq!(bucket_bound(&sl, Duration::from_millis(3)), 4000);
        assert_eq!(saturate(u128::from(big) * 5000), u64::MAX);
        // a refill of 2^52 per µs over a day: past 64 bits, not truncated to its low bits
        let tb = Policy::token_bucket(1, tollgate::Rate::new(1 << 40, Duration::from_micros(1)))
            .unwrap();
        assert_eq!(bucket_bound(&tb, Duration::from_secs(86_400)), u64::MAX);
    }
}
