#!/usr/bin/env bash
# Build SageAttention 2 in place, for this machine's GPU, from a source tree in .third_party/SageAttention
# (git-ignored: third-party code is never part of this pack). Used to measure ComfyUI's sage backend
# (--use-sage-attention) in benchmarks/profile_block.py --attention sage and tests/test_gpu_block.py.
#
#   git clone https://github.com/thu-ml/SageAttention .third_party/SageAttention   # or any copy of its source
#   bash benchmarks/build_sageattention.sh        # then: export PYTHONPATH=$PWD/.third_party/SageAttention
#
# Needs nvcc and the torch it builds against; a ninja binary on PATH makes it parallel (on an offline machine,
# put ninja's wheel into .whl/: benchmarks/run_gpu_checks.sh installs it to /tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${SAGE_SRC:-.third_party/SageAttention}
LOG=${OUT:-benchmarks/out}/sage-build.log
mkdir -p "$(dirname "$LOG")"
if [[ ! -f "$SRC/setup.py" ]]; then
  echo "build_sageattention.sh: no SageAttention source in $SRC" >&2
  exit 1
fi
export PATH="/tmp/site/bin:$PATH"
export MAX_JOBS=${MAX_JOBS:-$(nproc)} EXT_PARALLEL=${EXT_PARALLEL:-4}
start=$(date +%s)
if (cd "$SRC" && python3 setup.py build_ext --inplace) > "$LOG" 2>&1; then
  echo "SageAttention built in $SRC in $(( $(date +%s) - start )) s (log: $LOG)"
else
  echo "SageAttention build failed after $(( $(date +%s) - start )) s; last lines of $LOG:" >&2
  tail -30 "$LOG" >&2
  exit 1
fi
