#!/usr/bin/env python3
"""How a PyTorch engine adopts a model ferry loaded: every parameter becomes a
torch tensor through DLPack (no copy), then takes the place of the module's own
parameter of the same name.

    PYTHONPATH=build/release/python python3 examples/python/torch_adopt.py CHECKPOINT [TP]

The module here is a stand-in engine's: a tree of torch.nn.Module with one
parameter per name, allocated empty the way an engine builds its model before
loading. Exits 77 (skipped) where torch is not installed.
"""
import sys

try:
    import torch
except ImportError:
    print("torch_adopt: torch is not installed; skipped")
    sys.exit(77)

import ferry


def module_tree(names):
    """An nn.Module holding an empty parameter at each dotted name."""
    root = torch.nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.empty(0), requires_grad=False))
    return root


def adopt(module, model, tp_rank):
    """Swaps ferry's tensors of one rank into the module; returns how many."""
    n = 0
    for p in model.params():
        if p.tp_rank != tp_rank:
            continue
        t = torch.from_dlpack(p)  # FP8 comes as uint8: view it as p.dtype says
        if p.dtype == "F8_E4M3":
            t = t.view(torch.float8_e4m3fn)
        *path, leaf = p.name.split(".")
        owner = module.get_submodule(".".join(path)) if path else module
        setattr(owner, leaf, torch.nn.Parameter(t, requires_grad=False))
        n += 1
    return n


def main():
    checkpoint = sys.argv[1]
    tp = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    model = ferry.Runtime({"model.path": checkpoint, "parallel.tp": tp}).load()
    names = sorted({p.name for p in model.params() if p.tp_rank == 0})
    module = module_tree(names)
    n = adopt(module, model, 0)
    state = module.state_dict()
    for p in model.params():
        if p.tp_rank == 0:
            t = state[p.name]
            assert t.data_ptr() == p.data_ptr, f"{p.name} was copied"
            assert list(t.shape) == list(p.shape), p.name
    print(f"torch_adopt: {n} parameters of tp rank 0 adopted without a copy, e.g. "
          f"{names[0]} {tuple(state[names[0]].shape)} {state[names[0]].dtype}")


if __name__ == "__main__":
    main()
