//! Loopback ports for the servers tests start: never one this process handed out before, and
//! taken below the kernel's ephemeral range when there is room.
//!
//! A test that kills a server (a Cluster primary, a Sentinel primary) leaves clients whose
//! maps still name its address. Were that port handed to a server another test starts meanwhile
//! — or given by the kernel to anything bound to port 0 — those clients would reach a stranger
//! that may well answer: a Cluster node of another test that owns the same slot accepted a
//! killed primary's writes, and `cluster_failover::a_promoted_replica_is_followed` saw its
//! buckets start afresh (1 run in ~8 while other tests ran). So a port is handed out once per
//! process, and from below `ip_local_port_range`, where the kernel never picks one itself —
//! low enough that a Cluster node's bus port (its port + 10,000) is below it too.
//!
//! ```
//! let a = tollgate_testkit::ports::fresh_port();
//! let b = tollgate_testkit::ports::fresh_port();
//! assert_ne!(a, b);
//! ```

use std::collections::HashSet;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;
use std::sync::Mutex;

/// The lowest port handed out (below it: well-known and registered services).
const LOWEST: u16 = 12_000;
/// Highest port handed out when the kernel's ephemeral range cannot be read, or starts too
/// low to leave room: a Cluster node's bus port is its port + 10,000, so at most 55,535.
const HIGHEST: u16 = 55_535;
/// Draws before giving up on the range below the ephemeral ports.
const DRAWS: u32 = 1_000;

/// Every port [`fresh_port`] returned in this process.
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A loopback port free when asked (bound and released), never returned before by this
/// process: from [12,000, the kernel's lowest ephemeral port − 10,000) when that holds at
/// least 1,000 ports (Debian's range starts at 32,768: 10,768 ports), else from the kernel's
/// own choice (`bind` to port 0).
///
/// Another process may still take it before it is used; servers that lose such a race start
/// again on a fresh port.
///
/// # Panics
/// If no loopback port can be bound.
pub fn fresh_port() -> u16 {
    let mut handed = HANDED_OUT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let handed = handed.get_or_insert_with(HashSet::new);
    let below = ephemeral_low()
        .and_then(|low| low.checked_sub(10_000))
        .map(|high| high.min(HIGHEST))
        .filter(|&high| high >= LOWEST + 1_000);
    if let Some(high) = below {
        let span = u64::from(high - LOWEST);
        for _ in 0..DRAWS {
            let port = LOWEST + (random() % span) as u16;
            if !handed.contains(&port) && is_free(port) {
                handed.insert(port);
                return port;
            }
        }
    }
    loop {
        let port = TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        if port <= HIGHEST && handed.insert(port) {
            return port;
        }
    }
}

fn is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// The low end of the kernel's ephemeral port range, on Linux.
fn ephemeral_low() -> Option<u16> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

fn random() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_port_is_handed_out_twice_and_none_is_one_the_kernel_would_pick() {
        let ports: Vec<u16> = (0..2_000).map(|_| fresh_port()).collect();
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
        if let Some(low) = ephemeral_low().filter(|&low| low >= LOWEST + 11_000) {
            // a server's port and its Cluster bus port both below the ephemeral range
            assert!(
                ports.iter().all(|&p| p >= LOWEST && p + 10_000 < low),
                "a port in or near the kernel's ephemeral range (from {low})"
            );
        }
    }
}
