// The model of a presharded read (model.load_format=presharded, runtime/presharded.hpp):
// the family's own model for the layout gives the shells, and the folder's manifest
// gives, for each local rank, where each param's bytes are stored. Each param is one
// whole, flat copy of its storage bytes from one stored tensor: nothing is sliced,
// cast, zero-filled or post-processed again (no fill pieces, no hooks), because the
// folder holds the params as a load left them.
#pragma once

#include <memory>
#include <string>

#include "io/presharded.hpp"
#include "models/model.hpp"

namespace ferry::models {

// `base`: the family's model for the layout asked for (its hooks and transient params
// are what made the folder; the result has neither). `manifest` was parsed from
// `manifest_file`. Checks, before anything is read, that the manifest holds the
// base's pipeline stage and every local tp rank, and that each rank lists exactly the
// base shell's kept params in order with their dtype, shape and byte size; throws
// Error(Stage::kIndex) naming `manifest_file`, the param and what differs.
//
// route() places a stored tensor whole into each local rank's param that the manifest
// stores there, after checking that the file's header puts it where the manifest
// says (file, offset, bytes: Stage::kIndex otherwise); drops the alignment padding
// ("padding") and other ranks' tensors ("other_rank"); a tensor the manifest does not
// name is unmapped.
std::shared_ptr<const Model> make_presharded_model(std::shared_ptr<const Model> base,
                                                   const io::PreshardedManifest& manifest,
                                                   const std::string& manifest_file);

}  // namespace ferry::models
