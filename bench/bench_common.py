"""Shared setup of the benchmark scripts: the checkpoint they read."""
import os
import subprocess


def medium_checkpoint(build, model=None):
    """Returns (folder, shard paths, total bytes) of the benchmark checkpoint:
    `model` when given, else a medium Llama synthesized once under BUILD/bench-cache."""
    ferry = os.path.join(build, "ferry")
    model = model or os.path.join(build, "bench-cache", "llama-medium-seed1")
    if not os.path.exists(os.path.join(model, "model.safetensors.index.json")):
        os.makedirs(os.path.dirname(model), exist_ok=True)
        subprocess.run([ferry, "synth", "--family", "llama", "--preset", "medium", "--out", model],
                       check=True)
    files = sorted(os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors"))
    return model, files, sum(os.path.getsize(f) for f in files)
