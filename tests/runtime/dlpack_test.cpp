// Parameters exported as DLPack tensors: zero-copy views of the loaded storage with
// DLPack's dtype and device codes, shapes and strides in elements (the MLA w_kc's
// column-major strides included), keeping the model alive until the deleter runs;
// bad requests name the parameter.
#include "ferry/dlpack.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu/host_device.hpp"
#include "gpu/null_device.hpp"
#include "runtime/api_internal.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"
#include "testing/error_of.hpp"
#include "testing/temp_dir.hpp"

namespace ferry::runtime {
namespace {

using testing::error_of;
using ::testing::HasSubstr;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

TEST(Dlpack, ParamsExportAsZeroCopyTensorsThatKeepTheModelAlive) {
  TempDir dir;
  const testing::Checkpoint ck = synth_checkpoint(dir.file("ds"), "deepseek_v3");
  RuntimeTestSeams hooks;
  hooks.devices = {gpu::make_host_device(0), gpu::make_host_device(1)};
  std::vector<DLManagedTensor*> tensors;
  {
    Runtime rt =
        make_runtime(to_config(make_config(ck.dir, {"parallel.tp=2", "model.dtype=f32"})), hooks);
    LoadResult r = rt.load();
    ASSERT_TRUE(r) << r.error->message;
    for (const std::string name :
         {"model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.w_kc",
          "model.layers.1.mlp.gate.e_score_correction_bias"}) {
      SCOPED_TRACE(name);
      const LoadedParam* p = r.model->ranks()[1].find(name);
      ASSERT_NE(p, nullptr);
      DLManagedTensor* t = to_dlpack(r.model, 1, name);
      tensors.push_back(t);
      EXPECT_EQ(t->dl_tensor.data, p->data);
      EXPECT_EQ(t->dl_tensor.device.device_type, kDLCPU);
      EXPECT_EQ(t->dl_tensor.device.device_id, 1);
      EXPECT_EQ(t->dl_tensor.dtype.code, kDLFloat);
      EXPECT_EQ(t->dl_tensor.dtype.bits, 32);
      EXPECT_EQ(t->dl_tensor.dtype.lanes, 1);
      ASSERT_EQ(t->dl_tensor.ndim, static_cast<int>(p->shape.size()));
      for (std::size_t d = 0; d < p->shape.size(); ++d) {
        EXPECT_EQ(t->dl_tensor.shape[d], static_cast<std::int64_t>(p->shape[d]));
        EXPECT_EQ(t->dl_tensor.strides[d], static_cast<std::int64_t>(p->strides[d]));
      }
      EXPECT_EQ(t->dl_tensor.byte_offset, 0u);
    }
    // w_kc is [heads, qk_nope, kv_lora] with strides (kv_lora*qk_nope, 1, qk_nope).
    const DLTensor& kc = tensors[1]->dl_tensor;
    EXPECT_EQ(kc.strides[1], 1);
    EXPECT_EQ(kc.strides[2], kc.shape[1]);
    // The bytes are the loaded ones, read through the view.
    const std::vector<std::byte> want =
        r.model->read_param(1, "model.layers.1.mlp.gate.e_score_correction_bias");
    EXPECT_EQ(std::memcmp(tensors[2]->dl_tensor.data, want.data(), want.size()), 0);
  }
  // The LoadResult and the Runtime are gone: the tensors still hold the model.
  for (const auto& d : hooks.devices) {
    EXPECT_FALSE(d->stats().all_released()) << d->name();
  }
  for (DLManagedTensor* t : tensors) {
    t->deleter(t);
  }
  for (const auto& d : hooks.devices) {
    EXPECT_TRUE(d->stats().all_released()) << d->name();
  }
}

TEST(Dlpack, Bf16HasItsOwnCodeAndBadRequestsNameTheParameter) {
  TempDir dir;
  const testing::Checkpoint ck = synth_checkpoint(dir.file("llama"), "llama");
  Runtime rt(to_config(make_config(ck.dir, {"parallel.tp=1"})));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  DLManagedTensor* t = to_dlpack(r.model, 0, "model.norm.weight");
  EXPECT_EQ(t->dl_tensor.dtype.code, kDLBfloat);
  EXPECT_EQ(t->dl_tensor.dtype.bits, 16);
  t->deleter(t);
  EXPECT_THAT(error_of(Stage::kConfig, [&] { to_dlpack(r.model, 0, "model.nope.weight"); }),
              HasSubstr("no parameter 'model.nope.weight' on host:0"));
  EXPECT_THAT(error_of(Stage::kConfig, [&] { to_dlpack(r.model, 3, "model.norm.weight"); }),
              HasSubstr("local rank 3 does not exist"));
  EXPECT_THAT(error_of(Stage::kConfig, [&] { to_dlpack(nullptr, 0, "model.norm.weight"); }),
              HasSubstr("no loaded model"));
  // A null device keeps no data to export.
  Runtime null_rt(to_config(make_config(ck.dir, {"parallel.tp=1", "devices=null"})));
  LoadResult n = null_rt.load();
  ASSERT_TRUE(n) << n.error->message;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { to_dlpack(n.model, 0, "model.norm.weight"); }),
              HasSubstr("a null device keeps no parameter data"));
}

TEST(Dlpack, EveryViewExportsAndAViewKeepsTheModelAlive) {
  TempDir dir;
  const testing::Checkpoint ck = synth_checkpoint(dir.file("ds"), "deepseek_v3");
  RuntimeTestSeams hooks;
  hooks.devices = {gpu::make_host_device(0), gpu::make_host_device(1)};
  std::vector<ParamView> views;
  {
    Runtime rt = make_runtime(to_config(make_config(ck.dir, {"parallel.tp=2"})), hooks);
    LoadResult r = rt.load();
    ASSERT_TRUE(r) << r.error->message;
    views = r.model->views();
    std::size_t params = 0;
    for (const LoadedRank& rank : r.model->ranks()) {
      params += rank.params.size();
    }
    ASSERT_EQ(views.size(), params);  // every parameter and derived buffer
    for (const ParamView& v : views) {
      DLManagedTensor* t = to_dlpack(v);
      EXPECT_EQ(t->dl_tensor.data, v.data) << v.name;
      EXPECT_EQ(t->dl_tensor.device.device_id, v.device == "host:1" ? 1 : 0) << v.name;
      EXPECT_EQ(t->dl_tensor.dtype.code, v.dtype == DType::kBF16 ? kDLBfloat : kDLFloat);
      ASSERT_EQ(t->dl_tensor.ndim, static_cast<int>(v.shape.size()));
      t->deleter(t);
    }
  }
  // The Runtime and the result are gone; the views alone hold every allocation.
  for (const auto& d : hooks.devices) {
    EXPECT_FALSE(d->stats().all_released()) << d->name();
  }
  DLManagedTensor* last = to_dlpack(views.back());
  views.clear();
  for (const auto& d : hooks.devices) {
    EXPECT_FALSE(d->stats().all_released()) << d->name();  // the tensor holds it now
  }
  last->deleter(last);
  for (const auto& d : hooks.devices) {
    EXPECT_TRUE(d->stats().all_released()) << d->name();
  }
  EXPECT_THAT(error_of(Stage::kConfig, [] { to_dlpack(ParamView{}); }),
              HasSubstr("the view holds no loaded model"));
}

// DLPack 0.6 has no code for FP8 or BOOL: they go out as one-byte unsigned
// elements (the real dtype stays the view's), and a cuda:N device as kDLCUDA N.
// Views of a loaded model relabelled, since no checkpoint holds FP8 yet.
TEST(Dlpack, Fp8AndBoolAreBytesAndCudaDevicesAreKdlCuda) {
  TempDir dir;
  const testing::Checkpoint ck = synth_checkpoint(dir.file("ll"), "llama");
  Runtime rt(to_config(make_config(ck.dir, {})));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  const ParamView base = r.model->views().front();
  for (DType d : {DType::kF8E4M3, DType::kF8E5M2, DType::kF8E8M0, DType::kBool, DType::kU8}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    ParamView v = base;
    v.dtype = d;
    v.device = "cuda:3";
    DLManagedTensor* t = to_dlpack(v);
    EXPECT_EQ(t->dl_tensor.dtype.code, kDLUInt);
    EXPECT_EQ(t->dl_tensor.dtype.bits, 8);
    EXPECT_EQ(t->dl_tensor.dtype.lanes, 1);
    EXPECT_EQ(t->dl_tensor.device.device_type, kDLCUDA);
    EXPECT_EQ(t->dl_tensor.device.device_id, 3);
    EXPECT_EQ(t->dl_tensor.data, base.data);
    t->deleter(t);
  }
}

// update_tensor: an update's in-memory tensor over a DLPack tensor's bytes.
TEST(Dlpack, UpdateTensorsBorrowContiguousCpuAndCudaTensors) {
  std::vector<std::uint16_t> data(6 * 4, 0);
  std::int64_t shape[2] = {6, 4};
  DLTensor t{};
  t.data = data.data();
  t.device = {kDLCPU, 0};
  t.ndim = 2;
  t.dtype = {kDLBfloat, 16, 1};
  t.shape = shape;
  t.byte_offset = 8;
  const UpdateTensor u = update_tensor("w", t);
  EXPECT_EQ(u.name, "w");
  EXPECT_EQ(u.dtype, DType::kBF16);
  EXPECT_EQ(u.shape, (std::vector<std::uint64_t>{6, 4}));
  EXPECT_EQ(u.data, reinterpret_cast<const std::byte*>(data.data()) + 8);
  EXPECT_EQ(u.device, "host");
  // Compact strides are contiguous; a size-1 dimension's stride does not matter.
  std::int64_t compact[2] = {4, 1};
  t.strides = compact;
  EXPECT_EQ(update_tensor("w", t).shape.size(), 2u);
  std::int64_t one_shape[2] = {1, 4};
  std::int64_t one_strides[2] = {99, 1};
  DLTensor row = t;
  row.shape = one_shape;
  row.strides = one_strides;
  EXPECT_EQ(update_tensor("w", row).shape, (std::vector<std::uint64_t>{1, 4}));
  // FP8 given as bytes, with its checkpoint dtype; a CUDA tensor names its device.
  DLTensor bytes = t;
  bytes.dtype = {kDLUInt, 8, 1};
  bytes.device = {kDLCUDA, 3};
  const UpdateTensor fp8 = update_tensor("w", bytes, DType::kF8E4M3);
  EXPECT_EQ(fp8.dtype, DType::kF8E4M3);
  EXPECT_EQ(fp8.device, "cuda:3");

  // Refused, naming the tensor.
  std::int64_t transposed[2] = {1, 6};
  DLTensor bad = t;
  bad.strides = transposed;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { update_tensor("w", bad); }),
              HasSubstr("row-major contiguous"));
  EXPECT_THAT(error_of(Stage::kConfig, [&] { update_tensor("w", bad); }), HasSubstr("'w'"));
  bad = t;
  bad.dtype = {kDLFloat, 32, 4};
  EXPECT_THAT(error_of(Stage::kConfig, [&] { update_tensor("w", bad); }), HasSubstr("lanes"));
  bad = t;
  bad.dtype = {kDLComplex, 64, 1};
  EXPECT_THAT(error_of(Stage::kConfig, [&] { update_tensor("w", bad); }),
              HasSubstr("is not one ferry reads"));
  EXPECT_THAT(error_of(Stage::kConfig, [&] { update_tensor("w", t, DType::kF32); }),
              HasSubstr("another element size"));
  bad = t;
  bad.device = {kDLOpenCL, 0};
  EXPECT_THAT(error_of(Stage::kConfig, [&] { update_tensor("w", bad); }),
              HasSubstr("neither the CPU nor"));
  std::int64_t negative[2] = {-1, 4};
  bad = t;
  bad.shape = negative;
  bad.strides = nullptr;
  EXPECT_THAT(error_of(Stage::kConfig, [&] { update_tensor("w", bad); }), HasSubstr("negative"));
}

}  // namespace
}  // namespace ferry::runtime
