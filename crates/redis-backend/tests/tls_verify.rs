//! `rediss://` verifies the server by default: a certificate from a CA the client does not
//! trust, a certificate for another host name, and the `#insecure` URL fragment are all
//! refused, against a real TLS redis-server with certificates made here.
//!
//! One test, because the trusted roots come from the process-wide `SSL_CERT_FILE`.
#![cfg(feature = "tls")]
#![allow(unsafe_code)] // set_var/remove_var while no other thread reads the environment

use std::path::Path;
use std::time::Duration;

use tollgate_core::{ErrorClass, Key, Policy, Store, StoreError};
use tollgate_redis::RedisStore;
use tollgate_testkit::server::RedisServer;
use tollgate_testkit::tls::{self, make_ca, make_server_cert};

/// A redis-server with a TLS port serving certificate `cert`; returns it and the TLS port.
fn tls_server(d: &Path, cert: &str) -> (RedisServer, u16) {
    let port = tls::free_port();
    let server = RedisServer::builder()
        .extra_args(tls::server_args(d, port, cert, "ca"))
        .start();
    (server, port)
}

async fn connect(url: &str) -> Result<RedisStore, StoreError> {
    RedisStore::builder(url)
        .connect_timeout(Duration::from_secs(3))
        .build()
        .await
}

#[track_caller]
fn assert_refused(what: &str, got: Result<RedisStore, StoreError>) {
    match got {
        Ok(store) => panic!("{what}: connected ({store:?}) although verification must fail"),
        Err(e) => {
            assert!(
                !matches!(e, StoreError::Timeout(_)),
                "{what}: refused only by timing out: {e}"
            );
            let mut chain = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                chain = format!("{chain}: {s}");
                source = s.source();
            }
            println!("{what}: refused as {:?}: {chain}", e.class());
        }
    }
}

#[test]
fn rediss_verifies_the_server_certificate_and_host_name_by_default() {
    let certs = tempfile::tempdir().unwrap();
    let d = certs.path();
    make_ca(d, "ca");
    make_ca(d, "other-ca");
    make_server_cert(d, "good", "ca", "DNS:localhost,IP:127.0.0.1");
    make_server_cert(d, "wrong-name", "ca", "DNS:elsewhere.invalid");
    let (_good, good_port) = tls_server(d, "good");
    let (_wrong, wrong_port) = tls_server(d, "wrong-name");
    let good = format!("rediss://localhost:{good_port}");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // SAFETY (every set_var/remove_var below): this test binary runs this one test, and the
    // current-thread runtime runs on this thread; no other thread reads the environment.
    rt.block_on(async {
        // The system roots only: the test CA is unknown.
        unsafe { std::env::remove_var("SSL_CERT_FILE") };
        unsafe { std::env::remove_var("SSL_CERT_DIR") };
        assert_refused("untrusted CA (system roots)", connect(&good).await);

        // Another CA is trusted, not the server's.
        unsafe { std::env::set_var("SSL_CERT_FILE", d.join("other-ca.pem")) };
        assert_refused("untrusted CA (another CA)", connect(&good).await);

        // The right CA, but the certificate names another host.
        unsafe { std::env::set_var("SSL_CERT_FILE", d.join("ca.pem")) };
        assert_refused(
            "certificate for another host name",
            connect(&format!("rediss://localhost:{wrong_port}")).await,
        );
        assert_refused(
            "IP address not in the certificate",
            connect(&format!("rediss://127.0.0.1:{wrong_port}")).await,
        );

        // Verification cannot be switched off by the URL: redis-rs is built without
        // `tls-rustls-insecure`, so `#insecure` is refused as a configuration error.
        unsafe { std::env::set_var("SSL_CERT_FILE", d.join("other-ca.pem")) };
        let err = connect(&format!("{good}/#insecure")).await.unwrap_err();
        assert_ne!(err.class(), ErrorClass::Unavailable, "#insecure: {err}");
        println!("#insecure: refused as {:?}: {err}", err.class());

        // Control: the right CA and host name connect and decide.
        unsafe { std::env::set_var("SSL_CERT_FILE", d.join("ca.pem")) };
        let store = connect(&good).await.expect("verified TLS");
        let p = Policy::fixed_window(1, Duration::from_secs(3600)).unwrap();
        assert!(
            store
                .acquire(&Key::global("tls"), &p, 1)
                .await
                .unwrap()
                .allowed
        );
    });
}
