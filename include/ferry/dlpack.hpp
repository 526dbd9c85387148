// Parameters as DLPack tensors (Debian's libdlpack-dev, DLPack 0.6), for engines
// that hand them to a framework: every parameter and derived buffer of a loaded
// model, zero-copy. The DLManagedTensor keeps the loaded model alive until its
// deleter is called, so a framework may hold it past the LoadResult.
//
// Dtypes: BF16 as kDLBfloat 16, F16/F32/F64 as kDLFloat, signed and unsigned
// integers as kDLInt / kDLUInt. FP8 (E4M3, E5M2, E8M0) and BOOL have no DLPack code
// in 0.6: they are exported as kDLUInt 8, one byte an element, and the real dtype
// is the LoadedParam's. Devices: "host:N" as kDLCPU, "cuda:N" as kDLCUDA
// with device id N; a `null` device holds no data and is refused.
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "ferry/export.hpp"
#include "ferry/runtime.hpp"

namespace ferry::runtime {

// The DLPack tensor of parameter `name` of local rank `local_rank` (index into
// model->ranks()). The caller owns the result and must call its deleter once.
// Throws ferry::Error(Stage::kConfig) naming the parameter for an unknown rank or
// name, or a device that holds no data.
FERRY_API DLManagedTensor* to_dlpack(const std::shared_ptr<LoadedModel>& model,
                                     std::size_t local_rank, const std::string& name);
// The same for a view (LoadedModel::views()); the tensor holds the view's model.
FERRY_API DLManagedTensor* to_dlpack(const ParamView& view);

// An in-memory update tensor (Runtime::update) over a DLPack tensor's bytes,
// borrowed: `tensor` must outlive the update. It must be row-major contiguous (null
// strides or compact ones), on the CPU (kDLCPU, kDLCUDAHost) or a CUDA device
// (kDLCUDA, read back through the model's device of that name), of a dtype DLPack
// 0.6 names (kDLBfloat 16, kDLFloat 16/32/64, kDLInt / kDLUInt 8..64, one lane).
// `dtype`, when given, is the checkpoint dtype its bytes hold, of the same element
// size (FP8 tensors as uint8 bytes: DType::kF8E4M3). Throws ferry::Error
// (Stage::kConfig) naming the tensor for anything else.
FERRY_API UpdateTensor update_tensor(std::string name, const DLTensor& tensor,
                                     std::optional<DType> dtype = std::nullopt);

}  // namespace ferry::runtime
