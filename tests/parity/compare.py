# Compares what one rank holds on each side of a parity case: ferry's
# `ferry load --dump-dir` file and the SGLang worker's dump (sglang_worker.py).
# Plain Python and numpy only, so it and its unit test (test_compare.py) run
# without SGLang or torch.
#
# A difference is one of:
#   missing    SGLang holds the name, ferry does not
#   extra      ferry holds the name, SGLang does not
#   dtype      both hold it with different dtypes (bytes are not compared)
#   shape      both hold it with different shapes (bytes are not compared)
#   unwritten  elements of SGLang's tensor still hold the fill byte, so SGLang's
#              loader never wrote them (for one-byte dtypes, where the fill is
#              also a legal value, only those that ferry holds otherwise)
#   bytes      elements whose bytes differ (unwritten ones not counted again)
# A name only SGLang holds and never wrote at all is a note, not a difference.
import json
import mmap
import re
import struct

import numpy as np

ITEM_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


class Tensor:
    def __init__(self, dtype, shape, data):
        self.dtype = dtype
        self.shape = list(shape)
        self.data = data  # bytes-like, row-major

    def elements(self):
        """The tensor as a 2-D uint8 array: one row of item bytes per element."""
        size = ITEM_SIZE[self.dtype]
        raw = np.frombuffer(self.data, dtype=np.uint8)
        return raw.reshape(-1, size)


def read_safetensors(path):
    """name -> Tensor for every tensor in a safetensors file (header parsed
    here; the data is mapped, not copied)."""
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    (header_len,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8:8 + header_len])
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = Tensor(info["dtype"], info["shape"],
                           memoryview(mapped)[base + begin:base + end])
    return out


def _value(dtype, item):
    """One element's bytes as text: the number for float dtypes, else hex."""
    raw = bytes(item)
    if dtype == "F32":
        return repr(struct.unpack("<f", raw)[0])
    if dtype == "F16":
        return repr(float(np.frombuffer(raw, dtype=np.float16)[0]))
    if dtype == "BF16":
        return repr(struct.unpack("<f", b"\0\0" + raw)[0])
    return "0x" + raw[::-1].hex()


def compare_tensors(name, ferry, sglang, fill_byte, init=None):
    """The differences of one name held by both sides (a list of dicts). `init`
    is the bytes of the one value SGLang initialized the tensor to instead of the
    fill (sglang_worker.fill): an element still holding it where ferry holds
    another value counts as unwritten too."""
    if ferry.dtype != sglang.dtype:
        return [{"kind": "dtype", "name": name, "ferry": ferry.dtype,
                 "sglang": sglang.dtype,
                 "detail": f"shape ferry {ferry.shape}, SGLang {sglang.shape}"}]
    if ferry.shape != sglang.shape:
        return [{"kind": "shape", "name": name, "ferry": ferry.shape,
                 "sglang": sglang.shape}]
    out = []
    ours = ferry.elements()
    theirs = sglang.elements()
    count = theirs.shape[0]
    if count == 0:
        return out
    unwritten = np.all(theirs == fill_byte, axis=1)
    differ = np.any(ours != theirs, axis=1)
    if theirs.shape[1] == 1:
        # The fill byte is a legal one-byte value: an element that holds it
        # and matches ferry cannot be told from a written one.
        unwritten &= differ
    if init is not None and len(init) == theirs.shape[1]:
        initial = np.frombuffer(init, dtype=np.uint8)
        unwritten |= np.all(theirs == initial, axis=1) & differ
    if unwritten.any():
        first = int(np.argmax(unwritten))
        out.append({"kind": "unwritten", "name": name, "count": int(unwritten.sum()),
                    "of": count, "first": first,
                    "ferry": _value(ferry.dtype, ours[first])})
    differ &= ~unwritten
    if differ.any():
        first = int(np.argmax(differ))
        out.append({"kind": "bytes", "name": name, "count": int(differ.sum()),
                    "of": count, "first": first,
                    "ferry": _value(ferry.dtype, ours[first]),
                    "sglang": _value(sglang.dtype, theirs[first])})
    return out


def compare_ranks(ferry, sglang, fill_byte, ignore=(), notes=None, kept=None):
    """Every difference between two name -> Tensor maps. `ignore` holds regular
    expressions of SGLang names that are not weights (see README.md). A name
    only SGLang holds but never wrote a byte of (the MTP draft's embedding and
    head, which SGLang shares from the target model after loading) is not a
    difference; it goes to `notes` when given."""
    patterns = [re.compile(p) for p in ignore]
    sglang = {n: t for n, t in sglang.items()
              if not any(p.fullmatch(n) for p in patterns)}
    out = []
    for name in sorted(set(sglang) - set(ferry)):
        t = sglang[name]
        elements = t.elements()
        if elements.size and np.all(elements == fill_byte):
            if notes is not None:
                notes.append({"kind": "unloaded", "name": name,
                              "sglang": [t.dtype, t.shape]})
            continue
        out.append({"kind": "missing", "name": name, "sglang": [t.dtype, t.shape]})
    for name in sorted(set(ferry) - set(sglang)):
        t = ferry[name]
        out.append({"kind": "extra", "name": name, "ferry": [t.dtype, t.shape]})
    kept = kept or {}
    for name in sorted(set(ferry) & set(sglang)):
        init = bytes.fromhex(kept[name]) if name in kept else None
        out.extend(compare_tensors(name, ferry[name], sglang[name], fill_byte, init))
    return out


_LAYER = re.compile(r"\.(layers|experts)\.\d+\.")


def _pattern(name):
    return _LAYER.sub(lambda m: f".{m.group(1)}.N.", name)


def summarize(differences, limit=4):
    """One line per kind of difference and name pattern (layer indices folded
    to N), at most `limit` of them, for the table in docs/ARCHITECTURE.md."""
    if not differences:
        return "PASS"
    groups = {}
    for d in differences:
        key = (d["kind"], _pattern(d["name"]))
        groups.setdefault(key, []).append(d)
    lines = []
    for (kind, pattern), items in groups.items():
        d = items[0]
        many = f" ×{len(items)}" if len(items) > 1 else ""
        if kind in ("dtype", "shape"):
            text = f"{kind} `{pattern}`{many}: ferry {d['ferry']}, SGLang {d['sglang']}"
        elif kind == "missing":
            text = f"missing in ferry `{pattern}`{many} (SGLang {d['sglang'][0]} {d['sglang'][1]})"
        elif kind == "extra":
            text = f"extra in ferry `{pattern}`{many} ({d['ferry'][0]} {d['ferry'][1]})"
        elif kind == "unwritten":
            text = (f"unwritten by SGLang `{pattern}`{many}: {d['count']}/{d['of']} "
                    f"elements (ferry {d['ferry']} at {d['first']})")
        else:
            text = (f"bytes `{pattern}`{many}: {d['count']}/{d['of']} elements differ "
                    f"(first {d['first']}: ferry {d['ferry']}, SGLang {d['sglang']})")
        lines.append(text)
    extra = len(lines) - limit
    lines = lines[:limit]
    if extra > 0:
        lines.append(f"… {extra} more")
    return "; ".join(lines)
