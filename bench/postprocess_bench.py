#!/usr/bin/env python3
"""postprocess.target: what the post-processing phase costs (served-layouts issue).

    python3 bench/postprocess_bench.py [--build build/release] [--runs 3]
        [--config ../shared/data/models/deepseek-v3/config.json] [--skip-full]

Checkpoints are written once under BUILD/bench-cache with `ferry synth`:
- full size: `synth --sparse --from-config CONFIG` (DeepSeek-V3's FP8 checkpoint at
  its real shapes, 128 x 128 block scales; data are holes);
- medium: `synth --family llama --preset medium --quant fp8-tensor` (compressed-
  tensors per-tensor FP8 with static input scales) and the same for qwen3_moe
  (fused experts).

Rows, each a whole process, rounds in rotating order after one untimed run, medians
(min-max) of the report's seconds and its postprocess phase:
- full size, rank 0 of tp 8 / ep 8 with parallel.moe_a2a=deepep on `null:1`:
  `ferry plan --json` (its param bytes) and `ferry load` for loader and sm100 (the
  UE8M0 repack of every block-FP8 weight of the rank: the null device runs no
  kernel, so this is ferry's own cost of ordering and issuing the hooks);
- medium, tp 1 on `host:1` (the host device runs the FP8 operations on the CPU,
  the same arithmetic a GPU runs), hot page cache: loader and sm90 (every shard
  requantized to the largest scale, the input scales' max).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench_common import cell, run_measured


def synth(ferry, out, *args):
    if not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        subprocess.run([ferry, "synth", "--out", out, "--no-fsync", *args], check=True)
    return out


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
            print("| target | plan: params | plan: param bytes (GB) |")
            print("|---|---|---|")
            for target in ("loader", "sm90", "sm100"):
                _, _, out = run_measured([ferry, "plan", "--model", full, "--json", *flags,
                                          "--set", "postprocess.target=" + target])
                plan = json.loads(out)
                rank = plan["ranks"][0]
                print(f"| {target} | {rank['params']} | {rank['param_bytes'] / 1e9:.3f} |")
            res = rounds(["loader", "sm100"], args.runs,
                         lambda t: load(full, flags + ["--devices", "null:1"], t))
            print()
            print("| target | load seconds, null:1 | postprocess phase seconds |")
            print("|---|---|---|")
            for target, values in res.items():
                print(f"| {target} | {cell([v[0] for v in values])} | "
                      f"{cell([v[1] for v in values], fmt='{:.3f}')} |")
            print()

        for family in ("llama", "qwen3_moe"):
            model = synth(ferry, os.path.join(cache, f"{family}-medium-fp8-tensor"), "--family",
                          family, "--preset", "medium", "--quant", "fp8-tensor")
            warm(model)
            size = sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model)
                       if n.endswith(".safetensors"))
            res = rounds(["loader", "sm90"], args.runs,
                         lambda t: load(model, ["--devices", "host:1"], t))
            print(f"medium {family}, compressed-tensors FP8 per tensor, {size / 1e9:.2f} GB, "
                  f"host:1, hot, {args.runs} rounds")
            print("| target | load seconds | postprocess phase seconds |")
            print("|---|---|---|")
            for target, values in res.items():
                print(f"| {target} | {cell([v[0] for v in values])} | "
                      f"{cell([v[1] for v in values], fmt='{:.3f}')} |")
            print()


if __name__ == "__main__":
    main()
