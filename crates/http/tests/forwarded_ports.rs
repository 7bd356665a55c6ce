//! RFC 7239 lets a proxy write a node's port obfuscated (`node-port = port / obfport`,
//! `obfport = "_" 1*(ALPHA / DIGIT / "." / "_" / "-")`): `for="192.0.2.43:_p1"` is the
//! address 192.0.2.43. Behind a trusted proxy writing such nodes, every client must still get
//! its own bucket — over real HTTP on loopback, on a real redis-server (testkit).

use std::net::IpAddr;
use std::time::Duration;

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::get;
use reqwest::StatusCode;
use tollgate::{FailureMode, Limiter, Policy};
use tollgate_http::{ClientIpKey, ForwardedHeader, RateLimitLayer, TrustedProxies};
use tollgate_testkit::server::RedisServer;

mod common;
use common::{client, redis_store, serve};

fn loopback_proxy() -> TrustedProxies {
    TrustedProxies::new(["127.0.0.0/8".parse().unwrap()], ForwardedHeader::Forwarded)
}

/// Nodes with an obfuscated port are the address they carry, quoted or not, IPv4 or IPv6.
#[test]
fn a_node_with_an_obfuscated_port_is_its_address() {
    let proxies = loopback_proxy();
    let peer: IpAddr = "127.0.0.1".parse().unwrap();
    for (value, client) in [
        (r#"for="192.0.2.43:_p1""#, "192.0.2.43"),
        (r#"for="[2001:db8:cafe::17]:_p-2.x""#, "2001:db8:cafe::17"),
        ("for=192.0.2.43:_hidden", "192.0.2.43"),
        (r#"for="[2001:db8:cafe::17]:4711""#, "2001:db8:cafe::17"),
        // the client's own entry at the left is not reached
        (r#"for=6.6.6.6, for="198.51.100.7:_x""#, "198.51.100.7"),
    ] {
        let mut headers = HeaderMap::new();
        headers.insert("forwarded", value.parse().unwrap());
        assert_eq!(
            proxies.client_ip(peer, &headers),
            client.parse::<IpAddr>().unwrap(),
            "{value}"
        );
    }
    // Not addresses: an obfuscated node, a port that is neither digits nor `_`-led, an empty one.
    for value in [
        r#"for="_hidden:_p1""#,
        r#"for="192.0.2.43:p1""#,
        r#"for="192.0.2.43:""#,
        r#"for="192.0.2.43:_""#,
        r#"for="[2001:db8::1]:_p!""#,
    ] {
        let mut headers = HeaderMap::new();
        headers.insert("forwarded", value.parse().unwrap());
        assert_eq!(proxies.client_ip(peer, &headers), peer, "{value}");
    }
}

/// Two clients behind a trusted proxy that obfuscates ports draw from two buckets.
#[tokio::test]
async fn clients_behind_a_proxy_obfuscating_ports_do_not_share_a_bucket() {
    let server = RedisServer::start();
    let store = redis_store(&server).await;
    let limiter = Limiter::builder(
        "login",
        Policy::fixed_window(1, Duration::from_secs(3600)).unwrap(),
    )
    .store(store)
    .failure_mode(FailureMode::Closed)
    .build()
    .unwrap();
    let layer = RateLimitLayer::new(limiter, ClientIpKey::new(loopback_proxy()));
    let app = Router::new().route("/login", get(|| async { "ok" }).route_layer(layer));
    let base = serve(app).await;
    let http = client();
    let mut statuses = Vec::new();
    for node in [
        r#"for="192.0.2.43:_a""#,
        r#"for="198.51.100.7:_b""#,
        r#"for="[2001:db8:cafe::17]:_c""#,
    ] {
        let resp = http
            .get(format!("{base}/login"))
            .header("forwarded", node)
            .send()
            .await
            .unwrap();
        statuses.push(resp.status());
    }
    assert_eq!(statuses, [StatusCode::OK; 3], "one bucket for every client");
}
