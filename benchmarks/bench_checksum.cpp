// CRC-32 of checkpoint-sized buffers: tessera::crc32 (zlib's crc32 since this measurement)
// against the byte-at-a-time table loop the project used before, and Adler-32 likewise.
#include <benchmark/benchmark.h>
#include <zlib.h>

#include <array>
#include <random>
#include <vector>

#include "tessera/core/file_io.h"

namespace {

// The previous tessera::crc32: one table lookup per byte.
uint32_t crc32_bytewise(const std::vector<std::byte>& bytes) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (std::byte b : bytes) c = table[(c ^ static_cast<uint32_t>(b)) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

const std::vector<std::byte>& buffer(size_t n) {
  static std::vector<std::byte> bytes;
  if (bytes.size() != n) {
    std::mt19937 rng(1);
    bytes.resize(n);
    for (auto& b : bytes) b = static_cast<std::byte>(rng());
  }
  return bytes;
}

void BM_Crc32Bytewise(benchmark::State& state) {
  const auto& bytes = buffer(static_cast<size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(crc32_bytewise(bytes));
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BM_Crc32Zlib(benchmark::State& state) {
  const auto& bytes = buffer(static_cast<size_t>(state.range(0)));
  for (auto _ : state)
    benchmark::DoNotOptimize(::crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BM_Crc32Tessera(benchmark::State& state) {  // what checkpoints use now
  const auto& bytes = buffer(static_cast<size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(tessera::crc32(bytes));
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BM_Adler32Tessera(benchmark::State& state) {
  const auto& bytes = buffer(static_cast<size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(tessera::adler32(bytes));
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

}  // namespace

BENCHMARK(BM_Crc32Bytewise)->Arg(1 << 24);
BENCHMARK(BM_Crc32Zlib)->Arg(1 << 24);
BENCHMARK(BM_Crc32Tessera)->Arg(1 << 24);
BENCHMARK(BM_Adler32Tessera)->Arg(1 << 24);
BENCHMARK_MAIN();
