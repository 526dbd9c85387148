# The parity matrix: for each case, a checkpoint from `ferry synth`, what each
# rank holds after `ferry load --dump-dir`, what the same rank holds after
# SGLang 0.5.23's own loader (sglang_worker.py, one process per rank), and the
# differences (compare.py). Writes results.json and results.md to --work and,
# with --update-docs, the table in docs/ARCHITECTURE.md between the parity
# markers. Run it through scripts/sglang-parity.sh, which picks the venv.
import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import compare  # noqa: E402

DENSE = ["llama", "qwen2", "mistral", "qwen3", "gemma", "gemma2", "gemma3", "phi3"]
MOE = ["mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe", "deepseek_v2",
       "glm4_moe", "deepseek_v32"]
DEEPSEEK = ["deepseek_v3", "deepseek_v2", "deepseek_v32"]
# Families whose SGLang model has a NextN (MTP) draft class that ferry loads.
MTP = ["deepseek_v3", "glm4_moe", "deepseek_v32"]
REAL = ["llama-3.1-8b", "qwen2.5-7b", "mistral-7b-instruct-v0.3",
        "mixtral-8x7b-v0.1", "qwen3-30b-a3b", "deepseek-v3", "llama-3.2-3b-instruct",
        "sakura-14b-qwen2.5", "llama3-chinese-8b"]
QUANTS = ["fp8-block", "fp8-channel", "fp8-tensor", "modelopt-fp8", "nvfp4"]

# SGLang tensors that are not weights and that ferry rightly does not hold:
# rotary tables kept as plain tensor attributes, computed from the config.
IGNORE = [r"(.*\.)?rotary_emb[a-z_]*\.(original_inv_freq|inv_freq|cos_sin_cache)"]


def case(cid, tier, synth, layout=None, dtype="auto", ferry_set=(), server_args=(),
         config=None, sizes=None):
    """One case. `config` is merged into the synthesized config.json (both sides
    read it); `sizes` into the preset's config before the tensors are written
    (ferry synth --from-config); `server_args` are SGLang ServerArgs fields
    (NAME=JSON) and `ferry_set` the matching ferry keys."""
    layout = {**dict(tp=1, ep=1, pp=1, attn_dp=1, dp_lm_head=False, draft=False),
              **(layout or {})}
    return dict(id=cid, tier=tier, synth=synth, layout=layout, dtype=dtype,
                ferry_set=list(ferry_set), server_args=list(server_args),
                config=config or {}, sizes=sizes or {})


def tiny(family, *extra):
    return ["--family", family, "--preset", "tiny", *extra]


def matrix():
    """Every case, in tiers: 1 is one case per family (breadth), 2 the layouts,
    3 dtypes, ties and drafts, 4 real tensor sets and quantized formats."""
    cases = []
    for fam in DENSE + MOE:
        cases.append(case(f"{fam}/tp2", 1, tiny(fam), dict(tp=2)))
    for fam in DENSE + MOE:
        cases.append(case(f"{fam}/tp1", 2, tiny(fam), dict(tp=1)))
        cases.append(case(f"{fam}/tp4", 2, tiny(fam), dict(tp=4)))
        cases.append(case(f"{fam}/pp2", 2, tiny(fam), dict(pp=2)))
    for fam in MOE:
        cases.append(case(f"{fam}/tp2-ep2", 2, tiny(fam), dict(tp=2, ep=2)))
    for fam in DEEPSEEK + ["qwen3", "qwen3_moe", "llama"]:
        cases.append(case(f"{fam}/tp4-attn_dp2", 2, tiny(fam), dict(tp=4, attn_dp=2)))
        cases.append(case(f"{fam}/tp4-attn_dp2-dp_lm_head", 2, tiny(fam),
                          dict(tp=4, attn_dp=2, dp_lm_head=True)))
    for fam in MTP:
        cases.append(case(f"{fam}/draft-tp2", 3, tiny(fam), dict(tp=2, draft=True)))
    for fam in ["llama", "qwen2", "qwen3"]:
        cases.append(case(f"{fam}/tied-tp2", 3, tiny(fam, "--tie-embeddings"), dict(tp=2)))
    for fam in DENSE + ["qwen3_moe", "deepseek_v3"]:
        cases.append(case(f"{fam}/f32-tp2", 3, tiny(fam), dict(tp=2), dtype="f32"))
        cases.append(case(f"{fam}/f16-ckpt-tp2", 3, tiny(fam, "--dtype", "f16"),
                          dict(tp=2)))
    real_config = {m: os.path.join(ROOT, "..", "shared", "data", "models", m, "config.json")
                   for m in REAL}
    for model, layout, name in [("deepseek-v3", dict(tp=2, draft=True), "draft-tp2"),
                                ("deepseek-v3", dict(tp=2, ep=2), "tp2-ep2"),
                                ("qwen3-30b-a3b", dict(tp=2, ep=2), "tp2-ep2")]:
        cases.append(case(f"real:{model}/{name}", 4,
                          ["--from-config", real_config[model], "--scale-dims", "64"],
                          layout))
    # 128x128 blocks: SGLang's post_load_weights dequantizes kv_b_proj to BF16 on
    # CUDA for this block size only.
    cases.append(case("deepseek_v3/fp8-block128-tp1", 4,
                      tiny("deepseek_v3", "--quant", "fp8-block", "--quant-block", "128"),
                      dict(tp=1)))
    cases.append(case("deepseek_v3/small-fp8-block128-tp1", 4,
                      ["--family", "deepseek_v3", "--preset", "small", "--quant",
                       "fp8-block"], dict(tp=1)))
    cases.append(case("deepseek_v3/small-fp8-block128-tp2", 4,
                      ["--family", "deepseek_v3", "--preset", "small", "--quant",
                       "fp8-block"], dict(tp=2)))
    # SGLang 0.5.23's MixtralAttention takes head_dim as hidden_size // heads and
    # ignores config.head_dim; --scale-dims 64 rounds Mixtral's 2 up to 8, so a
    # width where the two agree (256 / 32 = 8) checks the real tensor set too.
    mixtral = os.path.join(ROOT, "..", "shared", "data", "models", "mixtral-8x7b-v0.1",
                           "config.json")
    cases.append(case("real:mixtral-8x7b-v0.1@256/tp2", 4,
                      ["--from-config", mixtral, "--scale-dims", "256"], dict(tp=2)))
    # SGLang's rules off the defaults: V3.2's fused indexer (interleaved rope)
    # and forced shared-expert fusion with 8 routed experts.
    cases.append(case("deepseek_v32/tp2-rope_interleave", 3, tiny("deepseek_v32"),
                      dict(tp=2), config={"indexer_rope_interleave": True}))
    cases.append(case("deepseek_v3/tp2-enforce_fusion", 3, tiny("deepseek_v3"),
                      dict(tp=2), server_args=["enforce_shared_experts_fusion=true"],
                      ferry_set=["model.fuse_shared_experts=true"]))
    for model in REAL:
        config = os.path.join(ROOT, "..", "shared", "data", "models", model, "config.json")
        # transformers' config check wants heads to divide hidden_size: 24 heads
        # need 192 (head_dim 8, the real 128 scaled by 192 / 3072).
        scale = "192" if model == "llama-3.2-3b-instruct" else "64"
        cases.append(case(f"real:{model}/tp2", 4,
                          ["--from-config", config, "--scale-dims", scale], dict(tp=2)))
    for quant in QUANTS:
        # Block 16: the tiny presets' per-rank widths (16 rows of k at tp 2) are
        # below 128, which SGLang's validate_block_quant_shapes refuses, as ferry.
        block = ["--quant-block", "16"] if quant == "fp8-block" else []
        for fam in ["llama", "qwen3_moe", "deepseek_v3"]:
            cases.append(case(f"{fam}/{quant}-tp2", 4,
                              tiny(fam, "--quant", quant, *block), dict(tp=2)))
    # DeepSeek's tiny experts at tp 2 (w13 32 rows) are narrower than a Marlin tile;
    # at tp 1 (64) they are not.
    cases.append(case("deepseek_v3/nvfp4-tp1", 4, tiny("deepseek_v3", "--quant", "nvfp4"),
                      dict(tp=1)))
    # NVFP4 experts on sm100 under flashinfer_trtllm at sizes it does not pad:
    # Qwen3-MoE's at tp 1 (intermediate 64), DeepSeek-V3's small at tp 2
    # (intermediate 64 a rank, hidden 256; qk_rope_head_dim 32 so that
    # fused_qkv_a_proj_with_mqa's 224 rows are ones pad_nvfp4_weight leaves).
    cases.append(case("qwen3_moe/nvfp4-tp1", 4, tiny("qwen3_moe", "--quant", "nvfp4"),
                      dict(tp=1)))
    cases.append(case("deepseek_v3/small-nvfp4-tp2", 4,
                      ["--family", "deepseek_v3", "--preset", "small", "--quant", "nvfp4"],
                      dict(tp=2), sizes={"qk_rope_head_dim": 32}))
    # NVFP4 experts under expert parallelism: SGLang's input scales hold every
    # global expert on each rank (_sglang_require_global_experts), and sm100's
    # flashinfer_trtllm takes their max over all of them; DeepSeek's with its
    # shared expert.
    cases.append(case("qwen3_moe/nvfp4-tp2-ep2", 4, tiny("qwen3_moe", "--quant", "nvfp4"),
                      dict(tp=2, ep=2)))
    cases.append(case("deepseek_v3/small-nvfp4-tp2-ep2", 4,
                      ["--family", "deepseek_v3", "--preset", "small", "--quant", "nvfp4"],
                      dict(tp=2, ep=2), sizes={"qk_rope_head_dim": 32}))
    # Qwen2's qkv_proj bias: Marlin permutes it on sm90 (marlin_permute_bias).
    cases.append(case("qwen2/nvfp4-tp2", 4, tiny("qwen2", "--quant", "nvfp4"), dict(tp=2)))
    # quant_method fp8 with per-tensor scales and static activations: the same
    # tensors as compressed-tensors' per-tensor ones, another method in SGLang
    # (Fp8LinearMethod / Fp8MoEMethod).
    for fam in ["llama", "qwen3_moe"]:
        cases.append(case(f"{fam}/fp8-static-tensor-tp2", 4,
                          tiny(fam, "--quant", "fp8-tensor"), dict(tp=2),
                          config={"quantization_config": {"quant_method": "fp8",
                                                          "activation_scheme": "static"}}))
    return cases


# The cases a --target run compares (SGLang's process_weights_after_loading):
# the quantized ones, and the MoE families whose unquantized experts a target
# re-lays out (flashinfer_trtllm on sm100).
TARGET_CASES = r"/(small-)?(fp8-|modelopt-|nvfp4)|^(qwen3_moe|deepseek_v3|glm4_moe|mixtral)/(tp2(-ep2)?|f16-ckpt-tp2)$"



def run(cmd, log, timeout):
    with open(log, "a") as handle:
        handle.write("$ " + " ".join(cmd) + "\n")
        handle.flush()
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT,
                              timeout=timeout)
    return proc.returncode


def tail(log, lines=3):
    with open(log) as handle:
        text = [l.rstrip() for l in handle
                if l.strip() and "Ignore import" not in l and not l.startswith("$ ")]
    return " / ".join(text[-lines:])[-400:]


def positive_kv_scales(path):
    """Makes every F32 scalar k_scale / v_scale of the checkpoint positive (|x|): synth's
    scales may be negative, which SGLang's BaseKVCacheMethod.process_weights_after_loading
    asserts against (k_scale <= 0 < v_scale) or replaces (both <= 0: 1.0). Real FP8
    KV-cache scales are positive; this keeps the --target comparison on the path
    real checkpoints take. (ferry's handling of invalid ones is tested in
    tests/runtime/postprocess_load_test.cpp, KvCacheScales.)"""
    import struct

    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(path, name), "r+b") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
            for tensor, info in header.items():
                if tensor == "__metadata__" or info.get("dtype") != "F32":
                    continue
                begin, end = info["data_offsets"]
                if end - begin == 4 and tensor.endswith(("k_scale", "v_scale")):
                    handle.seek(8 + length + begin)
                    (value,) = struct.unpack("<f", handle.read(4))
                    handle.seek(8 + length + begin)
                    handle.write(struct.pack("<f", abs(value)))


def checkpoint(args, synth, config, sizes=None):
    positive = bool(args.target)
    key = hashlib.sha1(json.dumps([synth, config] + ([sizes] if sizes else []) +
                                  (["positive_kv"] if positive else []))
                       .encode()).hexdigest()[:12]
    path = os.path.join(args.work, "ckpt", key)
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        log = path + ".log"
        if sizes:
            # The preset's config with `sizes` merged, written from that config.
            base = path + "-sizes"
            family = synth[synth.index("--family"):synth.index("--family") + 2]
            preset = synth[synth.index("--preset"):synth.index("--preset") + 2]
            if run([args.ferry, "synth", *family, *preset, "--out", base, "--force",
                    "--no-fsync"], log, 600) != 0:
                raise RuntimeError(f"ferry synth failed: {tail(log)}")
            with open(os.path.join(base, "config.json")) as handle:
                sized = {**json.load(handle), **sizes}
            with open(base + ".json", "w") as handle:
                json.dump(sized, handle, indent=2)
            shutil.rmtree(base)
            rest = [a for i, a in enumerate(synth)
                    if i not in (synth.index("--family"), synth.index("--family") + 1,
                                 synth.index("--preset"), synth.index("--preset") + 1)]
            synth = ["--from-config", base + ".json", *rest]
        rc = run([args.ferry, "synth", *synth, "--out", path, "--force", "--no-fsync"],
                 log, 600)
        if rc != 0:
            raise RuntimeError(f"ferry synth failed: {tail(log)}")
        if config:
            config_path = os.path.join(path, "config.json")
            with open(config_path) as handle:
                merged = {**json.load(handle), **config}
            with open(config_path, "w") as handle:
                json.dump(merged, handle, indent=2)
        if positive:
            positive_kv_scales(path)
    return path


FERRY_DTYPE = {"auto": None, "f32": "f32", "f16": "f16", "bf16": "bf16"}
SGLANG_DTYPE = {"auto": "auto", "f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def ferry_load(args, c, ckpt, pp_rank, out):
    lay = c["layout"]
    cmd = [args.ferry, "load", "--model", ckpt, "--tp", str(lay["tp"]),
           "--ep", str(lay["ep"]), "--pp", str(lay["pp"]), "--pp-rank", str(pp_rank),
           "--dump-dir", out, "--quiet"]
    if lay["draft"]:
        cmd.append("--draft")
    if lay["attn_dp"] > 1:
        cmd += ["--set", f"parallel.attn_dp={lay['attn_dp']}"]
    if lay["dp_lm_head"]:
        cmd += ["--set", "parallel.dp_lm_head=true"]
    if FERRY_DTYPE[c["dtype"]]:
        cmd += ["--set", f"model.dtype={FERRY_DTYPE[c['dtype']]}"]
    for item in c["ferry_set"] + args.ferry_set:
        cmd += ["--set", item]
    log = out + ".log"
    if run(cmd, log, 600) != 0:
        with open(log) as handle:
            lines = [l.strip() for l in handle if "error:" in l]
        return f"ferry load refused: {(lines[-1][:400] if lines else tail(log, 2))}"
    return None


def sglang_rank(args, c, ckpt, pp_rank, tp_rank, out):
    lay = c["layout"]
    cmd = [sys.executable, "-W", "ignore", os.path.join(HERE, "sglang_worker.py"),
           "--model", ckpt, "--out", out, "--tp", str(lay["tp"]), "--ep", str(lay["ep"]),
           "--pp", str(lay["pp"]), "--pp-rank", str(pp_rank), "--rank", str(tp_rank),
           "--attn-dp", str(lay["attn_dp"]), "--dtype", SGLANG_DTYPE[c["dtype"]]]
    if lay["dp_lm_head"]:
        cmd.append("--dp-lm-head")
    if lay["draft"]:
        cmd.append("--draft")
    for item in c["server_args"]:
        cmd += ["--server-arg", item]
    if args.target:
        cmd += ["--target", args.target]
    log = out + ".log"
    if run(cmd, log, args.timeout) != 0:
        return f"SGLang refused: {error_line(log)}"
    return None


def error_line(log):
    """The exception a Python traceback in `log` ended with, else its last line."""
    with open(log) as handle:
        lines = [l.strip() for l in handle if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", l)]
    return lines[-1][:400] if lines else tail(log, 1)


def run_case(args, c):
    """Runs one case; returns its result dict."""
    start = time.time()
    result = dict(id=c["id"], tier=c["tier"], ranks=[], status="PASS", summary="PASS")
    case_dir = os.path.join(args.work, "cases", re.sub(r"[^A-Za-z0-9_.-]+", "_", c["id"]))
    shutil.rmtree(case_dir, ignore_errors=True)
    os.makedirs(case_dir)
    try:
        ckpt = checkpoint(args, c["synth"], c["config"], c["sizes"])
    except Exception as error:
        result.update(status="ERROR", summary=str(error))
        return result
    lay = c["layout"]
    stage = args.stage
    ranks = [(p, r) for p in range(lay["pp"]) for r in range(lay["tp"])]
    ferry_errors = {}
    sglang_errors = {}
    for p in range(lay["pp"]):
        ferry_errors[p] = ferry_load(args, c, ckpt, p, os.path.join(case_dir, f"ferry-pp{p}"))
    all_diffs = []
    for p, r in ranks:
        out = os.path.join(case_dir, f"sglang-pp{p}-tp{r}")
        sglang_errors[(p, r)] = sglang_rank(args, c, ckpt, p, r, out)
        rank = dict(pp=p, tp=r)
        meta_path = os.path.join(out, "meta.json")
        if ferry_errors[p] and not sglang_errors[(p, r)] and os.path.exists(meta_path):
            # SGLang ran, but the stage compared may have failed: both refuse then.
            with open(meta_path) as handle:
                failed = json.load(handle)["stages"].get(stage, {}).get("error")
            if failed:
                sglang_errors[(p, r)] = f"SGLang {stage} stage failed: {failed}"
        if ferry_errors[p] or sglang_errors[(p, r)]:
            rank["error"] = ferry_errors[p] or sglang_errors[(p, r)]
            result["ranks"].append(rank)
            continue
        with open(os.path.join(out, "meta.json")) as handle:
            meta = json.load(handle)
        result["sglang_version"] = meta["sglang_version"]
        result["quantization"] = meta.get("quantization")
        st = meta["stages"].get(stage, {})
        if "error" in st:
            rank["error"] = f"SGLang {stage} stage failed: {st['error']}"
            result["ranks"].append(rank)
            continue
        ours = compare.read_safetensors(
            os.path.join(case_dir, f"ferry-pp{p}", f"rank-{r}.safetensors"))
        theirs = compare.read_safetensors(os.path.join(out, f"{stage}.safetensors"))
        notes = []
        # A tied name (lm_head.weight = model.embed_tokens.weight) is the same
        # storage in SGLang: compared when ferry holds it too, a note if not.
        for alias, canonical in st.get("aliases", {}).items():
            if alias in ours:
                theirs[alias] = theirs[canonical]
            else:
                notes.append({"kind": "tied", "name": alias, "sglang": canonical})
        kept = meta.get("kept_init") or {}
        if isinstance(kept, list):  # a dump from before kept values were recorded
            kept = {}
        diffs = compare.compare_ranks(ours, theirs, meta["fill_byte"], IGNORE, notes, kept)
        rank["notes"] = notes
        for d in diffs:
            d["rank"] = f"pp{p}/tp{r}"
        rank["differences"] = diffs
        all_diffs.extend(diffs)
        result["ranks"].append(rank)
        if not args.keep:
            for name in ("loader.safetensors", "processed.safetensors"):
                path = os.path.join(out, name)
                if os.path.exists(path):
                    os.remove(path)
    errors = [r["error"] for r in result["ranks"] if "error" in r]
    if errors:
        ferry_refuses = any(ferry_errors.values())
        sglang_refuses = any(sglang_errors.values())
        if ferry_refuses and sglang_refuses:
            result["status"] = "BOTH REFUSE"
            result["summary"] = (f"{next(e for e in ferry_errors.values() if e)}; "
                                 f"{next(e for e in sglang_errors.values() if e)}")
        else:
            result["status"] = ("FERRY REFUSES" if ferry_refuses else
                                "SGLANG REFUSES" if sglang_refuses else "ERROR")
            result["summary"] = errors[0]
    elif all_diffs:
        result["status"] = "DIFF"
        result["summary"] = compare.summarize(all_diffs)
    if not args.keep:
        for p in range(lay["pp"]):
            shutil.rmtree(os.path.join(case_dir, f"ferry-pp{p}"), ignore_errors=True)
    result["seconds"] = round(time.time() - start, 1)
    with open(os.path.join(case_dir, "result.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    return result


def table(results, version, stage, target=None):
    date = datetime.date.today().isoformat()
    passed = sum(r["status"] == "PASS" for r in results)
    what = (f"stage `{stage}`: ferry's `load --dump-dir` per rank against SGLang's "
            f"own loader on the CPU")
    if target:
        what = (f"`--target {target}`: ferry's `load --dump-dir` with "
                f"`postprocess.target={target}` per rank against SGLang's loader and "
                f"process_weights_after_loading on the CPU, its CUDA branches emulated "
                f"(tests/parity/README.md)")
    lines = [
        f"Generated by `scripts/sglang-parity.sh` on {date} against SGLang {version} "
        f"(PyPI), {what}. {passed} of {len(results)} cases PASS.",
        "",
        "| case | date | result |",
        "|---|---|---|",
    ]
    for r in results:
        text = r["summary"] if r["status"] != "PASS" else "PASS"
        if r["status"] not in ("PASS", "DIFF"):
            text = f"{r['status']}: {text}"
        text = text.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['id']} | {r.get('date', date)} | {text} |")
    return "\n".join(lines) + "\n"


BEGIN = "<!-- parity:begin -->"
END = "<!-- parity:end -->"


def update_docs(text, target=None):
    path = os.path.join(ROOT, "docs", "ARCHITECTURE.md")
    begin, end = BEGIN, END
    if target:
        begin = BEGIN.replace("parity:", f"parity-{target}:")
        end = END.replace("parity:", f"parity-{target}:")
    with open(path) as handle:
        doc = handle.read()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path} lacks the {begin} / {end} markers")
    head, rest = doc.split(begin, 1)
    _, tail_ = rest.split(end, 1)
    with open(path, "w") as handle:
        handle.write(head + begin + "\n" + text + end + tail_)


def main():
    parser = argparse.ArgumentParser(description="ferry vs SGLang 0.5.23 parity matrix")
    parser.add_argument("--ferry", default=os.path.join(ROOT, "build", "release", "ferry"))
    parser.add_argument("--work", default=os.path.join(ROOT, "build", "parity"))
    parser.add_argument("--only", action="append", default=[],
                        help="regular expression a case id must contain (repeatable: any)")
    parser.add_argument("--tier", type=int, default=4, help="run tiers up to this one")
    parser.add_argument("--from-tier", type=int, default=1, help="and from this one")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per SGLang rank")
    parser.add_argument("--stage", choices=["loader", "processed"], default="loader",
                        help="SGLang's state to compare: after load_weights (ferry's "
                             "postprocess.target=loader) or after "
                             "process_weights_after_loading")
    parser.add_argument("--target", choices=["sm90", "sm100"],
                        help="compare the quantized cases after SGLang's "
                             "process_weights_after_loading as on that GPU (emulated) "
                             "with ferry's postprocess.target; own results and table")
    parser.add_argument("--ferry-set", action="append", default=[],
                        help="KEY=VALUE passed to every ferry load as --set")
    parser.add_argument("--keep", action="store_true", help="keep the dumps")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--update-docs", action="store_true",
                        help="rewrite the table in docs/ARCHITECTURE.md")
    args = parser.parse_args()
    args.work = os.path.abspath(args.work)
    cases = [c for c in matrix() if args.from_tier <= c["tier"] <= args.tier]
    if args.target:
        args.stage = "processed"
        args.ferry_set.append(f"postprocess.target={args.target}")
        cases = [c for c in cases if re.search(TARGET_CASES, c["id"])]
    if args.only:
        cases = [c for c in cases if any(re.search(o, c["id"]) for o in args.only)]
    if args.list:
        for c in cases:
            print(f"tier {c['tier']}  {c['id']}")
        return 0
    if not os.access(args.ferry, os.X_OK):
        raise SystemExit(f"no ferry binary at {args.ferry} (cmake --build build/release "
                         "--target ferry)")
    os.makedirs(args.work, exist_ok=True)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_case, args, c): c for c in cases}
        for future in concurrent.futures.as_completed(futures):
            c = futures[future]
            try:
                r = future.result()
            except Exception as error:  # a harness bug: report it with the case
                r = dict(id=c["id"], tier=c["tier"], status="ERROR",
                         summary=f"harness: {type(error).__name__}: {error}")
            results[c["id"]] = r
            print(f"{r['status']:11} {r['id']}: {r['summary'][:300]}", flush=True)
    ordered = [results[c["id"]] for c in cases]
    # results.json accumulates: a run of some cases replaces theirs and keeps the
    # others', so the table covers every case run so far, each with its date.
    suffix = f"-{args.target}" if args.target else ""
    merged_path = os.path.join(args.work, f"results{suffix}.json")
    merged = {}
    if os.path.exists(merged_path):
        with open(merged_path) as handle:
            merged = {r["id"]: r for r in json.load(handle)}
    today = datetime.date.today().isoformat()
    for r in ordered:
        r["date"] = today
        merged[r["id"]] = r
    order = {c["id"]: i for i, c in enumerate(matrix())}
    everything = sorted(merged.values(), key=lambda r: order.get(r["id"], len(order)))
    version = next((r.get("sglang_version") for r in everything
                    if r.get("sglang_version")), "0.5.23")
    with open(merged_path, "w") as handle:
        json.dump(everything, handle, indent=1)
    text = table(everything, version, args.stage, args.target)
    with open(os.path.join(args.work, f"results{suffix}.md"), "w") as handle:
        handle.write(text)
    if args.update_docs:
        update_docs(text, args.target)
    passed = sum(r["status"] == "PASS" for r in ordered)
    print(f"{passed}/{len(ordered)} PASS in this run; table of all runs in "
          f"{args.work}/results{suffix}.md")
    return 0 if passed == len(ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
