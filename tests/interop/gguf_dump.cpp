// The C++ half of tests/interop/gguf_interop_test.py: ferry's GGUF code driven from
// the command line, its answers written where Python can compare them with gguf-py.
//
//   gguf_dump header FILE OUT.json OUT.bin   the parsed header as JSON; each tensor
//                                            ferry can dequantize as float32 in
//                                            OUT.bin (its "values_at" in floats)
//   gguf_dump quantize IN.f32 OUT.q8_0       Q8_0 blocks of raw float32
//   gguf_dump write SPEC.json OUT.gguf       a file from ferry's writer: SPEC has
//                                            "alignment", "metadata" [[key, type,
//                                            value]...] and "tensors" [{name, type,
//                                            dims, data: a raw file}]
//   gguf_dump permute ROWS HEADS             llama_qk_permute_rows as a JSON list
//
// Exit status 0 on success, 1 with the error on stderr.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "io/gguf.hpp"
#include "io/gguf_names.hpp"
#include "io/gguf_types.hpp"
#include "io/gguf_writer.hpp"

namespace {

using nlohmann::json;
using namespace ferry::io;

std::vector<std::byte> slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) {
    throw std::runtime_error("cannot read " + path);
  }
  std::vector<std::byte> out(chars.size());
  std::memcpy(out.data(), chars.data(), chars.size());
  return out;
}

void spill(const std::string& path, const void* data, std::size_t n) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  if (!out) {
    throw std::runtime_error("cannot write " + path);
  }
}

json value_json(const GgufValue& v) {
  json out = {{"type", std::string(gguf_value_type_name(v.type))}};
  switch (v.type) {
    case GgufValueType::kArray: {
      out["element_type"] = std::string(gguf_value_type_name(v.element_type));
      out["count"] = v.count;
      out["kept"] = v.kept;
      if (v.kept) {
        json elements = json::array();
        for (const GgufValue& e : v.elements) {
          elements.push_back(value_json(e));
        }
        out["elements"] = std::move(elements);
      }
      break;
    }
    case GgufValueType::kString:
      // Bytes as numbers: a token need not be UTF-8, and nlohmann would refuse it.
      out["bytes"] = std::vector<unsigned char>(v.s.begin(), v.s.end());
      break;
    case GgufValueType::kF32:
    case GgufValueType::kF64:
      out["value"] = v.f;
      break;
    case GgufValueType::kI8:
    case GgufValueType::kI16:
    case GgufValueType::kI32:
    case GgufValueType::kI64:
      out["value"] = v.i;
      break;
    default:
      out["value"] = v.u;
      break;
  }
  return out;
}

int header(const std::string& file, const std::string& out_json, const std::string& out_bin) {
  const GgufHeader h = read_gguf_header(file, file);
  json doc = {{"version", h.version},
              {"alignment", h.alignment},
              {"data_offset", h.data_offset},
              {"header_bytes", h.header_bytes}};
  json meta = json::object();
  for (const auto& [key, value] : h.metadata) {
    meta[key] = value_json(value);
  }
  doc["metadata"] = std::move(meta);
  std::ifstream in(file, std::ios::binary);
  std::vector<float> values;
  json tensors = json::array();
  for (const GgufTensorInfo& t : h.tensors) {
    json j = {{"name", t.name},
              {"dims", t.dims},
              {"type", std::string(ggml_type_name(t.type))},
              {"offset", t.offset},
              {"nbytes", t.nbytes}};
    if (can_dequantize(t.type)) {
      std::vector<std::byte> raw(t.nbytes);
      in.seekg(static_cast<std::streamoff>(t.offset));
      in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size()));
      j["values_at"] = values.size();
      values.resize(values.size() + t.elements());
      dequantize(t.type, raw, std::span(values).last(t.elements()), t.name);
    }
    tensors.push_back(std::move(j));
  }
  doc["tensors"] = std::move(tensors);
  const std::string text = doc.dump(1);
  spill(out_json, text.data(), text.size());
  spill(out_bin, values.data(), values.size() * sizeof(float));
  return 0;
}

int quantize(const std::string& in, const std::string& out) {
  const std::vector<std::byte> raw = slurp(in);
  std::vector<float> x(raw.size() / 4);
  std::memcpy(x.data(), raw.data(), x.size() * 4);
  std::vector<std::byte> q(x.size() / 32 * 34);
  quantize_q8_0(x, q);
  spill(out, q.data(), q.size());
  return 0;
}

GgufValueType type_named(const std::string& name) {
  for (std::uint32_t t = 0; t <= 12; ++t) {
    if (gguf_value_type_name(static_cast<GgufValueType>(t)) == name) {
      return static_cast<GgufValueType>(t);
    }
  }
  throw std::runtime_error("unknown spec type " + name);
}

// A value of the spec's type name: "u32", "f32", "string", ..., or "array:<element
// type>" with a list of values (one level).
GgufValue spec_value(const std::string& type, const json& v) {
  if (type.rfind("array:", 0) == 0) {
    const std::string element = type.substr(6);
    std::vector<GgufValue> elements;
    for (const json& e : v) {
      elements.push_back(spec_value(element, e));
    }
    return GgufValue::array(type_named(element), std::move(elements));
  }
  const GgufValueType t = type_named(type);
  switch (t) {
    case GgufValueType::kI8:
    case GgufValueType::kI16:
    case GgufValueType::kI32:
    case GgufValueType::kI64:
      return GgufValue::of_int(t, v.get<std::int64_t>());
    case GgufValueType::kF32:
      return GgufValue::of_f32(v.get<float>());
    case GgufValueType::kF64:
      return GgufValue::of_f64(v.get<double>());
    case GgufValueType::kBool:
      return GgufValue::of_bool(v.get<bool>());
    case GgufValueType::kString:
      return GgufValue::of_string(v.get<std::string>());
    case GgufValueType::kArray:
      throw std::runtime_error("arrays are spelled array:<type>");
    default:
      return GgufValue::of_uint(t, v.get<std::uint64_t>());
  }
}

int write(const std::string& spec_path, const std::string& out) {
  const std::vector<std::byte> raw = slurp(spec_path);
  const json spec = json::parse(reinterpret_cast<const char*>(raw.data()),
                                reinterpret_cast<const char*>(raw.data()) + raw.size());
  GgufWriter w(out);
  w.set_alignment(spec.at("alignment").get<std::uint64_t>());
  for (const json& kv : spec.at("metadata")) {
    w.add_metadata(kv.at(0).get<std::string>(), spec_value(kv.at(1).get<std::string>(), kv.at(2)));
  }
  for (const json& t : spec.at("tensors")) {
    const auto type = parse_ggml_type(t.at("type").get<std::string>());
    if (!type) {
      throw std::runtime_error("unknown ggml type " + t.at("type").dump());
    }
    w.add_tensor(t.at("name").get<std::string>(), *type,
                 t.at("dims").get<std::vector<std::uint64_t>>());
  }
  w.begin();
  for (const json& t : spec.at("tensors")) {
    w.write(slurp(t.at("data").get<std::string>()));
  }
  w.finish();
  return 0;
}

int permute(std::uint64_t rows, std::uint64_t heads) {
  std::cout << json(llama_qk_permute_rows(rows, heads)).dump() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 4 && args[0] == "header") {
      return header(args[1], args[2], args[3]);
    }
    if (args.size() == 3 && args[0] == "quantize") {
      return quantize(args[1], args[2]);
    }
    if (args.size() == 3 && args[0] == "write") {
      return write(args[1], args[2]);
    }
    if (args.size() == 3 && args[0] == "permute") {
      return permute(std::stoull(args[1]), std::stoull(args[2]));
    }
    std::cerr << "usage: gguf_dump header FILE OUT.json OUT.bin | quantize IN OUT | "
                 "write SPEC.json OUT.gguf | permute ROWS HEADS\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "gguf_dump: " << e.what() << "\n";
    return 1;
  }
}
