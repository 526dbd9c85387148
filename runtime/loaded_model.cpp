// LoadedModel: the result of a load, its parameters as views, read back and dumped.
// Its State (runtime/load_work.hpp) owns the devices and every allocation, so the
// model stays valid after the Runtime is gone.
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "io/safetensors_writer.hpp"
#include "runtime/load_work.hpp"

namespace ferry::runtime {

namespace {

bool contiguous(const LoadedParam& p) {
  std::uint64_t expect = 1;
  for (std::size_t i = p.shape.size(); i-- > 0;) {
    if (p.shape[i] != 1 && p.strides[i] != expect) {
      return false;
    }
    expect *= p.shape[i];
  }
  return true;
}

}  // namespace

const LoadedParam* LoadedRank::find(const std::string& name) const {
  auto it = std::lower_bound(params.begin(), params.end(), name,
                             [](const LoadedParam& p, const std::string& n) { return p.name < n; });
  return it != params.end() && it->name == name ? &*it : nullptr;
}

LoadedModel::LoadedModel(std::shared_ptr<State> state) : state_(std::move(state)) {}

const std::vector<LoadedRank>& LoadedModel::ranks() const {
  return state_->ranks;
}

const LoadReport& LoadedModel::report() const {
  return state_->report;
}

const std::vector<ManifestEntry>& LoadedModel::manifest() const {
  return state_->manifest;
}

std::vector<ParamView> LoadedModel::views() const {
  std::shared_ptr<const LoadedModel> self = shared_from_this();
  std::vector<ParamView> out;
  for (std::size_t r = 0; r < state_->ranks.size(); ++r) {
    const LoadedRank& rank = state_->ranks[r];
    for (std::size_t p = 0; p < rank.params.size(); ++p) {
      const LoadedParam& param = rank.params[p];
      const gpu::DeviceAllocation& a = state_->storage[r][p];
      ParamView v;
      v.name = param.name;
      v.device = rank.device;
      v.tp_rank = rank.tp_rank;
      v.data = param.data;
      v.dtype = param.dtype;
      v.shape = param.shape;
      v.strides = param.strides;
      v.byte_offset = a.empty() ? 0 : static_cast<std::uint64_t>(param.data - a.data());
      v.model = self;
      out.push_back(std::move(v));
    }
  }
  return out;
}

namespace {

// read_param and dump need parameter bytes, which a null device does not keep.
void require_data(const gpu::Device& device, const std::string& what) {
  if (!device.holds_data()) {
    throw Error(Stage::kConfig, device.name(), "",
                what + ": this device keeps no parameter data (a null device)");
  }
}

}  // namespace

std::vector<std::byte> LoadedModel::read_param(std::size_t rank_index,
                                               const std::string& name) const {
  if (rank_index >= state_->ranks.size()) {
    throw Error(Stage::kConfig, "", name,
                "read_param: local rank " + std::to_string(rank_index) + " does not exist (" +
                    std::to_string(state_->ranks.size()) + " local ranks)");
  }
  const LoadedRank& rank = state_->ranks[rank_index];
  const LoadedParam* p = rank.find(name);
  if (p == nullptr) {
    throw Error(Stage::kConfig, rank.device, name, "read_param: no such parameter");
  }
  require_data(*state_->devices[rank_index], "read_param");
  std::vector<std::byte> out(p->nbytes);
  auto stream = state_->devices[rank_index]->create_stream();
  stream->copy_d2h(out.data(), p->data, p->nbytes);
  stream->synchronize();
  return out;
}

bool LoadedModel::valid() const {
  std::lock_guard lock(state_->validity_mu);
  return state_->invalid_reason.empty();
}

std::string LoadedModel::invalid_reason() const {
  std::lock_guard lock(state_->validity_mu);
  return state_->invalid_reason;
}

void LoadedModel::dump(const std::string& dir) const {
  namespace fs = std::filesystem;
  if (std::string why = invalid_reason(); !why.empty()) {
    throw Error(Stage::kOutput, dir, "", "dump: the model is invalid: " + why);
  }
  for (const auto& device : state_->devices) {
    require_data(*device, "dump");
  }
  // The folder's path reaches C calls, which would end it at a NUL (Python can pass one).
  if (dir.find('\0') != std::string::npos) {
    throw Error(Stage::kConfig, "", "", "dump: the folder's path contains a NUL byte");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw Error(Stage::kOutput, dir, "", "dump: cannot create the folder: " + ec.message());
  }
  constexpr std::size_t kBlock = std::size_t{16} << 20;  // bounded host memory per copy
  for (std::size_t r = 0; r < state_->ranks.size(); ++r) {
    const LoadedRank& rank = state_->ranks[r];
    io::SafetensorsWriter writer(
        (fs::path(dir) / ("rank-" + std::to_string(rank.tp_rank) + ".safetensors")).string(),
        Stage::kOutput, "dump");
    writer.set_metadata({{"format", "pt"},
                         {"ferry.tp_rank", std::to_string(rank.tp_rank)},
                         {"ferry.device", rank.device}});
    for (const LoadedParam& p : rank.params) {
      writer.add(p.name, p.dtype, p.shape);
    }
    writer.begin();
    auto stream = state_->devices[r]->create_stream();
    std::vector<std::byte> buf;
    for (const LoadedParam& p : rank.params) {
      const std::size_t es = dtype_size(p.dtype);
      if (contiguous(p)) {
        std::uint64_t logical = es;
        for (std::uint64_t d : p.shape) {
          logical *= d;
        }
        for (std::uint64_t off = 0; off < logical; off += kBlock) {
          std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kBlock, logical - off));
          buf.resize(n);
          stream->copy_d2h(buf.data(), p.data + off, n);
          stream->synchronize();
          writer.write(buf);
        }
        continue;
      }
      // Strided storage (e.g. a transposed view): gather the logical order.
      std::vector<std::byte> all = read_param(r, p.name);
      std::vector<std::uint64_t> index(p.shape.size(), 0);
      std::uint64_t count = 1;
      for (std::uint64_t d : p.shape) {
        count *= d;
      }
      buf.clear();
      for (std::uint64_t i = 0; i < count; ++i) {
        std::uint64_t off = 0;
        for (std::size_t d = 0; d < index.size(); ++d) {
          off += index[d] * p.strides[d];
        }
        buf.insert(buf.end(), all.begin() + static_cast<std::ptrdiff_t>(off * es),
                   all.begin() + static_cast<std::ptrdiff_t>((off + 1) * es));
        for (std::size_t d = index.size(); d-- > 0;) {
          if (++index[d] < p.shape[d]) {
            break;
          }
          index[d] = 0;
        }
      }
      writer.write(buf);
    }
    writer.finish();
  }
}

}  // namespace ferry::runtime
