#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target (fuzz/*.cpp) under OUT/<target>/.

Seeds are valid inputs, so the fuzzer starts deep: real-looking safetensors headers
with several dtypes, indexes, layered configs. The discovery and planner targets
turn any bytes into a valid folder layout or model, so their seeds are
deterministic pseudo-random bytes. Nothing is copied from test data; the output is
the same on every run (fixed seeds), so it can be regenerated at will.

    fuzz/make_corpus.py OUT
"""
import json
import os
import random
import struct
import sys

DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4,
          "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def header_seed(rng, count, metadata, shuffle=True, escaped=False):
    """A safetensors header's JSON and its data size, as fuzz_header reads them:
    the text, then the data size as 8 little-endian bytes."""
    names = [f"model.layers.{i // 4}.mlp.w{i % 4}.weight" for i in range(count)]
    if escaped and names:
        names[0] = "emb\\u00e9d.t\u00e9\"q\""
    entries = {}
    offset = 0
    for name in names:
        dtype = rng.choice(sorted(DTYPES))
        shape = [rng.choice([0, 1, 2, 3, 4, 8]) for _ in range(rng.randrange(0, 4))]
        n = DTYPES[dtype]
        for d in shape:
            n *= d
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    items = list(entries.items())
    if shuffle:
        rng.shuffle(items)
    doc = {}
    if metadata:
        doc["__metadata__"] = {"format": "pt", "source": "fuzz"}
    doc.update(items)
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    if escaped:
        text = text.replace("\\\\u00e9", "\\u00e9")
    return text.encode(), offset


def header_seeds(rng):
    seeds = []
    for i in range(24):
        text, data = header_seed(rng, count=1 + i * 2, metadata=i % 3 == 0, shuffle=i % 2 == 0,
                                 escaped=i % 5 == 0)
        seeds.append(text + struct.pack("<Q", data))
    text, data = header_seed(rng, count=6, metadata=True)
    seeds.append(b"  " + text + b"    " + struct.pack("<Q", data))  # padded, as writers do
    seeds.append(b"{}" + struct.pack("<Q", 0))
    seeds.append(b'{"__metadata__":{}}' + struct.pack("<Q", 0))
    # Near misses: each breaks one rule, so the document path's errors are seeded too.
    seeds.append(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                 b'"b":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}}' + struct.pack("<Q", 24))
    seeds.append(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                 b'"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}' + struct.pack("<Q", 16))
    seeds.append(b'{"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}}' + struct.pack("<Q", 8))
    seeds.append(b'{"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,8]}}' +
                 struct.pack("<Q", 8))
    seeds.append(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,0]}}' +
                 struct.pack("<Q", 1))
    seeds.append(b'{"a":{"dtype":"F16","shape":[1],"data_offsets":[0,2],"extra":1.5e3}}' +
                 struct.pack("<Q", 2))
    return seeds


def index_seeds(rng):
    seeds = []
    for shards in (1, 2, 3, 5):
        wm = {}
        total = 0
        for i in range(4 + shards * 5):
            wm[f"model.layers.{i}.self_attn.q_proj.weight"] = (
                f"model-{1 + i % shards:05d}-of-{shards:05d}.safetensors")
            total += rng.randrange(1, 1 << 20)
        doc = {"metadata": {"total_size": total}, "weight_map": wm}
        seeds.append(json.dumps(doc, indent=2).encode())
        doc = {"weight_map": wm, "metadata": {"total_size": float(total), "format": "pt"}}
        seeds.append(json.dumps(doc).encode())
    seeds.append(b'{"weight_map":{"a":"sub/x.safetensors","b":"../x.safetensors"}}')
    seeds.append(b'{"metadata":{"total_size":1e19,"nested":{"k":[1,2]}},"weight_map":{"a":"x"}}')
    seeds.append(b'{"weight_map":{"t\\u00e9":"m\\u0000.safetensors"},"other":null}')
    seeds.append(b'{"weight_map":{}}')
    return seeds


def remote_control_seeds():
    """Frames of a seed's control port: the handshake both ways, and a seed's table."""
    import hashlib
    import hmac

    def frame(doc):
        body = json.dumps(doc).encode()
        return struct.pack(">I", len(body)) + body

    token = b"fuzz-token-0123456789abcdef"
    a, b = "a" * 64, "b" * 64

    def proof(label, first, second):
        return hmac.new(token, f"{label}|{first}|{second}".encode(), hashlib.sha256).hexdigest()

    table = {"type": "fetch", "status": "ok", "descriptors": 0, "worker": "00ff" * 16,
             "storages": [{"kind": "ucx", "bytes": 8192, "device": "host:0", "uuid": "",
                           "handle": "", "address": 140000000000000, "rkey": "ab" * 40}],
             "ranks": [{"tp_rank": 0, "pp_rank": 0, "device": "host:0",
                        "params": [{"name": "w", "dtype": "BF16", "shape": [4, 8],
                                    "strides": [8, 1], "storage": 0, "offset": 256,
                                    "bytes": 64},
                                   {"name": "e", "dtype": "F32", "shape": [0],
                                    "strides": [1], "storage": 0, "offset": 0, "bytes": 0}]}]}
    handshake = [{"type": "hello", "protocol": 1, "ferry": "0.1.0", "nonce": b},
                 {"type": "challenge", "nonce": b, "proof": proof("ferry-seed", a, b)},
                 {"type": "auth", "proof": proof("ferry-target", a, b)},
                 {"type": "query", "fingerprint": "f" * 64, "identity": {"keys": {}}},
                 {"type": "fetch", "fingerprint": "f" * 64, "ranks": [0]},
                 {"type": "hello", "seed": "10.0.0.1:7400", "listen": "[fd00::1]:1"}]
    return [frame(table), b"".join(frame(f) for f in handshake) + frame(table),
            frame({"type": "error", "message": "authentication failed"})]


def cache_frame_seeds():
    """Frames as the weight cache exchanges them: requests, and fetch replies."""
    def frame(doc):
        body = json.dumps(doc).encode()
        return struct.pack(">I", len(body)) + body

    reply = {"type": "fetch", "status": "ok", "descriptors": 1,
             "storages": [{"kind": "memfd", "bytes": 8192, "device": "host:0", "uuid": "",
                           "handle": ""},
                          {"kind": "cuda_ipc", "bytes": 4096, "device": "cuda:0",
                           "uuid": "GPU-1", "handle": "ab" * 64}],
             "ranks": [{"tp_rank": 0, "pp_rank": 0, "device": "host:0",
                        "params": [{"name": "w", "dtype": "BF16", "shape": [4, 8],
                                    "strides": [8, 1], "storage": 0, "offset": 256,
                                    "bytes": 64},
                                   {"name": "e", "dtype": "F32", "shape": [0],
                                    "strides": [1], "storage": 0, "offset": 0, "bytes": 0},
                                   {"name": "g", "dtype": "F8_E4M3", "shape": [16],
                                    "strides": [1], "storage": 1, "offset": 0,
                                    "bytes": 16}]}]}
    requests = [{"type": "hello", "protocol": 1, "ferry": "0.1.0"},
                {"type": "query", "fingerprint": "f" * 64, "identity": {"model": "/m"}},
                {"type": "fetch", "fingerprint": "f" * 64, "ranks": [0, 1]},
                {"type": "ping"}]
    seeds = [frame(reply), b"".join(frame(r) for r in requests) + frame(reply)]
    seeds.append(frame({"type": "error", "message": "busy"}))
    return seeds


def presharded_seeds(rng):
    seeds = []
    for ranks in (1, 2, 4):
        doc = {"format": "ferry-presharded", "version": 1, "pp_rank": 0,
               "signature": {"tp": str(ranks), "dtype": "auto"},
               "structure": "%032x" % rng.getrandbits(128), "ranks": []}
        for r in range(ranks):
            params = [{"name": "model.norm.weight", "tensor": "model.norm.weight",
                       "dtype": "BF16", "shape": [64], "nbytes": 128,
                       "file": "common-00000.safetensors", "offset": 4096,
                       "xxh3": "%032x" % 7}]
            params.append({"name": "model.layers.0.mlp.down_proj.weight",
                           "tensor": f"model.layers.0.mlp.down_proj.weight@{r}",
                           "dtype": "F8_E4M3", "shape": [64, 32], "nbytes": 2048,
                           "file": f"rank-{r}-00000.safetensors", "offset": 8192,
                           "xxh3": "%032x" % rng.getrandbits(128)})
            doc["ranks"].append({"tp_rank": r, "params": params})
        seeds.append(json.dumps(doc, indent=1).encode())
    for world in (1, 2):  # SGLang 0.5.23's checksum.json (PreshardedModelLoader)
        reads = {}
        for r in range(world):
            reads[str(r)] = [
                {"filename": "model-00000-common.safetensor", "stored_key": "%032x" % 5,
                 "name": "model.norm.weight", "is_extra": False},
                {"filename": f"model-{r + 1:05d}-rank-{r:03d}.safetensor",
                 "stored_key": "%032x" % rng.getrandbits(128),
                 "name": "model.layers.0.self_attn.w_kc", "is_extra": True}]
        seeds.append(json.dumps({"version": 1, "world_size": world, "files": [],
                                 "rank_to_reads": reads, "rank_checksums": {},
                                 "shard_config": {"tp": world}}).encode())
    seeds.append(b'{"format":"ferry-presharded","version":1,"signature":{},"ranks":[]}')
    seeds.append(b'{"format":"ferry-presharded","version":1,"pp_rank":0,"signature":{"a":1},'
                 b'"structure":"00","ranks":[{"tp_rank":0,"params":[{"name":"x","shape":"y"}]}]}')
    return seeds


def fdp_string(s):
    """FuzzedDataProvider::ConsumeRandomLengthString's encoding of `s`."""
    return s.replace(b"\\", b"\\\\") + b"\\x"


def config_seed(file_text, env, sets):
    """fuzz_config's input: integers are consumed from the end (env count, --set
    count, then one prefix flag per variable), strings from the front."""
    front = fdp_string(file_text)
    tail = [len(env), len(sets)]
    for name, value, prefixed in env:
        tail.append(1 if prefixed else 0)
        front += fdp_string(name) + fdp_string(value)
    for s in sets:
        front += fdp_string(s)
    return front + bytes(reversed(tail))


def config_seeds():
    files = [
        b'{"parallel":{"tp":2}}',
        b'{}',
        json.dumps({"model": {"path": "/models/llama", "load_format": "safetensors",
                              "dtype": "bf16", "unaligned_tp": "pad"},
                    "parallel": {"tp": 4, "ep": 2, "ranks": "0-1"},
                    "devices": "null",
                    "io": {"engine": "pread", "chunk_bytes": "4MiB", "queue_depth": 16,
                           "staging_bytes": "64 MiB", "direct": True,
                           "direct_to_device": "on", "cancel_timeout_ms": 100},
                    "prefetch": {"enabled": True, "threads": 2, "block_bytes": "1MiB",
                                 "ahead_bytes": 0},
                    "load": {"strict": True, "sort_weight_files": 2},
                    "host": {"bandwidth_gbps": 12.5, "deferred_copies": True},
                    "metrics": {"listen": "9400"},
                    "startup": {"mode": "overlap"}}).encode(),
        json.dumps({"parallel": {"tp": 8, "pp": 2, "pp_rank": 1, "pp_partition": [3, 5],
                                 "ranks": [6, 7]},
                    "devices": "host:2",
                    "model": {"fuse_shared_experts": "auto", "pad_moe_intermediate_to": 64}
                    }).encode(),
    ]
    envs = [
        [],
        [(b"IO__CHUNK_BYTES", b"1MiB", True), (b"DEVICES", b"host", True)],
        [(b"PARALLEL__TP", b"4", True), (b"LOG", b"debug", True), (b"BIN", b"/x", True),
         (b"HOME", b"/root", False)],
        [(b"LOAD__SORT_WEIGHT_FILES", b"-1", True), (b"MODEL__PATH", b"2024", True)],
    ]
    sets = [
        [],
        [b"io.direct=true", b"parallel.tp=2"],
        [b"devices=cuda:0,2", b"parallel.ranks=0,1", b"parallel.tp=4"],
        [b"model.dtype=float16", b"io.staging_bytes=1.5GiB", b"prefetch.enabled=false"],
        [b"metrics.listen=127.0.0.1:9400", b"trace.path=/tmp/t.json", b"io.engine=uring"],
    ]
    seeds = []
    for i, f in enumerate(files):
        for j, e in enumerate(envs):
            seeds.append(config_seed(f, e, sets[(i + j) % len(sets)]))
    return seeds


def state_dict_pickle(rng, count, v3=False):
    """A state dict pickled as torch.save's protocol-2 pickler writes one (GLOBAL,
    BINPERSID, _rebuild_tensor_v2 / _v3, memo puts), written out by hand: no torch."""
    def s(text):
        b = text.encode()
        return b"X" + struct.pack("<I", len(b)) + b
    def i(v):
        return b"K" + bytes([v]) if v < 256 else b"M" + struct.pack("<H", v)
    out = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01("
    storages = []
    for n in range(count):
        shape = [rng.randrange(1, 9) for _ in range(rng.randrange(1, 3))]
        numel = 1
        for d in shape:
            numel *= d
        stride = [shape[1], 1] if len(shape) == 2 else [1]
        out += s(f"layers.{n}.weight")
        if v3:
            out += b"ctorch._utils\n_rebuild_tensor_v3\n(("
            out += s("storage") + b"ctorch.storage\nUntypedStorage\n" + s(str(n)) + s("cpu")
            out += i(numel) + b"tQ"
        else:
            out += b"ctorch._utils\n_rebuild_tensor_v2\n(("
            out += s("storage") + b"ctorch\nFloatStorage\n" + s(str(n)) + s("cpu") + i(numel)
            out += b"tQ"
        out += i(0) + b"(" + b"".join(i(d) for d in shape) + b"t(" + b"".join(i(d) for d in stride)
        out += b"t\x89h\x00)R"
        if v3:
            out += b"ctorch\nfloat8_e4m3fn\n"
        out += b"tR"
        storages.append((str(n), numel * (1 if v3 else 4)))
    return out + b"u.", storages


def pickle_seeds(rng):
    return [state_dict_pickle(rng, n, v3=n % 2 == 1)[0] for n in (0, 1, 2, 5, 9)]


def torch_zip_seeds(rng):
    """torch.save archives: data.pkl and one stored member per storage."""
    import io
    import zipfile
    seeds = []
    for n in (1, 2, 4):
        pkl, storages = state_dict_pickle(rng, n, v3=n == 2)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", pkl)
            z.writestr("archive/byteorder", "little")
            for key, nbytes in storages:
                z.writestr(f"archive/data/{key}", bytes(rng.randrange(256) for _ in range(nbytes)))
            z.writestr("archive/version", "3\n")
        seeds.append(buf.getvalue())
    return seeds


GGUF_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
              8: (32, 34), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
              14: (256, 210), 24: (1, 1), 26: (1, 4), 30: (1, 2)}


def gguf_value(vtype, value):
    """A GGUF value's bytes (without its type): arrays are (element type, items)."""
    packers = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
               11: "q", 12: "d"}
    if vtype == 8:
        b = value.encode() if isinstance(value, str) else value
        return struct.pack("<Q", len(b)) + b
    if vtype == 9:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(gguf_value(etype, x) for x in items)
    return struct.pack("<" + packers[vtype], value)


def gguf_file(rng, kvs, tensors, alignment=32, version=3, offsets=None):
    """A GGUF file laid out as gguf-py's GGUFWriter lays one out; `kvs` holds (key,
    type, value), `tensors` (name, dims, ggml type); data is pseudo-random bytes."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, vtype, value in kvs:
        out += gguf_value(8, key) + struct.pack("<I", vtype) + gguf_value(vtype, value)
    sizes, at = [], 0
    for i, (name, dims, gtype) in enumerate(tensors):
        block, size = GGUF_SIZES.get(gtype, (1, 1))  # (1, 1) for a type no one has
        n = size * dims[0] // block
        for d in dims[1:]:
            n *= d
        sizes.append(n)
        offset = offsets[i] if offsets else at
        out += gguf_value(8, name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", gtype, offset)
        at += (n + alignment - 1) // alignment * alignment
    out += bytes(-len(out) % alignment)
    for n in sizes:
        out += bytes(rng.randrange(256) for _ in range(n)) + bytes(-n % alignment)
    return out


def gguf_seeds():
    """Small GGUF files: a Llama-like one at two alignments, every value type (and
    version 2), a DeepSeek-like one with stacked experts, an empty one, then near
    misses that each break one of the parser's rules."""
    rng = random.Random(23)
    llama_kvs = [("general.architecture", 8, "llama"), ("llama.block_count", 4, 1),
                 ("llama.context_length", 4, 4096), ("llama.embedding_length", 4, 32),
                 ("llama.attention.head_count", 4, 4),
                 ("llama.attention.layer_norm_rms_epsilon", 6, 1e-5),
                 ("llama.rope.freq_base", 6, 500000.0),
                 ("tokenizer.ggml.tokens", 9, (8, [f"t{i}" for i in range(12)])),
                 ("tokenizer.ggml.scores", 9, (6, [float(i) for i in range(12)])),
                 ("tokenizer.ggml.bos_token_id", 4, 1)]
    llama_tensors = [("token_embd.weight", [32, 12], 1), ("output_norm.weight", [32], 0),
                     ("blk.0.attn_q.weight", [32, 32], 8), ("blk.0.ffn_down.weight", [256, 2], 12),
                     ("blk.0.ffn_up.weight", [256, 1], 14)]
    every = [("u8", 0, 200), ("i8", 1, -5), ("u16", 2, 60000), ("i16", 3, -300),
             ("u32", 4, 7), ("i32", 5, -7), ("f32", 6, 0.25), ("bool", 7, True),
             ("str", 8, "h\u00e9llo"), ("u64", 10, 1 << 40), ("i64", 11, -(1 << 40)),
             ("f64", 12, 1e-300), ("ints", 9, (5, [1, -2, 3])),
             ("nested", 9, (9, [(4, [1, 2]), (8, ["x"]), (0, [])])),
             ("long", 9, (8, ["w"] * 100))]
    seeds = [
        gguf_file(rng, llama_kvs, llama_tensors),
        gguf_file(rng, llama_kvs + [("general.alignment", 4, 64)], llama_tensors, alignment=64),
        gguf_file(rng, every, [("v", [4], 30), ("i", [3, 2], 24)], version=2),
        gguf_file(rng, [("general.architecture", 8, "deepseek2"),
                        ("deepseek2.expert_count", 4, 4)],
                  [("blk.1.ffn_up_exps.weight", [32, 8, 4], 8),
                   ("blk.0.attn_k_b.weight", [8, 16, 2], 1),
                   ("blk.1.exp_probs_b.bias", [4], 0), ("blk.0.attn_q_a.weight", [32, 3], 2),
                   ("blk.0.attn_kv_a_mqa.weight", [32, 2], 3)]),
        gguf_file(rng, [], []),
    ]
    ok = [("a", [8], 0), ("b", [8], 0)]
    seeds += [
        gguf_file(rng, [], [("a", [4], 31)]),                          # a removed type
        gguf_file(rng, [], ok, offsets=[0, 16]),                       # misaligned
        gguf_file(rng, [], [("a", [16], 0), ("b", [8], 0)], offsets=[0, 32]),  # overlap
        gguf_file(rng, [("k", 4, 1), ("k", 4, 2)], []),                # a key twice
        gguf_file(rng, [("general.alignment", 4, 48)], ok),            # not a power of two
        gguf_file(rng, [], [("a", [33], 8)]),                          # not whole blocks
        gguf_file(rng, [], [("a", [1, 1, 1, 1, 1], 0)]),              # five dims
        gguf_file(rng, [], ok, version=1),
    ]
    return seeds


def random_seeds(rng, count):
    return [bytes(rng.randrange(256) for _ in range(rng.choice([16, 32, 64, 128, 256, 512])))
            for _ in range(count)]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    rng = random.Random(17)
    targets = {
        "fuzz_header": header_seeds(rng),
        "fuzz_index": index_seeds(rng),
        "fuzz_config": config_seeds(),
        "fuzz_discover": random_seeds(rng, 64),
        "fuzz_plan": random_seeds(rng, 64),
        "fuzz_presharded": presharded_seeds(rng),
        "fuzz_cache_frame": cache_frame_seeds(),
        "fuzz_remote_control": remote_control_seeds(),
        "fuzz_gguf": gguf_seeds(),
        "fuzz_pickle": pickle_seeds(rng),
        "fuzz_torch_zip": torch_zip_seeds(rng),
    }
    for target, seeds in targets.items():
        folder = os.path.join(out, target)
        os.makedirs(folder, exist_ok=True)
        for i, seed in enumerate(seeds):
            with open(os.path.join(folder, f"seed-{i:03d}"), "wb") as f:
                f.write(seed)
        print(f"{target}: {len(seeds)} seeds in {folder}")


if __name__ == "__main__":
    main()
