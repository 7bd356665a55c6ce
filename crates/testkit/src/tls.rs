//! Certificates for TLS tests, made with the `openssl` command (which `scripts/test.sh`
//! installs), and the `redis-server` arguments that serve them.
//!
//! ```no_run
//! use tollgate_testkit::server::RedisServer;
//! use tollgate_testkit::tls;
//!
//! let dir = tempfile::tempdir().unwrap();
//! tls::make_ca(dir.path(), "ca");
//! tls::make_server_cert(dir.path(), "server", "ca", "DNS:localhost,IP:127.0.0.1");
//! let port = tls::free_port();
//! let server = RedisServer::builder()
//!     .extra_args(tls::server_args(dir.path(), port, "server", "ca"))
//!     .start();
//! // rediss://localhost:{port}, trusting dir/ca.pem (SSL_CERT_FILE)
//! # drop(server);
//! ```

use std::path::Path;
use std::process::{Command, Stdio};

/// Runs `openssl args` in `dir`.
///
/// # Panics
/// If openssl cannot run or fails.
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

/// A self-signed CA, `<name>.pem` and `<name>.key` in `dir`, valid for two days.
///
/// # Panics
/// If openssl fails.
pub fn make_ca(dir: &Path, name: &str) {
    let (pem, key) = (format!("{name}.pem"), format!("{name}.key"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &pem,
            "-days",
            "2",
            "-subj",
            &format!("/CN=tollgate {name}"),
        ],
    );
}

/// A certificate `<name>.pem` / `<name>.key` in `dir` for the subject alternative names
/// `san` (`DNS:localhost,IP:127.0.0.1`), signed by the CA `<ca>.pem` / `<ca>.key`.
///
/// # Panics
/// If openssl fails or `dir` is not writable.
pub fn make_server_cert(dir: &Path, name: &str, ca: &str, san: &str) {
    let ext = format!("{name}.cnf");
    std::fs::write(dir.join(&ext), format!("subjectAltName={san}\n")).expect("write ext file");
    let (pem, key, csr) = (
        format!("{name}.pem"),
        format!("{name}.key"),
        format!("{name}.csr"),
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            "/CN=tollgate test server",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
}

/// A CA `ca` and, signed by it, a certificate `cert` for `localhost` and `127.0.0.1`: what a
/// loopback TLS test trusts (`SSL_CERT_FILE` = `dir/ca.pem`) and serves.
///
/// # Panics
/// If openssl fails or `dir` is not writable.
pub fn make_loopback_certs(dir: &Path, cert: &str) {
    make_ca(dir, "ca");
    make_server_cert(dir, cert, "ca", "DNS:localhost,IP:127.0.0.1");
}

/// The `redis-server` arguments for a TLS port `port` serving certificate `cert` (made by
/// [`make_server_cert`] in `dir`), trusting CA `ca` for its own outgoing TLS connections
/// (replication, Sentinel's) and not asking clients for certificates.
pub fn server_args(dir: &Path, port: u16, cert: &str, ca: &str) -> Vec<String> {
    let path = |f: String| dir.join(f).to_string_lossy().into_owned();
    vec![
        "--tls-port".into(),
        port.to_string(),
        "--tls-cert-file".into(),
        path(format!("{cert}.pem")),
        "--tls-key-file".into(),
        path(format!("{cert}.key")),
        "--tls-ca-cert-file".into(),
        path(format!("{ca}.pem")),
        "--tls-auth-clients".into(),
        "no".into(),
    ]
}

/// A free loopback port (free when asked; another process may take it before it is used):
/// [`ports::fresh_port`](crate::ports::fresh_port).
///
/// # Panics
/// If no loopback port can be bound.
pub fn free_port() -> u16 {
    crate::ports::fresh_port()
}
