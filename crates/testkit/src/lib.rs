//! Test support for tollgate: real `redis-server` processes on free loopback ports (with a
//! clock the test moves), Sentinel and Cluster topologies, a fault proxy, and the conformance
//! suite that every `Store` must pass.
//!
//! Nothing here mocks Redis: every backend test talks to a real server.

pub mod alloc;
pub mod busy;
pub mod clock;
pub mod cluster;
pub mod conformance;
pub mod logs;
pub mod ports;
pub mod proxy;
pub mod sentinel;
pub mod server;
pub mod tls;
pub mod wait;
