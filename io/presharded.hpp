// ferry's presharded checkpoints (model.load_format=presharded, issue 34): the
// parameters of every rank of one layout exactly as a load leaves them (after the
// hooks and postprocess.target), so that a restart reads them back with nothing to
// slice, convert or post-process. This header is the folder's format and its writer
// (the load path that reads it and `ferry save` are still to come):
//
//   <folder>/manifest.json   what this file describes (to_json / parse below)
//   <folder>/*.safetensors   the data, every tensor at a multiple of 4096 bytes
//                            (SafetensorsWriter::set_data_alignment)
//   <folder>/READY           written last, after everything else is synced
//
// A tensor the same on several ranks (norms, replicated layers) is stored once,
// named as the param; one rank's own is "<param>@<tp rank>", so names stay unique
// across the folder. Each rank lists its params in its shell's order with the
// stored tensor, its file, byte range and XXH3-128 (common/xxh3.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "common/xxh3.hpp"

namespace ferry::io {

inline constexpr int kPreshardedVersion = 1;
inline constexpr std::uint64_t kPreshardedAlignment = 4096;
inline constexpr const char* kPreshardedManifest = "manifest.json";
inline constexpr const char* kPreshardedReady = "READY";

struct PreshardedParam {
  std::string name;    // the param's
  std::string tensor;  // the stored tensor's name
  DType dtype = DType::kU8;
  std::vector<std::uint64_t> shape;  // as served (ParamSpec::shape)
  std::uint64_t nbytes = 0;          // storage bytes, in storage order
  std::string file;                  // relative to the folder
  std::uint64_t offset = 0;          // absolute in the file, a multiple of 4096 when nbytes > 0
  Hash128 xxh3;
};

struct PreshardedRank {
  int tp_rank = 0;
  std::vector<PreshardedParam> params;
};

struct PreshardedManifest {
  // What the layout is: parallel sizes, fusion, dtype, quantization, target, family,
  // ferry's layout version... as text, compared field by field
  // (presharded_mismatch), so that an error names the field that differs.
  std::map<std::string, std::string> signature;
  // XXH3-128 of every rank's shell (names, dtypes, shapes, strides, sizes).
  Hash128 structure;
  int pp_rank = 0;  // the pipeline stage whose ranks this folder holds
  std::vector<PreshardedRank> ranks;
};

nlohmann::json to_json(const PreshardedManifest& m);

// Validates everything a reader relies on before it reads a byte: the format and
// version, each field's type, names (relative file names without "/" or ".."),
// offsets aligned and byte sizes equal to dtype x shape, tp ranks distinct, a
// param listed once a rank, and one tensor name never given two byte ranges.
// Throws Error(Stage::kIndex) naming `file`, the param when there is one, and the
// field.
PreshardedManifest parse_presharded_manifest(const nlohmann::json& j, const std::string& file);

// The first signature field whose value differs between the folder's manifest and
// the layout asked for, as "<field>: the folder has <a>, the load asks <b>"
// (a field missing on one side reads "(none)"); empty when they agree.
std::string presharded_mismatch(const std::map<std::string, std::string>& folder,
                                const std::map<std::string, std::string>& asked);

// ---- writing ------------------------------------------------------------------

// One param of one rank as a load left it: `nbytes` of storage, in storage order.
struct PreshardedParamSpec {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<std::uint64_t> shape;
  std::uint64_t nbytes = 0;
};
struct PreshardedRankSpec {
  int tp_rank = 0;
  std::vector<PreshardedParamSpec> params;
};
// Fills `out` with bytes [offset, offset + out.size()) of param `param` of rank
// `rank` (indices into the specs), from wherever they live (a device).
using PreshardedRead = std::function<void(std::size_t rank, std::size_t param, std::uint64_t offset,
                                          std::span<std::byte> out)>;

struct PreshardedWriteOptions {
  std::uint64_t max_file_bytes = std::uint64_t{20} << 30;  // a file holds one tensor at least
  std::uint64_t block_bytes = std::uint64_t{16} << 20;     // host memory of one read
};

// Writes `ranks` (tp ranks of pipeline stage `pp_rank`) into the folder `dir` (created when
// missing; refused, Stage::kOutput, when it is not empty): each param's bytes are read twice
// through `read`, once to hash and find the params stored once for several ranks (same name, dtype,
// shape and XXH3-128), once to write them (hashed again: bytes that changed in between are an
// error); files of at most max_file_bytes, the manifest, each synced, then READY. Returns the
// manifest written. Host memory: one block.
PreshardedManifest write_presharded(const std::string& dir,
                                    const std::map<std::string, std::string>& signature,
                                    const Hash128& structure, int pp_rank,
                                    const std::vector<PreshardedRankSpec>& ranks,
                                    const PreshardedRead& read,
                                    const PreshardedWriteOptions& options = {});

}  // namespace ferry::io
