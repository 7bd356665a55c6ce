#!/usr/bin/env bash
# The whole test suite. Installs Redis from Debian's packages when missing (tests start their
# own redis-server processes on free loopback ports; none relies on a running server).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v redis-sentinel >/dev/null 2>&1 || need+=(redis-sentinel)
# the TLS tests make their certificates with openssl
command -v openssl >/dev/null 2>&1 || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y redis-server redis-tools redis-sentinel "${need[@]}"
fi
# Debian's package may start a system redis on 6379; tests never use it, but stop it so it
# cannot take CPU from the suite.
if command -v systemctl >/dev/null 2>&1; then
    systemctl stop redis-server redis-sentinel >/dev/null 2>&1 || true
fi

cargo test --workspace --all-targets "$@"
cargo test --workspace --doc "$@"
# rediss:// against a TLS redis-server with certificates made by the test (the `tls` feature
# is off by default, so the workspace run above does not build these)
cargo test -p tollgate-redis --features tls --test tls --test tls_verify --test tls_sentinel "$@"
