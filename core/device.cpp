#include "tessera/core/device.h"

#include "tessera/core/error.h"

namespace tessera {

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    const std::string idx = s.substr(5);
    bool digits = !idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos;
    TESSERA_CHECK(digits, "Device::parse: bad device index in '", s, "'");
    return cuda(std::stoi(idx));
  }
  TESSERA_FAIL("Device::parse: unknown device '", s, "' (expected cpu, cuda or cuda:N)");
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

}  // namespace tessera
