#!/usr/bin/env bash
# Nsight Compute report of one pack kernel launch (needs ncu and a GPU): where the pack's time goes.
#   bash benchmarks/ncu_pack.sh [case] [kernel regex]     e.g. plain5376_static nvfp4_pack_plain
# Cases are those of benchmarks/tune_pack.py. Writes ${OUT:-benchmarks/out}/ncu-<case>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
CASE=${1:-plain5376_static}
KERNEL=${2:-nvfp4_pack}
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
ncu --kernel-name "regex:$KERNEL" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section SchedulerStats --section LaunchStats --section SourceCounters \
    python3 - "$CASE" <<'PY' > "$OUT/ncu-$CASE.txt" 2>&1
import sys, pathlib
sys.path.insert(0, "tests"); sys.path.insert(0, "benchmarks")
import conftest  # noqa: F401
import torch
from tune_pack import cases
fn = cases()[sys.argv[1]]
for _ in range(3):
    fn()
torch.cuda.synchronize()
PY
echo "ncu report: $OUT/ncu-$CASE.txt"
