#!/usr/bin/env python3
# The PyTorch-checkpoint peer (issue 37): what a Python loader does with *.bin shards.
# argv: FOLDER TP. Starts TP rank processes at once, as an engine's ranks would; each
# torch.load()s every pytorch_model*.bin with weights_only=True and mmap=True, then
# copies its rank's slice of every tensor (rows r/TP of dim 0 when it divides, else
# the whole tensor) into a parameter it allocated (torch.empty), which is the copy a
# weight_loader makes. The process exits when every rank has.
import os
import sys

from peer_ranks import run_ranks

import torch


def rank_main(folder, tp, rank):
    names = sorted(f for f in os.listdir(folder) if f.startswith("pytorch_model") and f.endswith(".bin"))
    copied = 0
    for name in names:
        state = torch.load(os.path.join(folder, name), map_location="cpu", weights_only=True, mmap=True)
        for tensor in state.values():
            if tp > 1 and tensor.dim() >= 1 and tensor.shape[0] % tp == 0:
                rows = tensor.shape[0] // tp
                tensor = tensor.narrow(0, rank * rows, rows)
            param = torch.empty(tensor.shape, dtype=tensor.dtype)
            param.copy_(tensor)
            copied += param.numel() * param.element_size()
        del state
    return copied


def main():
    folder, tp = sys.argv[1], int(sys.argv[2])
    run_ranks(tp, lambda rank: rank_main(folder, tp, rank))


if __name__ == "__main__":
    main()
