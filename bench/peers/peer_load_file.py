#!/usr/bin/env python3
# The full-load peer: safetensors.torch.load_file of every shard (argv: FOLDER).
import os, sys
from safetensors.torch import load_file
folder = sys.argv[1]
for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
    load_file(os.path.join(folder, name))
