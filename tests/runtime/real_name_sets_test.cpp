// Real name sets: for every config.json + model.safetensors.index.json pair in
// /work/shared/data/models, a checkpoint with exactly that index's tensor names and
// shard files (dimensions scaled down, layer and expert counts kept) is written,
// then loaded in strict mode (an unknown name fails the load) under several
// layouts: the load must succeed (so no parameter was left unfilled) with zero
// unmapped tensors, and every tensor must be accounted for as placed or dropped.
//
// The shapes come from the scaled config by the Hugging Face conventions written
// out below, independently of ferry's models/ code; a family that expected another
// shape fails the load with "Attempted to load weight ...".
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "io/safetensors_writer.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/load_config.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::testing {
namespace {

namespace fs = std::filesystem;

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    throw std::runtime_error("cannot open " + path);
  }
  return nlohmann::json::parse(in);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The real config with every width scaled down and every count (layers, heads,
// experts) kept, so the name set stays exactly the real one.
nlohmann::json scaled(nlohmann::json c) {
  c["hidden_size"] = 64;
  c["head_dim"] = 4;  // explicit, so hidden_size need not be heads * head_dim
  c["intermediate_size"] = 96;
  c["vocab_size"] = 1000;  // not a multiple of 64: the padded rows are exercised
  c["torch_dtype"] = "bfloat16";
  return c;
}

struct Dims {
  std::uint64_t hidden, heads, kv_heads, head_dim, intermediate, vocab, experts;
};

Dims dims_of(const nlohmann::json& c) {
  Dims d{};
  d.hidden = c.at("hidden_size");
  d.heads = c.at("num_attention_heads");
  d.kv_heads = c.value("num_key_value_heads", d.heads);
  d.head_dim = c.at("head_dim");
  d.intermediate = c.at("intermediate_size");
  d.vocab = c.at("vocab_size");
  d.experts = c.value("num_local_experts", 0);
  return d;
}

// Hugging Face's shape of `name` for a Llama/Mistral/Qwen2/Mixtral config.
std::vector<std::uint64_t> hf_shape(const Dims& d, const std::string& name) {
  const std::uint64_t q = d.heads * d.head_dim;
  const std::uint64_t kv = d.kv_heads * d.head_dim;
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
    return {d.vocab, d.hidden};
  }
  if (ends_with(name, "norm.weight")) {
    return {d.hidden};
  }
  if (ends_with(name, "rotary_emb.inv_freq")) {
    return {d.head_dim / 2};
  }
  if (ends_with(name, "q_proj.weight")) {
    return {q, d.hidden};
  }
  if (ends_with(name, "k_proj.weight") || ends_with(name, "v_proj.weight")) {
    return {kv, d.hidden};
  }
  if (ends_with(name, "q_proj.bias")) {
    return {q};
  }
  if (ends_with(name, "k_proj.bias") || ends_with(name, "v_proj.bias")) {
    return {kv};
  }
  if (ends_with(name, "o_proj.weight")) {
    return {d.hidden, q};
  }
  if (ends_with(name, "block_sparse_moe.gate.weight")) {
    return {d.experts, d.hidden};
  }
  // Dense MLP and Mixtral experts (w1 gate, w3 up, w2 down; intermediate_size).
  if (ends_with(name, "gate_proj.weight") || ends_with(name, "up_proj.weight") ||
      ends_with(name, ".w1.weight") || ends_with(name, ".w3.weight")) {
    return {d.intermediate, d.hidden};
  }
  if (ends_with(name, "down_proj.weight") || ends_with(name, ".w2.weight")) {
    return {d.hidden, d.intermediate};
  }
  throw std::runtime_error("no Hugging Face shape rule for " + name);
}

// Writes the scaled checkpoint: config.json, the index, and every shard the index
// names with exactly its tensors (zero bytes: only names and shapes matter here).
void write_checkpoint(const std::string& src_dir, const std::string& dir) {
  const nlohmann::json config = scaled(read_json(src_dir + "/config.json"));
  const Dims d = dims_of(config);
  const nlohmann::json index = read_json(src_dir + "/model.safetensors.index.json");
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : index.at("weight_map").items()) {
    by_file[file.get<std::string>()].push_back(name);
  }
  fs::create_directories(dir);
  std::uint64_t total = 0;
  for (const auto& [file, names] : by_file) {
    io::SafetensorsWriter w(dir + "/" + file);
    std::uint64_t bytes = 0;
    for (const std::string& name : names) {
      std::vector<std::uint64_t> shape = hf_shape(d, name);
      const DType dtype = ends_with(name, "inv_freq") ? DType::kF32 : DType::kBF16;
      std::uint64_t n = dtype_size(dtype);
      for (std::uint64_t x : shape) {
        n *= x;
      }
      bytes += n;
      w.add(name, dtype, shape);
    }
    w.begin();
    std::vector<std::byte> zeros(1 << 16);
    for (std::uint64_t left = bytes; left > 0;) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(left, zeros.size()));
      w.write({zeros.data(), n});
      left -= n;
    }
    w.finish();
    total += bytes;
  }
  nlohmann::json out_index = index;
  out_index["metadata"] = {{"total_size", total}};
  std::ofstream(dir + "/model.safetensors.index.json") << out_index.dump(1);
  std::ofstream(dir + "/config.json") << config.dump(1);
}

struct Pair {
  std::string model;
  std::vector<std::vector<std::string>> layouts;  // --set lists, each one load
};

void PrintTo(const Pair& p, std::ostream* os) {
  *os << p.model;
}

class RealNameSetsTest : public ::testing::TestWithParam<Pair> {};

TEST_P(RealNameSetsTest, EveryNamePlacedOrDroppedAndEveryParamFilled) {
  FERRY_NEED_TEST_DATA();
  const Pair& p = GetParam();
  const std::string src = ::ferry::testing::test_data_path("models/" + p.model);
  ASSERT_TRUE(fs::exists(src + "/model.safetensors.index.json")) << src;
  TempDir tmp;
  const std::string dir = (tmp.path() / p.model).string();
  write_checkpoint(src, dir);
  const std::size_t names = read_json(src + "/model.safetensors.index.json")["weight_map"].size();
  for (const std::vector<std::string>& sets : p.layouts) {
    std::string label;
    runtime::ConfigBuilder b;
    b.apply_set("model.path=" + dir);
    b.apply_set("load.strict=true");
    for (const std::string& s : sets) {
      b.apply_set(s);
      label += s + " ";
    }
    SCOPED_TRACE(p.model + ": " + label);
    runtime::Runtime rt(to_config(b.build()));
    runtime::LoadResult r = rt.load();
    ASSERT_TRUE(r) << r.error->message;
    const runtime::LoadReport& rep = r.model->report();
    EXPECT_EQ(rep.tensors.unmapped, 0u);
    EXPECT_EQ(rep.tensors.placed + rep.tensors.dropped, names);
    EXPECT_GT(rep.tensors.placed, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    SharedData, RealNameSetsTest,
    ::testing::Values(
        Pair{"llama-3.2-3b-instruct",
             {{"parallel.tp=1"},
              {"parallel.tp=4", "parallel.ranks=1,3"},
              {"parallel.tp=2", "parallel.pp=2", "parallel.pp_rank=1"}}},
        Pair{"llama3-chinese-8b", {{"parallel.tp=2"}}},
        Pair{"mistral-7b-instruct-v0.3", {{"parallel.tp=1"}, {"parallel.tp=8", "parallel.ranks=7"}}},
        Pair{"sakura-14b-qwen2.5", {{"parallel.tp=2"}, {"parallel.pp=3", "parallel.pp_rank=0"}}},
        Pair{"mixtral-8x7b-v0.1",
             {{"parallel.tp=1"}, {"parallel.tp=2", "parallel.ep=2"},
              {"parallel.tp=8", "parallel.ep=8", "parallel.ranks=5"}}}),
    [](const ::testing::TestParamInfo<Pair>& param_info) {
      std::string n;
      for (char ch : param_info.param.model) {
        n += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
      }
      return n;
    });

}  // namespace
}  // namespace ferry::testing
