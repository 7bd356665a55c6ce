//! `tollgate serve`: a small demo HTTP service with a rate-limited route per policy-file
//! entry (the built-in file has three, each under a different algorithm), on the local store
//! or, with `--redis` (or `--sentinel … --master`, or `--cluster`), on a Redis shared by every
//! process started against it. A Redis that is down at startup is not fatal: the routes apply
//! their failure modes until it answers (a Cluster must answer at startup, as its slot map is
//! read when the store is made).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use axum::extract::Request;
use axum::http::Method;
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{MethodFilter, MethodRouter, any, get, on};
use clap::Args;
use tollgate_http::{
    AuthenticatedUser, BUILTIN_POLICY_FILE, CostSource, KeySource, PolicyFile, RouteConfig,
};

use crate::StoreArgs;

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// Policy file (TOML: routes, keys, costs, policies, failure modes). Without it, the
    /// built-in demo file (see --print-config).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address to listen on. Port 0 picks a free port; the address is printed on the first
    /// line of output.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Print the built-in policy file and exit.
    #[arg(long)]
    print_config: bool,
    /// After SIGTERM or Ctrl-C, how long requests in progress may take to finish before the
    /// server exits anyway (a client that keeps a request open cannot hold it up).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    shutdown_grace: Duration,
    #[command(flatten)]
    store: StoreArgs,
}

pub(crate) async fn run(args: ServeArgs) -> Result<()> {
    if args.print_config {
        return crate::write_stdout(format_args!("{BUILTIN_POLICY_FILE}"));
    }
    init_tracing();
    let file = match &args.config {
        None => PolicyFile::builtin(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            PolicyFile::parse(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
                .context("invalid policy file")?
        }
    };
    // A file without a route would serve the index page alone and limit nothing, silently:
    // the file is there to rate-limit routes, so one without any is a mistake.
    if file.routes.is_empty() {
        let path = args
            .config
            .as_deref()
            .unwrap_or(std::path::Path::new("<built-in>"));
        anyhow::bail!(
            "invalid policy file: {} has no [[route]]: nothing would be rate-limited",
            path.display()
        );
    }
    // The store's own deadline must not cut a route's longer one: each limiter keeps its
    // route's (or --timeout), the store gets the longest of them.
    let mut store_args = args.store.clone();
    store_args.timeout = file
        .routes
        .iter()
        .filter_map(|route| route.timeout)
        .fold(args.store.timeout, Duration::max);
    // A server starts during a Redis outage too: its routes apply their failure modes.
    let store = store_args.connect_or_defer().await?;

    let mut app = Router::new();
    for route in &file.routes {
        let limiter = route
            .limiter(store.clone())
            .timeout(route.timeout.unwrap_or(args.store.timeout))
            .build()?;
        let layer = route.layer(limiter, file.legacy_headers);
        // route_layer: a 405 for another method consumes no quota. `any` has no per-method
        // routes to attach to, so it takes the layer itself.
        let handler = demo_handler(route)?;
        let handler = if route.method.is_some() {
            handler.route_layer(layer)
        } else {
            handler.layer(layer)
        };
        app = app.route(&route.path, handler);
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    // A configured route at `/` owns it (the file's paths were checked as axum routes them;
    // `/` conflicts with no other path): the index page would clash with its method or take
    // the methods it leaves, unlimited.
    if !file.routes.iter().any(|route| route.path == "/") {
        let index = index_text(&file, args.store.label(), addr);
        app = app.route("/", get(move || async move { index }));
    }
    app = app.layer(middleware::from_fn(demo_auth));
    let shutdown = shutdown_signals()?;
    // Tests and scripts read this first line for the address. A reader that has gone
    // (`serve | head -1`) does not stop the server: the banner is only for it.
    let banner = crate::outln!("listening on http://{addr} (store: {})", args.store.label())
        .and_then(|()| {
            file.routes
                .iter()
                .try_for_each(|route| crate::outln!("  {}", describe(route)))
        });
    if let Err(error) = banner
        && !error.is::<crate::StdoutClosed>()
    {
        return Err(error);
    }
    let (signalled, on_signal) = tokio::sync::oneshot::channel();
    let server = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async move {
        shutdown.await;
        let _ = signalled.send(());
    });
    let grace = args.shutdown_grace;
    tokio::select! {
        served = std::future::IntoFuture::into_future(server) => served?,
        () = async move {
            if on_signal.await.is_ok() {
                tokio::time::sleep(grace).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => {
            tracing::warn!(?grace, "requests still open after the shutdown grace; exiting");
        }
    }
    Ok(())
}

/// The demo's endpoint: a small JSON body naming the route. The decision is deliberately
/// absent from the body: how it was enforced is for operators, not clients.
fn demo_handler(route: &RouteConfig) -> Result<MethodRouter> {
    let body = format!("{{\"route\":\"{}\",\"ok\":true}}\n", route.name);
    let handler = move || async move {
        (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
    };
    Ok(match &route.method {
        None => any(handler),
        Some(method) => {
            let filter = MethodFilter::try_from(method.clone())
                .map_err(|e| anyhow::anyhow!("route {}: {e}", route.name))?;
            on(filter, handler)
        }
    })
}

/// The demo's "authentication": `Authorization: Bearer NAME` (the scheme in any case) makes
/// the request NAME's.
/// (A real service verifies a token here.)
async fn demo_auth(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // the scheme is case-insensitive (RFC 9110, 11.1)
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, user)| user.trim())
        .filter(|u| !u.is_empty())
        .map(str::to_owned);
    if let Some(user) = user {
        request.extensions_mut().insert(AuthenticatedUser(user));
    }
    next.run(request).await
}

fn describe(route: &RouteConfig) -> String {
    format!(
        "{:<6} {:<16} key={:<18} policy={} failure_mode={}",
        route.method.as_ref().map_or("*", |m| m.as_str()),
        route.path,
        route.key.describe(),
        route.policy_spec,
        route.failure,
    )
}

/// The demo's index page at `GET /`: the store, the routes, and a request to try on each, at
/// the address the server listens on. Not served when the policy file has a route at `/`.
fn index_text(file: &PolicyFile, store: &str, addr: SocketAddr) -> String {
    let mut out = format!("tollgate demo (store: {store})\n\nrate-limited routes:\n");
    for route in &file.routes {
        let _ = writeln!(out, "  {}", describe(route));
    }
    out.push_str("\ntry:\n");
    for route in &file.routes {
        let _ = writeln!(out, "  {}", try_route(route, addr));
    }
    out
}

/// A `curl` command for `route` on the server at `addr`: its method (`GET` for any), the
/// header its key is read from, a cost header when the cost comes from one, and its path with
/// each parameter given a value.
fn try_route(route: &RouteConfig, addr: SocketAddr) -> String {
    let mut cmd = String::from("curl -i");
    match route.method.as_ref() {
        None | Some(&Method::GET) => {}
        // `-X HEAD` would have curl wait for the body the response's length announces
        Some(&Method::HEAD) => cmd = String::from("curl -I"),
        Some(method) => {
            let _ = write!(cmd, " -X {method}");
        }
    }
    match &route.key {
        KeySource::Header(h) => {
            let _ = write!(cmd, " -H '{}: k1'", h.name());
        }
        KeySource::User(_) => cmd.push_str(" -H 'Authorization: Bearer alice'"),
        // the client's address, one bucket for the route, or a source added since: no header
        _ => {}
    }
    if let CostSource::Header(c) = &route.cost {
        let _ = write!(cmd, " -H '{}: {}'", c.name(), c.default_cost());
    }
    // `{id}` and `{*rest}` segments: a value each
    let path: Vec<String> = route
        .path
        .split('/')
        .map(|segment| match segment.strip_prefix('{') {
            Some(_) if segment.ends_with('}') => "1".to_owned(),
            _ => segment.to_owned(),
        })
        .collect();
    let host = if addr.ip().is_unspecified() {
        format!("localhost:{}", addr.port())
    } else {
        addr.to_string()
    };
    let _ = write!(cmd, " '{host}{}'", path.join("/"));
    cmd
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// SIGTERM and SIGINT (Ctrl-C), registered when this is called (not when the future is first
/// polled): called before the ready line is printed, so a signal sent as soon as a script has
/// read that line ends the server gracefully rather than by the signal's default action.
fn shutdown_signals() -> std::io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = interrupt.recv() => {},
        }
    })
}
