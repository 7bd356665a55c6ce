//! Limiters that follow a policy published in a [`RedisRegistry`], so every instance of a
//! service converges on the newest publication. A [`PolicyFollower`] subscribes to the
//! registry's notifications and also polls, and switches its limiters when a newer generation
//! appears.
//!
//! # Convergence bound
//!
//! A follower switches within one round trip of a notification (the publication and the
//! notification are one atomic script). If the notification is lost — the subscription's
//! connection dropped, or the follower started mid-publication — the next poll finds it: a
//! follower switches at most `poll_interval + timeout` after a publication (the registry's
//! call deadline), however the notification fares, as long as Redis answers the poll. After
//! Redis restarts or a connection breaks under a call, the poll that meets the failure reports
//! it and the connection reconnects, so the bound holds again from the next poll (a
//! connection the server closes while idle is replaced before the next call, which then
//! succeeds: the registry speaks RESP3, see [`RedisRegistry`]). A
//! connection that falls silent (a path that died without a reset) is replaced after a call
//! times out, and each poll checks that the subscription answers a `PING`, resubscribing if
//! it does not: a silent subscription would never end, and its notices (resets among them)
//! would be lost for good. A subscription that ends (its connection closed; under Sentinel,
//! its server deposed) is made again after a back-off of its own, 100 ms doubling to 5 s while
//! new ones keep ending, whatever the poll interval, and the entry is read then.
//!
//! A registry that loses the followed generation (its server restarted empty, flushed, an
//! entry edited down) gets it back: a follower that reads nothing, or an older generation, than
//! the newest it took from the registry publishes that one again (logged), so an instance
//! started afterwards does not take an older policy and run it for good beside the others.
//!
//! During that window instances run different generations on the same buckets. That is safe:
//! a bucket written by a newer generation decides older callers under the newer parameters
//! (see `docs/policy-changes.md`), so the fleet enforces one policy per bucket from the first
//! write of the new generation.
//!
//! ```no_run
//! # async fn demo(limiter: tollgate::Limiter) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use tollgate::redis::RedisRegistry;
//! use tollgate::registry::PolicyFollower;
//!
//! let registry = RedisRegistry::connect("redis://127.0.0.1", "tollgate:", Duration::from_millis(250)).await?;
//! let follower = PolicyFollower::start(registry, "login", &[limiter.clone()], Duration::from_secs(5)).await?;
//! // ... `tollgate policy publish --redis redis://127.0.0.1 --name login \
//! //          --policy '...,generation=2,transition=carry'`
//! // switches `limiter` within a round trip (at most 5.25 s if the notification is lost).
//! # drop(follower); Ok(()) }
//! ```

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tollgate_core::Policy;
use tollgate_redis::{Notice, Published, RedisRegistry, RegistryError, Subscription};

use crate::Limiter;

/// Why [`PolicyFollower::reset`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResetError {
    /// The reset itself failed (an invalid key, or the store could not answer).
    #[error(transparent)]
    Limiter(#[from] crate::Error),
    /// The bucket was reset, but the announcement to the other instances failed: their deny
    /// caches keep a denial of the key until its cached deadline at the latest.
    #[error("bucket reset, but announcing it to the other instances failed: {0}")]
    Announce(#[source] RegistryError),
}

/// Default interval between two polls of the registry (the backstop for lost notifications).
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(5);

/// Keeps limiters on the newest policy published under one name. Stops when dropped.
#[derive(Debug)]
pub struct PolicyFollower {
    task: JoinHandle<()>,
    current: watch::Receiver<Policy>,
    bound: Duration,
    registry: RedisRegistry,
    name: String,
}

/// The first wait before subscribing again after a follower's subscription ended
/// ([`Follow::run`]), doubled at each attempt up to [`RESUBSCRIBE_MAX`].
const RESUBSCRIBE_FIRST: Duration = Duration::from_millis(100);
/// The longest wait before subscribing again.
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(5);

/// Whether `published` should replace `current`: a higher generation, or the same generation
/// with other contents (the registry is the source of truth for the name).
fn newer(published: &Policy, current: &Policy) -> bool {
    published.generation() > current.generation()
        || (published.generation() == current.generation() && published != current)
}

struct Follow {
    registry: RedisRegistry,
    name: String,
    limiters: Vec<Limiter>,
    tx: watch::Sender<Policy>,
    /// The newest publication read from the registry (the highest generation; of one
    /// generation, the last read): what [`Follow::refresh`] publishes again if the registry
    /// loses it.
    taken: Option<Policy>,
    /// The generation whose restoring failed and was warned about: later failures to restore
    /// it are logged at debug level until the registry holds it again (a follower whose user
    /// may not publish would otherwise warn at every poll and notification, for good).
    unrestored: Option<u64>,
    /// Runs in [`Follow::apply`] after a limiter's policy was found older than the
    /// publication and before the switch: where a concurrent switch races the follower.
    #[cfg(test)]
    between: Option<Between>,
}

/// A test's hook into [`Follow::apply`]: see [`Follow::between`].
#[cfg(test)]
type Between = Box<dyn Fn(&Limiter) + Send + Sync>;

impl Follow {
    /// Switches every limiter that `published` is newer for (each compared on its own: they
    /// need not all run the same policy when the follower starts, or be switched by hand
    /// later), and records it as the followed policy if it is newer. Whether any switched.
    fn apply(&self, published: Policy) -> bool {
        let mut switched = false;
        for l in &self.limiters {
            // One compare-and-set: a switch made between the comparison and this one's (by
            // the user, or another follower of the limiter) is compared again, so an older
            // publication never lands over a newer policy.
            let replace = |current: &Policy| {
                let replace = newer(&published, current);
                #[cfg(test)]
                if replace && let Some(between) = &self.between {
                    between(l);
                }
                replace
            };
            if l.set_policy_if(published, replace) {
                switched = true;
            }
        }
        if newer(&published, &self.tx.borrow()) {
            self.tx.send_replace(published);
            switched = true;
        }
        switched
    }

    /// Records `published`, read from the registry, and returns the publication the registry
    /// has lost, if any: the newest one read before, when the registry now holds nothing or
    /// an older generation (its server restarted empty or was flushed, or a hand edit).
    fn take(&mut self, published: Option<Policy>) -> Option<Policy> {
        match (published, self.taken) {
            (Some(p), Some(t)) if p.generation() < t.generation() => Some(t),
            (Some(p), _) => {
                self.taken = Some(p);
                None
            }
            (None, taken) => taken,
        }
    }

    /// Publishes `lost` again: the buckets the fleet wrote carry its generation and decide
    /// every older caller under it (the newest generation governs), so a registry without it
    /// would start new instances on an older policy that governs nothing they share, and keep
    /// the fleet on two policies for good. Whoever wins a race (another follower restoring it,
    /// a newer publication) is read at the next notification or poll.
    async fn restore(&mut self, lost: Policy) {
        match self.registry.publish(&self.name, &lost).await {
            Ok(published) => {
                self.unrestored = None;
                if published == Published::Stored {
                    tracing::warn!(
                        name = %self.name, policy = %lost,
                        "policy registry had lost the followed generation (restarted empty, flushed or edited); published it again"
                    );
                }
            }
            Err(error) if self.unrestored == Some(lost.generation()) => tracing::debug!(
                name = %self.name, policy = %lost, %error,
                "policy registry still lacks the followed generation; restoring it failed again"
            ),
            Err(error) => {
                self.unrestored = Some(lost.generation());
                tracing::warn!(
                    name = %self.name, policy = %lost, %error,
                    "policy registry had lost the followed generation; publishing it again failed (not warned again until it holds it)"
                );
            }
        }
    }

    async fn refresh(&mut self) {
        match self.registry.get(&self.name).await {
            Ok(published) => {
                let lost = self.take(published);
                if let Some(p) = published
                    && self.apply(p)
                {
                    tracing::info!(name = %self.name, policy = %p, "following a newly published policy");
                }
                match lost {
                    Some(lost) => self.restore(lost).await,
                    // The registry holds it (again): a later loss is warned about anew.
                    None => self.unrestored = None,
                }
            }
            Err(error) => {
                tracing::warn!(name = %self.name, %error, "policy registry poll failed; keeping the current policy");
            }
        }
    }

    async fn run(mut self, mut sub: Option<Subscription>, poll_interval: Duration) {
        let mut tick = tokio::time::interval(poll_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        // The wait before subscribing again after a subscription ended: its own, not the poll
        // interval (a follower relying on notifications, with an unbounded interval, would
        // never subscribe again), doubled at each attempt up to a bound, so that a server
        // closing every new subscription cannot make this loop spin; back to the least once a
        // subscription has carried a notice or answered a poll's check.
        let mut resubscribe = RESUBSCRIBE_FIRST;
        loop {
            if let Some(s) = &mut sub {
                let polled = tokio::select! {
                    notice = s.next_notice() => match notice {
                        Some(Notice::Published(name)) if name == self.name => {
                            resubscribe = RESUBSCRIBE_FIRST;
                            false
                        }
                        Some(Notice::Reset { name, key }) if name == self.name => {
                            for l in &self.limiters {
                                l.forget_reset_key(&key);
                            }
                            resubscribe = RESUBSCRIBE_FIRST;
                            continue;
                        }
                        Some(_) => continue,
                        None => {
                            tracing::warn!(name = %self.name, wait = ?resubscribe, "policy registry subscription lost; resubscribing");
                            sub = None;
                            continue;
                        }
                    },
                    _ = tick.tick() => true,
                };
                // A subscription whose path died silently never ends: each poll checks that
                // it still answers.
                if polled && let Some(s) = &mut sub {
                    if s.alive().await {
                        resubscribe = RESUBSCRIBE_FIRST;
                    } else {
                        tracing::warn!(name = %self.name, "policy registry subscription stalled; resubscribing");
                        // At once (a poll interval has passed): notices sent until it is back
                        // are lost (the poll still catches publications, not resets).
                        sub = self.registry.subscribe().await.ok();
                    }
                }
            } else {
                // Whichever comes first: the poll still polls meanwhile.
                tokio::select! {
                    _ = tick.tick() => {}
                    () = tokio::time::sleep(resubscribe) => {}
                }
                resubscribe = (resubscribe * 2).min(RESUBSCRIBE_MAX);
                sub = self.registry.subscribe().await.ok();
            }
            // After a poll, a notification, or a new subscription (publications made while
            // there was none are read now).
            self.refresh().await;
        }
    }
}

impl PolicyFollower {
    /// Starts following `name` in `registry` for `limiters`: subscribes, reads the entry once
    /// (switching at once every limiter it is newer for, each compared with its own policy),
    /// then does the same on every notification and poll. [`PolicyFollower::current`] starts
    /// as the publication or, if none is newer, the first limiter's policy. An unreachable registry at
    /// start is an error; later failures keep the current policy and are logged, and so does
    /// an entry this version cannot parse, at start too (with at least one limiter): in a
    /// rolling upgrade, a newer version's publication must not keep older instances from
    /// starting.
    pub async fn start(
        registry: RedisRegistry,
        name: impl Into<String>,
        limiters: &[Limiter],
        poll_interval: Duration,
    ) -> Result<Self, RegistryError> {
        let name = name.into();
        let sub = registry.subscribe().await?;
        let published = match registry.get(&name).await {
            // An entry this version cannot read (a newer version's algorithm, say, in a
            // rolling upgrade) must not keep an instance from starting: its limiters keep
            // their policies, as when a later poll meets it.
            Err(error @ RegistryError::Corrupt { .. }) if !limiters.is_empty() => {
                tracing::warn!(name = %name, %error, "policy registry entry unreadable; keeping the current policy");
                None
            }
            other => other?,
        };
        let initial = limiters
            .first()
            .map(Limiter::policy)
            .or(published)
            .ok_or_else(|| {
                RegistryError::BadName(format!("{name} (nothing published, no limiter)"))
            })?;
        let (tx, mut current) = watch::channel(initial);
        let bound = poll_interval.saturating_add(registry.timeout());
        let follow = Follow {
            registry: registry.clone(),
            name: name.clone(),
            limiters: limiters.to_vec(),
            tx,
            taken: published,
            unrestored: None,
            #[cfg(test)]
            between: None,
        };
        if let Some(p) = published {
            follow.apply(p);
        }
        // What start took is where `current` starts, not a change: the first `changed` waits
        // for the next one (the task that could make it is not spawned yet, so none is lost).
        current.mark_unchanged();
        Ok(Self {
            // An interval's period is added to instants: a "never" (`Duration::MAX`, relying on
            // notifications) is a poll every 10 years.
            task: tokio::spawn(follow.run(
                Some(sub),
                poll_interval.clamp(Duration::from_millis(1), tollgate_core::MAX_DURATION),
            )),
            current,
            bound,
            registry,
            name,
        })
    }

    /// Resets the bucket identified by `parts` through `limiter` ([`Limiter::reset`]: the
    /// store forgets it, and so do this process's deny cache and degraded local bucket), then
    /// announces the reset to every follower of this name, whose limiters forget what they hold
    /// of the key as well (a cached denial, a degraded local bucket): an opt-in deny cache
    /// elsewhere in the fleet would otherwise keep denying the key until its cached deadline,
    /// and a local bucket spent during an outage would deny it in the next. An announcement that fails (the registry unreachable) is an error after
    /// the reset itself succeeded: the other instances' caches then hold their denials until
    /// their deadlines at the latest; so are announcements a follower misses while its
    /// subscription is down (its poll recovers publications, not resets).
    pub async fn reset<I, P>(&self, limiter: &Limiter, parts: I) -> Result<(), ResetError>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        let key = limiter.key(parts)?;
        let reset = limiter.reset_key(&key).await;
        // Announced even when the reset failed: one that timed out may have run in Redis, and
        // an instance forgetting a cached denial early only asks Redis again.
        let announced = self.registry.announce_reset(&self.name, key.as_str()).await;
        reset?;
        announced.map_err(ResetError::Announce)?;
        Ok(())
    }

    /// The policy the limiters follow now.
    pub fn current(&self) -> Policy {
        *self.current.borrow()
    }

    /// Waits until the followed policy changes, and returns the new one. A change is measured
    /// from the policy [`PolicyFollower::current`] held when `start` returned (or from the one
    /// the previous `changed` returned): the publication `start` took is not reported again,
    /// and one that arrived before this call returns at once.
    pub async fn changed(&mut self) -> Policy {
        if self.current.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        *self.current.borrow_and_update()
    }

    /// The longest a publication takes to reach the limiters when its notification is lost:
    /// the poll interval plus the registry's call deadline.
    pub fn bound(&self) -> Duration {
        self.bound
    }
}

impl Drop for PolicyFollower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tollgate_local::LocalStore;
    use tollgate_testkit::server::RedisServer;

    use super::*;
    use crate::FailureMode;

    fn generation(g: u64) -> Policy {
        Policy::fixed_window(10, Duration::from_secs(3600))
            .unwrap()
            .with_generation(g)
    }

    fn limiter(policy: Policy) -> Limiter {
        Limiter::builder("api", policy)
            .store(Arc::new(LocalStore::new()))
            .failure_mode(FailureMode::Closed)
            .build()
            .unwrap()
    }

    /// A follower of `name` in the registry of `server` for `limiter`, not started: the tests
    /// call [`Follow::apply`] themselves.
    async fn follow(server: &RedisServer, limiter: &Limiter, between: Option<Between>) -> Follow {
        let registry = RedisRegistry::connect(&server.url(), "tollgate:", Duration::from_secs(2))
            .await
            .unwrap();
        Follow {
            registry,
            name: "api".to_owned(),
            limiters: vec![limiter.clone()],
            tx: watch::channel(limiter.policy()).0,
            taken: None,
            unrestored: None,
            between,
        }
    }

    /// Runs `switch` once, the first time the hook is reached.
    fn once(switch: impl Fn(&Limiter) + Send + Sync + 'static) -> Between {
        let done = AtomicBool::new(false);
        Box::new(move |l| {
            if !done.swap(true, Ordering::SeqCst) {
                switch(l);
            }
        })
    }

    /// A `Limiter::set_policy` of a newer generation lands between the follower's check of
    /// the limiter's policy and its switch: the follower must not put the older publication
    /// over it.
    #[tokio::test]
    async fn a_newer_policy_set_during_apply_is_not_overwritten() {
        let server = RedisServer::start();
        let l = limiter(generation(1));
        let f = follow(&server, &l, Some(once(|l| l.set_policy(generation(3))))).await;
        f.apply(generation(2));
        assert_eq!(
            l.policy().generation(),
            3,
            "the follower put generation 2 over the generation 3 set meanwhile"
        );
    }

    /// Two followers of one limiter (two registries, say): the second applies a newer
    /// publication while the first is between its check and its switch. The newest wins.
    #[tokio::test]
    async fn the_newest_of_two_racing_followers_wins() {
        let server = RedisServer::start();
        let l = limiter(generation(1));
        let second = follow(&server, &l, None).await;
        let first = follow(
            &server,
            &l,
            Some(once(move |_| {
                assert!(second.apply(generation(5)));
            })),
        )
        .await;
        first.apply(generation(4));
        assert_eq!(
            l.policy().generation(),
            5,
            "the older publication won the race"
        );
        // Either order ends on the newest: the older publication is now a no-op.
        assert!(!follow(&server, &l, None).await.apply(generation(4)));
        assert_eq!(l.policy().generation(), 5);
    }
}
