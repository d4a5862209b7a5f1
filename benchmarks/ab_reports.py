"""Two trees of the pack side by side: the report (report.py --dram) of each, compared.

    python benchmarks/ab_reports.py --new new.json [new2.json ...] --previous prev.json [prev2.json ...] --out ab.json

Each report measures ComfyUI's real H3 block stock vs fused in one process; the comparison is of the fused arm:
its output bits (0 differing elements in every report), its DRAM bytes and launches (Nsight Compute) and its
non-GEMM non-attention time (Nsight Compute and torch.profiler), new over previous. Reports are paired in the
order given (run them interleaved: new, previous, new, previous). ``benchmarks/gpu_run.sh`` step ``ab-previous``
runs the reports and this.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def fused_figures(report: dict) -> dict:
    dram, summary = report["dram"], report["summary"]

    def arms(key):
        return {arm: dram[arm][key] for arm in ("comfy", "fused")}

    return {
        "dram_gb": arms("non_gemm_non_attention_dram_gb"),
        "launches_ncu": arms("non_gemm_non_attention_launches"),
        "non_gemm_non_attention_ms_ncu": arms("non_gemm_non_attention_ncu_ms"),
        "non_gemm_non_attention_ms_profiler": summary["non_gemm_non_attention_ms"],
        "block_ms_median": summary["block_ms_median"],
        "block_output_differing_elements": report["validation"]["block_output_differing_elements"],
    }


def compare(new: dict, previous: dict) -> dict:
    def ratio(key):
        return round(new[key]["fused"] / previous[key]["fused"], 5)

    return {"fused_dram_bytes_ratio": ratio("dram_gb"), "fused_launches": (new["launches_ncu"]["fused"],
                                                                          previous["launches_ncu"]["fused"]),
            "fused_ms_ncu_ratio": ratio("non_gemm_non_attention_ms_ncu"),
            "fused_ms_profiler_ratio": ratio("non_gemm_non_attention_ms_profiler")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", nargs="+", required=True)
    parser.add_argument("--previous", nargs="+", required=True)
    parser.add_argument("--labels", nargs="+", help="one per pair (default: pair 1, 2, ...)")
    parser.add_argument("--what", default="", help="what the two trees are")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if len(args.new) != len(args.previous):
        parser.error("as many new reports as previous ones")
    labels = args.labels or [f"pair {i + 1}" for i in range(len(args.new))]
    runs, ok = {}, True
    for label, new_path, prev_path in zip(labels, args.new, args.previous):
        new = fused_figures(json.loads(pathlib.Path(new_path).read_text()))
        prev = fused_figures(json.loads(pathlib.Path(prev_path).read_text()))
        runs[label] = {"new": new, "previous": prev, "new_vs_previous": compare(new, prev)}
        ok &= new["block_output_differing_elements"] == 0 == prev["block_output_differing_elements"]
    result = {"what": args.what, "command": " ".join(sys.argv[1:]), "runs": runs, "all_bit_identical": ok}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'pair':<16}{'dram new/prev':>14}{'ms ncu':>10}{'ms prof':>10}{'launches':>10}{'differing':>10}")
    for label, run in runs.items():
        c, n, p = run["new_vs_previous"], run["new"], run["previous"]
        print(f"{label:<16}{c['fused_dram_bytes_ratio']:>14.4f}{c['fused_ms_ncu_ratio']:>10.4f}"
              f"{c['fused_ms_profiler_ratio']:>10.4f}{n['launches_ncu']['fused']:>5}/{p['launches_ncu']['fused']:<4}"
              f"{n['block_output_differing_elements']:>6}/{p['block_output_differing_elements']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
