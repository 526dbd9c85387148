// Coverage (every param written exactly once by pieces, fills and hook outputs) and
// the post-load hook mechanism: a toy model whose second param only a hook fills,
// run on the host device backend, plus the hook validation errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "common/error.hpp"
#include "gpu/device.hpp"
#include "gpu/host_device.hpp"
#include "models/coverage.hpp"
#include "models/hooks.hpp"
#include "testing/with_hooks.hpp"
#include "models/host_hook_context.hpp"
#include "models/reference_util.hpp"
#include "models/table_model.hpp"
#include "testing/error_of.hpp"

namespace ferry::testing {
namespace {

using models::Block;
using models::PostLoadHook;
using models::Route;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<Route> route_all(const models::Model& m, const SynthCase& ck,
                             const std::set<std::string>& skip = {}) {
  std::vector<Route> routes;
  for (const std::string& name : ck.names) {
    if (skip.count(name) == 0) {
      routes.push_back(m.route(tensor_info(name, ck.dtype, ck.shapes.at(name))));
    }
  }
  return routes;
}

std::unique_ptr<models::Model> llama(int tp, bool tied = false) {
  models::ParallelLayout l;
  l.tp = tp;
  return models::make_model(tiny_case("llama", DType::kBF16, tied).config, l);
}

TEST(Coverage, EveryParamIsCoveredWhenEveryTensorIsRouted) {
  for (bool tied : {false, true}) {
    SynthCase ck = tiny_case("llama", DType::kBF16, tied);
    auto m = llama(4, tied);
    EXPECT_TRUE(models::check_coverage(*m, route_all(*m, ck)).empty()) << tied;
  }
}

TEST(Coverage, AMissingTensorNamesItsParam) {
  SynthCase ck = tiny_case("llama", DType::kBF16, false);
  auto m = llama(2);
  auto gaps =
      models::check_coverage(*m, route_all(*m, ck, {"model.layers.2.self_attn.k_proj.weight"}));
  ASSERT_EQ(gaps.size(), 2u);  // both ranks
  EXPECT_THAT(models::gap_names(gaps), ElementsAre("model.layers.2.self_attn.qkv_proj.weight"));
  for (const auto& g : gaps) {
    // Each rank misses one kv head: 16 rows of 128 BF16.
    EXPECT_EQ(g.expected - g.written, 16u * 128u * 2u);
    EXPECT_EQ(m->shells()[g.local_rank].params[g.param].name, g.name);
  }
  EXPECT_EQ(gaps[0].tp_rank, 0);
  EXPECT_EQ(gaps[1].tp_rank, 1);

  // Without lm_head only the padding rows of the last ranks are written.
  auto m8 = llama(8);
  auto head =
      models::check_coverage(*m8, route_all(*m8, ck, {"lm_head.weight", "model.norm.weight"}));
  EXPECT_THAT(models::gap_names(head), ElementsAre("lm_head.weight", "model.norm.weight"));
  std::uint64_t padding = 0;
  for (const auto& g : head) {
    if (g.name == "lm_head.weight") {
      padding += g.written;
    }
  }
  EXPECT_EQ(padding, 24u * 128u * 2u);
}

TEST(Coverage, OverlappingWritesAreAnInternalErrorNamingBothWriters) {
  SynthCase ck = tiny_case("llama", DType::kBF16, false);
  auto m = llama(1);
  std::vector<Route> routes = route_all(*m, ck);
  std::vector<std::string> names = ck.names;
  routes.push_back(m->route(tensor_info("model.norm.weight", DType::kBF16, {128})));
  names.push_back("model.norm.weight (again)");
  try {
    models::check_coverage(*m, routes, [&](std::size_t route) { return names[route]; });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kPlacement);
    EXPECT_EQ(e.tensor(), "model.norm.weight");
    EXPECT_THAT(e.rule(), HasSubstr("internal"));
    EXPECT_THAT(e.rule(), HasSubstr("written twice"));
    EXPECT_THAT(e.rule(), HasSubstr("a copy from tensor model.norm.weight ("));
    EXPECT_THAT(e.rule(), HasSubstr("a copy from tensor model.norm.weight (again)"));
  }
  // Without names, the routes are numbered.
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::check_coverage(*m, routes); }),
              HasSubstr("a copy of route #"));
}

// The case a byte count cannot see: one region written twice and another of the
// same size never written. The param's count is exactly its size; the intervals
// still catch it.
TEST(Coverage, ARegionWrittenTwiceAndAnotherNeverWrittenIsCaught) {
  SynthCase ck = tiny_case("llama", DType::kBF16, false);
  auto m = llama(1);
  std::vector<Route> routes = route_all(*m, ck);
  const std::size_t norm = m->shells()[0].by_name.at("model.norm.weight");
  bool moved = false;
  for (Route& r : routes) {
    for (models::Piece& p : r.pieces) {
      if (p.param == norm) {
        ASSERT_EQ(p.dst_bytes(), 256u);
        // Two halves: [0, 128) and [128, 256); the second now lands on the first.
        models::Piece half = p;
        half.width_elems = 64;
        p.width_elems = 64;
        half.src_offset += 128;
        r.pieces.push_back(half);
        moved = true;
        break;
      }
    }
    if (moved) {
      break;
    }
  }
  ASSERT_TRUE(moved);
  models::CoverageTracker count(*m);
  for (const Route& r : routes) {
    for (const models::Piece& p : r.pieces) {
      count.add(p);
    }
  }
  EXPECT_EQ(count.written(0, norm), 256u);  // the count alone says complete
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::check_coverage(*m, routes); }),
              AllOf(HasSubstr("model.norm.weight"), HasSubstr("bytes [0, 128) are written twice")));
}

TEST(Coverage, AWriteOutsideItsParamIsCaught) {
  SynthCase ck = tiny_case("llama", DType::kBF16, false);
  auto m = llama(1);
  std::vector<Route> routes = route_all(*m, ck);
  const std::size_t norm = m->shells()[0].by_name.at("model.norm.weight");
  for (Route& r : routes) {
    for (models::Piece& p : r.pieces) {
      if (p.param == norm) {
        p.dst_offset = 2;
      }
    }
  }
  EXPECT_THAT(error_of(Stage::kPlacement, [&] { models::check_coverage(*m, routes); }),
              AllOf(HasSubstr("model.norm.weight"), HasSubstr("bytes [2, 258)"),
                    HasSubstr("outside its 256 bytes")));
}

TEST(Coverage, TrackerCompletesAParamPieceByPiece) {
  auto m = llama(1);
  const std::size_t qkv = m->shells()[0].by_name.at("model.layers.0.self_attn.qkv_proj.weight");
  models::CoverageTracker tracker(*m);
  EXPECT_EQ(tracker.gaps().size(), m->shells()[0].params.size());
  const std::vector<std::pair<std::string, std::vector<std::uint64_t>>> parts{
      {"model.layers.0.self_attn.q_proj.weight", {128, 128}},
      {"model.layers.0.self_attn.k_proj.weight", {32, 128}},
      {"model.layers.0.self_attn.v_proj.weight", {32, 128}}};
  for (std::size_t i = 0; i < parts.size(); ++i) {
    EXPECT_FALSE(tracker.complete(0, qkv));
    for (const auto& p :
         m->route(tensor_info(parts[i].first, DType::kBF16, parts[i].second)).pieces) {
      tracker.add(p);
    }
  }
  EXPECT_TRUE(tracker.complete(0, qkv));
  EXPECT_EQ(tracker.written(0, qkv), m->shells()[0].params[qkv].nbytes);
  models::Piece bad;
  bad.local_rank = 3;
  EXPECT_THROW(tracker.add(bad), Error);
}

TEST(TableModel, ParamsMayHaveTheirOwnDtype) {
  models::ParallelLayout l;
  auto m = std::make_shared<models::TableModel>("toy", "ToyForTest", models::normalize_layout(l),
                                                DType::kBF16, false);
  m->add_param("toy.ids", models::Shape{3}, DType::kI32);
  m->add_param("toy.w", models::Shape{3});
  for (const char* name : {"ids", "w"}) {
    m->add_target(name, std::string("toy.") + name, models::Shape{3},
                  [](int) { return std::vector<Block>{models::replicated(3)}; });
  }
  EXPECT_THROW(m->route(tensor_info("w", DType::kBF16, {3})), Error);  // before finish()
  m->finish();
  const auto& shell = m->shells()[0];
  EXPECT_EQ(shell.params[shell.by_name.at("toy.ids")].dtype, DType::kI32);
  EXPECT_EQ(shell.params[shell.by_name.at("toy.ids")].nbytes, 12u);
  EXPECT_EQ(shell.params[shell.by_name.at("toy.w")].dtype, DType::kBF16);
  // Same dtype: a plain copy of any type; a float into an integer param: refused.
  Route ids = m->route(tensor_info("ids", DType::kI32, {3}));
  ASSERT_EQ(ids.pieces.size(), 1u);
  EXPECT_EQ(ids.pieces[0].dst_dtype, DType::kI32);
  EXPECT_THROW(m->route(tensor_info("ids", DType::kF32, {3})), Error);
  EXPECT_THROW(m->finish(), Error);
}

// ---- hooks -----------------------------------------------------------------------

// A toy model: "a" feeds toy.a; toy.b is filled only by a hook that copies toy.a.
std::shared_ptr<models::TableModel> toy_model(int tp) {
  models::ParallelLayout l;
  l.tp = tp;
  auto m = std::make_shared<models::TableModel>("toy", "ToyForTest", models::normalize_layout(l),
                                                DType::kF32, false);
  m->add_param("toy.a", models::Shape{4});
  m->add_param("toy.b", models::Shape{4});
  m->add_target("a", "toy.a", models::Shape{4},
                [](int) { return std::vector<Block>{models::replicated(4)}; });
  // A tensor no local rank takes, with the reason the rule gives for that.
  m->add_target(
      "far", "toy.a", models::Shape{4}, [](int) { return std::vector<Block>{}; }, "remote_expert");
  m->finish();
  return m;
}

PostLoadHook copy_hook(const models::Model& m, std::size_t local_rank) {
  const auto& shell = m.shells().at(local_rank);
  const std::size_t a = shell.by_name.at("toy.a");
  const std::size_t b = shell.by_name.at("toy.b");
  PostLoadHook h;
  h.name = "copy_a_to_b";
  h.local_rank = local_rank;
  h.inputs = {a};
  h.outputs = {b};
  h.run = [a, b](models::HookContext& ctx) {
    // Same dtype on both sides: cast is a device-to-device copy.
    ctx.stream().cast(ctx.param_data(b), DType::kF32, ctx.param_data(a), DType::kF32, 4);
  };
  return h;
}

TEST(Hooks, AToyHookFillsItsOutputOnTheHostDevice) {
  auto m = toy_model(2);
  for (std::size_t r = 0; r < m->shells().size(); ++r) {
    m->add_hook(copy_hook(*m, r));
  }
  ASSERT_EQ(m->hooks().size(), 2u);

  const std::vector<float> a{1.5f, -2.0f, 0.25f, 8.0f};
  std::vector<std::byte> a_bytes(sizeof(float) * a.size());
  std::memcpy(a_bytes.data(), a.data(), a_bytes.size());
  Route route = m->route(tensor_info("a", DType::kF32, {4}));
  ASSERT_EQ(route.pieces.size(), 2u);
  EXPECT_TRUE(models::check_coverage(*m, std::span<const Route>(&route, 1)).empty());

  gpu::HostDeviceOptions options;
  options.poison_allocations = true;
  auto device = gpu::make_host_device(0, options);
  auto stream = device->create_stream();
  std::vector<std::vector<gpu::DeviceAllocation>> storage(m->shells().size());
  for (std::size_t r = 0; r < m->shells().size(); ++r) {
    for (const auto& p : m->shells()[r].params) {
      storage[r].push_back(device->allocate(p.nbytes));
    }
  }
  // Copy pieces as a copy worker would (same dtype: a pitched host-to-device copy).
  for (const models::Piece& p : route.pieces) {
    stream->copy_h2d_2d(storage[p.local_rank][p.param].data() + p.dst_offset, p.dst_pitch,
                        a_bytes.data() + p.src_offset, p.src_pitch,
                        p.width_elems * dtype_size(p.src_dtype), p.rows);
  }
  for (const PostLoadHook& h : m->hooks()) {
    std::vector<std::byte*> params;
    for (auto& alloc : storage[h.local_rank]) {
      params.push_back(alloc.data());
    }
    HostHookContext ctx(*stream, params, h);
    h.run(ctx);
  }
  stream->synchronize();
  for (std::size_t r = 0; r < m->shells().size(); ++r) {
    const std::size_t b = m->shells()[r].by_name.at("toy.b");
    std::vector<float> got(4);
    stream->copy_d2h(reinterpret_cast<std::byte*>(got.data()), storage[r][b].data(), 16);
    stream->synchronize();
    EXPECT_EQ(got, a) << "rank " << r;
  }
}

TEST(Hooks, WithoutTheHookTheOutputIsUncovered) {
  auto m = toy_model(1);
  Route far = m->route(tensor_info("far", DType::kF32, {4}));
  EXPECT_EQ(far.kind, models::RouteKind::kDropped);
  EXPECT_EQ(far.reason, "remote_expert");
  Route route = m->route(tensor_info("a", DType::kF32, {4}));
  EXPECT_THAT(models::gap_names(models::check_coverage(*m, std::span<const Route>(&route, 1))),
              ElementsAre("toy.b"));
}

TEST(Hooks, InvalidHooksAreRefused) {
  auto m = toy_model(2);
  auto refused = [&](PostLoadHook h, const std::string& what) {
    try {
      m->add_hook(std::move(h));
      ADD_FAILURE() << "accepted a hook with " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.stage(), Stage::kPostProcess);
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  PostLoadHook h = copy_hook(*m, 0);
  h.local_rank = 2;
  refused(h, "local rank 2 has no shell");
  h = copy_hook(*m, 0);
  h.outputs = {7};
  refused(h, "output param index 7");
  h = copy_hook(*m, 0);
  h.inputs = {9};
  refused(h, "input param index 9");
  h = copy_hook(*m, 0);
  h.outputs = {h.outputs[0], h.outputs[0]};
  refused(h, "listed twice");
  h = copy_hook(*m, 0);
  h.outputs = h.inputs;
  refused(h, "also an input");
  h = copy_hook(*m, 0);
  h.run = nullptr;
  refused(h, "no function");
  h = copy_hook(*m, 0);
  h.name.clear();
  refused(h, "needs a name");
  m->add_hook(copy_hook(*m, 0));
  refused(copy_hook(*m, 0), "already filled by another hook");
  EXPECT_NO_THROW(m->add_hook(copy_hook(*m, 1)));  // the other rank's toy.b
}

// Rewrites: params the pieces fill that a hook then changes in place, once, after the
// hooks that read them.
TEST(Hooks, RewritesAreCheckedAgainstOutputsOtherRewritersAndReaders) {
  auto m = toy_model(1);
  auto refused = [&](PostLoadHook h, const std::string& what) {
    try {
      m->add_hook(std::move(h));
      ADD_FAILURE() << "accepted a hook with " << what;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  const std::size_t a = m->shells()[0].by_name.at("toy.a");
  const std::size_t b = m->shells()[0].by_name.at("toy.b");
  auto rewrite_a = [&](std::vector<std::size_t> inputs) {
    PostLoadHook h;
    h.name = "scale_a_in_place";
    h.rewrites = {a};
    h.inputs = std::move(inputs);
    h.run = [](models::HookContext&) {};
    return h;
  };
  PostLoadHook h = rewrite_a({});
  h.rewrites = {11};
  refused(h, "rewritten param index 11");
  h = rewrite_a({a});
  refused(h, "is also an input or output");
  h = rewrite_a({});
  h.rewrites = {b};
  h.outputs = {b};
  refused(h, "is also an input or output");
  m->add_hook(copy_hook(*m, 0));  // reads toy.a, fills toy.b
  h = rewrite_a({});
  h.rewrites = {b};
  refused(h, "toy.b is a hook's output");
  // Rewriting toy.a while copy_a_to_b reads it: only after it (waiting for toy.b).
  refused(rewrite_a({}), "without waiting for one of its outputs");
  EXPECT_NO_THROW(m->add_hook(rewrite_a({b})));
  refused(rewrite_a({b}), "is rewritten by two hooks");
}

TEST(Hooks, WithHooksDecoratesARealModel) {
  std::shared_ptr<const models::Model> base = llama(2);
  EXPECT_TRUE(base->hooks().empty());
  const auto& shell = base->shells()[1];
  PostLoadHook watch;
  watch.name = "after_qkv";
  watch.local_rank = 1;
  watch.inputs = {shell.by_name.at("model.layers.0.self_attn.qkv_proj.weight")};
  watch.run = [](models::HookContext&) {};
  auto hooked = ferry::testing::with_hooks(base, {watch});
  ASSERT_EQ(hooked->hooks().size(), 1u);
  EXPECT_EQ(hooked->hooks()[0].name, "after_qkv");
  EXPECT_EQ(&hooked->shells(), &base->shells());
  EXPECT_EQ(hooked->family(), "llama");
  EXPECT_EQ(hooked->layout().local_ranks, base->layout().local_ranks);
  auto info = tensor_info("model.norm.weight", DType::kBF16, {128});
  EXPECT_EQ(hooked->route(info).pieces, base->route(info).pieces);
  EXPECT_EQ(hooked->fill_pieces(), base->fill_pieces());
  // A hook whose output a tensor already writes is an overlap: an internal error.
  PostLoadHook clash = watch;
  clash.name = "clash";
  clash.inputs = {};
  clash.outputs = {shell.by_name.at("model.norm.weight")};
  auto clashing = ferry::testing::with_hooks(base, {clash});
  SynthCase ck = tiny_case("llama", DType::kBF16, false);
  EXPECT_THAT(error_of(Stage::kPlacement,
                       [&] { models::check_coverage(*clashing, route_all(*clashing, ck)); }),
              AllOf(HasSubstr("model.norm.weight"), HasSubstr("post-load hook 'clash'"),
                    HasSubstr("written twice")));
  watch.local_rank = 5;
  EXPECT_THROW(ferry::testing::with_hooks(base, {watch}), Error);
  EXPECT_THROW(ferry::testing::with_hooks(nullptr, {}), Error);
}

}  // namespace
}  // namespace ferry::testing
