// `ferry selftest [--devices SPEC]`: runs every device operation the pipeline uses
// on each device of SPEC and compares the results byte for byte with the host
// backend (the reference). `--devices cuda` is the check to run first on a machine
// with a GPU; `--devices host:2` checks the host backend against itself.
#include <cstdio>
#include <string>

#include "gpu/backends.hpp"
#include "gpu/host_device.hpp"
#include "gpu/selftest.hpp"
#include "tools/commands.hpp"

namespace ferry::tools {

int cmd_selftest(const Args& args) {
  std::string spec = "cuda";
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "-h" || args[i] == "--help") {
      std::puts("usage: ferry selftest [--devices cuda | cuda:0,1 | host:N]   (default: cuda)");
      return 0;
    }
    if (args[i] == "--devices" && i + 1 < args.size()) {
      spec = args[++i];
    } else if (args[i].rfind("--devices=", 0) == 0) {
      spec = args[i].substr(10);
    } else {
      std::fprintf(stderr, "ferry selftest: unexpected argument '%s'\n", args[i].c_str());
      return 2;
    }
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
