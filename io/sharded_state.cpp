#include "io/sharded_state.hpp"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <utility>

#include "common/error.hpp"

namespace ferry::io {
namespace {

constexpr std::string_view kPrefix = "model-rank-";
constexpr std::string_view kMiddle = "-part-";
constexpr std::string_view kSuffix = ".safetensors";

// A decimal number as Python's str(int) writes it: no sign, no leading zero.
std::optional<int> number(std::string_view text) {
  if (text.empty() || (text.size() > 1 && text.front() == '0')) {
    return std::nullopt;
  }
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) {
    return std::nullopt;
  }
  return value;
}

}  // namespace

std::string sharded_state_file(int rank, int part) {
  return std::string(kPrefix) + std::to_string(rank) + std::string(kMiddle) + std::to_string(part) +
         std::string(kSuffix);
}

std::optional<ShardedStateName> parse_sharded_state_file(std::string_view name) {
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) {
    return std::nullopt;
  }
  name.remove_prefix(kPrefix.size());
  name.remove_suffix(kSuffix.size());
  const std::size_t middle = name.find(kMiddle);
  if (middle == std::string_view::npos) {
    return std::nullopt;
  }
  const std::optional<int> rank = number(name.substr(0, middle));
  const std::optional<int> part = number(name.substr(middle + kMiddle.size()));
  if (!rank || !part) {
    return std::nullopt;
  }
  return ShardedStateName{*rank, *part};
}

std::map<int, std::vector<std::string>> list_sharded_state(const std::string& folder) {
  namespace fs = std::filesystem;
  std::map<int, std::vector<std::pair<int, std::string>>> found;
  std::error_code ec;
  fs::directory_iterator it(folder, ec);
  if (ec) {
    throw Error(Stage::kDiscovery, folder, "",
                "sharded_state: cannot list the folder: " + ec.message());
  }
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    if (std::optional<ShardedStateName> n = parse_sharded_state_file(name)) {
      found[n->rank].emplace_back(n->part, name);
    }
  }
  std::map<int, std::vector<std::string>> out;
  for (auto& [rank, parts] : found) {
    std::sort(parts.begin(), parts.end());  // one name per (rank, part): parse is canonical
    for (auto& entry : parts) {
      out[rank].push_back(std::move(entry.second));
    }
  }
  return out;
}

}  // namespace ferry::io
