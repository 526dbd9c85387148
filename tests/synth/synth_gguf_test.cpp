// `ferry synth --format gguf`: for every family llama.cpp's converter maps and every
// type (F32, F16, BF16, Q8_0), the file parses, io/gguf_names maps every tensor back
// to its safetensors twin's name and shape, each tensor's bytes are what the
// converter's steps (LlamaModel.permute, torch.stack of the experts, DeepSeek's
// kv_b_proj split, gguf.quants.quantize) give from the twin's values (recomputed here
// through io's converter-direction helpers, not synth's), and undoing them gives the
// twin's values back (exactly, or to within Q8_0's step); the config comes back from
// the metadata through io/gguf_config; real configs scaled down (DeepSeek-V3's YaRN);
// the refusals; --force across formats; the command line.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/float_bits.hpp"
#include "io/gguf.hpp"
#include "io/gguf_config.hpp"
#include "io/gguf_names.hpp"
#include "io/gguf_types.hpp"
#include "io/safetensors.hpp"
#include "synth/cli_util.hpp"
#include "synth/synth.hpp"
#include "testing/error_of.hpp"
#include "testing/temp_dir.hpp"
#include "testing/test_data.hpp"

namespace ferry::synth {
namespace {

namespace fs = std::filesystem;
using ferry::testing::error_of;
using ferry::testing::read_file;
using ferry::testing::TempDir;
using ferry::testing::write_file;
using io::GgmlType;
using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

const std::vector<std::string> kGgufFamilies = {"llama", "mistral",   "mixtral",     "qwen2",
                                                "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3"};
const std::vector<GgmlType> kTypes = {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16,
                                      GgmlType::kQ8_0};

SynthOptions options_for(const std::string& family, const fs::path& out, SynthFormat format,
                         GgmlType type = GgmlType::kF16) {
  SynthOptions o;
  o.family = family;
  o.preset = "tiny";
  o.out = out.string();
  o.format = format;
  o.gguf_type = type;
  o.fsync = false;
  return o;
}

// ---- the twin and the file ---------------------------------------------------------

// The safetensors checkpoint's tensors as float32 (BF16, F16 widened), by name.
std::map<std::string, std::vector<float>> twin_floats(const fs::path& dir) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") {
      continue;
    }
    const io::SafetensorsHeader h = io::read_safetensors_header(e.path().string(), "twin");
    const std::string bytes = read_file(e.path().string());
    for (const io::TensorInfo& t : h.tensors) {
      std::vector<float>& v = out[t.name];
      v.resize(t.elements());
      const char* p = bytes.data() + t.offset;
      for (std::size_t k = 0; k < v.size(); ++k) {
        if (t.dtype == DType::kF32) {
          std::memcpy(&v[k], p + 4 * k, 4);
        } else {
          std::uint16_t bits = 0;
          std::memcpy(&bits, p + 2 * k, 2);
          v[k] = t.dtype == DType::kBF16 ? io::bf16_to_float(bits) : io::f16_to_float(bits);
        }
      }
    }
  }
  return out;
}

std::map<std::string, std::vector<std::uint64_t>> twin_shapes(const std::string& family) {
  std::map<std::string, std::vector<std::uint64_t>> out;
  for (const SynthTensor& t : synth_tensor_list(family, "tiny", DType::kBF16, false)) {
    out[t.name] = t.shape;
  }
  return out;
}

struct Gguf {
  std::string bytes;
  io::GgufHeader header;

  explicit Gguf(const fs::path& file)
      : bytes(read_file(file.string())),
        header(io::parse_gguf_header(
            std::span(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()),
            "model.gguf")) {}

  std::span<const std::byte> data(const io::GgufTensorInfo& t) const {
    return std::span(reinterpret_cast<const std::byte*>(bytes.data()) + t.offset, t.nbytes);
  }
  std::vector<float> floats(const io::GgufTensorInfo& t) const {
    std::vector<float> out(t.elements());
    io::dequantize(t.type, data(t), out, t.name);
    return out;
  }
  std::uint64_t u32(const std::string& key) const {
    const io::GgufValue* v = header.find(key);
    return v != nullptr && v->as_uint() ? *v->as_uint() : ~std::uint64_t{0};
  }
};

// The type the converter gives a tensor, restated: F32 for 1-D, norms, the router and
// non-weights; Q8_0 rows not whole blocks fall back to F16.
GgmlType converter_type(const io::GgufTensorInfo& t, GgmlType requested) {
  const std::string& n = t.name;
  auto ends = [&](std::string_view s) { return n.size() >= s.size() && n.ends_with(s); };
  if (t.dims.size() == 1 || ends("_norm.weight") || ends("ffn_gate_inp.weight") ||
      !ends(".weight")) {
    return GgmlType::kF32;
  }
  if (requested == GgmlType::kQ8_0 && t.dims[0] % 32 != 0) {
    return GgmlType::kF16;
  }
  return requested;
}

// `values` (rows of `cols`) as `type`'s bytes, as gguf.quants.quantize writes them.
std::vector<std::byte> encoded(GgmlType type, const std::vector<float>& values,
                               std::uint64_t cols) {
  std::vector<std::byte> out;
  if (type == GgmlType::kQ8_0) {
    out.resize(values.size() / 32 * 34);
    for (std::size_t r = 0; r < values.size() / cols; ++r) {
      io::quantize_q8_0(std::span(values).subspan(r * cols, cols),
                        std::span(out).subspan(r * cols / 32 * 34, cols / 32 * 34));
    }
    return out;
  }
  const std::size_t esize = type == GgmlType::kF32 ? 4 : 2;
  out.resize(values.size() * esize);
  for (std::size_t k = 0; k < values.size(); ++k) {
    if (type == GgmlType::kF32) {
      std::memcpy(out.data() + 4 * k, &values[k], 4);
    } else {
      const std::uint16_t bits =
          type == GgmlType::kF16 ? float_to_f16_bits(values[k]) : float_to_bf16_bits(values[k]);
      std::memcpy(out.data() + 2 * k, &bits, 2);
    }
  }
  return out;
}

// out row r = in row map[r], rows of `cols` floats.
std::vector<float> gather(const std::vector<float>& in, std::uint64_t cols,
                          const std::vector<std::uint64_t>& map) {
  std::vector<float> out(in.size());
  for (std::size_t r = 0; r < map.size(); ++r) {
    std::copy_n(in.begin() + static_cast<std::ptrdiff_t>(map[r] * cols), cols,
                out.begin() + static_cast<std::ptrdiff_t>(r * cols));
  }
  return out;
}

std::span<const std::byte> bytes_of(const std::vector<float>& v) {
  return std::as_bytes(std::span(v));
}

std::vector<float> floats_of(const std::vector<std::byte>& b) {
  std::vector<float> out(b.size() / 4);
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}

// Within Q8_0's step for values below 1: half of d = max|x| / 127 <= 1/128, plus
// 127 times d's fp16 rounding.
constexpr float kQ8Tolerance = 0.5f / 128 + 127.0f / 128 / 2048 + 1e-6f;

void expect_values(const std::vector<float>& got, const std::vector<float>& want, GgmlType type,
                   const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  std::size_t bad = 0;
  for (std::size_t k = 0; k < got.size(); ++k) {
    const bool ok =
        type == GgmlType::kQ8_0 ? std::fabs(got[k] - want[k]) <= kQ8Tolerance : got[k] == want[k];
    if (!ok && bad++ < 3) {
      ADD_FAILURE() << what << " element " << k << ": " << got[k] << " != " << want[k];
    }
  }
  EXPECT_EQ(bad, 0u) << what;
}

// Every check of one file against its twin (see the file comment).
void check_against_twin(const Gguf& g, const std::map<std::string, std::vector<float>>& twin,
                        const std::map<std::string, std::vector<std::uint64_t>>& shapes,
                        std::uint64_t layers, GgmlType requested) {
  const io::GgufHfMap map = io::map_gguf_to_hf(g.header);
  EXPECT_TRUE(map.skipped.empty());
  std::set<std::string> mapped;
  std::map<std::string, const io::GgufTensorInfo*> halves;  // attn_k_b / attn_v_b
  for (const io::GgufHfTensor& m : map.tensors) {
    SCOPED_TRACE(m.gguf_name);
    const io::GgufTensorInfo& t = *g.header.find_tensor(m.gguf_name);
    EXPECT_EQ(t.type, converter_type(t, requested));
    for (const io::GgufHfPiece& p : m.pieces) {
      mapped.insert(p.hf_name);
      ASSERT_TRUE(shapes.count(p.hf_name)) << p.hf_name;
      EXPECT_EQ(p.hf_shape, shapes.at(p.hf_name)) << p.hf_name;
    }
    const std::uint64_t cols = t.dims[0];
    std::vector<float> want;  // the GGUF order, from the twin
    std::vector<float> back;  // the file's values in HF order
    const std::vector<float> got = g.floats(t);
    switch (m.how) {
      case io::GgufToHf::kSame:
        want = twin.at(m.pieces[0].hf_name);
        back = got;
        break;
      case io::GgufToHf::kUnpermuteRows: {
        const std::uint64_t c = t.dims.size() == 1 ? 1 : cols;  // a bias's rows are elements
        want = gather(twin.at(m.pieces[0].hf_name), c, io::llama_qk_permute_rows(m.rows, m.heads));
        back = gather(got, c, io::llama_qk_hf_rows(m.rows, m.heads));
        EXPECT_NE(want, twin.at(m.pieces[0].hf_name)) << "not permuted";
        break;
      }
      case io::GgufToHf::kExperts:
        for (const io::GgufHfPiece& p : m.pieces) {
          const std::vector<float>& e = twin.at(p.hf_name);
          want.insert(want.end(), e.begin(), e.end());
        }
        back = got;
        break;
      case io::GgufToHf::kMlaKB:
      case io::GgufToHf::kMlaVB: {
        halves[m.gguf_name] = &t;
        const bool k = m.how == io::GgufToHf::kMlaKB;
        const std::uint64_t heads = t.dims[2];
        const std::uint64_t rank = k ? t.dims[1] : t.dims[0];
        const std::vector<std::uint64_t>& kv = shapes.at(m.pieces[0].hf_name);
        const std::uint64_t nope = k ? t.dims[0] : kv[0] / heads - t.dims[1];
        const std::uint64_t v_dim = kv[0] / heads - nope;
        const std::vector<float> split = floats_of(io::mla_split_kv_b(
            bytes_of(twin.at(m.pieces[0].hf_name)), 4, heads, nope, v_dim, rank));
        const std::size_t k_size = heads * rank * nope;
        want = k ? std::vector<float>(split.begin(), split.begin() + k_size)
                 : std::vector<float>(split.begin() + k_size, split.end());
        break;
      }
      case io::GgufToHf::kNone:
        break;
    }
    const std::vector<std::byte> want_bytes = encoded(t.type, want, cols);
    const std::span<const std::byte> file_bytes = g.data(t);
    EXPECT_TRUE(
        std::equal(file_bytes.begin(), file_bytes.end(), want_bytes.begin(), want_bytes.end()))
        << "bytes differ from the converter's";
    if (m.how == io::GgufToHf::kExperts) {
      const std::size_t each = got.size() / m.pieces.size();
      for (std::size_t e = 0; e < m.pieces.size(); ++e) {
        expect_values(std::vector<float>(got.begin() + static_cast<std::ptrdiff_t>(e * each),
                                         got.begin() + static_cast<std::ptrdiff_t>((e + 1) * each)),
                      twin.at(m.pieces[e].hf_name), t.type, m.pieces[e].hf_name);
      }
    } else if (!back.empty()) {
      expect_values(back, twin.at(m.pieces[0].hf_name), t.type, m.pieces[0].hf_name);
    }
  }
  // kv_b_proj put back together from its two halves.
  for (const auto& [name, kb] : halves) {
    if (name.find("attn_k_b") == std::string::npos) {
      continue;
    }
    std::string vb_name = name;
    vb_name.replace(vb_name.find("attn_k_b"), 8, "attn_v_b");
    const io::GgufTensorInfo& vb = *halves.at(vb_name);
    const std::string hf =
        "model.layers." + name.substr(4, name.find('.', 4) - 4) + ".self_attn.kv_b_proj.weight";
    const std::vector<float> whole =
        floats_of(io::mla_kv_b_proj(bytes_of(g.floats(*kb)), bytes_of(g.floats(vb)), 4, kb->dims[2],
                                    kb->dims[0], vb.dims[1], kb->dims[1]));
    expect_values(
        whole, twin.at(hf),
        kb->type == GgmlType::kQ8_0 || vb.type == GgmlType::kQ8_0 ? GgmlType::kQ8_0 : kb->type, hf);
  }
  // Every twin tensor is in the file, but the MTP layer the converter leaves out.
  std::size_t dropped = 0;
  for (const auto& [name, shape] : shapes) {
    const bool mtp = name.starts_with("model.layers." + std::to_string(layers) + ".");
    dropped += mtp ? 1 : 0;
    EXPECT_EQ(mapped.count(name), mtp ? 0u : 1u) << name;
  }
  EXPECT_EQ(mapped.size() + dropped, shapes.size());
}

// ---- names and types ---------------------------------------------------------------

TEST(SynthGguf, FormatTypeAndArchitectureNames) {
  EXPECT_EQ(parse_synth_format("gguf"), SynthFormat::kGguf);
  EXPECT_EQ(to_string(SynthFormat::kGguf), "gguf");
  EXPECT_EQ(synth_index_file(SynthFormat::kGguf), "");
  EXPECT_EQ(parse_synth_gguf_type("q8_0"), GgmlType::kQ8_0);
  EXPECT_EQ(parse_synth_gguf_type("Q8_0"), GgmlType::kQ8_0);
  EXPECT_EQ(parse_synth_gguf_type("bf16"), GgmlType::kBF16);
  EXPECT_EQ(parse_synth_gguf_type("F32"), GgmlType::kF32);
  EXPECT_EQ(parse_synth_gguf_type("q4_k"), std::nullopt);
  EXPECT_EQ(synth_gguf_file_type(GgmlType::kF32), 0u);
  EXPECT_EQ(synth_gguf_file_type(GgmlType::kF16), 1u);
  EXPECT_EQ(synth_gguf_file_type(GgmlType::kQ8_0), 7u);
  EXPECT_EQ(synth_gguf_file_type(GgmlType::kBF16), 32u);
  EXPECT_THROW(synth_gguf_file_type(GgmlType::kQ4_K), Error);
  const std::map<std::string, std::string> arch = {
      {"llama", "llama"},           {"mistral", "llama"},        {"mixtral", "llama"},
      {"qwen2", "qwen2"},           {"qwen3", "qwen3"},          {"qwen3_moe", "qwen3moe"},
      {"deepseek_v2", "deepseek2"}, {"deepseek_v3", "deepseek2"}};
  for (const std::string& family : synth_families()) {
    const auto a = synth_gguf_arch(family);
    if (arch.count(family)) {
      ASSERT_TRUE(a) << family;
      EXPECT_EQ(io::gguf_arch_name(*a), arch.at(family));
    } else {
      EXPECT_FALSE(a) << family;
    }
  }
}

TEST(SynthGguf, TensorTypesAreTheConvertersPerOutType) {
  using V = std::vector<std::uint64_t>;
  for (GgmlType t : kTypes) {
    // 1-D and norms are F32 whatever --outtype (biases too: not ".weight").
    EXPECT_EQ(synth_gguf_tensor_type("output_norm.weight", V{128}, t), GgmlType::kF32);
    EXPECT_EQ(synth_gguf_tensor_type("blk.0.attn_q.bias", V{128}, t), GgmlType::kF32);
    EXPECT_EQ(synth_gguf_tensor_type("blk.1.exp_probs_b.bias", V{8}, t), GgmlType::kF32);
    EXPECT_EQ(synth_gguf_tensor_type("blk.0.ffn_gate_inp.weight", V{128, 8}, t), GgmlType::kF32);
    EXPECT_EQ(synth_gguf_tensor_type("blk.0.attn_q.weight", V{128, 128}, t), t);
    EXPECT_EQ(synth_gguf_tensor_type("blk.0.ffn_up_exps.weight", V{128, 64, 8}, t), t);
  }
  // Q8_0 rows not whole blocks of 32: F16, as the converter falls back.
  EXPECT_EQ(synth_gguf_tensor_type("blk.0.attn_k_b.weight", V{16, 32, 8}, GgmlType::kQ8_0),
            GgmlType::kF16);
  EXPECT_EQ(synth_gguf_tensor_type("blk.0.attn_k_b.weight", V{16, 32, 8}, GgmlType::kBF16),
            GgmlType::kBF16);
}

TEST(SynthGguf, EverySynthValueIsExactInEveryFloatType) {
  // Why F16 and BF16 files compare exactly: k/128 for |k| <= 127 fits both.
  for (int k = -127; k <= 127; ++k) {
    const float v = static_cast<float>(k) / 128.0f;
    EXPECT_EQ(io::f16_to_float(float_to_f16_bits(v)), v) << k;
    EXPECT_EQ(io::bf16_to_float(float_to_bf16_bits(v)), v) << k;
  }
}

// ---- the files -----------------------------------------------------------------------

TEST(SynthGguf, EveryFamilyAndTypeMapsBackToItsSafetensorsTwin) {
  TempDir dir;
  for (const std::string& family : kGgufFamilies) {
    SCOPED_TRACE(family);
    const fs::path st = dir.path() / (family + "-st");
    synthesize(options_for(family, st, SynthFormat::kSafetensors));
    const auto twin = twin_floats(st);
    const auto shapes = twin_shapes(family);
    const std::uint64_t layers =
        synth_config(family, "tiny", DType::kBF16, false)["num_hidden_layers"].get<std::uint64_t>();
    for (GgmlType type : kTypes) {
      SCOPED_TRACE(std::string(io::ggml_type_name(type)));
      const fs::path out = dir.path() / (family + "-" + std::string(io::ggml_type_name(type)));
      const SynthResult r = synthesize(options_for(family, out, SynthFormat::kGguf, type));
      ASSERT_EQ(r.files, std::vector<std::string>{(out / "model.gguf").string()});
      EXPECT_EQ(std::distance(fs::directory_iterator(out), fs::directory_iterator()), 1);
      EXPECT_EQ(r.family, family);
      EXPECT_EQ(r.shards, 1u);
      const Gguf g(out / "model.gguf");
      EXPECT_EQ(g.header.version, 3u);
      EXPECT_EQ(g.header.architecture(), std::string(io::gguf_arch_name(*synth_gguf_arch(family))));
      EXPECT_EQ(g.u32("general.file_type"), synth_gguf_file_type(type));
      EXPECT_EQ(g.u32("general.quantization_version"), 2u);
      EXPECT_EQ(g.header.find("general.type")->s, "model");
      EXPECT_THAT(g.header.find("general.name")->s,
                  AllOf(HasSubstr("ferry synth " + family + "/tiny"),
                        HasSubstr(std::string(io::ggml_type_name(type)))));
      EXPECT_EQ(g.header.find("tokenizer.ggml.model"), nullptr);  // no tokenizer section
      EXPECT_EQ(r.tensors, g.header.tensors.size());
      std::uint64_t bytes = 0;
      for (const io::GgufTensorInfo& t : g.header.tensors) {
        bytes += t.nbytes;
      }
      EXPECT_EQ(r.total_bytes, bytes);
      check_against_twin(g, twin, shapes, layers, type);
    }
  }
}

TEST(SynthGguf, TheConvertersReshapesAreThere) {
  TempDir dir;
  const auto write = [&](const std::string& family, GgmlType type, bool tied = false) {
    SynthOptions o = options_for(
        family,
        dir.path() / (family + "-" + std::string(io::ggml_type_name(type)) + (tied ? "-t" : "")),
        SynthFormat::kGguf, type);
    o.tie_embeddings = tied;
    o.seed = 5;
    synthesize(o);
    return Gguf(fs::path(o.out) / "model.gguf");
  };
  std::vector<std::string> names;
  auto names_of = [&](const Gguf& g) {
    names.clear();
    for (const io::GgufTensorInfo& t : g.header.tensors) {
      names.push_back(t.name);
    }
    return names;
  };

  // Llama: attn_q row 1 of head 0 is HF row d / 2 (the second half's first row).
  const Gguf llama = write("llama", GgmlType::kF32);
  const io::GgufTensorInfo& q = *llama.header.find_tensor("blk.0.attn_q.weight");
  const std::vector<float> qv = llama.floats(q);
  const std::uint64_t d = 16, hidden = 128;  // tiny: head_dim 16
  for (std::uint64_t c = 0; c < hidden; ++c) {
    EXPECT_EQ(qv[1 * hidden + c],
              synth_value(5, "model.layers.0.self_attn.q_proj.weight", (d / 2) * hidden + c));
    EXPECT_EQ(qv[0 * hidden + c], synth_value(5, "model.layers.0.self_attn.q_proj.weight", c));
  }
  EXPECT_EQ(llama.u32("llama.rope.dimension_count"), 16u);
  EXPECT_EQ(llama.u32("llama.vocab_size"), 1000u);
  EXPECT_NE(llama.header.find_tensor("output.weight"), nullptr);
  EXPECT_EQ(write("llama", GgmlType::kF16, true).header.find_tensor("output.weight"), nullptr);

  // Mixtral stacks w1, w2, w3 (gate, down, up); Qwen3-MoE and DeepSeek down, gate, up.
  EXPECT_THAT(names_of(write("mixtral", GgmlType::kF16)),
              ::testing::IsSupersetOf({"blk.0.ffn_gate_exps.weight"}));
  auto order = [&](const std::string& layer) {
    std::vector<std::string> stacks;
    for (const std::string& n : names) {
      if (n.starts_with(layer) && n.ends_with("_exps.weight")) {
        stacks.push_back(n.substr(layer.size()));
      }
    }
    return stacks;
  };
  EXPECT_EQ(order("blk.0."),
            (std::vector<std::string>{"ffn_gate_exps.weight", "ffn_down_exps.weight",
                                      "ffn_up_exps.weight"}));
  const Gguf moe = write("qwen3_moe", GgmlType::kQ8_0);
  names_of(moe);
  EXPECT_EQ(order("blk.1."),
            (std::vector<std::string>{"ffn_down_exps.weight", "ffn_gate_exps.weight",
                                      "ffn_up_exps.weight"}));
  EXPECT_EQ(moe.header.find_tensor("blk.0.ffn_gate_inp.weight")->type, GgmlType::kF32);
  EXPECT_EQ(moe.header.find_tensor("blk.0.attn_q_norm.weight")->type, GgmlType::kF32);
  EXPECT_EQ(moe.header.find_tensor("blk.0.ffn_up_exps.weight")->dims,
            (std::vector<std::uint64_t>{128, 64, 8}));
  EXPECT_EQ(moe.u32("qwen3moe.expert_feed_forward_length"), 64u);

  // DeepSeek-V2 in Q8_0: kv_b_proj split (no attn_kv_b), attn_k_b's rows of 16 fall
  // back to F16, attn_v_b's of 32 are Q8_0.
  const Gguf v2 = write("deepseek_v2", GgmlType::kQ8_0);
  EXPECT_EQ(v2.header.find_tensor("blk.0.attn_kv_b.weight"), nullptr);
  const io::GgufTensorInfo& kb = *v2.header.find_tensor("blk.0.attn_k_b.weight");
  const io::GgufTensorInfo& vb = *v2.header.find_tensor("blk.0.attn_v_b.weight");
  EXPECT_EQ(kb.dims, (std::vector<std::uint64_t>{16, 32, 8}));
  EXPECT_EQ(kb.type, GgmlType::kF16);
  EXPECT_EQ(vb.dims, (std::vector<std::uint64_t>{32, 16, 8}));
  EXPECT_EQ(vb.type, GgmlType::kQ8_0);
  EXPECT_EQ(v2.u32("deepseek2.attention.head_count_kv"), 1u);
  EXPECT_EQ(v2.u32("deepseek2.attention.key_length"), 32u + 8u);
  EXPECT_EQ(v2.u32("deepseek2.attention.key_length_mla"), 16u + 8u);
  EXPECT_EQ(v2.u32("deepseek2.expert_gating_func"), 1u);                  // softmax
  EXPECT_EQ(v2.header.find("deepseek2.attention.q_lora_rank"), nullptr);  // V2-Lite

  // DeepSeek-V3: the MTP layer (num_hidden_layers = 2) is left out; the router bias
  // is blk.N.exp_probs_b.bias in F32; sigmoid gating.
  const Gguf v3 = write("deepseek_v3", GgmlType::kBF16);
  EXPECT_EQ(v3.u32("deepseek2.block_count"), 2u);
  for (const io::GgufTensorInfo& t : v3.header.tensors) {
    EXPECT_FALSE(t.name.starts_with("blk.2.")) << t.name;
  }
  EXPECT_EQ(v3.header.find_tensor("blk.1.exp_probs_b.bias")->type, GgmlType::kF32);
  EXPECT_EQ(v3.header.find_tensor("blk.1.ffn_gate_inp.weight")->type, GgmlType::kF32);
  EXPECT_EQ(v3.header.find_tensor("blk.1.ffn_up_shexp.weight")->type, GgmlType::kBF16);
  EXPECT_EQ(v3.u32("deepseek2.expert_gating_func"), 2u);  // sigmoid
  EXPECT_EQ(v3.u32("deepseek2.attention.q_lora_rank"), 64u);
  EXPECT_EQ(v3.u32("deepseek2.leading_dense_block_count"), 1u);
  EXPECT_EQ(v3.header.find("deepseek2.expert_weights_norm")->u, 1u);
}

// ---- the config ----------------------------------------------------------------------

// io/gguf_config of the file against the synth config.json: every field both have is
// equal, but what the conversion itself changes.
void expect_same_config(const json& got, const json& want, const std::string& family,
                        GgmlType type) {
  const std::set<std::string> changed = {
      // Mistral converts to the llama architecture, which reads back as Llama.
      family == "mistral" ? "architectures" : "",
      family == "mistral" ? "model_type" : "",
      // The converter leaves DeepSeek-V3's MTP layer out.
      family == "deepseek_v3" ? "num_nextn_predict_layers" : "",
      // The file's type, not the checkpoint's (checked below).
      "torch_dtype",
  };
  for (const auto& [key, value] : got.items()) {
    if (!want.contains(key) || changed.count(key)) {
      continue;
    }
    if (value.is_number() && want[key].is_number()) {
      EXPECT_EQ(value.get<double>(), want[key].get<double>()) << key;
    } else {
      EXPECT_EQ(value, want[key]) << key;
    }
  }
  // The fields ferry's models read are all there.
  for (const char* key : {"architectures",     "hidden_size",         "intermediate_size",
                          "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                          "vocab_size",        "tie_word_embeddings", "torch_dtype",
                          "num_local_experts", "num_experts",         "moe_intermediate_size",
                          "n_routed_experts",  "n_shared_experts",    "first_k_dense_replace",
                          "kv_lora_rank",      "q_lora_rank",         "qk_nope_head_dim",
                          "qk_rope_head_dim",  "v_head_dim",          "topk_method",
                          "moe_layer_freq",    "decoder_sparse_step", "mlp_only_layers",
                          "head_dim",          "attention_bias"}) {
    if (want.contains(key)) {
      EXPECT_TRUE(got.contains(key)) << key;
    }
  }
  if (family == "deepseek_v3") {
    EXPECT_EQ(got["num_nextn_predict_layers"], 0);
  }
  if (family == "mistral") {
    EXPECT_EQ(got["architectures"], json::array({"LlamaForCausalLM"}));
  }
  const std::map<GgmlType, std::string> dtypes = {
      {GgmlType::kF32, "float32"}, {GgmlType::kF16, "float16"}, {GgmlType::kBF16, "bfloat16"}};
  if (dtypes.count(type)) {
    EXPECT_EQ(got["torch_dtype"], dtypes.at(type));
  }
}

TEST(SynthGguf, TheConfigComesBackFromTheMetadata) {
  TempDir dir;
  for (const std::string& family : kGgufFamilies) {
    for (bool tied : {false, true}) {
      for (GgmlType type : {GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ8_0}) {
        SCOPED_TRACE(family + (tied ? " tied " : " ") + std::string(io::ggml_type_name(type)));
        SynthOptions o = options_for(family, dir.path() / "x", SynthFormat::kGguf, type);
        o.out = dir.file(family + std::to_string(tied) + std::string(io::ggml_type_name(type)));
        o.tie_embeddings = tied;
        synthesize(o);
        const Gguf g(fs::path(o.out) / "model.gguf");
        expect_same_config(io::gguf_hf_config(g.header).config,
                           synth_config(family, "tiny", DType::kBF16, tied), family, type);
      }
    }
  }
}

// A real config.json cut to a few layers and experts, scaled down.
SynthOptions from_real(const TempDir& dir, const std::string& model, const std::string& name,
                       const json& changes) {
  json c =
      json::parse(read_file(::ferry::testing::test_data_path("models/" + model + "/config.json")));
  c.update(changes);
  write_file(dir.file(name + ".json"), c.dump());
  SynthOptions o;
  o.from_config = dir.file(name + ".json");
  o.scale_hidden = 64;
  o.out = dir.file(name);
  o.format = SynthFormat::kGguf;
  o.fsync = false;
  return o;
}

TEST(SynthGguf, RealConfigsScaledDownKeepTheirRopeScaling) {
  TempDir dir;
  // DeepSeek-V3's YaRN (factor 40 from 4096, mscale_all_dim 1) comes back through
  // rope.scaling.* and yarn_log_multiplier.
  synthesize(from_real(dir, "deepseek-v3", "v3",
                       {{"num_hidden_layers", 3},
                        {"first_k_dense_replace", 1},
                        {"n_routed_experts", 8},
                        {"num_experts_per_tok", 2},
                        {"n_group", 4},
                        {"topk_group", 2}}));
  const Gguf v3(fs::path(dir.file("v3")) / "model.gguf");
  EXPECT_EQ(v3.header.find("deepseek2.rope.scaling.type")->s, "yarn");
  EXPECT_EQ(v3.header.find("deepseek2.rope.scaling.yarn_log_multiplier")->f, 0.1f);
  const json c = io::gguf_hf_config(v3.header).config;
  EXPECT_EQ(c["rope_scaling"]["type"], "yarn");
  EXPECT_EQ(c["rope_scaling"]["factor"], 40.0);
  EXPECT_EQ(c["rope_scaling"]["original_max_position_embeddings"], 4096);
  EXPECT_EQ(c["rope_scaling"]["beta_fast"], 32.0);
  EXPECT_EQ(c["rope_scaling"]["mscale_all_dim"], 1.0);
  EXPECT_EQ(c["architectures"], json::array({"DeepseekV3ForCausalLM"}));
  EXPECT_EQ(c["hidden_size"], 64);
  EXPECT_EQ(c["n_routed_experts"], 8);
  EXPECT_EQ(c["first_k_dense_replace"], 1);
  EXPECT_EQ(c["num_nextn_predict_layers"], 0);  // the real config's MTP layer is left out
  EXPECT_EQ(c["q_lora_rank"], synth_scaled_width(1536, 7168, 64));
  // Qwen3-30B-A3B: head_dim given (key_length), experts stacked.
  synthesize(from_real(dir, "qwen3-30b-a3b", "q3",
                       {{"num_hidden_layers", 2}, {"num_experts", 8}, {"num_experts_per_tok", 2}}));
  const Gguf q3(fs::path(dir.file("q3")) / "model.gguf");
  const json qc = io::gguf_hf_config(q3.header).config;
  EXPECT_EQ(qc["head_dim"], synth_scaled_width(128, 2048, 64));
  EXPECT_EQ(qc["num_experts"], 8);
  EXPECT_EQ(qc["rope_theta"], 1000000.0);
  // Llama 3.1's llama3 rope_scaling is a rope_freqs.weight the converter computes:
  // refused, naming it, and nothing is written.
  EXPECT_THAT(error_of(Stage::kSynth,
                       [&] { synthesize(from_real(dir, "llama-3.1-8b", "l31", json::object())); }),
              AllOf(HasSubstr("rope_scaling of type 'llama3'"), HasSubstr("--format gguf")));
  EXPECT_FALSE(fs::exists(dir.file("l31")));
}

// ---- refusals, --force, the command line --------------------------------------------

TEST(SynthGguf, RefusalsNameTheReasonAndWriteNothing) {
  TempDir dir;
  const fs::path out = dir.path() / "out";
  for (const std::string& family : synth_families()) {
    if (synth_gguf_arch(family)) {
      continue;
    }
    SCOPED_TRACE(family);
    EXPECT_THAT(
        error_of(Stage::kSynth, [&] { synthesize(options_for(family, out, SynthFormat::kGguf)); }),
        AllOf(HasSubstr("family '" + family + "'"), HasSubstr("--format gguf")));
  }
  SynthOptions sparse = options_for("llama", out, SynthFormat::kGguf);
  sparse.sparse = true;
  EXPECT_THAT(error_of(Stage::kSynth, [&] { synthesize(sparse); }), HasSubstr("--sparse"));
  SynthOptions fp8 = options_for("deepseek_v3", out, SynthFormat::kGguf);
  fp8.quant = SynthQuant::kFp8Block;
  EXPECT_THAT(error_of(Stage::kSynth, [&] { synthesize(fp8); }),
              AllOf(HasSubstr("--quant fp8-block"), HasSubstr("q8_0")));
  SynthOptions nvfp4 = options_for("llama", out, SynthFormat::kGguf);
  nvfp4.quant = SynthQuant::kNvfp4;
  EXPECT_THAT(error_of(Stage::kSynth, [&] { synthesize(nvfp4); }), HasSubstr("--quant nvfp4"));
  SynthOptions fused = options_for("qwen3_moe", out, SynthFormat::kGguf);
  fused.fused_experts = true;
  EXPECT_THAT(error_of(Stage::kSynth, [&] { synthesize(fused); }), HasSubstr("--fused-experts"));
  SynthOptions q4 = options_for("llama", out, SynthFormat::kGguf, GgmlType::kQ4_K);
  EXPECT_THAT(error_of(Stage::kSynth, [&] { synthesize(q4); }), HasSubstr("not Q4_K"));
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(SynthGguf, ForceReplacesACheckpointOfAnyFormat) {
  TempDir dir;
  const fs::path out = dir.path() / "ck";
  synthesize(options_for("llama", out, SynthFormat::kSafetensors));
  SynthOptions gguf = options_for("qwen2", out, SynthFormat::kGguf);
  EXPECT_THROW(synthesize(gguf), Error);  // not empty, no --force
  gguf.force = true;
  synthesize(gguf);
  EXPECT_TRUE(fs::exists(out / "model.gguf"));
  EXPECT_FALSE(fs::exists(out / "config.json"));
  SynthOptions st = options_for("llama", out, SynthFormat::kSafetensors);
  st.force = true;
  synthesize(st);  // *.gguf is a checkpoint's file
  EXPECT_FALSE(fs::exists(out / "model.gguf"));
  EXPECT_TRUE(fs::exists(out / "config.json"));
}

TEST(SynthGguf, CommandLine) {
  TempDir dir;
  std::string out;
  std::string err;
  EXPECT_EQ(run_cli({"--help"}, &out), 0);
  EXPECT_THAT(out, AllOf(HasSubstr("--gguf-type"), HasSubstr("model.gguf"), HasSubstr("q8_0"),
                         HasSubstr("falls"), HasSubstr("stay F32")));
  const std::string gguf = dir.file("g");
  ASSERT_EQ(run_cli({"--family=deepseek_v2", "--preset=tiny", "--out", gguf, "--format", "gguf",
                     "--gguf-type", "q8_0", "--seed", "3", "--no-fsync"},
                    &out),
            0);
  EXPECT_THAT(out, AllOf(HasSubstr("deepseek_v2/tiny format gguf Q8_0 seed 3"),
                         HasSubstr("1 files (1 shards)")));
  const Gguf g(fs::path(gguf) / "model.gguf");
  EXPECT_EQ(g.u32("general.file_type"), 7u);
  SynthOptions same =
      options_for("deepseek_v2", dir.path() / "api", SynthFormat::kGguf, GgmlType::kQ8_0);
  same.seed = 3;
  synthesize(same);
  EXPECT_EQ(read_file(gguf + "/model.gguf"), read_file(dir.file("api/model.gguf")));
  // The default type is F16.
  ASSERT_EQ(run_cli({"--family=qwen2", "--preset=tiny", "--out", dir.file("f16"), "--format=gguf",
                     "--no-fsync"},
                    &out),
            0);
  EXPECT_EQ(Gguf(fs::path(dir.file("f16")) / "model.gguf").u32("general.file_type"), 1u);

  const std::string other = dir.file("other");
  const std::vector<std::string> model = {"--family=llama", "--preset=tiny", "--out", other};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = model;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  EXPECT_EQ(run_cli(with({"--format", "pt"}), nullptr, &err), 2);
  EXPECT_THAT(err, HasSubstr("--format: pt not in {safetensors,bin,gguf}"));
  EXPECT_EQ(run_cli(with({"--format", "gguf", "--gguf-type", "q4_k"}), nullptr, &err), 2);
  EXPECT_THAT(err, HasSubstr("q4_k"));
  EXPECT_EQ(run_cli(with({"--gguf-type", "q8_0"}), nullptr, &err), 2);
  EXPECT_THAT(err, HasSubstr("--gguf-type needs --format gguf"));
  EXPECT_EQ(run_cli(with({"--format", "gguf", "--shard-bytes", "1M"}), nullptr, &err), 2);
  EXPECT_THAT(err, HasSubstr("--shard-bytes does not apply to --format gguf"));
  // Refusals are failures of the run (exit 1 from main), naming the reason.
  EXPECT_THAT(error_of(Stage::kSynth,
                       [&] {
                         run_cli(with({"--format=gguf", "--sparse"}));
                       }),
              HasSubstr("--sparse"));
  EXPECT_THAT(
      error_of(Stage::kSynth,
               [&] {
                 run_cli({"--family=glm4_moe", "--preset=tiny", "--out", other, "--format=gguf"});
               }),
      HasSubstr("family 'glm4_moe'"));
  EXPECT_FALSE(fs::exists(other));
}

}  // namespace
}  // namespace ferry::synth
