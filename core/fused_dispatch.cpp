#include "tessera/core/fused_dispatch.h"

#include <array>

namespace tessera {

FusedKernelTable& fused_kernel_table(DeviceType type) {
  static std::array<FusedKernelTable, kNumDeviceTypes> tables{};
  return tables[static_cast<int>(type)];
}

}  // namespace tessera
