// Does AMX's bf16 tile product (TDPBF16PS) sum in an order the other CPU kinds can repeat?
// The invariant matmul (engine/csrc/invariant_linear.cpp) sums each output as a chain of fp32
// FMAs in k order, which AVX512-BF16's vdpbf16ps, AVX2 and plain C++ all compute to the same bits.
// An AMX path could join them only if each tile product equals such a chain. This program
// multiplies random 16 x 32 by 32 x 16 bf16 tiles on the tiles and counts the outputs that equal,
// bit for bit, each candidate order computed in software.
//
//   g++ -O2 -mamx-tile -mamx-bf16 bench/amx_order.cpp -o build/amx_order && build/amx_order
//
// Needs a CPU with AMX (Sapphire Rapids or later) and Linux 5.16+ (the tile-data permission).

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

uint16_t to_bf16(float f) {  // truncation: every value is then exactly a bf16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u >> 16;
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// One trial set: `spread` binary orders of magnitude in the inputs, accumulators from `c_scale`.
void trial(const char* name, int spread, float c_scale) {
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0, 1);
  auto value = [&] { return normal(gen) * std::ldexp(1.f, spread ? int(gen() % spread) - spread / 2 : 0); };
  long n = 0, k_first = 0, k1_first = 0, pair_rounded = 0, exact_then_rounded = 0;
  for (int round = 0; round < 200; ++round) {
    alignas(64) uint16_t a[16][32], b[16][32];  // b: 16 pairs of k, 16 columns of (k, k + 1)
    alignas(64) float c0[16][16], c[16][16];
    for (auto& row : a)
      for (auto& x : row) x = to_bf16(value());
    for (auto& row : b)
      for (auto& x : row) x = to_bf16(value());
    for (auto& row : c0)
      for (auto& x : row) x = normal(gen) * c_scale;
    std::memcpy(c, c0, sizeof c);
    _tile_loadd(0, c, 64);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    for (int m = 0; m < 16; ++m)
      for (int j = 0; j < 16; ++j) {
        float s0 = c0[m][j], s1 = c0[m][j], s2 = c0[m][j];
        double exact = c0[m][j];
        for (int p = 0; p < 16; ++p) {
          const float x0 = from_bf16(a[m][2 * p]), x1 = from_bf16(a[m][2 * p + 1]);
          const float w0 = from_bf16(b[p][2 * j]), w1 = from_bf16(b[p][2 * j + 1]);
          s0 = std::fma(x1, w1, std::fma(x0, w0, s0));  // k's product, then k + 1's
          s1 = std::fma(x0, w0, std::fma(x1, w1, s1));  // k + 1's, then k's (vdpbf16ps)
          s2 += float(double(x0) * w0 + double(x1) * w1);  // the pair's sum rounded, then added
          exact += double(x0) * w0 + double(x1) * w1;
        }
        k_first += same_bits(s0, c[m][j]);
        k1_first += same_bits(s1, c[m][j]);
        pair_rounded += same_bits(s2, c[m][j]);
        exact_then_rounded += same_bits(float(exact), c[m][j]);
        ++n;
      }
  }
  std::printf("%-44s %6ld outputs: k first %5.1f%%  k+1 first %5.1f%%  pairs rounded %5.1f%%  exact sum %5.1f%%\n",
              name, n, 100.0 * k_first / n, 100.0 * k1_first / n, 100.0 * pair_rounded / n,
              100.0 * exact_then_rounded / n);
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::puts("no AMX here (the kernel refused the tile-data permission)");
    return 1;
  }
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 3; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  trial("inputs ~N(0,1), accumulators 0", 0, 0.f);
  trial("inputs over 2^-10..2^10, accumulators ~1000", 20, 1000.f);
  _tile_release();
  return 0;
}
