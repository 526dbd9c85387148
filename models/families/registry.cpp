// The registry of families: one line (one name) per file in models/families/.
// Each file defines families::<name>(), its architectures' descriptors.
#include <set>

#include "common/error.hpp"
#include "models/family.hpp"

#define FERRY_FAMILY_FILES(X) \
  X(llama)                    \
  X(qwen2)                    \
  X(qwen3)                    \
  X(gemma)                    \
  X(phi3)                     \
  X(mixtral)                  \
  X(qwen_moe)                 \
  X(deepseek)                 \
  X(glm4_moe)

namespace ferry::models {
namespace families {
#define FERRY_DECLARE_FAMILY(name) std::vector<FamilyDescriptor> name();
FERRY_FAMILY_FILES(FERRY_DECLARE_FAMILY)
#undef FERRY_DECLARE_FAMILY
}  // namespace families

const std::vector<FamilyDescriptor>& family_descriptors() {
  static const std::vector<FamilyDescriptor> all = [] {
    std::vector<FamilyDescriptor> out;
    std::set<std::string> seen;
#define FERRY_ADD_FAMILY(name)                                                            \
  for (FamilyDescriptor& d : families::name()) {                                           \
    if (!seen.insert(d.architecture).second || !d.build) {                                 \
      throw Error(Stage::kMapping, "", "",                                                 \
                  "internal: family file " #name " registers " + d.architecture +          \
                      (d.build ? " twice" : " without a build"));                          \
    }                                                                                      \
    out.push_back(std::move(d));                                                           \
  }
    FERRY_FAMILY_FILES(FERRY_ADD_FAMILY)
#undef FERRY_ADD_FAMILY
    return out;
  }();
  return all;
}

}  // namespace ferry::models
