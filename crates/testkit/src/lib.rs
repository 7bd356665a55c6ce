//! Test support for tollgate: real `redis-server` processes on free loopback ports (with a
//! clock the test moves), and the conformance suite that every `Store` must pass.
//!
//! Nothing here mocks Redis: every backend test talks to a real server.

pub mod clock;
pub mod conformance;
pub mod server;
