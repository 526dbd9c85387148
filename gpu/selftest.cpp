#include "gpu/selftest.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "common/ggml_blocks.hpp"
#include "gpu/kernels_host.hpp"

namespace ferry::gpu {
namespace {

constexpr std::size_t kGuard = 64;         // untouched bytes around every region
constexpr std::size_t kEdgeCount = 65536;  // elements in a cast source (all 16-bit patterns)
constexpr std::size_t kLargeCount = (std::size_t{1} << 21) + 7;  // past one grid of threads

// `p` moved up to the next multiple of `alignment` (a power of two).
std::byte* align_up(std::byte* p, std::size_t alignment) {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  return reinterpret_cast<std::byte*>((at + alignment - 1) & ~(std::uintptr_t{alignment} - 1));
}

// Deterministic bytes (SplitMix64), so that a failure reproduces.
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

 private:
  std::uint64_t state_;
};

std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  Random random(seed);
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; i += 8) {
    std::uint64_t v = random.next();
    std::memcpy(out.data() + i, &v, std::min<std::size_t>(8, n - i));
  }
  return out;
}

template <class T>
void put(std::vector<std::byte>& out, std::size_t i, T v) {
  std::memcpy(out.data() + i * sizeof v, &v, sizeof v);
}

// `count` source elements of a cast: for 16-bit types every bit pattern in turn;
// for F32 the edge cases of all three formats, then random values concentrated
// where F16 and BF16 rounding happens.
std::vector<std::byte> cast_source(DType dtype, std::size_t count) {
  std::vector<std::byte> out(count * dtype_size(dtype));
  if (dtype != DType::kF32) {
    for (std::size_t i = 0; i < count; ++i) {
      put(out, i, static_cast<std::uint16_t>(i));
    }
    return out;
  }
  const std::uint32_t edges[] = {
      0x00000000, 0x80000000,              // +-0
      0x3F800000, 0xBF800000,              // +-1
      0x00000001, 0x807FFFFF,              // F32 subnormals: smallest, largest (negative)
      0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  // smallest normal, +-max
      0x7F800000, 0xFF800000,              // +-inf
      0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FBFFFFF,  // quiet and signalling NaNs
      0x3A83126F,                                      // 1e-3
      0x3F808000, 0x3F818000, 0x3F808001,  // BF16 ties to even (down, up) and above a tie
      0x7F7F8000, 0x7F7FFFFF,              // BF16: rounds to max / to inf
      0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,  // F16: 65504, below/at the tie to inf
      0x38800000, 0x387FFFFF, 0x33800000, 0x33000000, 0x33000001, 0x32FFFFFF,  // F16 subnormals
      0x3F801000, 0x3F803000, 0x3F801001,  // F16 ties to even (down, up) and above a tie
      0x38FFE000, 0x387FF000,              // F16 subnormal rounding into the normal range
      0x40490FDB, 0xC2F6E979,              // pi, -123.456
  };
  std::size_t i = 0;
  for (std::uint32_t e : edges) {
    if (i < count) {
      put(out, i++, e);
    }
  }
  Random random(0xF32);
  for (; i < count; ++i) {
    auto r = static_cast<std::uint32_t>(random.next());
    switch (i % 4) {
      case 0:
        break;  // any pattern
      case 1:   // exponent 98..145: F16 underflow, subnormal, normal, overflow
        r = (r & 0x807FFFFFu) | ((98u + (r >> 8) % 48u) << 23);
        break;
      case 2:
        r = (r & 0xFFFF0000u) | 0x8000u;
        break;  // an exact BF16 tie
      default:  // an exact F16 tie in F16 range
        r = (r & 0x807FE000u) | ((103u + (r >> 8) % 40u) << 23) | 0x1000u;
        break;
    }
    put(out, i, r);
  }
  return out;
}

// One operation sequence run on each device, on a buffer of `bytes` bytes that
// starts out holding the same random background on both.
struct Scenario {
  std::string name;
  std::size_t bytes = 0;
  std::function<void(Device&, Stream&, std::byte* base)> run;
};

std::vector<std::byte> execute(Device& device, const Scenario& scenario,
                               const std::vector<std::byte>& background) {
  DeviceAllocation buffer = device.allocate(scenario.bytes);
  std::unique_ptr<Stream> stream = device.create_stream();
  stream->copy_h2d(buffer.data(), background.data(), scenario.bytes);
  scenario.run(device, *stream, buffer.data());
  std::vector<std::byte> out(scenario.bytes);
  stream->copy_d2h(out.data(), buffer.data(), scenario.bytes);
  stream->synchronize();
  return out;
}

std::string hex_bytes(const std::vector<std::byte>& v, std::size_t from, std::size_t n) {
  std::string out;
  char buf[12];
  for (std::size_t i = from; i < from + n && i < v.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%02x", static_cast<unsigned>(v[i]));
    if (!out.empty()) {
      out += ' ';
    }
    out += buf;
  }
  return out;
}

std::string compare(const std::vector<std::byte>& got, const std::vector<std::byte>& want) {
  std::size_t differing = 0;
  std::size_t first = got.size();
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      first = std::min(first, i);
      ++differing;
    }
  }
  if (differing == 0) {
    return {};
  }
  std::size_t from = first - first % 4;
  return std::to_string(differing) + " of " + std::to_string(got.size()) +
         " bytes differ; first at byte " + std::to_string(first) + ": bytes " +
         std::to_string(from) + ".. are [" + hex_bytes(got, from, 8) + "], reference [" +
         hex_bytes(want, from, 8) + "]";
}

SelftestCheck run_check(Device& dut, Device& reference, const Scenario& scenario,
                        std::uint64_t seed) {
  SelftestCheck check{scenario.name, false, {}};
  std::vector<std::byte> background = random_bytes(scenario.bytes, seed);
  std::vector<std::byte> results[2];
  Device* devices[2] = {&dut, &reference};
  for (int i = 0; i < 2; ++i) {
    try {
      results[i] = execute(*devices[i], scenario, background);
    } catch (const std::exception& e) {
      check.detail = devices[i]->name() + " threw: " + e.what();
      return check;
    }
  }
  check.detail = compare(results[0], results[1]);
  check.passed = check.detail.empty();
  return check;
}

std::string dtype_str(DType dtype) {
  return std::string(dtype_name(dtype));
}

void add_copy_scenarios(std::vector<Scenario>& out) {
  {
    std::size_t n = 100003;
    auto src = std::make_shared<std::vector<std::byte>>(random_bytes(n, 1));
    out.push_back({"copy_h2d", n + 2 * kGuard + 3, [src](Device&, Stream& s, std::byte* base) {
                     s.copy_h2d(base + kGuard + 3, src->data(), src->size());
                   }});
  }
  {
    std::size_t n = (std::size_t{4} << 20) + 5;
    auto src = std::make_shared<std::vector<std::byte>>(random_bytes(n, 2));
    out.push_back({"copy_h2d 4 MiB", n + 2 * kGuard, [src](Device&, Stream& s, std::byte* base) {
                     s.copy_h2d(base + kGuard, src->data(), src->size());
                   }});
  }
  {
    std::size_t n = 65536 + 17;
    auto src = std::make_shared<std::vector<std::byte>>(random_bytes(n, 3));
    out.push_back({"copy_h2d from pinned memory", n + 2 * kGuard,
                   [src](Device& d, Stream& s, std::byte* base) {
                     PinnedAllocation pinned = d.allocate_pinned(src->size());
                     std::memcpy(pinned.data(), src->data(), src->size());
                     s.copy_h2d(base + kGuard, pinned.data(), src->size());
                     s.synchronize();  // before the pinned buffer goes
                   }});
    out.push_back({"copy_h2d from registered memory", n + 2 * kGuard,
                   [src](Device& d, Stream& s, std::byte* base) {
                     std::vector<std::byte> host = *src;
                     HostRegistration pin = d.register_host(host.data(), host.size());
                     s.copy_h2d(base + kGuard, host.data(), host.size());
                     s.synchronize();  // before unregistering
                   }});
  }
  struct Shape {
    const char* name;
    std::size_t dst_pitch, src_pitch, width, rows;
  };
  for (Shape shape : {Shape{"copy_h2d_2d odd pitches", 1031, 997, 513, 77},
                      Shape{"copy_h2d_2d dense rows", 640, 640, 640, 33},
                      Shape{"copy_h2d_2d one column", 4099, 7, 1, 300},
                      Shape{"copy_h2d_2d narrow destination", 515, 4096, 515, 129}}) {
    std::size_t src_bytes = (shape.rows - 1) * shape.src_pitch + shape.width;
    std::size_t dst_bytes = (shape.rows - 1) * shape.dst_pitch + shape.width;
    auto src = std::make_shared<std::vector<std::byte>>(random_bytes(src_bytes, shape.dst_pitch));
    out.push_back(
        {shape.name, dst_bytes + 2 * kGuard + 1, [src, shape](Device&, Stream& s, std::byte* base) {
           s.copy_h2d_2d(base + kGuard + 1, shape.dst_pitch, src->data(), shape.src_pitch,
                         shape.width, shape.rows);
         }});
  }
  out.push_back({"zero", 20000, [](Device&, Stream& s, std::byte* base) {
                   s.zero(base + 7, 12345);
                   s.zero(base + 13000, 1);
                 }});
  {
    std::size_t n = 300001;
    auto src = std::make_shared<std::vector<std::byte>>(random_bytes(n, 4));
    out.push_back({"event after copy", n + 2 * kGuard, [src](Device&, Stream& s, std::byte* base) {
                     s.copy_h2d(base + kGuard, src->data(), src->size());
                     std::unique_ptr<Event> event = s.record();
                     event->synchronize();
                     if (!event->query()) {
                       throw std::runtime_error("Event::query() is false after synchronize()");
                     }
                   }});
    out.push_back({"two streams", 2 * n + 2 * kGuard, [src](Device& d, Stream& s, std::byte* base) {
                     // The background was written on `s`; the other stream must not
                     // race with it.
                     s.synchronize();
                     std::unique_ptr<Stream> other = d.create_stream();
                     s.copy_h2d(base + kGuard, src->data(), src->size());
                     other->copy_h2d(base + kGuard + src->size(), src->data(), src->size());
                     other->fill(base + kGuard + src->size(), 1000, DType::kF32, 1e-3);
                     other->synchronize();
                   }});
  }
}

void add_fill_scenarios(std::vector<Scenario>& out) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> values = {1e-3,  0.0,   -0.0, 1.0,       -2.5, 65504.0, 65520.0,
                                      1e40,  -1e40, inf,  -inf,      nan,  -nan,    1e-8,
                                      3e-39, 1e-46, 0.1,  1.0 / 3.0, 1e300};
  constexpr std::size_t kSegment = 999;  // elements per value: odd, so blocks end ragged
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32, DType::kF64}) {
    std::size_t size = dtype_size(dtype);
    for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
      std::string name = "fill " + dtype_str(dtype) + (misalign ? " unaligned" : "");
      out.push_back({name, values.size() * kSegment * size + 2 * kGuard + 1,
                     [values, dtype, size, misalign](Device&, Stream& s, std::byte* base) {
                       std::byte* p = base + kGuard + misalign;
                       for (double v : values) {
                         s.fill(p, kSegment, dtype, v);
                         p += kSegment * size;
                       }
                     }});
    }
  }
  out.push_back(
      {"fill F32 large", kLargeCount * 4 + 2 * kGuard, [](Device&, Stream& s, std::byte* base) {
         s.fill(base + kGuard, kLargeCount, DType::kF32, 1e-3);
       }});
  // The dummy format's weights: every dtype, aligned and not, wide and FP8 ranges.
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kU8}) {
    for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
      const std::size_t size = dtype_size(dtype);
      out.push_back({"fill_random " + dtype_str(dtype) + (misalign ? " unaligned" : ""),
                     kLargeCount * size + 2 * kGuard + 1,
                     [dtype, misalign](Device&, Stream& s, std::byte* base) {
                       const double bound = dtype == DType::kF8E4M3 ? 500.0 : 1e-3;
                       s.fill_random(base + kGuard + misalign, kLargeCount, dtype, -bound, bound,
                                     1234);
                     }});
    }
  }
}

void add_cast_scenarios(std::vector<Scenario>& out) {
  const DType types[] = {DType::kBF16, DType::kF16, DType::kF32};
  for (DType from : types) {
    auto src = std::make_shared<std::vector<std::byte>>(cast_source(from, kEdgeCount));
    for (DType to : types) {
      std::size_t src_bytes = src->size();
      std::size_t dst_bytes = kEdgeCount * dtype_size(to);
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
        if (misalign != 0 && from == to) {
          continue;  // a plain copy: alignment does not matter
        }
        std::string name =
            "cast " + dtype_str(from) + " -> " + dtype_str(to) + (misalign ? " unaligned" : "");
        // [guard][source][guard][destination][guard], both regions shifted by `misalign`.
        std::size_t src_at = kGuard + misalign;
        std::size_t dst_at = src_at + src_bytes + kGuard + 2 * misalign;
        out.push_back({name, dst_at + dst_bytes + kGuard,
                       [src, from, to, src_at, dst_at](Device&, Stream& s, std::byte* base) {
                         s.copy_h2d(base + src_at, src->data(), src->size());
                         s.cast(base + dst_at, to, base + src_at, from, kEdgeCount);
                       }});
      }
    }
    if (from != DType::kF32) {
      DType to = from == DType::kBF16 ? DType::kF16 : DType::kBF16;
      out.push_back({"cast " + dtype_str(from) + " -> " + dtype_str(to) + " in place",
                     src->size() + 2 * kGuard,
                     [src, from, to](Device&, Stream& s, std::byte* base) {
                       s.copy_h2d(base + kGuard, src->data(), src->size());
                       s.cast(base + kGuard, to, base + kGuard, from, kEdgeCount);
                     }});
    }
  }
  auto large = std::make_shared<std::vector<std::byte>>(cast_source(DType::kF32, kLargeCount));
  out.push_back({"cast F32 -> BF16 large", large->size() + kLargeCount * 2 + 3 * kGuard,
                 [large](Device&, Stream& s, std::byte* base) {
                   std::byte* src = base + kGuard;
                   std::byte* dst = src + large->size() + kGuard;
                   s.copy_h2d(src, large->data(), large->size());
                   s.cast(dst, DType::kBF16, src, DType::kF32, kLargeCount);
                 }});
}

// The pitched and batched device-side operations (zero_2d, cast_2d, copy_d2d_2d,
// transpose) read the random background and write a region after it.
void add_device_side_scenarios(std::vector<Scenario>& out) {
  out.push_back({"zero_2d", 40000, [](Device&, Stream& s, std::byte* base) {
                   s.zero_2d(base + kGuard + 3, 1031, 515, 33);
                 }});
  out.push_back({"set_bytes", 3 << 20, [](Device&, Stream& s, std::byte* base) {
                   s.set_bytes(base + kGuard + 1, std::byte{0x7E}, (2 << 20) + 5);
                   s.set_bytes(base + kGuard + (2 << 20) + 64, std::byte{0x01}, 3);
                 }});
  // The sentinel check: ranges written with the sentinel's patterns (some with one
  // element changed at either end), ranges over the random background, empty ones;
  // the table goes into the buffer, the flags after it, and the table is zeroed
  // again afterwards (it holds this device's pointers, which differ between the two).
  out.push_back({"fill then match_pattern (the sentinel check)", 8 << 20, [](Device&, Stream& s, std::byte* base) {
                   const std::size_t big = (std::size_t{3} << 20) + 3;  // many passes of a block
                   std::byte* a = base + kGuard + 1;                       // unaligned
                   std::byte* b = align_up(a + big + kGuard, 256);        // aligned
                   std::byte* c = b + (std::size_t{1} << 20) + kGuard;
                   s.set_bytes(a, std::byte{0x01}, big);
                   s.fill(b, (std::size_t{1} << 19), DType::kBF16, 1e-3);
                   s.fill(c, 4096, DType::kF32, 1e-3);
                   const std::uint64_t bf16 = host::fill_pattern(DType::kBF16, 1e-3);
                   const std::uint64_t f32 = host::fill_pattern(DType::kF32, 1e-3);
                   std::byte* rest = c + 4096 * 4 + kGuard;  // random background from here
                   std::vector<PatternRange> table = {
                       {a, big, 0x01, 1},
                       {a, big, 0x02, 1},
                       {b, std::size_t{1} << 20, bf16, 2},
                       {b + 1, 1001, bf16, 2},  // shifted: never the pattern
                       {c, 4096 * 4, f32, 4},
                       {c, 4096 * 4 + 3, f32, 4},  // a tail the check skips
                       {c, 4096 * 4, f32 | (f32 << 32), 8},
                       {rest, 4000, 0, 1},
                       {rest, 0, 0, 2},  // empty
                       {rest, 3, 0, 4},  // no whole element
                   };
                   // One element changed at the first and at the last place.
                   std::byte* d = rest + 8192;
                   s.fill(d, 1000, DType::kBF16, 1e-3);
                   s.set_bytes(d, std::byte{0}, 1);
                   std::byte* e = d + 4096;
                   s.fill(e, 1000, DType::kBF16, 1e-3);
                   s.set_bytes(e + 1999, std::byte{0}, 1);
                   table.push_back({d, 2000, bf16, 2});
                   table.push_back({e, 2000, bf16, 2});
                   table.push_back({e, 1998, bf16, 2});  // all but the changed element
                   // The table where a GPU kernel can read its 8-byte fields.
                   std::byte* at = align_up(e + 4096 + kGuard, alignof(PatternRange));
                   const std::size_t table_bytes = table.size() * sizeof(PatternRange);
                   std::byte* flags = at + table_bytes + kGuard;
                   s.copy_h2d(at, reinterpret_cast<const std::byte*>(table.data()), table_bytes);
                   s.match_pattern(reinterpret_cast<const PatternRange*>(at), table.size(),
                                   reinterpret_cast<std::uint8_t*>(flags));
                   s.zero(at, table_bytes);
                   s.synchronize();  // `table` goes now
                 }});
  struct Gather {
    const char* name;
    std::size_t dst_shift, src_shift, dst_pitch, src_pitch, width, rows;
  };
  // Row-parallel slices as the copy worker gathers them (16-byte words), and odd
  // shapes down to single bytes.
  for (Gather g : {Gather{"copy_d2d_2d tp 2 rows", 0, 7168, 7168, 14336, 7168, 40},
                   Gather{"copy_d2d_2d 8-byte words", 8, 0, 24, 40, 24, 300},
                   Gather{"copy_d2d_2d 2-byte words", 2, 6, 14, 18, 10, 999},
                   Gather{"copy_d2d_2d odd bytes", 1, 0, 7, 9, 7, 5000}}) {
    const std::size_t src_span = (g.rows - 1) * g.src_pitch + g.width;
    const std::size_t dst_at = kGuard + g.src_shift + src_span + kGuard + g.dst_shift;
    const std::size_t dst_span = (g.rows - 1) * g.dst_pitch + g.width;
    out.push_back(
        {g.name, dst_at + dst_span + kGuard, [g, dst_at](Device&, Stream& s, std::byte* base) {
           s.copy_d2d_2d(base + dst_at, g.dst_pitch, base + kGuard + g.src_shift, g.src_pitch,
                         g.width, g.rows);
         }});
  }
  const DType types[] = {DType::kBF16, DType::kF16, DType::kF32};
  for (DType from : types) {
    for (DType to : types) {
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
        const std::size_t width = 1000;
        const std::size_t rows = 37;
        const std::size_t src_pitch = width * dtype_size(from) + 2 * width + misalign;
        const std::size_t dst_pitch = width * dtype_size(to) + 64 + misalign;
        const std::size_t dst_at = kGuard + rows * src_pitch + kGuard + misalign;
        auto source = std::make_shared<std::vector<std::byte>>(
            cast_source(from, rows * src_pitch / dtype_size(from)));
        out.push_back(
            {"cast_2d " + dtype_str(from) + " -> " + dtype_str(to) + (misalign ? " unaligned" : ""),
             dst_at + rows * dst_pitch + kGuard, [=](Device&, Stream& s, std::byte* base) {
               s.copy_h2d(base + kGuard, source->data(), source->size());
               s.cast_2d(base + dst_at, dst_pitch, to, base + kGuard, src_pitch, from, width, rows);
             }});
      }
    }
  }
  struct Transpose {
    std::size_t rows, cols, batches;
  };
  // DeepSeek-V3's w_kc (128 x 512 per head, 4 heads) and ragged tiles.
  for (Transpose t : {Transpose{128, 512, 4}, Transpose{33, 65, 3}, Transpose{1, 999, 2}}) {
    for (std::size_t es : {1, 2, 4, 8}) {
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
        if (misalign != 0 && es == 1) {
          continue;
        }
        const std::size_t matrix = t.rows * t.cols * es;
        const std::size_t src_pitch = matrix + 5 * es;
        const std::size_t dst_at = kGuard + t.batches * src_pitch + kGuard + misalign;
        out.push_back({"transpose " + std::to_string(t.batches) + " x " + std::to_string(t.rows) +
                           " x " + std::to_string(t.cols) + " of " + std::to_string(es) + " bytes" +
                           (misalign ? " unaligned" : ""),
                       dst_at + t.batches * matrix + kGuard,
                       [=](Device&, Stream& s, std::byte* base) {
                         s.transpose(base + dst_at, matrix, base + kGuard + misalign, src_pitch, es,
                                     t.rows, t.cols, t.batches);
                       }});
      }
    }
  }
}

// The FP8 operations over the random background: its bytes are the E4M3 codes, the
// BF16 / F16 / F32 sources and the F32 scales (NaN, infinities, subnormals and zeros
// among them), at aligned and unaligned addresses; quantization per tile (rows and
// blocks), per tensor with aligned scales (the atomic reduction) and unaligned (a
// block a matrix), every scale rule.
void add_fp8_scenarios(std::vector<Scenario>& out) {
  struct Layout {
    const char* name;
    std::size_t rows, cols, batches;
    Fp8Scales scales;
  };
  const Layout layouts[] = {
      {"block 128x128", 260, 300, 2, {Fp8Granularity::kBlock, 128, 128, 1}},
      {"block 2x3", 37, 41, 3, {Fp8Granularity::kBlock, 2, 3, 1}},
      {"row", 65, 600, 2, {Fp8Granularity::kRow, 0, 0, 1}},
      {"tensor", 256, 1100, 2, {Fp8Granularity::kTensor, 0, 0, 1}},
      {"tensor repeated", 33, 65, 3, {Fp8Granularity::kTensor, 0, 0, 5}},
  };
  const DType types[] = {DType::kBF16, DType::kF16, DType::kF32};
  for (const Layout& l : layouts) {
    const std::size_t n = l.rows * l.cols * l.batches;
    const std::size_t scale_bytes = 4 * l.batches *
                                    (l.scales.granularity == Fp8Granularity::kTensor
                                         ? l.scales.tensor_repeat
                                         : fp8::scale_count(l.scales, l.rows, l.cols));
    for (DType dtype : types) {
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
        const std::size_t es = dtype_size(dtype);
        // [guard][source][guard][scales][guard][result][guard]
        const std::size_t src_at = kGuard + misalign;
        const std::size_t scale_at = src_at + n * es + kGuard;
        const std::size_t dst_at = scale_at + scale_bytes + kGuard;
        const std::string suffix =
            std::string(l.name) + " " + dtype_str(dtype) + (misalign ? " unaligned" : "");
        const Fp8Scales read{l.scales.granularity, l.scales.block_rows, l.scales.block_cols, 1};
        out.push_back({"dequantize_fp8 " + suffix, dst_at + n * es + kGuard,
                       [=](Device&, Stream& s, std::byte* base) {
                         s.dequantize_fp8(base + dst_at, dtype, base + src_at, base + scale_at,
                                          read, l.rows, l.cols, l.batches);
                       }});
        for (Fp8ScaleRule rule : {Fp8ScaleRule::kAmax, Fp8ScaleRule::kAmaxOrOne,
                                  Fp8ScaleRule::kInputToFloat8, Fp8ScaleRule::kUe8m0,
                                  Fp8ScaleRule::kStatic}) {
          out.push_back(
              {"quantize_fp8 " + suffix + " rule " + std::to_string(static_cast<int>(rule)),
               dst_at + n + kGuard, [=](Device&, Stream& s, std::byte* base) {
                 s.quantize_fp8(base + dst_at, base + scale_at, base + src_at, dtype, l.scales,
                                rule, l.rows, l.cols, l.batches);
               }});
        }
      }
    }
  }
  for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
    // DeepSeek-V3's w13 of one expert (4096 x 7168 in 128 blocks) and a ragged one.
    struct Pack {
      std::size_t rows, block_rows, scale_cols, batches;
    };
    for (Pack p : {Pack{4096, 128, 56, 1}, Pack{12, 4, 5, 3}}) {
      const std::size_t scale_bytes =
          4 * p.batches * ((p.rows + p.block_rows - 1) / p.block_rows) * p.scale_cols;
      const std::size_t dst_at = kGuard + scale_bytes + kGuard + misalign;
      const std::size_t dst_bytes = 4 * p.batches * p.rows * ((p.scale_cols + 3) / 4);
      out.push_back(
          {"pack_ue8m0 " + std::to_string(p.rows) + " rows" + (misalign ? " unaligned" : ""),
           dst_at + dst_bytes + kGuard, [=](Device&, Stream& s, std::byte* base) {
             s.pack_ue8m0(base + dst_at, base + kGuard, p.rows, p.block_rows, p.scale_cols,
                          p.batches);
           }});
    }
  }
  for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
    // Llama-3.1-8B's qkv_proj at tp 8 in NVFP4 (768 x 4096, 256 scale groups), one tile.
    struct Marlin {
      std::size_t n, k;
    };
    for (Marlin m : {Marlin{768, 4096}, Marlin{64, 16}}) {
      const std::string suffix = std::to_string(m.n) + " x " + std::to_string(m.k) +
                                 (misalign ? " unaligned" : "");
      const std::size_t weight_bytes = m.n * m.k / 2;
      const std::size_t dst_at = kGuard + weight_bytes + kGuard + misalign;
      out.push_back({"repack_marlin_fp4 " + suffix, dst_at + weight_bytes + kGuard,
                     [=](Device&, Stream& s, std::byte* base) {
                       s.repack_marlin_fp4(base + dst_at, base + kGuard + misalign, m.n, m.k);
                     }});
      const std::size_t groups = m.k / 16;
      const std::size_t scales_at = kGuard + m.n * groups + kGuard + misalign;
      out.push_back({"marlin_fp4_scales " + suffix, scales_at + m.n * groups + kGuard,
                     [=](Device&, Stream& s, std::byte* base) {
                       s.marlin_fp4_scales(base + scales_at, base + kGuard, m.n, groups);
                     }});
    }
  }
}

// GGML block dequantization of the random background: every format into BF16, F16
// and F32, at aligned and unaligned addresses and pitches. The background's F16
// scales include NaN, infinities and subnormals. One call past 65535 rows (the
// kernel's grid strides over rows).
void add_ggml_scenarios(std::vector<Scenario>& out) {
  const GgmlBlocks formats[] = {GgmlBlocks::kQ4_0, GgmlBlocks::kQ4_1, GgmlBlocks::kQ5_0,
                                GgmlBlocks::kQ5_1, GgmlBlocks::kQ8_0, GgmlBlocks::kQ2_K,
                                GgmlBlocks::kQ3_K, GgmlBlocks::kQ4_K, GgmlBlocks::kQ5_K,
                                GgmlBlocks::kQ6_K};
  for (GgmlBlocks blocks : formats) {
    const std::size_t elems = ggml_block_shape(blocks).elems;
    const std::size_t width = elems * (elems == 32 ? 9 : 3);
    const std::size_t rows = 33;
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (std::size_t misalign : {std::size_t{0}, std::size_t{1}}) {
        const std::size_t src_pitch = ggml_row_bytes(blocks, width) + 5 + misalign;
        const std::size_t dst_pitch = width * dtype_size(dtype) + 64 + misalign;
        const std::size_t dst_at = kGuard + rows * src_pitch + kGuard + misalign;
        out.push_back({"dequantize_ggml_2d " + std::string(ggml_blocks_name(blocks)) + " -> " +
                           dtype_str(dtype) + (misalign ? " unaligned" : ""),
                       dst_at + rows * dst_pitch + kGuard,
                       [=](Device&, Stream& s, std::byte* base) {
                         s.dequantize_ggml_2d(base + dst_at, dst_pitch, dtype, base + kGuard,
                                              src_pitch, blocks, width, rows);
                       }});
      }
    }
  }
  const std::size_t rows = 66000;
  const std::size_t src_pitch = ggml_row_bytes(GgmlBlocks::kQ4_0, 32);
  const std::size_t dst_at = kGuard + rows * src_pitch + kGuard;
  out.push_back({"dequantize_ggml_2d Q4_0 -> BF16, 66000 rows", dst_at + rows * 64 + kGuard,
                 [=](Device&, Stream& s, std::byte* base) {
                   s.dequantize_ggml_2d(base + dst_at, 64, DType::kBF16, base + kGuard, src_pitch,
                                        GgmlBlocks::kQ4_0, 32, rows);
                 }});
}

bool same_live(const AllocationStats& a, const AllocationStats& b) {
  return a.device.live_count == b.device.live_count && a.device.live_bytes == b.device.live_bytes &&
         a.pinned.live_count == b.pinned.live_count &&
         a.registered.live_count == b.registered.live_count && a.live_streams == b.live_streams &&
         a.live_events == b.live_events;
}

std::string live_summary(const AllocationStats& s) {
  return std::to_string(s.device.live_count) + " device allocations (" +
         std::to_string(s.device.live_bytes) + " bytes), " + std::to_string(s.pinned.live_count) +
         " pinned, " + std::to_string(s.registered.live_count) + " registered, " +
         std::to_string(s.live_streams) + " streams, " + std::to_string(s.live_events) + " events";
}

}  // namespace

bool SelftestResult::passed() const {
  return !checks.empty() && failures() == 0;
}

std::size_t SelftestResult::failures() const {
  std::size_t n = 0;
  for (const SelftestCheck& c : checks) {
    n += c.passed ? 0 : 1;
  }
  return n;
}

std::string SelftestResult::report() const {
  std::string out;
  for (const SelftestCheck& c : checks) {
    out += c.passed ? "PASS " : "FAIL ";
    out += c.name;
    if (!c.passed) {
      out += ": " + c.detail;
    }
    out += '\n';
  }
  out += device + " vs " + reference + ": " + std::to_string(checks.size() - failures()) + "/" +
         std::to_string(checks.size()) + " checks passed\n";
  return out;
}

SelftestResult run_selftest(Device& dut, Device& reference) {
  SelftestResult result;
  result.device = dut.name();
  result.reference = reference.name();
  try {
    dut.bind();
    reference.bind();
  } catch (const std::exception& e) {
    result.checks.push_back({"bind", false, e.what()});
    return result;
  }
  AllocationStats dut_before = dut.stats();
  AllocationStats reference_before = reference.stats();

  std::vector<Scenario> scenarios;
  add_copy_scenarios(scenarios);
  add_fill_scenarios(scenarios);
  add_cast_scenarios(scenarios);
  add_device_side_scenarios(scenarios);
  add_fp8_scenarios(scenarios);
  add_ggml_scenarios(scenarios);
  std::uint64_t seed = 100;
  for (const Scenario& scenario : scenarios) {
    result.checks.push_back(run_check(dut, reference, scenario, seed++));
  }

  SelftestCheck released{"everything released", true, {}};
  for (auto [device, before] :
       {std::pair<Device*, AllocationStats>{&dut, dut_before},
        std::pair<Device*, AllocationStats>{&reference, reference_before}}) {
    AllocationStats after = device->stats();
    if (!same_live(before, after)) {
      released.passed = false;
      released.detail += device->name() + " holds " + live_summary(after) +
                         " (before: " + live_summary(before) + ") ";
    }
  }
  result.checks.push_back(std::move(released));
  return result;
}

}  // namespace ferry::gpu
