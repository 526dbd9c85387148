#include "models/placement.hpp"

#include <algorithm>
#include <string>

#include "common/error.hpp"

namespace ferry::models {
namespace {

[[noreturn]] void fail(std::string_view what, const std::string& rule) {
  throw Error(Stage::kPlacement, "", std::string(what), rule);
}

std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, std::string_view what) {
  std::uint64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    fail(what, "size overflows 64 bits");
  }
  return out;
}

std::uint64_t product(const Shape& shape, std::size_t first, std::size_t last,
                      std::string_view what) {
  std::uint64_t n = 1;
  for (std::size_t i = first; i < last; ++i) {
    n = checked_mul(n, shape[i], what);
  }
  return n;
}

void check_parts(int index, int parts, std::string_view what) {
  if (parts < 1 || index < 0 || index >= parts) {
    fail("", std::string(what) + ": part " + std::to_string(index) + " of " +
                 std::to_string(parts) + " does not exist");
  }
}

// The shape left after fixing the leading `index` entries; a scalar counts as [1].
Shape view_of(const Shape& shape, const std::vector<std::uint64_t>& index,
              std::string_view param_name, const char* side) {
  if (index.size() > shape.size()) {
    fail(param_name, std::string("internal: ") + side + " index has " +
                         std::to_string(index.size()) + " entries for shape " +
                         format_shape(shape));
  }
  for (std::size_t i = 0; i < index.size(); ++i) {
    if (index[i] >= shape[i]) {
      fail(param_name, std::string("internal: ") + side + " index " + std::to_string(index[i]) +
                           " is outside dim " + std::to_string(i) + " of " + format_shape(shape));
    }
  }
  Shape view(shape.begin() + static_cast<std::ptrdiff_t>(index.size()), shape.end());
  if (view.empty()) {
    view.push_back(1);
  }
  return view;
}

std::uint64_t base_offset(const Shape& shape, const std::vector<std::uint64_t>& index,
                          std::string_view what) {
  std::vector<std::uint64_t> strides = contiguous_strides(shape);
  std::uint64_t off = 0;
  for (std::size_t i = 0; i < index.size(); ++i) {
    off += checked_mul(index[i], strides[i], what);
  }
  return off;
}

}  // namespace

std::uint64_t round_up(std::uint64_t value, std::uint64_t multiple) {
  if (multiple == 0) {
    return value;
  }
  std::uint64_t rem = value % multiple;
  return rem == 0 ? value : value + (multiple - rem);
}

Range pp_layers(std::uint64_t layers, int pp, int pp_rank, const std::vector<int>& partition) {
  if (pp < 1 || pp_rank < 0 || pp_rank >= pp) {
    throw Error(Stage::kConfig, "", "",
                "parallel layout: pp_rank " + std::to_string(pp_rank) + " is not a stage of pp " +
                    std::to_string(pp));
  }
  const auto stages = static_cast<std::uint64_t>(pp);
  const auto s = static_cast<std::uint64_t>(pp_rank);
  if (layers < stages) {
    // SGLang's make_layers asserts num_hidden_layers >= pp_size.
    throw Error(Stage::kConfig, "", "",
                "parallel layout: num_hidden_layers " + std::to_string(layers) +
                    " is fewer than the pipeline stages (pp " + std::to_string(pp) +
                    "); every stage needs at least one layer");
  }
  if (partition.empty()) {
    // SGLang's get_pp_indices: L // pp layers each, one more for each of the last
    // L % pp stages.
    const std::uint64_t base = layers / stages;
    const std::uint64_t first_long = stages - layers % stages;  // first stage with base + 1
    const std::uint64_t begin = s * base + (s > first_long ? s - first_long : 0);
    return {begin, base + (s >= first_long ? 1 : 0)};
  }
  if (partition.size() != stages) {
    throw Error(Stage::kConfig, "", "",
                "parallel.pp_partition has " + std::to_string(partition.size()) +
                    " entries; expected one layer count per stage (pp " + std::to_string(pp) + ")");
  }
  std::uint64_t sum = 0;
  std::uint64_t begin = 0;
  for (std::size_t i = 0; i < partition.size(); ++i) {
    if (partition[i] < 0) {
      throw Error(Stage::kConfig, "", "",
                  "parallel.pp_partition[" + std::to_string(i) + "] is negative (" +
                      std::to_string(partition[i]) + ")");
    }
    if (i == s) {
      begin = sum;
    }
    sum += static_cast<std::uint64_t>(partition[i]);
  }
  if (sum != layers) {
    throw Error(Stage::kConfig, "", "",
                "parallel.pp_partition sums to " + std::to_string(sum) +
                    " layers but the model has num_hidden_layers " + std::to_string(layers));
  }
  return {begin, static_cast<std::uint64_t>(partition[s])};
}

Range even_shard(std::uint64_t total, int index, int parts, std::string_view what) {
  check_parts(index, parts, what);
  auto p = static_cast<std::uint64_t>(parts);
  if (total % p != 0) {
    fail("", std::string(what) + " (" + std::to_string(total) +
                 ") is not divisible by tensor parallel size " + std::to_string(parts));
  }
  std::uint64_t per = total / p;
  return {static_cast<std::uint64_t>(index) * per, per};
}

// ---- uneven tensor parallelism -----------------------------------------------------

namespace {

[[noreturn]] void refuse_unaligned(const std::string& what, int tp) {
  fail("", what + " is not divisible by tensor parallel size " + std::to_string(tp) +
               ": SGLang asserts this on GPU, and model.unaligned_tp is refuse; set "
               "model.unaligned_tp=pad to zero-pad it as SGLang does on CPU");
}

}  // namespace

std::uint64_t padded_intermediate(std::uint64_t intermediate, int parts, Unaligned policy,
                                  std::string_view what) {
  check_parts(0, parts, "intermediate size");
  const auto p = static_cast<std::uint64_t>(parts);
  if (policy == Unaligned::kRefuse) {
    if (intermediate % p != 0) {
      refuse_unaligned(std::string(what) + " (" + std::to_string(intermediate) + ")", parts);
    }
    return intermediate;
  }
  const std::uint64_t multiple = checked_mul(p, kIntermediatePadding, "intermediate size");
  return intermediate % multiple == 0 ? intermediate : round_up(intermediate, multiple);
}

std::uint64_t padded_heads(std::uint64_t heads, int tp, Unaligned policy, std::string_view what) {
  check_parts(0, tp, "tensor parallel size");
  const auto t = static_cast<std::uint64_t>(tp);
  if (heads % t != 0 && policy == Unaligned::kRefuse) {
    refuse_unaligned(std::string(what) + " (" + std::to_string(heads) + ")", tp);
  }
  return round_up(heads, t);
}

// ---- QKVParallelLinear -------------------------------------------------------

namespace {

bool splits_evenly(const QkvShape& s, std::uint64_t tp) {
  if (s.q_heads % tp != 0) {
    return false;
  }
  return s.kv_heads >= tp ? s.kv_heads % tp == 0 : tp % s.kv_heads == 0;
}

// The share [first, first + count) of padded heads, `real` of which exist, placed
// at head `dst_head` of the rank's slot: the real heads are copied, the rest zeroed.
PaddedShard head_share(Range share, std::uint64_t real, std::uint64_t dst_head,
                       std::uint64_t head_dim) {
  const std::uint64_t copy = real > share.begin ? std::min(real, share.end()) - share.begin : 0;
  PaddedShard s;
  s.copy.kind = Block::Kind::kCopy;
  s.copy.axis = 0;
  s.copy.src_start = share.begin * head_dim;
  s.copy.dst_start = dst_head * head_dim;
  s.copy.length = copy * head_dim;
  s.zero.kind = Block::Kind::kZero;
  s.zero.axis = 0;
  s.zero.dst_start = (dst_head + copy) * head_dim;
  s.zero.length = (share.length - copy) * head_dim;
  return s;
}

}  // namespace

void check_qkv(const QkvShape& shape, int tp) {
  check_parts(0, tp, "tensor parallel size");
  if (shape.q_heads == 0 || shape.kv_heads == 0 || shape.head_dim == 0) {
    fail("", "attention needs num_attention_heads, num_key_value_heads and head_dim > 0");
  }
  if (shape.q_heads % shape.kv_heads != 0) {
    fail("", "num_attention_heads (" + std::to_string(shape.q_heads) +
                 ") is not a multiple of num_key_value_heads (" + std::to_string(shape.kv_heads) +
                 ")");
  }
}

QkvShape padded_qkv(const QkvShape& real, int tp, Unaligned policy) {
  check_qkv(real, tp);
  const auto t = static_cast<std::uint64_t>(tp);
  if (policy == Unaligned::kRefuse) {
    if (real.q_heads % t != 0) {
      refuse_unaligned("num_attention_heads (" + std::to_string(real.q_heads) + ")", tp);
    }
    if (!splits_evenly(real, t)) {
      refuse_unaligned("num_key_value_heads (" + std::to_string(real.kv_heads) +
                           ", which tp neither splits nor replicates evenly)",
                       tp);
    }
    return real;
  }
  // SGLang's adjust_config_with_unaligned_cpu_tp: when either head count is not a
  // multiple of tp, the kv heads are padded to one and the q heads follow.
  if (real.q_heads % t == 0 && real.kv_heads % t == 0) {
    return real;
  }
  QkvShape padded = real;
  padded.kv_heads = round_up(real.kv_heads, t);
  padded.q_heads =
      checked_mul(padded.kv_heads, real.q_heads / real.kv_heads, "num_attention_heads");
  return padded;
}

Range kv_heads_of_rank(const QkvShape& shape, int rank, int tp) {
  check_parts(rank, tp, "num_key_value_heads");
  auto t = static_cast<std::uint64_t>(tp);
  if (shape.kv_heads >= t) {
    return even_shard(shape.kv_heads, rank, tp, "num_key_value_heads");
  }
  if (shape.kv_heads == 0 || t % shape.kv_heads != 0) {
    fail("", "internal: " + std::to_string(shape.kv_heads) +
                 " kv heads are neither split nor replicated evenly over tensor parallel size " +
                 std::to_string(tp) + " (pad them with padded_qkv first)");
  }
  // Fewer kv heads than ranks: each head is replicated on tp / kv_heads
  // consecutive ranks (SGLang's num_kv_head_replicas).
  std::uint64_t replicas = t / shape.kv_heads;
  return {static_cast<std::uint64_t>(rank) / replicas, 1};
}

std::uint64_t qkv_local_rows(const QkvShape& real, int tp, Unaligned policy) {
  const QkvShape s = padded_qkv(real, tp, policy);
  std::uint64_t q = even_shard(s.q_heads, 0, tp, "num_attention_heads").length;
  std::uint64_t kv = kv_heads_of_rank(s, 0, tp).length;
  return checked_mul(q + 2 * kv, s.head_dim, "qkv_proj");
}

std::uint64_t qkv_slot_rows(const QkvShape& real, QkvSlot slot) {
  std::uint64_t heads = slot == QkvSlot::kQ ? real.q_heads : real.kv_heads;
  return checked_mul(heads, real.head_dim, "qkv_proj");
}

PaddedShard qkv_slot(const QkvShape& real, QkvSlot slot, int rank, int tp, Unaligned policy) {
  const QkvShape s = padded_qkv(real, tp, policy);
  Range q = even_shard(s.q_heads, rank, tp, "num_attention_heads");
  Range kv = kv_heads_of_rank(s, rank, tp);
  switch (slot) {
    case QkvSlot::kQ:
      return head_share(q, real.q_heads, 0, s.head_dim);
    case QkvSlot::kK:
      return head_share(kv, real.kv_heads, q.length, s.head_dim);
    case QkvSlot::kV:
      break;
  }
  return head_share(kv, real.kv_heads, q.length + kv.length, s.head_dim);
}

// ---- replicated ---------------------------------------------------------------

Block replicated(std::uint64_t dim0) {
  Block b;
  b.axis = 0;
  b.length = dim0;
  return b;
}

// ---- padded shards --------------------------------------------------------------

PaddedShard padded_shard(std::size_t axis, std::uint64_t real, std::uint64_t padded, int index,
                         int parts, std::string_view what) {
  if (padded < real) {
    fail("", std::string(what) + ": padded size " + std::to_string(padded) +
                 " is smaller than the real size " + std::to_string(real));
  }
  Range r = even_shard(padded, index, parts, std::string(what) + " padded");
  std::uint64_t copy = real > r.begin ? std::min(real, r.end()) - r.begin : 0;
  PaddedShard s;
  s.copy.kind = Block::Kind::kCopy;
  s.copy.axis = axis;
  s.copy.src_start = r.begin;
  s.copy.dst_start = 0;
  s.copy.length = copy;
  s.zero.kind = Block::Kind::kZero;
  s.zero.axis = axis;
  s.zero.dst_start = copy;
  s.zero.length = r.length - copy;
  return s;
}

std::uint64_t padded_vocab(std::uint64_t vocab) {
  return round_up(vocab, kVocabPadding);
}

PaddedShard vocab_parallel(std::uint64_t vocab, int rank, int tp) {
  return padded_shard(0, vocab, padded_vocab(vocab), rank, tp, "vocab_size");
}

// ---- blocks to pieces -----------------------------------------------------------

std::vector<std::uint64_t> contiguous_strides(const Shape& shape) {
  std::vector<std::uint64_t> strides(shape.size(), 1);
  for (std::size_t i = shape.size(); i > 1; --i) {
    strides[i - 2] = checked_mul(strides[i - 1], shape[i - 1], "strides");
  }
  return strides;
}

bool dense_permutation(const Shape& shape, const std::vector<std::uint64_t>& strides) {
  if (strides.size() != shape.size()) {
    return false;
  }
  std::vector<std::pair<std::uint64_t, std::uint64_t>> dims;  // (stride, size)
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) {
      return true;  // no elements: nothing is addressed
    }
    if (shape[i] != 1) {
      dims.emplace_back(strides[i], shape[i]);
    }
  }
  std::sort(dims.begin(), dims.end());
  std::uint64_t expect = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expect) {
      return false;
    }
    expect *= size;
  }
  return true;
}

std::uint64_t element_count(const Shape& shape) {
  return product(shape, 0, shape.size(), "element count");
}

Piece block_to_piece(const Block& block, const Shape& src_shape, DType src_dtype,
                     const Shape& dst_shape, DType dst_dtype, std::string_view param_name) {
  const bool zero = block.kind == Block::Kind::kZero;
  Shape dst = view_of(dst_shape, block.dst_index, param_name, "param");
  Shape src = zero ? dst : view_of(src_shape, block.src_index, param_name, "tensor");
  if (src.size() != dst.size() || block.axis >= dst.size()) {
    fail(param_name, "internal: block on axis " + std::to_string(block.axis) + " of tensor " +
                         format_shape(src) + " and param " + format_shape(dst));
  }
  for (std::size_t d = 0; d < dst.size(); ++d) {
    if (d != block.axis && src[d] != dst[d]) {
      fail(param_name, "internal: tensor " + format_shape(src) + " and param " + format_shape(dst) +
                           " differ on axis " + std::to_string(d));
    }
  }
  const std::size_t axis = block.axis;
  if (block.dst_start > dst[axis] || block.length > dst[axis] - block.dst_start ||
      (!zero && (block.src_start > src[axis] || block.length > src[axis] - block.src_start))) {
    fail(param_name, "internal: block [" + std::to_string(block.src_start) + ", +" +
                         std::to_string(block.length) + ") -> [" + std::to_string(block.dst_start) +
                         ", +" + std::to_string(block.length) + ") on axis " +
                         std::to_string(axis) + " exceeds tensor " + format_shape(src) +
                         " or param " + format_shape(dst));
  }
  const std::uint64_t outer = product(dst, 0, axis, param_name);
  const std::uint64_t inner = product(dst, axis + 1, dst.size(), param_name);
  const std::uint64_t ses = dtype_size(zero ? dst_dtype : src_dtype);
  const std::uint64_t des = dtype_size(dst_dtype);

  Piece p;
  p.kind = zero ? Piece::Kind::kZero : Piece::Kind::kCopy;
  p.src_dtype = zero ? dst_dtype : src_dtype;
  p.dst_dtype = dst_dtype;
  p.rows = outer;
  p.width_elems = checked_mul(block.length, inner, param_name);
  const std::uint64_t dst_base = base_offset(dst_shape, block.dst_index, param_name);
  p.dst_offset = checked_mul(dst_base + block.dst_start * inner, des, param_name);
  p.dst_pitch = checked_mul(dst[axis] * inner, des, param_name);
  if (!zero) {
    const std::uint64_t src_base = base_offset(src_shape, block.src_index, param_name);
    p.src_offset = checked_mul(src_base + block.src_start * inner, ses, param_name);
    p.src_pitch = checked_mul(src[axis] * inner, ses, param_name);
  }
  // Whole rows on both sides: the block is one contiguous run.
  const bool full = block.length == dst[axis] && (zero || block.length == src[axis]);
  if (p.rows == 1 || full) {
    p.width_elems = checked_mul(p.rows, p.width_elems, param_name);
    p.rows = 1;
    p.dst_pitch = checked_mul(p.width_elems, des, param_name);
    p.src_pitch = zero ? 0 : checked_mul(p.width_elems, ses, param_name);
  }
  if (zero) {
    p.src_offset = 0;
    p.src_pitch = 0;
  }
  return p;
}

}  // namespace ferry::models
