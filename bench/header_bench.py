#!/usr/bin/env python3
"""Header benchmark: `ferry inspect F` against the official Python safetensors
opening the same file, for single-file headers of many tensors.

    python3 bench/header_bench.py [--build build/release] [--runs 5] [--sizes 1000,16000,100000,1000000]

Each file holds N BF16 tensors of shape [4, 4] (32 bytes each). Up to 100,000 they
carry DeepSeek-V3's expert names (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight);
the 1,000,000-entry file uses short names (t0, t1, ...) so that its header stays
under the 100 MB limit both readers enforce. Files are written once under
BUILD/bench-cache/headers.

Per round, each reader runs once as its own process, in rotating order:
- ferry: `ferry inspect F` (the human listing, to /dev/null);
- python: `python3 -c "from safetensors import safe_open; safe_open(F, 'np').keys()"`.
Reports the median, min and max wall seconds of the whole process, peak RSS, and
the ratio python seconds / ferry seconds per round (above 1: ferry is faster).
"""
import json
import os
import statistics
import struct
import sys

from bench_common import bench_args, cell, run_measured

PYTHON_OPEN = "import sys; from safetensors import safe_open; safe_open(sys.argv[1], 'np').keys()"


def names(n):
    if n >= 1_000_000:
        return [f"t{i}" for i in range(n)]
    out = []
    layer = 0
    while len(out) < n:
        for e in range(256):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out.append(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight")
        layer += 1
    return out[:n]


def header_file(folder, n):
    """Writes (once) a safetensors file of n [4, 4] BF16 tensors; returns its path."""
    path = os.path.join(folder, f"headers-{n}.safetensors")
    if os.path.exists(path):
        return path
    header = {}
    for i, name in enumerate(names(n)):
        header[name] = {"dtype": "BF16", "shape": [4, 4], "data_offsets": [32 * i, 32 * (i + 1)]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + 32 * n)
    os.rename(tmp, path)
    return path


def main():
    ap = bench_args(model=False)
    ap.add_argument("--sizes", default="1000,16000,100000,1000000")
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    folder = os.path.join(args.build, "bench-cache", "headers")
    os.makedirs(folder, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]

    print("| tensors | header MB | ferry inspect s | python safe_open s | ratio (python / ferry) "
          "| ferry peak RSS MiB | python peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        path = header_file(folder, n)
        with open(path, "rb") as f:
            header_mb = struct.unpack("<Q", f.read(8))[0] / 1e6
        commands = {"ferry": [ferry, "inspect", path],
                    "python": [sys.executable, "-c", PYTHON_OPEN, path]}
        seconds = {k: [] for k in commands}
        rss = {k: [] for k in commands}
        order = list(commands)
        for r in range(args.runs):
            for key in order[r % 2:] + order[:r % 2]:
                s, m, _ = run_measured(commands[key], capture=False)
                seconds[key].append(s)
                rss[key].append(m)
        ratio = [p / f for p, f in zip(seconds["python"], seconds["ferry"])]
        print(f"| {n:,} | {header_mb:.1f} | {cell(seconds['ferry'], fmt='{:.3f}')} "
              f"| {cell(seconds['python'], fmt='{:.3f}')} "
              f"| {statistics.median(ratio):.2f} | {statistics.median(rss['ferry']) / 2**20:.0f} "
              f"| {statistics.median(rss['python']) / 2**20:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
