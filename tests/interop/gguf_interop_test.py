#!/usr/bin/env python3
"""Interoperability with llama.cpp's gguf-py (the `gguf` package).

usage: gguf_interop_test.py GGUF_DUMP [FERRY]   (gguf_dump.cpp and ferry, built by CMake)

1. Files gguf-py's GGUFWriter writes (every metadata value type, nested and long
   arrays, tensors of F32, F16, BF16 and every type gguf-py can quantize, random
   valid blocks of the K-quants, a type ferry cannot dequantize, the default and a
   custom alignment) parse in ferry exactly as GGUFReader reads them: version,
   alignment, data offset, every key's type and value (arrays: element type and
   count), every tensor's name, dims, type, offset and byte count; and ferry's
   float32 dequantization equals gguf-py's quants.dequantize bit for bit.
2. ferry's Q8_0 quantizer gives quants.quantize's bytes (blocks of every magnitude,
   zero blocks, blocks so small that 1/d overflows, ties at .5).
3. A file ferry's GgufWriter writes reads back in GGUFReader with the same keys,
   values, shapes, types and bytes.
4. ferry's llama_qk_permute_rows is LlamaModel.permute's reshape/swapaxes on row ids.
5. (with FERRY) `ferry synth --format gguf` files, one per family it writes and each
   --gguf-type among them, read in GGUFReader: the architecture, file type and the
   sizes' keys, and every tensor's name, type, shape and bytes as this script makes
   them from the safetensors twin the way convert_hf_to_gguf.py does (gguf-py's
   TensorNameMap for the names, LlamaModel.permute, torch.stack's order of the
   experts, DeepseekV2Model's kv_b_proj split, the MTP layer dropped, prepare_tensors'
   type rules and gguf.quants.quantize for the bytes).

Exits 77 (CTest's skip) when gguf or numpy cannot be imported. With FERRY_GGUF_PYTHON
set (a Python that has them, e.g. /work/venv-parity/bin/python), it runs itself again
with that interpreter first.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

if os.environ.get("FERRY_GGUF_PYTHON") and not os.environ.get("FERRY_GGUF_REEXEC"):
    os.environ["FERRY_GGUF_REEXEC"] = "1"
    python = os.environ["FERRY_GGUF_PYTHON"]
    os.execv(python, [python, *sys.argv])

try:
    import numpy as np
    import gguf
    from gguf import quants
    from gguf.constants import GGMLQuantizationType as Q, GGUFValueType as V
except ImportError as e:  # pragma: no cover
    print(f"SKIP: gguf-py or numpy is missing ({e}); set FERRY_GGUF_PYTHON to a Python with them")
    sys.exit(77)

DUMP = sys.argv[1]
FERRY = sys.argv[2] if len(sys.argv) > 2 else None
FAILURES = []
VALUE_NAMES = {V.UINT8: "u8", V.INT8: "i8", V.UINT16: "u16", V.INT16: "i16", V.UINT32: "u32",
               V.INT32: "i32", V.FLOAT32: "f32", V.BOOL: "bool", V.STRING: "string",
               V.ARRAY: "array", V.UINT64: "u64", V.INT64: "i64", V.FLOAT64: "f64"}
# Where the fp16 scales of a K-quant block are: random bytes elsewhere are valid.
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
            Q.IQ4_NL: (0,)}
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)


def fail(message):
    FAILURES.append(message)
    print("FAIL:", message)


def run(*args):
    p = subprocess.run([DUMP, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"gguf_dump {' '.join(args)} exited {p.returncode}: {p.stderr}")
    return p.stdout


def random_blocks(rng, qtype, rows, cols):
    """Random bytes for a K-quant (or IQ4_NL) tensor, with finite fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in K_SCALES[qtype]:
        scales = rng.uniform(-2.0, 2.0, size=n).astype(np.float16)
        raw[:, at:at + 2] = scales.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // block * size)


def write_gguf_py_file(path, rng, alignment):
    w = gguf.GGUFWriter(path, "llama")
    if alignment != 32:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 0xfedcba9876543210)
    w.add_int64("t.i64", -(1 << 62))
    w.add_float64("t.f64", 500000.25)
    w.add_bool("t.bool", True)
    w.add_string("t.string", "h\u00e9llo")
    w.add_array("t.ints", [24, 20, -1])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(5000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(5000)])
    expected = {}

    def add(name, array, raw_dtype=None):
        w.add_tensor(name, array, raw_dtype=raw_dtype)

    x = rng.standard_normal((6, 64)).astype(np.float32)
    add("f32", x)
    add("f16", rng.standard_normal((3, 5, 64)).astype(np.float16))
    add("bf16", quants.quantize(rng.standard_normal((4, 96)).astype(np.float32), Q.BF16),
        raw_dtype=Q.BF16)
    add("vector", rng.standard_normal(7).astype(np.float32))
    for qtype in QUANTIZABLE:
        data = rng.standard_normal((5, 128)).astype(np.float32) * 3
        data[0, :32] = 0.0  # a zero block
        add(qtype.name.lower(), quants.quantize(data, qtype), raw_dtype=qtype)
    for qtype in K_SCALES:
        cols = 512 if qtype != Q.IQ4_NL else 64
        add(qtype.name.lower(), random_blocks(rng, qtype, 3, cols), raw_dtype=qtype)
    add("experts", quants.quantize(rng.standard_normal((4, 8, 64)).astype(np.float32), Q.Q8_0),
        raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def compare_value(key, field, mine):
    main = field.types[0]
    if mine["type"] != VALUE_NAMES[main]:
        fail(f"{key}: type {mine['type']}, gguf-py {VALUE_NAMES[main]}")
        return
    if main == V.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else None
        count, values = mine["count"], mine.get("elements")
        if sub == V.ARRAY:
            # GGUFReader flattens arrays of arrays (its own FIXME): compare the
            # inner elements, which ferry keeps per array.
            count = sum(e["count"] for e in values)
            values = [x for e in values for x in e["elements"]]
        if count != len(field.data):
            fail(f"{key}: {count} elements, gguf-py {len(field.data)}")
        if sub is not None and mine["element_type"] != VALUE_NAMES[field.types[1]]:
            fail(f"{key}: elements {mine['element_type']}, gguf-py {VALUE_NAMES[sub]}")
        if mine["kept"]:
            theirs = field.contents()
            ours = [bytes(e["bytes"]).decode() if e["type"] == "string" else e["value"]
                    for e in values]
            if field.types[-1] == V.FLOAT32:
                theirs = [float(np.float32(t)) for t in theirs]
            if ours != theirs:
                fail(f"{key}: {ours}, gguf-py {theirs}")
        return
    theirs = field.contents()
    if main == V.STRING:
        ours = bytes(mine["bytes"]).decode()
    elif main == V.BOOL:
        ours = bool(mine["value"])
    elif main == V.FLOAT32:
        ours, theirs = np.float32(mine["value"]), np.float32(theirs)
    else:
        ours = mine["value"]
    if ours != theirs:
        fail(f"{key}: {ours!r}, gguf-py {theirs!r}")


def check_gguf_py_file(path):
    reader = gguf.GGUFReader(path)
    with tempfile.TemporaryDirectory() as d:
        out_json, out_bin = os.path.join(d, "h.json"), os.path.join(d, "v.bin")
        run("header", path, out_json, out_bin)
        with open(out_json) as f:
            mine = json.load(f)
        values = np.fromfile(out_bin, dtype=np.float32)
    name = os.path.basename(path)
    if mine["alignment"] != reader.alignment or mine["data_offset"] != reader.data_offset:
        fail(f"{name}: alignment {mine['alignment']} data {mine['data_offset']}, gguf-py "
             f"{reader.alignment} {reader.data_offset}")
    theirs_keys = {k for k in reader.fields if not k.startswith("GGUF.")}
    if set(mine["metadata"]) != theirs_keys:
        fail(f"{name}: keys differ: {sorted(set(mine['metadata']) ^ theirs_keys)}")
    for key in theirs_keys & set(mine["metadata"]):
        compare_value(key, reader.fields[key], mine["metadata"][key])
    by_name = {t["name"]: t for t in mine["tensors"]}
    if set(by_name) != {t.name for t in reader.tensors}:
        fail(f"{name}: tensor names differ")
    exact = 0
    for t in reader.tensors:
        m = by_name.get(t.name)
        if m is None:
            continue
        facts = (m["dims"], m["type"], m["offset"], m["nbytes"])
        expected = ([int(x) for x in t.shape], t.tensor_type.name, t.data_offset, t.n_bytes)
        if facts != expected:
            fail(f"{name}: tensor {t.name}: {facts}, gguf-py {expected}")
            continue
        if "values_at" not in m:
            if t.tensor_type not in (Q.IQ4_NL,):
                fail(f"{name}: tensor {t.name}: ferry did not dequantize {t.tensor_type.name}")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        ours = values[m["values_at"]:m["values_at"] + reference.size]
        if not np.array_equal(ours.view(np.uint32), reference.view(np.uint32)):
            diff = np.abs(ours.astype(np.float64) - reference)
            fail(f"{name}: tensor {t.name} ({t.tensor_type.name}): dequantized values differ "
                 f"in {int((ours.view(np.uint32) != reference.view(np.uint32)).sum())} of "
                 f"{reference.size}, max |diff| {diff.max()}")
        else:
            exact += 1
    print(f"{name}: {len(reader.tensors)} tensors, {len(theirs_keys)} keys; "
          f"{exact} dequantized bit for bit")


def check_q8_0(rng):
    blocks = []
    for exponent in range(-40, 31, 5):
        blocks.append(rng.standard_normal((8, 32)) * 10.0 ** exponent)
    blocks.append(np.zeros((2, 32)))
    ties = rng.integers(-254, 255, size=(8, 32)) / 2.0  # halves, with max |x| 127 below
    ties[:, 0] = 127.0
    blocks.append(ties)
    blocks.append(np.full((1, 32), 1e-38))
    x = np.concatenate(blocks).astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "x.f32"), os.path.join(d, "x.q8")
        x.tofile(src)
        run("quantize", src, dst)
        ours = np.fromfile(dst, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = quants.quantize(x, Q.Q8_0).reshape(-1)
    if not np.array_equal(ours, theirs):
        bad = np.nonzero(ours != theirs)[0]
        fail(f"Q8_0: {bad.size} of {theirs.size} bytes differ from gguf-py, first at "
             f"block {bad[0] // 34}")
    else:
        print(f"Q8_0: {x.shape[0]} blocks quantized byte for byte as gguf-py")


def check_ferry_writer(rng):
    with tempfile.TemporaryDirectory() as d:
        tensors = []
        arrays = {
            "a.f32": (rng.standard_normal((3, 16)).astype(np.float32), "F32", Q.F32),
            "b.f16": (rng.standard_normal((2, 2, 8)).astype(np.float16), "F16", Q.F16),
            "c.bf16": (quants.quantize(rng.standard_normal((4, 32)).astype(np.float32), Q.BF16),
                       "BF16", Q.BF16),
            "d.q8_0": (quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), Q.Q8_0),
                       "Q8_0", Q.Q8_0),
        }
        shapes = {"a.f32": [16, 3], "b.f16": [8, 2, 2], "c.bf16": [32, 4], "d.q8_0": [64, 2]}
        for name, (array, type_name, _) in arrays.items():
            path = os.path.join(d, name + ".raw")
            array.tofile(path)
            tensors.append({"name": name, "type": type_name, "dims": shapes[name], "data": path})
        metadata = [["general.architecture", "string", "llama"], ["t.u8", "u8", 7],
                    ["t.i16", "i16", -5], ["t.u32", "u32", 4096], ["t.i64", "i64", -(1 << 40)],
                    ["t.f32", "f32", 0.125], ["t.f64", "f64", 1e-300], ["t.bool", "bool", False],
                    ["t.ints", "array:i32", [1, -2, 3]], ["t.words", "array:string", ["x", "yz"]]]
        spec = {"alignment": 64, "metadata": metadata, "tensors": tensors}
        spec_path, out = os.path.join(d, "spec.json"), os.path.join(d, "ferry.gguf")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        run("write", spec_path, out)
        reader = gguf.GGUFReader(out)
        if reader.alignment != 64 or reader.data_offset % 64 != 0:
            fail(f"ferry's file: alignment {reader.alignment}, data at {reader.data_offset}")
        expect = {"general.architecture": "llama", "t.u8": 7, "t.i16": -5, "t.u32": 4096,
                  "t.i64": -(1 << 40), "t.f32": 0.125, "t.f64": 1e-300, "t.bool": False,
                  "t.ints": [1, -2, 3], "t.words": ["x", "yz"], "general.alignment": 64}
        for key, value in expect.items():
            field = reader.get_field(key)
            if field is None or field.contents() != value:
                fail(f"ferry's file: {key} reads {None if field is None else field.contents()!r}")
        for t in reader.tensors:
            array, _, qtype = arrays[t.name]
            if t.tensor_type != qtype or [int(x) for x in t.shape] != shapes[t.name]:
                fail(f"ferry's file: tensor {t.name}: {t.tensor_type.name} {list(t.shape)}")
            if t.data.tobytes() != array.tobytes():
                fail(f"ferry's file: tensor {t.name}: bytes differ")
            if t.data_offset % 64 != 0:
                fail(f"ferry's file: tensor {t.name} at {t.data_offset}")
        print(f"ferry's writer: gguf-py reads {len(reader.tensors)} tensors and "
              f"{len(expect)} keys back")


def check_permute():
    for rows, heads in ((4096, 32), (1024, 8), (8, 1)):
        ids = np.arange(rows)
        # LlamaModel.permute(w, n_head, n_head_kv): the row reorder, on row ids.
        theirs = ids.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)
        ours = json.loads(run("permute", str(rows), str(heads)))
        if ours != theirs.tolist():
            fail(f"permute {rows} rows, {heads} heads: differs from numpy")
    print("LlamaModel.permute: ferry's rows equal numpy's reshape/swapaxes")


# ---- 5. ferry synth --format gguf against the converter's steps ---------------------

SYNTH_CASES = [("llama", "q8_0"), ("mistral", "bf16"), ("mixtral", "f16"), ("qwen2", "f32"),
               ("qwen3", "q8_0"), ("qwen3_moe", "bf16"), ("deepseek_v2", "q8_0"),
               ("deepseek_v3", "f16")]
SYNTH_ARCH = {"llama": "LLAMA", "mistral": "LLAMA", "mixtral": "LLAMA", "qwen2": "QWEN2",
              "qwen3": "QWEN3", "qwen3_moe": "QWEN3MOE", "deepseek_v2": "DEEPSEEK2",
              "deepseek_v3": "DEEPSEEK2"}
OUTTYPES = {"f32": (Q.F32, 0), "f16": (Q.F16, 1), "bf16": (Q.BF16, 32), "q8_0": (Q.Q8_0, 7)}


def synth(*args):
    p = subprocess.run([FERRY, "synth", *args, "--no-fsync"], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ferry synth {' '.join(args)} exited {p.returncode}: {p.stderr}")


def read_safetensors_folder(folder):
    """Every tensor of the folder's *.safetensors as float32 (what the converter reads:
    data_torch.to(torch.float32))."""
    out = {}
    for file in sorted(os.listdir(folder)):
        if not file.endswith(".safetensors"):
            continue
        raw = open(os.path.join(folder, file), "rb").read()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            b = raw[8 + n + begin:8 + n + end]
            if info["dtype"] == "BF16":
                a = (np.frombuffer(b, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            elif info["dtype"] == "F16":
                a = np.frombuffer(b, dtype="<f2").astype(np.float32)
            else:
                a = np.frombuffer(b, dtype="<f4").copy()
            out[name] = a.reshape(info["shape"])
    return out


def llama_permute(w, n_head, n_head_kv):
    # LlamaModel.permute, on numpy.
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def converter_tensors(family, twin, config):
    """name -> float32 array, as convert_hf_to_gguf.py's modify_tensors yield them."""
    arch = getattr(gguf.MODEL_ARCH, SYNTH_ARCH[family])
    n_blocks = config["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(arch, n_blocks)
    n_experts = (config.get("num_local_experts") or config.get("num_experts")
                 or config.get("n_routed_experts"))
    out, pending = {}, {}

    def emit(name, data):
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise RuntimeError(f"{family}: gguf-py cannot map {name}")
        out[new] = data

    for name, data in twin.items():
        if name.endswith("e_score_correction_bias"):  # ModelBase.filter_tensors
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        m = re.match(r"model\.layers\.(\d+)\.", name)
        bid = int(m.group(1)) if m else None
        if arch == gguf.MODEL_ARCH.DEEPSEEK2 and bid is not None and bid >= n_blocks:
            continue  # skip_mtp
        if arch == gguf.MODEL_ARCH.LLAMA:
            heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                data = llama_permute(data, heads, heads)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                data = llama_permute(data, heads, kv)
        if ".experts." in name:
            pending.setdefault(bid, {})[name] = data
            if len(pending[bid]) < 3 * n_experts:
                continue
            experts = pending.pop(bid)
            if family == "mixtral":
                for wid in ("w1", "w2", "w3"):
                    stack = np.stack([experts[f"model.layers.{bid}.block_sparse_moe.experts."
                                              f"{x}.{wid}.weight"] for x in range(n_experts)])
                    emit(f"layers.{bid}.feed_forward.experts.{wid}.weight", stack)
            else:
                for w in ("down_proj", "gate_proj", "up_proj"):
                    stack = np.stack([experts[f"model.layers.{bid}.mlp.experts.{x}.{w}.weight"]
                                      for x in range(n_experts)])
                    emit(f"model.layers.{bid}.mlp.experts.{w}.weight", stack)
            continue
        if arch == gguf.MODEL_ARCH.DEEPSEEK2 and name.endswith("kv_b_proj.weight"):
            n, v, nope = (config["num_key_value_heads"], config["v_head_dim"],
                          config["qk_nope_head_dim"])
            kv_b = data.reshape(n, v + nope, data.shape[-1])
            k_b, v_b = kv_b[:, :nope, :], kv_b[:, nope:, :]
            emit(name.replace("kv_b_proj", "k_b_proj"), np.ascontiguousarray(k_b.transpose(0, 2, 1)))
            emit(name.replace("kv_b_proj", "v_b_proj"), np.ascontiguousarray(v_b))
            continue
        emit(name, data)
    if pending:
        raise RuntimeError(f"{family}: unstacked experts in layers {sorted(pending)}")
    return out


def converter_bytes(name, data, outtype):
    """prepare_tensors' type choice and gguf.quants.quantize."""
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        qtype = Q.F32
    elif name.endswith("ffn_gate_inp.weight") or not name.endswith(".weight"):
        qtype = Q.F32
    else:
        qtype = outtype
    try:
        raw = quants.quantize(data, qtype)
    except quants.QuantError:
        qtype = Q.F16  # "falling back to F16"
        raw = quants.quantize(data, qtype)
    return qtype, raw.tobytes()


def check_ferry_synth(root):
    checked = 0
    for family, outtype_name in SYNTH_CASES:
        what = f"ferry synth {family} --gguf-type {outtype_name}"
        st, gg = os.path.join(root, family + "-st"), os.path.join(root, family + "-gguf")
        synth("--family", family, "--preset", "tiny", "--seed", "9", "--out", st)
        synth("--family", family, "--preset", "tiny", "--seed", "9", "--out", gg,
              "--format", "gguf", "--gguf-type", outtype_name)
        if sorted(os.listdir(gg)) != ["model.gguf"]:
            fail(f"{what}: the folder holds {sorted(os.listdir(gg))}")
        config = json.load(open(os.path.join(st, "config.json")))
        expected = converter_tensors(family, read_safetensors_folder(st), config)
        outtype, file_type = OUTTYPES[outtype_name]
        reader = gguf.GGUFReader(os.path.join(gg, "model.gguf"))
        arch = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, SYNTH_ARCH[family])]
        keys = {"general.architecture": arch, "general.file_type": file_type,
                "general.quantization_version": 2,
                f"{arch}.block_count": config["num_hidden_layers"],
                f"{arch}.embedding_length": config["hidden_size"],
                f"{arch}.attention.head_count": config["num_attention_heads"],
                f"{arch}.attention.head_count_kv":
                    1 if arch == "deepseek2" else config["num_key_value_heads"]}
        experts = (config.get("num_local_experts") or config.get("num_experts")
                   or config.get("n_routed_experts"))
        if experts:
            keys[f"{arch}.expert_count"] = experts
        for key, value in keys.items():
            field = reader.get_field(key)
            if field is None or field.contents() != value:
                fail(f"{what}: {key} reads {None if field is None else field.contents()!r}, "
                     f"not {value!r}")
        names = {t.name for t in reader.tensors}
        if names != set(expected):
            fail(f"{what}: tensors only in the file {sorted(names - set(expected))[:4]}, "
                 f"only in the converter's {sorted(set(expected) - names)[:4]}")
        for t in reader.tensors:
            if t.name not in expected:
                continue
            data = expected[t.name]
            qtype, raw = converter_bytes(t.name, data, outtype)
            shape = [int(x) for x in t.shape]
            if t.tensor_type != qtype or shape != list(reversed(data.shape)):
                fail(f"{what}: {t.name} is {t.tensor_type.name} {shape}, the converter's "
                     f"{qtype.name} {list(reversed(data.shape))}")
            elif t.data.tobytes() != raw:
                fail(f"{what}: {t.name}: bytes differ from the converter's")
            checked += 1
    print(f"ferry synth --format gguf: {checked} tensors of {len(SYNTH_CASES)} files are the "
          f"converter's (names, types, shapes, bytes)")


def main():
    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as d:
        for alignment in (32, 64):
            path = os.path.join(d, f"gguf-py-{alignment}.gguf")
            write_gguf_py_file(path, rng, alignment)
            check_gguf_py_file(path)
    check_q8_0(rng)
    check_ferry_writer(rng)
    check_permute()
    if FERRY:
        with tempfile.TemporaryDirectory() as d:
            check_ferry_synth(d)
    else:
        print("ferry synth --format gguf: not checked (no FERRY argument)")
    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        return 1
    print(f"OK (gguf-py {getattr(gguf, '__version__', 'installed')}, numpy {np.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
