#!/usr/bin/env python3
"""Load benchmark: `ferry load` of a checkpoint onto host devices vs `cat`.

    python3 bench/load_bench.py [--build build/release] [--model DIR] [--runs 5]

On a `medium` Llama checkpoint (synthesized under BUILD/bench-cache unless --model
is given), interleaving the configurations inside every round:

- `cat FILES > /dev/null` (the raw rate from the page cache);
- `ferry_read_bench` with the reader settings the load uses by default (io_uring,
  QD 4, 1 MiB) — the read stage alone;
- `ferry_staged_probe` with the default staging pool (8 x 1 MiB): the smallest
  two-thread read-then-copy pipeline, no actors and no checks — the ceiling for any
  staged loader on this machine;
- `ferry load` with tp 1 and tp 2 on host devices, uncapped;
- `ferry load` tp 1 with the host device's bandwidth cap set to the read-alone rate
  of that round, so reading and copying are equally slow: a serial pipeline would
  take twice as long as either stage; overlap efficiency = stream seconds / the
  slower stage alone (1.0 is perfect overlap).

Peak RSS is measured from outside each process (wait4's ru_maxrss); "beyond the
params" subtracts the bytes of the loaded parameters, which host devices keep in
RAM. Reports medians, and ratios measured in the same run.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_common import bench_args, medium_checkpoint, run_measured

# ferry's defaults (runtime/load_config.hpp), which the comparison rows use too.
QUEUE_DEPTH = 4
CHUNK = 1 << 20
BUFFERS = 8


def main():
    ap = bench_args()
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    bench = os.path.join(args.build, "ferry_read_bench")
    probe = os.path.join(args.build, "ferry_staged_probe")
    model, files, nbytes = medium_checkpoint(args.build, args.model)
    tmp = tempfile.mkdtemp(prefix="ferry-load-bench-")
    subprocess.run(["cat"] + files, check=True, stdout=subprocess.DEVNULL)  # warm the cache

    def load(name, *extra):
        report = os.path.join(tmp, name + ".json")
        seconds, rss, _ = run_measured([ferry, "load", "--model", model, "--report", report, *extra])
        with open(report) as f:
            r = json.load(f)
        return {"wall": seconds, "rss": rss, "report": r}

    rows = {k: [] for k in ("cat", "read", "probe", "tp1", "tp2", "capped")}
    for _ in range(args.runs):
        s, _, _ = run_measured(["cat"] + files, capture=False)
        rows["cat"].append(nbytes / s / 1e9)
        _, _, out = run_measured([bench, "--engine", "uring", "--qd", str(QUEUE_DEPTH), "--chunk",
                                  str(CHUNK)] + files)
        read_gbps = float(dict(kv.split("=") for kv in out.split())["gbps"])
        rows["read"].append(read_gbps)
        _, _, out = run_measured([probe, "--chunk", str(CHUNK), "--buffers", str(BUFFERS)] + files)
        rows["probe"].append(float(dict(kv.split("=") for kv in out.split())["gbps"]))
        rows["tp1"].append(load("tp1", "--tp", "1"))
        rows["tp2"].append(load("tp2", "--tp", "2"))
        capped = load("capped", "--tp", "1", "--set", f"host.bandwidth_gbps={read_gbps:.3f}")
        rep = capped["report"]
        read_alone = rep["bytes_read"] / (read_gbps * 1e9)
        copy_alone = rep["bytes_copied"] / (read_gbps * 1e9)
        capped["efficiency"] = rep["phases"]["stream"] / max(read_alone, copy_alone)
        # The same against the stages as they run inside the pipeline: the uncapped
        # load of this round (reading plus CPU copies) and the link time alone.
        uncapped = rows["tp1"][-1]["report"]["phases"]["stream"]
        capped["efficiency_in_pipeline"] = rep["phases"]["stream"] / max(uncapped, copy_alone)
        capped["cap"] = read_gbps
        rows["capped"].append(capped)

    med = statistics.median
    cat = med(rows["cat"])
    print(f"checkpoint: {model} ({len(files)} files, {nbytes / 1e9:.2f} GB), {args.runs} rounds; "
          "GB/s = 1e9 bytes/s, medians (min-max)")
    print()
    print("| run | stream GB/s | whole load s | stream / cat | peak RSS MiB | RSS beyond params MiB | staging pool MiB |")
    print("|---|---|---|---|---|---|---|")
    print(f"| cat | {cat:.2f} ({min(rows['cat']):.2f}-{max(rows['cat']):.2f}) | | 1.00 | | | |")
    print(f"| read stage alone (io_uring QD{QUEUE_DEPTH} {CHUNK >> 20} MiB) | {med(rows['read']):.2f} | | "
          f"{med(rows['read']) / cat:.2f} | | | |")
    print(f"| staged probe (2 threads, {BUFFERS} x {CHUNK >> 20} MiB) | {med(rows['probe']):.2f} | | "
          f"{med(rows['probe']) / cat:.2f} | | | |")
    for key in ("tp1", "tp2"):
        rs = rows[key]
        g = [x["report"]["gbps"] for x in rs]
        params = rs[0]["report"]["bytes_copied"]
        beyond = [(x["rss"] - params) / 2**20 for x in rs]
        pool = rs[0]["report"]["staging_high_water_bytes"] / 2**20
        print(f"| ferry load {key} | {med(g):.2f} ({min(g):.2f}-{max(g):.2f}) | "
              f"{med([x['report']['seconds'] for x in rs]):.2f} | {med(g) / cat:.2f} | "
              f"{med([x['rss'] for x in rs]) / 2**20:.0f} | {med(beyond):.0f} | {pool:.0f} |")
    ratio = [x["report"]["gbps"] / p for x, p in zip(rows["tp1"], rows["probe"])]
    print()
    print(f"ferry load tp1 / staged probe, per round: median {med(ratio):.2f} "
          f"(min {min(ratio):.2f}, max {max(ratio):.2f})")
    eff = [x["efficiency"] for x in rows["capped"]]
    caps = [x["cap"] for x in rows["capped"]]
    print()
    print(f"overlap: cap = read-alone rate of the round (median {med(caps):.2f} GB/s); "
          f"stream / slower stage alone = {med(eff):.2f} (min {min(eff):.2f}, max {max(eff):.2f}); "
          "a serial pipeline would be about 2.0")
    eff2 = [x["efficiency_in_pipeline"] for x in rows["capped"]]
    print(f"overlap against the uncapped load of the same round (the read stage as it runs in the "
          f"pipeline) and the link time: {med(eff2):.2f} (min {min(eff2):.2f}, max {max(eff2):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
