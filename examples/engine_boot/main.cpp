// engine_boot: a stand-in inference engine that boots on ferry the capture-safe way.
//
//   1. prepare(): ferry hands over every parameter, filled with the sentinel, in
//      storage that will not move.
//   2. "Graph capture": record each layer's parameter pointers once, as a CUDA
//      graph would, and run a tiny forward pass through them: one matrix-vector
//      product per decoder layer with its o_proj weight, on the host.
//   3. commit(): ferry streams the real weights into the same storage; replay the
//      captured forward pass through the recorded pointers.
//   4. Check that no pointer moved and that the replay's output equals a forward
//      pass over a plain serial load() of the same checkpoint.
//
// With the weight cache (cache.mode=daemon or client, a `ferry serve` of the same
// model running), prepare() attaches to the daemon: the parameters are views of its
// memory, complete at once, and commit() only verifies. The engine then says what
// it does when that daemon dies (LoadCallbacks::on_cache_lost): here, it reports
// and exits, since its captured pointers would dangle on a GPU.
//
// It uses only ferry's installed headers (<ferry/ferry.hpp>) and libferry.so, and
// the host device, so it runs anywhere. Usage:
//   engine_boot CHECKPOINT_DIR [--mode serial|overlap|auto] [key=value ...]
// Exits 0 when every check holds, 1 when one fails, 2 for bad arguments.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ferry/ferry.hpp>
#include <map>
#include <string>
#include <vector>

namespace {

using ferry::runtime::LoadResult;
using ferry::runtime::ParamView;

// What the "capture" recorded for one layer: the pointer and the shape it will
// read on every replay, never asked again.
struct CapturedLayer {
  std::string name;
  const std::byte* data = nullptr;
  ferry::DType dtype = ferry::DType::kBF16;
  std::uint64_t rows = 0, cols = 0, row_stride = 0, col_stride = 0;
};

float element(const CapturedLayer& l, std::uint64_t i, std::uint64_t j) {
  const std::uint64_t index = i * l.row_stride + j * l.col_stride;
  switch (l.dtype) {
    case ferry::DType::kBF16: {
      std::uint16_t bits;
      std::memcpy(&bits, l.data + index * 2, 2);
      const std::uint32_t f32 = static_cast<std::uint32_t>(bits) << 16;
      float f;
      std::memcpy(&f, &f32, 4);
      return f;
    }
    case ferry::DType::kF32: {
      float f;
      std::memcpy(&f, l.data + index * 4, 4);
      return f;
    }
    default:
      return NAN;  // the capture refuses other dtypes
  }
}

// "model.layers.<i>.self_attn.o_proj.weight" of every layer, in layer order.
std::vector<CapturedLayer> capture(const std::vector<ParamView>& views, std::string& error) {
  std::map<std::uint64_t, CapturedLayer> layers;
  for (const ParamView& v : views) {
    const std::string prefix = "model.layers.";
    const std::string suffix = ".self_attn.o_proj.weight";
    if (v.tp_rank != 0 || v.name.rfind(prefix, 0) != 0 || v.name.size() <= suffix.size() ||
        v.name.compare(v.name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    if (v.device.rfind("host:", 0) != 0 || v.shape.size() != 2 ||
        (v.dtype != ferry::DType::kBF16 && v.dtype != ferry::DType::kF32)) {
      error = v.name + ": the stand-in engine runs 2-D BF16/F32 weights on host devices only";
      return {};
    }
    const std::uint64_t layer =
        std::stoull(v.name.substr(prefix.size(), v.name.size() - prefix.size() - suffix.size()));
    layers[layer] =
        CapturedLayer{v.name, v.data, v.dtype, v.shape[0], v.shape[1], v.strides[0], v.strides[1]};
  }
  std::vector<CapturedLayer> out;
  for (auto& [layer, l] : layers) {
    out.push_back(l);
  }
  if (out.empty()) {
    error = "no model.layers.<i>.self_attn.o_proj.weight to run";
  }
  return out;
}

// x <- normalize(W x) per layer, starting from x = 1.
std::vector<float> forward(const std::vector<CapturedLayer>& layers) {
  std::vector<float> x(layers.front().cols, 1.0f);
  for (const CapturedLayer& l : layers) {
    std::vector<float> y(l.rows, 0.0f);
    for (std::uint64_t i = 0; i < l.rows; ++i) {
      for (std::uint64_t j = 0; j < l.cols && j < x.size(); ++j) {
        y[i] += element(l, i, j) * x[j];
      }
    }
    float scale = 0;
    for (float v : y) {
      scale = std::max(scale, std::fabs(v));
    }
    for (float& v : y) {
      v = scale > 0 ? v / scale : v;
    }
    x = std::move(y);
  }
  return x;
}

int fail(const std::string& what) {
  std::fprintf(stderr, "engine_boot: FAILED: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: engine_boot CHECKPOINT_DIR [--mode M] [key=value ...]\n");
    return 2;
  }
  std::string mode = "overlap";
  std::vector<std::string> sets = {std::string("model.path=") + argv[1]};
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--mode" && i + 1 < argc) {
      mode = argv[++i];
    } else {
      sets.push_back(arg);
    }
  }
  ferry::runtime::Config serial_config;
  ferry::runtime::Config config;
  try {
    for (const std::string& s : sets) {
      serial_config.set(s);
    }
    config = serial_config;
    config.set("startup.mode", mode);
  } catch (const ferry::Error& e) {  // a bad key or value, naming it
    std::fprintf(stderr, "engine_boot: %s\n", e.what());
    return 2;
  }

  // 1. prepare
  ferry::runtime::Runtime rt(config);
  ferry::runtime::LoadCallbacks callbacks;
  callbacks.on_cache_lost = [](const std::string& why) {
    std::fprintf(stderr, "engine_boot: %s; exiting\n", why.c_str());
    std::fflush(stderr);
    std::_Exit(3);
  };
  LoadResult prepared = rt.prepare(callbacks).wait();
  if (!prepared) {
    return fail("prepare(): " + prepared.error->message);
  }
  const std::vector<ParamView> before = prepared.model->views();

  // 2. the stand-in capture, against the sentinel weights
  std::string error;
  const std::vector<CapturedLayer> graph = capture(before, error);
  if (graph.empty()) {
    return fail(error);
  }
  const std::vector<float> on_sentinel = forward(graph);

  // 3. commit, then replay the captured pass
  LoadResult ready = rt.commit().wait();
  if (!ready) {
    return fail("commit(): " + ready.error->message);
  }
  const std::vector<float> replayed = forward(graph);

  // 4. nothing moved; the replay equals a plain serial load's pass
  const std::vector<ParamView> after = ready.model->views();
  if (after.size() != before.size()) {
    return fail("the parameter list changed size");
  }
  std::size_t moved = 0;
  for (std::size_t i = 0; i < before.size(); ++i) {
    moved += after[i].data != before[i].data || after[i].name != before[i].name ? 1 : 0;
  }
  if (moved != 0) {
    return fail(std::to_string(moved) + " parameter(s) moved between prepare() and commit()");
  }
  ferry::runtime::Runtime plain(serial_config);
  LoadResult loaded = plain.load();
  if (!loaded) {
    return fail("load(): " + loaded.error->message);
  }
  const std::vector<CapturedLayer> fresh = capture(loaded.model->views(), error);
  if (fresh.size() != graph.size()) {
    return fail("the serial load has " + std::to_string(fresh.size()) + " layers, not " +
                std::to_string(graph.size()));
  }
  const std::vector<float> expected = forward(fresh);
  if (replayed != expected) {
    return fail("the replayed forward pass differs from the one over a serial load");
  }
  const ferry::runtime::LoadReport& report = ready.model->report();
  // In overlap mode the capture saw only the sentinel (serial prepare() loads fully).
  if (report.startup_mode == "overlap" && replayed == on_sentinel) {
    return fail("the forward pass over the real weights equals the one over the sentinel");
  }
  if (report.cache.attached) {
    std::printf("engine_boot: weight cache: attached to daemon pid %d (%s), %llu bytes mapped\n",
                report.cache.daemon_pid, report.cache.socket.c_str(),
                static_cast<unsigned long long>(report.cache.bytes_mapped));
  }
  std::printf(
      "engine_boot: ok: %s startup, %zu parameters, none moved; %zu layers replayed, output "
      "equals a serial load's (first %.6f); ready %.3f s after prepare()\n",
      report.startup_mode.c_str(), after.size(), graph.size(), static_cast<double>(replayed[0]),
      report.startup.time_to_ready);
  return 0;
}
