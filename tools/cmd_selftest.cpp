// `ferry selftest [--devices SPEC]`: runs every device operation the pipeline uses
// on each device of SPEC and compares the results byte for byte with the host
// backend (the reference). `--devices cuda` is the check to run first on a machine
// with a GPU; `--devices host:2` checks the host backend against itself.
#include <cstdio>
#include <optional>
#include <string>

#include "gpu/backends.hpp"
#include "gpu/host_device.hpp"
#include "gpu/selftest.hpp"
#include "tools/cli.hpp"
#include "tools/commands.hpp"

namespace ferry::tools {

int cmd_selftest(const Args& args) {
  CLI::App app(
      "Runs every device operation the pipeline uses on each device of SPEC and compares the\n"
      "results byte for byte with the host backend (the reference).",
      "ferry selftest");
  std::string spec = "cuda";
  app.add_option("--devices", spec, "the devices to check: cuda (every GPU) | cuda:0,1 | host:N")
      ->type_name("SPEC")
      ->capture_default_str();
  if (std::optional<int> status = parse_verb(app, args)) {
    return *status;
  }
  // make_devices explains why when the CUDA backend or a GPU is missing.
  auto devices = gpu::make_devices(spec);
  auto reference = gpu::make_host_device(1000);
  std::size_t failures = 0;
  for (const auto& device : devices) {
    gpu::SelftestResult r = gpu::run_selftest(*device, *reference);
    std::fputs(r.report().c_str(), stdout);
    failures += r.failures();
  }
  std::printf("selftest: %zu device(s), %s\n", devices.size(),
              failures == 0 ? "all checks passed" : (std::to_string(failures) + " check(s) failed").c_str());
  return failures == 0 ? 0 : 1;
}

}  // namespace ferry::tools
