// The consumer project's own header, named like one of Tessera's on purpose: Tessera's
// installed headers include each other as <tessera/core/error.h>, so this one (first on the
// include path) must not be picked up by them. If it were, TESSERA_CHECK would be missing
// and the build would fail.
#pragma once
#include <string>

namespace consumer {
inline std::string error_prefix() { return "consumer error: "; }
}  // namespace consumer
