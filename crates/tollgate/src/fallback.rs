//! [`LocalFallback`]: a [`LocalStore`] on any [`Clock`], as the store of a degraded failure
//! mode. It lets a caller choose the local store's clock (a [`ManualClock`] in tests, to move
//! degraded enforcement's time by hand) without making [`FailureMode`] generic.
//!
//! [`ManualClock`]: tollgate_core::ManualClock
//! [`FailureMode`]: crate::FailureMode

use std::fmt;
use std::sync::Arc;

use tollgate_core::{Clock, Decision, Key, Policy, StoreError};
use tollgate_local::LocalStore;

/// A local store on any [`Clock`], shared by clones, standing in for the shared store under
/// [`FailureMode::Degraded`](crate::FailureMode::Degraded); built by
/// [`FailureMode::degraded`](crate::FailureMode::degraded) (the real monotonic clock),
/// [`FailureMode::degraded_with`](crate::FailureMode::degraded_with), [`LocalFallback::new`] or
/// `.into()` from an `Arc<LocalStore<C>>`.
///
/// ```
/// use std::sync::Arc;
/// use tollgate::{LocalFallback, LocalStore, ManualClock};
///
/// let clock = ManualClock::new(1_700_000_000_000_000);
/// let fallback = LocalFallback::new(Arc::new(LocalStore::with_clock(clock)));
/// # let _ = fallback;
/// ```
#[derive(Clone)]
pub struct LocalFallback(Arc<dyn DecideNow>);

impl LocalFallback {
    /// Wraps `local`; keep a clone of the `Arc` (or of its clock) to look at or move it.
    pub fn new<C: Clock>(local: Arc<LocalStore<C>>) -> Self {
        Self(local)
    }

    pub(crate) fn decider(&self) -> &dyn DecideNow {
        &*self.0
    }
}

impl<C: Clock> From<Arc<LocalStore<C>>> for LocalFallback {
    fn from(local: Arc<LocalStore<C>>) -> Self {
        Self::new(local)
    }
}

impl fmt::Debug for LocalFallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("LocalFallback")
            .field(&self.0.describe())
            .finish()
    }
}

/// The synchronous decisions a degraded failure mode makes on its local store.
pub(crate) trait DecideNow: Send + Sync {
    fn acquire_now(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError>;
    fn peek_now(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError>;
    /// Drops the bucket of the key encoded as `key` ([`Key::as_str`]).
    fn forget(&self, key: &str);
    fn describe(&self) -> String;
}

impl<C: Clock> DecideNow for LocalStore<C> {
    fn acquire_now(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        LocalStore::acquire_now(self, key, policy, cost)
    }

    fn peek_now(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        LocalStore::peek_now(self, key, policy, cost)
    }

    fn forget(&self, key: &str) {
        self.reset_now(key);
    }

    fn describe(&self) -> String {
        format!("{self:?}")
    }
}
