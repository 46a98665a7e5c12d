#!/usr/bin/env bash
# One command: three hotswap nodes (simulated engines) behind HAProxy on loopback, openai SDK
# traffic for every model, one node SIGKILLed mid-load; prints a summary table and exits 0 when
# every claim holds (docs/multi-node.md). Extra flags go to deploy/multinode/trylocal.py.
#
# Installs what it needs, once: the project's venv (.venv, as .ci/run makes it) and Debian's
# haproxy (as root with apt-get; .ci/install-tools.sh installs it for CI). Bounded: the run is
# stopped after 240 s (it then says which step it was in), and every process it started is stopped
# on any exit. Its waits are polls with deadlines for a busy machine (deploy/multinode/steps.py).
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! .venv/bin/python -c 'import openai, yaml, router' >/dev/null 2>&1; then
    echo "try-local: installing the project into .venv (once)" >&2
    python3 -m venv .venv
    .venv/bin/pip install --quiet -e '.[test]'
fi
if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ]; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "try-local: needs haproxy: run \`apt-get install haproxy\` (or .ci/install-tools.sh) as root" >&2
        exit 2
    fi
    echo "try-local: installing Debian's haproxy (once; its system service is not used)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends haproxy >/dev/null
fi

# The Python side stops its nodes and HAProxy in a `finally`; this forwards our signals to it.
timeout --kill-after=20 240 .venv/bin/python deploy/multinode/trylocal.py "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null || true' INT TERM
trap 'kill -TERM "$child" 2>/dev/null || true; wait "$child" 2>/dev/null || true' EXIT
wait "$child"
