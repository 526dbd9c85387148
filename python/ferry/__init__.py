"""ferry: load a model checkpoint into sharded, kernel-ready parameters.

    import ferry, torch
    rt = ferry.Runtime({"model.path": "/models/llama", "parallel.tp": 2})
    model = rt.load()                       # raises ferry.Error (stage, file, tensor, rule)
    for p in model.params():
        t = torch.from_dlpack(p)            # zero-copy; FP8 comes as uint8, see p.dtype

`Runtime.start()`, `prepare()` and `commit()` return a LoadHandle (`wait`,
`cancel`, `progress`, `done`); `on_progress(progress)` (return False to cancel)
and `on_layer_ready(layer, tp_rank)` run on a ferry thread.

The weight cache: `ferry.CacheDaemon(config)` loads once and `serve()`s (as
`ferry serve`) until `stop()`; a Runtime with `cache.mode` "daemon" or "client"
maps that daemon's parameters instead of reading, and `on_cache_lost(why)` is
called if the daemon dies while the model lives (unset: the process aborts).
"""
from ._ferry import (CacheDaemon, Config, Error, LoadHandle, LoadProgress, Model, Param,  # noqa: F401
                     Runtime, __version__)

__all__ = ["CacheDaemon", "Config", "Error", "LoadHandle", "LoadProgress", "Model", "Param",
           "Runtime", "__version__"]
