// Errors are exceptions whose message names the op and the operands involved.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Raised when a device allocation fails; callers may catch it to retry smaller
// (Accelerator::find_executable_batch_size does).
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace tessera

// TESSERA_CHECK(cond, "op: ", details...) throws tessera::Error with the streamed message.
#define TESSERA_CHECK(cond, ...)                                          \
  do {                                                                    \
    if (!(cond)) throw ::tessera::Error(::tessera::detail::concat(__VA_ARGS__)); \
  } while (0)

#define TESSERA_FAIL(...) throw ::tessera::Error(::tessera::detail::concat(__VA_ARGS__))
