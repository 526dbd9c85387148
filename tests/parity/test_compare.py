# Unit test of the parity harness's comparison (compare.py): each kind of
# difference must be reported, and equal ranks must not be. Plain Python and
# numpy; no SGLang. Run: python3 tests/parity/test_compare.py
import json
import os
import struct
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402

FILL = 0xA5


def bf16(values):
    """BF16 bytes of float values (exact for the small multiples used here)."""
    f32 = np.asarray(values, dtype=np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def t(dtype, shape, data):
    return compare.Tensor(dtype, shape, data)


class CompareTest(unittest.TestCase):
    def test_equal_ranks_pass(self):
        a = {"w": t("BF16", [2, 2], bf16([1, 2, 3, 4]))}
        b = {"w": t("BF16", [2, 2], bf16([1, 2, 3, 4]))}
        self.assertEqual(compare.compare_ranks(a, b, FILL), [])
        self.assertEqual(compare.summarize([]), "PASS")

    def test_one_differing_element_is_counted(self):
        ferry = {"w": t("BF16", [4], bf16([1, 2, 3, 4]))}
        sglang = {"w": t("BF16", [4], bf16([1, 2, 3.5, 4]))}
        diffs = compare.compare_ranks(ferry, sglang, FILL)
        self.assertEqual(len(diffs), 1)
        self.assertEqual(diffs[0]["kind"], "bytes")
        self.assertEqual(diffs[0]["count"], 1)
        self.assertEqual(diffs[0]["first"], 2)
        self.assertEqual(diffs[0]["ferry"], "3.0")
        self.assertEqual(diffs[0]["sglang"], "3.5")
        self.assertIn("1/4 elements differ", compare.summarize(diffs))

    def test_fill_pattern_is_unwritten_not_a_byte_mismatch(self):
        filled = bytes([FILL, FILL])
        ferry = {"w": t("BF16", [3], bf16([1, 2, 3]))}
        sglang = {"w": t("BF16", [3], bf16([1]) + filled + filled)}
        diffs = compare.compare_ranks(ferry, sglang, FILL)
        self.assertEqual([d["kind"] for d in diffs], ["unwritten"])
        self.assertEqual(diffs[0]["count"], 2)
        self.assertEqual(diffs[0]["first"], 1)

    def test_one_byte_fill_that_matches_ferry_is_written(self):
        # 0xA5 is a legal FP8 value; equal on both sides means it was loaded.
        ferry = {"w": t("F8_E4M3", [3], bytes([FILL, 1, FILL]))}
        sglang = {"w": t("F8_E4M3", [3], bytes([FILL, 1, 2]))}
        diffs = compare.compare_ranks(ferry, sglang, FILL)
        self.assertEqual([d["kind"] for d in diffs], ["bytes"])
        ferry["w"] = t("F8_E4M3", [3], bytes([3, 1, 2]))
        diffs = compare.compare_ranks(ferry, sglang, FILL)
        self.assertEqual([d["kind"] for d in diffs], ["unwritten"])

    def test_a_kept_initial_value_is_unwritten_where_ferry_differs(self):
        # SGLang made the tensor torch.ones-like (kept, not filled): elements
        # still 1.0 where ferry holds something else were never loaded.
        ferry = {"s": t("F32", [3], np.array([1, 2, 3], np.float32).tobytes())}
        sglang = {"s": t("F32", [3], np.array([1, 1, 5], np.float32).tobytes())}
        kept = {"s": np.array([1], np.float32).tobytes().hex()}
        diffs = compare.compare_ranks(ferry, sglang, FILL, kept=kept)
        self.assertEqual([(d["kind"], d["count"], d["first"]) for d in diffs],
                         [("unwritten", 1, 1), ("bytes", 1, 2)])

    def test_names_dtypes_and_shapes(self):
        ferry = {
            "a": t("BF16", [2], bf16([1, 2])),
            "b": t("BF16", [2], bf16([1, 2])),
            "c": t("BF16", [1, 2], bf16([1, 2])),
            "only_ferry": t("F32", [], struct.pack("<f", 1.0)),
        }
        sglang = {
            "a": t("BF16", [2], bf16([1, 2])),
            "b": t("F32", [2], np.array([1, 2], np.float32).tobytes()),
            "c": t("BF16", [2], bf16([1, 2])),
            "only_sglang": t("F32", [], struct.pack("<f", 1.0)),
            "rotary.cache": t("F32", [], struct.pack("<f", 1.0)),
        }
        diffs = compare.compare_ranks(ferry, sglang, FILL, ignore=[r"rotary\..*"])
        kinds = {d["name"]: d["kind"] for d in diffs}
        self.assertEqual(kinds, {"b": "dtype", "c": "shape",
                                 "only_ferry": "extra", "only_sglang": "missing"})

    def test_a_name_sglang_never_wrote_is_a_note(self):
        filled = t("BF16", [2], bytes([FILL] * 4))
        half = t("BF16", [2], bf16([1]) + bytes([FILL] * 2))
        notes = []
        diffs = compare.compare_ranks({}, {"head": filled, "half": half}, FILL, notes=notes)
        self.assertEqual([(d["kind"], d["name"]) for d in diffs], [("missing", "half")])
        self.assertEqual([(n["kind"], n["name"]) for n in notes], [("unloaded", "head")])

    def test_layers_fold_in_the_summary(self):
        ferry = {f"model.layers.{i}.w": t("BF16", [1], bf16([1])) for i in range(3)}
        sglang = {f"model.layers.{i}.w": t("F32", [1], np.ones(1, np.float32).tobytes())
                  for i in range(3)}
        text = compare.summarize(compare.compare_ranks(ferry, sglang, FILL))
        self.assertEqual(text, "dtype `model.layers.N.w` ×3: ferry BF16, SGLang F32")

    def test_reads_a_safetensors_file(self):
        header = {"__metadata__": {"format": "pt"},
                  "x": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}
        blob = json.dumps(header).encode()
        with tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False) as f:
            f.write(struct.pack("<Q", len(blob)) + blob + bf16([1, -2]))
        try:
            tensors = compare.read_safetensors(f.name)
            self.assertEqual(list(tensors), ["x"])
            self.assertEqual(bytes(tensors["x"].data), bf16([1, -2]))
        finally:
            os.remove(f.name)


if __name__ == "__main__":
    unittest.main()
