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
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest ${PYTEST_PATHS:-tests} -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -40
for script in ${BENCHMARKS:-bench_pack}; do
  python3 "benchmarks/$script.py" --out "$OUT/h200-${script#bench_}.json" 2>&1 | tee "$OUT/$script.log" | tail -15
done
