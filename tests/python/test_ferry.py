"""The Python module over libferry.so (issue 16 §2), on synthesized checkpoints:

    PYTHONPATH=build/release/python python3 tests/python/test_ferry.py FERRY_CLI

numpy takes F32 and F16 parameters of host devices through DLPack without a copy,
equal to the values of `Model.dump`; BF16 parameters are checked by bytes; errors
are ferry.Error with stage, file, tensor and rule; start() with both callbacks,
a callback that raises, cancel, and prepare()/commit() keeping the storage. Exits
77 (skipped) when numpy is missing.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

try:
    import numpy as np
except ImportError:  # pragma: no cover
    print("test_ferry: numpy is not installed; skipped")
    sys.exit(77)

import ferry

FERRY_CLI = None
NP_DTYPES = {"F32": np.float32, "F16": np.float16}


def read_safetensors(path):
    """{name: (dtype, shape, bytes)} of a safetensors file, read by hand."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = (entry["dtype"], tuple(entry["shape"]), data[begin:end])
    return out


def contiguous(p):
    expected, stride = [], 1
    for dim in reversed(p.shape):
        expected.insert(0, stride)
        stride *= dim
    return list(p.strides) == expected


class FerryModule(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="ferry-py-")
        cls.ck = os.path.join(cls.tmp, "ck")
        subprocess.run([FERRY_CLI, "synth", "--family", "llama", "--preset", "tiny", "--out", cls.ck],
                       check=True, stdout=subprocess.DEVNULL)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def config(self, **extra):
        c = ferry.Config()
        c.set("model.path", self.ck).set("parallel.tp=2")
        for k, v in extra.items():
            c.set(k.replace("__", "."), str(v))
        return c

    def dump(self, model, name):
        d = os.path.join(self.tmp, name)
        model.dump(d)
        return {r: read_safetensors(os.path.join(d, f"rank-{r}.safetensors")) for r in model.tp_ranks}

    def test_version_and_config(self):
        self.assertRegex(ferry.__version__, r"^\d+\.\d+\.\d+$")
        c = ferry.Config().set("parallel.tp", "4").set("io.direct=true")
        j = json.loads(c.to_json())
        self.assertEqual(j["parallel"]["tp"], 4)
        self.assertTrue(j["io"]["direct"])
        self.assertEqual(ferry.Config().json(c.to_json()), c)
        with self.assertRaises(ferry.Error) as e:
            ferry.Config().set("io.no_such_key=1")
        self.assertEqual(e.exception.stage, "config")
        self.assertIn("io.no_such_key", str(e.exception))
        self.assertIsInstance(e.exception, RuntimeError)

    def test_f32_and_f16_through_numpy_without_a_copy(self):
        for dtype in ("f32", "f16"):
            with self.subTest(dtype=dtype):
                model = ferry.Runtime(self.config(model__dtype=dtype)).load()
                dumped = self.dump(model, "dump-" + dtype)
                checked = 0
                for p in model.params():
                    self.assertEqual(p.__dlpack_device__(), (1, p.tp_rank))  # kDLCPU, host:N
                    a = np.from_dlpack(p)
                    self.assertEqual(list(a.shape), list(p.shape))
                    self.assertEqual(a.dtype, NP_DTYPES[p.dtype])
                    self.assertEqual(a.ctypes.data, p.data_ptr)  # the parameter's own memory
                    st_dtype, shape, raw = dumped[p.tp_rank][p.name]
                    self.assertEqual(st_dtype, p.dtype)
                    want = np.frombuffer(raw, dtype=NP_DTYPES[st_dtype]).reshape(shape)
                    np.testing.assert_array_equal(a, want, err_msg=p.name)
                    checked += 1
                self.assertGreater(checked, 20)

    def test_bf16_by_bytes(self):
        model = ferry.Runtime(self.config()).load()
        dumped = self.dump(model, "dump-bf16")
        checked = 0
        for p in model.params():
            self.assertEqual(p.dtype, "BF16")
            st_dtype, shape, raw = dumped[p.tp_rank][p.name]
            if contiguous(p):
                self.assertEqual(model.read_param(p.name, p.tp_rank), raw, p.name)
                checked += 1
        self.assertGreater(checked, 20)

    def test_errors_carry_stage_file_tensor_and_rule(self):
        c = ferry.Config().set("model.path", os.path.join(self.tmp, "not-there"))
        with self.assertRaises(ferry.Error) as e:
            ferry.Runtime(c).load()
        err = e.exception
        self.assertEqual(err.stage, "discovery")
        self.assertIn("not-there", err.file)
        self.assertTrue(err.rule)
        self.assertIn(err.rule, str(err))
        model = ferry.Runtime(self.config()).load()
        with self.assertRaises(ferry.Error) as e:
            model.param("model.no_such_param")
        self.assertEqual(e.exception.tensor, "model.no_such_param")
        with self.assertRaises(TypeError):
            ferry.Runtime(42)

    def test_start_with_callbacks_releases_the_gil(self):
        # The callbacks run on a ferry thread and take the GIL while this thread is
        # inside wait(): they are called at all only because wait() gave it up.
        phases, layers = [], []
        rt = ferry.Runtime({"model.path": self.ck, "parallel.tp": 2, "io.direct": False})
        h = rt.start(on_progress=lambda p: phases.append(p.phase) or True,
                     on_layer_ready=lambda layer, rank: layers.append((layer, rank)))
        model = h.wait()
        self.assertTrue(h.done())
        self.assertEqual(h.progress().phase, "done")
        self.assertEqual(phases[-1], "done")
        self.assertEqual(sorted(layers), [(layer, r) for layer in range(4) for r in (0, 1)])
        self.assertEqual(rt.state, "ready")
        self.assertGreater(json.loads(model.report_json)["bytes_read"], 0)
        self.assertIsNotNone(h.wait(timeout=0.0))

    def test_a_callback_that_raises_fails_the_load(self):
        def boom(layer, rank):
            raise ValueError("engine says no")

        rt = ferry.Runtime(self.config())
        with self.assertRaises(ferry.Error) as e:
            rt.load(on_layer_ready=boom)
        self.assertEqual(e.exception.stage, "cancelled")
        self.assertIn("engine says no", str(e.exception))
        self.assertEqual(rt.state, "failed")
        with self.assertRaises(ferry.Error) as e:
            rt.load(on_progress=lambda p: False)  # False cancels
        self.assertEqual(e.exception.stage, "cancelled")
        self.assertGreater(len(rt.load().params()), 0)  # the same Runtime loads next

    def test_prepare_then_commit_keeps_the_storage(self):
        rt = ferry.Runtime(self.config(startup__mode="overlap"))
        prepared = rt.prepare().wait()
        before = {(p.tp_rank, p.name): p.data_ptr for p in prepared.params()}
        self.assertEqual(rt.state, "prepared")
        ready = rt.commit().wait()
        after = {(p.tp_rank, p.name): p.data_ptr for p in ready.params()}
        self.assertEqual(before, after)
        self.assertEqual(json.loads(ready.report_json)["startup_mode"], "overlap")

    def test_a_tensor_outlives_its_model_and_runtime(self):
        rt = ferry.Runtime(self.config(model__dtype="f32"))
        model = rt.load()
        p = model.params()[0]
        want = np.from_dlpack(p).copy()
        a = np.from_dlpack(p)
        del model, p, rt
        np.testing.assert_array_equal(a, want)


if __name__ == "__main__":
    FERRY_CLI = sys.argv.pop(1)
    unittest.main(verbosity=2)
