//! `tollgate load --redis URL --compare-redis-benchmark`: runs `redis-benchmark` with the very
//! script, arguments and key shape tollgate used, on the same server, right after tollgate's own
//! run, and reports tollgate's decisions/s as a ratio of that ceiling. On a shared, noisy
//! machine only ratios measured in one run mean anything.

use std::process::Command;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use tollgate::Policy;
use tollgate::redis::{RedisStore, scripts};

/// One `redis-benchmark` measurement.
#[derive(Debug, Serialize)]
pub(crate) struct Ceiling {
    /// Concurrent clients (`-c`).
    pub clients: usize,
    /// Commands pipelined per client (`-P`).
    pub pipeline: usize,
    /// Requests sent (`-n`).
    pub requests: u64,
    /// What redis-benchmark reported.
    pub requests_per_sec: f64,
    /// tollgate's decisions/s divided by this ceiling.
    pub tollgate_ratio: f64,
}

struct Endpoint {
    host: String,
    port: u16,
    user: Option<String>,
    password: Option<String>,
}

fn endpoint(url: &str) -> Result<Endpoint> {
    let rest = url.strip_prefix("redis://").context(
        "--compare-redis-benchmark needs a redis:// URL (redis-benchmark here has no TLS)",
    )?;
    let rest = rest.split('/').next().unwrap_or(rest);
    let (auth, hostport) = match rest.rsplit_once('@') {
        Some((a, h)) => (Some(a), h),
        None => (None, rest),
    };
    let (user, password) = match auth.map(|a| a.split_once(':').unwrap_or(("", a))) {
        Some((u, p)) => (
            (!u.is_empty()).then(|| u.to_owned()),
            (!p.is_empty()).then(|| p.to_owned()),
        ),
        None => (None, None),
    };
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (h.to_owned(), p.parse().context("port")?),
        None => (hostport.to_owned(), 6379),
    };
    Ok(Endpoint {
        host,
        port,
        user,
        password,
    })
}

/// Runs redis-benchmark on the script tollgate used for `policy`, with `clients` connections,
/// `requests` requests over `keys` random keys, for each pipeline depth.
#[allow(clippy::too_many_arguments)] // one call site, every value named there
pub(crate) async fn run(
    url: &str,
    prefix: &str,
    policy: &Policy,
    cost: u64,
    keys: usize,
    clients: usize,
    requests: u64,
    tollgate_rate: f64,
) -> Result<Vec<Ceiling>> {
    let ep = endpoint(url)?;
    // The script must be in the server's cache for EVALSHA.
    RedisStore::builder(url)
        .build()
        .await?
        .load_scripts()
        .await?;
    let script = scripts::for_policy(policy);
    let key = format!("{prefix}{{load:k__rand_int__}}:{}", script.key_suffix());
    let mut out = Vec::new();
    for pipeline in [1usize, 16] {
        let mut cmd = Command::new("redis-benchmark");
        cmd.args(["-h", &ep.host, "-p", &ep.port.to_string()]);
        if let Some(u) = &ep.user {
            cmd.args(["--user", u]);
        }
        if let Some(p) = &ep.password {
            cmd.args(["-a", p]);
        }
        cmd.args(["-c", &clients.to_string(), "-n", &requests.to_string()])
            .args([
                "-P",
                &pipeline.to_string(),
                "-r",
                &keys.max(1).to_string(),
                "--csv",
            ])
            .args(["EVALSHA", script.sha(), "1", &key]);
        for a in scripts::args(policy, cost, true).as_slice() {
            cmd.arg(a.to_string());
        }
        let output = cmd
            .output()
            .context("running redis-benchmark (apt-get install redis-tools)")?;
        if !output.status.success() {
            bail!(
                "redis-benchmark failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let text = String::from_utf8_lossy(&output.stdout);
        let rps = parse_csv_rps(&text)
            .with_context(|| format!("unexpected redis-benchmark output: {text}"))?;
        out.push(Ceiling {
            clients,
            pipeline,
            requests,
            requests_per_sec: rps,
            tollgate_ratio: tollgate_rate / rps,
        });
    }
    Ok(out)
}

/// The requests/s of the last data line of `redis-benchmark --csv`.
fn parse_csv_rps(text: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with("\"test\""))
        .filter_map(|l| l.split(',').nth(1))
        .filter_map(|f| f.trim_matches('"').parse::<f64>().ok())
        .next_back()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints_and_csv() {
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
        let csv = "\"test\",\"rps\",\"avg_latency_ms\"\n\"EVALSHA x\",\"41234.50\",\"1.2\"\n";
        assert_eq!(parse_csv_rps(csv), Some(41234.5));
    }
}
