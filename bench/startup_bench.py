#!/usr/bin/env python3
"""Startup benchmark: time-to-ready of the capture-safe boot, serial against overlap.

    python3 bench/startup_bench.py [--build build/release] [--model DIR] [--runs 3]
                                   [--captures 0.5,2,5]

On a `medium` Llama checkpoint (synthesized under BUILD/bench-cache unless --model
is given), every run is one process: `ferry load --startup MODE --capture-seconds C`
(prepare(), a stand-in capture of C seconds, commit()), whose report gives
time-to-ready (prepare() called .. ready). Configurations run in rotated order
inside every round (the prefetch alone is measured before them, then one untimed
warm-up load).

- hot: the files are in the page cache (read once before each run);
- cold: every file's pages are dropped with POSIX_FADV_DONTNEED before each run, and
  reads are buffered (overlap refuses io.direct).

Only the prefetch overlaps the capture, so the ideals are:
- serial:  C + load (the plain `ferry load` of the same temperature, same round);
- overlap: max(C, prefetch) + load from a warm cache, where prefetch is the time to
  read every planned file once with the prefetcher's settings (4 threads, 16 MiB
  blocks; measured here in Python with os.pread, which releases the GIL).
Reports medians (min-max) and the overlap / serial ratio of medians.
"""
import json
import os
import statistics
import tempfile
import threading
import time

from bench_common import bench_args, cell, drop_cache, medium_checkpoint, run_measured, warm_cache

PREFETCH_THREADS = 4
PREFETCH_BLOCK = 16 << 20


def prefetch_seconds(files):
    """Reads every file once in 16 MiB blocks handed to 4 threads, in file order."""
    blocks = []
    for path in files:
        size = os.path.getsize(path)
        blocks += [(path, off) for off in range(0, size, PREFETCH_BLOCK)]
    lock = threading.Lock()
    position = [0]

    def worker():
        fds = {}
        while True:
            with lock:
                if position[0] >= len(blocks):
                    break
                path, off = blocks[position[0]]
                position[0] += 1
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            os.pread(fd, PREFETCH_BLOCK, off)
        for fd in fds.values():
            os.close(fd)

    t = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(PREFETCH_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def main():
    ap = bench_args(runs=3)
    ap.add_argument("--captures", default="0.5,2,5")
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    model, files, nbytes = medium_checkpoint(args.build, args.model)
    captures = [float(c) for c in args.captures.split(",")]
    tmp = tempfile.mkdtemp(prefix="ferry-startup-bench-")

    def prepare_cache(temperature):
        if temperature == "cold":
            drop_cache(files)
        else:
            warm_cache(files)

    def ferry_load(name, *extra):
        report = os.path.join(tmp, name + ".json")
        run_measured([ferry, "load", "--model", model, "--report", report, *extra])
        with open(report) as f:
            return json.load(f)

    # [temperature][key] -> list of seconds
    results = {t: {} for t in ("hot", "cold")}

    def add(temperature, key, value):
        results[temperature].setdefault(key, []).append(value)

    configs = ["load"] + [(mode, c) for c in captures for mode in ("serial", "overlap")]

    def run_config(temperature, config):
        prepare_cache(temperature)
        if config == "load":
            add(temperature, "load", ferry_load("load")["seconds"])
        else:
            mode, c = config
            r = ferry_load(f"{mode}-{c}", "--startup", mode, "--capture-seconds", str(c))
            if r["startup_mode"] != mode:
                raise SystemExit(f"{mode} ran as {r['startup_mode']}: {r['startup_refusals']}")
            add(temperature, config, r["startup"]["time_to_ready"])
            if mode == "overlap":
                add(temperature, ("prefetched", c), r["startup"]["bytes_prefetched"])

    # The prefetch alone, before the rounds: a ferry process right after this Python
    # process has read and freed gigabytes pays seconds in its allocate phase (the
    # kernel reclaiming and compacting), so it is kept out of the timed rounds, and
    # one untimed load absorbs that.
    for _ in range(args.runs):
        for temperature in ("hot", "cold"):
            prepare_cache(temperature)
            add(temperature, "prefetch", prefetch_seconds(files))
    ferry_load("warm-up")
    for round_ in range(args.runs):
        # Rotated order: every configuration takes every position across rounds.
        order = configs[round_ % len(configs):] + configs[:round_ % len(configs)]
        for temperature in ("hot", "cold"):
            for config in order:
                run_config(temperature, config)
        print(f"round {round_ + 1}/{args.runs} done", flush=True)

    med = statistics.median
    print(f"\ncheckpoint: {model} ({nbytes / 1e9:.2f} GB, {len(files)} files), "
          f"{args.runs} rounds, medians (min-max), seconds")
    for temperature in ("hot", "cold"):
        r = results[temperature]
        load_hot = med(results["hot"]["load"])
        print(f"\n{temperature}: plain load {cell(r['load'])} s, prefetch alone "
              f"{cell(r['prefetch'])} s, load from a warm cache {load_hot:.2f} s")
        print("| C s | serial s | serial ideal (C + load) | overlap s | overlap ideal "
              "(max(C, prefetch) + warm load) | overlap / serial | prefetched during capture |")
        print("|---|---|---|---|---|---|---|")
        for c in captures:
            serial = r[("serial", c)]
            overlap = r[("overlap", c)]
            ideal_serial = c + med(r["load"])
            ideal_overlap = max(c, med(r["prefetch"])) + load_hot
            prefetched = r[("prefetched", c)]
            print(f"| {c:g} | {cell(serial)} | {ideal_serial:.2f} | {cell(overlap)} | "
                  f"{ideal_overlap:.2f} | {med(overlap) / med(serial):.2f} | "
                  f"{med(prefetched) / nbytes * 100:.0f}% |")


if __name__ == "__main__":
    main()
