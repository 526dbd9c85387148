#!/usr/bin/env python3
"""postprocess.target: what the post-processing costs (served-layouts issue).

    python3 bench/postprocess_bench.py [--build build/release] [--runs 3]
        [--config ../shared/data/models/deepseek-v3/config.json] [--skip-full]

Checkpoints are written once under BUILD/bench-cache with `ferry synth`:
- full size: `synth --sparse --from-config CONFIG` (DeepSeek-V3's FP8 checkpoint at
  its real shapes, 128 x 128 block scales; data are holes);
- medium: `synth --family F --preset medium --quant Q`: DeepSeek-V3 with FP8
  128 x 128 blocks, Llama and Qwen3-MoE with compressed-tensors per-tensor FP8 and
  static input scales, and with NVFP4.

Rows:
- full size, rank 0 of tp 8 / ep 8 with parallel.moe_a2a=deepep: `ferry plan --json`
  per target, the rank's params and param bytes (the load-only loaded scales
  included). A load on the null device runs no hook (it keeps no data: the
  report's hooks_skipped), so the time is measured on the host device below.
- medium, tp 1 on `host:1` (its FP8 operations are the CPU's, the arithmetic a GPU
  runs), hot page cache, each load a whole process, rounds in rotated order after
  one untimed load, medians (min-max) of the report's seconds and its postprocess
  phase (the hooks run as their layers complete, overlapping the stream; the phase
  is what is left after the last copy): loader against the target (DeepSeek-V3:
  sm100 with DeepEP, every weight's UE8M0 repack; the FP8 others: sm90, every shard
  requantized to the largest scale; NVFP4: sm90's Marlin repack, and sm100's
  swizzled scales and experts (flashinfer_trtllm's shuffles for Qwen3-MoE, the
  default runner's swizzle for Mixtral); block FP8 DeepSeek-V3 on sm100 without
  DeepEP: its experts loaded up rows first for flashinfer_trtllm; unquantized
  Qwen3-MoE on sm100: flashinfer_trtllm's BF16 block layout of its experts; ModelOpt
  FP8 Qwen3-MoE on sm100: flashinfer_trtllm's per-tensor FP8 experts).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

from bench_common import cell, run_measured
from bench_common import synth_once as synth


def warm(folder):
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                while f.read(64 << 20):
                    pass


def rounds(configs, runs, run_one):
    """{name: [result, ...]}: one untimed run of the first config, then `runs` rounds
    in rotated order."""
    out = {name: [] for name in configs}
    names = list(configs)
    run_one(names[0])
    for i in range(runs):
        for name in names[i % len(names):] + names[:i % len(names)]:
            out[name].append(run_one(name))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build/release")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--config", default="../shared/data/models/deepseek-v3/config.json")
    ap.add_argument("--skip-full", action="store_true")
    ap.add_argument("--only", action="append", default=[],
                    help="medium rows to run, as FAMILY-QUANT (qwen3_moe-none); default all")
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    cache = os.path.join(args.build, "bench-cache")

    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")

        def load(model, flags, target):
            cmd = [ferry, "load", "--model", model, "--report", report, *flags,
                   "--set", "postprocess.target=" + target]
            run_measured(cmd)
            with open(report) as f:
                r = json.load(f)
            if r["postprocess_target"] != target:
                sys.exit(f"report says {r['postprocess_target']}, not {target}")
            return r["seconds"], r["phases"]["postprocess"]

        if not args.skip_full:
            full = synth(ferry, os.path.join(cache, "deepseek-v3-full-sparse"), "--from-config",
                         args.config, "--sparse")
            flags = ["--tp", "8", "--ep", "8", "--ranks", "0", "--set",
                     "parallel.moe_a2a=deepep"]
            print("full-size DeepSeek-V3 FP8 (sparse), rank 0 of tp 8 / ep 8, deepep")
            print("| target | plan seconds | params | param bytes (GB) |")
            print("|---|---|---|---|")
            for target in ("loader", "sm90", "sm100"):
                secs = []
                for _ in range(args.runs):
                    seconds, _, out = run_measured([ferry, "plan", "--model", full, "--json",
                                                    *flags, "--set",
                                                    "postprocess.target=" + target])
                    secs.append(seconds)
                plan = json.loads(out)
                rank = plan["ranks"][0]
                print(f"| {target} | {cell(secs)} | {rank['params']} | "
                      f"{rank['param_bytes'] / 1e9:.3f} |")
            print()

        mediums = [
            ("deepseek_v3", "fp8-block", ("sm100",), ["--set", "parallel.moe_a2a=deepep"]),
            ("llama", "fp8-tensor", ("sm90",), []),
            ("qwen3_moe", "fp8-tensor", ("sm90",), []),
            ("llama", "nvfp4", ("sm90", "sm100"), []),
            ("qwen3_moe", "nvfp4", ("sm90", "sm100"), []),
            # sm100's experts: flashinfer_trtllm's shuffles (Qwen3-MoE above), the
            # CUTLASS branch's swizzle (Mixtral), block FP8 loaded up rows first
            # (DeepSeek-V3 without DeepEP).
            ("mixtral", "nvfp4", ("sm100",), []),
            ("deepseek_v3", "fp8-block", ("sm100",), []),
            # Unquantized experts under flashinfer_trtllm: BF16 blocks, in place.
            ("qwen3_moe", "none", ("sm100",), []),
            # Per-tensor FP8 experts under flashinfer_trtllm (ModelOpt): requantized,
            # reordered and shuffled in place, and their output scales.
            ("qwen3_moe", "modelopt-fp8", ("sm100",), []),
        ]
        for family, quant, targets, extra in mediums:
            if args.only and f"{family}-{quant}" not in args.only:
                continue
            model = synth(ferry, os.path.join(cache, f"{family}-medium-{quant}"), "--family",
                          family, "--preset", "medium", "--quant", quant)
            warm(model)
            size = sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model)
                       if n.endswith(".safetensors"))
            flags = ["--tp", "1", "--devices", "host:1", *extra]
            res = rounds(["loader", *targets], args.runs, lambda t: load(model, flags, t))
            print(f"medium {family}, {quant}, {size / 1e9:.2f} GB, tp 1, host:1, hot, "
                  f"{args.runs} rounds{' (deepep)' if extra else ''}")
            print("| target | load seconds | postprocess phase seconds |")
            print("|---|---|---|")
            for name, values in res.items():
                print(f"| {name} | {cell([v[0] for v in values])} | "
                      f"{cell([v[1] for v in values], fmt='{:.3f}')} |")
            for target in targets:
                ratio = statistics.median(v[0] for v in res[target]) / statistics.median(
                    v[0] for v in res["loader"])
                print(f"{target} / loader, load seconds: {ratio:.2f}")
            print()

if __name__ == "__main__":
    main()
