//! The harness shared by this crate's HTTP tests: an axum app served on a free loopback port,
//! a client, a response's header, and a store on a real redis-server (testkit).
#![allow(dead_code)] // each test binary uses its own part

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use reqwest::Response;
use tollgate::Store;
use tollgate_testkit::server::RedisServer;

/// Serves `app` (with each connection's peer address) on a free loopback port; its base URL.
pub async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    format!("http://{addr}")
}

/// A client whose requests give up after 5 s.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// `resp`'s header `name`, as text.
pub fn header<'a>(resp: &'a Response, name: &str) -> Option<&'a str> {
    resp.headers().get(name).map(|v| v.to_str().unwrap())
}

/// A store on `server`, whose calls time out after 2 s.
pub async fn redis_store(server: &RedisServer) -> Arc<dyn Store> {
    Arc::new(
        tollgate::redis::RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .build()
            .await
            .unwrap(),
    )
}
