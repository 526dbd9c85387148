#!/usr/bin/env python3
"""remote_instance across two network namespaces (issue 36 section 4): the medium
Llama (2.2 GB) pulled by a target from a `ferry serve --remote` seed, beside the
link's own limits, in the same rounds.

    sudo python3 bench/remote_bench.py [--build build/release] [--runs 3]

Two namespaces joined by a veth pair (10.231.8.1 seed, 10.231.8.2 target), made here
and removed at the end; UCX over TCP (UCX_TLS=tcp, remote.transports=tcp: left to
itself UCX would use shared memory between two processes of one host). tp 1: one
rank of 2.2 GB. Each round, after one untimed round, in rotated order:
- perftest: `ucx_perftest -t ucp_get` from the target namespace, 8 MiB messages (the
  pieces ferry's gets are cut in) with 32 outstanding (ferry's 256 MiB in flight),
  the transport's limit on this link;
- iperf3: a plain TCP stream, 5 s, one stream;
- pull: `ferry load --set model.load_format=remote_instance` in the target namespace:
  the report's pull rate (remote.gbps), its in-process seconds, and exec to exit;
- disk: `ferry load --set io.drop_cache=true` of the same files in the target
  namespace, from a cold page cache (the files' pages dropped before the load):
  exec to exit.
Medians over the rounds; the ratio pull / perftest per round, then its median.
"""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import bench_args, medium_checkpoint

SEED_NS, TARGET_NS = "ferry-bench-seed", "ferry-bench-target"
SEED_IP, TARGET_IP = "10.231.8.1", "10.231.8.2"
PORT = 7400


def sh(*args, check=True):
    return subprocess.run(list(args), check=check, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True).stdout


def setup():
    teardown()
    sh("ip", "netns", "add", SEED_NS)
    sh("ip", "netns", "add", TARGET_NS)
    sh("ip", "link", "add", "fbseed", "type", "veth", "peer", "name", "fbtarget")
    sh("ip", "link", "set", "fbseed", "netns", SEED_NS)
    sh("ip", "link", "set", "fbtarget", "netns", TARGET_NS)
    sh("ip", "-n", SEED_NS, "addr", "add", SEED_IP + "/30", "dev", "fbseed")
    sh("ip", "-n", TARGET_NS, "addr", "add", TARGET_IP + "/30", "dev", "fbtarget")
    for ns, dev in ((SEED_NS, "fbseed"), (TARGET_NS, "fbtarget")):
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def teardown():
    for ns in (SEED_NS, TARGET_NS):
        sh("ip", "netns", "del", ns, check=False)


def in_ns(ns, *cmd):
    return ["ip", "netns", "exec", ns, *cmd]


def perftest():
    env = dict(os.environ, UCX_TLS="tcp")
    server = subprocess.Popen(in_ns(SEED_NS, "ucx_perftest", "-p", "13337"), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(
            in_ns(TARGET_NS, "ucx_perftest", SEED_IP, "-p", "13337", "-t", "ucp_get",
                  "-s", str(8 << 20), "-n", "300", "-w", "20", "-O", "32"),
            env=env, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=300).stdout
    finally:
        server.wait(timeout=60)
    final = [line for line in out.splitlines() if line.startswith("Final:")]
    # Final: iters, latency 50%, avg, overall, bandwidth avg (MB/s), overall (MB/s), msg rates
    fields = final[-1].split()
    return float(fields[6]) * (1 << 20) / 1e9  # overall MB/s (MiB) -> GB/s


def iperf():
    server = subprocess.Popen(in_ns(SEED_NS, "iperf3", "-s", "-1", "-p", "5201"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(in_ns(TARGET_NS, "iperf3", "-c", SEED_IP, "-p", "5201", "-t", "5",
                                   "-J"), check=True, stdout=subprocess.PIPE, text=True,
                             timeout=120).stdout
    finally:
        server.wait(timeout=60)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9


def start_seed(ferry, model, token, tmp):
    ready = os.path.join(tmp, "ready.json")
    if os.path.exists(ready):
        os.remove(ready)
    proc = subprocess.Popen(
        in_ns(SEED_NS, ferry, "serve", "--model", model, "--tp", "1", "--ready-file", ready,
              "--remote", f"{SEED_IP}:{PORT}", "--set", "remote.token_file=" + token, "--set",
              "remote.transports=tcp", "--set", "cache.dir=" + os.path.join(tmp, "registry")),
        stdout=open(os.path.join(tmp, "seed.log"), "w"), stderr=subprocess.STDOUT)
    until = time.monotonic() + 600
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > until:
            raise RuntimeError("the seed did not start: " + open(os.path.join(tmp, "seed.log")).read())
        time.sleep(0.05)
    return proc


def load(ferry, model, tmp, sets):
    report = os.path.join(tmp, "report.json")
    cmd = [ferry, "load", "--model", model, "--tp", "1", "--quiet", "--report", report]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    subprocess.run(in_ns(TARGET_NS, *cmd), check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    with open(report) as f:
        return wall, json.load(f)


def main():
    ap = bench_args(runs=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("remote_bench: network namespaces need root")
    ferry = os.path.abspath(os.path.join(args.build, "ferry"))
    model, files, total = medium_checkpoint(args.build, args.model)
    model = os.path.abspath(model)
    cols = {k: [] for k in ("perftest", "iperf", "pull_gbps", "pull_s", "pull_wall", "disk_wall",
                            "disk_gbps", "ratio")}
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "registry"), 0o700)
        token = os.path.join(tmp, "token")
        with open(token, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        os.chmod(token, 0o600)
        setup()
        seed = None
        try:
            seed = start_seed(ferry, model, token, tmp)
            pull_sets = ["model.load_format=remote_instance", f"remote.seed={SEED_IP}:{PORT}",
                         "remote.token_file=" + token, "remote.transports=tcp"]
            steps = ["perftest", "iperf", "pull", "disk"]
            for rnd in range(args.runs + 1):
                row = {}
                order = steps[rnd % len(steps):] + steps[:rnd % len(steps)]
                for step in order:
                    if step == "perftest":
                        row["perftest"] = perftest()
                    elif step == "iperf":
                        row["iperf"] = iperf()
                    elif step == "pull":
                        wall, rep = load(ferry, model, tmp, pull_sets)
                        row.update(pull_gbps=rep["remote"]["gbps"], pull_s=rep["seconds"],
                                   pull_wall=wall)
                    else:
                        wall, rep = load(ferry, model, tmp, ["io.drop_cache=true"])
                        row.update(disk_wall=wall, disk_gbps=rep["gbps"])
                row["ratio"] = row["pull_gbps"] / row["perftest"]
                print(f"round {rnd}{' (untimed)' if rnd == 0 else ''}: " +
                      ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
                if rnd == 0:
                    continue
                for k, v in row.items():
                    cols[k].append(v)
        finally:
            if seed is not None:
                seed.send_signal(signal.SIGTERM)
                seed.wait(timeout=60)
            teardown()
    med = {k: statistics.median(v) for k, v in cols.items()}
    print(f"\nmedium Llama, {total / 1e9:.2f} GB, tp 1, {args.runs} rounds (medians):\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| `ucx_perftest -t ucp_get`, 8 MiB x 32 outstanding | {med['perftest']:.3f} GB/s |")
    print(f"| iperf3, one TCP stream | {med['iperf']:.3f} GB/s |")
    print(f"| ferry pull (report's remote.gbps) | {med['pull_gbps']:.3f} GB/s |")
    print(f"| pull / perftest (median of per-round ratios) | {med['ratio']:.2f} |")
    print(f"| target time to ready, pull: in-process / exec to exit | {med['pull_s']:.2f} s / "
          f"{med['pull_wall']:.2f} s |")
    print(f"| target time to ready, cold disk load (exec to exit) | {med['disk_wall']:.2f} s "
          f"({med['disk_gbps']:.2f} GB/s read) |")


if __name__ == "__main__":
    main()
