# postprocess.target for NVFP4, replayed from SGLang 0.5.23's own code where it
# cannot run without a GPU: ModelOptFp4LinearMethod.process_weights_after_loading
# (modelopt_quant.py) on sm100 (swizzle_blockscale, quantization/utils.py, moves its
# result to CUDA) and on sm90 (prepare_nvfp4_layer_for_marlin, marlin_utils_fp4.py,
# whose gptq_marlin_repack is a CUDA kernel). Their Python steps are replayed in
# numpy, the repack kernel (kernels/jit/csrc/gemm/marlin/gptq_marlin_repack.cuh)
# thread by thread, on a plain (loader) dump, and compared with ferry's dumps of the
# same checkpoint on each target. Plain Python and numpy: no SGLang, no torch.
#
#   python3 tests/parity/nvfp4_targets.py [--ferry build/release/ferry]
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

from compare import read_safetensors


def e4m3(b):
    b = b.astype(np.int64)
    e = (b >> 3) & 15
    m = b & 7
    mag = np.where(e == 0, m / 8.0 / 64.0, (1 + m / 8.0) * np.exp2(e - 7.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


def round_bf16(x):  # float32 to the nearest bfloat16 (even on ties), as float32
    u = np.array(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def marlin_global_scale(ws2, dtype):
    """nvfp4_marlin_process_global_scale(x.to(dtype)): the bits of the result."""
    if dtype == "F16":
        v = np.float16(np.float32(np.float16(ws2)) * np.float32(2.0 ** 7))
        return np.array(v).view(np.uint16)
    g = round_bf16(round_bf16(ws2) * np.float32(2.0 ** 119))
    return np.array(g).view(np.uint32) >> 16


def swizzle_blockscale(scale):
    rows, cols = scale.shape
    rp, cp = (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
    p = np.zeros((1, rp, cp), dtype=scale.dtype)
    p[0, :rows, :cols] = scale
    p = p.reshape(1, rp // 128, 4, 32, cp // 4, 4).transpose((0, 1, 4, 3, 2, 5))
    return np.ascontiguousarray(p).reshape(rp, cp)


def marlin_padded_nk(n, k):
    return min((((n + 63) // 64 * 64, (k + 127) // 128 * 128),
                ((n + 127) // 128 * 128, (k + 63) // 64 * 64)),
               key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def gptq_marlin_repack(weight, n, k):
    """The kernel's threads over weight.view(int32).T (num_bits 4, no perm)."""
    q = np.zeros((k, n), dtype=np.uint32)  # element (k, n)
    q[0::2, :] = (weight & 15).T
    q[1::2, :] = (weight >> 4).T
    out = np.zeros(n * k // 8, dtype=np.uint32)
    tc_offsets, pack_idx = [0, 1, 8, 9], [0, 2, 4, 6, 1, 3, 5, 7]
    for k_tile in range(k // 16):
        for n_tile in range(n // 64):
            for warp_id in range(4):
                for th_id in range(32):
                    cur_n = n_tile * 64 + warp_id * 16 + th_id // 4
                    tc_row = k_tile * 16 + (th_id % 4) * 2
                    vals = [q[tc_row + o, cur_n] for o in tc_offsets]
                    vals += [q[tc_row + o, cur_n + 8] for o in tc_offsets]
                    res = 0
                    for i in range(8):
                        res |= int(vals[pack_idx[i]]) << (4 * i)
                    out[(k_tile * (n // 64) + n_tile) * 128 + th_id * 4 + warp_id] = res
    return out.view(np.int32).reshape(k // 16, 2 * n)


SCALE_PERM = [i + 8 * j for i in range(8) for j in range(8)]
SCALE_PERM_SINGLE = [2 * i + j for i in range(4) for j in [0, 1, 8, 9, 16, 17, 24, 25]]


def marlin_scales(scales_padded, n):
    t = e4m3(scales_padded.T.copy())  # weight_scale.T.to(bf16): exact
    t = t.reshape(-1, 64)[:, SCALE_PERM].reshape(-1, n)  # marlin_permute_scales
    h = t.astype(np.float16).reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(t.shape[0], -1)
    return ((h * np.float16(128)).view(np.int16) << 1).view(np.uint8)[:, 1::2]


def tensor(f, name):
    t = f[name]
    dt = {"F32": np.float32, "U8": np.uint8, "F8_E4M3": np.uint8, "BF16": np.uint16,
          "F16": np.uint16, "I32": np.int32}[t.dtype]
    return np.frombuffer(t.data, dtype=dt).reshape(t.shape)


def check_experts(plain, sm90, name):
    """ModelOptNvFp4FusedMoEMethod's Marlin branch: w13_weight_scale_2[:, 0] (or the
    [E] as loaded), then prepare_moe_nvfp4_layer_for_marlin expert by expert."""
    diffs = []
    base = name[: -len("weight")]
    w = tensor(plain, name)
    s = tensor(plain, base + "weight_scale")
    experts, n, k = w.shape[0], w.shape[1], w.shape[2] * 2
    got_w, got_s = tensor(sm90, name), tensor(sm90, base + "weight_scale")
    for e in range(experts):
        if not np.array_equal(got_w[e], gptq_marlin_repack(w[e], n, k)):
            diffs.append(f"sm90 {name}[{e}]")
        if not np.array_equal(got_s[e], marlin_scales(s[e], n)):
            diffs.append(f"sm90 {base}weight_scale[{e}]")
    s2 = tensor(plain, base + "weight_scale_2")
    s2 = s2[:, 0] if s2.ndim == 2 else s2
    want = [marlin_global_scale(v, sm90[base + "weight_scale_2"].dtype) for v in s2]
    if not np.array_equal(tensor(sm90, base + "weight_scale_2"), np.array(want).reshape(-1)):
        diffs.append(f"sm90 {base}weight_scale_2")
    if not np.array_equal(tensor(sm90, base + "input_scale"), tensor(plain, base + "input_scale")):
        diffs.append(f"sm90 {base}input_scale")
    return diffs


def check_rank(plain, sm90, sm100):
    diffs = []
    count = 0
    for name, t in plain.items():
        if t.dtype != "U8":
            continue
        count += 1
        if len(t.shape) == 3:
            diffs += check_experts(plain, sm90, name)
            continue
        base = name[: -len("weight")]
        w = tensor(plain, name)
        s = tensor(plain, base + "weight_scale")
        is2 = np.float32(tensor(plain, base + "input_scale").max())
        ws2 = np.float32(tensor(plain, base + "weight_scale_2").max())
        want = {"alpha": np.float32(is2 * ws2), "input_scale_inv": np.float32(np.float32(1) / is2)}
        # sm100: alias_or_bind_derived_param over weight_scale where the shapes agree.
        sw = swizzle_blockscale(s)
        got = base + ("weight_scale" if sw.shape == s.shape else "weight_scale_interleaved")
        if sm100 is not None and not np.array_equal(tensor(sm100, got), sw):
            diffs.append(f"sm100 {got}")
        if sm100 is not None and not np.array_equal(tensor(sm100, name), w):
            diffs.append(f"sm100 {name}")
        # sm90: prepare_nvfp4_layer_for_marlin on the padded weight and scales.
        n, k = w.shape[0], w.shape[1] * 2
        np_, kp = marlin_padded_nk(n, k)
        wp = np.zeros((np_, kp // 2), dtype=np.uint8)
        wp[:n, : k // 2] = w
        sp = np.zeros((np_, kp // 16), dtype=np.uint8)
        sp[:n, : k // 16] = s
        if not np.array_equal(tensor(sm90, name), gptq_marlin_repack(wp, np_, kp)):
            diffs.append(f"sm90 {name}")
        if not np.array_equal(tensor(sm90, base + "weight_scale"), marlin_scales(sp, np_)):
            diffs.append(f"sm90 {base}weight_scale")
        dtype = sm90[base + "weight_global_scale"].dtype
        if tensor(sm90, base + "weight_global_scale")[0] != marlin_global_scale(ws2, dtype):
            diffs.append(f"sm90 {base}weight_global_scale")
        if base + "bias" in plain:  # marlin_permute_bias of the padded bias
            bias = np.zeros(np_, dtype=np.uint16)
            bias[:n] = tensor(plain, base + "bias")
            if not np.array_equal(tensor(sm90, base + "bias"),
                                  bias.reshape(-1, 32)[:, SCALE_PERM_SINGLE].reshape(-1)):
                diffs.append(f"sm90 {base}bias")
        for target, f, extra in (("sm100", sm100, {}), ("sm90", sm90, {"input_global_scale": is2})):
            for scalar, value in ({**want, **extra} if f is not None else {}).items():
                if tensor(f, base + scalar).reshape(()) != value:
                    diffs.append(f"{target} {base}{scalar}")
    return count, diffs


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ferry", default="build/release/ferry")
    args = parser.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        # (family, model.dtype): F16 takes the other global-scale exponent.
        for family, dtype in (("llama", "auto"), ("llama", "f16"), ("qwen2", "auto"),
                              ("qwen3", "auto"), ("qwen3_moe", "auto"), ("qwen3_moe", "f16")):
            ck = os.path.join(tmp, family)
            if not os.path.exists(ck):
                subprocess.run([args.ferry, "synth", "--family", family, "--preset", "tiny",
                                "--quant", "nvfp4", "--out", ck], check=True,
                               capture_output=True)
            for tp in (1, 2):
                dumps = {}
                # NVFP4 experts on sm100 are refused (the trtllm runner's shuffles).
                targets = ("loader", "sm90") if family == "qwen3_moe" else ("loader", "sm90", "sm100")
                for target in targets:
                    out = os.path.join(tmp, f"{family}-{dtype}-{tp}-{target}")
                    subprocess.run([args.ferry, "load", "--model", ck, "--set",
                                    f"parallel.tp={tp}", "--set", f"postprocess.target={target}",
                                    "--set", f"model.dtype={dtype}", "--dump-dir", out],
                                   check=True, capture_output=True)
                    dumps[target] = out
                for r in range(tp):
                    files = [read_safetensors(os.path.join(dumps[t], f"rank-{r}.safetensors"))
                             if t in dumps else None for t in ("loader", "sm90", "sm100")]
                    count, diffs = check_rank(*files)
                    status = "PASS" if count and not diffs else "DIFF " + ", ".join(diffs[:4])
                    failed += status != "PASS"
                    print(f"{family}/nvfp4-{dtype}-tp{tp} rank {r}: {count} linears: {status}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
