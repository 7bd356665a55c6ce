//! `tollgate load`: several independent limiter instances (each with its own store handle,
//! as separate service processes would have) × tasks, against one or many keys, bounded in
//! both time and count.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Args;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tollgate::{Algorithm, FailureMode, Key, Limiter, Policy};

use crate::StoreArgs;

/// Upper bound on requests when only `--duration` is given.
const DEFAULT_MAX_REQUESTS: u64 = 100_000_000;
/// Upper bound on time when only `--requests` is given.
const DEFAULT_MAX_DURATION: Duration = Duration::from_secs(300);

#[derive(Args, Debug)]
pub(crate) struct LoadArgs {
    /// The policy, e.g. `token-bucket:capacity=100,rate=50`.
    #[arg(long)]
    policy: Policy,
    /// Independent limiter instances, each with its own store handle.
    #[arg(long, default_value_t = 1)]
    instances: usize,
    /// Concurrent tasks per instance.
    #[arg(long, default_value_t = 1)]
    tasks: usize,
    /// Stop after this long (default 300 s if only --requests is given).
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// Stop after this many requests in total (default 100,000,000 if only --duration is given).
    #[arg(long)]
    requests: Option<u64>,
    /// Number of distinct keys, used round-robin.
    #[arg(long, default_value_t = 1)]
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
    /// Decide this many keys per call (`Limiter::check_many`: one round trip on Redis).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Measure a bare `PING` round trip instead of decisions, with the same connections,
    /// tasks and bounds: the baseline for decision latency.
    #[arg(long, requires = "redis", conflicts_with_all = ["batch", "deny_cache"])]
    ping: bool,
    /// After the run, run `redis-benchmark` with the same script, arguments, key shape and
    /// concurrency on the same server (pipeline 1 and 16) and report tollgate's ratio to it.
    #[arg(long, requires = "redis")]
    compare_redis_benchmark: bool,
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
}

impl Probe {
    /// Runs one iteration over `keys`; returns (allowed, denied) or the error text.
    async fn run(&mut self, keys: &[Key], cost: u64) -> Result<(u64, u64), String> {
        match self {
            Self::Check(limiter) if keys.len() == 1 => {
                let d = limiter
                    .check_key(&keys[0], cost)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(if d.allowed { (1, 0) } else { (0, 1) })
            }
            Self::Check(limiter) => {
                let ds = limiter
                    .check_many(keys, cost)
                    .await
                    .map_err(|e| e.to_string())?;
                let allowed = ds.iter().filter(|d| d.allowed).count() as u64;
                Ok((allowed, ds.len() as u64 - allowed))
            }
            Self::Ping(conn) => {
                let () = redis::cmd("PING")
                    .query_async(conn)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok((1, 0))
            }
        }
    }
}

#[derive(Default)]
struct Counters {
    issued: AtomicU64,
    allowed: AtomicU64,
    denied: AtomicU64,
    errors: AtomicU64,
}

/// The summary printed at the end of a run.
#[derive(Debug, Serialize)]
pub(crate) struct Summary {
    store: &'static str,
    policy: String,
    instances: usize,
    tasks_per_instance: usize,
    keys: usize,
    cost: u64,
    elapsed_secs: f64,
    requests: u64,
    allowed: u64,
    denied: u64,
    errors: u64,
    admitted_cost: u64,
    decisions_per_sec: f64,
    /// Keys decided per call (`--batch`); latency is per call.
    batch: usize,
    latency_us: Latency,
    /// Most cost one shared quota could admit over the run, summed over keys. With the local
    /// store every instance has its own quota, so the fleet may admit `instances` times this.
    quota_bound_per_store: u64,
    first_error: Option<String>,
    /// redis-benchmark on the same script and server, when asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    redis_benchmark: Vec<crate::compare::Ceiling>,
}

#[derive(Debug, Serialize)]
struct Latency {
    p50: f64,
    p99: f64,
    p999: f64,
    max: f64,
    mean: f64,
}

/// Most cost one bucket can admit over `elapsed` under `policy`.
fn bucket_bound(policy: &Policy, elapsed: Duration) -> u64 {
    let us = elapsed.as_micros();
    match policy.algorithm() {
        Algorithm::TokenBucket(tb) => {
            let refill = u128::from(tb.rate) * us / u128::from(tb.unit);
            tb.capacity.saturating_add(refill as u64)
        }
        Algorithm::FixedWindow(fw) => fw.limit * (us / u128::from(fw.window_micros) + 2) as u64,
        Algorithm::SlidingLog(sl) => sl.limit * (us / u128::from(sl.window_micros) + 1) as u64,
        _ => u64::MAX,
    }
}

#[allow(clippy::too_many_lines)] // one bounded run, read top to bottom
pub(crate) async fn run(args: LoadArgs) -> Result<()> {
    if args.instances == 0 || args.tasks == 0 || args.keys == 0 {
        bail!("--instances, --tasks and --keys must be at least 1");
    }
    if args.duration.is_none() && args.requests.is_none() {
        bail!("give --duration or --requests (or both): a load run is always bounded");
    }
    args.policy.check_cost(args.cost)?;
    let max_requests = args.requests.unwrap_or(DEFAULT_MAX_REQUESTS);
    let max_duration = args.duration.unwrap_or(DEFAULT_MAX_DURATION);

    let keys: Arc<Vec<Key>> = Arc::new(
        (0..args.keys)
            .map(|i| Key::new("load", [format!("k{i}")]))
            .collect::<Result<_, _>>()?,
    );
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let mut probes = Vec::with_capacity(args.instances);
    for _ in 0..args.instances {
        probes.push(if args.ping {
            let url = args.store.redis.as_deref().unwrap_or_default();
            Probe::Ping(
                redis::Client::open(url)?
                    .get_multiplexed_async_connection()
                    .await?,
            )
        } else {
            let mut b = Limiter::builder("load", args.policy)
                .store(args.store.connect().await?)
                .failure_mode(FailureMode::Closed)
                .timeout(args.store.timeout);
            if let Some(n) = args.deny_cache {
                b = b.deny_cache(n);
            }
            Probe::Check(b.build()?)
        });
    }

    let counters = Arc::new(Counters::default());
    let first_error = Arc::new(std::sync::Mutex::new(None::<String>));
    let progress = progress_bar(max_requests, args.json);
    let started = Instant::now();
    let deadline = started + max_duration;
    let batch = args.batch as u64;
    let mut handles = Vec::new();
    for probe in &probes {
        for _ in 0..args.tasks {
            let mut probe = probe.clone();
            let keys = keys.clone();
            let counters = counters.clone();
            let first_error = first_error.clone();
            let cost = args.cost;
            handles.push(tokio::spawn(async move {
                let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
                    .expect("histogram bounds");
                let mut picked = Vec::with_capacity(batch as usize);
                loop {
                    let n = counters.issued.fetch_add(batch, Ordering::Relaxed);
                    if n >= max_requests || Instant::now() >= deadline {
                        break;
                    }
                    picked.clear();
                    picked.extend(
                        (n..(n + batch).min(max_requests))
                            .map(|i| keys[(i % keys.len() as u64) as usize].clone()),
                    );
                    let t0 = Instant::now();
                    let result = probe.run(&picked, cost).await;
                    hist.saturating_record(t0.elapsed().as_nanos().max(1) as u64);
                    match result {
                        Ok((allowed, denied)) => {
                            counters.allowed.fetch_add(allowed, Ordering::Relaxed);
                            counters.denied.fetch_add(denied, Ordering::Relaxed);
                        }
                        Err(e) => {
                            first_error.lock().expect("poisoned").get_or_insert(e);
                            counters
                                .errors
                                .fetch_add(picked.len() as u64, Ordering::Relaxed);
                        }
                    }
                }
                hist
            }));
        }
    }
    let ticker = progress.clone().map(|bar| {
        let counters = counters.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let done = counters.allowed.load(Ordering::Relaxed)
                    + counters.denied.load(Ordering::Relaxed)
                    + counters.errors.load(Ordering::Relaxed);
                bar.set_position(done);
            }
        })
    });
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    for h in handles {
        hist.add(h.await?)?;
    }
    let elapsed = started.elapsed();
    if let Some(t) = ticker {
        t.abort();
    }
    if let Some(bar) = progress {
        bar.finish_and_clear();
    }

    let allowed = counters.allowed.load(Ordering::Relaxed);
    let denied = counters.denied.load(Ordering::Relaxed);
    let errors = counters.errors.load(Ordering::Relaxed);
    let requests = allowed + denied + errors;
    let summary = Summary {
        store: if args.ping {
            "redis-ping"
        } else {
            args.store.label()
        },
        policy: args.policy.to_string(),
        instances: args.instances,
        tasks_per_instance: args.tasks,
        keys: args.keys,
        cost: args.cost,
        elapsed_secs: elapsed.as_secs_f64(),
        requests,
        allowed,
        denied,
        errors,
        admitted_cost: allowed * args.cost,
        decisions_per_sec: requests as f64 / elapsed.as_secs_f64(),
        batch: args.batch,
        latency_us: Latency {
            p50: hist.value_at_quantile(0.5) as f64 / 1e3,
            p99: hist.value_at_quantile(0.99) as f64 / 1e3,
            p999: hist.value_at_quantile(0.999) as f64 / 1e3,
            max: hist.max() as f64 / 1e3,
            mean: hist.mean() / 1e3,
        },
        quota_bound_per_store: bucket_bound(&args.policy, elapsed).saturating_mul(args.keys as u64),
        first_error: first_error.lock().expect("poisoned").clone(),
        redis_benchmark: Vec::new(),
    };
    let mut summary = summary;
    if args.compare_redis_benchmark
        && let Some(url) = &args.store.redis
    {
        summary.redis_benchmark = crate::compare::run(
            url,
            &args.store.prefix,
            &args.policy,
            args.cost,
            args.keys,
            args.instances * args.tasks,
            requests.max(10_000),
            summary.decisions_per_sec,
        )
        .await?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_human(&summary);
    }
    Ok(())
}

fn progress_bar(total: u64, json: bool) -> Option<ProgressBar> {
    if json || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {pos}/{len} decisions [{elapsed_precise}] {per_sec}",
        )
        .expect("valid template"),
    );
    Some(bar)
}

fn print_human(s: &Summary) {
    println!(
        "store       {} ({} instance(s) x {} task(s), {} key(s), cost {})",
        s.store, s.instances, s.tasks_per_instance, s.keys, s.cost
    );
    println!("policy      {}", s.policy);
    println!("elapsed     {:.3} s", s.elapsed_secs);
    println!(
        "requests    {} (allowed {}, denied {}, errors {})",
        s.requests, s.allowed, s.denied, s.errors
    );
    println!("throughput  {:.0} decisions/s", s.decisions_per_sec);
    println!(
        "latency     p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, max {:.1} us",
        s.latency_us.p50, s.latency_us.p99, s.latency_us.p999, s.latency_us.max
    );
    println!(
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
    );
    if let Some(e) = &s.first_error {
        println!("first error {e}");
    }
    for c in &s.redis_benchmark {
        println!(
            "ceiling     redis-benchmark same script -c {} -P {}: {:.0} req/s; tollgate/ceiling = {:.2}",
            c.clients, c.pipeline, c.requests_per_sec, c.tollgate_ratio
        );
    }
}
