// Stage labels of the error paths the fault matrix does not cover (hardening round
// two, item 10): an exception that is not a ferry::Error is labelled by the phase
// the load had reached (it was always "config"), and writing an output after the
// load (the dump, the report, the trace, the metrics textfile) is stage "output"
// (a dump on a full disk was "synth").
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <filesystem>
#include <stdexcept>
#include <string>

#include "common/error.hpp"
#include "runtime/runtime_test_util.hpp"
#include "runtime/test_seams.hpp"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using testing::Checkpoint;
using testing::make_config;
using testing::synth_checkpoint;
using testing::TempDir;

TEST(ErrorStages, AnExceptionThatIsNotAFerryErrorIsLabelledByItsPhase) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  {
    RuntimeTestSeams hooks;  // wrap_model runs in the plan phase
    hooks.wrap_model = [](std::shared_ptr<const models::Model>)
        -> std::shared_ptr<const models::Model> { throw std::runtime_error("boom"); };
    Runtime rt = make_runtime(to_config(make_config(ck.dir, {})), std::move(hooks));
    LoadResult r = rt.load();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kPlacement) << r.error->message;
    EXPECT_EQ(r.error->message, "placement: unexpected during plan: boom");
  }
  {
    RuntimeTestSeams hooks;
    hooks.wrap_model = [](std::shared_ptr<const models::Model>)
        -> std::shared_ptr<const models::Model> { throw 42; };
    Runtime rt = make_runtime(to_config(make_config(ck.dir, {})), std::move(hooks));
    LoadResult r = rt.load();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error->stage, Stage::kPlacement) << r.error->message;
    EXPECT_NE(r.error->message.find("an exception that is not a std::exception"),
              std::string::npos)
        << r.error->message;
  }
}

TEST(ErrorStages, ADumpThatHitsAFullDiskIsStageOutputNotSynth) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  Runtime rt(to_config(make_config(ck.dir, {})));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  fs::create_directories(dir.path() / "dump");
  // rank-0.safetensors is a twin of /dev/full: written in place, every write ENOSPC.
  const std::string full = dir.file("dump/rank-0.safetensors");
  if (::mknod(full.c_str(), S_IFCHR | 0666, makedev(1, 7)) != 0) {
    GTEST_SKIP() << "mknod is not permitted here; CI runs as root and makes the node";
  }
  try {
    r.model->dump(dir.file("dump"));
    ADD_FAILURE() << "the dump succeeded on a full device";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kOutput) << e.what();
    EXPECT_EQ(e.file(), full);
    EXPECT_EQ(e.rule(), "dump: cannot write: " + errno_text(ENOSPC));
  }
  struct stat st {};
  ASSERT_EQ(::lstat(full.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST(ErrorStages, ADumpFolderThatCannotBeMadeIsStageOutputAndANulIsConfig) {
  TempDir dir;
  Checkpoint ck = synth_checkpoint(dir.file("ck"), "llama");
  Runtime rt(to_config(make_config(ck.dir, {})));
  LoadResult r = rt.load();
  ASSERT_TRUE(r) << r.error->message;
  testing::write_file(dir.file("file"), "x");
  try {
    r.model->dump(dir.file("file/dump"));  // a file where a folder must go
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kOutput) << e.what();
    EXPECT_NE(e.rule().find("dump: cannot create the folder"), std::string::npos) << e.what();
  }
  // Python can pass a NUL; C calls would make the folder "out".
  try {
    r.model->dump(dir.file("out") + std::string(1, '\0') + "x");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), Stage::kConfig) << e.what();
    EXPECT_NE(e.rule().find("NUL"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.file("out")));
}

}  // namespace
}  // namespace ferry::runtime
