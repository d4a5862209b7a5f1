#!/usr/bin/env bash
# GPU checks and measurements in one call on an offline GPU machine; logs and JSON under ${OUT:-benchmarks/out}.
#
#   STEPS="tests report"  bash benchmarks/gpu_run.sh
#
# Steps (run in the order given; each has its own time limit STEP_TIMEOUT seconds):
#   tests          the GPU tests (tests/test_gpu_*.py and the GPU half of tests/test_linear*.py), ComfyUI's real code
#   emulated       the same with H3_FUSED_NVFP4_EMULATE_BLACKWELL=1 (the Blackwell code path, its instructions
#                  modelled in software: runs on Hopper)
#   report         python report.py --dram (dynamic scales)         -> report.json
#   report-static  python report.py --dram --all-static            -> report-static.json
#   bench-pack     benchmarks/bench_pack.py                        -> pack.json
#   bench-pack-fp16 benchmarks/bench_pack.py --shapes wan --dtype fp16 (Wan 2.2 14B's inputs) -> pack-fp16.json
#   bench-rope     benchmarks/bench_rope.py                        -> rope.json
#   bench-zimage   benchmarks/bench_zimage_ops.py --ncu: Z-Image's fused ops vs ComfyUI's op sequences at 1024x1024,
#                  times and DRAM bytes, comfy-kitchen's rms_rope on its q / k views -> zimage-ops.json
#   bench-wan      benchmarks/bench_wan_kernels.py: each step of Wan 2.2 14B's block in fp16 at 832x480, 81 frames,
#                  ComfyUI's ops vs the fused kernels (equal bytes, times, bandwidth) -> wan-kernels.json; the 5B
#                  with WAN_MODEL=wan22_5b
#   trade          benchmarks/calibration_trade.py                 -> calibration-trade.json
#   sage           builds SageAttention 2 from .third_party/SageAttention (benchmarks/build_sageattention.sh, local
#                  arch only, into /tmp/sageattention, skipped when it already imports), puts it on PYTHONPATH for
#                  the later steps, then tests/test_gpu_sage_block.py: one real H3 block at full width with ComfyUI's
#                  sage backend, stock vs fused, bits, layout copies, times -> sage-block.json (~4-6 min)
#   ab-previous    the H3 report of this tree and of a previous one side by side: .device/previous.tar.gz (a git archive
#                  of the previous ref) unpacked beside this tree, report.py --dram of each, interleaved (dynamic: new,
#                  previous; static: new, previous), then benchmarks/ab_reports.py -> ab-previous.json (~6 min)
#   full-model     benchmarks/full_model.py: the whole 50-block model at full size, stock vs the Patch node's
#                  clone, one forward per sigma, time and peak memory -> full-model.json (~3-5 min)
#   families       benchmarks/families.py: each NVFP4 model family (Z-Image, FLUX.2 klein and dev, Wan 2.2 14B,
#                  LTX-2, Qwen-Image) at its official widths with 2 blocks, stock vs the Patch node's clone: parity,
#                  calls fused, time, peak memory, and under ncu the Linear input path's DRAM bytes against its floor
#                  and both arms' whole non-GEMM non-attention bytes per forward (block fusions profiled by blocks,
#                  against their exact-fusion floor; GB10 projection per forward and per 8-step image)
#                  -> families.json. FAMILIES=a,b picks families, FAMILIES_ARGS adds arguments (--no-ncu, --layers N,
#                  --dtype bf16, --ncu-timeout S, --ncu-blocks-only), FAMILIES_TIMEOUT (default 560 s) is its limit
#   server         benchmarks/real_server.py: ComfyUI's real main.py with the pack installed, only ComfyUI's own flags,
#                  random-weight NVFP4 H3, Wan 2.2 (fp16) and Z-Image files with and without a LoRA, graphs through
#                  the HTTP API in each memory mode (dynamic VRAM with and without the Comfy compiler, classic):
#                  latents comfy vs fused vs without the pack, NVFP4 calls accounted for, times -> server.json.
#                  Needs .device/server-wheels (benchmarks/server-wheels.sh); SERVER_ARGS adds arguments,
#                  SERVER_TIMEOUT (default 560 s) is its time limit
#   server-dram    the same server under Nsight Compute: one full-width H3 block's DRAM bytes, comfy and fused, in
#                  the default memory mode and in classic mode -> server-dram.json (SERVER_TIMEOUT as above)
#
#   STEPS="sage full-model" bash benchmarks/gpu_run.sh   (carry .third_party, .whl and .device)
#
# The machine has no network: .whl/ holds the wheels it lacks (comfy-kitchen, comfy-aimdo, torchsde, trampoline;
# ../shared/tools/device-wheels.sh and pip download make them), .device/comfyui.tar.gz a copy of ../shared/comfyui,
# .device/av_stub an import-time stand-in for PyAV (ComfyUI's video I/O imports it; nothing here decodes video) and
# .device/server-wheels what ComfyUI's server imports besides (benchmarks/server-wheels.sh; the server steps only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: steps run commands from other folders
STEP_TIMEOUT=${STEP_TIMEOUT:-420}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ -f .device/comfyui.tar.gz && -z "${COMFYUI_PATH:-}" ]]; then
  mkdir -p /tmp/comfyui && tar -xzf .device/comfyui.tar.gz -C /tmp/comfyui
  export COMFYUI_PATH=/tmp/comfyui
fi
python3 -c 'import av' 2>/dev/null || export PYTHONPATH=$PWD/.device/av_stub${PYTHONPATH:+:$PYTHONPATH}
export H3_FUSED_NVFP4_CACHE=${H3_FUSED_NVFP4_CACHE:-/tmp/h3_fused_nvfp4_cache} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
summary=()
for step in ${STEPS:-tests report}; do
  start=$SECONDS
  case "$step" in
    tests) timeout "$STEP_TIMEOUT" python3 -m pytest tests/test_gpu_*.py tests/test_linear*.py -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} \
             > "$OUT/tests.log" 2>&1; rc=$?; tail -3 "$OUT/tests.log" ;;
    emulated) H3_FUSED_NVFP4_EMULATE_BLACKWELL=1 H3_FUSED_NVFP4_CACHE=/tmp/h3_emulated_cache timeout "$STEP_TIMEOUT" \
             python3 -m pytest tests/test_gpu_pack_parity.py tests/test_gpu_block.py tests/test_gpu_selfcheck.py \
             tests/test_gpu_rms_rope.py tests/test_gpu_zimage_kernels.py tests/test_gpu_zimage_model.py \
             tests/test_gpu_wan_kernels.py tests/test_gpu_wan_block.py -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} \
             > "$OUT/emulated.log" 2>&1; rc=$?
             tail -3 "$OUT/emulated.log" ;;
    report) timeout "$STEP_TIMEOUT" python3 report.py --dram --ncu-timeout 300 --out "$OUT/report.json" > "$OUT/report.log" 2>&1; rc=$?
            tail -8 "$OUT/report.log" ;;
    report-static) timeout "$STEP_TIMEOUT" python3 report.py --dram --ncu-timeout 300 --all-static --out "$OUT/report-static.json" \
             > "$OUT/report-static.log" 2>&1; rc=$?; tail -8 "$OUT/report-static.log" ;;
    bench-pack) timeout "$STEP_TIMEOUT" python3 benchmarks/bench_pack.py --out "$OUT/pack.json" > "$OUT/pack.log" 2>&1
             rc=$?; tail -12 "$OUT/pack.log" ;;
    bench-pack-fp16) timeout "$STEP_TIMEOUT" python3 benchmarks/bench_pack.py --shapes wan --dtype fp16 \
             --out "$OUT/pack-fp16.json" > "$OUT/pack-fp16.log" 2>&1; rc=$?; tail -8 "$OUT/pack-fp16.log" ;;
    bench-rope) timeout "$STEP_TIMEOUT" python3 benchmarks/bench_rope.py --out "$OUT/rope.json" > "$OUT/rope.log" 2>&1
             rc=$?; tail -3 "$OUT/rope.log" ;;
    bench-zimage) timeout "$STEP_TIMEOUT" python3 benchmarks/bench_zimage_ops.py --ncu --out "$OUT/zimage-ops.json" \
             > "$OUT/zimage-ops.log" 2>&1; rc=$?; tail -8 "$OUT/zimage-ops.log" ;;
    bench-wan) timeout "$STEP_TIMEOUT" python3 benchmarks/bench_wan_kernels.py --model "${WAN_MODEL:-wan22_14b}" \
             --out "$OUT/wan-kernels.json" > "$OUT/wan-kernels.log" 2>&1; rc=$?; tail -10 "$OUT/wan-kernels.log" ;;
    trade) timeout "$STEP_TIMEOUT" python3 benchmarks/calibration_trade.py --out "$OUT/calibration-trade.json" \
             > "$OUT/trade.log" 2>&1; rc=$?; tail -12 "$OUT/trade.log" ;;
    sage) OUT="$OUT" timeout "$STEP_TIMEOUT" bash benchmarks/build_sageattention.sh 2>&1 | tee "$OUT/sage.log"
          rc=${PIPESTATUS[0]}; left=$((STEP_TIMEOUT - (SECONDS - start))); (( left < 150 )) && left=150
          if [[ $rc == 0 ]]; then
            export PYTHONPATH=${SAGE_BUILD:-/tmp/sageattention}${PYTHONPATH:+:$PYTHONPATH}
            export SAGE_SOURCE_COMMIT=${SAGE_SOURCE_COMMIT:-d1a57a546c3d395b1ffcbeecc66d81db76f3b4b5}
            SAGE_BLOCK_JSON="$OUT/sage-block.json" timeout "$left" python3 -m pytest \
              "tests/test_gpu_sage_block.py::test_full_width_block_with_sage_attention_bit_identical_and_copy_free" \
              -q -rs -s -p no:cacheprovider ${PYTEST_ARGS:-} >> "$OUT/sage.log" 2>&1; rc=$?
            grep -E "^sage block:|passed|failed|skipped|Error" "$OUT/sage.log" | tail -6
          fi ;;
    families) timeout "${FAMILIES_TIMEOUT:-560}" python3 benchmarks/families.py ${FAMILIES:+--families "$FAMILIES"} \
             ${FAMILIES_ARGS:-} --out "$OUT/families.json" > "$OUT/families.log" 2>&1; rc=$?; tail -10 "$OUT/families.log" ;;
    ab-previous) mkdir -p /tmp/previous && tar -xzf .device/previous.tar.gz -C /tmp/previous; rc=0
             for kind in dynamic static; do
               flag=$([[ $kind == static ]] && echo --all-static)
               for tree in new previous; do
                 dir=$([[ $tree == new ]] && echo . || echo /tmp/previous)
                 (cd "$dir" && timeout "$STEP_TIMEOUT" python3 report.py --dram --ncu-timeout 300 $flag \
                   --out "$OUT/ab-$tree-$kind.json") > "$OUT/ab-$tree-$kind.log" 2>&1 || rc=$?
               done
             done
             python3 benchmarks/ab_reports.py --new "$OUT/ab-new-dynamic.json" "$OUT/ab-new-static.json" \
               --previous "$OUT/ab-previous-dynamic.json" "$OUT/ab-previous-static.json" --labels dynamic static \
               --what "${AB_WHAT:-this tree against a previous one}" --out "$OUT/ab-previous.json" || rc=$? ;;
    full-model) timeout "$STEP_TIMEOUT" python3 benchmarks/full_model.py --out "$OUT/full-model.json" > "$OUT/full-model.log" 2>&1
             rc=$?; tail -4 "$OUT/full-model.log" ;;
    server|server-dram)
             if compgen -G ".device/server-wheels/*.whl" > /dev/null; then
               python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-server .device/server-wheels/*.whl
             fi
             [[ $step == server ]] && what=(--out "$OUT/server.json") || what=(--dram --out "$OUT/server-dram.json")
             PYTHONPATH=/tmp/site-server${PYTHONPATH:+:$PYTHONPATH} timeout "${SERVER_TIMEOUT:-560}" \
               python3 benchmarks/real_server.py "${what[@]}" ${SERVER_ARGS:-} > "$OUT/$step.log" 2>&1; rc=$?
             tail -16 "$OUT/$step.log" ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  summary+=("$step: exit $rc, $((SECONDS - start)) s")
done
printf '%s\n' "${summary[@]}" | tee "$OUT/steps.txt"
