#include "tessera/optim/host_parallel.h"

namespace tessera::optim {

namespace {
thread_local const RangeRunner* tls_runner = nullptr;
}  // namespace

RangeRunnerScope::RangeRunnerScope(const RangeRunner* runner) : previous_(tls_runner) {
  tls_runner = runner;
}

RangeRunnerScope::~RangeRunnerScope() { tls_runner = previous_; }

const RangeRunner* current_range_runner() { return tls_runner; }

}  // namespace tessera::optim
