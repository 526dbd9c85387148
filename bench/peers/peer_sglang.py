#!/usr/bin/env python3
# The SGLang path (argv: FOLDER TP [DEVICE], DEVICE cpu by default or e.g. cuda):
# safe_open(framework="pt") on the CPU,
# get_tensor, narrow to tp rank 0 as SGLang's weight loaders do (a row-parallel
# weight, o_proj and down_proj, along its input dimension as
# RowParallelLinear.weight_loader does; every other split weight along dim 0 as
# ColumnParallelLinear and VocabParallelEmbedding do), then copy_ into a tensor
# preallocated on DEVICE.
import os
import sys

import torch
from safetensors import safe_open

folder, tp = sys.argv[1], int(sys.argv[2])
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
for name in files:
    with safe_open(os.path.join(folder, name), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            dim = 1 if key.endswith(ROW_PARALLEL) and t.dim() == 2 else 0
            if tp > 1 and t.dim() > dim and t.shape[dim] % tp == 0:
                t = t.narrow(dim, 0, t.shape[dim] // tp)
            dst = torch.empty(t.shape, dtype=t.dtype, device=device)
            dst.copy_(t)
if device != "cpu":
    torch.cuda.synchronize()
