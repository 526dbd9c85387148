// The public Config (include/ferry/config.hpp) over the internal ConfigBuilder:
// the layers applied so far, and the LoadConfig they build, rebuilt after every
// call so that a bad key or value is refused by the call that gave it.
#include "ferry/config.hpp"

#include <unistd.h>  // environ

#include <cstdlib>
#include <string>
#include <utility>

#include "common/log.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/load_config.hpp"

namespace ferry::runtime {

struct FERRY_HIDDEN Config::Impl {
  ConfigBuilder builder;
  LoadConfig built;
};

namespace {

// Applies `change` to a copy of the layers and builds it; the Config changes only
// when both succeed. The load rules wait for the load (ConfigBuilder::Rules), so
// that the keys they tie may be set in any order. Warnings the layer raised
// (ignored FERRY_ variables) are logged once, as the CLI logs them.
template <typename F>
void apply(std::unique_ptr<Config::Impl>& impl, F&& change) {
  auto next = std::make_unique<Config::Impl>(*impl);
  const std::size_t warned = next->builder.warnings().size();
  change(next->builder);
  next->built = next->builder.build(ConfigBuilder::Rules::kAllButLoad);
  for (std::size_t i = warned; i < next->builder.warnings().size(); ++i) {
    log::warn(next->builder.warnings()[i]);
  }
  impl = std::move(next);
}

}  // namespace

Config::Config() : impl_(std::make_unique<Impl>()) {
  impl_->built = impl_->builder.build(ConfigBuilder::Rules::kAllButLoad);
}

Config to_config(const LoadConfig& config) {
  Config out;
  // The round trip to_json -> apply_json builds an equal LoadConfig (load_config.hpp),
  // so later layers apply over exactly this configuration.
  out.impl_->builder.apply_json(runtime::to_json(config), "configuration");
  out.impl_->built = config;
  return out;
}

Config::Config(const Config& other) : impl_(std::make_unique<Impl>(*other.impl_)) {}

Config& Config::operator=(const Config& other) {
  if (this != &other) {
    impl_ = std::make_unique<Impl>(*other.impl_);
  }
  return *this;
}

Config::~Config() = default;

Config& Config::set(std::string_view assignment) {
  apply(impl_, [&](ConfigBuilder& b) { b.apply_set(assignment); });
  return *this;
}

Config& Config::set(std::string_view key, std::string_view value) {
  std::string assignment(key);
  assignment += '=';
  assignment += value;
  return set(assignment);
}

Config& Config::json(std::string_view text, std::string_view source) {
  apply(impl_, [&](ConfigBuilder& b) { b.apply_json_text(text, source); });
  return *this;
}

Config& Config::file(const std::string& path) {
  apply(impl_, [&](ConfigBuilder& b) { b.apply_file(path); });
  return *this;
}

Config& Config::environment() {
  apply(impl_, [&](ConfigBuilder& b) { b.apply_env(environ); });
  return *this;
}

std::string Config::to_json(int indent) const {
  return runtime::to_json(load_config()).dump(indent);
}

bool Config::operator==(const Config& other) const {
  return load_config() == other.load_config();
}

const LoadConfig& Config::load_config() const {
  return impl_->built;
}

}  // namespace ferry::runtime
