# sharded_state against SGLang 0.5.23's own code (issue 34), both ways, on the CPU:
#
#   SGLang writes, ferry reads: SGLang's loader loads a `ferry synth` checkpoint and
#   ShardedStateLoader.save_model writes its sharded_state (sglang_worker.py
#   --save-sharded-state, rank by rank); `ferry load --set
#   model.load_format=sharded_state --dump-dir` of that folder must hold, rank by
#   rank, the bytes of a raw `ferry load --dump-dir` of the checkpoint.
#   ferry writes, SGLang reads: `ferry save --format sharded_state`, then SGLang's
#   ShardedStateLoader.load_model on it (sglang_worker.py --load-sharded-state); what
#   SGLang then holds must be what its own DefaultModelLoader holds after loading the
#   checkpoint (w_kc, w_vc made again by post_load_weights included).
#
# Outside CI (the venv holds torch and SGLang):
#   FERRY_PARITY_PYTHON=... python tests/parity/sharded_state_parity.py --work /tmp/ssp
import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# (id, synth args, tp, ep, target): SGLang saves what its GPU's
# process_weights_after_loading left (sglang_worker.py --target emulates sm90 on the
# CPU); ferry matches it with postprocess.target (loader: the checkpoint's layout,
# which for FP8 lacks the KV-cache scales every SGLang attention holds).
CASES = [
    ("llama/tp2", ["--family", "llama", "--preset", "tiny"], 2, 1, None),
    ("llama/tied-tp1", ["--family", "llama", "--preset", "tiny", "--tie-embeddings"], 1, 1, None),
    ("qwen3/tied-tp2", ["--family", "qwen3", "--preset", "tiny", "--tie-embeddings"], 2, 1, None),
    ("gemma2/tp2", ["--family", "gemma2", "--preset", "tiny"], 2, 1, None),
    ("qwen3_moe/tp2-ep2", ["--family", "qwen3_moe", "--preset", "tiny"], 2, 2, None),
    ("deepseek_v3/tp2", ["--family", "deepseek_v3", "--preset", "tiny"], 2, 1, None),
    ("deepseek_v3/tp4-attn_dp2", ["--family", "deepseek_v3", "--preset", "tiny"], 4, 1, None),
    ("deepseek_v3-fp8/tp2-sm90", ["--family", "deepseek_v3", "--preset", "tiny", "--quant",
                                  "fp8-block", "--quant-block", "8"], 2, 1, "sm90"),
    # Not llama with block FP8: SGLang's legacy Llama loader never writes its
    # weight_scale_inv (docs/ARCHITECTURE.md, the parity tables), so SGLang's own
    # state holds no scales to compare.
]


def run(cmd, log):
    with open(log, "w") as handle:
        return subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT).returncode


def last_error(log):
    with open(log) as handle:
        lines = [l.strip() for l in handle if l.strip()]
    return lines[-1][:300] if lines else "(no output)"


def tensors(path):
    out = {}
    with open(path, "rb") as handle:
        n = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(n))
        base = 8 + n
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            handle.seek(base + begin)
            out[name] = handle.read(end - begin)
    return out


def same(a, b, ignore=()):
    """The names in both files whose bytes differ, and the names only one holds."""
    x, y = tensors(a), tensors(b)
    keep = lambda n: not any(n.endswith(s) for s in ignore)
    names_x = {n for n in x if keep(n)}
    names_y = {n for n in y if keep(n)}
    differ = sorted(n for n in names_x & names_y if x[n] != y[n])
    return differ, sorted(names_x ^ names_y)


def against_raw(d, dumped, tp):
    """ferry's dump in d/`dumped` against its raw load's in d/raw, rank by rank:
    "identical", else each rank's differing and one-sided names (five at most)."""
    verdicts = []
    for rank in range(tp):
        differ, only = same(os.path.join(d, "raw", f"rank-{rank}.safetensors"),
                            os.path.join(d, dumped, f"rank-{rank}.safetensors"))
        verdicts.append({"rank": rank, "differ": differ[:5], "only_one": only[:5]})
    ok = all(not v["differ"] and not v["only_one"] for v in verdicts)
    return "identical" if ok else verdicts


def normalizer_differs(ck, processed):
    """Gemma 2's model.normalizer as SGLang holds it after reading ferry's files,
    against torch.tensor(hidden_size**0.5) in the model's dtype (Gemma2Model)."""
    import torch
    from safetensors.torch import load_file
    held = load_file(processed)
    if "model.normalizer" not in held:
        return []
    with open(os.path.join(ck, "config.json")) as handle:
        config = json.load(handle)
    dtype = held["model.normalizer"].dtype
    want = torch.tensor(config["hidden_size"] ** 0.5, dtype=dtype)
    return [] if torch.equal(held["model.normalizer"], want) else ["model.normalizer"]


def worker(py, args, log):
    return run([py, "-W", "ignore", os.path.join(HERE, "sglang_worker.py"), *args], log)


def case(cid, synth, tp, ep, target, work, ferry, py):
    d = os.path.join(work, cid.replace("/", "_"))
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    ck = os.path.join(d, "ck")
    if run([ferry, "synth", *synth, "--out", ck], os.path.join(d, "synth.log")) != 0:
        return {"id": cid, "error": "synth: " + last_error(os.path.join(d, "synth.log"))}
    layout = ["--tp", str(tp), "--ep", str(ep)]
    sgl_layout = ["--tp", str(tp), "--ep", str(ep)]
    if "attn_dp2" in cid:
        layout += ["--set", "parallel.attn_dp=2"]
        sgl_layout += ["--attn-dp", "2"]
    if target:
        layout += ["--set", f"postprocess.target={target}"]
        sgl_layout += ["--target", target]
    result = {"id": cid, "tp": tp, "ep": ep, "target": target or "loader"}
    # ferry's raw load, the reference for ferry's reads.
    if run([ferry, "load", "--model", ck, *layout, "--dump-dir", os.path.join(d, "raw"),
            "--quiet"], os.path.join(d, "raw.log")) != 0:
        return {**result, "error": "ferry raw: " + last_error(os.path.join(d, "raw.log"))}
    # 1. SGLang writes, ferry reads.
    sgl_ss = os.path.join(d, "sglang_ss")
    for rank in range(tp):
        out = os.path.join(d, f"sglang-{rank}")
        code = worker(py, ["--model", ck, "--out", out, *sgl_layout,
                           "--rank", str(rank), "--save-sharded-state", sgl_ss],
                      out + ".log")
        if code != 0:
            return {**result, "error": "SGLang save: " + last_error(out + ".log")}
    shutil.copy(os.path.join(ck, "config.json"), sgl_ss)
    result["sglang_files"] = sorted(f for f in os.listdir(sgl_ss) if f.endswith(".safetensors"))
    if run([ferry, "load", "--model", sgl_ss, *layout, "--set", "model.load_format=sharded_state",
            "--dump-dir", os.path.join(d, "from_sglang"), "--quiet"],
           os.path.join(d, "from_sglang.log")) != 0:
        result["ferry_reads_sglang"] = "refused: " + last_error(os.path.join(d, "from_sglang.log"))
    else:
        result["ferry_reads_sglang"] = against_raw(d, "from_sglang", tp)
    # 2. ferry writes, SGLang reads.
    ferry_ss = os.path.join(d, "ferry_ss")
    if run([ferry, "save", "--model", ck, *layout, "--format", "sharded_state", "--out", ferry_ss,
            "--quiet"], os.path.join(d, "save.log")) != 0:
        return {**result, "error": "ferry save: " + last_error(os.path.join(d, "save.log"))}
    verdicts = []
    for rank in range(tp):
        out = os.path.join(d, f"sglang-reads-{rank}")
        code = worker(py, ["--model", ferry_ss, "--out", out, *sgl_layout,
                           "--rank", str(rank), "--load-sharded-state"], out + ".log")
        if code != 0:
            verdicts.append({"rank": rank, "refused": last_error(out + ".log")})
            continue
        # Rotary tables are computed from the config, not weights. Gemma 2's
        # normalizer too: the reference run's fill overwrote it (SGLang's loader never
        # writes it), so it is checked against torch's own value instead.
        differ, only = same(os.path.join(d, f"sglang-{rank}", "processed.safetensors"),
                            os.path.join(out, "processed.safetensors"),
                            ignore=("inv_freq", "cos_sin_cache", "normalizer"))
        differ += normalizer_differs(ck, os.path.join(out, "processed.safetensors"))
        verdicts.append({"rank": rank, "differ": differ[:5], "only_one": only[:5]})
    ok = all("refused" not in v and not v["differ"] and not v["only_one"] for v in verdicts)
    result["sglang_reads_ferry"] = "identical" if ok else verdicts
    # 3. SGLang's presharded folder (PreshardedModelLoader's first-run dump, all ranks
    # at once), read by ferry's model.load_format=presharded with its keys verified.
    procs = []
    for rank in range(tp):
        out = os.path.join(d, f"sglang-presharded-{rank}")
        log = open(out + ".log", "w")
        procs.append((out, subprocess.Popen(
            [py, "-W", "ignore", os.path.join(HERE, "sglang_worker.py"), "--model", ck, "--out",
             out, *sgl_layout, "--rank", str(rank), "--save-presharded"],
            stdout=log, stderr=subprocess.STDOUT)))
    failed = [out for out, p in procs if p.wait() != 0]
    if failed:
        result["ferry_reads_sglang_presharded"] = "SGLang dump: " + last_error(failed[0] + ".log")
        return result
    result["sglang_presharded"] = sorted(os.listdir(os.path.join(ck, "presharded")))
    log = os.path.join(d, "from_presharded.log")
    if run([ferry, "load", "--model", ck, *layout, "--set", "model.load_format=presharded",
            "--set", "load.verify_checksums=true", "--dump-dir",
            os.path.join(d, "from_presharded"), "--quiet"], log) != 0:
        result["ferry_reads_sglang_presharded"] = "refused: " + last_error(log)
        return result
    result["ferry_reads_sglang_presharded"] = against_raw(d, "from_presharded", tp)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", required=True)
    parser.add_argument("--ferry", default=os.path.join(ROOT, "build", "release", "ferry"))
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    results = []
    for cid, synth, tp, ep, target in CASES:
        if args.only and args.only not in cid:
            continue
        r = case(cid, synth, tp, ep, target, args.work, args.ferry, sys.executable)
        print(json.dumps(r), flush=True)
        results.append(r)
    with open(os.path.join(args.work, "results.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    bad = [r for r in results if r.get("error") or r.get("ferry_reads_sglang") != "identical"
           or r.get("sglang_reads_ferry") != "identical"
           or r.get("ferry_reads_sglang_presharded") != "identical"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
