// FP8 block-quantized variants of the tiny synthetic checkpoints, and the checks that
// compare what a rank loaded with three readings of one naive reference.
//
// The checkpoint: every quantized linear weight (the spec, not ferry's predicate:
// *_proj.weight and *_proj_with_mqa.weight but eh_proj, and the experts) stored as
// F8_E4M3 plus an F32 <weight>_scale_inv of [ceil(N / B), ceil(K / B)] blocks
// (quant_method fp8, weight_block_size [B, B]). A family's reference (which knows
// nothing of FP8) is fed three value functions:
//   - weight(): the FP8 values themselves; each FP8 param must hold them exactly;
//   - own_scale(): each weight element's own scale S[i / B][j / B] of its source
//     tensor; the loaded scale of the param's element (n, k), scale[n / B][k / B],
//     must equal it, which is what makes every local block dequantize as its source
//     block did;
//   - dequantized(): f32(W) * S rounded to BF16, what an output computed from the
//     dequantized weight (DeepSeek's w_kc / w_vc) holds.
// Header-only, like the references it is used with.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "models/model.hpp"
#include "models/reference_util.hpp"
#include "testing/dtype_codec.hpp"
#include "tools/synth.hpp"

namespace ferry::testing::fp8 {

constexpr std::uint64_t kBlock = 8;

inline bool ends_with(const std::string& s, const std::string& x) {
  return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
}

inline bool fp8_param(const std::string& name) {
  return (ends_with(name, "_proj.weight") || ends_with(name, "_proj_with_mqa.weight") ||
          ends_with(name, "experts.w13_weight") || ends_with(name, "experts.w2_weight")) &&
         !ends_with(name, "eh_proj.weight");
}

// Turns a BF16 tensor list and config into the FP8 block layout (tools' synth
// transform; the values are this header's).
inline std::map<std::string, std::vector<std::uint64_t>> quantize(
    std::vector<tools::SynthTensor>& tensors, nlohmann::json& config) {
  tools::synth_quantize_fp8_block(tensors, kBlock);
  config["quantization_config"] = tools::synth_fp8_quant_config(kBlock);
  std::map<std::string, std::vector<std::uint64_t>> fp8;
  for (const tools::SynthTensor& t : tensors) {
    if (t.dtype == DType::kF8E4M3) {
      fp8[t.name] = t.shape;
    }
  }
  return fp8;
}

class Values {
 public:
  Values(std::uint64_t seed, std::map<std::string, std::vector<std::uint64_t>> fp8_shapes)
      : seed_(seed), shapes_(std::move(fp8_shapes)) {}

  float weight(const std::string& name, std::uint64_t i) {
    const float v = tools::synth_value(seed_, name, i);
    if (shapes_.count(name) == 0) {
      return v;
    }
    auto it = rounded_.find(v);  // synth values take 255 values: round each once
    return it != rounded_.end() ? it->second : rounded_.emplace(v, round_to_e4m3(v)).first->second;
  }
  float own_scale(const std::string& name, std::uint64_t i) const {
    auto it = shapes_.find(name);
    if (it == shapes_.end()) {
      return 0.0f;
    }
    const std::uint64_t k = it->second[1];
    const std::uint64_t kb = (k + kBlock - 1) / kBlock;
    return tools::synth_value(seed_, name + "_scale_inv", (i / k) / kBlock * kb + (i % k) / kBlock);
  }
  float dequantized(const std::string& name, std::uint64_t i) {
    const float v = weight(name, i) * own_scale(name, i);
    const std::uint32_t bits = static_cast<std::uint32_t>(tools::float_to_bf16_bits(v)) << 16;
    float out = 0;
    std::memcpy(&out, &bits, 4);
    return out;
  }
  // Every element of a checkpoint tensor, as weight() gives them.
  std::vector<std::byte> bytes(const tools::SynthTensor& t) {
    std::vector<float> v(t.elements());
    for (std::uint64_t i = 0; i < v.size(); ++i) {
      v[i] = weight(t.name, i);
    }
    return encode(v, t.dtype);
  }

 private:
  std::uint64_t seed_;
  std::map<std::string, std::vector<std::uint64_t>> shapes_;
  std::map<float, float> rounded_;
};

// Routes every tensor of `tensors` (placed or dropped, never unmapped), runs the
// pieces and fills into `buffers`, and returns the routes.
inline std::vector<models::Route> load(const models::Model& model,
                                       const std::vector<tools::SynthTensor>& tensors,
                                       Values& values, ParamBuffers& buffers) {
  std::vector<models::Route> routes;
  for (const tools::SynthTensor& t : tensors) {
    models::Route route = model.route(tensor_info(t.name, t.dtype, t.shape));
    EXPECT_NE(route.kind, models::RouteKind::kUnmapped) << t.name;
    if (route.kind != models::RouteKind::kPlaced) {
      continue;
    }
    const std::vector<std::byte> bytes = values.bytes(t);
    std::span<const std::byte> window(bytes.data() + route.src_begin,
                                      route.src_end - route.src_begin);
    for (const models::Piece& p : route.pieces) {
      apply_piece(p, window, route.src_begin, buffers);
    }
    routes.push_back(std::move(route));
  }
  for (const models::Piece& p : model.fill_pieces()) {
    apply_piece(p, {}, 0, buffers);  // vocabulary padding
  }
  return routes;
}

// Compares local rank `i` of `model` (its bytes in `buffers`) with the three
// reference readings (maps from param name to something with .shape and .values,
// logical row-major). `dequantized_outputs`: params that hold the dequantized
// reading (w_kc, w_vc); the rest hold weight(). Returns how many scale params were
// checked. Params are read through the strides the shell reports.
template <typename Map>
std::size_t check_rank(const models::Model& model, std::size_t i, const ParamBuffers& buffers,
                       const Map& want_w, const Map& want_s, const Map& want_d,
                       const std::set<std::string>& dequantized_outputs = {}) {
  const models::RankShell& shell = model.shells()[i];
  std::set<std::string> names;
  for (const auto& [name, p] : want_w) {
    names.insert(name);
    if (fp8_param(name)) {
      names.insert(name + "_scale_inv");
    }
  }
  std::set<std::string> got_names;
  for (const models::ParamSpec& p : shell.params) {
    got_names.insert(p.name);
  }
  EXPECT_EQ(got_names, names) << "tp rank " << shell.tp_rank;
  if (got_names != names) {
    return 0;
  }
  std::size_t scales = 0;
  for (std::size_t k = 0; k < shell.params.size(); ++k) {
    const models::ParamSpec& spec = shell.params[k];
    const std::string where = spec.name + " tp rank " + std::to_string(shell.tp_rank);
    for (std::uint8_t n : buffers.writes[i][k]) {
      if (n != 1) {
        ADD_FAILURE() << where << ": a byte is written " << int(n) << " times";
        return scales;
      }
    }
    const std::byte* base = buffers.bytes[i][k].data();
    const std::string suffix = "_scale_inv";
    if (ends_with(spec.name, suffix)) {
      // The scale of weight element (.., n, k) is scale[.., n / B, k / B].
      const auto& w = want_s.at(spec.name.substr(0, spec.name.size() - suffix.size()));
      const std::size_t d = w.shape.size();
      std::vector<std::uint64_t> sshape = w.shape;
      sshape[d - 2] = (sshape[d - 2] + kBlock - 1) / kBlock;
      sshape[d - 1] = (sshape[d - 1] + kBlock - 1) / kBlock;
      EXPECT_EQ(spec.shape, sshape) << where;
      EXPECT_EQ(spec.dtype, DType::kF32) << where;
      if (spec.shape != sshape || spec.dtype != DType::kF32) {
        return scales;
      }
      const std::uint64_t rows = w.shape[d - 2];
      const std::uint64_t cols = w.shape[d - 1];
      for (std::uint64_t e = 0; e < w.values.size(); ++e) {
        const std::uint64_t lead = e / (rows * cols);
        const std::uint64_t at =
            (lead * sshape[d - 2] + (e / cols) % rows / kBlock) * sshape[d - 1] + e % cols / kBlock;
        const float got = decode_one(base + at * 4, DType::kF32);
        if (got != w.values[e]) {
          ADD_FAILURE() << where << ": weight element " << e << " reads scale " << got
                        << ", its source block's is " << w.values[e];
          return scales;
        }
      }
      ++scales;
      continue;
    }
    const auto& ref = (dequantized_outputs.count(spec.name) != 0 ? want_d : want_w).at(spec.name);
    EXPECT_EQ(spec.shape, ref.shape) << where;
    if (fp8_param(spec.name)) {
      EXPECT_EQ(spec.dtype, DType::kF8E4M3) << where;
    } else {
      EXPECT_NE(spec.dtype, DType::kF8E4M3) << where;
    }
    if (spec.shape != ref.shape) {
      return scales;
    }
    const DType dt = spec.dtype;
    std::vector<std::uint64_t> idx(spec.shape.size(), 0);
    for (std::size_t e = 0; e < ref.values.size(); ++e) {
      const std::uint64_t off = storage_offset(idx, spec.strides);
      const float got = decode_one(base + off * dtype_size(dt), dt);
      if (got != ref.values[e]) {
        ADD_FAILURE() << where << " element " << e << ": got " << got << ", reference "
                      << ref.values[e];
        return scales;
      }
      next_index(idx, spec.shape);
    }
  }
  return scales;
}

}  // namespace ferry::testing::fp8
