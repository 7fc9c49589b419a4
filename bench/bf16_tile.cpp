// What bf16 products would buy the GGUF matmul (engine/csrc/gguf_linear.cpp): its 6 x 4 tile
// as it sums dequantized fp32 weights (an FMA a weight), against the same tile on bf16 pairs
// (vdpbf16ps: two weights a lane an instruction, which is two fp32 FMAs in a fixed order, so an
// invariant kernel can use it: engine/csrc/vec.h). Weights in L1 per 4 outputs, rows of x in
// L2, both threads, SmolLM2's gate_up (576 -> 3,072), M rows; the GF/s of each, in turns.
//
//   g++ -O3 -march=native -fopenmp bench/bf16_tile.cpp -o build/bf16_tile && OMP_NUM_THREADS=2 build/bf16_tile [M]
//
// Needs AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids or later).

#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int R = 6, C = 4;
constexpr long K = 576, N = 3072;

inline void in_register(__m512i& v) { asm volatile("" : "+v"(v)); }

// The tile on T = float (an FMA a weight) or T = uint16_t, bf16 bits (vdpbf16ps: a pair a lane).
template <typename T>
void tile(const T* x, const T* w, float* y) {
  constexpr long kStep = 64 / sizeof(T);  // weights a 512-bit load holds
  __m512 acc[R][C];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (long k = 0; k < K; k += kStep) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = _mm512_loadu_si512(w + c * K + k);
      in_register(wv[c]);
    }
    for (int r = 0; r < R; ++r) {
      __m512i xv = _mm512_loadu_si512(x + r * K + k);
      in_register(xv);
      for (int c = 0; c < C; ++c) {
        if constexpr (sizeof(T) == 4)
          acc[r][c] = _mm512_fmadd_ps(_mm512_castsi512_ps(xv), _mm512_castsi512_ps(wv[c]), acc[r][c]);
        else
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wv[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * C + c] = _mm512_reduce_add_ps(acc[r][c]);
}

uint16_t to_bf16(float f) {  // truncated: the speed does not depend on the rounding
  uint32_t u;
  memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

int main(int argc, char** argv) {
  const long M = (argc > 1 ? atol(argv[1]) : 64) / R * R;
  std::vector<float> x(M * K), w(N * K), y(N);
  std::vector<uint16_t> xb(M * K), wb(N * K);
  for (auto& v : x) v = rand() / static_cast<float>(RAND_MAX);
  for (auto& v : w) v = rand() / static_cast<float>(RAND_MAX);
  for (long i = 0; i < M * K; ++i) xb[i] = to_bf16(x[i]);
  for (long i = 0; i < N * K; ++i) wb[i] = to_bf16(w[i]);
  printf("%ld x %ld -> %ld, GF/s in turns:\n", M, K, N);
  for (int rep = 0; rep < 6; ++rep) {
    double gfs[2];
    for (int bf16 = 0; bf16 < 2; ++bf16) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < 20; ++it) {
#pragma omp parallel for schedule(static)
        for (long n = 0; n < N; n += C) {
          float out[R * C];
          for (long m = 0; m < M; m += R) {
            if (bf16)
              tile(&xb[m * K], &wb[n * K], out);
            else
              tile(&x[m * K], &w[n * K], out);
          }
          y[n] += out[0];
        }
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      gfs[bf16] = 20.0 * 2 * M * K * N / s / 1e9;
    }
    printf("  fp32 %6.1f  bf16 %6.1f  (%.2fx)\n", gfs[0], gfs[1], gfs[1] / gfs[0]);
  }
  return y[0] == 12345.f;  // keeps the sums live
}
