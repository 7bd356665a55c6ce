//! Which Redis a command uses: one server (`--redis`), the primary a set of sentinels names
//! (`--sentinel … --master`), or a Cluster (`--cluster`). One set of flags for the store of
//! `check`, `load` and `serve` and for the registry of `policy`.

use anyhow::{Context, Result, bail};
use clap::Args;
use tollgate::redis::{RedisStore, RedisStoreBuilder, redact_url};

/// The environment variable that holds the Sentinel primary's password: not a flag, since a
/// command line is visible to every user of the machine (`ps`).
pub(crate) const PRIMARY_PASSWORD_ENV: &str = "TOLLGATE_PRIMARY_PASSWORD";

/// Where Redis is. At most one of `--redis`, `--sentinel` and `--cluster`.
///
/// Clap waives an argument's `requires` when an argument it conflicts with is present, so the
/// flags of one kind name the other kinds in `conflicts_with_all` rather than rely on
/// `requires` alone.
#[derive(Args, Debug, Clone)]
#[command(group = clap::ArgGroup::new("redis_target").multiple(true).args(["redis", "sentinel", "cluster"]))]
pub(crate) struct RedisTarget {
    /// Use the Redis server at this URL (redis://host:port, redis://user:pass@host:port/db; no
    /// rediss://, this binary is built without TLS). Without --redis, --sentinel or --cluster,
    /// `check`, `load` and `serve` use the embedded local store.
    #[arg(long, value_name = "URL", conflicts_with_all = ["sentinel", "cluster"])]
    pub(crate) redis: Option<String>,
    /// Use the primary that these sentinels name for --master, following its failovers
    /// (redis://host:26379, the sentinels' own password in their URLs; repeat the flag or
    /// separate the URLs with commas). The primary's credentials: --primary-user, and the
    /// password in the environment variable TOLLGATE_PRIMARY_PASSWORD.
    #[arg(
        long,
        value_name = "URL",
        value_delimiter = ',',
        requires = "master",
        conflicts_with = "cluster"
    )]
    sentinel: Vec<String>,
    /// The name of the master the sentinels monitor (with --sentinel).
    #[arg(long, value_name = "NAME", requires = "sentinel", conflicts_with_all = ["redis", "cluster"])]
    master: Option<String>,
    /// The ACL user to authenticate to the primary as, with the password in
    /// TOLLGATE_PRIMARY_PASSWORD (with --sentinel; without it, that password alone, as
    /// `requirepass` asks).
    #[arg(long, value_name = "USER", requires = "sentinel", conflicts_with_all = ["redis", "cluster"])]
    primary_user: Option<String>,
    /// The primary's database (with --sentinel; default 0).
    #[arg(long, value_name = "DB", requires = "sentinel", conflicts_with_all = ["redis", "cluster"], value_parser = clap::value_parser!(i64).range(0..))]
    primary_db: Option<i64>,
    /// Use the Redis Cluster reached through these nodes (redis://host:port, credentials in the
    /// URLs; repeat the flag or separate the URLs with commas).
    #[arg(long, value_name = "URL", value_delimiter = ',')]
    cluster: Vec<String>,
}

impl RedisTarget {
    /// A store builder for the Redis named, `None` when none is. Every URL is checked here
    /// (a URL that can never work is an error now, not an outage later), and the primary's
    /// password is read from [`PRIMARY_PASSWORD_ENV`].
    pub(crate) fn builder(&self) -> Result<Option<RedisStoreBuilder>> {
        let check = |urls: &[String]| -> Result<()> {
            for url in urls {
                redis::Client::open(url.as_str())
                    .with_context(|| format!("invalid Redis URL {}", redact_url(url)))?;
            }
            Ok(())
        };
        if let Some(url) = &self.redis {
            check(std::slice::from_ref(url))?;
            return Ok(Some(RedisStore::builder(url.clone())));
        }
        if !self.sentinel.is_empty() {
            check(&self.sentinel)?;
            // clap's `requires` makes --master present with --sentinel
            let master = self.master.clone().context("--sentinel needs --master")?;
            let mut builder = RedisStore::sentinel(master, self.sentinel.iter().cloned());
            // set but empty is no password (`AUTH ""` could only fail)
            let password = std::env::var(PRIMARY_PASSWORD_ENV)
                .ok()
                .filter(|p| !p.is_empty());
            builder = match (&self.primary_user, password) {
                (Some(user), Some(password)) => builder.primary_credentials(user.clone(), password),
                (Some(_), None) => {
                    bail!("--primary-user needs the primary's password in {PRIMARY_PASSWORD_ENV}")
                }
                (None, Some(password)) => builder.primary_password(password),
                (None, None) => builder,
            };
            if let Some(db) = self.primary_db {
                builder = builder.primary_db(db);
            }
            return Ok(Some(builder));
        }
        if !self.cluster.is_empty() {
            check(&self.cluster)?;
            return Ok(Some(RedisStore::cluster(self.cluster.iter().cloned())));
        }
        Ok(None)
    }

    /// The Redis named, for messages: URLs with their passwords hidden.
    pub(crate) fn describe(&self) -> String {
        let urls = |urls: &[String]| {
            urls.iter()
                .map(|u| redact_url(u))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if let Some(url) = &self.redis {
            redact_url(url)
        } else if !self.sentinel.is_empty() {
            format!(
                "the primary of {:?} named by sentinels {}",
                self.master.as_deref().unwrap_or_default(),
                urls(&self.sentinel)
            )
        } else if !self.cluster.is_empty() {
            format!("the Cluster of {}", urls(&self.cluster))
        } else {
            "the embedded local store".to_owned()
        }
    }

    /// The store's label in outputs: `local`, `redis`, `sentinel` or `cluster`.
    pub(crate) fn label(&self) -> &'static str {
        if self.redis.is_some() {
            "redis"
        } else if !self.sentinel.is_empty() {
            "sentinel"
        } else if !self.cluster.is_empty() {
            "cluster"
        } else {
            "local"
        }
    }
}
