// A load's configuration, as an engine builds it: every key of the CLI's
// `--set` (docs/OPERATING.md lists them all, with their defaults), layered in the
// order the calls are made, each later layer overriding the keys it names. A
// Config starts from ferry's in-code defaults; the CLI's embedded
// config/default.json is the CLI's own layer, not applied here.
//
//   ferry::runtime::Config config;
//   config.set("model.path", "/models/llama").set("parallel.tp=8").environment();
//   ferry::runtime::Runtime runtime(config);
//
// Every call validates at once: an unknown key, a bad value or a file that does not
// parse throws ferry::Error (Stage::kConfig) naming the key and the layer that set
// it ("--set", the file, "environment FERRY_X"), and leaves the Config as it was.
// So do the rules between keys of the parallel layout and the sizes (parallel.ep
// divides parallel.tp, ...): set parallel.tp before the keys that depend on it. The
// rules a load needs (load.layered with quantization.online, the dummy format or
// io.direct_to_device=on; prefetch.enabled with io.direct) wait for the load, which
// refuses a configuration that breaks one: those keys may come in any order.
// A Config is a value: copies are independent (a move copies too, so nothing is
// ever left empty). Not thread-safe; a const Config may
// be read from any thread.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "ferry/export.hpp"

namespace ferry::runtime {

struct LoadConfig;  // ferry's internal form (runtime/load_config.hpp)

class FERRY_API Config {
 public:
  Config();  // ferry's in-code defaults
  Config(const Config& other);
  Config& operator=(const Config& other);
  ~Config();

  // "key=value" as `ferry load --set` reads it: the value is JSON when it parses as
  // JSON ("parallel.tp=8", "io.direct=true"), else the text ("model.path=/m").
  Config& set(std::string_view assignment);
  // The same with the key and the value apart.
  Config& set(std::string_view key, std::string_view value);
  // A JSON object shaped like to_json() (any subset of its keys); `source` names
  // it in errors.
  Config& json(std::string_view text, std::string_view source = "json");
  // A config file holding such an object; its path names it in errors.
  Config& file(const std::string& path);
  // The process's FERRY_<SECTION>__<KEY> variables and FERRY_DEVICES, as the CLI
  // reads them (README); other FERRY_ variables are ignored with a warning.
  Config& environment();

  // Every key with its effective value, as a JSON object's text (`indent` < 0:
  // one line). Applying it to a new Config builds an equal one.
  std::string to_json(int indent = 2) const;
  bool operator==(const Config& other) const;

  // ferry's internal form (runtime/load_config.hpp).
  const LoadConfig& load_config() const;

  struct Impl;  // internal (runtime/config.cpp)

 private:
  // ferry's own code makes one from its internal form (runtime/api_internal.hpp);
  // not exported.
  friend Config to_config(const LoadConfig& config);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::runtime
