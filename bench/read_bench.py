#!/usr/bin/env python3
"""Read benchmark: ferry's byte readers vs `cat` and `dd` over a checkpoint.

    python3 bench/read_bench.py [--build build/release] [--model DIR] [--hot-runs 5]
                                [--cold-runs 3] [--out results.md]

Synthesizes a `medium` Llama checkpoint (>= 2 GiB) under BUILD/bench-cache unless
--model is given, then measures, interleaving configurations inside every round so
that the noisy shared disk hits all of them alike:

- hot (page cache): io_uring at queue depths 1/4/16 x chunks 1/4/16 MiB, pread,
  and `cat FILES > /dev/null`;
- cold (pages dropped with posix_fadvise(DONTNEED) before every run): O_DIRECT
  io_uring at the same depths and chunks, O_DIRECT pread, and
  `dd iflag=direct bs=4M` of each file.

Prints medians (GB/s, 1e9 bytes/s) and the ratio of the best ferry configuration
to the raw baseline measured in the same run.
"""
import os
import statistics
import subprocess
import sys
import time

from bench_common import bench_args, medium_checkpoint

MiB = 1 << 20


def run_bench(exe, files, engine, qd, chunk, direct):
    cmd = [exe, "--engine", engine, "--qd", str(qd), "--chunk", str(chunk)]
    if direct:
        cmd.append("--direct")
    out = subprocess.run(cmd + files, check=True, capture_output=True, text=True).stdout
    fields = dict(kv.split("=") for kv in out.split())
    return float(fields["gbps"])


def timed(cmd_list, nbytes):
    t = time.perf_counter()
    for cmd in cmd_list:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return nbytes / (time.perf_counter() - t) / 1e9


def main():
    ap = bench_args(runs=None)
    ap.add_argument("--hot-runs", type=int, default=5)
    ap.add_argument("--cold-runs", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()

    exe = os.path.join(args.build, "ferry_read_bench")
    model, files, nbytes = medium_checkpoint(args.build, args.model)

    def evict():
        subprocess.run([exe, "--evict"] + files, check=True)

    hot = {}
    for qd in (1, 4, 16):
        for c in (1, 4, 16):
            hot[f"uring qd{qd} {c}MiB"] = lambda qd=qd, c=c: run_bench(exe, files, "uring", qd, c * MiB, False)
    hot["pread 4MiB"] = lambda: run_bench(exe, files, "pread", 1, 4 * MiB, False)
    hot["cat"] = lambda: timed([["cat"] + files], nbytes)

    cold = {}
    for qd in (1, 4, 16):
        for c in (1, 4, 16):
            cold[f"uring O_DIRECT qd{qd} {c}MiB"] = lambda qd=qd, c=c: run_bench(exe, files, "uring", qd, c * MiB, True)
    cold["pread O_DIRECT 4MiB"] = lambda: run_bench(exe, files, "pread", 1, 4 * MiB, True)
    cold["dd iflag=direct bs=4M"] = lambda: timed(
        [["dd", f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"] for f in files], nbytes)

    results = {k: [] for k in list(hot) + list(cold)}
    subprocess.run(["cat"] + files, check=True, stdout=subprocess.DEVNULL)  # warm the cache
    for _ in range(args.hot_runs):
        for name, fn in hot.items():
            results[name].append(fn())
    for _ in range(args.cold_runs):
        for name, fn in cold.items():
            evict()
            results[name].append(fn())

    lines = [f"checkpoint: {model} ({len(files)} files, {nbytes / 1e9:.2f} GB)",
             f"hot runs: {args.hot_runs}, cold runs: {args.cold_runs}; GB/s = 1e9 bytes/s", "",
             "| configuration | median GB/s | min | max |", "|---|---|---|---|"]
    for name, v in results.items():
        lines.append(f"| {name} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    med = {k: statistics.median(v) for k, v in results.items()}
    best_hot = max((k for k in hot if k != "cat"), key=lambda k: med[k])
    best_uring_hot = max((k for k in hot if k.startswith("uring")), key=lambda k: med[k])
    best_cold = max((k for k in cold if k.startswith("uring")), key=lambda k: med[k])
    lines += ["",
              f"best hot ferry reader: {best_hot}: {med[best_hot]:.2f} GB/s = "
              f"{med[best_hot] / med['cat']:.2f} x cat ({med['cat']:.2f})",
              f"best hot io_uring: {best_uring_hot}: {med[best_uring_hot]:.2f} GB/s = "
              f"{med[best_uring_hot] / med['cat']:.2f} x cat",
              f"best cold O_DIRECT io_uring: {best_cold}: {med[best_cold]:.2f} GB/s = "
              f"{med[best_cold] / med['dd iflag=direct bs=4M']:.2f} x dd iflag=direct "
              f"({med['dd iflag=direct bs=4M']:.2f})"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
