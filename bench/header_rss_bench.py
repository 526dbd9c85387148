#!/usr/bin/env python3
"""Header memory benchmark (issue 31, item 13): `ferry inspect F > /dev/null` on
single-file headers of N entries in two spellings, median of 3 runs each: CPU
seconds (user + system) and wall seconds of the whole process, and its peak RSS,
all from wait4.

    python3 bench/header_rss_bench.py [--ferry build/release/ferry] [--sizes 16000,100000,1000000]

- plain: "t<i>": BF16 [4, 4] at 32 i (as bench/header_bench.py's 1,000,000 file);
- unknown: "t<i>": U8 [0] at [0, 0] with a field the format does not define,
  "x": 0 (the attack of tests/attack/header_attack_test.cpp).
Files are written once under /tmp/ferry-header-rss.
"""
import argparse
import os
import statistics
import struct
import subprocess
import time


def write(path, n, spelling):
    if os.path.exists(path):
        return
    if spelling == "plain":
        parts = [f'"t{i}":{{"dtype":"BF16","shape":[4,4],"data_offsets":[{32 * i},{32 * (i + 1)}]}}'
                 for i in range(n)]
        data = 32 * n
    else:
        parts = [f'"t{i}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":0}}' for i in range(n)]
        data = 0
    text = ("{" + ",".join(parts) + "}").encode()
    text += b" " * (-len(text) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + data)
    os.rename(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default="build/release/ferry")
    ap.add_argument("--sizes", default="16000,100000,1000000")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    folder = "/tmp/ferry-header-rss"
    os.makedirs(folder, exist_ok=True)
    print("| file | tensors | CPU s | wall s | peak RSS MiB |")
    print("|---|---|---|---|---|")
    for spelling in ("plain", "unknown"):
        for n in (int(s) for s in args.sizes.split(",")):
            path = os.path.join(folder, f"{spelling}-{n}.safetensors")
            write(path, n, spelling)
            wall, cpu, rss = [], [], []
            for _ in range(args.runs):
                t = time.monotonic()
                p = subprocess.Popen([args.ferry, "inspect", path], stdout=subprocess.DEVNULL)
                _, status, ru = os.wait4(p.pid, 0)
                wall.append(time.monotonic() - t)
                cpu.append(ru.ru_utime + ru.ru_stime)
                rss.append(ru.ru_maxrss / 1024)
                assert os.waitstatus_to_exitcode(status) == 0, path
            m = statistics.median
            print(f"| {spelling} | {n:,} | {m(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) | "
                  f"{m(wall):.2f} ({min(wall):.2f}-{max(wall):.2f}) | {m(rss):.0f} |", flush=True)


if __name__ == "__main__":
    main()
