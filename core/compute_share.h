// Multiprocessors left to collectives that run beside the compute.
//
// While DDP's gradient all-reduces overlap the backward, their kernels (NCCL's) occupy a few
// multiprocessors of the GPU. A GEMM sized for the whole GPU then waits for those
// multiprocessors: its last wave of tiles, or the blocks of a persistent kernel placed there,
// start only when the collective ends, and the GEMM takes up to twice as long. The strategy
// that issues the collectives sets how many multiprocessors they may take; the matmul
// backends plan their GEMMs for the rest (cuBLASLt's SM_COUNT_TARGET, PyTorch's "SM
// carveout"). Core knows no devices: this is just the number, 0 = the whole device.
#pragma once

namespace tessera {

void set_communication_sm_reserve(int multiprocessors);
int communication_sm_reserve();

// Sets the reserve for its lifetime, then restores the previous value.
class CommunicationSmReserveScope {
 public:
  explicit CommunicationSmReserveScope(int multiprocessors)
      : previous_(communication_sm_reserve()) {
    set_communication_sm_reserve(multiprocessors);
  }
  ~CommunicationSmReserveScope() { set_communication_sm_reserve(previous_); }
  CommunicationSmReserveScope(const CommunicationSmReserveScope&) = delete;
  CommunicationSmReserveScope& operator=(const CommunicationSmReserveScope&) = delete;

 private:
  int previous_;
};

}  // namespace tessera
