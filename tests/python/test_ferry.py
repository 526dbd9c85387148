"""The Python module over libferry.so (issue 16 §2), on synthesized checkpoints:

    PYTHONPATH=build/release/python python3 tests/python/test_ferry.py FERRY_CLI

numpy takes F32 and F16 parameters of host devices through DLPack without a copy,
equal to the values of `Model.dump`; BF16 parameters are checked by bytes; errors
are ferry.Error with stage, file, tensor and rule; start() with both callbacks,
a callback that raises, cancel, and prepare()/commit() keeping the storage. Exits
77 (skipped) when numpy is missing.

The attacks of hardening round two that reach the module (Attack* classes below):
wait() with deadlines too large to count, NaN or negative; callbacks that raise,
whose exception must be named in the error and chained as its __cause__.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
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


class TinyCheckpointCase(unittest.TestCase):
    """A tiny llama checkpoint of the class's own, in a folder named by PREFIX."""

    PREFIX = "ferry-py-"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix=cls.PREFIX)
        cls.ck = os.path.join(cls.tmp, "ck")
        subprocess.run([FERRY_CLI, "synth", "--family", "llama", "--preset", "tiny", "--out", cls.ck],
                       check=True, stdout=subprocess.DEVNULL)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)


class FerryModule(TinyCheckpointCase):
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

    def test_a_dict_config_ties_layered_and_online_in_either_order(self):
        # The load checks the rules that tie keys a load needs, so a dict may give
        # them in any order; load.layered alone is refused by the load.
        base = {"model.path": self.ck, "parallel.tp": 2}
        for keys in (("load.layered", "quantization.online"),
                     ("quantization.online", "load.layered")):
            with self.subTest(order=keys):
                values = {"load.layered": True, "quantization.online": "fp8_channel"}
                model = ferry.Runtime(dict(base, **{k: values[k] for k in keys})).load()
                self.assertTrue(any(p.dtype == "F8_E4M3" for p in model.params()))
        with self.assertRaises(ferry.Error) as e:
            ferry.Runtime(dict(base, **{"load.layered": True})).load()
        self.assertEqual(e.exception.stage, "config")
        self.assertIn("only quantization.online makes any", e.exception.rule)

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

    def test_bin_and_gguf_checkpoints_load_as_their_safetensors_twin(self):
        # issue 37: the same weights as torch.save .bin shards and as GGUF (BF16, and
        # Q8_0 dequantized on the device) through the module.
        def synth(name, *args):
            out = os.path.join(self.tmp, name)
            if not os.path.exists(out):
                subprocess.run([FERRY_CLI, "synth", "--family", "llama", "--preset", "tiny",
                                "--out", out, *args], check=True, stdout=subprocess.DEVNULL)
            return out

        def params(path, **extra):
            c = {"model.path": path, "parallel.tp": 2, "model.dtype": "f32"}
            c.update({k.replace("__", "."): v for k, v in extra.items()})
            model = ferry.Runtime(c).load()
            return {(p.tp_rank, p.name): np.from_dlpack(p).copy() for p in model.params()}

        want = params(self.ck)
        for name, args in (("bin", ["--format", "bin"]),
                           ("gguf-bf16", ["--format", "gguf", "--gguf-type", "bf16"])):
            with self.subTest(format=name):
                got = params(synth(name, *args))
                self.assertEqual(got.keys(), want.keys())
                for key, a in want.items():
                    np.testing.assert_array_equal(got[key], a, err_msg=str(key))
        q8 = synth("gguf-q8_0", "--format", "gguf", "--gguf-type", "q8_0")
        got = params(os.path.join(q8, "model.gguf"))
        self.assertEqual(got.keys(), want.keys())
        differ = 0
        for key, a in want.items():
            # Q8_0 keeps 8 bits a value and one F16 scale per 32: within about half a step
            # (the block's largest value / 127, bounded here by the row's).
            bound = np.abs(a).max(axis=-1, keepdims=True) / 127 if a.ndim > 1 else 0
            err = np.abs(got[key] - a)
            self.assertTrue(np.all(err < bound * 0.6 + 1e-6),
                            f"{key}: error up to {err.max()}")
            differ += int(not np.array_equal(got[key], a))
        self.assertGreater(differ, 3)  # the matrices really were Q8_0
        with self.assertRaises(ferry.Error) as e:
            params(q8, gguf__dequantize=False)
        self.assertIn("gguf.dequantize is off", str(e.exception))
        self.assertIn("model.gguf", str(e.exception))

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


class Updates(TinyCheckpointCase):
    """rt.update (issue 34 section 2): from a folder and from a dict of tensors."""

    PREFIX = "ferry-py-update-"

    def checkpoint_f32(self):
        """The checkpoint's tensors as float32 arrays (BF16 widened exactly)."""
        out = {}
        for f in sorted(os.listdir(self.ck)):
            if f.endswith(".safetensors"):
                for name, (dtype, shape, raw) in read_safetensors(os.path.join(self.ck, f)).items():
                    self.assertEqual(dtype, "BF16")
                    bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
                    out[name] = bits.view(np.float32).reshape(shape)
        return out

    def test_a_dict_of_tensors_lands_in_place_and_a_folder_brings_the_old_weights_back(self):
        rt = ferry.Runtime({"model.path": self.ck, "parallel.tp": 2, "model.dtype": "f32"})
        model = rt.load()
        before = {(p.tp_rank, p.name): (p.data_ptr, np.from_dlpack(p).copy()) for p in model.params()}
        doubled = {name: np.ascontiguousarray(a * 2) for name, a in self.checkpoint_f32().items()}
        self.assertEqual(rt.update(doubled).params()[0].data_ptr, model.params()[0].data_ptr)
        self.assertEqual(json.loads(model.report_json)["update"]["source"], "tensors")
        for p in model.params():
            ptr, old = before[(p.tp_rank, p.name)]
            self.assertEqual(p.data_ptr, ptr, p.name)
            np.testing.assert_array_equal(np.from_dlpack(p), old * 2, err_msg=p.name)
        rt.update(self.ck)
        for p in model.params():
            np.testing.assert_array_equal(np.from_dlpack(p), before[(p.tp_rank, p.name)][1])
        self.assertTrue(model.valid)
        self.assertEqual(model.invalid_reason, "")

    def test_names_keep_only_matching_tensors_and_bad_sources_are_refused(self):
        rt = ferry.Runtime({"model.path": self.ck, "model.dtype": "f32"})
        model = rt.load()
        old = {p.name: np.from_dlpack(p).copy() for p in model.params()}
        doubled = {name: np.ascontiguousarray(a * 2) for name, a in self.checkpoint_f32().items()}
        rt.update(doubled, names=["model.norm.*"])
        for p in model.params():
            want = old[p.name] * 2 if p.name == "model.norm.weight" else old[p.name]
            np.testing.assert_array_equal(np.from_dlpack(p), want, err_msg=p.name)
        with self.assertRaises(ferry.Error) as e:
            rt.update({"model.norm.weight": doubled["model.norm.weight"][:-1].copy()})
        self.assertEqual(e.exception.tensor, "model.norm.weight")
        with self.assertRaises(ferry.Error) as e:
            rt.update({"model.layers.0.self_attn.q_proj.weight":
                       doubled["model.layers.0.self_attn.q_proj.weight"]})
        self.assertIn("update refused", str(e.exception))
        with self.assertRaises(ferry.Error) as e:
            rt.update({"model.norm.weight": doubled["model.norm.weight"][::2]})
        self.assertIn("contiguous", str(e.exception))
        with self.assertRaises(TypeError):
            rt.update({"model.norm.weight": [1.0, 2.0]})
        with self.assertRaises(ValueError):
            rt.update({"model.norm.weight": (doubled["model.norm.weight"], "F99")})
        self.assertTrue(model.valid)


class RemoteInstance(TinyCheckpointCase):
    """remote_instance (issue 36): a ferry.CacheDaemon with remote.listen is a seed on
    loopback, and a Runtime with model.load_format remote_instance pulls from it."""

    PREFIX = "ferry-py-remote-"

    def setUp(self):
        self.registry = tempfile.mkdtemp(prefix="ferry-py-registry-")
        os.chmod(self.registry, 0o700)
        self.token = self.registry + ".token"
        with open(self.token, "w") as f:
            f.write("python-fleet-secret-0123456789\n")
        os.chmod(self.token, 0o600)

    def tearDown(self):
        shutil.rmtree(self.registry, ignore_errors=True)
        os.remove(self.token)

    def test_a_target_pulls_the_seeds_params(self):
        daemon = ferry.CacheDaemon({"model.path": self.ck, "parallel.tp": 2,
                                    "cache.dir": self.registry, "remote.listen": "127.0.0.1:0",
                                    "remote.token_file": self.token, "remote.transports": "tcp"})
        server = threading.Thread(target=daemon.serve)
        server.start()
        try:
            target = {"model.path": self.ck, "parallel.tp": 2,
                      "model.load_format": "remote_instance",
                      "remote.seed": daemon.remote_address, "remote.token_file": self.token,
                      "remote.transports": "tcp"}
            model = ferry.Runtime(target).load()
            report = json.loads(model.report_json)
            self.assertEqual(report["load_format"], "remote_instance")
            self.assertTrue(report["remote"]["pulled"])
            self.assertEqual(report["remote"]["seed"], daemon.remote_address)
            disk = ferry.Runtime({"model.path": self.ck, "parallel.tp": 2}).load()
            want = {(p.tp_rank, p.name): bytes(disk.read_param(p.name, p.tp_rank))
                    for p in disk.params()}
            got = {(p.tp_rank, p.name): bytes(model.read_param(p.name, p.tp_rank))
                   for p in model.params()}
            self.assertEqual(got, want)
            self.assertEqual(daemon.stats()["remote_served"], 1)
            # Another layout is refused, naming the field, in stage "remote".
            with self.assertRaises(ferry.Error) as e:
                ferry.Runtime(dict(target, **{"parallel.tp": 1})).load()
            self.assertEqual(e.exception.stage, "remote")
            self.assertIn("parallel.tp", str(e.exception))
        finally:
            daemon.stop()
            server.join()


class WeightCache(TinyCheckpointCase):
    """The weight cache (issue 35): ferry.CacheDaemon serves, a Runtime with
    cache.mode attaches, and on_cache_lost reports a daemon's death."""

    PREFIX = "ferry-py-cache-"

    def setUp(self):
        self.registry = tempfile.mkdtemp(prefix="ferry-py-registry-")
        os.chmod(self.registry, 0o700)

    def tearDown(self):
        shutil.rmtree(self.registry, ignore_errors=True)

    def config(self, **more):
        c = {"model.path": self.ck, "parallel.tp": 2, "cache.dir": self.registry}
        c.update(more)
        return c

    def test_a_client_maps_the_daemons_params_and_refuses_updates(self):
        daemon = ferry.CacheDaemon(self.config())
        server = threading.Thread(target=daemon.serve)
        server.start()
        try:
            self.assertTrue(os.path.exists(daemon.registration))
            rt = ferry.Runtime(self.config(**{"cache.mode": "daemon"}))
            model = rt.load(on_cache_lost=lambda why: None)
            report = json.loads(model.report_json)
            self.assertEqual(report["load_format"], "ipc_cache")
            self.assertTrue(report["cache"]["attached"])
            disk = ferry.Runtime({"model.path": self.ck, "parallel.tp": 2}).load()
            want = {(p.tp_rank, p.name): bytes(disk.read_param(p.name, p.tp_rank))
                    for p in disk.params()}
            got = {(p.tp_rank, p.name): bytes(model.read_param(p.name, p.tp_rank))
                   for p in model.params()}
            self.assertEqual(got, want)
            with self.assertRaises(ferry.Error) as e:
                rt.update(self.ck)
            self.assertIn("update refused: ipc_cache", str(e.exception))
            self.assertEqual(daemon.stats()["clients_served"], 1)
        finally:
            daemon.stop()
            server.join()
        self.assertFalse(os.path.exists(daemon.registration))
        with self.assertRaises(ferry.Error) as e:
            ferry.Runtime(self.config(**{"cache.mode": "daemon"})).load()
        self.assertEqual(e.exception.stage, "cache")

    def test_on_cache_lost_is_called_when_the_daemon_dies(self):
        ready = os.path.join(self.registry, "..", os.path.basename(self.registry) + ".ready")
        daemon = subprocess.Popen([FERRY_CLI, "serve", "--model", self.ck, "--tp", "2", "--set",
                                   "cache.dir=" + self.registry, "--ready-file", ready],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(1200):
                if os.path.exists(ready):
                    break
                time.sleep(0.05)
            lost = threading.Event()
            said = []
            rt = ferry.Runtime(self.config(**{"cache.mode": "client", "cache.watch_ms": 50}))
            model = rt.load(on_cache_lost=lambda why: (said.append(why), lost.set()))
            self.assertTrue(json.loads(model.report_json)["cache"]["attached"])
            daemon.kill()
            daemon.wait()
            self.assertTrue(lost.wait(10))
            self.assertIn("is gone", said[0])
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            if os.path.exists(ready):
                os.remove(ready)


class AttackCase(TinyCheckpointCase):
    """A tiny checkpoint of its own for each attack class."""

    PREFIX = "ferry-py-attack-"

    def runtime(self):
        return ferry.Runtime({"model.path": self.ck, "parallel.tp": 2})

    def held_load(self, gate):
        """A load that cannot end before `gate` is set: its first on_layer_ready waits
        there (60 s at most, so a failing test cannot hang), and the result is
        published only after the callbacks are done."""
        rt = self.runtime()
        reached = threading.Event()

        def hold(layer, rank):
            reached.set()
            gate.wait(60)

        h = rt.start(on_layer_ready=hold)
        self.assertTrue(reached.wait(60), "the load never reached its first layer")
        return rt, h


class AttackWaitDeadlines(AttackCase):
    """LoadHandle.wait(timeout): a timeout too large to count is no deadline (it
    returned None at once: int64(timeout * 1000) overflowed); NaN and negative
    timeouts are refused."""

    def test_a_huge_timeout_waits_for_the_load(self):
        for timeout in (float("inf"), 1e20, 1e10, 1e300, sys.float_info.max, 9.3e15, 9.2e15):
            with self.subTest(timeout=timeout):
                gate = threading.Event()
                rt, h = self.held_load(gate)
                opener = threading.Timer(0.5, gate.set)
                opener.start()
                began = time.monotonic()
                try:
                    model = h.wait(timeout)
                    waited = time.monotonic() - began
                finally:
                    opener.join()
                self.assertIsNotNone(model, f"wait({timeout!r}) returned None after {waited:.3f} s")
                self.assertGreaterEqual(waited, 0.4)
                self.assertTrue(h.done())
                self.assertGreater(len(model.params()), 0)

    def test_a_short_timeout_still_times_out(self):
        gate = threading.Event()
        rt, h = self.held_load(gate)
        try:
            self.assertIsNone(h.wait(0))
            began = time.monotonic()
            self.assertIsNone(h.wait(0.2))
            self.assertGreaterEqual(time.monotonic() - began, 0.15)
            self.assertIsNone(h.wait(1e-9))  # rounds up to a millisecond, still None
        finally:
            gate.set()
        self.assertIsNotNone(h.wait(60))

    def test_nan_and_negative_timeouts_are_refused(self):
        gate = threading.Event()
        rt, h = self.held_load(gate)
        try:
            for timeout in (float("nan"), -1.0, -1e-9, float("-inf"), -1e300):
                with self.subTest(timeout=timeout):
                    with self.assertRaises(ValueError) as e:
                        h.wait(timeout)
                    self.assertIn("timeout", str(e.exception))
                    self.assertFalse(h.done())
        finally:
            gate.set()
        self.assertIsNotNone(h.wait(None))
        with self.assertRaises(ValueError):  # refused on an ended load too
            h.wait(float("nan"))


class EngineRefused(Exception):
    pass


class AttackRaisingCallbacks(AttackCase):
    """A callback that raises: the ferry.Error names the callback and the Python
    exception's type and message, and chains the exception (__cause__), with its
    traceback, whichever layer raises and however the load was started."""

    def check(self, error, callback, cause_type, text, frame):
        self.assertEqual(error.stage, "cancelled")
        self.assertIn(callback, str(error))
        self.assertIn(f"{cause_type.__name__}", str(error))
        self.assertIn(text, str(error))
        self.assertNotIn("the load was cancelled", str(error))
        self.assertIsInstance(error.__cause__, cause_type)
        self.assertIn(text, str(error.__cause__))
        self.assertTrue(error.__suppress_context__)
        frames = [f.name for f in traceback.extract_tb(error.__cause__.__traceback__)]
        self.assertIn(frame, frames)

    def test_on_layer_ready_at_any_layer(self):
        for layer_to_fail in (0, 3):  # the first layer, and the last (the load is done)
            for way in ("load", "start", "wait_timeout", "prepare"):
                with self.subTest(layer=layer_to_fail, way=way):
                    def refuse(layer, rank):
                        if layer == layer_to_fail:
                            raise EngineRefused(f"engine refused layer {layer}")

                    rt = self.runtime()
                    kwargs = {"on_layer_ready": refuse, "on_progress": lambda p: True}
                    with self.assertRaises(ferry.Error) as e:
                        if way == "load":
                            rt.load(**kwargs)
                        elif way == "start":
                            rt.start(**kwargs).wait()
                        elif way == "wait_timeout":
                            self.assertIsNotNone(rt.start(**kwargs).wait(120))
                        else:
                            rt.prepare(**kwargs).wait()
                    self.check(e.exception, "on_layer_ready", EngineRefused,
                               f"engine refused layer {layer_to_fail}", "refuse")
                    # named with its module (__main__ when run as a script)
                    self.assertIn(f"{EngineRefused.__module__}.EngineRefused", str(e.exception))
                    self.assertEqual(rt.state, "failed")

    def test_on_progress(self):
        def boom(progress):
            raise ValueError("engine says no")

        rt = self.runtime()
        with self.assertRaises(ferry.Error) as e:
            rt.load(on_progress=boom)
        self.check(e.exception, "on_progress", ValueError, "engine says no", "boom")
        self.assertIn("ValueError: engine says no", str(e.exception))

    def test_repeated_and_next_load_carries_no_stale_cause(self):
        rt = self.runtime()
        for i in range(10):
            def boom(layer, rank, i=i):
                raise KeyError(f"round {i}")

            with self.assertRaises(ferry.Error) as e:
                rt.load(on_layer_ready=boom)
            self.check(e.exception, "on_layer_ready", KeyError, f"round {i}", "boom")
        with self.assertRaises(ferry.Error) as e:
            rt.load(on_progress=lambda p: False)  # a cancel, not a raise: nothing to chain
        self.assertEqual(e.exception.stage, "cancelled")
        self.assertIsNone(e.exception.__cause__)
        self.assertGreater(len(rt.load(on_layer_ready=lambda layer, rank: None).params()), 0)

    def test_an_exception_whose_str_raises(self):
        class Mute(Exception):
            def __str__(self):
                raise RuntimeError("no words")

        def mute(layer, rank):
            raise Mute()

        with self.assertRaises(ferry.Error) as e:
            self.runtime().load(on_layer_ready=mute)
        self.assertEqual(e.exception.stage, "cancelled")
        self.assertIn("Mute", str(e.exception))
        self.assertIsInstance(e.exception.__cause__, Mute)


if __name__ == "__main__":
    FERRY_CLI = sys.argv.pop(1)
    unittest.main(verbosity=2)
