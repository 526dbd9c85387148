#!/usr/bin/env python3
"""Expert-parallel read skipping: one rank of ep = 8 against the whole checkpoint.

    python3 bench/ep_bench.py [--build build/bench] [--model DIR] [--runs 5]

On a DeepSeek-V3-shaped `medium` checkpoint (synthesized under BUILD/bench-cache
unless --model is given), from the page cache, interleaving inside every round:

- `ferry load --tp 1` (one rank holds everything: every byte is read);
- `ferry load --tp 8 --ep 8 --ranks 0` (one rank of eight: its share of the
  attention and dense layers, the replicated tensors, and 1/8 of the experts).

Reports bytes read (from the load report), the bytes `ferry plan` says the rank
needs, whole-load and stream seconds (medians), and the ratios.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_common import bench_args


def checkpoint(build, model):
    ferry = os.path.join(build, "ferry")
    model = model or os.path.join(build, "bench-cache", "deepseek_v3-medium-seed1")
    if not os.path.exists(os.path.join(model, "model.safetensors.index.json")):
        os.makedirs(os.path.dirname(model), exist_ok=True)
        subprocess.run([ferry, "synth", "--family", "deepseek_v3", "--preset", "medium", "--out",
                        model], check=True)
    files = sorted(os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors"))
    return model, files


def main():
    ap = bench_args(build="build/bench")
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    model, files = checkpoint(args.build, args.model)
    total = sum(os.path.getsize(f) for f in files)
    subprocess.run(["cat"] + files, check=True, stdout=subprocess.DEVNULL)  # warm the cache
    tmp = tempfile.mkdtemp(prefix="ferry-ep-bench-")
    layouts = {"whole (tp 1)": ["--tp", "1"],
               "one rank of ep 8 (tp 8, rank 0)": ["--tp", "8", "--ep", "8", "--ranks", "0"]}
    plans = {}
    for name, flags in layouts.items():
        out = subprocess.run([ferry, "plan", "--model", model, "--json", *flags], check=True,
                             capture_output=True, text=True).stdout
        plans[name] = json.loads(out)["totals"]
    rows = {name: [] for name in layouts}
    for _ in range(args.runs):
        for name, flags in layouts.items():
            report = os.path.join(tmp, "r.json")
            p = subprocess.run([ferry, "load", "--model", model, "--report", report, *flags],
                               capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"ferry load {' '.join(flags)} failed:\n{p.stderr}")
            with open(report) as f:
                rows[name].append(json.load(f))
    med = statistics.median
    print(f"checkpoint: {model} ({len(files)} files, {total / 1e9:.2f} GB), {args.runs} rounds, "
          "medians")
    print()
    print("| layout | tensor bytes the plan reads | bytes read | of the files | whole load s | "
          "stream s |")
    print("|---|---|---|---|---|---|")
    for name in layouts:
        rs = rows[name]
        read = rs[0]["bytes_read"]
        print(f"| {name} | {plans[name]['read_bytes'] / 1e9:.3f} GB | {read / 1e9:.3f} GB | "
              f"{read / total:.3f} | {med([r['seconds'] for r in rs]):.2f} | "
              f"{med([r['phases']['stream'] for r in rs]):.2f} |")
    names = list(layouts)
    a, b = rows[names[0]], rows[names[1]]
    print()
    print(f"bytes read, one rank of ep 8 / whole: {b[0]['bytes_read'] / a[0]['bytes_read']:.3f}; "
          f"whole-load time ratio: {med([r['seconds'] for r in b]) / med([r['seconds'] for r in a]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
