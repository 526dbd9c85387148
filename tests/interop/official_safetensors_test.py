#!/usr/bin/env python3
"""Interoperability: files written by the official safetensors library must load.

Writes files with `safetensors.numpy.save_file` (every dtype numpy has, rank-0 and
empty tensors, metadata), runs `ferry inspect --json` on them, and checks every
name, dtype, shape, offset and byte count against what the official library wrote,
then reads each tensor's bytes at the reported offset and compares them with the
array. Exits 77 (CTest's skip code) when the library is not installed.
"""
import json
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file
except ImportError as e:  # pragma: no cover
    print(f"SKIP: the official safetensors/numpy Python packages are missing ({e})")
    sys.exit(77)

FERRY = sys.argv[1]
DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "F32": np.float32, "F64": np.float64,
}


def inspect(path, *extra):
    p = subprocess.run([FERRY, "inspect", path, "--json", *extra], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def main():
    rng = np.random.default_rng(7)
    failures = []
    with tempfile.TemporaryDirectory() as d:
        tensors = {}
        for name, dt in DTYPES.items():
            shape = (3, 5, 7) if name != "BOOL" else (4, 9)
            a = rng.integers(0, 100, size=shape).astype(dt)
            tensors[f"t.{name.lower()}"] = a
        tensors["scalar"] = np.array(3.5, dtype=np.float32)
        tensors["empty"] = np.zeros((0, 4), dtype=np.float16)
        path = os.path.join(d, "model.safetensors")
        save_file(tensors, path, metadata={"format": "np", "who": "official"})

        rc, out, err = inspect(path)
        if rc != 0:
            print(f"FAIL: ferry inspect exited {rc}: {err}")
            return 1
        doc = json.loads(out)  # exactly one JSON document on stdout
        by_name = {t["name"]: t for t in doc["tensors"]}
        if set(by_name) != set(tensors):
            failures.append(f"names differ: {sorted(set(by_name) ^ set(tensors))}")
        raw = open(path, "rb").read()
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                want = f.get_tensor(name)
                got = by_name.get(name)
                if got is None:
                    continue
                want_dtype = [k for k, v in DTYPES.items() if np.dtype(v) == want.dtype][0]
                if got["dtype"] != want_dtype:
                    failures.append(f"{name}: dtype {got['dtype']} != {want_dtype}")
                if tuple(got["shape"]) != want.shape:
                    failures.append(f"{name}: shape {got['shape']} != {list(want.shape)}")
                if got["nbytes"] != want.nbytes:
                    failures.append(f"{name}: nbytes {got['nbytes']} != {want.nbytes}")
                data = raw[got["offset"]:got["offset"] + got["nbytes"]]
                if data != want.tobytes():
                    failures.append(f"{name}: bytes at offset {got['offset']} differ")
        if doc["total_bytes"] != sum(a.nbytes for a in tensors.values()):
            failures.append("total_bytes wrong")
        if doc["files"][0]["bytes"] != len(raw) or doc["files"][0]["tensors"] != len(tensors):
            failures.append(f"files entry wrong: {doc['files']}")

        # A corrupted copy (one byte cut off the end) must be refused, naming the file.
        bad = os.path.join(d, "cut.safetensors")
        open(bad, "wb").write(raw[:-1])
        rc, out, err = inspect(bad)
        if rc == 0 or out.strip() or "cut.safetensors" not in err:
            failures.append(f"truncated file not refused properly: rc={rc} err={err!r}")

    for f in failures:
        print("FAIL:", f)
    print(f"{len(DTYPES) + 2} tensors checked, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
