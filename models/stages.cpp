#include "models/stages.hpp"

#include <string>
#include <vector>

#include "models/layers.hpp"

namespace ferry::models {
namespace {

using Blocks = std::vector<Block>;

// VocabParallelEmbedding / ParallelLMHead: `param` holds this rank's rows of the
// vocabulary padded to kVocabPadding; checkpoint tensor `tensor` ([vocab, hidden])
// feeds the real rows, the padded tail is zero-filled.
void add_vocab_parallel(TableModel& m, const StageEdges& e, int tp, const std::string& tensor,
                        const std::string& param) {
  if (e.replicated_embedding) {
    m.add_param(param, Shape{e.vocab, e.hidden});
    m.add_target(tensor, param, Shape{e.vocab, e.hidden},
                 [v = e.vocab](int) { return Blocks{replicated(v)}; });
    return;
  }
  const std::uint64_t local = even_shard(padded_vocab(e.vocab), 0, tp, "padded vocab_size").length;
  m.add_param(param, Shape{local, e.hidden});
  m.add_target(tensor, param, Shape{e.vocab, e.hidden}, [v = e.vocab, tp](int rank) {
    return Blocks{vocab_parallel(v, rank % tp, tp).copy};
  });
  m.add_fill(param, [v = e.vocab, tp](int rank) {
    return Blocks{vocab_parallel(v, rank % tp, tp).zero};
  });
}

}  // namespace

void add_stage_edges(TableModel& m, const StageEdges& edges, const ParallelLayout& layout) {
  const bool first = layout.pp_rank == 0;
  const bool last = layout.pp_rank == layout.pp - 1;
  const int embed_tp = edges.embed_group != 0 ? edges.embed_group : layout.tp;
  const int tp = edges.head_group != 0 ? edges.head_group : layout.tp;

  if (first) {
    add_vocab_parallel(m, edges, embed_tp, edges.embed_name, edges.embed_name);
  } else if (!(last && edges.tie_embeddings)) {
    m.add_drop_name(edges.embed_name, "first_stage_only");
  }

  if (!last) {
    m.add_drop_name(edges.norm_name, "last_stage_only");
    if (edges.head_on_every_stage && !edges.tie_embeddings) {
      add_vocab_parallel(m, edges, tp, edges.head_name, edges.head_name);
    } else {
      m.add_drop_name(edges.head_name, "last_stage_only");
    }
    return;
  }
  m.add_param(edges.norm_name, Shape{edges.hidden});
  m.add_target(edges.norm_name, edges.norm_name, Shape{edges.hidden},
               [h = edges.hidden](int) { return Blocks{replicated(h)}; });
  if (!edges.tie_embeddings) {
    add_vocab_parallel(m, edges, tp, edges.head_name, edges.head_name);
    return;
  }
  // Tied: the output projection is embed_tokens. A checkpoint's own lm_head.weight
  // (some tied checkpoints still save it) is never read.
  m.add_drop_name(edges.head_name, "tied_lm_head");
  if (!first) {
    // The last stage holds no embed_tokens to share, so it gets an lm_head param of
    // its own and fills it from the embedding tensor (SGLang does the same on a
    // last pipeline rank).
    add_vocab_parallel(m, edges, tp, edges.embed_name, edges.head_name);
  }
  // first && last: no lm_head param at all; the engine uses embed_tokens.
}

void add_layer_drops(TableModel& m, std::uint64_t num_layers, Range stage) {
  for (std::uint64_t layer = 0; layer < num_layers; ++layer) {
    if (layer >= stage.begin && layer < stage.end()) {
      continue;
    }
    // The trailing dot keeps layer 1 from matching layer 11's tensors.
    m.add_drop_pattern(layer_prefix(layer), "pp_stage");
  }
}

}  // namespace ferry::models
