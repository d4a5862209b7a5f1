#!/usr/bin/env bash
# Developer entry point: one virtual environment (.venv, git-ignored) with what the pack and its tests need.
#
#   ./dev.sh setup            create / update .venv (skipped when nothing it installs from has changed)
#   ./dev.sh report [args]    setup, then python report.py [args]: self-check + H3 block profile -> JSON
#                             needs a ComfyUI (checked first: nothing is installed without one)
#   ./dev.sh lint             setup, then the architecture contracts (lint-imports, .importlinter) and ruff (ruff.toml)
#   ./dev.sh test [args]      setup, lint, then python -m pytest tests -q -rs [args]; exits with pytest's code
#                             without a ComfyUI the tests that run ComfyUI's code skip (said before setup)
#
# The report and the tests run ComfyUI's real code: the first of $COMFYUI_PATH, the ComfyUI this folder is
# installed in (custom_nodes/<pack>), ../shared/comfyui (tools/comfy_env.py). setup installs what that ComfyUI
# imports:
#   torch 2.11.0 + torchvision 0.26.0 + torchaudio 2.11.0   the newest set with a torchaudio release, and the
#       CUDA-13 build (cu130) that ComfyUI runs NVFP4 with. About 5 GB, also on a CPU-only machine: PyPI (the one
#       index setup uses) has no CPU-only torch 2.11.0 for Linux x86_64, and the CUDA wheels carry NVRTC 13,
#       which the kernel build tests use to compile every kernel on CPU-only machines
#   comfy-kitchen 0.2.40, comfy-aimdo 0.5.5                 ComfyUI's kernel and memory packages
#   ComfyUI's import-time requirements (tests/requirements-test.txt), pytest
#   for tests/browser: ComfyUI's server requirements, its pinned frontend package, Playwright (the browser is
#       Debian's chromium: apt-get install chromium; .ci/run installs it in CI)
# Environment: PYTHON (interpreter that creates the venv, default python3), VENV (default .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.dev-setup-stamp"
TORCH_PINS=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0)
PIP_FLAGS=(--disable-pip-version-check -q)

say() { printf 'dev.sh: %s\n' "$*"; }

setup_hash() {
  { printf '%s\n' "${TORCH_PINS[@]}"; cat requirements.txt tests/requirements-test.txt; } | sha256sum | cut -d' ' -f1
}

setup() {
  local want
  want="$(setup_hash)"
  if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    say "environment up to date ($VENV)"
    return 0
  fi
  if [[ ! -x "$VENV/bin/python" ]]; then
    if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" && -n "$(ls -A "$VENV" 2>/dev/null)" ]]; then
      say "$VENV exists and is not a virtual environment: refusing to replace it (set VENV to another folder)"
      return 1
    fi
    say "creating $VENV with $("$PYTHON" --version 2>&1)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  rm -f "$STAMP"
  say "installing ${TORCH_PINS[*]} and the test requirements"
  "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "${TORCH_PINS[@]}" -r requirements.txt -r tests/requirements-test.txt
  "$VENV/bin/python" -c 'import torch, torchaudio, comfy_kitchen, comfy_aimdo, pytest; print("dev.sh: torch", torch.__version__, "| CUDA available:", torch.cuda.is_available())'
  printf '%s\n' "$want" > "$STAMP"
  say "setup done"
}

run_lint() {
  setup
  # lint-imports finds the pack by its import name: a link of that name to this folder on its path
  local path="$ROOT/build/lint"
  mkdir -p "$path"
  ln -sfn "$ROOT" "$path/h3_fused_nvfp4"
  say "lint-imports (.importlinter)"
  (cd "$path" && PYTHONPATH="$path" "$VENV/bin/lint-imports" "$ROOT/.importlinter" --no-cache) || { say "import contracts broken"; return 1; }
  say "ruff check (ruff.toml)"
  "$VENV/bin/ruff" check --no-cache "$ROOT" || { say "ruff found problems"; return 1; }
  say "lint passed"
}

# Where the ComfyUI is, by tools/comfy_env.py's own search (run by $PYTHON, before anything is installed); prints
# one line, and fails (the line ending with \$1) when there is none.
find_comfyui() {
  "$PYTHON" - "$ROOT/tools/comfy_env.py" "${1:-}" <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("comfy_env", sys.argv[1])
comfy_env = sys.modules["comfy_env"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(comfy_env)
try:
    location = comfy_env.find_comfyui()
except RuntimeError as exc:
    print(f"dev.sh: {exc}{sys.argv[2]}")
    sys.exit(1)
if location is None:
    print("dev.sh: no ComfyUI found: set COMFYUI_PATH to a ComfyUI folder, install this pack in ComfyUI/custom_nodes, "
          f"or put the test tree at ../shared/comfyui{sys.argv[2]}")
    sys.exit(1)
print(f"dev.sh: ComfyUI at {location.root} ({location.how})")
PY
}

run_tests() {
  find_comfyui "; the tests that run ComfyUI's code will skip" || true
  setup
  run_lint
  say "running pytest tests -q -rs $*"
  local rc=0
  "$VENV/bin/python" -m pytest tests -q -rs "$@" || rc=$?
  if [[ $rc -eq 5 ]]; then
    say "pytest collected no tests: failing"
  elif [[ $rc -ne 0 ]]; then
    say "pytest failed (exit $rc)"
  else
    say "tests passed"
  fi
  return "$rc"
}

run_report() {
  find_comfyui "; the report needs one: nothing was installed" >&2 || return 1
  setup
  say "running report.py $*"
  "$VENV/bin/python" report.py "$@"
}

usage() {
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  setup) setup ;;
  test) run_tests "$@" ;;
  lint) run_lint ;;
  report) run_report "$@" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
