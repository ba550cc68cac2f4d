"""The host step of adam_mini.AdamMini as a small C++ CPU op (as rounded_update_cpu.py is for RoundedAdamW).

adam_mini.update_torch in torch ops makes ~20 passes over each chunk and allocates its temporaries;
here one row at a time is read twice (the squared gradients' mean, then the update) while it is in the
cache, in one loop the compiler vectorises (-O3 -march=native), split over torch's intra-op threads
(at::parallel_for, so torch.set_num_threads holds). The arithmetic is update_torch's, in its order
(no fused multiply-add: -ffp-contract=off), and the rounding bits are the same hash; the row mean's
sum runs in another order than torch's reduction, so the two agree to an fp32 ulp of v, not bit for
bit (tests/test_adam_mini.py holds them to that).

Built once per machine by torch.utils.cpp_extension.load_inline (cached in torch's extension folder,
backends/rank/jit_cache.py); `get()` returns None with the reason when it cannot be built, and the
caller runs the torch code.
"""

from __future__ import annotations

from shardconsole.backends.rank.jit_cache import load_host_op

NAME = "shardconsole_adam_mini_cpu"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float from_bf16(uint16_t h) { return from_bits((uint32_t)h << 16); }

// adam_mini.round_stochastic: noise from the value's bits, the seed and the element's index
static inline uint16_t round_sr(float x, uint32_t seed, uint32_t index) {
  const uint32_t b = bits_of(x);
  const uint32_t noise = ((b ^ seed ^ (index * 0x85EBCA6Bu)) * 0x9E3779B1u) >> 16;
  return (uint16_t)((b + noise) >> 16);
}

// KIND 0: fp32 weight and first moment; 1: bf16 weight rounded stochastically, bf16 moment;
// 2: bf16 weight + int16 remainder (an fp32 master), bf16 moment. GBF: the gradient is bf16 (else fp32).
template <int KIND, bool GBF>
static void rows(void* Wv, const void* Gv, void* Mv, float* V, int16_t* LO, const float* q,
                 uint32_t sw, uint32_t sm, int64_t cols, int64_t r0, int64_t r1) {
  // q: adam_mini.hyper_parameters, fp32
  const float b2 = q[2], decay = q[3], eps = q[4], step_size = q[5], bc2 = q[6], inv = q[7];
  const float wt = q[8], omb2 = q[9];
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * cols;
    float s = 0.0f;
    for (int64_t j = 0; j < cols; ++j) {
      const float g = (GBF ? from_bf16(((const uint16_t*)Gv)[base + j]) : ((const float*)Gv)[base + j]) * inv;
      s += g * g;
    }
    const float v = V[r] * b2 + s / (float)cols * omb2;
    V[r] = v;
    const float denom = std::sqrt(v) / bc2 + eps;
    #pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t i = base + j;
      const float g32 = (GBF ? from_bf16(((const uint16_t*)Gv)[i]) : ((const float*)Gv)[i]) * inv;
      const float m0 = KIND == 0 ? ((const float*)Mv)[i] : from_bf16(((const uint16_t*)Mv)[i]);
      const float m32 = m0 + (g32 - m0) * wt;
      float w32;
      if (KIND == 0) w32 = ((const float*)Wv)[i];
      else if (KIND == 1) w32 = from_bf16(((const uint16_t*)Wv)[i]);
      else w32 = from_bits(((uint32_t)((const uint16_t*)Wv)[i] << 16) + (uint32_t)(int32_t)LO[i]);
      w32 = w32 * decay - step_size * m32 / denom;
      if (KIND == 0) {
        ((float*)Wv)[i] = w32;
        ((float*)Mv)[i] = m32;
      } else {
        if (KIND == 1) {
          ((uint16_t*)Wv)[i] = round_sr(w32, sw, (uint32_t)i);
        } else {
          const uint32_t b = bits_of(w32);
          const uint32_t top = (uint32_t)((int32_t)(b + 0x8000u) >> 16);
          ((uint16_t*)Wv)[i] = (uint16_t)top;
          LO[i] = (int16_t)(b - (top << 16));
        }
        ((uint16_t*)Mv)[i] = round_sr(m32, sm, (uint32_t)i);
      }
    }
  }
}

void update(torch::Tensor w, torch::Tensor g, torch::Tensor m, torch::Tensor v, torch::Tensor lo,
            torch::Tensor hp, int64_t seed_w, int64_t seed_m) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous(),
              "adam-mini: contiguous [rows, cols] tensors");
  const int64_t nrows = w.size(0), cols = w.size(1);
  TORCH_CHECK(g.numel() == w.numel() && m.numel() == w.numel() && v.numel() == nrows, "adam-mini: sizes");
  TORCH_CHECK(v.scalar_type() == torch::kFloat32, "adam-mini: v is fp32");
  const bool fp32 = w.scalar_type() == torch::kFloat32;
  TORCH_CHECK(fp32 || w.scalar_type() == torch::kBFloat16, "adam-mini: fp32 or bf16 weights");
  TORCH_CHECK(m.scalar_type() == w.scalar_type(), "adam-mini: the moment has the weight's dtype");
  const bool split = lo.numel() > 0;
  TORCH_CHECK(!split || (!fp32 && lo.numel() == w.numel() && lo.scalar_type() == torch::kInt16 && lo.is_contiguous()),
              "adam-mini: the remainder is int16 like the bf16 weight");
  const bool gbf = g.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(gbf || g.scalar_type() == torch::kFloat32, "adam-mini: fp32 or bf16 gradients");
  auto h = hp.to(torch::kFloat32).contiguous();
  TORCH_CHECK(h.numel() == 10, "adam-mini: 10 hyper-parameters");
  const float* q = h.data_ptr<float>();
  void* W = w.data_ptr();
  const void* G = g.data_ptr();
  void* M = m.data_ptr();
  float* V = v.data_ptr<float>();
  int16_t* LO = split ? lo.data_ptr<int16_t>() : nullptr;
  const uint32_t sw = (uint32_t)seed_w, sm = (uint32_t)seed_m;
  const int kind = fp32 ? 0 : (split ? 2 : 1);
  auto run = kind == 0 ? (gbf ? rows<0, true> : rows<0, false>)
           : kind == 1 ? (gbf ? rows<1, true> : rows<1, false>)
                       : (gbf ? rows<2, true> : rows<2, false>);
  const int64_t grain = std::max<int64_t>(1, (int64_t)(1 << 15) / std::max<int64_t>(cols, 1));
  at::parallel_for(0, nrows, grain, [&](int64_t a, int64_t b) { run(W, G, M, V, LO, q, sw, sm, cols, a, b); });
}
"""


def get():
    """(the built module, None) or (None, why it could not be built); built at most once a process."""
    return load_host_op(NAME, SOURCE, ["update"])
