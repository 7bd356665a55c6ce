//! Log lines captured in memory, for tests that assert what a component logs (and how often).
//!
//! ```
//! let (logs, _guard) = tollgate_testkit::logs::capture();
//! tracing::warn!(target: "demo", route = "login", "decided without the shared store");
//! assert_eq!(logs.matching(&["WARN", "route=\"login\""]).len(), 1);
//! ```

use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::subscriber::DefaultGuard;

/// The text a `tracing` subscriber wrote, shared by clones (the subscriber's writer is one).
#[derive(Clone, Default, Debug)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Everything written so far.
    pub fn text(&self) -> String {
        let bytes = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The lines that contain every one of `parts`.
    pub fn matching(&self, parts: &[&str]) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .map(str::to_owned)
            .collect()
    }
}

/// A plain-text subscriber (no colours, `INFO` and above) writing into the returned
/// [`Captured`], set as this thread's default until the guard drops. Events from other threads
/// go to their own default subscriber, so a test drives the component on this thread (a
/// current-thread runtime).
pub fn capture() -> (Captured, DefaultGuard) {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    (captured, tracing::subscriber::set_default(subscriber))
}
