//! Chaos soak: four `Limiter` instances (two degraded to a local quota, one fail-open, one
//! fail-closed), each with its own connection, put load on one real redis-server while the
//! test kills, restarts and pauses it in cycles. Asserts:
//!
//! - no panic, and no call past its deadline (the limiter's timeout plus a slack);
//! - shared enforcement never over-admits: Redis runs on a frozen clock (so a fixed window never
//!   rolls over) with `appendfsync always` (so an acknowledged decision survives SIGKILL), and
//!   per key the `Shared` admissions of all instances together stay within the limit — and
//!   within what the server itself counted;
//! - degraded enforcement stays within its documented bound: each instance admits at most
//!   `limit / expected_instances` per key on its own (its local store runs on the real clock,
//!   so a run that crosses an hour boundary allows one more local window);
//! - memory stays flat: the process's resident set after the first cycle and at the end.
//!
//! `short_chaos_soak` runs 12 s in the default suite. `chaos_soak` is the long run:
//! `TOLLGATE_SOAK_SECS=300 cargo test -p tollgate --test chaos_soak -- --ignored --nocapture`.
//! `TOLLGATE_SOAK_SLACK_MS` sets the deadline slack (default 500 ms: calls within the deadline
//! take ~15 ms at p99 on an idle machine, but a CI runner busy with builds can stall a thread
//! for a few hundred ms; a call hanging on a reconnect would take seconds).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tollgate::{Enforcement, Error, FailureMode, Key, Limiter, LocalStore, Policy};
use tollgate_redis::RedisStore;
use tollgate_testkit::server::RedisServer;

/// Redis `TIME`, frozen in 2023 on a whole hour.
const T0: u64 = 1_699_999_200_000_000;
/// Admitted per key per (hour-long, never rolling) window.
const LIMIT: u64 = 100;
const INSTANCES: usize = 4;
const EXPECTED_INSTANCES: u32 = 4;
const WORKERS_PER_INSTANCE: usize = 3;
/// Distinct keys per phase; the key set changes every phase so that keys fill up and drain.
const KEYS_PER_PHASE: u64 = 16;
const PHASE: Duration = Duration::from_secs(1);
const TIMEOUT: Duration = Duration::from_millis(100);

/// What one instance saw for one key.
#[derive(Debug, Default, Clone, Copy)]
struct PerKey {
    shared: u64,
    degraded: u64,
}

/// Counts of one worker, merged at the end.
#[derive(Debug, Default)]
struct Stats {
    shared_allowed: u64,
    shared_denied: u64,
    degraded_allowed: u64,
    degraded_denied: u64,
    bypassed: u64,
    unavailable: u64,
    store_errors: u64,
    other_errors: u64,
    /// Latency histogram in whole milliseconds (last bucket: 2 s and more).
    latency_ms: Vec<u64>,
    max_latency: Duration,
    per_key: HashMap<(u64, u64), PerKey>,
}

impl Stats {
    fn new() -> Self {
        Self {
            latency_ms: vec![0; 2_001],
            ..Self::default()
        }
    }

    fn merge(&mut self, o: &Self) {
        self.shared_allowed += o.shared_allowed;
        self.shared_denied += o.shared_denied;
        self.degraded_allowed += o.degraded_allowed;
        self.degraded_denied += o.degraded_denied;
        self.bypassed += o.bypassed;
        self.unavailable += o.unavailable;
        self.store_errors += o.store_errors;
        self.other_errors += o.other_errors;
        for (a, b) in self.latency_ms.iter_mut().zip(&o.latency_ms) {
            *a += b;
        }
        self.max_latency = self.max_latency.max(o.max_latency);
    }

    fn calls(&self) -> u64 {
        self.latency_ms.iter().sum()
    }

    fn percentile_ms(&self, p: f64) -> usize {
        let target = (self.calls() as f64 * p).ceil() as u64;
        let mut seen = 0;
        for (ms, n) in self.latency_ms.iter().enumerate() {
            seen += n;
            if seen >= target {
                return ms;
            }
        }
        self.latency_ms.len()
    }
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The current hour-long window of the real clock.
fn unix_hour() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / 3600
}

fn key(phase: u64, index: u64) -> Key {
    Key::new("soak", [format!("p{phase}"), format!("k{index}")]).unwrap()
}

fn slack() -> Duration {
    let ms = std::env::var("TOLLGATE_SOAK_SLACK_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    Duration::from_millis(ms)
}

/// A thread that watches the process's own scheduling until `stop` (at most `bound`): it
/// sleeps [`TICK`] at a time and returns the most any sleep overran. A call that missed its
/// deadline by no more than that was held up by the machine (a CI runner starving the process
/// of CPU, as in a fresh-clone run beside other builds: every instance's slowest call 811–813
/// ms at once, against a 600 ms deadline), not by the limiter, whose own stall (a call hanging
/// on a reconnect) the watch does not share.
fn watch_scheduling(stop: Arc<AtomicBool>, bound: Duration) -> std::thread::JoinHandle<Duration> {
    const TICK: Duration = Duration::from_millis(2);
    std::thread::spawn(move || {
        let started = Instant::now();
        let mut worst = Duration::ZERO;
        // each pass sleeps at least TICK: the count bounds it as the time does
        for _ in 0..=bound.as_millis() / TICK.as_millis() {
            if stop.load(Ordering::Relaxed) || started.elapsed() > bound {
                break;
            }
            let before = Instant::now();
            std::thread::sleep(TICK);
            worst = worst.max(before.elapsed().saturating_sub(TICK));
        }
        worst
    })
}

async fn worker(limiter: Limiter, seed: u64, started: Instant, stop: Arc<AtomicBool>) -> Stats {
    let mut stats = Stats::new();
    let mut rng = seed | 1;
    while !stop.load(Ordering::Relaxed) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let phase = started.elapsed().as_millis() as u64 / PHASE.as_millis() as u64;
        let index = rng % KEYS_PER_PHASE;
        let k = key(phase, index);
        let t = Instant::now();
        let got = limiter.check_key(&k, 1).await;
        let latency = t.elapsed();
        stats.max_latency = stats.max_latency.max(latency);
        let bucket = (latency.as_millis() as usize).min(stats.latency_ms.len() - 1);
        stats.latency_ms[bucket] += 1;
        let entry = stats.per_key.entry((phase, index)).or_default();
        match got {
            Ok(d) => match (d.enforcement, d.allowed) {
                (Enforcement::Shared, true) => {
                    stats.shared_allowed += 1;
                    entry.shared += 1;
                }
                (Enforcement::Shared, false) => stats.shared_denied += 1,
                (Enforcement::Degraded, true) => {
                    stats.degraded_allowed += 1;
                    entry.degraded += 1;
                }
                (Enforcement::Degraded, false) => stats.degraded_denied += 1,
                (Enforcement::Bypassed, _) => stats.bypassed += 1,
                (other, _) => panic!("unknown enforcement {other:?}"),
            },
            Err(Error::Unavailable { .. }) => stats.unavailable += 1,
            Err(Error::Store(_)) => stats.store_errors += 1,
            Err(_) => stats.other_errors += 1,
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    stats
}

/// Fault events the controller caused.
#[derive(Debug, Default)]
struct Faults {
    kills: u32,
    pauses: u32,
    script_flushes: u32,
    down: Duration,
}

/// Kills, restarts, pauses and flushes the server's scripts in cycles until `until`; samples
/// the resident set after the first cycle.
fn chaos(server: &mut RedisServer, until: Instant, rss_after_first: &mut u64) -> Faults {
    let mut faults = Faults::default();
    let mut cycle = 0;
    let sleep_until = |deadline: Instant| {
        let now = Instant::now();
        if deadline > now {
            std::thread::sleep((deadline - now).min(Duration::from_millis(1_500)));
        }
    };
    while Instant::now() < until {
        sleep_until(Instant::now() + Duration::from_millis(1_500));
        if Instant::now() >= until {
            break;
        }
        let down = Instant::now();
        server.kill();
        faults.kills += 1;
        // Kept fixed: the outage's length is the fault injected (long enough for calls to
        // meet it and the breaker to open), not a wait for anything.
        std::thread::sleep(Duration::from_millis(700));
        server.restart();
        faults.down += down.elapsed();
        sleep_until(Instant::now() + Duration::from_millis(1_500));
        if Instant::now() >= until {
            break;
        }
        let paused = Instant::now();
        server.pause();
        faults.pauses += 1;
        // Kept fixed: the pause's length is the fault injected, as the kill's above.
        std::thread::sleep(Duration::from_millis(700));
        server.resume();
        faults.down += paused.elapsed();
        if cycle % 2 == 1 {
            server.script_flush();
            faults.script_flushes += 1;
        }
        cycle += 1;
        if cycle == 1 {
            *rss_after_first = rss_kib();
        }
    }
    faults
}

#[allow(clippy::too_many_lines)] // one run, its checks and its table, read top to bottom
fn soak(duration: Duration) {
    let mut server = RedisServer::builder()
        .clock_control(true)
        .extra_args(["--appendonly", "yes", "--appendfsync", "always"])
        .start();
    server.clock().freeze_at_micros(T0);
    let policy = Policy::fixed_window(LIMIT, Duration::from_secs(3600)).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let rss_start = rss_kib();
    let limiters: Vec<Limiter> = (0..INSTANCES)
        .map(|i| {
            let store = rt
                .block_on(
                    RedisStore::builder(server.url())
                        .timeout(TIMEOUT)
                        .connect_timeout(Duration::from_millis(500))
                        .build(),
                )
                .unwrap();
            let mode = match i {
                0 | 1 => FailureMode::Degraded {
                    local: Arc::new(LocalStore::new()).into(),
                    expected_instances: EXPECTED_INSTANCES,
                },
                2 => FailureMode::Open,
                _ => FailureMode::Closed,
            };
            Limiter::builder("soak", policy)
                .store(Arc::new(store))
                .failure_mode(mode)
                .timeout(TIMEOUT)
                .build()
                .unwrap()
        })
        .collect();

    let stop = Arc::new(AtomicBool::new(false));
    let scheduling = watch_scheduling(stop.clone(), duration + Duration::from_secs(60));
    let started = Instant::now();
    let hour_at_start = unix_hour();
    let mut tasks = Vec::new();
    for (i, limiter) in limiters.iter().enumerate() {
        for w in 0..WORKERS_PER_INSTANCE {
            let seed = 0x9E37_79B9_7F4A_7C15_u64.wrapping_mul((i * 16 + w + 1) as u64);
            tasks.push((
                i,
                rt.spawn(worker(limiter.clone(), seed, started, stop.clone())),
            ));
        }
    }
    let mut rss_after_first = 0;
    let faults = chaos(&mut server, started + duration, &mut rss_after_first);
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let unscheduled = scheduling.join().expect("the scheduling watch");

    let mut total = Stats::new();
    let mut per_instance: Vec<Stats> = (0..INSTANCES).map(|_| Stats::new()).collect();
    let mut instance_keys: Vec<HashMap<(u64, u64), PerKey>> = vec![HashMap::new(); INSTANCES];
    for (i, task) in tasks {
        let stats = rt.block_on(task).expect("a worker panicked");
        total.merge(&stats);
        per_instance[i].merge(&stats);
        for (k, v) in stats.per_key {
            let e = instance_keys[i].entry(k).or_default();
            e.shared += v.shared;
            e.degraded += v.degraded;
        }
    }
    let rss_end = rss_kib();

    // Shared: all instances together, and against the server's own count.
    let mut shared: HashMap<(u64, u64), u64> = HashMap::new();
    for keys in &instance_keys {
        for (k, v) in keys {
            *shared.entry(*k).or_default() += v.shared;
        }
    }
    let max_shared = shared.values().copied().max().unwrap_or(0);
    let check = rt
        .block_on(
            RedisStore::builder(server.url())
                .timeout(Duration::from_secs(5))
                .build(),
        )
        .unwrap();
    let mut server_checked = 0;
    let mut lost = Vec::new();
    for (&(phase, index), &admitted) in &shared {
        let d = rt
            .block_on(tollgate::Store::peek(
                &check,
                &key(phase, index),
                &policy,
                1,
            ))
            .unwrap();
        let counted = if d.allowed {
            LIMIT - 1 - d.remaining
        } else {
            LIMIT - d.remaining
        };
        server_checked += 1;
        if admitted > counted {
            lost.push((phase, index, admitted, counted));
        }
    }
    // Degraded: each instance on its own, per local window.
    let local_windows = 1 + unix_hour() - hour_at_start;
    let local_limit = LIMIT / u64::from(EXPECTED_INSTANCES) * local_windows;
    let max_degraded = instance_keys
        .iter()
        .flat_map(HashMap::values)
        .map(|v| v.degraded)
        .max()
        .unwrap_or(0);

    // The process's own longest unscheduled spell excuses as much of a call's overrun.
    let deadline = TIMEOUT + slack() + unscheduled;
    println!(
        "\nchaos soak: {elapsed:.1?}, {INSTANCES} instances x {WORKERS_PER_INSTANCE} workers, \
         fixed window {LIMIT}/h on a frozen clock, {KEYS_PER_PHASE} new keys every {PHASE:?}\n\
         faults: {} kills + restarts, {} pauses (SIGSTOP), {} SCRIPT FLUSH; server down or \
         paused {:.1?} in all\n\
         | instance (mode)   |  calls | shared ok | shared deny | degraded ok | degraded deny | bypassed | unavailable | store err | p50 ms | p99 ms | max |",
        faults.kills, faults.pauses, faults.script_flushes, faults.down
    );
    println!(
        "|-------------------|--------|-----------|-------------|-------------|---------------|----------|-------------|-----------|--------|--------|-----|"
    );
    let modes = ["degraded/4", "degraded/4", "open", "closed"];
    for (label, s) in per_instance
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("{i} ({})", modes[i]), s))
        .chain(std::iter::once(("all".to_owned(), &total)))
    {
        println!(
            "| {label:<17} | {:>6} | {:>9} | {:>11} | {:>11} | {:>13} | {:>8} | {:>11} | {:>9} | {:>6} | {:>6} | {:>3.0?} |",
            s.calls(),
            s.shared_allowed,
            s.shared_denied,
            s.degraded_allowed,
            s.degraded_denied,
            s.bypassed,
            s.unavailable,
            s.store_errors,
            s.percentile_ms(0.50),
            s.percentile_ms(0.99),
            s.max_latency,
        );
    }
    println!(
        "bounds: max shared admissions per key {max_shared} (limit {LIMIT}) over {} keys, {} \
         checked against the server's count; max degraded admissions per instance per key \
         {max_degraded} (limit/{EXPECTED_INSTANCES} x {local_windows} local window(s) = \
         {local_limit}); slowest call {:.1?} \
         (deadline {TIMEOUT:?} + slack {:?} + the process unscheduled at most {unscheduled:.1?})\n\
         memory: VmRSS {rss_start} KiB at start, {rss_after_first} KiB after the first cycle, \
         {rss_end} KiB at the end",
        shared.len(),
        server_checked,
        total.max_latency,
        slack(),
    );

    assert_eq!(total.other_errors, 0, "invalid-input or other errors");
    assert_eq!(
        total.store_errors, 0,
        "loud store errors: NOSCRIPT or a reply was mishandled"
    );
    assert!(
        total.max_latency <= deadline,
        "a call took {:?}, past its deadline {deadline:?}",
        total.max_latency
    );
    assert!(
        max_shared <= LIMIT,
        "shared enforcement over-admitted: {max_shared} > {LIMIT}"
    );
    assert!(
        lost.is_empty(),
        "the server counted fewer admissions than the instances were told: {lost:?}"
    );
    assert!(
        max_degraded <= local_limit,
        "degraded enforcement over-admitted: {max_degraded} > {local_limit}"
    );
    assert!(total.shared_allowed > 0, "Redis never answered");
    assert!(faults.kills > 0 && faults.pauses > 0);
    if rss_after_first > 0 {
        let growth = rss_end.saturating_sub(rss_after_first);
        assert!(
            growth < 32 * 1024,
            "resident set grew by {growth} KiB after the first cycle"
        );
    }
    drop(limiters);
}

#[test]
fn short_chaos_soak() {
    soak(Duration::from_secs(12));
}

#[test]
#[ignore = "long soak: TOLLGATE_SOAK_SECS=300 cargo test -p tollgate --test chaos_soak -- --ignored --nocapture"]
fn chaos_soak() {
    let secs = std::env::var("TOLLGATE_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    soak(Duration::from_secs(secs));
}
