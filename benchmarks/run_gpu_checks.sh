#!/usr/bin/env bash
# GPU checks in one go: the GPU tests, then the pack benchmark, JSON and logs under ${OUT:-benchmarks/out}.
# On a machine without network access, put comfy-kitchen's wheel in .whl/ first; it is installed to /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export H3_FUSED_NVFP4_CACHE=${H3_FUSED_NVFP4_CACHE:-/tmp/h3_fused_nvfp4_cache}
# SAGE=1: build SageAttention from .third_party/SageAttention first (benchmarks/build_sageattention.sh), so the
# sage tests run and profile_block can take --attention sage.
if [[ "${SAGE:-0}" == 1 ]] && OUT="$OUT" bash benchmarks/build_sageattention.sh; then
  export PYTHONPATH=$PWD/.third_party/SageAttention${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
# STEP_TIMEOUT: seconds allowed for the tests and for each benchmark (0: no limit), so one stuck step does not
# take the others' results with it.
STEP_TIMEOUT=${STEP_TIMEOUT:-0}
timeout "$STEP_TIMEOUT" python3 -m pytest ${PYTEST_PATHS:-tests} -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -40
# BENCHMARKS: script names without .py, each optionally with arguments after a colon, comma-separated
# (profile_block:--attention,sage writes h200-profile_block-attention-sage.json).
for entry in ${BENCHMARKS:-bench_pack}; do
  name=${entry%%:*}; args=""; tag=${name#bench_}
  if [[ "$entry" == *:* ]]; then
    args=${entry#*:}; args=${args//,/ }
    tag="$tag$(echo " $args" | tr -s ' -' '-')"
  fi
  timeout "$STEP_TIMEOUT" python3 "benchmarks/$name.py" $args --out "$OUT/h200-$tag.json" 2>&1 | tee "$OUT/$tag.log" | tail -15
done
