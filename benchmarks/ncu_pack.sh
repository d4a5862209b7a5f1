#!/usr/bin/env bash
# Nsight Compute report of one pack kernel launch (needs ncu and a GPU): where the pack's time goes.
#   bash benchmarks/ncu_pack.sh [case] [kernel regex]     e.g. plain5376_static nvfp4_pack_plain
# Cases are those of benchmarks/tune_pack.py. Writes ${OUT:-benchmarks/out}/ncu-<case>[-<tag>].txt.
# PACK_DEFINES="E2M1_SW_IMPL=9,PACK_SKIP_SCALE_STORE=1" builds the kernels with -D overrides (tag: TAG);
# NCU_CLOCKS=none profiles at the GPU's own clocks instead of ncu's locked base clock.
set -euo pipefail
cd "$(dirname "$0")/.."
CASE=${1:-plain5376_static}
KERNEL=${2:-nvfp4_pack}
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
TAG=${TAG:+-$TAG}
ncu --clock-control "${NCU_CLOCKS:-base}" --kernel-name "regex:$KERNEL" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section SchedulerStats --section LaunchStats --section SourceCounters \
    python3 - "$CASE" <<'PY' > "$OUT/ncu-$CASE$TAG.txt" 2>&1
import sys, pathlib
sys.path.insert(0, "tests"); sys.path.insert(0, "benchmarks")
import conftest  # noqa: F401
import os
import torch
from tune_pack import cases
from h3_fused_nvfp4.kernels import ops
ops.TUNING_DEFINES = tuple(tuple(d.split("=", 1)) for d in os.environ.get("PACK_DEFINES", "").split(",") if d)
fn = cases()[sys.argv[1]]
for _ in range(3):
    fn()
torch.cuda.synchronize()
PY
echo "ncu report: $OUT/ncu-$CASE$TAG.txt"
