#!/usr/bin/env python3
"""Whether two dump folders (`ferry load --dump-dir`) hold the same parameters: the
same files, and in each the same tensors (names, dtypes, shapes, offsets) and the
same bytes. The header's __metadata__ is not compared: it names the device the
dump came from ("host:0", "cuda:0"), which is what a GPU check compares across.

    python3 scripts/dumps_equal.py DIR_A DIR_B    # exit 0: equal; 1: not (says why)
"""
import json
import os
import struct
import sys


def read(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n:]


def main(a, b):
    names_a = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
    names_b = sorted(f for f in os.listdir(b) if f.endswith(".safetensors"))
    if names_a != names_b or not names_a:
        print(f"dumps_equal: the files differ: {names_a} vs {names_b}")
        return 1
    bad = 0
    for name in names_a:
        ha, da = read(os.path.join(a, name))
        hb, db = read(os.path.join(b, name))
        if ha != hb:
            print(f"dumps_equal: {name}: the tensor tables differ")
            bad += 1
            continue
        for tensor, info in sorted(ha.items()):
            lo, hi = info["data_offsets"]
            if da[lo:hi] != db[lo:hi]:
                print(f"dumps_equal: {name}: {tensor} differs")
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
