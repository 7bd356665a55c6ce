//! `rediss://` against a real redis-server with TLS, verifying the server's certificate
//! against a test CA handed to rustls through `SSL_CERT_FILE`.
#![cfg(feature = "tls")]
#![allow(unsafe_code)] // set_var before any other thread reads the environment

mod common;

use std::time::Duration;

use common::Server;
use tollgate_core::{Key, Policy, Rate, Store};
use tollgate_redis::RedisStore;
use tollgate_testkit::tls;

#[test]
fn rediss_urls_connect_over_verified_tls() {
    let certs = tempfile::tempdir().unwrap();
    let d = certs.path();
    tls::make_loopback_certs(d, "server");
    // SAFETY: no other thread exists yet in this test binary's only test.
    unsafe { std::env::set_var("SSL_CERT_FILE", d.join("ca.pem")) };

    let tls_port = tls::free_port();
    let server = Server::start_with_args(&tls::server_args(d, tls_port, "server", "ca"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let url = format!("rediss://localhost:{tls_port}");
        // A token bucket refilling one token an hour: no refill within the test (an hour's
        // fixed window, aligned to the epoch on Redis's real clock, restarted at the top of the
        // hour and broke the counts of a run that crossed it).
        let p = Policy::token_bucket(2, Rate::new(1, Duration::from_secs(3600))).unwrap();
        let k = Key::global("tls");
        let multiplexed = RedisStore::builder(url.clone())
            .build()
            .await
            .expect("TLS, multiplexed");
        let pooled = RedisStore::builder(url)
            .pool(2)
            .build()
            .await
            .expect("TLS, pooled");
        assert_eq!(multiplexed.acquire(&k, &p, 1).await.unwrap().remaining, 1);
        assert_eq!(pooled.acquire(&k, &p, 1).await.unwrap().remaining, 0);
        let plain = RedisStore::builder(format!("redis://127.0.0.1:{}", server.port()))
            .build()
            .await
            .unwrap();
        assert!(
            !plain.acquire(&k, &p, 1).await.unwrap().allowed,
            "one server behind both ports"
        );
    });
}
