#include "gpu/backends.hpp"

#include <algorithm>
#include <charconv>
#include <string>

#include "common/error.hpp"
#include "gpu/null_device.hpp"

namespace ferry::gpu {

#if FERRY_HAVE_CUDA
namespace cuda {
int device_count(std::string* why);              // gpu/cuda/cuda_probe.cu
int compute_capability(int index);               // gpu/cuda/cuda_probe.cu
std::shared_ptr<Device> make_device(int index);  // gpu/cuda/cuda_device.cpp
}  // namespace cuda
bool cuda_compiled() {
  return true;
}
int cuda_device_count(std::string* why) {
  return cuda::device_count(why);
}
int cuda_compute_capability(int index) {
  return cuda::compute_capability(index);
}
#else
int cuda_compute_capability(int) {
  return -1;
}
bool cuda_compiled() {
  return false;
}
int cuda_device_count(std::string* why) {
  if (why != nullptr) {
    *why = "ferry was built without the CUDA backend (FERRY_CUDA=OFF or no toolkit)";
  }
  return 0;
}
#endif

namespace {

constexpr std::string_view kNotCompiled =
    "this ferry was built without the CUDA backend; reconfigure with -DFERRY_CUDA=ON on a "
    "machine with the CUDA toolkit";

[[noreturn]] void spec_error(std::string_view spec, const std::string& why) {
  throw Error(Stage::kConfig, "", "", "device spec '" + std::string(spec) + "': " + why);
}

// A spec that does not parse: also says what would.
[[noreturn]] void bad_spec(std::string_view spec, const std::string& why) {
  spec_error(spec, why + " (expected host:N, host, null:N, null, cuda:I[,J...] or cuda)");
}

// A non-negative decimal int, nothing else (no sign, no spaces).
bool parse_index(std::string_view text, int& out) {
  if (text.empty() || text.front() < '0' || text.front() > '9') {
    return false;
  }
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size();
}

}  // namespace

std::shared_ptr<Device> make_cuda_device(int index) {
  std::string name = "cuda:" + std::to_string(index);
  if (!cuda_compiled()) {
    throw Error(Stage::kConfig, name, "", std::string(kNotCompiled));
  }
  std::string why;
  int count = cuda_device_count(&why);
  if (count == 0) {
    throw Error(Stage::kConfig, name, "", "no CUDA device is usable: " + why);
  }
  if (index < 0 || index >= count) {
    throw Error(Stage::kConfig, name, "",
                "no such CUDA device (" + std::to_string(count) + " present)");
  }
#if FERRY_HAVE_CUDA
  return cuda::make_device(index);
#else
  return nullptr;  // unreachable: cuda_compiled() is false
#endif
}

std::vector<std::shared_ptr<Device>> make_devices(std::string_view spec,
                                                  const HostDeviceOptions& host_options) {
  std::string_view backend = spec.substr(0, spec.find(':'));
  bool has_list = backend.size() < spec.size();
  std::string_view list = has_list ? spec.substr(backend.size() + 1) : std::string_view();
  if (has_list && list.empty()) {
    bad_spec(spec, "nothing after ':'");
  }
  std::vector<std::shared_ptr<Device>> devices;

  if (backend == "host" || backend == "null") {
    const bool host = backend == "host";
    int count = 1;
    if (has_list && (!parse_index(list, count) || count == 0)) {
      bad_spec(spec, "'" + std::string(list) + "' is not a device count (" + std::string(backend) +
                         ":N makes N >= 1 " + (host ? "emulated" : "null") + " devices)");
    }
    for (int i = 0; i < count; ++i) {
      devices.push_back(host ? make_host_device(i, host_options) : make_null_device(i));
    }
    return devices;
  }

  if (backend == "cuda") {
    std::vector<int> indices;
    while (has_list) {
      std::size_t comma = list.find(',');
      std::string_view item = list.substr(0, comma);
      int index = 0;
      if (!parse_index(item, index)) {
        bad_spec(spec, "'" + std::string(item) + "' is not a CUDA device index");
      }
      if (std::find(indices.begin(), indices.end(), index) != indices.end()) {
        bad_spec(spec, "CUDA device " + std::to_string(index) + " is listed twice");
      }
      indices.push_back(index);
      if (comma == std::string_view::npos) {
        break;
      }
      list.remove_prefix(comma + 1);
      if (list.empty()) {
        bad_spec(spec, "the list ends with ','");
      }
    }
    if (!cuda_compiled()) {
      spec_error(spec, std::string(kNotCompiled));
    }
    std::string why;
    int count = cuda_device_count(&why);
    if (count == 0) {
      spec_error(spec, "no CUDA device is usable: " + why);
    }
    if (indices.empty()) {
      for (int i = 0; i < count; ++i) {
        indices.push_back(i);
      }
    }
    for (int index : indices) {
      if (index >= count) {
        spec_error(spec, "CUDA device " + std::to_string(index) + " does not exist (" +
                             std::to_string(count) + " present)");
      }
    }
    for (int index : indices) {
      devices.push_back(make_cuda_device(index));
    }
    return devices;
  }

  bad_spec(spec, backend.empty() ? std::string("no backend named")
                                 : "unknown backend '" + std::string(backend) + "'");
}

}  // namespace ferry::gpu
