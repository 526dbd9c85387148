#!/usr/bin/env python3
"""Interoperability: checkpoints written by the real torch.save load in ferry.

Synthesizes safetensors checkpoints with `ferry synth` (a dense and an MoE family),
re-saves every shard with torch.save as transformers' save_pretrained(
safe_serialization=False) lays them out (pytorch_model-0000i-of-0000n.bin and
pytorch_model.bin.index.json), then loads both folders with `ferry load --dump-dir`
at tp 1 and 2 and requires equal dumps (scripts/dumps_equal.py). Also: a module's
state_dict() with _metadata and tied weights (one storage, two names), a *.pt file,
and a pickle whose __reduce__ calls os.system, which must be refused without the
command running. Exits 77 (CTest's skip code) when torch is not importable; set
FERRY_TORCH_PYTHON to an interpreter that has it (the script re-executes itself).
Usage: torch_save_load_test.py FERRY
"""
import collections
import json
import os
import subprocess
import sys
import tempfile

if os.environ.get("FERRY_TORCH_PYTHON") and os.environ.get("FERRY_TORCH_REEXEC") != "1":
    os.environ["FERRY_TORCH_REEXEC"] = "1"
    os.execv(os.environ["FERRY_TORCH_PYTHON"],
             [os.environ["FERRY_TORCH_PYTHON"], os.path.abspath(__file__)] + sys.argv[1:])

try:
    import torch
    from safetensors.torch import load_file
except ImportError as e:  # pragma: no cover
    print(f"SKIP: torch or safetensors is not importable here ({e}); set FERRY_TORCH_PYTHON")
    sys.exit(77)

FERRY = sys.argv[1]
HERE = os.path.dirname(os.path.abspath(__file__))
DUMPS_EQUAL = os.path.join(HERE, "..", "..", "scripts", "dumps_equal.py")


def ferry(*args, ok=True):
    p = subprocess.run([FERRY, *args], capture_output=True, text=True)
    if ok and p.returncode != 0:
        raise SystemExit(f"ferry {' '.join(args)} failed ({p.returncode}): {p.stderr}")
    return p


def to_bin(src, dst):
    """Every safetensors shard of src re-saved by torch.save, with the .bin index."""
    os.makedirs(dst)
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        state = load_file(os.path.join(src, shard))
        torch.save(collections.OrderedDict(state), os.path.join(dst, name))
        weight_map.update({k: name for k in state})
    json.dump({"metadata": {}, "weight_map": weight_map},
              open(os.path.join(dst, "pytorch_model.bin.index.json"), "w"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def same_dumps(a, b, tp, *extra):
    for folder, out in ((a, a + f"-d{tp}"), (b, b + f"-d{tp}")):
        ferry("load", "--model", folder, "--tp", str(tp), "--quiet", "--dump-dir", out, *extra)
    p = subprocess.run([sys.executable, DUMPS_EQUAL, a + f"-d{tp}", b + f"-d{tp}"],
                       capture_output=True, text=True)
    return p.returncode == 0, p.stdout + p.stderr


def main():
    failures = []
    with tempfile.TemporaryDirectory() as d:
        for family in ("llama", "qwen3_moe"):
            st = os.path.join(d, family + "-st")
            ferry("synth", "--family", family, "--preset", "tiny", "--out", st)
            binary = os.path.join(d, family + "-bin")
            to_bin(st, binary)
            for tp in (1, 2):
                equal, why = same_dumps(st, binary, tp)
                if not equal:
                    failures.append(f"{family} tp {tp}: the .bin load differs: {why}")
            print(f"{family}: torch.save shards load as the safetensors do at tp 1 and 2")

        # A module's state_dict() (with _metadata) with tied weights, as *.pt.
        model = torch.nn.Module()
        model.embed = torch.nn.Embedding(16, 8)
        model.head = torch.nn.Linear(8, 16, bias=False)
        model.head.weight = model.embed.weight
        pt = os.path.join(d, "pt")
        os.makedirs(pt)
        torch.save(model.state_dict(), os.path.join(pt, "model.pt"))
        info = json.loads(ferry("inspect", pt, "--load-format", "pt", "--json").stdout)
        tensors = {t["name"]: t for t in info["tensors"]}
        if set(tensors) != {"embed.weight", "head.weight"}:
            failures.append(f"state_dict names: {sorted(tensors)}")
        elif tensors["embed.weight"]["offset"] != tensors["head.weight"]["offset"]:
            failures.append("tied weights are not one byte range")
        else:
            raw = open(os.path.join(pt, "model.pt"), "rb").read()
            t = tensors["embed.weight"]
            got = raw[t["offset"]:t["offset"] + t["nbytes"]]
            if got != model.embed.weight.detach().numpy().tobytes():
                failures.append("embed.weight's byte range does not hold its values")
        print("state_dict() with _metadata and tied weights: indexed")

        # A pickle that would run a command: refused, and the command never runs.
        marker = os.path.join(d, "ran")

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        evil = os.path.join(d, "evil")
        os.makedirs(evil)
        torch.save({"w": torch.zeros(2), "x": Evil()}, os.path.join(evil, "pytorch_model.bin"))
        p = ferry("inspect", evil, ok=False)
        if p.returncode == 0 or "system is not allowed" not in p.stderr:
            failures.append(f"the os.system pickle was not refused: {p.returncode} {p.stderr}")
        if os.path.exists(marker):
            failures.append("the os.system pickle RAN")
        print("a __reduce__ calling os.system: refused by name, nothing ran")

        # The legacy (pre-1.6) format is refused by name.
        legacy = os.path.join(d, "legacy")
        os.makedirs(legacy)
        torch.save({"w": torch.zeros(2)}, os.path.join(legacy, "pytorch_model.bin"),
                   _use_new_zipfile_serialization=False)
        p = ferry("inspect", legacy, ok=False)
        if p.returncode == 0 or "legacy torch.save file" not in p.stderr:
            failures.append(f"the legacy format was not refused by name: {p.stderr}")
        print("legacy torch.save: refused by name")

    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
