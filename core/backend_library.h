// Optional backends are shared libraries of their own: libtessera_cuda.so.0 (CUDA runtime,
// cuBLAS, cuDNN, NVRTC, NCCL) and libtessera_mpi.so.0 (MPI). libtessera.so links none of
// their dependencies, so a CPU-only program needs none of them installed. A backend
// registers itself into Tessera's tables (device backends, kernel tables, process-group
// backends) when it is loaded: by the program's own link to it, or through
// load_backend_library the first time something asks for it (a CUDA device, the mpi
// process group).
#pragma once
#include <string>

namespace tessera {

// Loads libtessera_<name>.so.0 once: from the folder libtessera.so itself was loaded from,
// else from the system's search path. True when it is loaded (now or before, by any means);
// otherwise false, and why_not (when given) says why. The answer is kept: later calls cost
// a lock and a lookup.
bool load_backend_library(const std::string& name, std::string* why_not = nullptr);

}  // namespace tessera
