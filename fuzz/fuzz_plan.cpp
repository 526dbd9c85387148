// The planner (actors::make_plan and WindowCutter) over random valid model configs,
// parallel layouts and header sets, with the coverage invariant asserted
// independently of make_plan's own check.
//
// Input (FuzzedDataProvider), turned into:
//  - a model: one of the families of synth/synth.hpp, its tiny config.json with
//    every size replaced by a small random one (hidden, vocab, layers, heads,
//    experts, MLA ranks, ...; configs the family cannot express are refused by
//    synth::synth_source, a clean error), the weights' dtype, tied embeddings,
//    fused experts;
//  - a header set: the family's tensors for that config (synth::synth_tensor_list),
//    in one of the quantized layouts of synth::synth_quantize or none,
//    spread over 1-3 files in a shuffled order behind random header sizes, with at
//    times one tensor dropped, an unknown one added, a dtype or a shape changed;
//  - a layout: tp (1-8), ep dividing tp, pp and its rank and partition, a random
//    subset of local ranks in random order; model options (param dtype, strict,
//    draft, switch_w13, shared-expert fusion, uneven tp padding, MoE padding);
//  - plan options: chunk_bytes from 4096 up, O_DIRECT alignment, 1-4 read lanes.
//
// Asserted wherever make_model and make_plan accept (a ferry::Error is a refusal):
//  - every window is inside its file's data, at most chunk_bytes and not empty,
//    in order and disjoint within a lane's file; lanes are contiguous and cover
//    every span; bytes read add up to bytes_planned, and planned + skipped to the
//    checkpoint's bytes (skipped by reason to skipped);
//  - every fragment reads inside its tensor and inside its window, writes inside
//    its param, with the tensor's and the param's dtypes;
//  - coverage: every byte of every param of every local rank is written exactly
//    once by the fragments, the zero fills and the hooks' outputs together (no
//    piece or fill writes a hook output), counted byte by byte;
//  - the fragments write exactly what the unsplit route pieces write: the same
//    source element (file and offset) into every destination byte.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "actors/plan.hpp"
#include "common/dtype.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "fuzz/fuzz_check.hpp"
#include "io/safetensors.hpp"
#include "models/model.hpp"
#include "models/quant.hpp"
#include "synth/synth.hpp"

namespace {

using ferry::DType;
using nlohmann::json;
namespace actors = ferry::actors;
namespace io = ferry::io;
namespace models = ferry::models;
namespace synth = ferry::synth;

constexpr DType kFloatTypes[] = {DType::kBF16, DType::kF16, DType::kF32};

// Sizes of the family's tiny config.json replaced by small ones: byte-by-byte
// checks stay cheap, and odd sizes meet the uneven tp paths.
void shrink(json& config, FuzzedDataProvider& in) {
  struct Field {
    const char* key;
    int low;
    int high;
  };
  static constexpr Field kFields[] = {
      {"intermediate_size", 1, 48},
      {"num_hidden_layers", 1, 4},
      {"num_attention_heads", 1, 8},
      {"num_key_value_heads", 1, 8},
      {"head_dim", 1, 16},
      {"vocab_size", 1, 160},
      {"num_local_experts", 1, 8},
      {"num_experts", 1, 8},
      {"n_routed_experts", 1, 8},
      {"num_experts_per_tok", 1, 4},
      {"moe_intermediate_size", 1, 24},
      {"shared_expert_intermediate_size", 1, 24},
      {"q_lora_rank", 1, 16},
      {"kv_lora_rank", 1, 16},
      {"qk_nope_head_dim", 1, 16},
      {"qk_rope_head_dim", 1, 8},
      {"v_head_dim", 1, 16},
      {"n_shared_experts", 1, 2},
      {"first_k_dense_replace", 0, 3},
      {"num_nextn_predict_layers", 0, 1},
      {"n_group", 1, 4},
      {"topk_group", 1, 4},
  };
  config["hidden_size"] = 8 * in.ConsumeIntegralInRange(1, 6);
  for (const Field& f : kFields) {
    auto it = config.find(f.key);
    if (it != config.end() && it->is_number()) {
      *it = in.ConsumeIntegralInRange(f.low, f.high);
    }
  }
}

struct Checkpoint {
  io::CheckpointIndex index;
  json config;
};

// The family's tensors over 1-3 files, maybe perturbed. nullopt when the config
// is one the synthetic lists cannot express.
std::optional<Checkpoint> make_checkpoint(FuzzedDataProvider& in) {
  const auto& families = synth::synth_families();
  const std::string family =
      families[in.ConsumeIntegralInRange<std::size_t>(0, families.size() - 1)];
  const DType dtype = kFloatTypes[in.ConsumeIntegralInRange(0, 2)];
  const bool tied = in.ConsumeBool();
  const bool fused = synth::synth_family_has_experts(family) && in.ConsumeBool();
  Checkpoint c;
  std::vector<synth::SynthTensor> tensors;
  try {
    c.config = synth::synth_config(family, "tiny", dtype, tied);
    shrink(c.config, in);
    const synth::SynthSource source = synth::synth_source(c.config, "config.json");
    tensors = synth::synth_tensor_list(source, dtype, 0, fused);
    c.config = synth::synth_config(source, dtype);
    // A quantized layout (synth::SynthQuant, kNone first) with 8 to 32 wide blocks.
    const auto quant = static_cast<synth::SynthQuant>(in.ConsumeIntegralInRange(0, 5));
    if (quant != synth::SynthQuant::kNone && !fused) {
      const std::uint64_t block = 8 * in.ConsumeIntegralInRange<std::uint64_t>(1, 4);
      synth::synth_quantize(tensors, quant, block);
      if (json q = synth::synth_quant_config(quant, block); !q.is_null()) {
        c.config["quantization_config"] = q;
      }
      if (json h = synth::synth_hf_quant_config(quant); !h.is_null()) {
        c.config = ferry::models::with_hf_quant_config(c.config, h);
      }
    }
  } catch (const ferry::Error&) {
    return std::nullopt;
  }

  // Perturbations, each rare, so most inputs plan.
  const int perturb = in.ConsumeIntegralInRange(0, 15);
  if (!tensors.empty()) {
    const std::size_t victim = in.ConsumeIntegralInRange<std::size_t>(0, tensors.size() - 1);
    if (perturb == 1) {
      tensors.erase(tensors.begin() + static_cast<std::ptrdiff_t>(victim));
    } else if (perturb == 2) {
      tensors.push_back({"model.layers.0.fuzz_unknown.weight", dtype, {3, 5}});
    } else if (perturb == 3) {
      tensors[victim].dtype = kFloatTypes[in.ConsumeIntegralInRange(0, 2)];
    } else if (perturb == 4 && !tensors[victim].shape.empty()) {
      tensors[victim].shape.back() += 1;
    }
  }

  std::mt19937_64 rng(in.ConsumeIntegral<std::uint64_t>());
  std::shuffle(tensors.begin(), tensors.end(), rng);
  const std::uint32_t files = in.ConsumeIntegralInRange<std::uint32_t>(1, 3);
  std::vector<std::vector<const synth::SynthTensor*>> by_file(files);
  for (const synth::SynthTensor& t : tensors) {
    by_file[rng() % files].push_back(&t);
  }
  for (std::uint32_t f = 0; f < files; ++f) {
    io::CheckpointFile file;
    file.name = "model-" + std::to_string(f) + ".safetensors";
    file.path = file.name;
    file.header_bytes = 8 + in.ConsumeIntegralInRange<std::uint64_t>(2, 5000);
    std::uint64_t at = file.header_bytes;
    for (const synth::SynthTensor* s : by_file[f]) {
      io::TensorInfo t;
      t.name = s->name;
      t.dtype = s->dtype;
      t.shape = s->shape;
      t.file = file.name;
      t.file_index = f;
      t.offset = at;
      t.nbytes = s->nbytes();
      at += t.nbytes;
      c.index.total_bytes += t.nbytes;
      c.index.tensors.push_back(std::move(t));
      c.index.add_name(c.index.tensors.size() - 1);
    }
    file.size = at;
    file.tensor_count = by_file[f].size();
    c.index.files.push_back(std::move(file));
  }
  return c;
}

models::ParallelLayout make_layout(FuzzedDataProvider& in) {
  static constexpr int kTp[] = {1, 2, 3, 4, 6, 8};
  models::ParallelLayout layout;
  layout.tp = kTp[in.ConsumeIntegralInRange(0, 5)];
  std::vector<int> divisors;
  for (int d = 1; d <= layout.tp; ++d) {
    if (layout.tp % d == 0) {
      divisors.push_back(d);
    }
  }
  layout.ep = divisors[in.ConsumeIntegralInRange<std::size_t>(0, divisors.size() - 1)];
  layout.pp = in.ConsumeIntegralInRange(1, 3);
  layout.pp_rank = in.ConsumeIntegralInRange(0, layout.pp - 1);
  if (layout.pp > 1 && in.ConsumeIntegralInRange(0, 3) == 0) {
    for (int s = 0; s < layout.pp; ++s) {
      layout.pp_partition.push_back(in.ConsumeIntegralInRange(0, 3));
    }
  }
  if (in.ConsumeBool()) {
    std::vector<int> ranks(layout.tp);
    for (int r = 0; r < layout.tp; ++r) {
      ranks[r] = r;
    }
    std::mt19937 rng(in.ConsumeIntegral<std::uint32_t>());
    std::shuffle(ranks.begin(), ranks.end(), rng);
    ranks.resize(in.ConsumeIntegralInRange<std::size_t>(1, ranks.size()));
    layout.local_ranks = std::move(ranks);
  }
  // SGLang's DeepSeek deployment layouts, now and then (families other than
  // DeepSeek refuse them; invalid combinations are refused too).
  if (in.ConsumeIntegralInRange(0, 3) == 0) {
    layout.attn_dp = divisors[in.ConsumeIntegralInRange<std::size_t>(0, divisors.size() - 1)];
    layout.dp_lm_head = in.ConsumeBool();
    layout.moe_dense_tp = in.ConsumeIntegralInRange(0, 2);
    if (in.ConsumeBool()) {
      layout.moe_a2a = models::ParallelLayout::MoeA2a::kDeepep;
    }
  }
  return layout;
}

models::ModelOptions make_options(FuzzedDataProvider& in) {
  models::ModelOptions o;
  if (const int d = in.ConsumeIntegralInRange(0, 3); d > 0) {
    o.dtype = kFloatTypes[d - 1];
  }
  o.strict = in.ConsumeIntegralInRange(0, 3) == 0;
  o.draft = in.ConsumeIntegralInRange(0, 7) == 0;
  o.switch_w13 = in.ConsumeBool();
  if (const int f = in.ConsumeIntegralInRange(0, 2); f > 0) {
    o.fuse_shared_experts = f == 1;
  }
  o.unaligned_tp = in.ConsumeBool() ? models::Unaligned::kPad : models::Unaligned::kRefuse;
  static constexpr std::uint64_t kPad[] = {0, 0, 8, 16, 24};
  o.pad_moe_intermediate_to = kPad[in.ConsumeIntegralInRange(0, 4)];
  return o;
}

// Per param byte: how many writes, and what each wrote (source element and the
// byte within it; 0 for zero fills and hook outputs).
struct Writes {
  std::vector<std::vector<std::vector<std::uint8_t>>> count;  // [rank][param][byte]
  std::vector<std::vector<std::vector<std::uint64_t>>> what;
};

Writes empty_writes(const models::Model& model) {
  Writes w;
  for (const models::RankShell& shell : model.shells()) {
    w.count.emplace_back();
    w.what.emplace_back();
    for (const models::ParamSpec& p : shell.params) {
      w.count.back().emplace_back(p.nbytes, 0);
      w.what.back().emplace_back(p.nbytes, 0);
    }
  }
  return w;
}

// Records a 2-D block (a piece or a fragment) whose source element k of row r sits
// at file `file`, offset src_base + src_offset + r * src_pitch + k * size, after
// checking that it lies inside its param.
template <class Block>
void record(const Block& b, const models::Model& model, std::uint32_t file, std::uint64_t src_base,
            bool zero, Writes& w) {
  FUZZ_CHECK(b.local_rank < model.shells().size());
  const auto& params = model.shells()[b.local_rank].params;
  FUZZ_CHECK(b.param < params.size());
  const models::ParamSpec& param = params[b.param];
  FUZZ_CHECK(b.dst_dtype == param.dtype, param.name);
  if (b.rows == 0 || b.width_elems == 0) {
    return;
  }
  const std::uint64_t des = ferry::dtype_size(b.dst_dtype);
  const std::uint64_t ses = ferry::dtype_size(b.src_dtype);
  std::uint64_t row_bytes = 0;
  std::uint64_t last = 0;
  std::uint64_t end = 0;
  FUZZ_CHECK(!__builtin_mul_overflow(b.width_elems, des, &row_bytes) &&
                 !__builtin_mul_overflow(b.rows - 1, b.dst_pitch, &last) &&
                 !__builtin_add_overflow(b.dst_offset, last, &end) &&
                 !__builtin_add_overflow(end, row_bytes, &end) && end <= param.nbytes,
             "writes past the end of " + param.name);
  auto& count = w.count[b.local_rank][b.param];
  auto& what = w.what[b.local_rank][b.param];
  for (std::uint64_t r = 0; r < b.rows; ++r) {
    for (std::uint64_t e = 0; e < b.width_elems; ++e) {
      const std::uint64_t src = src_base + b.src_offset + r * b.src_pitch + e * ses;
      const std::uint64_t id = zero ? 0 : ((std::uint64_t{file} + 1) << 44 | src) << 4;
      const std::uint64_t dst = b.dst_offset + r * b.dst_pitch + e * des;
      for (std::uint64_t k = 0; k < des; ++k) {
        FUZZ_CHECK(count[dst + k] < 255);
        ++count[dst + k];
        what[dst + k] = zero ? 0 : id | k;
      }
    }
  }
}

// Marks the hooks' outputs written once, after checking nothing else wrote them.
void record_hooks(const models::Model& model, Writes& w) {
  for (const models::PostLoadHook& hook : model.hooks()) {
    FUZZ_CHECK(hook.local_rank < w.count.size());
    for (std::size_t out : hook.outputs) {
      FUZZ_CHECK(out < w.count[hook.local_rank].size());
      for (std::uint8_t& c : w.count[hook.local_rank][out]) {
        FUZZ_CHECK(c == 0, "a piece or fill writes the output of hook " + hook.name);
        c = 1;
      }
    }
    for (std::size_t input : hook.inputs) {
      FUZZ_CHECK(input < w.count[hook.local_rank].size());
    }
  }
}

void check_complete(const models::Model& model, const Writes& w, const char* by) {
  for (std::size_t r = 0; r < w.count.size(); ++r) {
    for (std::size_t p = 0; p < w.count[r].size(); ++p) {
      const auto& count = w.count[r][p];
      for (std::size_t b = 0; b < count.size(); ++b) {
        FUZZ_CHECK(count[b] == 1, std::string(by) + ": byte " + std::to_string(b) + " of " +
                                      model.shells()[r].params[p].name + " (rank " +
                                      std::to_string(r) + ") written " + std::to_string(count[b]) +
                                      " times");
      }
    }
  }
}

void check_plan(const io::CheckpointIndex& index, const models::Model& model,
                const actors::Plan& plan, unsigned lanes) {
  // What the unsplit pieces write.
  Writes want = empty_writes(model);
  for (const io::TensorInfo& t : index.tensors) {
    const models::Route route = model.route(t);
    for (const models::Piece& p : route.pieces) {
      FUZZ_CHECK(p.src_dtype == t.dtype, t.name);
      FUZZ_CHECK(p.src_end() <= t.nbytes, "a piece reads past its tensor " + t.name);
      record(p, model, t.file_index, t.offset, false, want);
    }
  }
  for (const models::Piece& p : plan.fills) {
    record(p, model, 0, 0, true, want);
  }
  record_hooks(model, want);
  check_complete(model, want, "pieces");

  // What the windows' fragments write, cut lane by lane.
  Writes got = empty_writes(model);
  for (const models::Piece& p : plan.fills) {
    record(p, model, 0, 0, true, got);
  }
  const auto runs = actors::lane_spans(plan, lanes);
  FUZZ_CHECK(runs.size() <= lanes);
  std::size_t next_span = 0;
  std::uint64_t read = 0;
  for (const auto& run : runs) {
    FUZZ_CHECK(run.first == next_span && run.first < run.second, "lanes not contiguous");
    next_span = run.second;
    actors::WindowCutter cutter(plan, run);
    actors::Window w;
    std::vector<std::uint64_t> last_end(index.files.size(), 0);
    while (cutter.next(w)) {
      FUZZ_CHECK(w.file < index.files.size());
      const io::CheckpointFile& file = index.files[w.file];
      FUZZ_CHECK(w.nbytes > 0 && w.nbytes <= plan.options.chunk_bytes);
      FUZZ_CHECK(w.offset >= file.header_bytes && w.offset + w.nbytes <= file.size,
                 "a window outside its file's data");
      FUZZ_CHECK(w.offset >= last_end[w.file], "windows overlap or go backwards");
      last_end[w.file] = w.offset + w.nbytes;
      read += w.nbytes;
      FUZZ_CHECK(w.rank_begin.size() == model.shells().size() + 1);
      for (std::size_t r = 0; r < model.shells().size(); ++r) {
        FUZZ_CHECK(w.rank_begin[r] <= w.rank_begin[r + 1] &&
                   w.rank_begin[r + 1] <= w.fragments.size());
        for (std::uint32_t i = w.rank_begin[r]; i < w.rank_begin[r + 1]; ++i) {
          const actors::Fragment& f = w.fragments[i];
          FUZZ_CHECK(f.local_rank == r);
          FUZZ_CHECK(f.tensor < index.tensors.size());
          const io::TensorInfo& t = index.tensors[f.tensor];
          FUZZ_CHECK(t.file_index == w.file && f.src_dtype == t.dtype);
          FUZZ_CHECK(f.src_end() <= w.nbytes, "a fragment reads past its window");
          if (f.rows > 0 && f.width_elems > 0) {
            const std::uint64_t first = w.offset + f.src_offset;
            const std::uint64_t last = w.offset + f.src_end();
            FUZZ_CHECK(first >= t.offset && last <= t.offset + t.nbytes,
                       "a fragment reads outside its tensor " + t.name);
          }
          record(f, model, w.file, w.offset, false, got);
        }
      }
    }
  }
  FUZZ_CHECK(next_span == plan.spans.size(), "the lanes miss spans");
  record_hooks(model, got);
  check_complete(model, got, "fragments");
  FUZZ_CHECK(got.what == want.what, "the fragments write other bytes than the pieces");

  FUZZ_CHECK(read == plan.bytes_planned);
  FUZZ_CHECK(plan.bytes_planned + plan.bytes_skipped == index.total_bytes);
  std::uint64_t by_reason = 0;
  for (const auto& [reason, bytes] : plan.bytes_skipped_by_reason) {
    by_reason += bytes;
  }
  FUZZ_CHECK(by_reason == plan.bytes_skipped);
}

// How far inputs get, printed at exit when FERRY_FUZZ_STATS is set: a target whose
// inputs never reach check_plan would assert nothing.
struct Stats {
  std::uint64_t no_config = 0;
  std::uint64_t refused = 0;
  std::uint64_t checked = 0;
} g_stats;

void print_stats() {
  std::fprintf(stderr, "fuzz_plan: %llu configs refused, %llu plans refused, %llu plans checked\n",
               static_cast<unsigned long long>(g_stats.no_config),
               static_cast<unsigned long long>(g_stats.refused),
               static_cast<unsigned long long>(g_stats.checked));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ferry::log::set_level(ferry::log::Level::kError);
  if (std::getenv("FERRY_FUZZ_STATS") != nullptr) {
    std::atexit(print_stats);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  std::optional<Checkpoint> c = make_checkpoint(in);
  if (!c) {
    ++g_stats.no_config;
    return 0;
  }
  const models::ParallelLayout layout = make_layout(in);
  const models::ModelOptions options = make_options(in);
  actors::PlanOptions plan_options;
  plan_options.chunk_bytes = 4096 + in.ConsumeIntegralInRange<std::size_t>(0, 1 << 16);
  if (in.ConsumeBool()) {
    plan_options.chunk_bytes &= ~std::size_t{4095};
  }
  plan_options.direct = in.ConsumeBool();
  const unsigned lanes = in.ConsumeIntegralInRange(1u, 4u);
  try {
    const std::unique_ptr<models::Model> model = models::make_model(c->config, layout, options);
    const actors::Plan plan = actors::make_plan(c->index, *model, plan_options, "fuzz");
    check_plan(c->index, *model, plan, lanes);
    ++g_stats.checked;
  } catch (const ferry::Error&) {
    ++g_stats.refused;
  }
  return 0;
}
