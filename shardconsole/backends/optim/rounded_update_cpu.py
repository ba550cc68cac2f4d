"""The host step of master_update.RoundedAdamW as a small C++ CPU op (issue 35 item 2).

Inductor's C++ code for master_update.update_chunk turns the fp32 <-> int32 bit views of the rounding into
a scalar loop, so the offloaded host step of bf16 masters ran about 4x below the host's memory bandwidth.
Here the same update is one loop of plain C++ over uint16 / uint32 / float arrays, which the compiler
vectorises (-O3 -march=native: AVX2 / AVX-512 where the host has them), split over torch's intra-op
threads (at::parallel_for, so torch.set_num_threads holds).

The numerics are master_update's: torch's AdamW formula in fp32, written in the order the eager update
evaluates it (no fused multiply-add: -ffp-contract=off), and the same stochastic rounding: the value's
own fp32 bits hashed with the same per-step, per-tensor, per-chunk seed (Knuth's multiplicative hash),
the high 16 bits kept after adding the hash's 16 bits. Unbiased, deterministic for a seed and any thread
count, and identical to master_update.round_stochastic_ bit for bit (tests/test_master_rounding.py).
Where eager torch computes an element with a fused multiply-add (its vectorised lerp) the fp32 value may
differ by an ulp, which picks other random bits: the same distribution, as compiled against eager.

Built once per machine by torch.utils.cpp_extension.load_inline (cached in torch's extension folder,
backends/rank/jit_cache.py); needs a C++ compiler, which the GPU machines have (Inductor uses one). When the
build fails, `get()` returns None with the reason and the caller keeps the compiled update.
"""

from __future__ import annotations

import torch

from shardconsole.backends.rank.jit_cache import load_host_op

NAME = "shardconsole_rounded_adamw_cpu"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16; float f; std::memcpy(&f, &u, 4); return f;
}
static inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// master_update._stochastic: noise = ((bits ^ seed) * 0x9E3779B1) >> 16 (16 bits), kept: (bits + noise)'s
// high half. A NaN result becomes torch's canonical bf16 NaN, as its fp32 -> bf16 cast makes it.
static inline uint16_t round_sr(float x, uint32_t seed) {
  uint32_t b = bits_of(x);
  uint32_t r = (b + (((b ^ seed) * 0x9E3779B1u) >> 16)) >> 16;
  return ((r & 0x7F80u) == 0x7F80u && (r & 0x7Fu)) ? (uint16_t)0x7FC0 : (uint16_t)r;
}
// torch's fp32 -> bf16 cast: round to nearest even
static inline uint16_t round_ne(float x) {
  uint32_t u = bits_of(x);
  uint16_t r = (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
  return x != x ? (uint16_t)0x7FC0 : r;
}

static void check(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.numel() == n,
              what, ": a contiguous bf16 CPU tensor of the weight's size");
}

// One pass over [lo, hi). Templated so the loop has no branch: the compiler vectorises only a loop
// without control flow (gcc -fopt-info-vec: "control flow in loop" with the kahan test inside).
template <bool KAHAN, bool SMALL>
static void pass(uint16_t* __restrict W, const uint16_t* __restrict G, uint16_t* __restrict M,
                 uint16_t* __restrict V, uint16_t* __restrict K, const float* q,
                 uint32_t sw, uint32_t sm, uint32_t sv, int64_t lo, int64_t hi) {
  // q: [lr, beta1, beta2, 1 - lr * weight_decay, eps, lr / bias_correction1, sqrt(bias_correction2), 1 / grad_scale]
  const float b2 = q[2], decay = q[3], eps = q[4], step_size = q[5], bc2 = q[6], inv_scale = q[7];
  const float wt = 1.0f - q[1], omb2 = 1.0f - b2, wt_c = 1.0f - wt;
  #pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const float g32 = from_bf16(G[i]) * inv_scale;
    const float m0 = from_bf16(M[i]);
    // torch's lerp, in the form it takes for this weight
    const float m32 = SMALL ? m0 + wt * (g32 - m0) : g32 - (g32 - m0) * wt_c;
    const float v32 = from_bf16(V[i]) * b2 + g32 * g32 * omb2;
    float w32 = KAHAN ? from_bf16(W[i]) + from_bf16(K[i]) : from_bf16(W[i]);
    w32 = w32 * decay - step_size * m32 / (std::sqrt(v32) / bc2 + eps);
    if (KAHAN) {
      const uint16_t wn = round_ne(w32);
      W[i] = wn;
      K[i] = round_ne(w32 - from_bf16(wn));
    } else {
      W[i] = round_sr(w32, sw);
    }
    M[i] = round_sr(m32, sm);
    V[i] = round_sr(v32, sv);
  }
}

void update(torch::Tensor w, torch::Tensor g, torch::Tensor m, torch::Tensor v, torch::Tensor c,
            torch::Tensor hp, int64_t seed_w, int64_t seed_m, int64_t seed_v) {
  const int64_t n = w.numel();
  check(w, n, "w"); check(g, n, "g"); check(m, n, "m"); check(v, n, "v");
  const bool kahan = c.numel() > 0;
  if (kahan) check(c, n, "c");
  auto h = hp.to(torch::kFloat32).contiguous();
  const float* q = h.data_ptr<float>();
  const bool small = std::abs(1.0f - q[1]) < 0.5f;
  const uint32_t sw = (uint32_t)seed_w, sm = (uint32_t)seed_m, sv = (uint32_t)seed_v;
  uint16_t* W = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  const uint16_t* G = reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>());
  uint16_t* M = reinterpret_cast<uint16_t*>(m.data_ptr<at::BFloat16>());
  uint16_t* V = reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>());
  uint16_t* K = kahan ? reinterpret_cast<uint16_t*>(c.data_ptr<at::BFloat16>()) : nullptr;
  auto run = kahan ? (small ? pass<true, true> : pass<true, false>) : (small ? pass<false, true> : pass<false, false>);
  at::parallel_for(0, n, 1 << 15, [&](int64_t lo, int64_t hi) { run(W, G, M, V, K, q, sw, sm, sv, lo, hi); });
}

// master_update.round_stochastic_ (the test compares the two bit for bit)
void round_stochastic(torch::Tensor x, torch::Tensor out, int64_t seed) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32");
  check(out, x.numel(), "out");
  const float* X = x.data_ptr<float>();
  uint16_t* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < x.numel(); ++i) O[i] = round_sr(X[i], (uint32_t)seed);
}
"""


def get():
    """(the built module, None) or (None, why it could not be built); built at most once a process."""
    return load_host_op(NAME, SOURCE, ["update", "round_stochastic"])


def update_chunk(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor | None,
                 hp: torch.Tensor, seed_w: int, seed_m: int, seed_v: int) -> None:
    """master_update.update_chunk's signature, run by the C++ op (get() must have built it)."""
    mod, _ = get()
    mod.update(w, g, m, v, c if c is not None else w.new_empty(0), hp, seed_w, seed_m, seed_v)
