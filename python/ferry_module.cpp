// The Python module `ferry` (pybind11) over libferry.so's public API: Config,
// Runtime (load, start, prepare, commit, cancel), LoadHandle (wait, cancel,
// progress, done), the progress and layer callbacks, and loaded parameters that
// frameworks take through DLPack (`numpy.from_dlpack`, `torch.from_dlpack`).
//
// Threads: wait() releases the GIL while it blocks; the callbacks run on a ferry
// thread and take the GIL to call Python. An exception a callback raises fails the
// load (as any callback's throw does, Stage::kCancelled naming it, with the Python
// exception's type and message), and the ferry.Error raised for it has the Python
// exception as its `__cause__`. ferry's errors reach Python as ferry.Error with
// `stage`, `file`, `tensor` and `rule`. wait(timeout) refuses NaN and negative
// timeouts (ValueError); infinity and timeouts too large to count mean no deadline.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <ferry/ferry.hpp>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;
using namespace ferry::runtime;  // NOLINT(google-build-using-namespace): the module's own TU

namespace {

PyObject* g_error_type = nullptr;  // ferry.Error, made once at import

// Raises ferry.Error carrying the parts of an error; `cause` (an exception a
// callback raised), when set, becomes its __cause__, as `raise ... from cause` does.
[[noreturn]] void raise_error(ferry::Stage stage, const std::string& file,
                              const std::string& tensor, const std::string& rule,
                              const std::string& message, const py::object& cause = py::object()) {
  py::object type = py::reinterpret_borrow<py::object>(g_error_type);
  py::object e = type(message);
  e.attr("stage") = std::string(ferry::to_string(stage));
  e.attr("file") = file;
  e.attr("tensor") = tensor;
  e.attr("rule") = rule;
  if (cause) {
    PyException_SetCause(e.ptr(), cause.inc_ref().ptr());  // steals; sets __suppress_context__
  }
  PyErr_SetObject(g_error_type, e.ptr());
  throw py::error_already_set();
}

// The first exception a load's Python callbacks raised (null until one does), kept
// for the ferry.Error of that load. Touched only with the GIL held: the callback
// thread writes it, and the load's result (after which it is read) is published
// only once that thread has been joined.
struct CallbackFailure {
  py::object exception;
};
using Failure = std::shared_ptr<CallbackFailure>;

Failure make_failure() {
  // Dropped on whichever thread releases the last copy: take the GIL for it.
  return Failure(new CallbackFailure(), [](CallbackFailure* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// "ValueError: engine says no" (a class outside builtins with its module) for the
// C++ error's message; the traceback stays on the exception itself (`__cause__`).
std::string describe(const py::error_already_set& e) {
  std::string type = "exception";
  std::string text;
  try {
    const py::object t = e.type();
    type = py::str(t.attr("__qualname__")).cast<std::string>();
    const std::string module = py::str(t.attr("__module__")).cast<std::string>();
    if (module != "builtins") {
      type = module + "." + type;
    }
    text = py::str(e.value()).cast<std::string>();
  } catch (const py::error_already_set&) {
    text = "(its str() raised too)";  // a __str__ that raises must not hide the first one
  } catch (const py::cast_error&) {
    text = "(its str() is not text)";
  }
  return text.empty() ? type : type + ": " + text;
}

// `seconds` as LoadHandle::wait_for takes it: NaN and negative values are refused;
// infinity and anything past what a count of milliseconds holds mean no deadline
// (nullopt); a part of a millisecond rounds up, so that a positive timeout waits.
std::optional<std::chrono::milliseconds> wait_timeout(double seconds) {
  if (std::isnan(seconds) || seconds < 0) {
    throw py::value_error(
        "LoadHandle.wait: timeout must be a number of seconds >= 0, "
        "infinity or None, got " +
        py::repr(py::float_(seconds)).cast<std::string>());
  }
  const double ms = std::ceil(seconds * 1000.0);
  if (!(ms < 9223372036854775808.0)) {  // 2^63: the first double an int64 cannot hold
    return std::nullopt;
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(ms));
}

// A parameter or derived buffer, as a framework takes it.
struct Param {
  ParamView view;

  std::string dtype() const { return std::string(ferry::dtype_name(view.dtype)); }
  // The device as to_dlpack maps it (a null device is refused there, named).
  std::pair<int, int> dlpack_device() const {
    DLManagedTensor* t = to_dlpack(view);
    const DLDevice d = t->dl_tensor.device;
    t->deleter(t);
    return {d.device_type, d.device_id};
  }
  // The DLPack 0.6 protocol: a capsule named "dltensor" that the consumer renames
  // "used_dltensor" once it owns the tensor; one never consumed is deleted here.
  // ferry's tensors are ready when the load returned, so `stream` needs no wait.
  py::capsule dlpack(const py::kwargs& /*stream, max_version, dl_device, copy*/) const {
    DLManagedTensor* t = to_dlpack(view);  // ferry::Error -> ferry.Error (the translator)
    return py::capsule(t, "dltensor", [](PyObject* capsule) {
      if (PyCapsule_IsValid(capsule, "dltensor")) {
        auto* owned = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
        if (owned != nullptr && owned->deleter != nullptr) {
          owned->deleter(owned);
        }
      }
    });
  }
};

// A loaded (or prepared) model.
struct Model {
  std::shared_ptr<LoadedModel> model;

  std::vector<Param> params() const {
    std::vector<Param> out;
    for (ParamView& v : model->views()) {
      out.push_back(Param{std::move(v)});
    }
    return out;
  }
  Param param(const std::string& name, int tp_rank) const {
    for (ParamView& v : model->views()) {
      if (v.name == name && v.tp_rank == tp_rank) {
        return Param{std::move(v)};
      }
    }
    throw ferry::Error(ferry::Stage::kConfig, "", name,
                       "no such parameter on tp rank " + std::to_string(tp_rank));
  }
  py::bytes read_param(const std::string& name, int tp_rank) const {
    const auto& ranks = model->ranks();
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i].tp_rank == tp_rank) {
        const std::vector<std::byte> bytes = model->read_param(i, name);
        return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
      }
    }
    throw ferry::Error(ferry::Stage::kConfig, "", name,
                       "no local tp rank " + std::to_string(tp_rank));
  }
};

// The model, or ferry.Error (chained to what a callback of the load raised, if one did).
Model result_or_raise(const LoadResult& r, const Failure& failure = nullptr) {
  if (!r) {
    const ErrorInfo& e = *r.error;
    raise_error(e.stage, e.file, e.tensor, e.rule, e.message,
                failure ? failure->exception : py::object());
  }
  return Model{r.model};
}

// A LoadHandle as Python holds it: the load, and what its callbacks raised.
struct PyLoadHandle {
  LoadHandle handle;
  Failure failure;
};

// The callbacks as ferry calls them: on a ferry thread, taking the GIL; what
// Python raises is kept in `failure` (the first only: ferry calls no callback
// after one has failed) and becomes a C++ exception naming its type and message,
// which fails the load naming the callback.
LoadCallbacks callbacks(std::optional<py::function> on_progress,
                        std::optional<py::function> on_layer_ready, const Failure& failure,
                        std::optional<py::function> on_cache_lost = std::nullopt) {
  LoadCallbacks cb;
  // Keeps the exception (normalized by pybind11, its traceback on it) and returns
  // the C++ exception that fails the load.
  auto fail = [failure](const py::error_already_set& e) {
    if (!failure->exception && e.value()) {
      if (e.trace()) {
        PyException_SetTraceback(e.value().ptr(), e.trace().ptr());
      }
      failure->exception = e.value();
    }
    return std::runtime_error(describe(e));
  };
  auto hold = [](py::function f) {
    // Destroyed on whichever thread drops the last copy: take the GIL for it.
    return std::shared_ptr<py::function>(new py::function(std::move(f)), [](py::function* p) {
      py::gil_scoped_acquire gil;
      delete p;
    });
  };
  if (on_progress) {
    auto f = hold(std::move(*on_progress));
    cb.on_progress = [f, fail](const LoadProgress& p) {
      py::gil_scoped_acquire gil;
      try {
        py::object r = (*f)(p);
        return r.is_none() || r.cast<bool>();
      } catch (const py::error_already_set& e) {
        throw fail(e);
      }
    };
  }
  if (on_layer_ready) {
    auto f = hold(std::move(*on_layer_ready));
    cb.on_layer_ready = [f, fail](std::uint64_t layer, int tp_rank) {
      py::gil_scoped_acquire gil;
      try {
        (*f)(layer, tp_rank);
      } catch (const py::error_already_set& e) {
        throw fail(e);
      }
    };
  }
  if (on_cache_lost) {
    // Called once from the model's watchdog thread, after the load: nothing to fail
    // then, so what it raises is printed (sys.unraisablehook) and dropped.
    auto f = hold(std::move(*on_cache_lost));
    cb.on_cache_lost = [f](const std::string& why) {
      py::gil_scoped_acquire gil;
      try {
        (*f)(why);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("ferry on_cache_lost");
      }
    };
  }
  return cb;
}

// Config from a ferry.Config, a dict of key -> value, or None.
Config to_config(const py::object& o) {
  if (o.is_none()) {
    return Config();
  }
  if (py::isinstance<Config>(o)) {
    return o.cast<Config>();
  }
  if (py::isinstance<py::dict>(o)) {
    Config c;
    for (auto [k, v] : o.cast<py::dict>()) {
      std::string value;
      if (py::isinstance<py::bool_>(v)) {
        value = v.cast<bool>() ? "true" : "false";
      } else {
        value = py::str(v);
      }
      c.set(py::str(k).cast<std::string>(), value);
    }
    return c;
  }
  throw py::type_error("a ferry.Config, a dict of configuration keys, or None");
}

// A Runtime as Python holds it: its destructor cancels and waits for a running
// load, whose callbacks need the GIL, so it gives the GIL up while it waits.
struct PyRuntime {
  std::unique_ptr<Runtime> rt;
  explicit PyRuntime(Config config) : rt(std::make_unique<Runtime>(std::move(config))) {}
  PyRuntime(const PyRuntime&) = delete;
  PyRuntime& operator=(const PyRuntime&) = delete;
  ~PyRuntime() {
    py::gil_scoped_release nogil;
    rt.reset();
  }
};

}  // namespace

PYBIND11_MODULE(_ferry, m) {
  m.doc() = "ferry: load model checkpoints into sharded, kernel-ready parameters";
  m.attr("__version__") = std::string(ferry::version());
  g_error_type = PyErr_NewException("ferry.Error", PyExc_RuntimeError, nullptr);
  m.attr("Error") = py::handle(g_error_type);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const ferry::Error& e) {
      try {
        raise_error(e.stage(), e.file(), e.tensor(), e.rule(), e.what());
      } catch (py::error_already_set& set) {
        set.restore();
      }
    }
  });

  py::class_<Config>(m, "Config")
      .def(py::init<>())
      .def("set", py::overload_cast<std::string_view>(&Config::set), py::arg("assignment"),
           py::return_value_policy::reference_internal)
      .def("set", py::overload_cast<std::string_view, std::string_view>(&Config::set),
           py::arg("key"), py::arg("value"), py::return_value_policy::reference_internal)
      .def("json", &Config::json, py::arg("text"), py::arg("source") = "json",
           py::return_value_policy::reference_internal)
      .def("file", &Config::file, py::arg("path"), py::return_value_policy::reference_internal)
      .def("environment", &Config::environment, py::return_value_policy::reference_internal)
      .def("to_json", &Config::to_json, py::arg("indent") = 2)
      .def("__eq__", &Config::operator==);

  py::class_<LoadProgress>(m, "LoadProgress")
      .def_property_readonly("phase",
                             [](const LoadProgress& p) { return std::string(to_string(p.phase)); })
      .def_readonly("bytes_planned", &LoadProgress::bytes_planned)
      .def_readonly("bytes_read", &LoadProgress::bytes_read)
      .def_readonly("bytes_copied", &LoadProgress::bytes_copied)
      .def_readonly("tensors_placed", &LoadProgress::tensors_placed);

  py::class_<Param>(m, "Param")
      .def_property_readonly("name", [](const Param& p) { return p.view.name; })
      .def_property_readonly("device", [](const Param& p) { return p.view.device; })
      .def_property_readonly("tp_rank", [](const Param& p) { return p.view.tp_rank; })
      .def_property_readonly("dtype", &Param::dtype)
      .def_property_readonly("shape", [](const Param& p) { return p.view.shape; })
      .def_property_readonly("strides", [](const Param& p) { return p.view.strides; })
      .def_property_readonly(
          "data_ptr", [](const Param& p) { return reinterpret_cast<std::uintptr_t>(p.view.data); })
      .def("__dlpack__", &Param::dlpack)
      .def("__dlpack_device__", &Param::dlpack_device)
      .def("__repr__", [](const Param& p) {
        return "<ferry.Param " + p.view.name + " " + p.dtype() + " on " + p.view.device + ">";
      });

  py::class_<Model>(m, "Model")
      .def("params", &Model::params, "every parameter and derived buffer, by rank then name")
      .def("param", &Model::param, py::arg("name"), py::arg("tp_rank") = 0)
      .def("read_param", &Model::read_param, py::arg("name"), py::arg("tp_rank") = 0,
           "the parameter's storage copied to host memory, as bytes")
      .def(
          "dump", [](const Model& mo, const std::string& dir) { mo.model->dump(dir); },
          py::arg("dir"))
      .def_property_readonly("tp_ranks",
                             [](const Model& mo) {
                               std::vector<int> out;
                               for (const LoadedRank& r : mo.model->ranks()) {
                                 out.push_back(r.tp_rank);
                               }
                               return out;
                             })
      .def_property_readonly("report_json",
                             [](const Model& mo) { return mo.model->report().json(-1); })
      .def_property_readonly(
          "valid", [](const Model& mo) { return mo.model->valid(); },
          "False once an update failed and could not be undone")
      .def_property_readonly("invalid_reason",
                             [](const Model& mo) { return mo.model->invalid_reason(); });

  py::class_<PyLoadHandle>(m, "LoadHandle")
      .def(
          "wait",
          [](const PyLoadHandle& h, std::optional<double> timeout) -> py::object {
            // Checked before the wait: a bad timeout is refused even on a running load.
            const std::optional<std::chrono::milliseconds> deadline =
                timeout ? wait_timeout(*timeout) : std::nullopt;
            std::optional<LoadResult> r;
            {
              py::gil_scoped_release nogil;
              r = deadline ? h.handle.wait_for(*deadline) : h.handle.wait();
            }
            if (!r) {
              return py::none();
            }
            return py::cast(result_or_raise(*r, h.failure));
          },
          py::arg("timeout") = py::none(),
          "the model when the load ends (None when `timeout` seconds pass first; None or "
          "infinity: no deadline; NaN or negative: ValueError); raises ferry.Error")
      .def("cancel", [](const PyLoadHandle& h) { h.handle.cancel(); })
      .def("progress", [](const PyLoadHandle& h) { return h.handle.progress(); })
      .def("done", [](const PyLoadHandle& h) { return h.handle.done(); });

  using Start = LoadHandle (Runtime::*)(LoadCallbacks);
  auto starter = [](Start f) {
    return
        [f](PyRuntime& p, std::optional<py::function> on_progress,
            std::optional<py::function> on_layer_ready, std::optional<py::function> on_cache_lost) {
          Failure failure = make_failure();
          LoadCallbacks cb = callbacks(std::move(on_progress), std::move(on_layer_ready), failure,
                                       std::move(on_cache_lost));
          // start() joins the previous load's thread, which may wait for the GIL to
          // drop its callbacks: give the GIL up for the call.
          py::gil_scoped_release nogil;
          return PyLoadHandle{((*p.rt).*f)(std::move(cb)), std::move(failure)};
        };
  };
  py::class_<PyRuntime>(m, "Runtime")
      .def(py::init([](const py::object& config) {
             return std::make_unique<PyRuntime>(to_config(config));
           }),
           py::arg("config") = py::none())
      .def("start", starter(&Runtime::start), py::arg("on_progress") = py::none(),
           py::arg("on_layer_ready") = py::none(), py::arg("on_cache_lost") = py::none())
      .def("prepare", starter(&Runtime::prepare), py::arg("on_progress") = py::none(),
           py::arg("on_layer_ready") = py::none(), py::arg("on_cache_lost") = py::none())
      .def("commit", starter(&Runtime::commit), py::arg("on_progress") = py::none(),
           py::arg("on_layer_ready") = py::none(), py::arg("on_cache_lost") = py::none())
      .def(
          "load",
          [](PyRuntime& p, std::optional<py::function> on_progress,
             std::optional<py::function> on_layer_ready,
             std::optional<py::function> on_cache_lost) {
            Failure failure = make_failure();
            LoadCallbacks cb = callbacks(std::move(on_progress), std::move(on_layer_ready), failure,
                                         std::move(on_cache_lost));
            LoadResult r;
            {
              py::gil_scoped_release nogil;
              r = p.rt->start(std::move(cb)).wait();
            }
            return result_or_raise(r, failure);
          },
          py::arg("on_progress") = py::none(), py::arg("on_layer_ready") = py::none(),
          py::arg("on_cache_lost") = py::none(),
          "loads (or, with cache.mode, attaches to a `ferry serve` daemon); on_cache_lost(why) "
          "is called if that daemon dies while the model lives (default: abort)")
      .def(
          "update",
          [](PyRuntime& p, const py::object& source, std::optional<std::vector<std::string>> names,
             std::string load_format) {
            UpdateSource s;
            s.load_format = std::move(load_format);
            std::vector<py::object> capsules;  // keep the tensors' bytes alive for the call
            if (py::isinstance<py::dict>(source)) {
              for (auto [k, v] : source.cast<py::dict>()) {
                const std::string name = py::str(k);
                py::object tensor = py::reinterpret_borrow<py::object>(v);
                std::optional<ferry::DType> dtype;
                if (py::isinstance<py::tuple>(v)) {
                  py::tuple pair = v.cast<py::tuple>();
                  if (pair.size() != 2) {
                    throw py::value_error("update: '" + name +
                                          "': a tensor, or (tensor, checkpoint dtype name)");
                  }
                  tensor = pair[0];
                  const std::string dtype_text = py::str(pair[1]);
                  dtype = ferry::parse_dtype(dtype_text);
                  if (!dtype) {
                    throw py::value_error("update: '" + name + "': unknown dtype '" + dtype_text +
                                          "' (a safetensors name such as F8_E4M3)");
                  }
                }
                if (!py::hasattr(tensor, "__dlpack__")) {
                  throw py::type_error("update: '" + name +
                                       "' is not a DLPack tensor (torch or numpy)");
                }
                py::object capsule = tensor.attr("__dlpack__")();
                auto* managed =
                    static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
                if (managed == nullptr) {
                  throw py::error_already_set();
                }
                capsules.push_back(std::move(capsule));
                s.tensors.push_back(update_tensor(name, managed->dl_tensor, dtype));
              }
            } else {
              s.folder = py::str(py::module_::import("os").attr("fspath")(source));
            }
            if (names) {
              s.names = std::move(*names);
            }
            LoadResult r;
            {
              py::gil_scoped_release nogil;
              r = p.rt->update(std::move(s));
            }
            return result_or_raise(r, make_failure());
          },
          py::arg("source"), py::arg("names") = py::none(), py::arg("load_format") = "",
          "writes new weights into the loaded model in place, from a checkpoint folder or a "
          "dict of name -> tensor (DLPack; FP8 as (uint8 tensor, 'F8_E4M3')); `names`: shell "
          "globs of the tensors to use. Returns the same model; raises ferry.Error")
      .def(
          "cancel", [](PyRuntime& p) { p.rt->cancel(); }, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "state", [](const PyRuntime& p) { return std::string(to_string(p.rt->state())); });

  // `ferry serve` in Python: the constructor loads and registers (GIL released),
  // serve() blocks until stop() (from another thread, or a signal handler's).
  py::class_<ferry::runtime::CacheDaemon>(m, "CacheDaemon")
      .def(py::init([](const py::object& config) {
             Config c = to_config(config);
             py::gil_scoped_release nogil;
             return std::make_unique<ferry::runtime::CacheDaemon>(std::move(c));
           }),
           py::arg("config") = py::none())
      .def("serve", &ferry::runtime::CacheDaemon::serve, py::call_guard<py::gil_scoped_release>())
      .def("stop", &ferry::runtime::CacheDaemon::stop)
      .def_property_readonly("socket", &ferry::runtime::CacheDaemon::socket)
      .def_property_readonly("registration", &ferry::runtime::CacheDaemon::registration)
      .def_property_readonly("fingerprint", &ferry::runtime::CacheDaemon::fingerprint)
      .def_property_readonly("remote_address", &ferry::runtime::CacheDaemon::remote_address)
      .def_property_readonly("model",
                             [](const ferry::runtime::CacheDaemon& d) {
                               return Model{std::const_pointer_cast<LoadedModel>(d.model())};
                             })
      .def("stats", [](const ferry::runtime::CacheDaemon& d) {
        const ferry::runtime::CacheDaemon::Stats s = d.stats();
        py::dict out;
        out["clients_served"] = s.clients_served;
        out["bytes_shared"] = s.bytes_shared;
        out["connections"] = s.connections;
        out["refused"] = s.refused;
        out["uptime_seconds"] = s.uptime_seconds;
        out["remote_served"] = s.remote_served;
        out["remote_refused"] = s.remote_refused;
        return out;
      });
}
