// The safetensors weight index (model.safetensors.index.json) and the cross-file
// CheckpointIndex built from every shard's header (the headers themselves:
// safetensors.cpp).
#include <algorithm>
#include <cmath>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "common/error.hpp"
#include "common/log.hpp"
#include "common/small_file.hpp"
#include "io/fd_limit.hpp"
#include "io/gguf_checkpoint.hpp"
#include "io/safetensors.hpp"
#include "io/safetensors_internal.hpp"
#include "io/torch_checkpoint.hpp"

namespace ferry::io {
namespace {

using detail::describe;
using detail::parse_json_no_duplicates;
using nlohmann::json;

// Opens a weight file to read its header from and keep (errors at the header stage,
// where resolve finds them).
File open_weight_file(const std::string& path, const std::string& display) {
  try {
    return File::open(path, false, display);
  } catch (const Error& e) {
    throw Error(Stage::kHeader, e.file(), e.tensor(), e.rule());
  }
}

// The index's common case without a document, as HeaderSax: {"metadata": {scalars},
// "weight_map": {name: file}} in any order, nothing else. Anything else (another
// key, a nested metadata value, a duplicate, malformed JSON) falls back to the
// document path and its errors.
class IndexSax {
 public:
  WeightIndex index;

  bool null() { return metadata_scalar(); }
  bool boolean(bool) { return metadata_scalar(); }
  bool number_integer(json::number_integer_t) { return metadata_scalar(); }
  bool number_unsigned(json::number_unsigned_t v) {
    if (state_ == State::kMetaValue && total_size_key_) {
      index.total_size = v;
    }
    return metadata_scalar();
  }
  bool number_float(json::number_float_t v, const json::string_t&) {
    // 0x1p64: a larger double does not convert (undefined behaviour); it is no size.
    if (state_ == State::kMetaValue && total_size_key_ && v >= 0 && v == std::floor(v) &&
        v < 0x1p64) {
      index.total_size = static_cast<std::uint64_t>(v);
    }
    return metadata_scalar();
  }
  bool binary(json::binary_t&) { return false; }
  bool string(json::string_t& v) {
    if (state_ == State::kMapValue) {
      const std::size_t before = index.weight_map.size();
      index.weight_map.emplace_hint(index.weight_map.end(), std::move(key_), std::move(v));
      state_ = State::kMapKey;
      return index.weight_map.size() != before;
    }
    return metadata_scalar();
  }
  bool start_object(std::size_t) {
    switch (state_) {
      case State::kStart:
        state_ = State::kTopKey;
        return true;
      case State::kMetaStart:
        state_ = State::kMetaKey;
        return true;
      case State::kMapStart:
        state_ = State::kMapKey;
        return true;
      default:
        return false;
    }
  }
  bool key(json::string_t& k) {
    switch (state_) {
      case State::kTopKey:
        if (k == "weight_map" && !have_map_) {
          have_map_ = true;
          state_ = State::kMapStart;
          return true;
        }
        if (k == "metadata" && !have_metadata_) {
          have_metadata_ = true;
          state_ = State::kMetaStart;
          return true;
        }
        return false;
      case State::kMetaKey:
        total_size_key_ = k == "total_size";
        state_ = State::kMetaValue;
        return metadata_keys_.insert(std::move(k)).second;
      case State::kMapKey:
        key_ = std::move(k);
        state_ = State::kMapValue;
        return true;
      default:
        return false;
    }
  }
  bool end_object() {
    if (state_ == State::kMetaKey || state_ == State::kMapKey) {
      state_ = State::kTopKey;
      return true;
    }
    if (state_ == State::kTopKey) {
      state_ = State::kDone;
      return true;
    }
    return false;
  }
  bool start_array(std::size_t) { return false; }
  bool end_array() { return false; }
  template <class Exception>
  bool parse_error(std::size_t, const std::string&, const Exception&) {
    return false;
  }

  bool done() const { return state_ == State::kDone && have_map_; }

 private:
  enum class State {
    kStart,
    kTopKey,
    kMetaStart,
    kMetaKey,
    kMetaValue,
    kMapStart,
    kMapKey,
    kMapValue,
    kDone
  };
  bool metadata_scalar() {
    if (state_ != State::kMetaValue) {
      return false;
    }
    state_ = State::kMetaKey;
    return true;
  }

  State state_ = State::kStart;
  bool have_map_ = false;
  bool have_metadata_ = false;
  bool total_size_key_ = false;
  std::string key_;
  std::unordered_set<std::string> metadata_keys_;
};

}  // namespace

WeightIndex parse_weight_index(std::string_view text, const std::string& display) {
  if (text.find('\0') == std::string_view::npos) {
    IndexSax sax;
    if (json::sax_parse(text.begin(), text.end(), &sax) && sax.done()) {
      sax.index.file = display;
      return std::move(sax.index);
    }
  }
  json doc = parse_json_no_duplicates(text, Stage::kIndex, display);
  if (!doc.is_object()) {
    throw Error(Stage::kIndex, display, "", "index is not a JSON object");
  }
  auto wm = doc.find("weight_map");
  if (wm == doc.end() || !wm->is_object()) {
    throw Error(Stage::kIndex, display, "", "index has no \"weight_map\" object");
  }
  WeightIndex index;
  index.file = display;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it->is_string()) {
      throw Error(Stage::kIndex, display, it.key(),
                  "weight_map value " + describe(*it) + " is not a file name");
    }
    index.weight_map[it.key()] = it->get<std::string>();
  }
  auto md = doc.find("metadata");
  if (md != doc.end() && md->is_object()) {
    auto ts = md->find("total_size");
    if (ts != md->end()) {
      if (ts->is_number_unsigned()) {
        index.total_size = ts->get<std::uint64_t>();
      } else if (ts->is_number_float() && ts->get<double>() >= 0 &&
                 ts->get<double>() == std::floor(ts->get<double>()) &&
                 ts->get<double>() < 0x1p64) {  // as IndexSax
        index.total_size = static_cast<std::uint64_t>(ts->get<double>());
      }
    }
  }
  return index;
}

WeightIndex read_weight_index(const std::string& path, const std::string& display,
                              std::uint64_t max_bytes) {
  return parse_weight_index(read_small_file(path, Stage::kIndex, max_bytes, "the index", display),
                            display);
}

const TensorInfo* CheckpointIndex::find(std::string_view name) const {
  std::optional<std::uint32_t> at =
      by_name.find(name, [this](std::uint32_t i) -> std::string_view { return tensors[i].name; });
  return at ? &tensors[*at] : nullptr;
}

std::optional<std::size_t> CheckpointIndex::add_name(std::size_t position) {
  if (position >= NameTable::kMaxPositions) {
    throw Error(Stage::kIndex, "", "",
                "more than " + std::to_string(NameTable::kMaxPositions) + " tensors");
  }
  std::optional<std::uint32_t> there =
      by_name.insert(static_cast<std::uint32_t>(position),
                     [this](std::uint32_t i) -> std::string_view { return tensors[i].name; });
  if (there) {
    return *there;
  }
  return std::nullopt;
}

CheckpointIndex build_checkpoint_index(const ResolvedSource& source, const IndexOptions& options) {
  // Every file's descriptor is kept from here on: fail before opening the first
  // when they cannot all be open at once.
  reserve_descriptors(source.files.size(), source.folder);
  CheckpointIndex ci;
  for (std::size_t i = 0; i < source.files.size(); ++i) {
    const WeightFile& wf = source.files[i];
    auto file = std::make_shared<const File>(open_weight_file(wf.path, wf.name));
    // A torch.save archive and a GGUF file become the same list of byte ranges as a
    // header.
    SafetensorsHeader h;
    if (source.format == FileFormat::kPickle) {
      h = read_torch_checkpoint(*file, options.max_metadata_bytes);
    } else if (source.format == FileFormat::kGguf) {
      GgufCheckpoint gguf =
          read_gguf_checkpoint(*file, options.max_metadata_bytes, options.gguf_dequantize);
      h = std::move(gguf.header);
      ci.embedded_config = std::make_shared<const nlohmann::json>(std::move(gguf.config));
      for (std::string& note : gguf.notes) {
        ci.warnings.push_back(wf.name + ": " + note);
      }
      if (!gguf.skipped.empty()) {
        std::string list;
        for (const std::string& n : gguf.skipped) {
          list += (list.empty() ? "" : ", ") + n;
        }
        ci.warnings.push_back(wf.name +
                              ": GGUF tensors with no Hugging Face twin, not loaded: " + list);
      }
    } else {
      h = read_safetensors_header(*file);
    }
    CheckpointFile cf;
    cf.file = std::move(file);
    cf.path = wf.path;
    cf.name = wf.name;
    cf.reason = wf.reason;
    cf.size = h.file_size;
    cf.header_bytes = h.header_bytes;
    cf.tensor_count = h.tensors.size();
    cf.metadata = std::move(h.metadata);
    cf.identity = h.identity;
    ci.header_bytes_read += h.header_bytes;
    ci.files.push_back(std::move(cf));
    // The header's tensors move in whole (a lone file's vector is taken as it is):
    // a million-entry header is never copied record by record.
    const std::size_t first = ci.tensors.size();
    if (first == 0) {
      ci.tensors = std::move(h.tensors);
    } else {
      if (ci.tensors.capacity() < first + h.tensors.size()) {
        ci.tensors.reserve(std::max(2 * ci.tensors.capacity(), first + h.tensors.size()));
      }
      std::move(h.tensors.begin(), h.tensors.end(), std::back_inserter(ci.tensors));
    }
    ci.by_name.reserve(ci.tensors.size());
    for (std::size_t at = first; at < ci.tensors.size(); ++at) {
      TensorInfo& t = ci.tensors[at];
      t.file_index = static_cast<std::uint32_t>(i);
      if (std::optional<std::size_t> there = ci.add_name(at); there && !options.names_per_file) {
        throw Error(Stage::kIndex, wf.name, t.name,
                    "the same tensor name is in two shards: " + ci.tensors[*there].file + " and " +
                        wf.name);
      }
      ci.total_bytes += t.nbytes;
    }
  }
  if (!source.index_file) {
    return ci;
  }
  const std::string index_path = source.folder + "/" + *source.index_file;
  std::shared_ptr<const WeightIndex> parsed = source.weight_index;
  if (!parsed) {
    parsed = std::make_shared<const WeightIndex>(
        read_weight_index(index_path, *source.index_file, options.max_metadata_bytes));
  }
  const WeightIndex& index = *parsed;
  std::set<std::string> indexed_files;
  for (const auto& [name, shard] : index.weight_map) {
    indexed_files.insert(shard);
  }
  std::vector<std::string> unlisted;
  std::uint64_t indexed_bytes = 0;
  for (const auto& t : ci.tensors) {
    if (!indexed_files.count(t.file)) {
      continue;  // a file discovery added outside the index (e.g. GLM's mtp.safetensors)
    }
    indexed_bytes += t.nbytes;
    auto it = index.weight_map.find(t.name);
    if (it == index.weight_map.end()) {
      unlisted.push_back(t.name);
      continue;
    }
    if (it->second != t.file) {
      throw Error(Stage::kIndex, t.file, t.name,
                  *source.index_file + " places it in " + it->second + " but it is in " + t.file);
    }
  }
  std::vector<std::string> missing;
  for (const auto& [name, shard] : index.weight_map) {
    if (ci.find(name) == nullptr) {
      missing.push_back(name);
    }
  }
  auto list = [](const std::vector<std::string>& names) {
    std::string s;
    for (std::size_t i = 0; i < names.size() && i < 10; ++i) {
      s += (i ? ", " : "") + names[i];
    }
    if (names.size() > 10) {
      s += ", ... (" + std::to_string(names.size() - 10) + " more)";
    }
    return s;
  };
  if (!missing.empty()) {
    throw Error(Stage::kIndex, *source.index_file, missing.size() == 1 ? missing[0] : "",
                std::to_string(missing.size()) +
                    " tensor(s) listed by the index are in no shard: " + list(missing));
  }
  if (!unlisted.empty()) {
    std::string rule = std::to_string(unlisted.size()) +
                       " tensor(s) in the shards are not listed by " + *source.index_file + ": " +
                       list(unlisted);
    if (options.strict) {
      throw Error(Stage::kIndex, *source.index_file, unlisted.size() == 1 ? unlisted[0] : "",
                  rule + " (load.strict)");
    }
    ci.warnings.push_back(rule);
    log::warn(rule);
  }
  if (index.total_size && *index.total_size != indexed_bytes) {
    std::string w = *source.index_file + ": metadata.total_size is " +
                    std::to_string(*index.total_size) + " but the indexed tensors hold " +
                    std::to_string(indexed_bytes) + " bytes";
    ci.warnings.push_back(w);
    log::warn(w);
  }
  return ci;
}

namespace {

// Heap bytes of a string beyond the object itself (0 for short strings).
std::uint64_t heap_bytes(const std::string& s) {
  return s.capacity() > 15 ? s.capacity() + 1 : 0;
}

}  // namespace

std::uint64_t CheckpointIndex::bytes_owned() const {
  std::uint64_t n =
      files.capacity() * sizeof(CheckpointFile) + tensors.capacity() * sizeof(TensorInfo);
  for (const CheckpointFile& f : files) {
    n += heap_bytes(f.path) + heap_bytes(f.name) + heap_bytes(f.reason);
    for (const auto& [k, v] : f.metadata) {
      n += 64 + heap_bytes(k) + heap_bytes(v);  // a map node: links, key, value
    }
  }
  for (const TensorInfo& t : tensors) {
    n += heap_bytes(t.name) + heap_bytes(t.file) + t.shape.capacity() * sizeof(std::uint64_t);
  }
  n += by_name.bytes_owned();
  for (const std::string& w : warnings) {
    n += sizeof(std::string) + heap_bytes(w);
  }
  return n;
}

}  // namespace ferry::io
