#!/usr/bin/env bash
# Installs the real tools the component tests run: Debian's `prometheus` package (`prometheus`
# and `promtool`, for the observability tests), `chromium` (the /ui page test) and `haproxy`
# (the multi-node front, deploy/multinode/try-local.sh). Idempotent: returns at once when all are on PATH.
#
# The package's maintainer scripts would start a system Prometheus on :9090. The tests run
# their own Prometheus (own port, config and storage in a temporary directory) and need no
# daemon, so service starts are refused for the duration of the install with a temporary
# policy-rc.d (the standard Debian mechanism), removed again afterwards.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1 \
        && command -v haproxy >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

policy=/usr/sbin/policy-rc.d
added_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# hotswap .ci/install-tools.sh: no service starts during this install\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    added_policy=1
fi
cleanup() {
    if [ "$added_policy" = 1 ]; then
        $SUDO rm -f "$policy"
    fi
}
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
# Other jobs on the machine may hold the apt locks for a while: wait for them, do not fail.
$SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
$SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends prometheus chromium haproxy >/dev/null

# On a machine where systemd runs anyway, make sure no packaged daemon holds :9090.
if command -v systemctl >/dev/null 2>&1 && systemctl is-system-running >/dev/null 2>&1; then
    $SUDO systemctl disable --now prometheus haproxy >/dev/null 2>&1 || true
fi

command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v haproxy >/dev/null
prometheus --version 2>&1 | head -1
