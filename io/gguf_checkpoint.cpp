#include "io/gguf_checkpoint.hpp"

#include <algorithm>
#include <optional>
#include <utility>

#include "common/error.hpp"
#include "io/gguf.hpp"
#include "io/gguf_config.hpp"
#include "io/gguf_names.hpp"

namespace ferry::io {

GgufCheckpoint read_gguf_checkpoint(const File& file, std::uint64_t max_metadata_bytes,
                                    bool dequantize) {
  GgufParseOptions options;
  options.max_metadata_bytes = max_metadata_bytes;
  const GgufHeader gguf = read_gguf_header(file, options);
  const GgufHfMap map = map_gguf_to_hf(gguf);
  GgufCheckpoint out;
  GgufHfConfig config = gguf_hf_config(gguf);
  out.config = std::move(config.config);
  out.notes = std::move(config.notes);
  out.skipped = map.skipped;
  SafetensorsHeader& h = out.header;
  h.file = gguf.file;
  h.file_size = gguf.file_size;
  h.header_bytes = gguf.header_bytes;
  h.identity = gguf.identity;
  for (const GgufHfTensor& t : map.tensors) {
    std::optional<DType> dtype = ggml_dtype(t.type);
    const std::optional<GgmlBlocks> blocks = ggml_blocks(t.type);
    if (!dtype && blocks && dequantize) {
      dtype = DType::kF32;  // what each element dequantizes to
    }
    if (!dtype) {
      const std::string type(ggml_type_name(t.type));
      throw Error(Stage::kHeader, gguf.file, t.gguf_name,
                  !blocks ? "GGML type " + type +
                                " is not supported: ferry loads GGUF tensors of types F32, F16, "
                                "BF16 and the integers, and dequantizes Q4_0, Q4_1, Q5_0, Q5_1, "
                                "Q8_0 and Q2_K to Q6_K"
                          : "GGML type " + type +
                                " is quantized and gguf.dequantize is off: keeping GGML blocks "
                                "for GGUF kernels (SGLang's GGUFLinearMethod) is not built; "
                                "gguf.dequantize=true dequantizes them on the device");
    }
    if (t.how == GgufToHf::kMlaKB || t.how == GgufToHf::kMlaVB) {
      throw Error(Stage::kHeader, gguf.file, t.gguf_name,
                  "DeepSeek's kv_b_proj split into attn_k_b and attn_v_b (current "
                  "convert_hf_to_gguf.py) is not loaded yet: it is put back together element "
                  "by element; files with attn_kv_b load");
    }
    for (const GgufHfPiece& p : t.pieces) {
      TensorInfo info;
      info.name = p.hf_name;
      info.dtype = *dtype;
      info.shape = p.hf_shape;
      info.file = gguf.file;
      info.offset = p.offset;
      info.nbytes = p.nbytes;
      info.blocks = blocks.value_or(GgmlBlocks::kNone);  // a quantized type got here dequantized
      if (t.how == GgufToHf::kUnpermuteRows) {
        info.interleaved_heads = static_cast<std::uint32_t>(t.heads);
      }
      h.tensors.push_back(std::move(info));
    }
  }
  std::stable_sort(h.tensors.begin(), h.tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) { return a.offset < b.offset; });
  return out;
}

}  // namespace ferry::io
