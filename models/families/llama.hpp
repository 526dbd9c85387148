// Llama's descriptor, for the families SGLang implements as its Llama (Mistral,
// Phi-3).
#pragma once

#include <string>

#include "models/family.hpp"

namespace ferry::models::families {

// `architecture` placed as SGLang's LlamaForCausalLM places it, reported as `family`.
FamilyDescriptor llama_descriptor(std::string architecture, std::string family);

}  // namespace ferry::models::families
