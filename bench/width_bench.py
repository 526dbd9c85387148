#!/usr/bin/env python3
"""Read-width benchmark (the real-scale issue, part 2): read lanes, single-copy
reads, and the whole process against the SGLang path, hot and cold.

    python3 bench/width_bench.py [--build build/release] [--model DIR] [--runs 5]
                                 [--cold-runs 3] [--python .venv-bench/bin/python]
                                 [--memory warm|idle]

On the `medium` Llama checkpoint (synthesized under BUILD/bench-cache unless --model
is given), every configuration runs as its own process, once per round, in an order
that rotates between rounds (../shared/notes/benchmarks.md).

Hot (the files in the page cache, warmed once with `cat`):
- `cat FILES > /dev/null`: the floor, and the rate the stream phase is held to;
- `ferry load` tp 1 on a host device with the defaults (read lanes auto,
  io.direct_to_device auto);
- `ferry load` tp 1 with io.read_lanes 1, 2, 3, 4 (single-copy reads on);
- `ferry load` tp 1 with one lane and io.direct_to_device=off: the pipeline as it
  was before this issue; and with 2 and 4 lanes, staged only;
- `ferry load` tp 1 with host.huge_pages=true;
- `ferry load` tp 2, rank 0 only, defaults;
- the SGLang path in Python (bench/peers/peer_sglang.py) at tp 1 and tp 2 (rank 0).

Cold (each run starts with the files' pages dropped):
- `dd if=F of=/dev/null bs=4M iflag=direct` per file, in one shell;
- `ferry load` tp 1 with io.direct (and io.drop_cache), read lanes auto and 1.

Memory (--memory): on these virtual machines, committing fresh memory costs far
more when the guest's free memory has gone back to the hypervisor (after a few idle
seconds) than right after another process freed some. Every process here (ferry,
`cat`, the Python peers) allocates, so each run starts from the same state:
- warm: right after a primer process committed and freed 2.5 GB
  (`dd bs=2500M count=1` from /dev/zero), the state of back-to-back loads;
- idle: after 5 idle seconds, the state of a process starting on a quiet machine.

Figures: stream rate = tensor bytes read / stream-phase seconds (from the load
report), compared with file bytes / `cat` (or `dd`) seconds of the same round;
whole-process seconds and their ratio to the SGLang path; how much of ferry's
time is the allocate phase (committing host-device memory page by page).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import bench_args, cell, medium_checkpoint, run_measured

HERE = os.path.dirname(os.path.abspath(__file__))
TP1 = "parallel.tp=1"  # the embedded default is tp 2


def main():
    ap = bench_args()
    ap.add_argument("--cold-runs", type=int, default=3)
    ap.add_argument("--python", default=os.environ.get("FERRY_BENCH_PYTHON", ".venv-bench/bin/python"))
    ap.add_argument("--memory", choices=["warm", "idle"], default="warm")
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    model, files, nbytes = medium_checkpoint(args.build, args.model)
    tmp = tempfile.mkdtemp(prefix="ferry-width-bench-")
    have_python = os.path.exists(args.python)
    if not have_python:
        print(f"note: no {args.python} (scripts/bench-venv.sh makes it): the SGLang path is skipped")

    def ferry_load(name, sets):
        def run():
            report = os.path.join(tmp, name + ".json")
            argv = [ferry, "load", "--model", model, "--quiet", "--report", report]
            for s in sets:
                argv += ["--set", s]
            seconds, rss, _ = run_measured(argv)
            with open(report) as f:
                return {"wall": seconds, "rss": rss, "report": json.load(f)}
        return run

    def plain(argv):
        def run():
            seconds, rss, _ = run_measured(argv)
            return {"wall": seconds, "rss": rss}
        return run

    hot = {
        "cat": plain(["sh", "-c", 'cat "$@" > /dev/null', "cat", *files]),
        "ferry tp1 defaults": ferry_load("d1", [TP1]),
        "ferry tp1 lanes 1": ferry_load("l1", [TP1, "io.read_lanes=1"]),
        "ferry tp1 lanes 2": ferry_load("l2", [TP1, "io.read_lanes=2"]),
        "ferry tp1 lanes 3": ferry_load("l3", [TP1, "io.read_lanes=3"]),
        "ferry tp1 lanes 4": ferry_load("l4", [TP1, "io.read_lanes=4"]),
        "ferry tp1 lanes 1, staged only": ferry_load("old", [TP1, "io.read_lanes=1",
                                                             "io.direct_to_device=off"]),
        "ferry tp1 lanes 2, staged only": ferry_load("s2", [TP1, "io.read_lanes=2",
                                                            "io.direct_to_device=off"]),
        "ferry tp1 lanes 4, staged only": ferry_load("s4", [TP1, "io.read_lanes=4",
                                                            "io.direct_to_device=off",
                                                            "io.staging_bytes=32MiB"]),
        "ferry tp1 huge pages": ferry_load("hp", [TP1, "host.huge_pages=true"]),
        "ferry tp2 rank 0": ferry_load("t2", ["parallel.tp=2", "parallel.ranks=0"]),
    }
    if have_python:
        peer = os.path.join(HERE, "peers", "peer_sglang.py")
        hot["SGLang path tp1"] = plain([args.python, peer, model, "1"])
        hot["SGLang path tp2 rank 0"] = plain([args.python, peer, model, "2"])
    cold = {
        "dd iflag=direct": plain(["sh", "-c",
                                  'for f in "$@"; do dd if="$f" of=/dev/null bs=4M iflag=direct '
                                  '2>/dev/null; done', "dd", *files]),
        "ferry tp1 io.direct": ferry_load("c", [TP1, "io.direct=true", "io.drop_cache=true"]),
        "ferry tp1 io.direct 4 MiB x QD 16": ferry_load("c4", [
            TP1, "io.direct=true", "io.drop_cache=true", "io.chunk_bytes=4MiB",
            "io.queue_depth=16"]),
    }

    def drop():
        # posix_fadvise(DONTNEED) on every file, as ferry's io.drop_cache does.
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    def settle():
        if args.memory == "warm":
            subprocess.run(["dd", "if=/dev/zero", "of=/dev/null", "bs=2500M", "count=1"],
                           check=True, stderr=subprocess.DEVNULL)
        else:
            time.sleep(5)

    def drop_and_settle():
        drop()
        settle()

    def rounds(configs, runs, before):
        out = {k: [] for k in configs}
        names = list(configs)
        for r in range(runs):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                before()
                out[name].append(configs[name]())
            print(f"round {r + 1}/{runs} done", file=sys.stderr)
        return out

    subprocess.run(["cat"] + files, check=True, stdout=subprocess.DEVNULL)  # warm the cache
    h = rounds(hot, args.runs, settle)
    c = rounds(cold, args.cold_runs, drop_and_settle)

    def tensor_bytes(res):
        paths = res["report"]["read_paths"]
        return paths["direct_to_device"] + paths["staged"]

    def stream_rates(results):
        return [tensor_bytes(x) / x["report"]["phases"]["stream"] / 1e9 for x in results]

    def walls(results):
        return [x["wall"] for x in results]

    cat_rate = [nbytes / x["wall"] / 1e9 for x in h["cat"]]
    dd_rate = [nbytes / x["wall"] / 1e9 for x in c["dd iflag=direct"]]
    print(f"\nmedium Llama: {nbytes / 1e9:.2f} GB in {len(files)} files; medians of "
          f"{args.runs} hot and {args.cold_runs} cold rounds, (min-max); memory {args.memory}\n")
    print("| hot | whole process s | stream GB/s | stream ÷ cat rate | allocate s "
          "| allocate share | lanes | direct GB | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    cat_med = statistics.median(cat_rate)
    for name, results in h.items():
        if "report" not in results[0]:
            print(f"| {name} | {cell(walls(results))} | {cell([nbytes / x['wall'] / 1e9 for x in results])} "
                  f"(file bytes) | | | | | | {statistics.median(x['rss'] for x in results) / 2**20:.0f} |")
            continue
        rates = stream_rates(results)
        alloc = [x["report"]["phases"]["allocate"] for x in results]
        share = [x["report"]["phases"]["allocate"] / x["report"]["seconds"] for x in results]
        rep = results[0]["report"]
        print(f"| {name} | {cell(walls(results))} | {cell(rates)} | "
              f"{statistics.median(rates) / cat_med:.2f} | {cell(alloc)} | "
              f"{statistics.median(share):.2f} | {rep['read_lanes']} | "
              f"{rep['read_paths']['direct_to_device'] / 1e9:.2f} | "
              f"{statistics.median(x['rss'] for x in results) / 2**20:.0f} |")
    dd_med = statistics.median(dd_rate)
    print("\n| cold | whole process s | stream GB/s | stream ÷ dd rate | lanes |")
    print("|---|---|---|---|---|")
    for name, results in c.items():
        if "report" not in results[0]:
            print(f"| {name} | {cell(walls(results))} | {cell(dd_rate)} (file bytes) | | |")
            continue
        rates = stream_rates(results)
        print(f"| {name} | {cell(walls(results))} | {cell(rates)} | "
              f"{statistics.median(rates) / dd_med:.2f} | {results[0]['report']['read_lanes']} |")
    if have_python:
        print()
        for tp, ours, theirs in ((1, "ferry tp1 defaults", "SGLang path tp1"),
                                 (2, "ferry tp2 rank 0", "SGLang path tp2 rank 0")):
            ratio = statistics.median(walls(h[theirs])) / statistics.median(walls(h[ours]))
            print(f"whole process, tp {tp}: SGLang path ÷ ferry = {ratio:.2f}")


if __name__ == "__main__":
    main()
