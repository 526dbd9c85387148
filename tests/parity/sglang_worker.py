# One rank of one parity case, in its own process: builds SGLang 0.5.23's model
# class for a checkpoint and a parallel layout on the CPU, fills every parameter
# with a fixed byte, runs SGLang's DefaultModelLoader steps (load_weights, which
# calls the model's post_load_weights, then each quant method's
# process_weights_after_loading) and writes what the rank holds after each step.
#
# It runs SGLang's code, so it needs the parity venv (scripts/sglang-parity.sh).
# Every way this process differs from a real SGLang server is one of the
# emulations listed in tests/parity/README.md; keep that list in step with this
# file.
#
# Output, in --out:
#   loader.safetensors     the rank's tensors right after load_weights
#   processed.safetensors  after process_weights_after_loading (when it ran)
#   meta.json              fill byte, stage errors, SGLang version, emulations
import argparse
import importlib.abc
import importlib.machinery
import json
import os
import sys
import traceback
import types

# The byte every SGLang parameter holds before loading; compare.py reports an
# element still holding it as unwritten.
FILL_BYTE = 0xA5

# GPU-only packages that SGLang imports at module level on paths loading never
# calls. Anything imported from them is a function that raises when called, so
# a stub reached while loading fails loudly instead of passing silently.
STUBBED_ROOTS = {"vllm"}


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        module = self.__name__

        def _unavailable(*args, **kwargs):
            raise RuntimeError(f"{module}.{attr} is a parity-harness import stub")

        return _unavailable


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED_ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())

import torch  # noqa: E402


class StandInGroup:
    """A process group that knows only its rank and size. Loading reads these to
    pick its shard; any other use (a collective, a device handle) raises, naming
    the attribute, so a load that would communicate is not silently emulated."""

    def __init__(self, name, rank, size):
        self.name = name
        self.rank_in_group = rank
        self.world_size = size
        self.rank = rank
        self.local_rank = rank
        self.ranks = list(range(size))
        self.first_rank = 0
        self.last_rank = size - 1
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == size - 1
        # Handles the LogitsProcessor keeps for later chunked gathers; never used
        # while loading.
        self.cpu_group = None
        self.device_group = None

    def __getattr__(self, attr):
        raise RuntimeError(
            f"stand-in process group {self.name!r} has no {attr!r}: "
            "SGLang tried to communicate while loading"
        )


GROUPS = ("tp", "attn_tp", "pp", "moe_ep", "moe_tp", "moe_dp", "attn_cp")


def install_groups():
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    groups = {}
    for name in GROUPS:
        groups[f"{name}_group"] = StandInGroup(
            name, getattr(parallel, f"{name}_rank"), getattr(parallel, f"{name}_size")
        )
    parallel.override_permanently(**groups)
    return {n: (getattr(parallel, f"{n}_rank"), getattr(parallel, f"{n}_size")) for n in GROUPS}


def emulate_capability(emulations):
    """The GPU capability is an H100's (9, 0). Installed before the server
    arguments resolve: their DSA defaults read it."""
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    emulations.append("torch.cuda.get_device_capability answers (9, 0)")


def _modules_of(klass):
    return [sys.modules[c.__module__] for c in klass.__mro__
            if c.__module__ in sys.modules and hasattr(sys.modules[c.__module__], "_is_cuda")]


def cuda_static_fp8_quant(x, scale=None, num_token_padding=None,
                          use_per_token_if_dynamic=False):
    """scaled_fp8_quant with a static scale on CUDA, in torch on the CPU:
    per_tensor_quant_fp8_kernel (kernels/jit/csrc/gemm/per_tensor_quant_fp8.cuh)
    multiplies by the F32 reciprocal 1.0f / *scale, clips to +-448 and rounds to
    E4M3. (SGLang's CPU fallback divides instead: a different rounding.) The
    dynamic form goes to cuda_scaled_fp8_quant."""
    import torch

    if scale is None:
        return cuda_scaled_fp8_quant(x, None, num_token_padding, use_per_token_if_dynamic)
    assert not num_token_padding and scale.numel() == 1
    inv = torch.reciprocal(scale.float().reshape(1))
    q = x.float() * inv
    q = torch.where(torch.isnan(q), torch.full_like(q, 448.0), q).clamp(-448.0, 448.0)
    return q.to(torch.float8_e4m3fn), scale


def emulate_cuda_postprocess(target, emulations):
    """process_weights_after_loading as on an NVIDIA GPU of the target (postprocess
    .target sm90 / sm100), for the per-tensor and per-channel FP8 methods: the
    quantization modules see CUDA, not the CPU (their CPU branches repack for AMX
    or requantize where CUDA expands per row), cutlass FP8 supported, no Marlin,
    the target's capability, FlashInfer's per-tensor bmm_fp8 available (ModelOpt),
    and scaled_fp8_quant computed as its CUDA kernel does."""
    from sglang.srt.layers.quantization import fp8, fp8_utils, modelopt_quant
    from sglang.srt.layers.quantization import utils as qutils
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a8_fp8 as ct_linear,
        compressed_tensors_w8a8_fp8_moe as ct_moe,
    )

    capability = (9, 0) if target == "sm90" else (10, 0)
    modules = [fp8, fp8_utils, modelopt_quant, qutils, ct_linear, ct_moe]
    for m in modules:
        for name, value in (("_is_cpu", False), ("_is_cuda", True), ("_is_hip", False),
                            ("_use_aiter", False), ("_is_fp8_fnuz", False),
                            ("_is_cpu_amx_available", False)):
            if hasattr(m, name):
                setattr(m, name, value)
        if hasattr(m, "cutlass_fp8_supported"):
            m.cutlass_fp8_supported = lambda: True
        if hasattr(m, "can_auto_enable_marlin_fp8"):
            m.can_auto_enable_marlin_fp8 = lambda *a, **k: False
        if hasattr(m, "get_device_capability"):
            m.get_device_capability = lambda *a, **k: capability
        if hasattr(m, "flashinfer_per_tensor_fp8_supported"):
            m.flashinfer_per_tensor_fp8_supported = lambda: True
        if hasattr(m, "is_fp8_fnuz"):
            m.is_fp8_fnuz = lambda: False
        if hasattr(m, "scaled_fp8_quant"):
            m.scaled_fp8_quant = cuda_static_fp8_quant
    emulations.append(
        f"process_weights_after_loading as on CUDA capability {capability}: the FP8 "
        "quantization modules see _is_cuda (not _is_cpu), cutlass FP8, no Marlin, "
        "FlashInfer bmm_fp8 available; scaled_fp8_quant as its CUDA kernel "
        "(x * (1 / s), clip, E4M3)"
    )


def cpu_gptq_marlin_repack(b_q_weight, perm, size_k, size_n, num_bits):
    """gptq_marlin_repack (kernels/jit/csrc/gemm/marlin/gptq_marlin_repack.cuh) for
    num_bits 4 without perm, in torch on the CPU: the kernel's thread indexing,
    every thread of every tile at once. Word th * 4 + warp of tile (kt, nt) packs,
    in the order pack_idx, the nibbles of rows tc_row + tc_offsets of columns cur_n
    and cur_n + 8."""
    import torch

    assert num_bits == 4 and perm.numel() == 0
    # The op's own checks (gptq_marlin_repack: RuntimeCheck on the tiles).
    if size_k % 16 != 0:
        raise RuntimeError(f"size_k = {size_k} is not divisible by tile_k_size = 16")
    if size_n % 64 != 0:
        raise RuntimeError(f"size_n = {size_n} is not divisible by tile_n_size = 64")
    assert b_q_weight.shape == (size_k // 8, size_n) and b_q_weight.dtype == torch.int32
    words = torch.arange(size_k * size_n // 8, dtype=torch.int64)
    tile, in_tile = words // 128, words % 128
    th_id, warp_id = in_tile // 4, in_tile % 4
    n_tiles = size_n // 64
    cur_n = (tile % n_tiles) * 64 + warp_id * 16 + th_id // 4
    tc_row = (tile // n_tiles) * 16 + (th_id % 4) * 2
    tc_offsets = [0, 1, 8, 9]
    vals = []
    for i in range(8):
        k = tc_row + tc_offsets[i % 4]
        n = cur_n + (i // 4) * 8
        word = b_q_weight.to(torch.int64)[k // 8, n] & 0xFFFFFFFF
        vals.append((word >> (4 * (k % 8))) & 15)
    res = torch.zeros_like(words)
    for i, v in enumerate([0, 2, 4, 6, 1, 3, 5, 7]):
        res |= vals[v] << (4 * i)
    res = torch.where(res >= 2**31, res - 2**32, res)
    return res.to(torch.int32).reshape(size_k // 16, size_n * 2)


def emulate_nvfp4_postprocess(target, emulations):
    """ModelOpt NVFP4's process_weights_after_loading as on the target: the FP4 GEMM
    backend initialize_fp4_gemm_config picks there (marlin below sm100,
    flashinfer_cutedsl on sm100); on sm90 the fused experts' MoE runner auto
    resolving to Marlin (create_moe_runner sees CUDA 9.0), gptq_marlin_repack on the
    CPU (cpu_gptq_marlin_repack) and a stand-in Marlin workspace (not a parameter);
    on sm100 the dense path sees a Blackwell platform, and its .cuda() of the
    swizzled scales is the identity."""
    import torch
    from sglang.srt.layers.quantization import fp4_utils, marlin_utils_fp4, modelopt_quant

    backend = "marlin" if target == "sm90" else "flashinfer_cutedsl"
    fp4_utils.FP4_GEMM_RUNNER_BACKEND = fp4_utils.Fp4GemmRunnerBackend(backend)
    emulations.append(f"FP4 GEMM backend {backend} (initialize_fp4_gemm_config on {target})")
    if target == "sm90":
        marlin_utils_fp4.gptq_marlin_repack = cpu_gptq_marlin_repack
        marlin_utils_fp4.marlin_make_workspace = (
            lambda device, *a, **k: torch.zeros(1, dtype=torch.int32))
        method = modelopt_quant.ModelOptNvFp4FusedMoEMethod
        method.create_moe_runner = on_hopper(modelopt_quant, method.create_moe_runner)
        emulations.append(
            "gptq_marlin_repack run on the CPU from its kernel's indexing; Marlin's "
            "workspace a stand-in; ModelOptNvFp4FusedMoEMethod.create_moe_runner sees "
            "CUDA 9.0 (auto -> marlin)")
        return
    emulate_nvfp4_experts_on_blackwell(modelopt_quant, emulations)
    linear = modelopt_quant.ModelOptFp4LinearMethod
    process = linear.process_weights_after_loading

    def process_on_blackwell(self, layer):
        saved = (modelopt_quant.get_platform, torch.Tensor.cuda)
        platform = saved[0]()
        modelopt_quant.get_platform = lambda: _Blackwell(platform)
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return process(self, layer)
        finally:
            modelopt_quant.get_platform, torch.Tensor.cuda = saved

    linear.process_weights_after_loading = process_on_blackwell
    emulations.append(
        "ModelOptFp4LinearMethod.process_weights_after_loading sees a Blackwell "
        "(sm100) platform; its .cuda() of the swizzled scales is the identity")


def on_blackwell(modules, fn):
    """`fn` with each of `modules`' get_platform() answering as sm100 while it runs."""
    modules = modules if isinstance(modules, list) else [modules]

    def wrapped(*args, **kwargs):
        saved = [m.get_platform for m in modules]
        for m, real in zip(modules, saved):
            m.get_platform = lambda real=real: _Blackwell(real())
        try:
            return fn(*args, **kwargs)
        finally:
            for m, real in zip(modules, saved):
                m.get_platform = real

    return wrapped


def server_arg_modules():
    """SGLang's server-argument resolution modules (sglang.srt.arg_groups: the
    overrides, the hooks, every model's override declarations) that ask the
    platform."""
    import importlib
    import pkgutil

    from sglang.srt import arg_groups

    out = []
    for info in pkgutil.walk_packages(arg_groups.__path__, arg_groups.__name__ + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # a hook for hardware this venv lacks; it asks nothing here
            continue
        if hasattr(module, "get_platform"):
            out.append(module)
    return out


def block_scale_interleave_host(unswizzled):
    """FlashInfer 0.7.2's nvfp4_block_scale_interleave (a CUDA or JIT-built op) on
    the CPU, from its host path (data/csrc/nv_internal/tensorrt_llm/thop/fp4Op.cpp,
    blockScaleInterleaveHost with computeSFIndex's SWIZZLED_128x4 index): every
    element (r, c) of the [rows, cols] scales (rows padded to 128, cols to 4, with
    zeros) goes to offset c % 4 + (c / 4) * 512 + (r % 32) * 16 + (r % 128 / 32) * 4
    + (r / 128) * 128 * cols_padded of its expert's flat output."""
    import torch

    experts = unswizzled.shape[0] if unswizzled.dim() == 3 else 1
    rows, cols = unswizzled.shape[-2], unswizzled.shape[-1]
    rows_p, cols_p = (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
    src = unswizzled.reshape(experts, rows, cols)
    out = torch.zeros(experts * rows_p * cols_p, dtype=unswizzled.dtype)
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    index = (c % 4 + (c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4
             + (r // 128) * 128 * cols_p)
    for e in range(experts):
        out[e * rows_p * cols_p + index.reshape(-1)] = src[e].reshape(-1)
    return out


def emulate_nvfp4_experts_on_blackwell(modelopt_quant, emulations):
    """ModelOpt NVFP4 fused experts on sm100: the method's constructor sees a
    Blackwell platform (off it, it refuses); flashinfer_trtllm's weight preparation
    runs FlashInfer 0.7.2's own row permutations (pure torch) and its
    nvfp4_block_scale_interleave on the CPU (block_scale_interleave_host)."""
    method = modelopt_quant.ModelOptNvFp4FusedMoEMethod
    method.__init__ = on_blackwell(modelopt_quant, method.__init__)
    emulations.append("ModelOptNvFp4FusedMoEMethod.__init__ sees a Blackwell platform")
    try:
        import flashinfer
    except Exception as error:  # only the flashinfer_trtllm cases need it
        emulations.append(f"flashinfer not importable: {error}")
        return
    flashinfer.nvfp4_block_scale_interleave = block_scale_interleave_host
    emulations.append(
        "flashinfer.nvfp4_block_scale_interleave run on the CPU from its host path's "
        "index (blockScaleInterleaveHost)")


class _Blackwell:
    """The platform as sm100 answers it; anything else from the real one."""

    def __init__(self, real):
        self._real = real

    is_blackwell = True
    is_sm100 = True

    def __getattr__(self, name):
        return getattr(self._real, name)


def emulate_hopper(emulations):
    """Answers SGLang's CUDA-only placement decisions as an H100 (sm90) does,
    scoped to the decisions themselves: the modules keep _is_cuda False
    everywhere else, so no CUDA stream or kernel is touched on the CPU."""
    from sglang.srt.model_loader import loader

    resolve = loader.resolve_shared_experts_config

    def resolve_on_cuda(model_class, hf_config, quant_config):
        # The fusion gate (shared_experts_fusion_disable_reason) is the model
        # class's own or an ancestor's; each reads its module's _is_cuda.
        modules = _modules_of(model_class)
        saved = [m._is_cuda for m in modules]
        for m in modules:
            m._is_cuda = True
        try:
            return resolve(model_class, hf_config, quant_config)
        finally:
            for m, value in zip(modules, saved):
                m._is_cuda = value

    loader.resolve_shared_experts_config = resolve_on_cuda
    emulations.append(
        "shared-expert fusion gate sees _is_cuda=True in the model class's modules"
    )

    from sglang.srt.layers.rotary_embedding import rope_variant

    # YaRN-scaled rotary tables (DeepSeek's rope_scaling) ask for the
    # accelerator to build their cache on; they are not weights.
    rope_variant.get_device = lambda *a, **k: "cpu"
    emulations.append("rope_variant.get_device answers 'cpu' (rotary caches)")

    from sglang.srt.models.deepseek_common import deepseek_weight_loader

    deepseek_weight_loader._is_cuda = True
    emulations.append(
        "deepseek_weight_loader._is_cuda=True (post_load_weights' kv_b_proj rule)"
    )
    emulate_cuda_tensor_requant(deepseek_weight_loader, emulations)
    # The DeepSeek loader hands host tensors to a thread pool (should_async_load), so
    # where an expert's gate_proj and up_proj input scales differ, which of them
    # FusedMoE._load_single_value keeps changes from run to run. Loaded inline, in
    # the checkpoint's order (up_proj after gate_proj): one of the orders the pool
    # may take, and the one ferry keeps.
    deepseek_weight_loader.should_async_load = lambda weight: False
    emulations.append("deepseek_weight_loader loads inline, in the checkpoint's order "
                      "(should_async_load answers False)")

    try:
        from sglang.srt.layers.attention.dsa import dsa_indexer
    except Exception as error:  # an import failure here only matters for V3.2
        emulations.append(f"dsa_indexer not importable: {error}")
        return
    indexer_init = dsa_indexer.Indexer.__init__

    def indexer_init_on_cuda(self, *args, **kwargs):
        saved = (dsa_indexer._is_cuda, dsa_indexer.resolve_num_sms)
        dsa_indexer._is_cuda = True
        dsa_indexer.resolve_num_sms = lambda *a, **k: 132
        try:
            indexer_init(self, *args, **kwargs)
        finally:
            dsa_indexer._is_cuda, dsa_indexer.resolve_num_sms = saved

    dsa_indexer.Indexer.__init__ = indexer_init_on_cuda
    emulate_nvfp4_moe_on_hopper(emulations)


def cuda_scaled_fp8_quant(x, scale=None, num_token_padding=None, use_per_token_if_dynamic=False):
    """The dynamic per-tensor path of SGLang's scaled_fp8_quant on CUDA, in torch on
    the CPU: sgl_per_tensor_quant_fp8's absmax kernel stores s = amax / 448 in a [1]
    F32 tensor, its quant kernel multiplies by the F32 reciprocal 1 / s, clamps to
    +-448 (fmin / fmax, so the NaN of a zero s becomes 448) and rounds to E4M3."""
    import torch

    assert scale is None and not use_per_token_if_dynamic and not num_token_padding
    x = x.float()
    s = (x.abs().max() / 448.0).reshape(1).to(torch.float32)
    inv = torch.reciprocal(s)
    q = x * inv
    q = torch.where(torch.isnan(q), torch.full_like(q, 448.0), q).clamp(-448.0, 448.0)
    return q.to(torch.float8_e4m3fn), s


def emulate_cuda_tensor_requant(loader_module, emulations):
    """post_load_weights' block_quant_to_tensor_quant and
    channel_quant_to_tensor_quant take fp8_utils' CUDA branch (scaled_fp8_quant, a
    [1] scale and the 1 / (amax / 448) multiplier) instead of the CPU one
    (input_to_float8: a 0-d scale, the multiplier 448 / amax). Scoped to those two
    calls from the DeepSeek loader."""
    from sglang.srt.layers.quantization import fp8_utils

    def on_cuda(fn):
        def wrapped(*args, **kwargs):
            saved = (fp8_utils._is_cuda, fp8_utils.scaled_fp8_quant)
            fp8_utils._is_cuda = True
            fp8_utils.scaled_fp8_quant = cuda_scaled_fp8_quant
            try:
                return fn(*args, **kwargs)
            finally:
                fp8_utils._is_cuda, fp8_utils.scaled_fp8_quant = saved

        return wrapped

    for name in ("block_quant_to_tensor_quant", "channel_quant_to_tensor_quant"):
        setattr(loader_module, name, on_cuda(getattr(fp8_utils, name)))
    emulations.append(
        "the DeepSeek loader's block_quant_to_tensor_quant / channel_quant_to_tensor_quant "
        "take fp8_utils' CUDA branch, scaled_fp8_quant emulated in torch "
        "(sgl_per_tensor_quant_fp8: s = amax / 448, x * (1 / s), clamp, E4M3)"
    )


def on_hopper(module, fn):
    """`fn` with `module`'s is_cuda() true and get_device_capability() (9, 0) while
    it runs."""

    def wrapped(*args, **kwargs):
        saved = (module.is_cuda, module.get_device_capability)
        module.is_cuda = lambda: True
        module.get_device_capability = lambda *a, **k: (9, 0)
        try:
            return fn(*args, **kwargs)
        finally:
            module.is_cuda, module.get_device_capability = saved

    return wrapped


def emulate_nvfp4_moe_on_hopper(emulations):
    """ModelOpt NVFP4 MoE on Hopper takes SGLang's Marlin fallback; off CUDA its
    constructor refuses the platform. Scoped to that constructor."""
    from sglang.srt.layers.quantization import modelopt_quant

    method = modelopt_quant.ModelOptNvFp4FusedMoEMethod
    method.__init__ = on_hopper(modelopt_quant, method.__init__)
    emulations.append(
        "ModelOptNvFp4FusedMoEMethod.__init__ sees CUDA 9.0 (Marlin fallback)"
    )
    emulations.append(
        "dsa Indexer.__init__ sees _is_cuda=True and 132 SMs (indexer fusion rule)"
    )


def held_tensors(model):
    """Every tensor the rank holds, by SGLang's name: parameters (tied ones under
    each name, as SGLang's state dict lists them), persistent buffers, and plain
    tensor attributes that post_load_weights sets (DeepSeek's w_kc, w_vc,
    w_scale). Non-persistent buffers are caches computed from the config (rotary
    tables), not weights."""
    out = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, param in module._parameters.items():
            if param is not None:
                out[prefix + name] = param.data
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = buf
        for name, value in vars(module).items():
            if name.startswith("_") or not isinstance(value, torch.Tensor):
                continue
            if isinstance(value, torch.nn.Parameter):
                continue
            if name == "workspace":  # Marlin's kernel scratch (zeros), not a weight
                continue
            out[prefix + name] = value
    return out


def fill(model):
    """Fills every tensor with FILL_BYTE, except those of more than one element
    that SGLang initializes to one non-zero value (torch.ones input scales that
    FusedMoE checks against 1 before loading the second shard): those keep it,
    and an element of theirs that still holds it and differs from ferry's is
    reported as unwritten. Returns name -> that value's bytes, in hex."""
    kept = {}
    with torch.no_grad():
        for name, tensor in held_tensors(model).items():
            flat = tensor.view(-1)
            if flat.numel() > 1 and flat.is_floating_point():
                first = flat[0]
                if first.item() != 0 and bool((flat == first).all()):
                    kept[name] = bytes(flat[:1].view(torch.uint8).tolist()).hex()
                    continue
            flat.view(torch.uint8).fill_(FILL_BYTE)
    return kept


def save_stage(model, path):
    """Writes the rank's tensors; a name that is another's storage (a tied
    lm_head) is written once, under its first name, and returned as an alias."""
    from safetensors.torch import save_file

    tensors = {}
    aliases = {}
    seen = {}
    transposed = []
    for name, tensor in held_tensors(model).items():
        if tensor.device.type != "cpu":
            raise RuntimeError(f"{name} is on {tensor.device}, not the CPU")
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        if tensor.dim() == 2 and not tensor.is_contiguous() and tensor.t().is_contiguous():
            # process_weights_after_loading keeps FP8 weights as weight.t(): a view
            # of the loaded [N, K] storage, saved in that order (what ferry holds).
            transposed.append(name)
            tensor = tensor.t()
        tensors[name] = tensor.detach().contiguous().clone()
    save_file(tensors, path)
    return {"tensors": len(tensors), "aliases": aliases, "transposed_views": transposed}


def dump_presharded(loader, model_config, model, world_rank, world_size, emulations):
    """PreshardedModelLoader's first-run dump (_dump_state_to_disk: the manifests,
    _build_dump_plan on rank 0, each rank's files, READY), SGLang's own code, with
    the world group's rank and barrier stood in for: the ranks are concurrent
    processes that meet at marker files in the dump folder."""
    import time
    from sglang.srt.configs.load_config import LoadConfig

    cls = loader.PreshardedModelLoader
    dumper = cls(LoadConfig(load_format="presharded"))
    shard_config = dumper._collect_shard_config(model_config)
    folder = dumper._presharded_dir(model_config, shard_config)
    sync = os.path.join(os.path.dirname(folder), ".sync-" + os.path.basename(folder))
    os.makedirs(sync, exist_ok=True)
    count = [0]

    def barrier():
        count[0] += 1
        open(os.path.join(sync, f"{count[0]}-{world_rank}"), "w").close()
        deadline = time.time() + 600
        while not all(os.path.exists(os.path.join(sync, f"{count[0]}-{r}"))
                      for r in range(world_size)):
            if time.time() > deadline:
                raise RuntimeError(f"barrier {count[0]}: other ranks never came")
            time.sleep(0.05)

    cls._world_rank_and_size = staticmethod(lambda: (world_rank, world_size))
    cls._world_barrier = staticmethod(barrier)
    emulations.append("PreshardedModelLoader's world rank and barrier: marker files")
    os.makedirs(folder, exist_ok=True)
    dumper._dump_state_to_disk(dict(model.state_dict()), cls._collect_extra_tensors(model),
                               folder, shard_config)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--pp-rank", type=int, default=0)
    parser.add_argument("--rank", type=int, default=0, help="tp rank")
    parser.add_argument("--attn-dp", type=int, default=1)
    parser.add_argument("--dp-lm-head", action="store_true")
    parser.add_argument("--draft", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--target", choices=["loader", "sm90", "sm100"], default="loader",
                        help="the CUDA target process_weights_after_loading emulates")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra ServerArgs field NAME=JSON")
    parser.add_argument("--save-sharded-state", metavar="DIR",
                        help="after the load, ShardedStateLoader.save_model into DIR")
    parser.add_argument("--save-presharded", action="store_true",
                        help="after the load, PreshardedModelLoader's dump into "
                             "<model>/presharded/ (every rank of the world at once: "
                             "run one worker per rank concurrently)")
    parser.add_argument("--load-sharded-state", action="store_true",
                        help="load --model (a sharded_state folder) with SGLang's "
                             "ShardedStateLoader.load_model instead; writes processed only")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    emulations = []
    meta = {"fill_byte": FILL_BYTE, "emulations": emulations, "stages": {}}

    import sglang
    from sglang.srt.server_args import ServerArgs

    meta["sglang_version"] = sglang.__version__
    emulate_capability(emulations)
    server_kwargs = dict(
        model_path=args.model,
        tp_size=args.tp,
        ep_size=args.ep,
        pp_size=args.pp,
        dtype=args.dtype,
        # The server's device is CUDA (SGLang decides its GPU layouts from it);
        # tensors are still built on the CPU below.
        device="cuda",
        load_format="safetensors",
        trust_remote_code=False,
    )
    emulations.append("ServerArgs.device='cuda', tensors built on the CPU")
    if args.attn_dp > 1:
        server_kwargs.update(enable_dp_attention=True, dp_size=args.attn_dp)
    if args.dp_lm_head:
        server_kwargs["enable_dp_lm_head"] = True
    for item in args.server_arg:
        key, value = item.split("=", 1)
        server_kwargs[key] = json.loads(value)
    if args.draft:
        server_kwargs.update(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=args.model,
        )
    if args.target == "sm100":
        # The server's defaults as resolved on sm100 (the DeepSeek family's MoE
        # runner: _deepseek_moe_quant_resolution), not the CPU's.
        server_args = ServerArgs(**server_kwargs)
        on_blackwell(server_arg_modules(), server_args.resolve_once)()
        emulations.append("ServerArgs.resolve_once's hooks and overrides see a Blackwell "
                          "platform")
    else:
        server_args = ServerArgs(**server_kwargs)

    from sglang.srt.runtime_context import SpawnRanks, publish

    world_rank = args.tp * args.pp_rank + args.rank
    dp_rank = None
    if args.attn_dp > 1:
        dp_rank = args.rank // (args.tp // args.attn_dp)
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=world_rank, dp_rank=dp_rank, gpu_id=0))
    meta["groups"] = install_groups()
    emulations.append("stand-in process groups (rank and size only)")
    # What the scheduler does right after publishing (managers/scheduler.py): the
    # MoE runtime flags from the resolved arguments (the global MoE runner that the
    # quant methods read while they build and process their layers).
    from sglang.srt.layers.moe import get_moe_runner_backend, initialize_moe_config

    initialize_moe_config()
    meta["moe_runner_backend"] = str(get_moe_runner_backend())
    # What the server's bootstrap does right after building the groups
    # (distributed/bootstrap.py, _init_parallel_groups): the attention-DP flags
    # that layers read while they are built (get_embedding_tp_kwargs).
    from sglang.srt.layers.dp_attention import initialize_dp_attention

    initialize_dp_attention(server_args)
    emulate_hopper(emulations)
    if args.target != "loader":
        emulate_cuda_postprocess(args.target, emulations)
        emulate_nvfp4_postprocess(args.target, emulations)

    from sglang.srt.configs.device_config import DeviceConfig  # noqa: F401
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import loader

    model_config = ModelConfig.from_server_args(
        server_args, model_path=args.model, is_draft_model=args.draft
    )
    # The rest of the bootstrap's per-model runtime setup that layers read
    # (init_layer_runtime; its gathered buffer is forward-only).
    from sglang.srt.layers.layernorm_sp import initialize_layernorm_sp

    initialize_layernorm_sp(model_config=model_config)
    meta["architecture"] = model_config.hf_config.architectures[0]
    meta["dtype"] = str(model_config.dtype)
    cpu = torch.device("cpu")
    if args.load_sharded_state:
        # SGLang's own sharded_state reader, as an engine started with
        # --load-format sharded_state runs it, on the CPU.
        from sglang.srt.configs.device_config import DeviceConfig as Device

        ss_config = LoadConfig(load_format="sharded_state")
        model = loader.ShardedStateLoader(ss_config).load_model(
            model_config=model_config, device_config=Device(device="cpu"))
        meta["stages"]["processed"] = save_stage(
            model, os.path.join(args.out, "processed.safetensors"))
        with open(os.path.join(args.out, "meta.json"), "w") as handle:
            json.dump(meta, handle, indent=1)
        return
    load_config = LoadConfig(load_format="safetensors")
    model_loader = loader.DefaultModelLoader(load_config)
    # DefaultModelLoader.load_model, step by step, with the fill between building
    # the model and loading it.
    quant_config = loader._get_quantization_config(model_config, load_config)
    meta["quantization"] = None if quant_config is None else quant_config.get_name()
    with loader.set_default_torch_dtype(model_config.dtype):
        with cpu:
            model = loader._initialize_model(model_config, load_config, quant_config)
        meta["kept_init"] = fill(model)
        loader.DefaultModelLoader.load_weights_only(
            model, model_loader._get_all_weights(model_config, model), cpu
        )
        meta["stages"]["loader"] = save_stage(
            model, os.path.join(args.out, "loader.safetensors"))
        try:
            loader.DefaultModelLoader.postprocess_weights(model, cpu)
            meta["stages"]["processed"] = save_stage(
                model, os.path.join(args.out, "processed.safetensors"))
            if args.save_sharded_state:
                os.makedirs(args.save_sharded_state, exist_ok=True)
                loader.ShardedStateLoader.save_model(model, args.save_sharded_state)
        except Exception as error:
            meta["stages"]["processed"] = {
                "error": f"{type(error).__name__}: {error}".splitlines()[0][:300],
                "where": traceback.format_exc().splitlines()[-3:],
            }
        if args.save_presharded and "error" not in meta["stages"]["processed"]:
            dump_presharded(loader, model_config, model, world_rank, args.tp * args.pp,
                            emulations)
    with open(os.path.join(args.out, "meta.json"), "w") as handle:
        json.dump(meta, handle, indent=1)


if __name__ == "__main__":
    main()
