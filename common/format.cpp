#include "common/format.hpp"

#include <cstdio>

#include "common/error.hpp"
#include "common/output_file.hpp"

namespace ferry {

std::string human_bytes(std::uint64_t n, int digits) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f %s", u == 0 ? 0 : digits, v, units[u]);
  return buf;
}

std::string join_list(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    out += (i ? separator : "") + items[i];
  }
  return out;
}

std::string join_first(const std::vector<std::string>& items, std::size_t limit) {
  std::string out;
  for (std::size_t i = 0; i < items.size() && i < limit; ++i) {
    out += (i ? ", " : "") + items[i];
  }
  if (items.size() > limit) {
    out += " and " + std::to_string(items.size() - limit) + " more";
  }
  return out;
}

std::string format_dims(const std::vector<std::uint64_t>& dims) {
  std::string out = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + "]";
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

void write_file_replacing(const std::string& path, const std::string& text,
                          const std::string& what) {
  OutputFile out(path, Stage::kOutput, what);
  out.write(text);
  out.commit();
}

}  // namespace ferry
