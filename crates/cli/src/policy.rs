//! `tollgate policy publish|show`: the policy registry in Redis. Limiters that follow a name
//! (`tollgate::registry::PolicyFollower`) switch to each newer publication.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use tollgate::Policy;
use tollgate::redis::{Published, RedisRegistry};

use crate::target::RedisTarget;

/// The registry commands.
#[derive(Args, Debug)]
pub(crate) struct PolicyArgs {
    #[command(subcommand)]
    command: PolicyCommand,
}

#[derive(Subcommand, Debug)]
enum PolicyCommand {
    /// Publish a policy under a name (atomic; refused if a higher generation is published, or
    /// if this generation already holds another policy).
    Publish(PublishArgs),
    /// Show one published policy, or all of them, as JSON.
    Show(ShowArgs),
}

/// Where the registry lives: one of --redis, --sentinel and --cluster is required.
#[derive(Args, Debug)]
#[command(group = clap::ArgGroup::new("registry_target").required(true).args(["redis", "sentinel", "cluster"]))]
struct RegistryArgs {
    #[command(flatten)]
    target: RedisTarget,
    /// Key prefix in Redis (the stores' prefix).
    #[arg(long, default_value = "tollgate:")]
    prefix: String,
    /// Deadline of each call, above zero.
    #[arg(long, default_value = "2s", value_parser = crate::deadline)]
    timeout: Duration,
}

impl RegistryArgs {
    /// The registry on the Redis named: a single server's, or the one
    /// [`build_registry`](tollgate::redis::RedisStoreBuilder::build_registry) gives on the
    /// primary the sentinels name or on a Cluster.
    async fn connect(&self) -> Result<RedisRegistry> {
        let builder = self
            .target
            .builder()?
            .context("give the registry's Redis: --redis, --sentinel with --master, or --cluster")?
            .prefix(self.prefix.clone())
            .timeout(self.timeout);
        builder
            .build_registry()
            .await
            .with_context(|| format!("connecting to the registry on {}", self.target.describe()))
    }
}

#[derive(Args, Debug)]
struct PublishArgs {
    /// The policy's name (what limiters follow): 1-64 characters of [a-z0-9_.-].
    #[arg(long)]
    name: String,
    /// The policy with its generation and transition rule, e.g.
    /// `token-bucket:capacity=20,rate=5,generation=2,transition=carry` (a generation above 0
    /// must name its rule: reset, carry, proportional or defer-until-expiry).
    #[arg(long)]
    policy: Policy,
    #[command(flatten)]
    registry: RegistryArgs,
}

#[derive(Args, Debug)]
struct ShowArgs {
    /// Show only this name.
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    registry: RegistryArgs,
}

fn entry(name: &str, p: &Policy) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "generation": p.generation(),
        "transition": p.transition().as_str(),
        "algorithm": p.algorithm().name(),
        "limit": p.limit(),
        "spec": p.to_spec(),
    })
}

pub(crate) async fn run(args: PolicyArgs) -> Result<()> {
    match args.command {
        PolicyCommand::Publish(a) => {
            let registry = a.registry.connect().await?;
            let outcome = registry
                .publish(&a.name, &a.policy)
                .await
                .with_context(|| format!("publishing {}", a.name))?;
            let mut out = entry(&a.name, &a.policy);
            out["published"] = (outcome == Published::Stored).into();
            crate::outln!("{}", serde_json::to_string_pretty(&out)?)?;
        }
        PolicyCommand::Show(a) => {
            let registry = a.registry.connect().await?;
            let out: Vec<_> = match &a.name {
                Some(name) => registry
                    .get(name)
                    .await?
                    .map(|p| vec![entry(name, &p)])
                    .with_context(|| format!("no policy is published under {name:?}"))?,
                // every entry; one this version cannot read is shown with why, not hiding the
                // others (a rolling upgrade's newer algorithm)
                None => registry
                    .list()
                    .await?
                    .into_iter()
                    .map(|(n, p)| match p {
                        Ok(p) => entry(&n, &p),
                        Err(e) => serde_json::json!({ "name": n, "error": e.to_string() }),
                    })
                    .collect(),
            };
            crate::outln!("{}", serde_json::to_string_pretty(&out)?)?;
        }
    }
    Ok(())
}
