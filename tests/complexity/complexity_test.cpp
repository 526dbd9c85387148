// Complexity, pinned by counting work, not by timing it: parsing and planning 10x
// more tensors must cost well under 100x the work (near-linear work costs about
// 10x; the bound allows a log factor and fixed costs, and fails anything
// quadratic). This executable replaces the global operator new to count heap
// allocations, the one count every layer (nlohmann's documents, ferry's own
// vectors and strings, the plan's routes) cannot avoid; the plan also counts the
// (piece, window) pairs it clips and the windows it cuts. A loop that does
// quadratic work without allocating is not seen by these counts; the 1,000,000-entry
// header and index in tests/io/json_scale_test.cpp, which must parse within 60 s,
// are the backstop for those.
//
// The names are realistic and longer than the small-string buffer, so every name
// a parser keeps is an allocation and the counts follow the entries.
#include <gtest/gtest.h>
#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "actors/plan.hpp"
#include "io/discover.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_internal.hpp"
#include "models/model.hpp"
#include "synth/synth.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace {
std::atomic<std::uint64_t> g_allocations{0};
// Heap bytes live through operator new (the allocator's usable sizes), and the most
// they have been since reset_peak(): the memory a parse holds at its worst,
// independent of the allocator's arenas and of timing.
std::atomic<std::int64_t> g_live_bytes{0};
std::atomic<std::int64_t> g_peak_bytes{0};

void note_alloc(void* p) {
  const auto n = static_cast<std::int64_t>(malloc_usable_size(p));
  const std::int64_t live = g_live_bytes.fetch_add(n, std::memory_order_relaxed) + n;
  std::int64_t peak = g_peak_bytes.load(std::memory_order_relaxed);
  while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live)) {
  }
}
void release(void* p) {
  if (p != nullptr) {
    g_live_bytes.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(p)),
                           std::memory_order_relaxed);
  }
  std::free(p);
}

void* counted(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) {
    note_alloc(p);
    return p;
  }
  throw std::bad_alloc();
}
void* counted_aligned(std::size_t n, std::align_val_t a) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t al = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) {
    note_alloc(p);
    return p;
  }
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) { return counted(n); }
void* operator new[](std::size_t n) { return counted(n); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_aligned(n, a); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_aligned(n, a); }
// The nothrow forms too (std::stable_sort's temporary buffer uses them): every
// allocation is counted, and every pointer a delete frees came from malloc.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept {
  return operator new(n, t);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  release(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  release(p);
}
void operator delete(void* p) noexcept { release(p); }
void operator delete[](void* p) noexcept { release(p); }
void operator delete(void* p, std::size_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t) noexcept { release(p); }
void operator delete(void* p, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { release(p); }

namespace ferry {
namespace {

// Allocations made while `body` runs.
std::uint64_t allocations(const std::function<void()>& body) {
  const std::uint64_t before = g_allocations.load();
  body();
  return g_allocations.load() - before;
}

// The work grows at most `bound` times when the input grows `factor` times.
void expect_near_linear(const char* what, double small, double large, double factor) {
  SCOPED_TRACE(what);
  ASSERT_GT(small, 0) << "nothing was counted";
  const double ratio = large / small;
  std::printf("%s: %.0f -> %.0f (%.2fx for %.2fx the input)\n", what, small, large, ratio, factor);
  // At least linear (the count really follows the input), at most 1.5x linear:
  // 10x more entries may cost up to 15x, never the 100x of a quadratic.
  EXPECT_GE(ratio, 0.5 * factor) << small << " -> " << large;
  EXPECT_LE(ratio, 1.5 * factor) << small << " -> " << large;
}

TEST(CountedWork, TheCounterSeesAllocations) {
  std::uint64_t n = allocations([] {
    std::vector<std::string> v;
    for (int i = 0; i < 100; ++i) {
      v.push_back(std::string(64, 'x'));
    }
  });
  EXPECT_GE(n, 100u);
}

// A safetensors header of `n` BF16 tensors with expert-style names, in one of the
// spellings io/safetensors_internal.hpp reads by three paths: plain (the byte
// scanner), every name starting with the escape \u006d for 'm' (the SAX pass), or
// an unknown field in the first entry (the SAX pass skips it; the document path is
// called directly, as only an invalid header reaches it otherwise).
enum class Spelling { kPlain, kEscaped, kUnknownField };
std::string header(std::uint64_t n, Spelling spelling, std::uint64_t* data_bytes,
                   bool extra_in_every_entry = false) {
  const std::string extra = spelling == Spelling::kUnknownField ? ",\"unknown\":1" : "";
  const std::string m = spelling == Spelling::kEscaped ? "\\u006d" : "m";
  std::string text = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::uint64_t offset = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    text += ",\"" + m + "odel.layers." + std::to_string(i / 384) + ".mlp.experts." +
            std::to_string(i % 384) + ".down_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[2,4]," +
            "\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + 16) +
            "]" + (i == 0 || extra_in_every_entry ? extra : "") + "}";
    offset += 16;
  }
  *data_bytes = offset;
  return text + "}";
}

std::uint64_t parse_work(std::uint64_t n, Spelling spelling, bool document = false) {
  std::uint64_t data = 0;
  const std::string text = header(n, spelling, &data);
  std::size_t tensors = 0;
  const std::uint64_t work = allocations([&] {
    io::SafetensorsHeader h =
        document ? io::detail::parse_header_document(text, 8 + text.size() + data,
                                                     "counted.safetensors")
                 : io::parse_safetensors_header(text, 8 + text.size() + data,
                                                "counted.safetensors");
    tensors = h.tensors.size();
  });
  EXPECT_EQ(tensors, n);
  return work;
}

TEST(CountedWork, HeaderParsingOnEveryPath) {
  expect_near_linear("plain scanner", parse_work(10'000, Spelling::kPlain),
                     parse_work(100'000, Spelling::kPlain), 10);
  expect_near_linear("SAX pass", parse_work(10'000, Spelling::kEscaped),
                     parse_work(100'000, Spelling::kEscaped), 10);
  expect_near_linear("SAX pass, an unknown field", parse_work(10'000, Spelling::kUnknownField),
                     parse_work(100'000, Spelling::kUnknownField), 10);
  // The document path: nlohmann's DOM and the duplicate-key count over it.
  expect_near_linear("document path", parse_work(10'000, Spelling::kUnknownField, true),
                     parse_work(100'000, Spelling::kUnknownField, true), 10);
}

// The most heap a header's parse holds at once, per entry, beyond its text: the
// compact records, the names and the TensorInfo list made of them (issue 31, item
// 13). Every entry carries an unknown field, which sent the header through
// nlohmann's document before (1,088 bytes an entry, measured by calling the
// document path here); it costs 383 now, every spelling alike (the TensorInfo
// list, 250, made while the compact records, 130, are still held).
TEST(CountedWork, AHeaderParseHoldsUnder512BytesAnEntryAtItsPeak) {
  constexpr std::uint64_t kEntries = 100'000;
  for (Spelling spelling : {Spelling::kPlain, Spelling::kEscaped, Spelling::kUnknownField}) {
    std::uint64_t data = 0;
    const std::string text = header(kEntries, spelling, &data, /*extra_in_every_entry=*/true);
    const std::int64_t base = g_live_bytes.load();
    g_peak_bytes.store(base);
    std::size_t tensors = 0;
    {
      io::SafetensorsHeader h =
          io::parse_safetensors_header(text, 8 + text.size() + data, "counted.safetensors");
      tensors = h.tensors.size();
    }
    const double per_entry = static_cast<double>(g_peak_bytes.load() - base) / kEntries;
    std::printf("header parse, spelling %d: peak %.0f heap bytes an entry (%.0f of text)\n",
                static_cast<int>(spelling), per_entry, double(text.size()) / kEntries);
    EXPECT_EQ(tensors, kEntries);
    EXPECT_LT(per_entry, 512.0) << "spelling " << static_cast<int>(spelling);
  }
}

std::uint64_t index_work(std::uint64_t n) {
  std::string text = "{\"metadata\":{\"total_size\":1},\"weight_map\":{";
  for (std::uint64_t i = 0; i < n; ++i) {
    text += (i ? ",\"" : "\"") + std::string("model.layers.") + std::to_string(i / 384) +
            ".mlp.experts." + std::to_string(i % 384) +
            ".gate_proj.weight\":\"model-00001-of-00163.safetensors\"";
  }
  text += "}}";
  std::size_t entries = 0;
  const std::uint64_t work = allocations([&] {
    entries = io::parse_weight_index(text, "counted.index.json").weight_map.size();
  });
  EXPECT_EQ(entries, n);
  return work;
}

TEST(CountedWork, IndexParsing) {
  expect_near_linear("index", index_work(10'000), index_work(100'000), 10);
}

// Qwen3-30B-A3B at its real dimensions (128 experts, so about 390 tensors a layer),
// with `layers` layers, written sparse: the index and plan of real tensor shapes.
struct PlanWork {
  std::size_t tensors = 0;
  std::uint64_t index_allocations = 0;
  std::uint64_t plan_allocations = 0;
  std::size_t clip_calls = 0;
  std::size_t windows = 0;
  std::size_t fragments = 0;
};

PlanWork plan_work(int layers) {
  testing::TempDir dir;
  nlohmann::json config = nlohmann::json::parse(
      testing::read_file(testing::test_data_path("models/qwen3-30b-a3b/config.json")));
  config["num_hidden_layers"] = layers;
  const std::string config_path = dir.file("config.json");
  std::ofstream(config_path) << config.dump();
  synth::SynthOptions o;
  o.from_config = config_path;
  o.sparse = true;
  o.out = dir.file("ck");
  o.fsync = false;
  synth::synthesize(o);

  PlanWork w;
  const io::ResolvedSource source = io::resolve_source(o.out);
  io::CheckpointIndex index;
  w.index_allocations = allocations([&] { index = io::build_checkpoint_index(source); });
  w.tensors = index.tensors.size();
  models::ParallelLayout layout;
  layout.tp = 4;
  layout.ep = 4;
  std::unique_ptr<models::Model> model = models::make_model(config, layout, {});
  w.plan_allocations = allocations([&] {
    const actors::Plan plan = actors::make_plan(index, *model, {});
    actors::WindowCutter cutter(plan);
    actors::Window window;
    while (cutter.next(window)) {
      ++w.windows;
      w.fragments += window.fragments.size();
    }
    w.clip_calls = cutter.clip_calls();
    EXPECT_EQ(w.windows, plan.window_count);
  });
  return w;
}

TEST(CountedWork, IndexingAndPlanningARealMoECheckpoint) {
  FERRY_NEED_TEST_DATA();
  const PlanWork small = plan_work(2);
  const PlanWork large = plan_work(20);
  const double factor = static_cast<double>(large.tensors) / static_cast<double>(small.tensors);
  ASSERT_GT(factor, 9.0);  // 2 and 20 layers: 10x the layers, about 10x the tensors
  expect_near_linear("checkpoint index", small.index_allocations, large.index_allocations, factor);
  expect_near_linear("plan and every window", small.plan_allocations, large.plan_allocations,
                     factor);
  expect_near_linear("clip calls", small.clip_calls, large.clip_calls, factor);
  expect_near_linear("windows", small.windows, large.windows, factor);
  // Every clip makes a fragment: no piece is tried against a window it misses.
  EXPECT_LE(large.clip_calls, large.fragments);
}

}  // namespace
}  // namespace ferry
