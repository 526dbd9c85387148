// What libferry.so exports. The library is built with -fvisibility=hidden (and a
// version script that keeps anything outside namespace ferry local), so only the
// declarations marked FERRY_API in these headers are visible to an engine. The
// static libraries the CLI and the tests link ignore the mark.
#pragma once

#define FERRY_API __attribute__((visibility("default")))
// For the internal parts of exported classes (a Runtime's Impl), defined in the
// library: they stay hidden although their enclosing class is exported.
#define FERRY_HIDDEN __attribute__((visibility("hidden")))
