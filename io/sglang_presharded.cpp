#include "io/sglang_presharded.hpp"

#include <array>
#include <string_view>

#include "common/enum_name.hpp"
#include "common/error.hpp"

namespace ferry::io {
namespace {

[[noreturn]] void bad(const std::string& file, const std::string& what) {
  throw Error(Stage::kIndex, file, "", "SGLang presharded plan: " + what);
}

const std::string& text(const nlohmann::json& o, const char* key, const std::string& file,
                        const std::string& where) {
  auto it = o.find(key);
  if (it == o.end() || !it->is_string()) {
    bad(file, where + ": \"" + key + "\" is missing or not a string");
  }
  return it->get_ref<const std::string&>();
}

int rank_number(std::string_view s, int world, const std::string& file) {
  int r = 0;
  if (s.empty() || s.size() > 9 || (s.size() > 1 && s.front() == '0')) {
    bad(file, "rank_to_reads: \"" + std::string(s) + "\" is not a world rank");
  }
  for (char ch : s) {
    if (ch < '0' || ch > '9') {
      bad(file, "rank_to_reads: \"" + std::string(s) + "\" is not a world rank");
    }
    r = r * 10 + (ch - '0');
  }
  if (r >= world) {
    bad(file, "rank_to_reads: rank " + std::to_string(r) + " is outside world_size " +
                  std::to_string(world));
  }
  return r;
}

}  // namespace

SglangPlan parse_sglang_plan(const nlohmann::json& doc, const std::string& file) {
  if (!doc.is_object()) {
    bad(file, "not a JSON object");
  }
  const nlohmann::json version = doc.value("version", nlohmann::json());
  if (!version.is_number_integer() || version.get<std::int64_t>() != kSglangPlanVersion) {
    bad(file, "version " + version.dump() + " (SGLang 0.5.23 writes " +
                  std::to_string(kSglangPlanVersion) + ")");
  }
  const nlohmann::json world = doc.value("world_size", nlohmann::json());
  if (!world.is_number_unsigned() || world.get<std::uint64_t>() == 0 ||
      world.get<std::uint64_t>() > 1u << 20) {
    bad(file, "world_size " + world.dump() + " is not a positive number of ranks");
  }
  SglangPlan plan;
  plan.world_size = static_cast<int>(world.get<std::uint64_t>());
  const auto reads = doc.find("rank_to_reads");
  if (reads == doc.end() || !reads->is_object()) {
    bad(file, "\"rank_to_reads\" is missing or not an object");
  }
  for (const auto& [rank, list] : reads->items()) {
    const int r = rank_number(rank, plan.world_size, file);
    if (!list.is_array()) {
      bad(file, "rank_to_reads[" + rank + "] is not an array");
    }
    std::vector<SglangRead>& out = plan.reads[r];
    out.reserve(list.size());
    for (const nlohmann::json& e : list) {
      const std::string where = "rank_to_reads[" + rank + "][" + std::to_string(out.size()) + "]";
      if (!e.is_object()) {
        bad(file, where + " is not an object");
      }
      SglangRead read;
      read.file = text(e, "filename", file, where);
      read.stored_key = text(e, "stored_key", file, where);
      read.name = text(e, "name", file, where);
      const auto extra = e.find("is_extra");
      if (extra != e.end() && !extra->is_boolean()) {
        bad(file, where + ": \"is_extra\" is not a boolean");
      }
      read.extra = extra != e.end() && extra->get<bool>();
      if (read.file.empty() || read.file.find('/') != std::string::npos || read.file == "." ||
          read.file == ".." || read.file.find('\0') != std::string::npos) {
        bad(file, where + ": \"filename\" \"" + read.file + "\" is not a file of the folder");
      }
      if (!Hash128::from_hex(read.stored_key)) {
        bad(file, where + ": \"stored_key\" \"" + read.stored_key + "\" is not 32 hex digits");
      }
      if (read.name.empty()) {
        bad(file, where + ": \"name\" is empty");
      }
      out.push_back(std::move(read));
    }
  }
  plan.shard_config = doc.value("shard_config", nlohmann::json());
  return plan;
}

std::string torch_dtype_name(DType dtype) {
  static constexpr std::array<std::string_view, 16> kNames{
      "torch.bool",    "torch.uint8",         "torch.int8",        "torch.uint16",
      "torch.int16",   "torch.uint32",        "torch.int32",       "torch.uint64",
      "torch.int64",   "torch.float16",       "torch.bfloat16",    "torch.float32",
      "torch.float64", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float8_e8m0fnu"};
  static_assert(kNames.size() == static_cast<std::size_t>(DType::kF8E8M0) + 1);
  return std::string(enum_name(dtype, kNames, "torch.unknown"));
}

Xxh3Hasher sglang_key_hasher(DType dtype, const std::vector<std::uint64_t>& shape) {
  // Python's str(tuple(shape)): "()", "(4,)", "(4, 8)".
  std::string prefix = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    prefix += (i == 0 ? "" : ", ") + std::to_string(shape[i]);
  }
  prefix += shape.size() == 1 ? ",)" : ")";
  prefix += torch_dtype_name(dtype);
  Xxh3Hasher h;
  h.update(std::as_bytes(std::span(prefix.data(), prefix.size())));
  return h;
}

Hash128 sglang_stored_key(DType dtype, const std::vector<std::uint64_t>& shape,
                          std::span<const std::byte> bytes) {
  Xxh3Hasher h = sglang_key_hasher(dtype, shape);
  h.update(bytes);
  return h.digest();
}

}  // namespace ferry::io
