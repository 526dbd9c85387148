#!/usr/bin/env python3
"""Scale benchmark: real tensor counts and real dimensions.

    python3 bench/scale_bench.py [--build build/release] [--runs 3]
        [--config ../shared/data/models/deepseek-v3/config.json]

Two checkpoints are written once under BUILD/bench-cache with `ferry synth`:
- full size: `synth --sparse --from-config CONFIG` (DeepSeek-V3: about 1.37 TB of
  holes, 46,183 tensors; headers are real, data reads as zeros and costs no disk);
- real count: `synth --from-config CONFIG --scale-dims 64` (the same 46,183 tensors
  with every width scaled to hidden 64, real data, about 190 MB).

Rows, each a whole process, rounds in rotating order, medians (min-max):
- `ferry plan --tp 8 --ep 8 --ranks 0 --json` of the full-size checkpoint;
- `ferry load` of it with the same flags and `--devices null:1` (reads the rank's
  bytes, keeps none); its bytes read must equal the plan's read_bytes plus headers;
- `ferry load --tp 8 --ep 8 --devices host:8` of the real-count checkpoint, with
  the report's resolve + plan seconds (and, apart, its allocate seconds);
- Python safetensors opening every header of the real-count checkpoint and reading
  its index (`safe_open(f, 'np').keys()` per shard, json.load of the index): the
  target for ferry's resolve + plan.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_common import bench_args, cell, run_measured

PYTHON_OPEN_ALL = """
import json, os, sys
from safetensors import safe_open
d = sys.argv[1]
index = json.load(open(os.path.join(d, 'model.safetensors.index.json')))
n = 0
for f in sorted(set(index['weight_map'].values())):
    n += len(list(safe_open(os.path.join(d, f), 'np').keys()))
print(n)
"""


def synth(ferry, out, config, *extra):
    if not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        subprocess.run([ferry, "synth", "--from-config", config, "--out", out, "--no-fsync",
                        *extra], check=True)
    return out


def main():
    ap = bench_args(runs=3, model=False)
    ap.add_argument("--config", default="../shared/data/models/deepseek-v3/config.json")
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    cache = os.path.join(args.build, "bench-cache")
    name = os.path.basename(os.path.dirname(os.path.abspath(args.config)))
    full = synth(ferry, os.path.join(cache, name + "-sparse"), args.config, "--sparse", "--dtype", "bf16")
    scaled = synth(ferry, os.path.join(cache, name + "-h64"), args.config, "--scale-dims", "64")
    tmp = tempfile.mkdtemp(prefix="ferry-scale-bench-")
    layout = ["--tp", "8", "--ep", "8"]
    rows = {"plan": [], "load-null": [], "load-h64": [], "python-h64": []}
    rss = {k: [] for k in rows}
    checks = []
    phases = []
    allocate = []
    for r in range(args.runs):
        order = list(rows)
        order = order[r % len(order):] + order[:r % len(order)]
        for key in order:
            if key == "plan":
                s, m, out = run_measured([ferry, "plan", "--model", full, *layout, "--ranks", "0",
                                          "--json"])
                plan = json.loads(out)
            elif key == "load-null":
                report = os.path.join(tmp, "null.json")
                s, m, _ = run_measured([ferry, "load", "--model", full, *layout, "--ranks", "0",
                                        "--devices", "null:1", "--report", report])
                with open(report) as f:
                    null_report = json.load(f)
            elif key == "load-h64":
                report = os.path.join(tmp, "h64.json")
                s, m, _ = run_measured([ferry, "load", "--model", scaled, *layout, "--devices",
                                        "host:8", "--report", report])
                with open(report) as f:
                    rep = json.load(f)
                phases.append(rep["phases"]["resolve"] + rep["phases"]["plan"])
                allocate.append(rep["phases"]["allocate"])
            else:
                s, m, out = run_measured([sys.executable, "-c", PYTHON_OPEN_ALL, scaled])
                checks.append(int(out))
            rows[key].append(s)
            rss[key].append(m)
        headers = null_report["bytes_read"] - plan["totals"]["read_bytes"]
        print(f"round {r + 1}: plan read_bytes {plan['totals']['read_bytes']}, null load "
              f"bytes_read {null_report['bytes_read']} (headers {headers})", file=sys.stderr)

    print(f"full-size checkpoint: {plan['totals']['checkpoint_bytes'] / 1e12:.3f} TB, "
          f"{len(plan['tensors'])} tensors; rank 0 of tp 8 ep 8 reads "
          f"{plan['totals']['read_bytes'] / 1e9:.1f} GB")
    print(f"null load bytes_read {null_report['bytes_read']} = plan read_bytes "
          f"{plan['totals']['read_bytes']} + {null_report['bytes_read'] - plan['totals']['read_bytes']} "
          f"header bytes; real-count checkpoint: {checks[0]} tensors")
    print()
    print("| run | seconds | peak RSS MiB |")
    print("|---|---|---|")
    labels = {"plan": "ferry plan, full size, rank 0 of tp 8 ep 8",
              "load-null": "ferry load, full size, rank 0 of tp 8 ep 8, null:1",
              "load-h64": "ferry load, real count (h64), tp 8 ep 8, host:8",
              "python-h64": "python: every header + the index, real count (h64)"}
    for key, label in labels.items():
        print(f"| {label} | {cell(rows[key])} | {cell(rss[key], 1 / 2**20, '{:.0f}')} |")
    print()
    print(f"ferry load (h64) resolve + plan seconds: {cell(phases)}; python open-all / "
          f"(resolve + plan), median of rounds: "
          f"{statistics.median(p / q for p, q in zip(rows['python-h64'], phases)):.2f}; "
          f"allocate (the eight host devices' parameters) seconds: {cell(allocate)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
