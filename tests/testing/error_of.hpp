// Runs a callable that must throw ferry::Error of a given stage and returns the
// message, for bad-input tests that then match words in it.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "common/error.hpp"

namespace ferry::testing {

// Runs `fn`, expecting a ferry::Error of `stage`; returns its message. A missing
// error or another stage is a test failure (the message is still returned).
template <class F>
std::string error_of(Stage stage, F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.stage(), stage) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no ferry::Error thrown";
  return {};
}

}  // namespace ferry::testing
