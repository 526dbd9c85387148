#!/usr/bin/env python3
"""The weight cache (issue 35 section 4): eight engine processes of one machine, one
tp rank each (tp 8 on host devices, as SGLang runs it), each loading its rank from
disk, against one `ferry serve` daemon and eight clients that attach to it.

    python3 bench/cache_bench.py [--build build/release] [--runs 3]

Checkpoints, synthesized once under BUILD/bench-cache: the medium Llama (2.2 GB,
201 tensors) and DeepSeek-V3 at its real tensor count with every width scaled to 64
(`--scale-dims 64`: 46,183 tensors, 212 MiB). Files warm in the page cache. In each
round, in rotated order after one untimed round:
- disk: 8 `ferry load --tp 8 --ranks r` processes at once, each holding its rank
  (`--hold`) until measured;
- serve: `ferry serve --tp 8`, from exec to its --ready-file (the load, sharing,
  registration), against a plain `ferry load --tp 8` of all eight ranks in one
  process (exec to exit, and the in-process seconds of both reports), run before
  the daemon in even rounds and after it in odd ones;
- attach: 8 clients `ferry load --tp 8 --ranks r --set cache.mode=daemon` at once
  against that daemon, each holding its rank until measured.
A client's ready time is its report's in-process seconds (fingerprint, registry,
connect, fetch, check against the model, map) and, from outside, exec to the
"holding" line (a whole process: ferry's start-up too); the slowest of the eight
attaching at once, and one client attaching alone (median of five, after them). Memory while all eight hold
their ranks, from /proc/PID/smaps_rollup: each process's Pss and Private bytes; the
clients' "added" memory is their Private bytes summed (what they hold beyond the
pages they share with the daemon), and the total is the Pss of all processes
together (daemon included), beside the bytes the daemon shares.
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import bench_args, cell
from bench_common import synth_once as synth
from bench_common import warm_cache as warm

TP = 8


def smaps(pid):
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def private(s):
    return s.get("Private_Clean", 0) + s.get("Private_Dirty", 0)


def wait_for(pred, timeout, what):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if pred():
            return
        time.sleep(0.002)
    raise RuntimeError("timed out waiting for " + what)


def hold_eight(ferry, model, extra, tmp, tag):
    """Starts 8 `ferry load --hold` processes, one rank each, at once; waits until all
    hold; returns (per-process in-process seconds, exec-to-holding seconds, smaps)."""
    procs, logs, reports, started = [], [], [], []
    for r in range(TP):
        log = os.path.join(tmp, f"{tag}-{r}.log")
        report = os.path.join(tmp, f"{tag}-{r}.json")
        for p in (log, report):
            if os.path.exists(p):
                os.remove(p)
        logs.append(log)
        reports.append(report)
        started.append(time.monotonic())
        procs.append(subprocess.Popen(
            [ferry, "load", "--model", model, "--tp", str(TP), "--ranks", str(r), "--devices",
             "host:1", "--quiet", "--hold", "600", "--report", report, *extra],
            stdout=open(log, "w"), stderr=subprocess.STDOUT))
    ready = [None] * TP

    def all_holding():
        for r in range(TP):
            if ready[r] is None:
                if procs[r].poll() is not None:
                    raise RuntimeError(f"{tag} rank {r} exited: " + open(logs[r]).read())
                if "holding" in open(logs[r]).read():
                    ready[r] = time.monotonic() - started[r]
        return all(x is not None for x in ready)

    wait_for(all_holding, 600, tag + " processes")
    seconds = []
    mem = [smaps(p.pid) for p in procs]
    for p in procs:
        p.send_signal(signal.SIGINT)  # ends the hold; the report is written then
    for p in procs:
        p.wait(timeout=60)
    for r in range(TP):
        with open(reports[r]) as f:
            seconds.append(json.load(f)["seconds"])
    return seconds, ready, mem


def serve(ferry, model, registry, tmp):
    ready = os.path.join(tmp, "ready.json")
    report = os.path.join(tmp, "serve.json")
    for p in (ready, report):
        if os.path.exists(p):
            os.remove(p)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [ferry, "serve", "--model", model, "--tp", str(TP), "--set", "cache.dir=" + registry,
         "--ready-file", ready, "--report", report],
        stdout=open(os.path.join(tmp, "serve.log"), "w"), stderr=subprocess.STDOUT)
    wait_for(lambda: os.path.exists(ready) or proc.poll() is not None, 600, "the daemon")
    if proc.poll() is not None:
        raise RuntimeError("ferry serve exited: " + open(os.path.join(tmp, "serve.log")).read())
    return proc, time.monotonic() - t0


def plain_load(ferry, model, tmp):
    report = os.path.join(tmp, "plain.json")
    t0 = time.monotonic()
    subprocess.run([ferry, "load", "--model", model, "--tp", str(TP), "--quiet", "--report",
                    report], check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    with open(report) as f:
        return wall, json.load(f)["seconds"]


def main():
    ap = bench_args(runs=3, model=False)
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    cache = os.path.join(args.build, "bench-cache")
    models = {
        "llama medium": synth(ferry, os.path.join(cache, "llama-medium-seed1"), "--family",
                              "llama", "--preset", "medium"),
        "deepseek-v3 h64": synth(ferry, os.path.join(cache, "deepseek-v3-h64"), "--from-config",
                                 os.path.join(os.path.dirname(__file__),
                                              "../../shared/data/models/deepseek-v3/config.json"),
                                 "--scale-dims", "64"),
    }
    for name, model in models.items():
        files = [os.path.join(model, f) for f in sorted(os.listdir(model))
                 if f.endswith(".safetensors")]
        warm(files)
        with tempfile.TemporaryDirectory() as tmp:
            registry = os.path.join(tmp, "registry")
            os.mkdir(registry, 0o700)
            cols = {k: [] for k in ("disk_s", "disk_ready", "attach_s", "attach_ready", "attach_alone",
                                    "serve_ready", "plain_wall", "serve_s", "plain_s",
                                    "disk_total_pss", "attach_added", "attach_total_pss",
                                    "shared", "ratio_start")}
            for rnd in range(args.runs + 1):
                order = ["disk", "cache"] if rnd % 2 == 0 else ["cache", "disk"]
                row = {}
                for what in order:
                    if what == "disk":
                        s, ready, mem = hold_eight(ferry, model, [], tmp, "disk")
                        row["disk_s"] = statistics.median(s)
                        row["disk_ready"] = statistics.median(ready)
                        row["disk_total_pss"] = sum(m["Pss"] for m in mem)
                    else:
                        # The plain load before the daemon in even rounds, after it
                        # in odd ones: neither always runs on the other's leftovers.
                        if rnd % 2 == 0:
                            plain_wall, plain_s = plain_load(ferry, model, tmp)
                        proc, serve_ready = serve(ferry, model, registry, tmp)
                        try:
                            s, ready, mem = hold_eight(
                                ferry, model,
                                ["--set", "cache.mode=daemon", "--set", "cache.dir=" + registry],
                                tmp, "attach")
                            daemon = smaps(proc.pid)
                            # One client alone, five times: no other client shares the CPU.
                            alone = []
                            for _ in range(5):
                                one = os.path.join(tmp, "alone.json")
                                subprocess.run(
                                    [ferry, "load", "--model", model, "--tp", str(TP), "--ranks",
                                     "0", "--devices", "host:1", "--quiet", "--report", one,
                                     "--set", "cache.mode=daemon", "--set",
                                     "cache.dir=" + registry],
                                    check=True, stdout=subprocess.DEVNULL)
                                with open(one) as f:
                                    alone.append(json.load(f)["seconds"])
                        finally:
                            proc.send_signal(signal.SIGTERM)
                            proc.wait(timeout=60)
                        if rnd % 2 == 1:
                            plain_wall, plain_s = plain_load(ferry, model, tmp)
                        with open(os.path.join(tmp, "serve.json")) as f:
                            serve_s = json.load(f)["seconds"]
                        with open(os.path.join(tmp, "ready.json")) as f:
                            shared = json.load(f)["bytes_shared"]
                        row.update(attach_alone=statistics.median(alone), attach_s=max(s), attach_ready=max(ready),
                                   attach_added=sum(private(m) for m in mem),
                                   attach_total_pss=sum(m["Pss"] for m in mem) + daemon["Pss"],
                                   serve_ready=serve_ready, plain_wall=plain_wall,
                                   serve_s=serve_s, plain_s=plain_s,
                                   shared=shared,
                                   ratio_start=serve_ready / plain_wall)
                if rnd == 0:
                    continue  # untimed
                for k, v in row.items():
                    cols[k].append(v)
            mib = 1.0 / (1 << 20)
            print(f"\n### {name}\n")
            print("| run | in-process seconds | exec to ready, s | memory |")
            print("|---|---|---|---|")
            print(f"| 8 x disk load (one rank each) | {cell(cols['disk_s'])} | "
                  f"{cell(cols['disk_ready'])} | total Pss {cell(cols['disk_total_pss'], mib, '{:.0f}')} MiB |")
            print(f"| 8 x attach (slowest client) | {cell(cols['attach_s'], 1000, '{:.1f}')} ms | "
                  f"{cell(cols['attach_ready'])} | clients' private {cell(cols['attach_added'], mib, '{:.0f}')} MiB; "
                  f"total Pss with the daemon {cell(cols['attach_total_pss'], mib, '{:.0f}')} MiB; "
                  f"shared {cell(cols['shared'], mib, '{:.0f}')} MiB |")
            print(f"| 1 x attach alone (median of 5) | {cell(cols['attach_alone'], 1000, '{:.1f}')} ms | | |")
            print(f"| ferry serve (to registered) | {cell(cols['serve_s'])} | "
                  f"{cell(cols['serve_ready'])} | |")
            print(f"| plain ferry load, 8 ranks | {cell(cols['plain_s'])} | "
                  f"{cell(cols['plain_wall'])} | |")
            print(f"\nserve / plain load (exec to ready), median of the rounds' ratios: "
                  f"{statistics.median(cols['ratio_start']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
