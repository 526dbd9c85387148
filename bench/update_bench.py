#!/usr/bin/env python3
"""In-place updates (issue 34 section 4): `Runtime::update` of the medium Llama from
the page cache, against a fresh load of the same checkpoint.

    python3 bench/update_bench.py [--build build/release] [--runs 3] [--tp 1 2]

Checkpoints, synthesized once under BUILD/bench-cache with `ferry synth`: the medium
Llama with seed 1 (A, what is loaded first) and seed 2 (B, the update). Every run is
a whole `ferry load` process on host devices (`host:<tp>`), B's and A's files warm in
the page cache; rounds run in rotated order after one untimed round:
- fresh: `ferry load --model B`: the report's seconds (resolve to verified);
- update (reread, the default): `ferry load --model A --then-update B`: the update's
  report's seconds; a failure would read A again (its files are unchanged), so
  nothing is kept;
- update (snapshot): the same with update.rollback=snapshot: the written params are
  first copied to host memory (they fit the default update.rollback_bytes, 4 GiB).
Columns: medians (min-max) of the in-process seconds, the ratio update / fresh of
the medians, and the process's peak RSS measured from outside (for an update, that
of the load and the update together: the parameters live in host memory here).
"""
import json
import os
import statistics
import sys
import tempfile

from bench_common import bench_args, cell, run_measured
from bench_common import synth_once as synth
from bench_common import warm_cache as warm


def main():
    ap = bench_args(runs=3, model=False)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    cache = os.path.join(args.build, "bench-cache")
    a = synth(ferry, os.path.join(cache, "llama-medium-seed1"), "--family", "llama", "--preset",
              "medium")
    b = synth(ferry, os.path.join(cache, "llama-medium-seed2"), "--family", "llama", "--preset",
              "medium", "--seed", "2")
    files = [os.path.join(d, f) for d in (a, b) for f in sorted(os.listdir(d))
             if f.endswith(".safetensors")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")

        def run(cmd):
            _, rss, _ = run_measured(cmd)
            with open(report) as f:
                r = json.load(f)
            return r["seconds"], rss, r

        for tp in args.tp:
            layout = ["--tp", str(tp), "--devices", f"host:{tp}", "--quiet", "--report", report]
            cmds = {
                "fresh": [ferry, "load", "--model", b, *layout],
                "reread": [ferry, "load", "--model", a, "--then-update", b, *layout],
                "snapshot": [ferry, "load", "--model", a, "--then-update", b, *layout, "--set",
                             "update.rollback=snapshot"],
            }
            runs = {k: [] for k in cmds}
            for i in range(args.runs + 1):
                order = list(cmds)
                order = order[i % len(order):] + order[:i % len(order)]
                for what in order:
                    warm(files)
                    seconds, rss, r = run(cmds[what])
                    if what != "fresh":
                        assert r["update"]["rollback"] == what, r["update"]
                        assert r["update"]["params_unchanged"] == 0, r["update"]
                    if i > 0:
                        runs[what].append((seconds, rss))
            med = {k: statistics.median(x[0] for x in v) for k, v in runs.items()}
            row = {"tp": tp}
            for k, v in runs.items():
                row[k] = cell([x[0] for x in v])
                row[k + "_rss_mib"] = statistics.median(x[1] for x in v) / 2**20
            row["snapshot_over_fresh"] = med["snapshot"] / med["fresh"]
            row["reread_over_fresh"] = med["reread"] / med["fresh"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| tp | fresh load of B s | update A -> B (reread) s | update (snapshot) s | "
          "reread / fresh | snapshot / fresh | peak RSS fresh / reread / snapshot MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['fresh']} | {r['reread']} | {r['snapshot']} | "
              f"{r['reread_over_fresh']:.2f} | {r['snapshot_over_fresh']:.2f} | "
              f"{r['fresh_rss_mib']:.0f} / {r['reread_rss_mib']:.0f} / "
              f"{r['snapshot_rss_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
