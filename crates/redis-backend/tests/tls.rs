//! `rediss://` against a real redis-server with TLS, verifying the server's certificate
//! against a test CA handed to rustls through `SSL_CERT_FILE`.
#![cfg(feature = "tls")]
#![allow(unsafe_code)] // set_var before any other thread reads the environment

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Server, free_port};
use tollgate_core::{Key, Policy, Store};
use tollgate_redis::RedisStore;

fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl");
    assert!(status.success(), "openssl {args:?}");
}

/// A CA and a server certificate for `localhost` / 127.0.0.1, signed by it, in `d`.
fn make_certs(d: &Path) {
    openssl(
        d,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=tollgate test CA",
        ],
    );
    std::fs::write(
        d.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    openssl(
        d,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ],
    );
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
}

#[test]
fn rediss_urls_connect_over_verified_tls() {
    let certs = tempfile::tempdir().unwrap();
    let d = certs.path();
    make_certs(d);
    // SAFETY: no other thread exists yet in this test binary's only test.
    unsafe { std::env::set_var("SSL_CERT_FILE", d.join("ca.pem")) };

    let tls_port = free_port();
    let path = |f: &str| d.join(f).to_string_lossy().into_owned();
    let server = Server::start_with_args(&[
        "--tls-port".into(),
        tls_port.to_string(),
        "--tls-cert-file".into(),
        path("server.pem"),
        "--tls-key-file".into(),
        path("server.key"),
        "--tls-ca-cert-file".into(),
        path("ca.pem"),
        "--tls-auth-clients".into(),
        "no".into(),
    ]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let url = format!("rediss://localhost:{tls_port}");
        let p = Policy::fixed_window(2, Duration::from_secs(3600)).unwrap();
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
