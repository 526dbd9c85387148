#!/usr/bin/env python3
# The GGUF peer (issue 37): llama.cpp's gguf-py reading a GGUF file as a Python
# loader would. argv: FILE TP. Starts TP rank processes at once; each opens the file
# with gguf.GGUFReader (a numpy memmap), and for every tensor copies its rank's rows
# (r/TP of the first dimension when it divides) into a numpy array it allocated,
# dequantizing quantized types with gguf.quants.dequantize first.
import os
import sys

from peer_ranks import run_ranks

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

PLAIN = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def rank_main(path, tp, rank):
    reader = GGUFReader(path)
    for t in reader.tensors:
        data = t.data
        if t.tensor_type not in PLAIN:
            data = dequantize(data, t.tensor_type)
        if tp > 1 and data.ndim >= 2 and data.shape[0] % tp == 0:
            rows = data.shape[0] // tp
            data = data[rank * rows:(rank + 1) * rows]
        param = np.empty(data.shape, dtype=data.dtype)
        np.copyto(param, data)


def main():
    path, tp = sys.argv[1], int(sys.argv[2])
    run_ranks(tp, lambda rank: rank_main(path, tp, rank))


if __name__ == "__main__":
    main()
