#!/usr/bin/env python3
"""Interoperability: `ferry synth --format bin` checkpoints are what PyTorch writes.

For a few option sets (one shard; several shards with FP8 block weights, whose F8_E4M3
tensors take torch's _rebuild_tensor_v3 path; NVFP4's U8 and F8_E4M3 in F32; fused
3-D experts in F16) it runs `ferry synth` twice, --format bin and --format
safetensors, then checks that
  - the two indexes map the same tensors to the same shard numbers, with the same
    total_size, and config.json is the same file;
  - torch.load(weights_only=True, mmap=True) of every .bin shard gives every tensor of
    the safetensors shard of the same number (safe_open) with the same name, order,
    dtype, shape and bytes;
  - torch.save of what torch.load returned, to a file of the same name, gives ferry's
    file byte for byte.
Exits 77 (CTest's skip code) when torch or safetensors cannot be imported. With
FERRY_TORCH_PYTHON set, it re-runs itself with that interpreter first (a virtual
environment that has torch while the build's python3 does not).
"""
import json
import os
import subprocess
import sys
import tempfile

if os.environ.get("FERRY_TORCH_PYTHON") and not os.environ.get("FERRY_TORCH_BIN_TEST_CHILD"):
    os.environ["FERRY_TORCH_BIN_TEST_CHILD"] = "1"
    python = os.environ["FERRY_TORCH_PYTHON"]
    os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:]])

try:
    import collections

    import torch
    from safetensors import safe_open
except ImportError as e:  # pragma: no cover
    print(f"SKIP: torch and safetensors are needed ({e}); set FERRY_TORCH_PYTHON to an "
          "interpreter that has them")
    sys.exit(77)

FERRY = sys.argv[1]
CASES = [
    ("llama-one-shard", ["--family", "llama", "--preset", "tiny", "--shard-bytes", "1G"]),
    ("deepseek_v3-fp8-block", ["--family", "deepseek_v3", "--preset", "tiny", "--quant",
                               "fp8-block", "--seed", "7"]),
    ("llama-nvfp4-f32", ["--family", "llama", "--preset", "tiny", "--quant", "nvfp4",
                         "--dtype", "f32"]),
    ("mixtral-fused-f16", ["--family", "mixtral", "--preset", "tiny", "--fused-experts",
                           "--dtype", "f16", "--shard-bytes", "300K"]),
]


def synth(out, fmt, args):
    p = subprocess.run([FERRY, "synth", *args, "--format", fmt, "--out", out, "--no-fsync"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ferry synth --format {fmt} exited {p.returncode}: {p.stderr}")


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def shard_number(file):
    # pytorch_model-00002-of-00004.bin and model-00002-of-00004.safetensors: "00002-of-00004"
    return file.rsplit(".", 1)[0].split("-", 1)[1]


def check(name, args, root, failures):
    bin_dir = os.path.join(root, name + "-bin")
    st_dir = os.path.join(root, name + "-st")
    synth(bin_dir, "bin", args)
    synth(st_dir, "safetensors", args)
    bin_index = json.load(open(os.path.join(bin_dir, "pytorch_model.bin.index.json")))
    st_index = json.load(open(os.path.join(st_dir, "model.safetensors.index.json")))
    if bin_index["metadata"] != st_index["metadata"]:
        failures.append(f"{name}: metadata {bin_index['metadata']} != {st_index['metadata']}")
    bin_map = {k: shard_number(v) for k, v in bin_index["weight_map"].items()}
    st_map = {k: shard_number(v) for k, v in st_index["weight_map"].items()}
    if bin_map != st_map:
        failures.append(f"{name}: the weight maps differ")
    if open(os.path.join(bin_dir, "config.json"), "rb").read() != \
            open(os.path.join(st_dir, "config.json"), "rb").read():
        failures.append(f"{name}: config.json differs")

    bins = sorted(f for f in os.listdir(bin_dir) if f.endswith(".bin"))
    if sorted(set(bin_index["weight_map"].values())) != bins:
        failures.append(f"{name}: the index names {sorted(set(bin_index['weight_map'].values()))}"
                        f", the folder holds {bins}")
    tensors = 0
    for file in bins:
        path = os.path.join(bin_dir, file)
        loaded = torch.load(path, weights_only=True, mmap=True)
        if type(loaded) is not collections.OrderedDict:
            failures.append(f"{name}/{file}: torch.load gave a {type(loaded).__name__}")
        st_file = os.path.join(st_dir, "model-" + shard_number(file) + ".safetensors")
        with safe_open(st_file, framework="pt") as f:
            keys = list(f.keys())
            # safe_open lists names sorted; the .bin keeps the shard's order, which is
            # the index's order of first appearance.
            if sorted(loaded.keys()) != keys:
                failures.append(f"{name}/{file}: names differ from {os.path.basename(st_file)}")
                continue
            for k, t in loaded.items():
                want = f.get_tensor(k)
                if t.dtype != want.dtype or tuple(t.shape) != tuple(want.shape):
                    failures.append(f"{name}/{file}: {k}: {t.dtype} {tuple(t.shape)} != "
                                    f"{want.dtype} {tuple(want.shape)}")
                elif raw(t) != raw(want):
                    failures.append(f"{name}/{file}: {k}: the bytes differ")
                tensors += 1
        # torch.save of the same dict to the same file name writes the same bytes.
        again = os.path.join(root, "again", file)
        os.makedirs(os.path.dirname(again), exist_ok=True)
        torch.save(loaded, again)
        if open(again, "rb").read() != open(path, "rb").read():
            failures.append(f"{name}/{file}: torch.save of what torch.load read differs")
        os.remove(again)
    if tensors != len(st_index["weight_map"]):
        failures.append(f"{name}: {tensors} tensors loaded, the index lists "
                        f"{len(st_index['weight_map'])}")
    print(f"{name}: {len(bins)} shards, {tensors} tensors")


def main():
    failures = []
    with tempfile.TemporaryDirectory() as root:
        for name, args in CASES:
            check(name, args, root, failures)
    for f in failures:
        print("FAIL:", f)
    if failures:
        return 1
    print(f"OK: torch {torch.__version__} loads ferry's .bin shards as the safetensors ones, "
          "and writes them byte for byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
