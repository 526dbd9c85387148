#!/usr/bin/env python3
"""Online FP8 quantization: layered against not layered (quantized-checkpoints issue).

    python3 bench/online_quant_bench.py [--build build/release] [--model DIR] [--runs 5]
                                        [--tp 1] [--online fp8_channel]

On a `medium` Llama checkpoint (BF16, synthesized under BUILD/bench-cache unless --model
is given), from the page cache, every run one `ferry load` process onto host devices
with a JSON report:

- plain:    the BF16 load, no quantization (the reference peak: the BF16 model);
- online:   quantization.online, the full-precision weights allocated up front and
            freed at the end (SGLang's peak: the whole BF16 model, plus the FP8 one);
- layered:  quantization.online with load.layered, each full-precision weight
            allocated on its first write and freed right after its quantization.

Configurations run in rotated order in every round, after one untimed load. Reports
medians (min-max) of the load's seconds and of each device's allocation high water
(the report's peak_device_bytes), and each peak's ratio to plain's.
"""
import argparse
import json
import os
import statistics
import tempfile

from bench_common import cell, medium_checkpoint, run_measured

CONFIGS = {
    "plain": [],
    "online": ["--set", "quantization.online={online}"],
    "layered": ["--set", "quantization.online={online}", "--set", "load.layered=true"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build/release")
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--online", default="fp8_channel")
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    model, files, total = medium_checkpoint(args.build, args.model)
    for path in files:  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    seconds = {name: [] for name in CONFIGS}
    peaks = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")

        def load(name):
            extra = [a.format(online=args.online) for a in CONFIGS[name]]
            cmd = [ferry, "load", "--model", model, "--tp", str(args.tp), "--report", report]
            run_measured(cmd + extra)
            with open(report) as f:
                r = json.load(f)
            return r["seconds"], max(r["peak_device_bytes"].values())

        load("plain")  # untimed
        names = list(CONFIGS)
        for i in range(args.runs):
            for name in names[i % len(names):] + names[:i % len(names)]:
                s, peak = load(name)
                seconds[name].append(s)
                peaks[name].append(peak)
    print(f"medium Llama, {total / 1e9:.2f} GB BF16 in {len(files)} files, tp {args.tp}, "
          f"quantization.online={args.online}, hot, {args.runs} rounds")
    print("| load | seconds | peak device bytes (GB) | peak / plain |")
    print("|---|---|---|---|")
    plain = statistics.median(peaks["plain"])
    for name in CONFIGS:
        ratio = statistics.median(peaks[name]) / plain
        print(f"| {name} | {cell(seconds[name])} | {cell(peaks[name], 1e-9, '{:.3f}')} | "
              f"{ratio:.2f} |")


if __name__ == "__main__":
    main()
