#include "ferry/dlpack.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "common/error.hpp"

static_assert(DLPACK_VERSION >= 60, "ferry exports DLPack 0.6 tensors (kDLCUDA, kDLBfloat)");

namespace ferry::runtime {
namespace {

// What the DLManagedTensor points into: the model (kept alive) and the shape and
// strides arrays DLTensor borrows.
struct Context {
  std::shared_ptr<const LoadedModel> model;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  DLManagedTensor tensor{};
};

DLDataType dl_dtype(DType d) {
  switch (d) {
    case DType::kBool:  // no kDLBool before DLPack 0.8: bytes, as FP8
    case DType::kU8:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kF8E8M0:
      return {kDLUInt, 8, 1};  // FP8 and BOOL as bytes: DLPack 0.6 has no code for them
    case DType::kI8:
      return {kDLInt, 8, 1};
    case DType::kU16:
      return {kDLUInt, 16, 1};
    case DType::kI16:
      return {kDLInt, 16, 1};
    case DType::kU32:
      return {kDLUInt, 32, 1};
    case DType::kI32:
      return {kDLInt, 32, 1};
    case DType::kU64:
      return {kDLUInt, 64, 1};
    case DType::kI64:
      return {kDLInt, 64, 1};
    case DType::kF16:
      return {kDLFloat, 16, 1};
    case DType::kBF16:
      return {kDLBfloat, 16, 1};
    case DType::kF32:
      return {kDLFloat, 32, 1};
    case DType::kF64:
      return {kDLFloat, 64, 1};
  }
  return {kDLUInt, 8, 1};
}

[[noreturn]] void refuse(const std::string& device, const std::string& name,
                         const std::string& rule) {
  throw Error(Stage::kConfig, device, name, "DLPack export: " + rule);
}

// "host:3" -> {kDLCPU, 3}; "cuda:1" -> {kDLCUDA, 1}.
DLDevice dl_device(const std::string& device, const std::string& name) {
  const std::size_t colon = device.find(':');
  const std::string kind = device.substr(0, colon);
  int id = 0;
  if (colon != std::string::npos) {
    try {
      id = std::stoi(device.substr(colon + 1));
    } catch (const std::exception&) {
      refuse(device, name, "cannot read the device id of '" + device + "'");
    }
  }
  if (kind == "host") {
    return {kDLCPU, id};
  }
  if (kind == "cuda") {
    return {kDLCUDA, id};
  }
  if (kind == "null") {
    refuse(device, name, "a null device keeps no parameter data to export");
  }
  refuse(device, name, "device '" + device + "' has no DLPack device type");
}

}  // namespace

DLManagedTensor* to_dlpack(const std::shared_ptr<LoadedModel>& model, std::size_t local_rank,
                           const std::string& name) {
  if (!model) {
    refuse("", name, "no loaded model");
  }
  if (local_rank >= model->ranks().size()) {
    refuse("", name,
           "local rank " + std::to_string(local_rank) + " does not exist (the model has " +
               std::to_string(model->ranks().size()) + ")");
  }
  const LoadedRank& rank = model->ranks()[local_rank];
  const LoadedParam* p = rank.find(name);
  if (p == nullptr) {
    refuse(rank.device, name, "no parameter '" + name + "' on " + rank.device);
  }
  ParamView view;
  view.name = p->name;
  view.device = rank.device;
  view.tp_rank = rank.tp_rank;
  view.data = p->data;
  view.dtype = p->dtype;
  view.shape = p->shape;
  view.strides = p->strides;
  view.model = model;
  return to_dlpack(view);
}

DLManagedTensor* to_dlpack(const ParamView& view) {
  if (!view.model) {
    refuse(view.device, view.name, "the view holds no loaded model");
  }
  const DLDevice device = dl_device(view.device, view.name);
  auto ctx = std::make_unique<Context>();
  ctx->model = view.model;
  for (std::uint64_t d : view.shape) {
    ctx->shape.push_back(static_cast<std::int64_t>(d));
  }
  for (std::uint64_t s : view.strides) {
    ctx->strides.push_back(static_cast<std::int64_t>(s));
  }
  DLTensor& t = ctx->tensor.dl_tensor;
  t.data = view.data;
  t.device = device;
  t.ndim = static_cast<std::int32_t>(ctx->shape.size());
  t.dtype = dl_dtype(view.dtype);
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.empty() ? nullptr : ctx->strides.data();
  t.byte_offset = 0;
  ctx->tensor.manager_ctx = ctx.get();
  ctx->tensor.deleter = [](DLManagedTensor* self) {
    delete static_cast<Context*>(self->manager_ctx);  // drops the model reference
  };
  return &ctx.release()->tensor;
}

UpdateTensor update_tensor(std::string name, const DLTensor& tensor, std::optional<DType> dtype) {
  auto bad = [&](const std::string& rule) {
    throw Error(Stage::kConfig, "", name, "DLPack import for an update: " + rule);
  };
  const DLDataType t = tensor.dtype;
  if (t.lanes != 1) {
    bad("vector dtypes (lanes " + std::to_string(t.lanes) + ") are not a checkpoint dtype");
  }
  std::optional<DType> have;
  for (DType d : {DType::kU8, DType::kI8, DType::kU16, DType::kI16, DType::kU32, DType::kI32,
                  DType::kU64, DType::kI64, DType::kF16, DType::kBF16, DType::kF32, DType::kF64}) {
    const DLDataType x = dl_dtype(d);
    if (x.code == t.code && x.bits == t.bits) {
      have = d;
    }
  }
  if (!have) {
    bad("DLPack dtype code " + std::to_string(t.code) + " of " + std::to_string(t.bits) +
        " bits is not one ferry reads");
  }
  if (dtype && dtype_size(*dtype) != dtype_size(*have)) {
    bad(std::string("the given dtype ") + std::string(dtype_name(*dtype)) +
        " has another element size than the tensor's " + std::string(dtype_name(*have)));
  }
  if (tensor.ndim < 0) {
    bad("a negative number of dimensions");
  }
  UpdateTensor out;
  out.dtype = dtype.value_or(*have);
  std::int64_t expect = 1;
  for (int d = tensor.ndim; d-- > 0;) {
    if (tensor.shape[d] < 0) {
      bad("a negative dimension");
    }
    if (tensor.strides != nullptr && tensor.shape[d] != 1 && tensor.strides[d] != expect) {
      bad("the tensor is not row-major contiguous (make it .contiguous() first)");
    }
    expect *= tensor.shape[d];
  }
  for (int d = 0; d < tensor.ndim; ++d) {
    out.shape.push_back(static_cast<std::uint64_t>(tensor.shape[d]));
  }
  out.data = static_cast<const std::byte*>(tensor.data) + tensor.byte_offset;
  switch (tensor.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
      out.device = "host";
      break;
    case kDLCUDA:
      out.device = "cuda:" + std::to_string(tensor.device.device_id);
      break;
    default:
      bad("DLPack device type " + std::to_string(tensor.device.device_type) +
          " is neither the CPU nor a CUDA device");
  }
  out.name = std::move(name);  // last: the errors above name it
  return out;
}

}  // namespace ferry::runtime
