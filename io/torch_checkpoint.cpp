#include "io/torch_checkpoint.hpp"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "common/error.hpp"
#include "io/pickle.hpp"
#include "io/read_fully.hpp"

namespace ferry::io {
namespace {

[[noreturn]] void fail(const std::string& display, const std::string& tensor,
                       const std::string& rule) {
  throw Error(Stage::kHeader, display, tensor, rule);
}

std::string dims_text(const std::vector<std::uint64_t>& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return s + "]";
}

// What the first bytes say the file is, when it is not a zip archive.
void check_zip_magic(const ReadAt& read, std::uint64_t file_size, const std::string& display) {
  std::byte head[4]{};
  if (file_size >= 4) {
    read(0, head);
  }
  if (file_size >= 4 && head[0] == std::byte{'P'} && head[1] == std::byte{'K'} &&
      head[2] == std::byte{3} && head[3] == std::byte{4}) {
    return;
  }
  if (file_size >= 2 && head[0] == std::byte{0x80} && std::to_integer<int>(head[1]) <= 5) {
    fail(display, "",
         "a legacy torch.save file (PyTorch before 1.6, or _use_new_zipfile_serialization="
         "False): a stream of pickles whose storages follow the last one, which cannot be "
         "indexed without running it; re-save it with torch.save in PyTorch 1.6 or later, or "
         "as safetensors");
  }
  fail(display, "", "not a torch.save zip archive (it does not start with a zip local header)");
}

std::uint64_t elements(const std::vector<std::uint64_t>& shape, const std::string& display,
                       const std::string& tensor) {
  std::uint64_t n = 1;
  for (std::uint64_t d : shape) {
    if (d != 0 && n > UINT64_MAX / d) {
      fail(display, tensor, "shape " + dims_text(shape) + " overflows 64 bits");
    }
    n *= d;
  }
  return n;
}

}  // namespace

SafetensorsHeader parse_torch_checkpoint(const ReadAt& read, std::uint64_t file_size,
                                         const std::string& display,
                                         std::uint64_t max_pickle_bytes) {
  check_zip_magic(read, file_size, display);
  const ZipDirectory zip = read_zip_directory(read, file_size, display, max_pickle_bytes);
  std::unordered_map<std::string_view, const ZipMember*> by_name;
  by_name.reserve(zip.members.size());
  const ZipMember* pickle = nullptr;
  for (const ZipMember& m : zip.members) {
    by_name.emplace(m.name, &m);
    if (m.method != 0) {
      fail(display, "",
           "archive member " + m.name + " is compressed (method " + std::to_string(m.method) +
               "); torch.save stores every member, and ferry reads tensors in place");
    }
    const std::size_t slash = m.name.find('/');
    if (slash != std::string::npos && m.name.substr(slash) == "/data.pkl") {
      if (pickle != nullptr) {
        fail(display, "", "two pickles in one archive: " + pickle->name + " and " + m.name);
      }
      pickle = &m;
    }
  }
  if (pickle == nullptr) {
    fail(display, "", "no <archive>/data.pkl member: not a torch.save archive");
  }
  const std::string prefix = pickle->name.substr(0, pickle->name.size() - 8);  // "<archive>/"
  std::uint64_t read_bytes = zip.bytes_read;
  if (auto it = by_name.find(prefix + "byteorder"); it != by_name.end()) {
    const ZipMember& m = *it->second;
    if (m.size > 16) {
      fail(display, "", "the byteorder member is " + std::to_string(m.size) + " bytes");
    }
    std::string order(m.size, '\0');
    read(m.data_offset, std::as_writable_bytes(std::span(order.data(), order.size())));
    read_bytes += m.size;
    if (order != "little") {
      fail(display, "", "byteorder is '" + order + "'; ferry reads little-endian tensors only");
    }
  }
  if (pickle->size > max_pickle_bytes) {
    fail(display, "",
         pickle->name + " is " + std::to_string(pickle->size) + " bytes, over the limit of " +
             std::to_string(max_pickle_bytes) + " (io.max_metadata_bytes)");
  }
  std::string bytes(pickle->size, '\0');
  read(pickle->data_offset, std::as_writable_bytes(std::span(bytes.data(), bytes.size())));
  read_bytes += bytes.size();
  std::vector<PickledTensor> pickled =
      parse_state_dict_pickle(bytes, display + " (" + pickle->name + ")");
  bytes = std::string();

  SafetensorsHeader h;
  h.file = display;
  h.file_size = file_size;
  h.header_bytes = read_bytes;
  h.tensors.reserve(pickled.size());
  for (PickledTensor& p : pickled) {
    const std::string member = prefix + "data/" + p.storage_key;
    auto it = by_name.find(member);
    if (it == by_name.end()) {
      fail(display, p.name, "its storage " + member + " is not in the archive");
    }
    const ZipMember& storage = *it->second;
    const std::uint64_t esize = dtype_size(p.dtype);
    const std::uint64_t unit = p.untyped_storage ? 1 : esize;
    if (p.storage_numel > UINT64_MAX / unit || p.storage_numel * unit != storage.size) {
      fail(display, p.name,
           "its storage " + member + " holds " + std::to_string(storage.size) +
               " bytes but the pickle says " + std::to_string(p.storage_numel) +
               (p.untyped_storage ? " bytes" : " elements of " + std::string(dtype_name(p.dtype))));
    }
    const std::uint64_t n = elements(p.shape, display, p.name);
    // Contiguous row-major strides; a dimension of size 1 (or an empty tensor) may
    // carry any stride, as torch's is_contiguous() allows.
    std::uint64_t expect = 1;
    for (std::size_t d = p.shape.size(); d-- > 0;) {
      if (n != 0 && p.shape[d] != 1 && p.stride[d] != expect) {
        fail(display, p.name,
             "its strides " + dims_text(p.stride) + " for shape " + dims_text(p.shape) +
                 " are not contiguous (a transposed or sliced view); save tensor.contiguous() "
                 "or safetensors");
      }
      expect *= p.shape[d];
    }
    const std::uint64_t size = storage.size;
    if (n > size / esize || p.storage_offset > size / esize ||
        p.storage_offset * esize > size - n * esize) {
      fail(display, p.name,
           "shape " + dims_text(p.shape) + " at storage offset " +
               std::to_string(p.storage_offset) + " runs past its storage " + member + " (" +
               std::to_string(size) + " bytes)");
    }
    TensorInfo t;
    t.name = std::move(p.name);
    t.dtype = p.dtype;
    t.shape = std::move(p.shape);
    t.file = display;
    t.offset = storage.data_offset + p.storage_offset * esize;
    t.nbytes = n * esize;
    h.tensors.push_back(std::move(t));
  }
  std::stable_sort(h.tensors.begin(), h.tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) {
                     return a.offset != b.offset ? a.offset < b.offset : a.nbytes < b.nbytes;
                   });
  // Tensors sharing a storage: the same view twice is tied weights (one range, two
  // names); any other overlap is two layouts of one set of bytes.
  const TensorInfo* reach = nullptr;  // the tensor that ends last so far
  for (const TensorInfo& t : h.tensors) {
    if (reach != nullptr && t.nbytes != 0 && t.offset < reach->offset + reach->nbytes) {
      const bool same_view = t.offset == reach->offset && t.nbytes == reach->nbytes &&
                             t.dtype == reach->dtype && t.shape == reach->shape;
      if (!same_view) {
        fail(display, t.name,
             "its bytes overlap tensor " + reach->name +
                 " with another layout (one storage viewed two ways). SGLang's "
                 "pt_weights_iterator would hand both views to the model as they are; ferry "
                 "reads each tensor as its own byte range and refuses to guess which layout the "
                 "bytes hold; save each tensor with its own storage (tensor.clone())");
      }
      continue;
    }
    if (t.nbytes != 0 &&
        (reach == nullptr || t.offset + t.nbytes > reach->offset + reach->nbytes)) {
      reach = &t;
    }
  }
  return h;
}

SafetensorsHeader read_torch_checkpoint(const File& file, std::uint64_t max_pickle_bytes) {
  const ReadAt read = [&file](std::uint64_t offset, std::span<std::byte> into) {
    read_exactly(file.fd(), into, offset, Stage::kHeader, file.display(), "",
                 "the torch.save archive's records (directory, headers, data.pkl)");
  };
  SafetensorsHeader h = parse_torch_checkpoint(read, file.size(), file.display(), max_pickle_bytes);
  h.identity = file.identity();
  return h;
}

}  // namespace ferry::io
