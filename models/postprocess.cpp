#include "models/postprocess.hpp"

#include <algorithm>
#include <cmath>

#include "common/enum_name.hpp"
#include "common/error.hpp"
#include "gpu/device.hpp"
#include "models/quant.hpp"
#include "models/table_model.hpp"

namespace ferry::models {
namespace {

using Method = QuantScheme::Method;
using Format = QuantScheme::Format;
using Target = QuantScheme::Target;

[[noreturn]] void bad(const std::string& param, const std::string& rule) {
  throw Error(Stage::kPostProcess, "", param, "postprocess.target: " + rule);
}

constexpr std::size_t kF32 = sizeof(float);

// Rows [first, first + count) of an F32 [N, 1] scale all take the value at `src`:
// one copy, then doublings of what is written (no fill from a device value exists).
void broadcast_rows(gpu::Stream& stream, std::byte* dst, const std::byte* src,
                    std::uint64_t count) {
  if (count == 0) {
    return;
  }
  stream.copy_d2d_2d(dst, kF32, src, kF32, kF32, 1);
  for (std::uint64_t have = 1; have < count; have *= 2) {
    const std::uint64_t n = std::min(have, count - have);
    stream.copy_d2d_2d(dst + have * kF32, n * kF32, dst, n * kF32, n * kF32, 1);
  }
}

// The largest of `count` F32 values at `src` into `dst`, on the device: a static
// quantize (Fp8ScaleRule::kStatic) of one zero element, whose scale slots (a copy of
// the values in scratch) all end up holding the largest.
void max_into(gpu::Stream& stream, std::byte* dst, const std::byte* src, std::uint64_t count,
              std::byte* scratch) {
  std::byte* slots = scratch;
  std::byte* zero = scratch + count * kF32;
  std::byte* code = zero + kF32;
  stream.copy_d2d_2d(slots, count * kF32, src, count * kF32, count * kF32, 1);
  stream.zero(zero, kF32);
  stream.quantize_fp8(code, slots, zero, DType::kF32,
                      gpu::Fp8Scales{gpu::Fp8Granularity::kTensor, 0, 0, count},
                      gpu::Fp8ScaleRule::kStatic, 1, 1, 1);
  stream.copy_d2d_2d(dst, kF32, slots, kF32, kF32, 1);
}

std::size_t max_scratch(std::uint64_t count) {
  return count * kF32 + kF32 + 1;
}

// nvfp4_marlin_process_global_scale(x.to(params dtype)) of each of `values`, into
// `out` (params dtype): rounded to it by the device's cast, widened back, scaled
// by 2^119 (BF16) or 2^7 (F16) (exact, or infinite), rounded again. `f32` is
// scratch of values.size() F32.
void write_global_scales(gpu::Stream& stream, std::vector<float>& values, std::byte* out,
                         std::byte* f32, DType dtype) {
  const std::size_t count = values.size();
  auto* host = reinterpret_cast<std::byte*>(values.data());
  stream.copy_h2d(f32, host, count * kF32);
  stream.cast(out, dtype, f32, DType::kF32, count);
  stream.cast(f32, DType::kF32, out, dtype, count);
  stream.copy_d2h(host, f32, count * kF32);
  stream.synchronize();
  for (float& v : values) {
    v = std::ldexp(v, dtype == DType::kBF16 ? 119 : 7);
  }
  stream.copy_h2d(f32, host, count * kF32);
  stream.cast(out, dtype, f32, DType::kF32, count);
  stream.synchronize();  // the host values die with the caller
}

// `rows` rows of `width` bytes at `src`, zero-padded to `prows` rows of `pwidth` in
// the hook's scratch (returned); `src` itself where nothing pads.
const std::byte* pad_rows(HookContext& ctx, const std::byte* src, std::uint64_t rows,
                          std::uint64_t width, std::uint64_t prows, std::uint64_t pwidth) {
  if (rows == prows && width == pwidth) {
    return src;
  }
  std::byte* p = ctx.scratch(prows * pwidth);
  ctx.stream().zero(p, prows * pwidth);
  ctx.stream().copy_d2d_2d(p, pwidth, src, width, width, rows);
  return p;
}

// torch's max() of F32 values: NaN if any is.
float torch_max(const std::vector<float>& values) {
  float out = values.front();
  for (float v : values) {
    if (std::isnan(v) || (!std::isnan(out) && v > out)) {
      out = v;
    }
  }
  return out;
}

// swizzle_blockscale's layout of E4M3 scales [mp][cp] (mp % 128 == 0, cp % 4 == 0):
// seen as 4-byte groups of columns, each 128-row block [4][32][cp/4] becomes
// [cp/4][32][4]: two batched transposes through `tmp` (mp * cp bytes).
void swizzle_128x4(gpu::Stream& stream, std::byte* dst, const std::byte* src, std::byte* tmp,
                   std::uint64_t mp, std::uint64_t cp) {
  // Each 128-row block [4 * 32 rows][cp/4 groups] to [cp/4][4 * 32].
  stream.transpose(tmp, 128 * cp, src, 128 * cp, 4, 128, cp / 4, mp / 128);
  // Each group's 128 rows [4][32] to [32][4].
  stream.transpose(dst, 512, tmp, 512, 4, 4, 32, mp * cp / 512);
}

// FlashInfer's shuffle_matrix_a with epilogue_tile_m 128 (get_shuffle_matrix_a_row_indices,
// blocks of 32 rows, srcToDstBlk32RowMap): in each block, row 4a + b moves to row
// 8b + a. Rows of `row_bytes` as words of `es` bytes (W a row): each block's [8][4 W]
// transposed to [4 W][8], then each [W][8] to [8][W], through `tmp` (rows * row_bytes).
void shuffle_rows_32(gpu::Stream& stream, std::byte* dst, const std::byte* src, std::byte* tmp,
                     std::uint64_t rows, std::uint64_t row_bytes) {
  std::size_t es = 8;
  while (row_bytes % es != 0) {
    es /= 2;
  }
  const std::uint64_t words = row_bytes / es;
  stream.transpose(tmp, 32 * row_bytes, src, 32 * row_bytes, es, 8, 4 * words, rows / 32);
  stream.transpose(dst, 8 * row_bytes, tmp, 8 * row_bytes, es, words, 8, rows / 8);
}

// FlashInfer's reorder_rows_for_gated_act_gemm of w13 as flashinfer_trtllm loads it
// (up rows first: load_up_proj_weight_first, or FusedMoE's swapped shard ids) from
// ferry's [gate | up] rows, or its [up | gate] rows where `up_first`: row 2j is up's
// row j, row 2j + 1 gate's. Two pitched copies into `dst`.
void interleave_up_gate(gpu::Stream& stream, std::byte* dst, const std::byte* src,
                        std::uint64_t rows, std::uint64_t row_bytes, bool up_first) {
  const std::uint64_t half = rows / 2;
  const std::byte* up = src + (up_first ? 0 : half * row_bytes);
  const std::byte* gate = src + (up_first ? half * row_bytes : 0);
  stream.copy_d2d_2d(dst, 2 * row_bytes, up, row_bytes, row_bytes, half);
  stream.copy_d2d_2d(dst + row_bytes, 2 * row_bytes, gate, row_bytes, row_bytes, half);
}

// F32 values of a param, read back to the host.
std::vector<float> read_floats(gpu::Stream& stream, const std::byte* src, std::uint64_t count) {
  std::vector<float> out(count);
  stream.copy_d2h(reinterpret_cast<std::byte*>(out.data()), src, count * kF32);
  stream.synchronize();
  return out;
}

// The first `count` of `values` to a param, from the host (synchronized: the host
// values may die when the caller returns).
void write_floats(gpu::Stream& stream, std::byte* dst, const std::vector<float>& values,
                  std::uint64_t count) {
  stream.copy_h2d(dst, reinterpret_cast<const std::byte*>(values.data()), count * kF32);
  stream.synchronize();
}

// BaseKVCacheMethod.process_weights_after_loading for a loaded pair: both valid,
// kept; neither, 1.0; only k_scale (a single kv_scale loaded as it), the larger in
// both. A valid v_scale beside an invalid k_scale is refused, as SGLang asserts.
void kv_rule(const std::string& module, float& k, float& v) {
  if (k > 0.0f && v > 0.0f) {
    return;
  }
  if (k <= 0.0f && v <= 0.0f) {
    k = v = 1.0f;
    return;
  }
  if (!(k > 0.0f)) {
    throw Error(Stage::kPostProcess, "", module + ".k_scale",
                "the FP8 KV cache's k_scale is " + std::to_string(k) + " while v_scale is " +
                    std::to_string(v) +
                    ": SGLang's BaseKVCacheMethod asserts k_scale > 0 when only one is valid");
  }
  k = v = std::max(k, v);
}

// The k_scale / v_scale hooks of one rank: 1.0 where nothing loads them, the rule
// above where the checkpoint does (two scalars read back to the host, decided there
// and written back: no device kernel compares).
void add_kv_scale_hooks(const RankShell& shell, std::size_t r, const QuantScheme& q,
                        std::vector<PostLoadHook>& out) {
  constexpr std::string_view kSuffix = ".k_scale";
  for (std::size_t k = 0; k < shell.params.size(); ++k) {
    const std::string& name = shell.params[k].name;
    if (!name.ends_with(kSuffix) || name.find(".self_attn.attn") == std::string::npos) {
      continue;
    }
    const std::string module = name.substr(0, name.size() - kSuffix.size());
    const std::string attn = module.substr(module.rfind('.') + 1);
    auto vit = shell.by_name.find(module + ".v_scale");
    if (vit == shell.by_name.end()) {
      bad(module + ".v_scale", "no v_scale beside " + name);
    }
    const std::size_t v = vit->second;
    PostLoadHook hook;
    hook.name = "postprocess_" + std::string(to_string(q.target)) + ":" + module +
                ".kv_scales (tp rank " + std::to_string(shell.tp_rank) + ")";
    hook.local_rank = r;
    if (!kv_scales_loaded(q, attn)) {
      hook.outputs = {k, v};
      hook.run = [k, v](HookContext& ctx) {
        ctx.stream().fill(ctx.param_data(k), 1, DType::kF32, 1.0);
        ctx.stream().fill(ctx.param_data(v), 1, DType::kF32, 1.0);
      };
    } else {
      hook.rewrites = {k, v};
      hook.run = [k, v, module](HookContext& ctx) {
        gpu::Stream& stream = ctx.stream();
        float kv[2] = {0, 0};
        stream.copy_d2h(reinterpret_cast<std::byte*>(&kv[0]), ctx.param_data(k), kF32);
        stream.copy_d2h(reinterpret_cast<std::byte*>(&kv[1]), ctx.param_data(v), kF32);
        stream.synchronize();
        kv_rule(module, kv[0], kv[1]);
        stream.copy_h2d(ctx.param_data(k), reinterpret_cast<const std::byte*>(&kv[0]), kF32);
        stream.copy_h2d(ctx.param_data(v), reinterpret_cast<const std::byte*>(&kv[1]), kF32);
        stream.synchronize();  // the host values die with this call
      };
    }
    out.push_back(std::move(hook));
  }
}

}  // namespace

std::string input_scale_w1_name(std::string_view weight) {
  return companion_name(weight, "input_scale_w1");
}

std::vector<PostLoadHook> make_input_scale_checks(const Model& model) {
  std::vector<PostLoadHook> out;
  for (std::size_t r = 0; r < model.shells().size(); ++r) {
    const RankShell& shell = model.shells()[r];
    for (std::size_t w1 = 0; w1 < shell.params.size(); ++w1) {
      const std::string& name = shell.params[w1].name;
      constexpr std::string_view kSuffix = "w13_input_scale_w1";
      if (!name.ends_with(kSuffix)) {
        continue;
      }
      const std::string weight = name.substr(0, name.size() - kSuffix.size()) + "w13_weight";
      // The slot as loaded: postprocess.target's twin, else the param itself.
      auto slot = shell.by_name.find(loaded_input_scale_name(weight));
      if (slot == shell.by_name.end()) {
        slot = shell.by_name.find(companion_name(weight, "input_scale"));
      }
      if (slot == shell.by_name.end() ||
          shell.params[slot->second].nbytes != shell.params[w1].nbytes) {
        bad(name, "no loaded w13_input_scale of its shape beside it");
      }
      const std::size_t w3 = slot->second;
      const std::uint64_t experts = shell.params[w1].nbytes / kF32;
      const std::string param = shell.params[w3].name;
      PostLoadHook hook;
      hook.name = "input_scale_check:" + name + " (tp rank " + std::to_string(shell.tp_rank) + ")";
      hook.local_rank = r;
      hook.inputs = {w3};
      hook.rewrites = {w1};  // read only; the load waits for the check
      hook.run = [w1, w3, experts, param](HookContext& ctx) {
        gpu::Stream& stream = ctx.stream();
        const std::vector<float> a = read_floats(stream, ctx.param_data(w1), experts);
        const std::vector<float> b = read_floats(stream, ctx.param_data(w3), experts);
        for (std::uint64_t e = 0; e < experts; ++e) {
          if (a[e] != 1.0f && std::fabs(a[e] - b[e]) > 1e-5f) {
            throw Error(Stage::kPostProcess, "", param,
                        "input_scales of w1 and w3 of a layer must be equal (SGLang's "
                        "FusedMoE.weight_loader for compressed-tensors): local expert " +
                            std::to_string(e) + " has " + std::to_string(a[e]) + " vs. " +
                            std::to_string(b[e]));
          }
        }
      };
      out.push_back(std::move(hook));
    }
  }
  return out;
}

namespace {

// The post-processing hooks of one rank's shell: the served weight scale and the
// static input scale of each FP8 linear weight.
class RankPostprocess {
 public:
  RankPostprocess(const TableModel& model, const QuantScheme& q,
                  const std::vector<PostLoadHook>& existing, std::size_t r)
      : model_(model),
        q_(q),
        existing_(existing),
        shell_(model.shells()[r]),
        r_(r),
        rank_note_(" (tp rank " + std::to_string(shell_.tp_rank) + ")") {}

  void add(std::vector<PostLoadHook>& out) const {
    for (std::size_t w = 0; w < shell_.params.size(); ++w) {
      const ParamSpec& weight = shell_.params[w];
      if (q_.trtllm_experts && !q_.quantized() && !weight.loaded_shape.empty()) {
        add_trtllm_bf16_experts(w, out);
        continue;
      }
      if (weight.dtype == DType::kU8 && !weight.transient && nvfp4_served(q_, weight.shape) &&
          quantized_linear_param(weight.name)) {
        if (weight.shape.size() == 2) {
          if (auto twin = find(loaded_weight_name(weight.name))) {
            add_nvfp4_padding(w, *twin, out);
          }
          add_nvfp4_scales(w, out);
          add_nvfp4_alpha(w, out, false);
          continue;
        }
        if (q_.trtllm_experts) {
          add_trtllm_experts(w, out);
        } else {
          add_nvfp4_scales(w, out);
        }
        add_nvfp4_expert_scalars(w, out);
        continue;
      }
      if (q_.method == Method::kNvfp4 && q_.target == Target::kSm90 && !weight.transient &&
          quantized_linear_param(weight.name) && find(loaded_weight_name(weight.name))) {
        add_marlin(w, out);
        if (weight.shape.size() == 2) {  // dense (the experts' scalars are their own)
          add_nvfp4_alpha(w, out, true);
        }
        continue;
      }
      if (weight.dtype != DType::kF8E4M3 || weight.transient ||
          !quantized_linear_param(weight.name)) {
        continue;
      }
      // flashinfer_trtllm's per-tensor FP8 experts: w13 shuffled by its requantizing
      // hook (add_weight_scale), w2 by its own.
      const bool trtllm_fp8 =
          q_.trtllm_experts && q_.method == Method::kFp8Tensor && weight.shape.size() == 3;
      const bool w13 = weight.name.ends_with("w13_weight");
      const std::optional<std::size_t> scale_twin = find(loaded_tensor_scale_name(weight.name));
      if (trtllm_fp8 && w13 != scale_twin.has_value()) {
        bad(weight.name, "internal: flashinfer_trtllm's FP8 experts without w13's [E, 2] scales");
      }
      if (trtllm_fp8 && !w13) {
        add_trtllm_fp8_w2(w, out);
      }
      if (scale_twin) {
        add_weight_scale(w, *scale_twin, out);
      }
      if (auto twin = find(loaded_input_scale_name(weight.name))) {
        add_input_scale(w, *twin, out);
      }
      if (trtllm_fp8 && w13) {
        add_trtllm_fp8_scalars(w, out);
      }
    }
  }

 private:
  std::optional<std::size_t> find(const std::string& name) const {
    auto it = shell_.by_name.find(name);
    return it == shell_.by_name.end() ? std::nullopt : std::optional<std::size_t>(it->second);
  }
  std::size_t need(const std::string& name, const Shape& shape, const std::string& of,
                   DType dtype = DType::kF32) const {
    auto p = find(name);
    if (!p || shell_.params[*p].shape != shape || shell_.params[*p].dtype != dtype) {
      bad(name, "the model declares no " + std::string(dtype_name(dtype)) + " " +
                    format_shape(shape) + " parameter for " + of);
    }
    return *p;
  }
  // A hook of this rank writing `output` from `input`, named after `what`, after the
  // hooks that read `input` as loaded.
  PostLoadHook hook_for(const std::string& what, std::size_t input, std::size_t output) const {
    PostLoadHook hook;
    hook.name = "postprocess_" + std::string(to_string(q_.target)) + ":" + what + rank_note_;
    hook.local_rank = r_;
    hook.inputs = {input};
    hook.outputs = {output};
    after(hook, {input});
    return hook;
  }

  // A flashinfer_trtllm hook of this rank rewriting `param` in place, expert by
  // expert, with scratch for two experts of `bytes`.
  PostLoadHook trtllm_hook(const std::string& what, std::size_t param, std::uint64_t bytes) const {
    PostLoadHook hook;
    hook.name = "postprocess_sm100:" + what + " (flashinfer_trtllm)" + rank_note_;
    hook.local_rank = r_;
    hook.rewrites = {param};
    after(hook, {param});
    hook.scratch_bytes = 2 * bytes;
    return hook;
  }

  // After every hook that reads one of `params` as loaded.
  void after(PostLoadHook& hook, std::initializer_list<std::size_t> params) const {
    for (const PostLoadHook& h : existing_) {
      if (h.local_rank == r_ && !h.outputs.empty() &&
          std::any_of(h.inputs.begin(), h.inputs.end(), [&](std::size_t p) {
            return std::find(params.begin(), params.end(), p) != params.end();
          })) {
        hook.inputs.push_back(h.outputs.front());
      }
    }
  }

  // The weight scale in its served form, from weight w's loaded scales `twin`
  // (requantizing the weight where the form keeps one scale for several).
  void add_weight_scale(std::size_t w, std::size_t twin, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const Shape& ts = shell_.params[twin].shape;
    const bool experts = weight.shape.size() == 3;
    const std::vector<std::uint64_t> starts = model_.shard_starts(weight.name);
    const std::uint64_t shards = experts ? (ts.size() == 2 ? ts[1] : 1) : starts.size();
    const ScaleForm form = scale_form(q_, weight.shape, shards);
    if (form == ScaleForm::kAsLoaded) {
      bad(weight.name, "internal: a loaded-scale twin without a served form");
    }
    const std::size_t output = need(weight_scale_name(q_, weight.name),
                                    served_scale_shape(form, weight.shape), weight.name);
    const std::uint64_t rows = weight.shape[weight.shape.size() - 2];
    const std::uint64_t cols = weight.shape.back();
    std::vector<std::uint64_t> widths;
    if (experts) {
      if (ts != Shape{weight.shape[0], 2} || rows % 2 != 0) {
        bad(shell_.params[twin].name, "expected F32 [E, 2] scales for " + weight.name);
      }
    } else {
      if (ts != Shape{starts.size()} || starts.empty() || starts.front() != 0 ||
          starts.back() >= rows) {
        bad(shell_.params[twin].name, "its " + format_shape(ts) + " scales do not match the " +
                                          std::to_string(starts.size()) + " shards of " +
                                          weight.name);
      }
      for (std::size_t i = 0; i < starts.size(); ++i) {
        widths.push_back((i + 1 < starts.size() ? starts[i + 1] : rows) - starts[i]);
      }
    }
    PostLoadHook hook;
    hook.name = "postprocess_" + std::string(to_string(q_.target)) + ":" + weight.name + rank_note_;
    hook.local_rank = r_;
    hook.inputs = {twin};
    hook.outputs = {output};
    const bool requant = form != ScaleForm::kChannelwise;
    if (requant) {
      hook.rewrites = {w};
    }
    after(hook, {w, twin});
    const std::uint64_t max_width =
        experts ? rows : *std::max_element(widths.begin(), widths.end());
    const std::uint64_t slot_count = experts ? 2 : widths.size();
    hook.scratch_bytes = requant ? max_width * cols * 2 + slot_count * kF32 : 0;
    // flashinfer_trtllm (align_fp8_moe_weights_for_flashinfer_trtllm): each requantized
    // expert then reordered for the gated activation (up rows first: Fp8MoEMethod
    // loads them so, ModelOpt flips its [gate | up]) and its rows shuffled, through
    // the F16 scratch (two experts of FP8).
    const bool shuffle = experts && q_.trtllm_experts;
    const bool up_first = trtllm_loads_up_first(q_);
    hook.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      const std::byte* loaded = ctx.param_data(twin);
      std::byte* od = ctx.param_data(output);
      if (form == ScaleForm::kChannelwise) {
        std::uint64_t row = 0;
        for (std::size_t i = 0; i < widths.size(); ++i) {
          broadcast_rows(stream, od + row * kF32, loaded + i * kF32, widths[i]);
          row += widths[i];
        }
        return;
      }
      std::byte* wd = ctx.param_data(w);
      std::byte* values = ctx.scratch(max_width * cols * 2 + slot_count * kF32);
      std::byte* slots = values + max_width * cols * 2;
      const gpu::Fp8Scales one{gpu::Fp8Granularity::kTensor, 0, 0, 1};
      const gpu::Fp8Scales all{gpu::Fp8Granularity::kTensor, 0, 0, slot_count};
      if (experts) {
        // Per expert: w1 and w3 dequantized to F16 with their own scales, then
        // both quantized with the larger one, which goes to w13_weight_scale[e].
        const std::uint64_t half = rows / 2;
        for (std::uint64_t e = 0; e < weight.shape[0]; ++e) {
          std::byte* m = wd + e * rows * cols;
          const std::byte* s = loaded + e * 2 * kF32;
          stream.copy_d2d_2d(slots, 2 * kF32, s, 2 * kF32, 2 * kF32, 1);
          stream.dequantize_fp8(values, DType::kF16, m, s, one, half, cols, 2);
          stream.quantize_fp8(m, slots, values, DType::kF16, all, gpu::Fp8ScaleRule::kStatic, rows,
                              cols, 1);
          stream.copy_d2d_2d(od + e * kF32, kF32, slots, kF32, kF32, 1);
          if (shuffle) {
            interleave_up_gate(stream, values, m, rows, cols, up_first);
            shuffle_rows_32(stream, m, values, values + rows * cols, rows, cols);
          }
        }
        return;
      }
      // Dense: every shard requantized to the largest of the S scales, the slots
      // (a copy of them) holding it after the first shard's quantize.
      stream.copy_d2d_2d(slots, slot_count * kF32, loaded, slot_count * kF32, slot_count * kF32, 1);
      std::uint64_t row = 0;
      for (std::size_t i = 0; i < widths.size(); ++i) {
        std::byte* m = wd + row * cols;
        stream.dequantize_fp8(values, DType::kF16, m, loaded + i * kF32, one, widths[i], cols, 1);
        stream.quantize_fp8(m, slots, values, DType::kF16, all, gpu::Fp8ScaleRule::kStatic,
                            widths[i], cols, 1);
        row += widths[i];
      }
      if (form == ScaleForm::kMaxScalar) {
        stream.copy_d2d_2d(od, kF32, slots, kF32, kF32, 1);
      } else {
        broadcast_rows(stream, od, slots, rows);
      }
    };
    out.push_back(std::move(hook));
  }

  // Per-tensor FP8 fused experts under flashinfer_trtllm: w2's rows of each expert
  // shuffled in place (shuffle_matrix_a; w13's are in add_weight_scale).
  void add_trtllm_fp8_w2(std::size_t w, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const std::uint64_t experts = weight.shape[0];
    const std::uint64_t n = weight.shape[1];
    const std::uint64_t k = weight.shape[2];
    if (n % 32 != 0) {
      bad(weight.name, "internal: flashinfer_trtllm FP8 experts of " + format_shape(weight.shape));
    }
    const std::uint64_t bytes = n * k;
    PostLoadHook hook = trtllm_hook(weight.name, w, bytes);
    hook.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      std::byte* a = ctx.scratch(2 * bytes);
      for (std::uint64_t e = 0; e < experts; ++e) {
        std::byte* m = ctx.param_data(w) + e * bytes;
        stream.copy_d2d_2d(a, bytes, m, bytes, bytes, 1);
        shuffle_rows_32(stream, m, a, a + bytes, n, k);
      }
    };
    out.push_back(std::move(hook));
  }

  // Per-tensor FP8 fused experts under flashinfer_trtllm: the F32 [E] scalars
  // align_fp8_moe_weights_for_flashinfer_trtllm adds from the served scales (the
  // input scales their max, w13's requantized: the hooks above), in torch's order:
  //   output1_scales_scalar[e] = w13_weight_scale[e] * in13 * (1 / in2),
  //   output1_scales_gate_scalar[e] = w13_weight_scale[e] * in13,
  //   output2_scales_scalar[e] = in2 * w2_weight_scale[e].
  void add_trtllm_fp8_scalars(std::size_t w, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const std::uint64_t experts = weight.shape[0];
    const Shape per_expert{experts};
    const std::size_t s13 =
        need(companion_name(weight.name, "weight_scale"), per_expert, weight.name);
    const std::size_t s2 =
        need(experts_param(weight.name, "w2_weight_scale"), per_expert, weight.name);
    const std::size_t in13 = need(companion_name(weight.name, "input_scale"), Shape{}, weight.name);
    const std::size_t in2 =
        need(experts_param(weight.name, "w2_input_scale"), Shape{}, weight.name);
    std::vector<std::size_t> outputs;
    for (const std::string& name : trtllm_fp8_scalars(q_, weight.name, true)) {
      outputs.push_back(need(name, per_expert, weight.name));
    }
    PostLoadHook hook;
    hook.name = "postprocess_sm100:" + experts_param(weight.name, "output_scales") +
                " (flashinfer_trtllm)" + rank_note_;
    hook.local_rank = r_;
    hook.inputs = {s13, s2, in13, in2};
    hook.outputs = outputs;
    hook.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      const std::vector<float> w13s = read_floats(stream, ctx.param_data(s13), experts);
      const std::vector<float> w2s = read_floats(stream, ctx.param_data(s2), experts);
      const float input = read_floats(stream, ctx.param_data(in13), 1)[0];
      const float activation = read_floats(stream, ctx.param_data(in2), 1)[0];
      const float inverse = 1.0f / activation;
      std::vector<std::vector<float>> values(3);
      for (std::uint64_t e = 0; e < experts; ++e) {
        const float gate = w13s[e] * input;
        values[0].push_back(gate * inverse);
        values[1].push_back(gate);
        values[2].push_back(activation * w2s[e]);
      }
      for (std::size_t o = 0; o < outputs.size(); ++o) {
        write_floats(stream, ctx.param_data(outputs[o]), values[o], experts);
      }
    };
    out.push_back(std::move(hook));
  }

  // Dense NVFP4 on kSm100 that pad_nvfp4_weight pads: the param [N', K' / 2] is the
  // weight as loaded (its twin [N, K / 2]) with zeros after each row and below.
  void add_nvfp4_padding(std::size_t w, std::size_t twin, std::vector<PostLoadHook>& out) const {
    const Shape& from = shell_.params[twin].shape;
    const Shape& to = shell_.params[w].shape;
    if (from.size() != 2 || to.size() != 2 || to[0] < from[0] || to[1] < from[1]) {
      bad(shell_.params[w].name,
          "internal: an NVFP4 weight " + format_shape(to) + " padded from " + format_shape(from));
    }
    PostLoadHook hook = hook_for(shell_.params[w].name, twin, w);
    hook.run = [w, twin, from, to](HookContext& ctx) {
      ctx.stream().zero(ctx.param_data(w), to[0] * to[1]);
      ctx.stream().copy_d2d_2d(ctx.param_data(w), to[1], ctx.param_data(twin), from[1], from[1],
                               from[0]);
    };
    out.push_back(std::move(hook));
  }

  // NVFP4 on kSm100: the E4M3 block scales [M, C] zero-padded to [M', C'] and
  // swizzled (SGLang 0.5.23's swizzle_blockscale), over weight_scale from its loaded
  // twin, or into weight_scale_interleaved (fused experts: <layer>.w13_blockscale_swizzled,
  // each expert's [M, C] as one matrix) beside it.
  void add_nvfp4_scales(std::size_t w, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const bool experts = weight.shape.size() == 3;
    const std::uint64_t batches = experts ? weight.shape[0] : 1;
    // The rows as loaded (a padded weight's twin's: the scales are not padded with it).
    const std::optional<std::size_t> loaded = find(loaded_weight_name(weight.name));
    const Shape& ws = loaded ? shell_.params[*loaded].shape : weight.shape;
    const std::uint64_t rows = ws[ws.size() - 2];
    const std::string served = companion_name(weight.name, "weight_scale");
    const std::optional<std::size_t> twin = find(loaded_tensor_scale_name(weight.name));
    const std::optional<std::size_t> src = twin ? twin : find(served);
    const Shape* ss = src ? &shell_.params[*src].shape : nullptr;
    if (!src || shell_.params[*src].dtype != DType::kF8E4M3 || ss->size() != weight.shape.size() ||
        (*ss)[ss->size() - 2] != rows || (experts && (*ss)[0] != batches)) {
      bad(served, "the model declares no E4M3 [" + std::string(experts ? "E, " : "") +
                      std::to_string(rows) + ", K / 16] block scales for " + weight.name);
    }
    const std::uint64_t m = rows;
    const std::uint64_t c = ss->back();
    const std::uint64_t mp = (m + 127) / 128 * 128;
    const std::uint64_t cp = (c + 3) / 4 * 4;
    const std::string dst_name =
        twin ? served
             : companion_name(weight.name,
                              experts ? "blockscale_swizzled" : "weight_scale_interleaved");
    Shape dst_shape{mp, cp};
    if (experts) {
      dst_shape.insert(dst_shape.begin(), batches);
    }
    const std::size_t dst = need(dst_name, dst_shape, weight.name, DType::kF8E4M3);
    PostLoadHook hook;
    hook.name = "postprocess_sm100:" + dst_name + rank_note_;
    hook.local_rank = r_;
    hook.inputs = {*src};
    hook.outputs = {dst};
    after(hook, {w, *src});
    // Where nothing pads, the experts are one matrix of E * M rows.
    const bool padded = m != mp || c != cp;
    const std::uint64_t count = padded ? batches : 1;
    const std::uint64_t matrix_rows = padded ? mp : mp * batches;
    hook.scratch_bytes = 2 * matrix_rows * cp;
    const std::size_t from = *src;
    hook.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      for (std::uint64_t b = 0; b < count; ++b) {
        // The padded scales (scratch's first half, or the twin itself where nothing
        // pads), then the groups in its second half.
        const std::byte* in = pad_rows(ctx, ctx.param_data(from) + b * m * c, m, c, mp, cp);
        std::byte* tmp = ctx.scratch(2 * matrix_rows * cp) + matrix_rows * cp;
        swizzle_128x4(stream, ctx.param_data(dst) + b * mp * cp, in, tmp, matrix_rows, cp);
      }
    };
    out.push_back(std::move(hook));
  }

  // NVFP4 fused experts on kSm100 under flashinfer_trtllm
  // (align_fp4_moe_weights_for_flashinfer_trtllm, prepare_static_weights_for_trtllm_fp4_moe):
  // each expert's weight rows, and its block scales' rows, in place: w13 as loaded up
  // rows first and reordered for the gated activation (interleave_up_gate), then
  // both w13 and w2 shuffled (shuffle_rows_32); the scales then swizzled as
  // nvfp4_block_scale_interleave does (swizzle_128x4, nothing padded:
  // sm100_experts_unaligned refused that).
  void add_trtllm_experts(std::size_t w, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const bool w13 = weight.name.ends_with("w13_weight");
    const std::uint64_t experts = weight.shape[0];
    const std::uint64_t n = weight.shape[1];
    const std::uint64_t k = weight.shape[2] * 2;
    const std::string scale_name = companion_name(weight.name, "weight_scale");
    const std::size_t scale =
        need(scale_name, Shape{experts, n, k / 16}, weight.name, DType::kF8E4M3);
    if (n % 128 != 0 || (k / 16) % 4 != 0) {
      bad(weight.name, "internal: flashinfer_trtllm experts of " + format_shape(weight.shape));
    }
    for (const bool scales : {false, true}) {
      const std::size_t param = scales ? scale : w;
      const std::uint64_t row_bytes = scales ? k / 16 : k / 2;
      const std::uint64_t bytes = n * row_bytes;
      PostLoadHook hook = trtllm_hook(scales ? scale_name : weight.name, param, bytes);
      hook.run = [=](HookContext& ctx) {
        gpu::Stream& stream = ctx.stream();
        std::byte* a = ctx.scratch(2 * bytes);
        std::byte* b = a + bytes;
        for (std::uint64_t e = 0; e < experts; ++e) {
          std::byte* m = ctx.param_data(param) + e * bytes;
          // Rows to shuffle: the expert's own (w2), or w13's interleaved into a.
          const std::byte* rows = m;
          if (w13) {
            interleave_up_gate(stream, a, m, n, row_bytes, false);
            rows = a;
          }
          // Shuffled into the expert (weights) or into b (scales, swizzled from
          // there into the expert), through whichever buffer is free.
          std::byte* shuffled = scales ? b : m;
          std::byte* tmp = !w13 ? a : (scales ? m : b);
          shuffle_rows_32(stream, shuffled, rows, tmp, n, row_bytes);
          if (scales) {
            swizzle_128x4(stream, m, b, a, n, row_bytes);
          }
        }
      };
      out.push_back(std::move(hook));
    }
  }

  // BF16 fused experts on kSm100 under flashinfer_trtllm
  // (UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout), each expert in
  // place: its [N, K] rows permuted as FlashInfer's indices say (w13, loaded up rows
  // first: _maybe_get_cached_w3_w1_permute_indices, the gated reorder then
  // shuffle_matrix_a; w2: get_w2_permute_indices_with_cache, the shuffle alone), then
  // convert_to_block_layout of the rows as bytes with blockK 128: [N][K / 64][128 B]
  // to [K / 64][N][128 B], the param's served [K / 64, N, 64] (TableModel::serve_as).
  void add_trtllm_bf16_experts(std::size_t w, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const bool w13 = weight.name.ends_with("w13_weight");
    const Shape& ls = weight.loaded_shape;
    if (weight.dtype != DType::kBF16 || ls.size() != 3 || weight.shape.size() != 4 ||
        ls[1] % 32 != 0 || ls[2] % 64 != 0 || (w13 && ls[1] % 2 != 0)) {
      bad(weight.name, "internal: flashinfer_trtllm BF16 experts of " + format_shape(ls));
    }
    const std::uint64_t experts = ls[0];
    const std::uint64_t n = ls[1];
    const std::uint64_t row_bytes = ls[2] * 2;
    const std::uint64_t blocks = row_bytes / 128;
    const std::uint64_t bytes = n * row_bytes;
    PostLoadHook hook = trtllm_hook(weight.name, w, bytes);
    hook.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      std::byte* a = ctx.scratch(2 * bytes);
      std::byte* b = a + bytes;
      for (std::uint64_t e = 0; e < experts; ++e) {
        std::byte* m = ctx.param_data(w) + e * bytes;
        const std::byte* rows = m;
        if (w13) {  // loaded [up | gate]
          interleave_up_gate(stream, a, m, n, row_bytes, true);
          rows = a;
        }
        shuffle_rows_32(stream, b, rows, w13 ? m : a, n, row_bytes);
        // [N][blocks * 16] words of 8 bytes to [blocks * 16][N], then each block's
        // [16][N] to [N][16].
        stream.transpose(a, bytes, b, bytes, 8, n, blocks * 16, 1);
        stream.transpose(m, n * 128, a, n * 128, 8, 16, n, blocks);
      }
    };
    out.push_back(std::move(hook));
  }

  // NVFP4 fused experts on kSm100: the F32 scalars ModelOptNvFp4FusedMoEMethod.
  // process_weights_after_loading adds (nvfp4_expert_scalars), from weight_scale_2
  // and the input scales as loaded (read back to the host: a few per expert).
  // flashinfer_trtllm takes one input scale for all experts (its max); the default
  // runner each expert's (w13's: the larger of w1's and w3's, max(dim=-1)):
  //   g1_alphas[e] = in13[e] * s2[e][0], g1_alphas_up[e] = in13[e] * s2[e][1],
  //   w13_input_scale_quant = 1 / in13, g2_alphas[e] = in2[e] * w2 s2[e],
  //   w2_input_scale_quant = 1 / in2, g1_scale_c[e] = (1 / in2) * g1_alphas_up[e]
  //   (_compute_gemm1_alphas, _compute_g1_scale_c).
  void add_nvfp4_expert_scalars(std::size_t w, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const bool w13 = weight.name.ends_with("w13_weight");
    const bool trtllm = q_.trtllm_experts;
    const std::uint64_t experts = weight.shape[0];
    const std::size_t s2 = need(companion_name(weight.name, "weight_scale_2"),
                                w13 ? Shape{experts, 2} : Shape{experts}, weight.name);
    // The input scales: w13's or w2's own, and (trtllm's g1_scale_c) w2's.
    std::vector<std::optional<std::size_t>> inputs{
        find(companion_name(weight.name, "input_scale"))};
    if (trtllm && w13) {
      inputs.push_back(find(experts_param(weight.name, "w2_input_scale")));
    }
    std::vector<std::uint64_t> counts;
    for (const std::optional<std::size_t>& in : inputs) {
      const std::uint64_t count = in ? shell_.params[*in].nbytes / kF32 : 0;
      const std::uint64_t per_expert = w13 && counts.empty() ? 2 : 1;
      if (in && (shell_.params[*in].dtype != DType::kF32 ||
                 (!trtllm && count != experts * per_expert) || count == 0)) {
        bad(shell_.params[*in].name,
            "expected F32 input scales, " + std::to_string(per_expert) + " for each of the " +
                std::to_string(experts) + " experts" +
                (trtllm ? "" : " (SGLang's default runner multiplies them by the local ones)"));
      }
      counts.push_back(count);
    }
    std::vector<std::size_t> outputs;
    std::vector<std::uint64_t> written;  // elements of each output
    for (const auto& [name, scalar] : nvfp4_expert_scalars(q_, weight.name, true)) {
      outputs.push_back(need(name, scalar ? Shape{} : Shape{experts}, weight.name));
      written.push_back(scalar ? 1 : experts);
    }
    PostLoadHook hook;
    hook.name = "postprocess_sm100:" + experts_param(weight.name, w13 ? "g1_alphas" : "g2_alphas") +
                rank_note_;
    hook.local_rank = r_;
    hook.inputs = {s2};
    for (const std::optional<std::size_t>& in : inputs) {
      if (in) {
        hook.inputs.push_back(*in);
      }
    }
    hook.outputs = outputs;
    after(hook, {s2});
    hook.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      const std::vector<float> second =
          read_floats(stream, ctx.param_data(s2), experts * (w13 ? 2 : 1));
      // Each expert's input scale (SGLang's create_weights fills a missing one with 1.0).
      std::vector<std::vector<float>> scale(inputs.size());
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        const std::vector<float> loaded =
            inputs[i] ? read_floats(stream, ctx.param_data(*inputs[i]), counts[i])
                      : std::vector<float>(experts * (w13 && i == 0 ? 2 : 1), 1.0f);
        const std::size_t per = w13 && i == 0 ? 2 : 1;
        for (std::size_t e = 0; e < loaded.size() / per; ++e) {
          scale[i].push_back(torch_max(
              std::vector<float>(loaded.begin() + e * per, loaded.begin() + (e + 1) * per)));
        }
        if (trtllm) {
          scale[i].assign(experts, torch_max(scale[i]));
        }
      }
      std::vector<std::vector<float>> values(outputs.size());
      for (std::uint64_t e = 0; e < experts; ++e) {
        const float in = scale[0][e];
        if (w13) {
          values[0].push_back(in * second[2 * e]);
          values[1].push_back(in * second[2 * e + 1]);
          values[2].push_back(1.0f / in);
          if (trtllm) {
            values[3].push_back((1.0f / scale[1][e]) * values[1].back());
          }
        } else {
          values[0].push_back(in * second[e]);
          values[1].push_back(1.0f / in);
        }
      }
      for (std::size_t o = 0; o < outputs.size(); ++o) {
        write_floats(stream, ctx.param_data(outputs[o]), values[o], written[o]);
      }
    };
    out.push_back(std::move(hook));
  }

  // NVFP4 on kSm90: Marlin's weight and scales from their loaded twins, each padded
  // with zeros in scratch first where the Marlin shape is larger.
  void add_marlin(std::size_t w, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const std::size_t loaded = *find(loaded_weight_name(weight.name));
    const Shape& ls = shell_.params[loaded].shape;
    if (ls.size() == 3) {
      add_marlin_experts(w, loaded, out);
      return;
    }
    if (shell_.params[loaded].dtype != DType::kU8 || ls.size() != 2) {
      bad(shell_.params[loaded].name, "expected the U8 [N, K / 2] NVFP4 weight as loaded");
    }
    const std::uint64_t n = ls[0];
    const std::uint64_t k = ls[1] * 2;
    const Shape padded = marlin_padded_shape(Shape{n, k});
    const std::uint64_t np = padded[0];
    const std::uint64_t kp = padded[1];
    const std::uint64_t groups = kp / 16;
    need(weight.name, marlin_weight_shape(Shape{n, k}), weight.name, DType::kI32);
    const std::string scale_name = companion_name(weight.name, "weight_scale");
    const std::size_t twin =
        need(loaded_tensor_scale_name(weight.name), Shape{n, k / 16}, weight.name, DType::kF8E4M3);
    const std::size_t scale = need(scale_name, Shape{groups, np}, weight.name, DType::kF8E4M3);
    const bool pad = np != n || kp != k;
    PostLoadHook repack = hook_for(weight.name, loaded, w);
    repack.scratch_bytes = pad ? np * kp / 2 : 0;
    repack.run = [=](HookContext& ctx) {
      const std::byte* src = pad_rows(ctx, ctx.param_data(loaded), n, k / 2, np, kp / 2);
      ctx.stream().repack_marlin_fp4(ctx.param_data(w), src, np, kp);
    };
    out.push_back(std::move(repack));
    PostLoadHook scales = hook_for(scale_name, twin, scale);
    scales.scratch_bytes = pad ? np * groups : 0;
    scales.run = [=](HookContext& ctx) {
      const std::byte* src = pad_rows(ctx, ctx.param_data(twin), n, k / 16, np, groups);
      ctx.stream().marlin_fp4_scales(ctx.param_data(scale), src, np, groups);
    };
    out.push_back(std::move(scales));
    if (auto bias = find(loaded_bias_name(weight.name))) {
      add_marlin_bias(*bias, companion_name(weight.name, "bias"), n, np, out);
    }
  }

  // marlin_permute_bias of the zero-padded bias: in each run of 32 elements, the
  // pairs at 2 * (4a + i) go to 2 * (4i + a) (scale_perm_single): a 4 x 4 transpose
  // of two-element units.
  void add_marlin_bias(std::size_t loaded, const std::string& name, std::uint64_t n,
                       std::uint64_t np, std::vector<PostLoadHook>& out) const {
    const DType dtype = shell_.params[loaded].dtype;
    const std::size_t es = dtype_size(dtype);
    if (shell_.params[loaded].shape != Shape{n}) {
      bad(shell_.params[loaded].name, "expected the bias as loaded, [" + std::to_string(n) + "]");
    }
    const std::size_t bias = need(name, Shape{np}, name, dtype);
    PostLoadHook hook = hook_for(name, loaded, bias);
    hook.scratch_bytes = np != n ? np * es : 0;
    hook.run = [=](HookContext& ctx) {
      const std::byte* src = pad_rows(ctx, ctx.param_data(loaded), 1, n * es, 1, np * es);
      ctx.stream().transpose(ctx.param_data(bias), 32 * es, src, 32 * es, 2 * es, 4, 4, np / 32);
    };
    out.push_back(std::move(hook));
  }

  // NVFP4 fused experts on kSm90 (the Marlin branch of ModelOptNvFp4FusedMoEMethod.
  // process_weights_after_loading, prepare_moe_nvfp4_layer_for_marlin): each
  // expert's weight and scales as a dense linear's, unpadded; weight_scale_2 [E] in
  // the model dtype from w1's column of [E, 2] (or the [E] as loaded), processed as
  // the dense global scale.
  void add_marlin_experts(std::size_t w, std::size_t loaded, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const Shape& ls = shell_.params[loaded].shape;
    const std::uint64_t experts = ls[0];
    const std::uint64_t n = ls[1];
    const std::uint64_t k = ls[2] * 2;
    const std::uint64_t groups = k / 16;
    if (shell_.params[loaded].dtype != DType::kU8 || n % 64 != 0 || k % 16 != 0) {
      bad(shell_.params[loaded].name, "expected U8 [E, N, K / 2] experts, N % 64 = K % 16 = 0");
    }
    need(weight.name, Shape{experts, k / 16, 2 * n}, weight.name, DType::kI32);
    const std::string scale_name = companion_name(weight.name, "weight_scale");
    const std::size_t twin = need(loaded_tensor_scale_name(weight.name), Shape{experts, n, groups},
                                  weight.name, DType::kF8E4M3);
    const std::size_t scale =
        need(scale_name, Shape{experts, groups, n}, weight.name, DType::kF8E4M3);
    const std::optional<std::size_t> s2_loaded = find(loaded_scale_2_name(weight.name));
    if (!s2_loaded || shell_.params[*s2_loaded].dtype != DType::kF32 ||
        shell_.params[*s2_loaded].shape.empty() || shell_.params[*s2_loaded].shape[0] != experts) {
      bad(loaded_scale_2_name(weight.name), "expected F32 [E] or [E, 2] for " + weight.name);
    }
    const std::uint64_t columns = shell_.params[*s2_loaded].nbytes / kF32 / experts;
    const DType dtype = q_.params_dtype;
    const std::size_t s2 =
        need(companion_name(weight.name, "weight_scale_2"), Shape{experts}, weight.name, dtype);
    const std::uint64_t bytes = n * k / 2;
    PostLoadHook repack = hook_for(weight.name, loaded, w);
    repack.run = [=](HookContext& ctx) {
      for (std::uint64_t e = 0; e < experts; ++e) {
        ctx.stream().repack_marlin_fp4(ctx.param_data(w) + e * bytes,
                                       ctx.param_data(loaded) + e * bytes, n, k);
      }
    };
    out.push_back(std::move(repack));
    PostLoadHook scales = hook_for(scale_name, twin, scale);
    scales.run = [=](HookContext& ctx) {
      for (std::uint64_t e = 0; e < experts; ++e) {
        ctx.stream().marlin_fp4_scales(ctx.param_data(scale) + e * n * groups,
                                       ctx.param_data(twin) + e * n * groups, n, groups);
      }
    };
    out.push_back(std::move(scales));
    PostLoadHook global = hook_for(companion_name(weight.name, "weight_scale_2"), *s2_loaded, s2);
    global.scratch_bytes = experts * kF32;
    const std::size_t from = *s2_loaded;
    global.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      const std::vector<float> loaded_values =
          read_floats(stream, ctx.param_data(from), experts * columns);
      std::vector<float> values(experts);
      for (std::uint64_t e = 0; e < experts; ++e) {
        values[e] = loaded_values[e * columns];  // w1's where w1 and w3 each have one
      }
      write_global_scales(stream, values, ctx.param_data(s2), ctx.scratch(experts * kF32), dtype);
    };
    out.push_back(std::move(global));
  }

  // NVFP4: alpha = input_scale.max() * weight_scale_2.max() and input_scale_inv =
  // 1 / input_scale.max(), F32 [] each, from the [S] scales as loaded (read back to
  // the host: a few scalars). `marlin` (kSm90): also input_global_scale F32 [] =
  // input_scale.max() and weight_global_scale [1] = weight_scale_2.max() rounded to
  // the model dtype, times 2^119 (BF16) or 2^7 (F16) in it
  // (nvfp4_marlin_process_global_scale): the rounding is the device's cast.
  void add_nvfp4_alpha(std::size_t w, std::vector<PostLoadHook>& out, bool marlin) const {
    const ParamSpec& weight = shell_.params[w];
    const std::string s2_name = companion_name(weight.name, "weight_scale_2");
    const std::optional<std::size_t> s2 = find(s2_name);
    if (!s2 || shell_.params[*s2].dtype != DType::kF32 || shell_.params[*s2].nbytes == 0) {
      bad(s2_name, "the model declares no F32 weight_scale_2 for " + weight.name);
    }
    const std::optional<std::size_t> in = find(companion_name(weight.name, "input_scale"));
    if (in && (shell_.params[*in].dtype != DType::kF32 || shell_.params[*in].nbytes == 0)) {
      bad(shell_.params[*in].name, "an NVFP4 input_scale must be F32 [S]");
    }
    const std::size_t alpha = need(companion_name(weight.name, "alpha"), Shape{}, weight.name);
    const std::size_t inv =
        need(companion_name(weight.name, "input_scale_inv"), Shape{}, weight.name);
    const std::uint64_t n2 = shell_.params[*s2].nbytes / kF32;
    const std::uint64_t ni = in ? shell_.params[*in].nbytes / kF32 : 0;
    const DType dtype = q_.params_dtype;
    std::size_t input_global = 0;
    std::size_t weight_global = 0;
    if (marlin) {
      input_global = need(companion_name(weight.name, "input_global_scale"), Shape{}, weight.name);
      weight_global =
          need(companion_name(weight.name, "weight_global_scale"), Shape{1}, weight.name, dtype);
    }
    PostLoadHook hook;
    hook.name = "postprocess_" + std::string(to_string(q_.target)) + ":" +
                companion_name(weight.name, "alpha") + rank_note_;
    hook.local_rank = r_;
    hook.inputs = {*s2};
    if (in) {
      hook.inputs.push_back(*in);
    }
    hook.outputs = {alpha, inv};
    if (marlin) {
      hook.outputs.push_back(input_global);
      hook.outputs.push_back(weight_global);
      hook.scratch_bytes = kF32;
    }
    after(hook, {*s2});
    const std::size_t s2_param = *s2;
    const std::optional<std::size_t> in_param = in;
    hook.run = [=](HookContext& ctx) {
      gpu::Stream& stream = ctx.stream();
      // SGLang's create_weights fills an input_scale nothing loads with 1.0.
      const std::vector<float> second = read_floats(stream, ctx.param_data(s2_param), n2);
      const std::vector<float> input =
          in_param && ni > 0 ? read_floats(stream, ctx.param_data(*in_param), ni)
                             : std::vector<float>(std::max<std::uint64_t>(ni, 1), 1.0f);
      const float is = torch_max(input);
      float values[2] = {is * torch_max(second), 1.0f / is};
      stream.copy_h2d(ctx.param_data(alpha), reinterpret_cast<const std::byte*>(&values[0]), kF32);
      stream.copy_h2d(ctx.param_data(inv), reinterpret_cast<const std::byte*>(&values[1]), kF32);
      if (marlin) {
        stream.copy_h2d(ctx.param_data(input_global), reinterpret_cast<const std::byte*>(&is),
                        kF32);
        std::vector<float> global{torch_max(second)};
        write_global_scales(stream, global, ctx.param_data(weight_global), ctx.scratch(kF32),
                            dtype);
      }
      stream.synchronize();  // the host values die with this call
    };
    out.push_back(std::move(hook));
  }

  // The static input scale: the max of the loaded ones.
  void add_input_scale(std::size_t w, std::size_t twin, std::vector<PostLoadHook>& out) const {
    const ParamSpec& weight = shell_.params[w];
    const std::size_t output =
        need(companion_name(weight.name, "input_scale"), Shape{}, weight.name);
    const std::uint64_t count = shell_.params[twin].nbytes / kF32;
    PostLoadHook hook;
    hook.name = "postprocess_" + std::string(to_string(q_.target)) + ":" +
                companion_name(weight.name, "input_scale") + rank_note_;
    hook.local_rank = r_;
    hook.inputs = {twin};
    hook.outputs = {output};
    after(hook, {twin});
    hook.scratch_bytes = max_scratch(count);
    hook.run = [=](HookContext& ctx) {
      max_into(ctx.stream(), ctx.param_data(output), ctx.param_data(twin), count,
               ctx.scratch(max_scratch(count)));
    };
    out.push_back(std::move(hook));
  }

  const TableModel& model_;
  const QuantScheme& q_;
  const std::vector<PostLoadHook>& existing_;
  const RankShell& shell_;
  std::size_t r_;
  std::string rank_note_;
};

}  // namespace

std::vector<PostLoadHook> make_postprocess_hooks(const TableModel& model, const QuantScheme& q) {
  std::vector<PostLoadHook> out;
  if (q.target == Target::kLoader) {
    return out;
  }
  const std::vector<PostLoadHook> existing = model.hooks();
  for (std::size_t r = 0; r < model.shells().size(); ++r) {
    if (kv_scales_served(q)) {
      add_kv_scale_hooks(model.shells()[r], r, q, out);
    }
    RankPostprocess(model, q, existing, r).add(out);
  }
  return out;
}

}  // namespace ferry::models
