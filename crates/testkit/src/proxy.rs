//! A TCP fault proxy on loopback: put it between a client and a redis-server, then add latency,
//! cut connections, refuse new ones, or swallow traffic while the test runs.
//!
//! The proxy runs on its own background thread with a current-thread tokio runtime, so its
//! control methods are plain blocking calls usable from sync tests and from async tests alike
//! (they block the caller for at most a few milliseconds and never need the caller's runtime).
//! Dropping the proxy stops the thread and closes every connection.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// How long a control call waits for the proxy thread to acknowledge.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes read per chunk.
const CHUNK: usize = 16 * 1024;
/// Chunks in flight per direction (read but not yet delivered, e.g. while delayed).
const IN_FLIGHT: usize = 64;

/// Counters since the proxy started; see [`FaultProxy::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Client connections accepted.
    pub accepted: u64,
    /// Client connections open now.
    pub active: u64,
    /// Bytes delivered from clients to the target.
    pub bytes_to_target: u64,
    /// Bytes delivered from the target to clients.
    pub bytes_from_target: u64,
}

/// A TCP proxy on `127.0.0.1:<free port>` forwarding to one target, with faults the test
/// switches at run time. Every fault is off at start.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate_testkit::proxy::FaultProxy;
/// use tollgate_testkit::server::RedisServer;
///
/// let server = RedisServer::start();
/// let proxy = FaultProxy::start(server.port());
/// let client = redis::Client::open(proxy.url()).unwrap(); // goes through the proxy
/// proxy.set_latency(Duration::from_millis(50)); // each direction: +50 ms per round trip leg
/// proxy.cut_all(); // open connections see EOF
/// proxy.set_refuse(true); // new connections get ECONNREFUSED
/// ```
pub struct FaultProxy {
    addr: SocketAddr,
    target: SocketAddr,
    shared: Arc<Shared>,
    control: Option<mpsc::UnboundedSender<Control>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("target", &self.target)
            .field("latency", &self.latency())
            .field("blackhole", &*self.shared.blackhole.borrow())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// State read by the connection tasks.
struct Shared {
    latency_nanos: AtomicU64,
    blackhole: watch::Sender<bool>,
    /// Connections numbered below this (in order of acceptance, from 0) are stalled for good.
    stalled_below: AtomicU64,
    accepted: AtomicU64,
    active: AtomicU64,
    bytes_to_target: AtomicU64,
    bytes_from_target: AtomicU64,
}

/// Requests to the accept loop; each carries an acknowledgement sent once it took effect.
enum Control {
    CutAll(std_mpsc::Sender<()>),
    Refuse(bool, std_mpsc::Sender<()>),
}

impl FaultProxy {
    /// Starts a proxy to `127.0.0.1:target_port`.
    ///
    /// # Panics
    /// If the proxy thread cannot start or bind a loopback port.
    pub fn start(target_port: u16) -> Self {
        Self::start_to(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::LOCALHOST,
            target_port,
        )))
    }

    /// Starts a proxy to `target`, which must be a loopback address.
    ///
    /// # Panics
    /// If `target` is not loopback, or the proxy thread cannot start or bind a port.
    pub fn start_to(target: SocketAddr) -> Self {
        assert!(
            target.ip().is_loopback(),
            "the fault proxy forwards to loopback only, not {target}"
        );
        let (blackhole, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            latency_nanos: AtomicU64::new(0),
            blackhole,
            stalled_below: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            active: AtomicU64::new(0),
            bytes_to_target: AtomicU64::new(0),
            bytes_from_target: AtomicU64::new(0),
        });
        let (control, control_rx) = mpsc::unbounded_channel();
        let (bound_tx, bound_rx) = std_mpsc::channel();
        let thread_shared = Arc::clone(&shared);
        let thread = thread::Builder::new()
            .name(format!("fault-proxy-{target}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("failed to build the proxy runtime");
                runtime.block_on(async move {
                    let listener = match bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))) {
                        Ok(listener) => listener,
                        Err(err) => {
                            let _ = bound_tx.send(Err(err));
                            return;
                        }
                    };
                    let addr = listener
                        .local_addr()
                        .expect("a bound listener has an address");
                    let _ = bound_tx.send(Ok(addr));
                    accept_loop(listener, addr, target, thread_shared, control_rx).await;
                });
            })
            .expect("failed to spawn the proxy thread");
        let addr = bound_rx
            .recv_timeout(CONTROL_TIMEOUT)
            .expect("the proxy thread did not report its port")
            .unwrap_or_else(|err| panic!("the proxy could not bind a loopback port: {err}"));
        Self {
            addr,
            target,
            shared,
            control: Some(control),
            thread: Some(thread),
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The proxy's port (stable for its lifetime, across [`set_refuse`](Self::set_refuse)).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `redis://127.0.0.1:PORT` of the proxy.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// The address traffic is forwarded to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// Delays every chunk, in each direction, by `latency` from when the proxy read it (so a
    /// request/response round trip gains about twice `latency`). Chunks stay in order and
    /// are pipelined, not serialised. Applies at once to open connections; zero turns it off.
    pub fn set_latency(&self, latency: Duration) {
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.shared.latency_nanos.store(nanos, Ordering::SeqCst);
    }

    /// The latency set by [`set_latency`](Self::set_latency).
    pub fn latency(&self) -> Duration {
        Duration::from_nanos(self.shared.latency_nanos.load(Ordering::SeqCst))
    }

    /// Closes every open connection, both the client side and the target side (clients see
    /// EOF or a reset). New connections are accepted as before. Returns once they are closed.
    pub fn cut_all(&self) {
        self.request(Control::CutAll);
    }

    /// `true`: closes the listening socket, so new connections fail with `ECONNREFUSED`, as if
    /// the server were down (open connections are untouched; add [`cut_all`](Self::cut_all)
    /// for a full outage). `false`: listens again on the same port. Returns once in effect.
    pub fn set_refuse(&self, refuse: bool) {
        self.request(|ack| Control::Refuse(refuse, ack));
    }

    /// `true`: traffic stops in both directions without any error: new connections are
    /// accepted but not connected onwards, and data already sent is held (not dropped). Looks
    /// like a hung server or a network partition; clients only notice through their timeouts.
    /// `false`: everything held is delivered and traffic flows again.
    pub fn blackhole(&self, enabled: bool) {
        self.shared.blackhole.send_replace(enabled);
    }

    /// Traffic on every connection open now stops for good, silently: what either side sends
    /// is held, never delivered, and neither side sees an error or EOF — a path that died
    /// without a reset, as when a NAT or firewall between client and server drops its state.
    /// Connections made afterwards pass as usual, so a client recovers only by reconnecting.
    pub fn stall_open(&self) {
        let accepted = self.shared.accepted.load(Ordering::SeqCst);
        self.shared.stalled_below.store(accepted, Ordering::SeqCst);
    }

    /// Connection and byte counters since start.
    pub fn stats(&self) -> ProxyStats {
        ProxyStats {
            accepted: self.shared.accepted.load(Ordering::SeqCst),
            active: self.shared.active.load(Ordering::SeqCst),
            bytes_to_target: self.shared.bytes_to_target.load(Ordering::SeqCst),
            bytes_from_target: self.shared.bytes_from_target.load(Ordering::SeqCst),
        }
    }

    /// Sends a control request and waits for its acknowledgement (a std channel, so this works
    /// from inside or outside a tokio runtime).
    fn request(&self, make: impl FnOnce(std_mpsc::Sender<()>) -> Control) {
        let (ack, acked) = std_mpsc::channel();
        self.control
            .as_ref()
            .expect("the control channel lives until drop")
            .send(make(ack))
            .expect("the proxy thread has stopped");
        acked
            .recv_timeout(CONTROL_TIMEOUT)
            .expect("the proxy thread did not acknowledge a control request");
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // Closing the control channel ends the accept loop; the runtime's drop then cancels
        // every connection task, closing their sockets.
        drop(self.control.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A listener on `addr` with `SO_REUSEADDR`, so it can be re-bound while old connections on the
/// port sit in TIME_WAIT.
fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

async fn accept_loop(
    listener: TcpListener,
    addr: SocketAddr,
    target: SocketAddr,
    shared: Arc<Shared>,
    mut control: mpsc::UnboundedReceiver<Control>,
) {
    let mut listener = Some(listener);
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = accept(listener.as_ref()) => {
                // Accept errors (e.g. EMFILE) are transient for a test proxy: try again.
                if let Ok((client, _)) = accepted {
                    let id = shared.accepted.fetch_add(1, Ordering::SeqCst);
                    connections.spawn(serve(client, id, target, Arc::clone(&shared)));
                }
            }
            request = control.recv() => match request {
                None => return,
                Some(Control::CutAll(ack)) => {
                    connections.abort_all();
                    while connections.join_next().await.is_some() {}
                    let _ = ack.send(());
                }
                Some(Control::Refuse(refuse, ack)) => {
                    if refuse {
                        listener = None;
                    } else if listener.is_none() {
                        listener = Some(bind(addr).unwrap_or_else(|err| {
                            panic!("the fault proxy could not listen on {addr} again: {err}")
                        }));
                    }
                    let _ = ack.send(());
                }
            },
            // Reap finished connections so the set does not grow for the proxy's lifetime.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Accepts on `listener`, or waits forever while refusing (no listener).
async fn accept(listener: Option<&TcpListener>) -> io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(listener) => listener.accept().await,
        None => std::future::pending().await,
    }
}

/// Decrements the active-connection count when a connection task ends or is aborted.
struct ActiveGuard(Arc<Shared>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Forwards one client connection to the target until either side closes or fails.
async fn serve(client: TcpStream, id: u64, target: SocketAddr, shared: Arc<Shared>) {
    shared.active.fetch_add(1, Ordering::SeqCst);
    let _guard = ActiveGuard(Arc::clone(&shared));
    // While blackholed, do not even connect onwards: the client hangs, as on a partition.
    let mut blackhole = shared.blackhole.subscribe();
    if blackhole.wait_for(|on| !*on).await.is_err() {
        return;
    }
    let Ok(upstream) = TcpStream::connect(target).await else {
        return; // the client sees its connection closed, as a dead target would cause
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    let to_target = pump(
        client_read,
        upstream_write,
        (id, Arc::clone(&shared)),
        Direction::ToTarget,
    );
    let from_target = pump(
        upstream_read,
        client_write,
        (id, Arc::clone(&shared)),
        Direction::FromTarget,
    );
    tokio::pin!(to_target, from_target);
    // A clean EOF on one side is forwarded (write shutdown) and the other direction drains;
    // an error on either side ends the connection at once.
    tokio::select! {
        done = &mut to_target => if done.is_ok() { let _ = from_target.await; },
        done = &mut from_target => if done.is_ok() { let _ = to_target.await; },
    }
}

#[derive(Clone, Copy)]
enum Direction {
    ToTarget,
    FromTarget,
}

/// Copies `from` to `to` chunk by chunk, each chunk delivered no earlier than the latency
/// after it was read, never while blackholed and never once connection `id` is stalled. On
/// EOF, shuts down `to`'s write side.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    (id, shared): (u64, Arc<Shared>),
    direction: Direction,
) -> io::Result<()> {
    let (chunks, mut pending) = mpsc::channel::<(Instant, Vec<u8>)>(IN_FLIGHT);
    let reader = {
        let shared = Arc::clone(&shared);
        async move {
            let mut buf = vec![0; CHUNK];
            loop {
                let n = from.read(&mut buf).await?;
                if n == 0 {
                    return Ok::<(), io::Error>(()); // dropping `chunks` ends the writer
                }
                let latency = Duration::from_nanos(shared.latency_nanos.load(Ordering::SeqCst));
                if chunks
                    .send((Instant::now() + latency, buf[..n].to_vec()))
                    .await
                    .is_err()
                {
                    return Ok(());
                }
            }
        }
    };
    let writer = async move {
        let mut blackhole = shared.blackhole.subscribe();
        let counter = match direction {
            Direction::ToTarget => &shared.bytes_to_target,
            Direction::FromTarget => &shared.bytes_from_target,
        };
        while let Some((deliver_at, chunk)) = pending.recv().await {
            tokio::time::sleep_until(deliver_at).await;
            if blackhole.wait_for(|on| !*on).await.is_err() {
                return Ok(());
            }
            if id < shared.stalled_below.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            to.write_all(&chunk).await?;
            counter.fetch_add(chunk.len() as u64, Ordering::SeqCst);
        }
        to.shutdown().await
    };
    tokio::try_join!(reader, writer).map(|_| ())
}
