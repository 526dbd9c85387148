#!/usr/bin/env python3
"""Presharded checkpoints (issue 34 section 4): reading a `ferry save` folder against
`cat` / `dd iflag=direct` of its files and against ferry's raw load of the checkpoint.

    python3 bench/presharded_bench.py [--build build/release] [--runs 3] [--tp 1 2]
        [--skip-cold] [--only NAME]

Checkpoints, synthesized once under BUILD/bench-cache with `ferry synth`:
- llama: the medium Llama (BF16), loaded at postprocess.target=loader;
- deepseek_fp8: the medium DeepSeek-V3 with FP8 128 x 128 blocks, loaded at
  postprocess.target=sm100 with parallel.moe_a2a=deepep (ep = tp), so every FP8
  weight's block scales are repacked to UE8M0 after loading: the case where
  post-processing costs most.

For each checkpoint and tp, `ferry save --format presharded` writes the layout once
under BUILD/bench-cache/presharded. Every load is a whole `ferry load` process on
host devices (`host:<tp>`); rounds run in rotated order after one untimed load. Rows:
- hot (page cache warm): `cat` of the part's files, the presharded load, the raw load;
- cold (io.drop_cache=true, each file evicted first): `dd iflag=direct bs=16M` of the
  part's files, the presharded load with io.direct=true, the raw load with
  io.direct=true.
- the SGLang path (bench/peers/peer_sglang.py, rank 0 of tp, from the raw checkpoint),
  when .venv-bench/bin/python exists (scripts/bench-venv.sh): hot only.
Columns: the process's wall seconds and the report's stream seconds (medians, min-max)
and peak RSS. A load's wall time includes what is not reading: process start, the
plan, and on host devices committing the parameters' memory (about 1 s per GB on this
machine), so the reading is compared by the stream phase: `cat` / `dd` against the
presharded stream. Ratios are of medians of the same rounds.
"""
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_common import bench_args, cell, run_measured
from bench_common import drop_cache as drop
from bench_common import synth_once as synth
from bench_common import warm_cache as warm

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.path.join(HERE, "..", ".venv-bench", "bin", "python")
PEER = os.path.join(HERE, "peers", "peer_sglang.py")


def main():
    ap = bench_args(runs=3, model=False)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--only")
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    cache = os.path.join(args.build, "bench-cache")
    checkpoints = {
        "llama": (synth(ferry, os.path.join(cache, "llama-medium-seed1"), "--family", "llama",
                        "--preset", "medium"), ["--set", "postprocess.target=loader"]),
        "deepseek_fp8": (synth(ferry, os.path.join(cache, "deepseek_v3-medium-fp8-block"),
                               "--family", "deepseek_v3", "--preset", "medium", "--quant",
                               "fp8-block"),
                         ["--set", "postprocess.target=sm100", "--set",
                          "parallel.moe_a2a=deepep"]),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")

        def load(model, flags):
            seconds, rss, _ = run_measured([ferry, "load", "--model", model, "--report", report,
                                            "--quiet", *flags])
            with open(report) as f:
                r = json.load(f)
            return seconds, r["phases"]["stream"], rss, r

        for name, (ck, extra) in checkpoints.items():
            if args.only and args.only not in name:
                continue
            for tp in args.tp:
                layout = ["--tp", str(tp), "--devices", f"host:{tp}", *extra]
                if name == "deepseek_fp8":
                    layout += ["--ep", str(tp)]
                root = os.path.join(cache, "presharded", name)
                subprocess.run([ferry, "save", "--format", "presharded", "--out", root,
                                "--model", ck, "--quiet", *layout], check=True,
                               stdout=subprocess.DEVNULL)
                pre = [*layout, "--set", "model.load_format=presharded"]
                first = load(root, pre)[3]
                part = first["presharded"]["read"]
                files = sorted(glob.glob(os.path.join(part, "*.safetensors")))
                part_bytes = sum(os.path.getsize(f) for f in files)
                raw_files = sorted(glob.glob(os.path.join(ck, "*.safetensors")))
                for temp in ("hot", "cold"):
                    if temp == "cold" and args.skip_cold:
                        continue
                    cold = ["--set", "io.drop_cache=true", "--set", "io.direct=true",
                            "--set", "prefetch.enabled=false"] if temp == "cold" else []
                    base = (["dd", "iflag=direct", "bs=16M", "of=/dev/null"]
                            if temp == "cold" else ["cat"])
                    runs = {"base": [], "presharded": [], "raw": []}
                    if temp == "hot" and os.path.exists(PYTHON):
                        runs["sglang"] = []
                    for i in range(args.runs + 1):
                        order = list(runs)
                        order = order[i % len(order):] + order[:i % len(order)]
                        for what in order:
                            if temp == "hot":
                                warm(files if what in ("base", "presharded") else raw_files)
                            else:
                                drop(files + raw_files)
                            if what == "base":
                                if temp == "cold":
                                    t = 0.0
                                    for f in files:
                                        t += run_measured(base[:1] + ["if=" + f] + base[1:])[0]
                                    res = (t, t, 0, None)
                                else:
                                    s, rss, _ = run_measured(["cat", *files], capture=False)
                                    res = (s, s, rss, None)
                            elif what == "sglang":
                                s_, rss, _ = run_measured([PYTHON, PEER, ck, str(tp)])
                                res = (s_, s_, rss, None)
                            elif what == "presharded":
                                res = load(root, pre + cold)
                            else:
                                res = load(ck, layout + cold)
                            if i > 0:
                                runs[what].append(res)
                    med = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
                    stream = statistics.median(r[1] for r in runs["presharded"])
                    rows.append({
                        "checkpoint": name, "tp": tp, "temp": temp, "part_bytes": part_bytes,
                        "base": cell([r[0] for r in runs["base"]]),
                        "presharded": cell([r[0] for r in runs["presharded"]]),
                        "presharded_stream": cell([r[1] for r in runs["presharded"]]),
                        "raw": cell([r[0] for r in runs["raw"]]),
                        "raw_stream": cell([r[1] for r in runs["raw"]]),
                        "rss_presharded_mib": statistics.median(
                            r[2] for r in runs["presharded"]) / 2**20,
                        "rss_raw_mib": statistics.median(r[2] for r in runs["raw"]) / 2**20,
                        "sglang": cell([r[0] for r in runs["sglang"]]) if "sglang" in runs else "",
                        "base_over_stream": med["base"] / stream,
                        "sglang_over_presharded": (med["sglang"] / med["presharded"]
                                                   if "sglang" in runs else None),
                        "raw_over_presharded": med["raw"] / med["presharded"],
                    })
                    print(json.dumps(rows[-1]), flush=True)
    print()
    print("| checkpoint | tp | cache | part GB | cat / dd s | presharded s | its stream s | "
          "raw s | its stream s | SGLang path s | base / presharded stream | "
          "raw / presharded | SGLang path / presharded | RSS presharded / raw MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sg = (f"{r['sglang_over_presharded']:.2f}" if r["sglang_over_presharded"] is not None
              else "")
        print(f"| {r['checkpoint']} | {r['tp']} | {r['temp']} | {r['part_bytes'] / 1e9:.2f} | "
              f"{r['base']} | {r['presharded']} | {r['presharded_stream']} | "
              f"{r['raw']} | {r['raw_stream']} | {r['sglang']} | {r['base_over_stream']:.2f} | "
              f"{r['raw_over_presharded']:.2f} | {sg} | "
              f"{r['rss_presharded_mib']:.0f} / {r['rss_raw_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
