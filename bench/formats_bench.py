#!/usr/bin/env python3
"""The other checkpoint formats (issue 37 section 3): the medium Llama as torch.save
`.bin` shards, GGUF F16 and GGUF Q8_0 against its safetensors twin, hot, tp 1 and 2,
in the same rounds.

    python3 bench/formats_bench.py [--build build/release] [--runs 3] [--tp 1 2]

Checkpoints, synthesized once under BUILD/bench-cache with `ferry synth` (same
seed, same shard plan): llama-medium-seed1 (safetensors) and llama-medium-seed1-bin
(`--format bin`: pytorch_model-0000i-of-0000n.bin byte for byte as torch.save writes
them, and pytorch_model.bin.index.json). Every row is a whole process on host devices
(`host:<tp>`), the page cache warm, in rotated order after one untimed round:
- ferry safetensors: `ferry load` of the safetensors folder;
- ferry bin: `ferry load` of the .bin folder;
- ferry bin null: the same on null devices (`null:<tp>`: every byte read and counted,
  no parameter memory committed), since on host devices both ferry's and the peer's
  wall time are mostly the kernel faulting in the parameters' 2.2 GB of RAM, which a
  GPU load does not do;
- ferry gguf: `ferry load` of the medium Llama as one GGUF F16 file (`ferry synth
  --format gguf --gguf-type f16`: llama.cpp's names, Q/K rows permuted), model.dtype
  auto (the file's F16, no cast);
- ferry gguf q8_0: the same as one GGUF Q8_0 file (`--gguf-type q8_0`: every
  matrix in Q8_0 blocks, dequantized to BF16 on the device as it is copied);
- gguf-py: bench/peers/peer_gguf.py (tp rank processes; each gguf.GGUFReader's memmap
  and a numpy copy of its rank's rows of every tensor), when this Python has gguf;
- torch.load: bench/peers/peer_torch_load.py (tp rank processes at once, each
  torch.load(weights_only=True, mmap=True) of every shard and a copy of its rank's
  rows into parameters it allocated), when .venv-bench/bin/python exists
  (scripts/bench-venv.sh).
Columns: the process's wall seconds and, for ferry, the report's stream seconds
(medians, min-max) and peak RSS. Ratios are of medians of the same rounds: bin stream
over safetensors stream (target <= 1.1), torch.load's wall over ferry bin's wall
(target >= 3), on host devices and against the null-device load.
"""
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_common import bench_args, cell, run_measured
from bench_common import synth_once as synth
from bench_common import warm_cache as warm

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.path.join(HERE, "..", ".venv-bench", "bin", "python")
PEER = os.path.join(HERE, "peers", "peer_torch_load.py")
GGUF_PEER = os.path.join(HERE, "peers", "peer_gguf.py")


def has_gguf_py():
    return subprocess.run([sys.executable, "-c", "import gguf, numpy"],
                          capture_output=True).returncode == 0


def main():
    ap = bench_args(runs=3, model=False)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    cache = os.path.join(args.build, "bench-cache")
    st = synth(ferry, os.path.join(cache, "llama-medium-seed1"), "--family", "llama",
               "--preset", "medium")
    binary = os.path.join(cache, "llama-medium-seed1-bin")
    if not os.path.exists(os.path.join(binary, "pytorch_model.bin.index.json")):
        run_measured([ferry, "synth", "--out", binary, "--no-fsync", "--family", "llama",
                      "--preset", "medium", "--format", "bin"])
    gguf = os.path.join(cache, "llama-medium-seed1-gguf-f16")
    if not os.path.exists(os.path.join(gguf, "model.gguf")):
        run_measured([ferry, "synth", "--out", gguf, "--no-fsync", "--family", "llama",
                      "--preset", "medium", "--format", "gguf", "--gguf-type", "f16"])
    gguf_file = os.path.join(gguf, "model.gguf")
    q8 = os.path.join(cache, "llama-medium-seed1-gguf-q8_0")
    if not os.path.exists(os.path.join(q8, "model.gguf")):
        run_measured([ferry, "synth", "--out", q8, "--no-fsync", "--family", "llama",
                      "--preset", "medium", "--format", "gguf", "--gguf-type", "q8_0"])
    q8_file = os.path.join(q8, "model.gguf")
    files = {"st": sorted(glob.glob(os.path.join(st, "*.safetensors"))),
             "bin": sorted(glob.glob(os.path.join(binary, "*.bin"))),
             "gguf": [gguf_file], "gguf_q8": [q8_file]}
    sizes = {k: sum(os.path.getsize(f) for f in v) for k, v in files.items()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")

        def load(model, tp, device="host"):
            seconds, rss, _ = run_measured([ferry, "load", "--model", model, "--report", report,
                                            "--quiet", "--tp", str(tp), "--devices",
                                            f"{device}:{tp}", "--set",
                                            "postprocess.target=loader"])
            with open(report) as f:
                r = json.load(f)
            return seconds, r["phases"]["stream"], rss

        for tp in args.tp:
            runs = {"st": [], "bin": [], "bin_null": [], "gguf": [], "gguf_q8": []}
            if os.path.exists(PYTHON):
                runs["torch"] = []
            if has_gguf_py():
                runs["gguf_py"] = []
                runs["gguf_py_q8"] = []
            for i in range(args.runs + 1):
                order = list(runs)
                order = order[i % len(order):] + order[:i % len(order)]
                for what in order:
                    warm(files["st"] if what == "st" else
                         files["gguf_q8"] if what.endswith("q8") else
                         files["gguf"] if what.startswith("gguf") else files["bin"])
                    if what in ("gguf_py", "gguf_py_q8"):
                        s, rss, _ = run_measured([sys.executable, GGUF_PEER,
                                                  q8_file if what.endswith("q8") else gguf_file,
                                                  str(tp)])
                        res = (s, s, rss)
                    elif what in ("gguf", "gguf_q8"):
                        res = load(q8_file if what == "gguf_q8" else gguf_file, tp)
                    elif what == "torch":
                        s, rss, _ = run_measured([PYTHON, PEER, binary, str(tp)])
                        res = (s, s, rss)
                    elif what == "bin_null":
                        res = load(binary, tp, "null")
                    else:
                        res = load(st if what == "st" else binary, tp)
                    if i > 0:
                        runs[what].append(res)
            med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
                   for k, v in runs.items()}
            row = {"tp": tp,
                   "st_wall": cell([r[0] for r in runs["st"]]),
                   "st_stream": cell([r[1] for r in runs["st"]]),
                   "bin_wall": cell([r[0] for r in runs["bin"]]),
                   "bin_stream": cell([r[1] for r in runs["bin"]]),
                   "bin_null_wall": cell([r[0] for r in runs["bin_null"]]),
                   "gguf_wall": cell([r[0] for r in runs["gguf"]]),
                   "gguf_stream": cell([r[1] for r in runs["gguf"]]),
                   "gguf_over_st_stream": med["gguf"][1] / med["st"][1],
                   "q8_wall": cell([r[0] for r in runs["gguf_q8"]]),
                   "q8_stream": cell([r[1] for r in runs["gguf_q8"]]),
                   "q8_over_st_stream": med["gguf_q8"][1] / med["st"][1],
                   "rss_st_mib": statistics.median(r[2] for r in runs["st"]) / 2**20,
                   "rss_bin_mib": statistics.median(r[2] for r in runs["bin"]) / 2**20,
                   "bin_over_st_stream": med["bin"][1] / med["st"][1]}
            if "torch" in runs:
                row["torch_wall"] = cell([r[0] for r in runs["torch"]])
                row["rss_torch_mib"] = statistics.median(r[2] for r in runs["torch"]) / 2**20
                row["torch_over_bin_wall"] = med["torch"][0] / med["bin"][0]
                row["torch_over_bin_null_wall"] = med["torch"][0] / med["bin_null"][0]
            if "gguf_py" in runs:
                row["gguf_py_wall"] = cell([r[0] for r in runs["gguf_py"]])
                row["gguf_py_over_gguf_wall"] = med["gguf_py"][0] / med["gguf"][0]
                row["gguf_py_q8_wall"] = cell([r[0] for r in runs["gguf_py_q8"]])
                row["gguf_py_q8_over_q8_wall"] = med["gguf_py_q8"][0] / med["gguf_q8"][0]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"safetensors {sizes['st'] / 1e9:.3f} GB in {len(files['st'])} files; "
          f".bin {sizes['bin'] / 1e9:.3f} GB in {len(files['bin'])} files; "
          f"GGUF F16 {sizes['gguf'] / 1e9:.3f} GB; GGUF Q8_0 {sizes['gguf_q8'] / 1e9:.3f} GB")
    print("| tp | ferry GGUF F16 wall (s) | stream (s) | GGUF / safetensors stream | "
          "gguf-py peer wall (s) | gguf-py / ferry GGUF wall |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['gguf_wall']} | {r['gguf_stream']} | "
              f"{r['gguf_over_st_stream']:.2f} | {r.get('gguf_py_wall', 'n/a')} | "
              f"{r.get('gguf_py_over_gguf_wall', float('nan')):.2f} |")
    print("| tp | ferry GGUF Q8_0 wall (s) | stream (s) | Q8_0 / safetensors stream | "
          "gguf-py Q8_0 peer wall (s) | gguf-py / ferry Q8_0 wall |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['q8_wall']} | {r['q8_stream']} | {r['q8_over_st_stream']:.2f} | "
              f"{r.get('gguf_py_q8_wall', 'n/a')} | "
              f"{r.get('gguf_py_q8_over_q8_wall', float('nan')):.2f} |")
    print("| tp | ferry safetensors wall (s) | stream (s) | ferry .bin wall (s) | stream (s) | "
          "ferry .bin null wall (s) | torch.load wall (s) | .bin / safetensors stream | "
          "torch.load / ferry .bin wall (host; null) | peak RSS st / bin / torch (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['st_wall']} | {r['st_stream']} | {r['bin_wall']} | "
              f"{r['bin_stream']} | {r['bin_null_wall']} | {r.get('torch_wall', 'n/a')} | "
              f"{r['bin_over_st_stream']:.2f} | {r.get('torch_over_bin_wall', float('nan')):.2f}; "
              f"{r.get('torch_over_bin_null_wall', float('nan')):.2f} | {r['rss_st_mib']:.0f} / "
              f"{r['rss_bin_mib']:.0f} / {r.get('rss_torch_mib', float('nan')):.0f} |")


if __name__ == "__main__":
    sys.exit(main())
