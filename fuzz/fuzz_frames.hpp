// What the wire fuzz targets share (fuzz_cache_frame, fuzz_remote_control): the
// input written into one end of a real socket pair, then read from the other by
// cache::Connection::next_frame, frame after frame, each handed to `one`. Inputs
// over 64 KiB are skipped (the writer never blocks on one socket buffer).
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "cache/socket.hpp"
#include "common/error.hpp"

namespace ferry::fuzz {

template <class OneFrame>
void feed_frames(const std::uint8_t* data, std::size_t size, OneFrame&& one) {
  using namespace ferry::cache;
  if (size > (std::size_t{1} << 16)) {
    return;
  }
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, fds) != 0) {
    return;
  }
  Connection reader(UniqueFd(fds[0]), "fuzz");
  {
    UniqueFd writer(fds[1]);
    int buffer = 1 << 18;
    ::setsockopt(writer.get(), SOL_SOCKET, SO_SNDBUF, &buffer, sizeof buffer);
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::send(writer.get(), data + done, size - done, MSG_NOSIGNAL);
      if (n <= 0) {
        return;
      }
      done += static_cast<std::size_t>(n);
    }
  }  // closed: the reader sees the end after the input
  reader.set_deadline(Clock::now() + std::chrono::seconds(5));
  try {
    while (std::optional<nlohmann::json> frame = reader.next_frame(std::size_t{1} << 16)) {
      one(*frame);
    }
  } catch (const ferry::Error&) {
  }
}

}  // namespace ferry::fuzz
