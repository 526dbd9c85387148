// The device self-test: runs every Device/Stream operation on a device under test
// and on a reference (normally the host backend), reads both results back and
// compares them byte for byte. `ferry selftest --devices cuda` runs it on each GPU
// against a host device.
//
// What it covers: 1-D copies (pageable, pinned and registered sources), 2-D copies
// with odd pitches, zero, fill for every fill dtype and a range of values (the 1e-3
// sentinel, signed zeros, F16 overflow, subnormals, inf, NaN) at aligned and
// unaligned addresses, every cast pair among BF16/F16/F32 over all 65536 16-bit
// patterns and a set of F32 edge and random values (also unaligned, in place and
// large enough for grid-stride loops), the FP8 dequantization, quantization (every
// scale granularity and rule) and UE8M0 pack, events, two streams, and that everything
// allocated was given back. Each region is surrounded by guard bytes that must
// come back untouched.
#pragma once

#include <string>
#include <vector>

#include "gpu/device.hpp"

namespace ferry::gpu {

struct SelftestCheck {
  std::string name;  // "cast F32 -> BF16 unaligned"
  bool passed = false;
  std::string detail;  // why it failed: the first differing byte, or the error thrown
};

struct SelftestResult {
  std::string device;     // the device under test's name
  std::string reference;  // the reference's name
  std::vector<SelftestCheck> checks;

  // True when there is at least one check and every check passed.
  bool passed() const;
  std::size_t failures() const;
  // One line per check ("PASS name" / "FAIL name: detail") and a summary line.
  std::string report() const;
};

// Runs the checks; never throws for a failing operation (it becomes a failed
// check). Binds both devices to the calling thread first. Takes a few hundred
// milliseconds on the host backend.
SelftestResult run_selftest(Device& dut, Device& reference);

}  // namespace ferry::gpu
