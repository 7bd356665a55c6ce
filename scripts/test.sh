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
    # A package just installed may start a system redis on 6379 or a sentinel; tests never
    # use them, so stop the ones this script installed, that they cannot take CPU from the
    # suite. A Redis the machine already had is left alone.
    started=()
    for pkg in "${need[@]}"; do
        case "$pkg" in redis-server | redis-sentinel) started+=("$pkg") ;; esac
    done
    if [ ${#started[@]} -gt 0 ] && command -v systemctl >/dev/null 2>&1; then
        $SUDO systemctl stop "${started[@]}" >/dev/null 2>&1 || true
    fi
fi

cargo test --workspace --all-targets "$@"
cargo test --workspace --doc "$@"
# rediss:// against a TLS redis-server with certificates made by the test (the `tls` feature
# is off by default, so the workspace run above does not build these)
cargo test -p tollgate-redis --features tls --test tls --test tls_verify --test tls_sentinel "$@"
