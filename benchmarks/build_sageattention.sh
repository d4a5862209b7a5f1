#!/usr/bin/env bash
# Build SageAttention 2 for this machine's GPU from the source in .third_party/SageAttention (git-ignored: third-party
# code is never part of this pack) into $SAGE_BUILD (default /tmp/sageattention), offline, and print the time.
# Used by the `sage` step of benchmarks/gpu_run.sh, which puts $SAGE_BUILD on PYTHONPATH afterwards.
#
#   bash benchmarks/build_sageattention.sh && export PYTHONPATH=/tmp/sageattention${PYTHONPATH:+:$PYTHONPATH}
#
# Skips the build when `import sageattention` already gives the kernels this GPU needs. Builds for the local GPU's
# architecture only (TORCH_CUDA_ARCH_LIST from torch.cuda.get_device_capability(), which SageAttention's setup.py
# reads). On sm_90 only the two extensions its sageattn() calls there are built (_qattn_sm90, _fused; the sm80 and
# sm89 ones are optional imports in sageattention/core.py); SAGE_ALL_EXTENSIONS=1 builds all of them.
# `setup.py build_ext --inplace` in a copy of the source: no pip, no build isolation, nothing downloaded. Needs nvcc
# (CUDA_HOME or on PATH), setuptools, packaging and ninja (MAX_JOBS, default 16) beside the torch it builds against.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SRC=${SAGE_SRC:-.third_party/SageAttention}
BUILD=${SAGE_BUILD:-/tmp/sageattention}
LOG=${OUT:-benchmarks/out}/sage-build.log
mkdir -p "$(dirname "$LOG")"
start=$SECONDS

check='import torch, sageattention.core as c
cap = torch.cuda.get_device_capability()
flag = {(9, 0): "SM90_ENABLED", (8, 0): "SM80_ENABLED"}.get(cap, "SM89_ENABLED")
assert getattr(c, flag), flag + " is False"
print(c.__file__)'
if found=$(PYTHONPATH=$BUILD${PYTHONPATH:+:$PYTHONPATH} python3 -c "$check" 2>/dev/null); then
  echo "SageAttention already importable ($found): build skipped"
  exit 0
fi
if [[ ! -f "$SRC/setup.py" ]]; then
  echo "build_sageattention.sh: no SageAttention source in $SRC (copy thu-ml/SageAttention there; it is git-ignored)" >&2
  exit 1
fi
for tool in nvcc ninja; do
  if ! command -v "$tool" > /dev/null && [[ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/$tool" ]]; then
    echo "build_sageattention.sh: $tool not found (PATH, CUDA_HOME)" >&2
    [[ "$tool" == nvcc ]] && exit 1
  fi
done
export PATH="$PATH:${CUDA_HOME:-/usr/local/cuda}/bin"
if ! python3 -c 'import setuptools, packaging' 2> /dev/null; then
  echo "build_sageattention.sh: python3 lacks setuptools or packaging (put their wheels into .whl/)" >&2
  exit 1
fi
arch=$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())') || {
  echo "build_sageattention.sh: torch sees no CUDA device" >&2; exit 1; }
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
export MAX_JOBS=${MAX_JOBS:-16} EXT_PARALLEL=${EXT_PARALLEL:-4}
if [[ "$arch" == 9.0 && "${SAGE_ALL_EXTENSIONS:-0}" != 1 ]]; then
  export SAGE_EXTENSIONS="sageattention._qattn_sm90 sageattention._fused"
else
  export SAGE_EXTENSIONS=""
fi
rm -rf "$BUILD" && mkdir -p "$BUILD" && cp -r "$SRC"/. "$BUILD"/ && rm -rf "$BUILD/.git" "$BUILD/build"
echo "building SageAttention for sm_${arch/./} (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS," \
     "extensions: ${SAGE_EXTENSIONS:-all}) in $BUILD; log $LOG"
if (cd "$BUILD" && python3 "$REPO/benchmarks/sage_setup.py" build_ext --inplace) > "$LOG" 2>&1 \
   && found=$(PYTHONPATH=$BUILD${PYTHONPATH:+:$PYTHONPATH} python3 -c "$check" 2>> "$LOG"); then
  echo "SageAttention built in $((SECONDS - start)) s ($found)"
else
  echo "SageAttention build FAILED after $((SECONDS - start)) s; last lines of $LOG:" >&2
  tail -40 "$LOG" >&2
  exit 1
fi
