#!/usr/bin/env python3
"""Hostile inputs: the time and peak RSS of `ferry` refusing each one, against the
targets of 10 s and 1 GiB (the hardening issue, section 2).

    python3 bench/hostile_bench.py [--build build/release] [--runs 3]

Each case is written once under BUILD/bench-cache/hostile (the checkpoint cases
start from `ferry synth --family llama --preset tiny`). Each run is one process,
`ferry inspect FILE` for a lone safetensors file or `ferry load --model DIR
--devices null --quiet` for a checkpoint, killed after 60 s. A case passes when
ferry exits with the status expected (1: a clean refusal; 0 for the valid
million-tensor header), its error names what the case expects, and the median
time and the peak RSS are within the targets. Prints a Markdown table; exits 1 when
a case fails.
"""
import argparse
import json
import os
import shutil
import statistics
import struct
import sys

from bench_common import run_status

TIME_TARGET_S = 10.0
RSS_TARGET = 1 << 30
F32 = '"dtype":"F32","shape":[1],"data_offsets":[0,4]'


def nested(depth):
    return '{"a":' + "[" * depth + "]" * depth + "}"


def safetensors(path, header, length=None, data=b""):
    header = header.encode() if isinstance(header, str) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length))
        f.write(header)
        f.write(data)


def million_header(path):
    """A valid header of 1,000,000 F32 [1] tensors (4 MB of data)."""
    n = 1_000_000
    parts = [f'"t{i}":{{"dtype":"F32","shape":[1],"data_offsets":[{4 * i},{4 * i + 4}]}}'
             for i in range(n)]
    safetensors(path, "{" + ",".join(parts) + "}", data=bytes(4 * n))


def big_junk_header(path):
    """A header just under the 100 MB limit that is one long string, then broken."""
    body = '{"t":"' + "x" * (100_000_000 - 64) + '"'
    safetensors(path, body)


def checkpoint(ferry, base, name, edit):
    """A tiny Llama checkpoint in base/name, changed by edit(folder)."""
    folder = os.path.join(base, name)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    seconds, rss, code, out, err = run_status(
        [ferry, "synth", "--family", "llama", "--preset", "tiny", "--out", folder])
    if code != 0:
        sys.exit(f"synth failed: {err}")
    edit(folder)
    return folder


def first_shard(folder):
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return sorted(set(json.load(f)["weight_map"].values()))[0]


def set_index_path(folder, value):
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    shard = first_shard(folder)
    index["weight_map"] = {k: (value if v == shard else v) for k, v in index["weight_map"].items()}
    with open(path, "w") as f:
        json.dump(index, f)


def symlink_out(folder):
    shard = first_shard(folder)
    outside = os.path.join(os.path.dirname(folder), "outside-" + os.path.basename(folder))
    os.makedirs(outside, exist_ok=True)
    target = os.path.join(outside, shard)
    shutil.move(os.path.join(folder, shard), target)
    os.symlink(os.path.relpath(target, folder), os.path.join(folder, shard))


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def cases(ferry, base, make):
    """(name, command, expected status, text the error must hold); with `make`,
    writes the inputs too."""
    os.makedirs(base, exist_ok=True)
    f = lambda name: os.path.join(base, name)  # noqa: E731
    files = [
        ("header JSON nested 100,000 deep", "deep.safetensors",
         lambda p: safetensors(p, nested(100_000)), 1, "nests deeper than 64 levels"),
        ("header length 2^63", "len2p63.safetensors",
         lambda p: safetensors(p, "{}", 1 << 63), 1, "exceeds the limit"),
        ("header length 2^64-1", "lenmax.safetensors",
         lambda p: safetensors(p, "{}", (1 << 64) - 1), 1, "exceeds the limit"),
        ("tensor offsets near 2^64", "offsets.safetensors",
         lambda p: safetensors(p, '{"t":{"dtype":"F32","shape":[2],"data_offsets":'
                                  '[18446744073709551600,18446744073709551608]}}'),
         1, "tensor 't'"),
        ("shape whose product overflows", "shape.safetensors",
         lambda p: safetensors(p, '{"t":{"dtype":"F32","shape":[4294967296,4294967296,16],'
                                  '"data_offsets":[0,0]}}'), 1, "overflows 64 bits"),
        ("tensor name with NUL", "nul.safetensors",
         lambda p: safetensors(p, '{"a\\u0000b":{' + F32 + "}}", data=bytes(4)), 1, "NUL byte"),
        ("tensor name not UTF-8", "utf8.safetensors",
         lambda p: safetensors(p, b'{"a\xff\xfe":{' + F32.encode() + b"}}", data=bytes(4)),
         1, "not valid UTF-8"),
        ("100 MB header, broken at its end", "junk.safetensors", big_junk_header, 1, "junk.safetensors"),
        ("1,000,000 tensors (valid)", "million.safetensors", million_header, 0, ""),
    ]
    out = []
    for name, file, write, status, text in files:
        if make and not os.path.exists(f(file)):
            write(f(file))
        out.append((name, [ferry, "inspect", f(file)], status, text))
    folders = [
        ("config.json nested 100,000 deep", "ck-deep-config",
         lambda d: write_text(os.path.join(d, "config.json"), nested(100_000)),
         "nests deeper than 64 levels"),
        ("index nested 100,000 deep", "ck-deep-index",
         lambda d: write_text(os.path.join(d, "model.safetensors.index.json"), nested(100_000)),
         "nests deeper than 64 levels"),
        ("index path with ..", "ck-dotdot",
         lambda d: set_index_path(d, "../outside.safetensors"), "outside.safetensors"),
        ("index path absolute", "ck-absolute",
         lambda d: set_index_path(d, "/etc/passwd"), "/etc/passwd"),
        ("shard symlink leaving the folder", "ck-symlink", symlink_out,
         "outside the checkpoint folder"),
    ]
    for name, folder, edit, text in folders:
        d = checkpoint(ferry, base, folder, edit) if make else os.path.join(base, folder)
        out.append((name, [ferry, "load", "--model", d, "--devices", "null", "--quiet"], 1, text))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build/release")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ferry = os.path.join(args.build, "ferry")
    base = os.path.join(args.build, "bench-cache", "hostile")
    if args.make_only:
        cases(ferry, base, make=True)
        return
    # The inputs are written by a child process: a child's peak RSS counts its
    # parent's pages up to exec, so the parent that measures stays small.
    seconds, rss, code, out, err = run_status(
        [sys.executable, __file__, "--build", args.build, "--make-only"])
    if code != 0:
        sys.exit(f"writing the inputs failed: {err}")
    print("| case | command | exit (expected) | seconds, median (min-max) | peak RSS MiB | within 10 s, 1 GiB |")
    print("|---|---|---|---|---|---|")
    failed = 0
    for name, cmd, status, text in cases(ferry, base, make=False):
        times, rss, codes, ok_text = [], [], [], True
        for _ in range(args.runs):
            seconds, peak, code, out, err = run_status(cmd, capture=False, timeout=60)
            times.append(seconds)
            rss.append(peak)
            codes.append(code)
            ok_text = ok_text and text in err
        code = max(set(codes), key=codes.count)
        ok = (all(c == status for c in codes) and ok_text and
              statistics.median(times) <= TIME_TARGET_S and max(rss) <= RSS_TARGET)
        failed += not ok
        verb = "inspect FILE" if cmd[1] == "inspect" else "load --devices null"
        t = statistics.median(times)
        print(f"| {name} | `{verb}` | {code} ({status}) | {t:.3f} ({min(times):.3f}-{max(times):.3f}) "
              f"| {max(rss) / 2**20:.0f} | {'yes' if ok else 'NO'} |")
        if not ok_text:
            print(f"<!-- {name}: the error did not hold {text!r}: {err.strip()[:300]} -->")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
