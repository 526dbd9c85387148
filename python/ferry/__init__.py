"""ferry: load a model checkpoint into sharded, kernel-ready parameters.

    import ferry, torch
    rt = ferry.Runtime({"model.path": "/models/llama", "parallel.tp": 2})
    model = rt.load()                       # raises ferry.Error (stage, file, tensor, rule)
    for p in model.params():
        t = torch.from_dlpack(p)            # zero-copy; FP8 comes as uint8, see p.dtype

`Runtime.start()`, `prepare()` and `commit()` return a LoadHandle (`wait`,
`cancel`, `progress`, `done`); `on_progress(progress)` (return False to cancel)
and `on_layer_ready(layer, tp_rank)` run on a ferry thread.
"""
from ._ferry import (Config, Error, LoadHandle, LoadProgress, Model, Param, Runtime,  # noqa: F401
                     __version__)

__all__ = ["Config", "Error", "LoadHandle", "LoadProgress", "Model", "Param", "Runtime",
           "__version__"]
