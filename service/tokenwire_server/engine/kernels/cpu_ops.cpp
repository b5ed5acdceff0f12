// The batched engine's native pass on x86 CPUs (AVX2+FMA, float32): the operations
// around its GEMMs, each one call instead of several stock torch ops.
//
// decode_attention: each one-token row attends over the first `lengths[r]` columns of
//   its own block table (column c: row c % block_size of block tables[r][c / block_size])
//   and nothing else: no padding to the longest row, no mask, so a row
//   computes the same numbers whatever else is in the step. The query heads that share
//   a KV head are done together (each key and value vector is read once for all of
//   them), and the work is split over (row, KV head) pairs on torch's intra-op threads.
//   Plain softmax in two passes over a row's columns: the scores (one read of the
//   keys), then max, exp and sum, then the weighted sum of values (one read of the
//   values).
//
// rms_norm: Llama's RMSNorm of each row, w * (x / sqrt(mean(x^2) + eps)).
// silu_mul: SiLU(gate) * up over the fused gate/up GEMM's output, without slicing it.
// rope_: rotary embedding of q and k in place (x*cos + rotate_half(x)*sin), over the
//   fused q/k/v GEMM's output rows.
// store_kv: this step's keys and values (the roped k and the v of the fused q/k/v
//   output) into each token's block and offset in the cache, one copy per vector.
// lora_add_: each token's LoRA delta, s·(x·Aᵀ)·Bᵀ, added to its row of a GEMM's output in
//   place, for a step whose tokens use several adapters (slots[t]: the index of token t's
//   adapter in downs/ups/spans, -1: none, its row untouched). An adapter's B is held by
//   segment (one per projection: the output columns it writes and its rank rows, B times the
//   scaling as [rank rows, columns]); its weights float32 or bf16, widened as read. A token's
//   low-rank vector is its own row's dot products with its adapter's A rows, and each output
//   element adds Σ_r h[r]·B[r][c] over its segment's rank rows (in order, then once into the
//   output): the same arithmetic whatever the other tokens are, their adapters or the
//   threads. Tokens of one adapter go in tiles of up to four, so each weight read serves all;
//   each tile's sums are held in registers over several rank rows (A) or all of them (B).
// panel_linear_lora: panel_linear, then lora_add_ on its output, in one call (the native pass's
//   at each GEMM a step's adapters adapt, on an AVX-512F CPU), the LoRA pass run by the GEMM's
//   own threads: each takes a share of the A pass before its panels and does the B pass over
//   its panels' columns after them. The same bits as the two calls.
// A row's result never depends on the other rows: the work is split over rows only.
// decoder_layers: every decoder layer of a step in one call (the panels and the ops above, in
//   the order the native pass's Python loop calls them): one dispatch a step, not ~500.
//
// panel_linear: x·Wᵀ (+ bias) (+ residual) for float32 rows x [rows, in] and a weight held as
//   panels of 16 output columns ([out / 16, in, 16]: panel p, input k holds W[16p..16p+15][k]),
//   float32 or bf16 (widened as read). Each output element is one float32 accumulator that
//   takes x[r][k]·W[c][k] for k = 0, 1, ... in order (an FMA each), then the bias, then the
//   residual: the same arithmetic at any row count, in any tile, on any thread, so a row's
//   result never depends on how many rows share the call (batch invariance by construction,
//   in bf16 too). A tile is up to 6 rows × 4 panels (24 accumulators); each panel is streamed
//   in order, each weight read once per tile of rows, so one row reads the weights at the
//   memory's pace. AVX-512F only (target attribute; ``cpu_has_avx512f`` says whether this CPU
//   runs it): elsewhere the native pass keeps oneDNN's packed GEMM.
//
// Built with -mavx2 -mfma by kernels/__init__.py, loaded only where the CPU has both.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// exp(x) for 8 floats: Cephes' expf, the range reduction x = n ln2 + r with ln2 split
// in two, a degree-5 polynomial for e^r and 2^n put into the exponent (error ~1 ulp).
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 lo = _mm256_set1_ps(-88.3762626647949f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight horizontal sums at once: lane j of the result is the sum of v[j]'s lanes.
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low/high 128-bit halves of each sum), likewise b.
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Rows per task for a row-wise op: enough work per task to be worth a thread.
int64_t grain(int64_t per_row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(per_row, 1)); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name, ": a contiguous float32 [rows, n] tensor");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == at::kFloat && weight.is_contiguous(), "rms_norm weight: float32 [n]");
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* r = xp + t * n;
      float* o = op + t * n;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(r + i);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float squares = hsum(acc);
      for (; i < n; ++i) squares += r[i] * r[i];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(n) + feps);
      const __m256 vinv = _mm256_set1_ps(inv);
      i = 0;
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(wp + i), _mm256_mul_ps(_mm256_loadu_ps(r + i), vinv)));
      for (; i < n; ++i) o[i] = wp[i] * (r[i] * inv);
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate) {
  check_rows(gate_up, "silu_mul gate_up");
  TORCH_CHECK(intermediate > 0 && gate_up.size(1) == 2 * intermediate, "silu_mul: gate_up must be [rows, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), n = intermediate;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = gp + t * 2 * n;
      const float* up = gate + n;
      float* o = op + t * n;
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
      }
      for (; i < n; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "rope_ x: float32 [rows, heads, dim], dim contiguous");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 16 == 0, "rope_: head dim must be a multiple of 16");
  check_rows(cos, "rope_ cos");
  check_rows(sin, "rope_ sin");
  TORCH_CHECK(cos.size(0) == rows && cos.size(1) == dim && sin.sizes() == cos.sizes(), "rope_: cos and sin are [rows, dim]");
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, rows, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + t * row_stride + h * head_stride;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256 x1 = _mm256_loadu_ps(v + i), x2 = _mm256_loadu_ps(v + half + i);
          // [x1, x2] * cos + [-x2, x1] * sin
          _mm256_storeu_ps(v + i, _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)), _mm256_mul_ps(x2, _mm256_loadu_ps(s + i))));
          _mm256_storeu_ps(v + half + i, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)), _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i))));
        }
      }
    }
  });
}

void store_kv(const at::Tensor& qkv, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& blocks,
              const at::Tensor& offsets, int64_t heads) {
  check_rows(qkv, "store_kv qkv");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat &&
                  keys.is_contiguous() && values.is_contiguous(),
              "store_kv: keys, values are contiguous float32 [blocks, kv_heads, block_size, dim]");
  const int64_t tokens = qkv.size(0), kv_heads = keys.size(1), block_size = keys.size(2), dim = keys.size(3);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "store_kv: qkv must be [tokens, (heads + 2 * kv_heads) * dim]");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && blocks.numel() == tokens && offsets.numel() == tokens,
              "store_kv: one int64 block and offset per token");
  const int64_t* block = blocks.data_ptr<int64_t>();
  const int64_t* offset = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(block[t] >= 0 && block[t] < keys.size(0) && offset[t] >= 0 && offset[t] < block_size, "store_kv: block or offset out of range");
  }
  const float* src = qkv.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const int64_t width = qkv.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* k = src + t * width + heads * dim;
    const float* v = k + kv_heads * dim;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = ((block[t] * kv_heads + h) * block_size + offset[t]) * dim;
      std::memcpy(kp + at, k + h * dim, sizeof(float) * dim);
      std::memcpy(vp + at, v + h * dim, sizeof(float) * dim);
    }
  }
}

constexpr int kMaxGroup = 16;  // query heads per KV head

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& tables, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(), "q [rows, heads, dim]; keys, values [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous(),
              "tables [rows, blocks] and lengths [rows] are int64");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t blocks = keys.size(0), kv_heads = keys.size(1), block_size = keys.size(2), width = tables.size(1);
  TORCH_CHECK(keys.size(3) == dim && dim % 8 == 0, "head dim must match and be a multiple of 8");
  TORCH_CHECK(block_size % 8 == 0, "block size must be a multiple of 8");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "query heads must be a multiple of KV heads, at most kMaxGroup (16) per KV head");
  TORCH_CHECK(tables.size(0) == rows && lengths.numel() == rows, "one table and one length per row");
  const int64_t group = heads / kv_heads;
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(length[r] >= 1 && length[r] <= width * block_size, "length out of range");
    for (int64_t b = 0; b < (length[r] + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(table[r * width + b] >= 0 && table[r * width + b] < blocks, "block out of range");
    }
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t lanes = dim / 8;

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads, n = length[r];
      const int64_t* row_table = table + r * width;
      // Column c of this row and KV head: row c % block_size of block row_table[c / block_size].
      auto at = [&](const float* base, int64_t c) {
        return base + ((row_table[c / block_size] * kv_heads + h) * block_size + c % block_size) * dim;
      };
      const float* qh = qp + (r * heads + h * group) * dim;
      float* oh = op + (r * heads + h * group) * dim;
      scores.resize(static_cast<size_t>(group * n));
      // Pass 1: scores of every query head of the group, each key read once. Eight
      // columns at a time: eight dot products, reduced together into one vector.
      int64_t c = 0;
      for (; c + 8 <= n; c += 8) {
        const float* kc = at(kp, c);  // eight columns in one block (block_size is a multiple of 8)
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * dim;
          __m256 acc[8];
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
          for (int64_t l = 0; l < lanes; ++l) {
            const __m256 ql = _mm256_loadu_ps(qg + 8 * l);
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(kc + j * dim + 8 * l), acc[j]);
          }
          _mm256_storeu_ps(scores.data() + g * n + c, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(fscale)));
        }
      }
      for (; c < n; ++c) {
        const float* kc = at(kp, c);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * dim;
          __m256 acc = _mm256_setzero_ps();
          for (int64_t l = 0; l < lanes; ++l) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * l), _mm256_loadu_ps(kc + 8 * l), acc);
          scores[g * n + c] = hsum(acc) * fscale;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < n; ++c) top = s[c] > top ? s[c] : top;
        const __m256 vtop = _mm256_set1_ps(top);
        __m256 vsum = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= n; c += 8) {
          __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), vtop));
          _mm256_storeu_ps(s + c, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        float total = hsum(vsum);
        if (c < n) {
          alignas(32) float tail[8];
          for (int64_t i = 0; i < 8; ++i) tail[i] = c + i < n ? s[c + i] - top : -std::numeric_limits<float>::infinity();
          __m256 e = exp8(_mm256_load_ps(tail));
          _mm256_store_ps(tail, e);
          for (int64_t i = 0; c + i < n; ++i) {
            s[c + i] = tail[i];
            total += tail[i];
          }
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < n; ++i) s[i] *= inv;
      }
      // Pass 2: the weighted sum of values, per query head, in registers (a row's
      // values are read from memory once; the next heads find them in cache).
      for (int64_t g = 0; g < group; ++g) {
        const float* p = scores.data() + g * n;
        float* og = oh + g * dim;
        for (int64_t base = 0; base < lanes; base += 8) {
          const int64_t lanes8 = lanes - base < 8 ? lanes - base : 8;
          __m256 acc[8];
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
          for (int64_t c0 = 0; c0 < n; c0 += block_size) {
            const float* vb = at(vp, c0) + 8 * base;
            const int64_t stop = std::min<int64_t>(block_size, n - c0);
            for (int64_t i = 0; i < stop; ++i) {
              const float* vc = vb + i * dim;
              const __m256 pc = _mm256_set1_ps(p[c0 + i]);
              for (int64_t j = 0; j < lanes8; ++j) acc[j] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vc + 8 * j), acc[j]);
            }
          }
          for (int64_t j = 0; j < lanes8; ++j) _mm256_storeu_ps(og + 8 * (base + j), acc[j]);
        }
      }
    }
  });
  return out;
}

// --- lora_add_ ---------------------------------------------------------------------------

constexpr int64_t kLoraTile = 4;     // tokens of one adapter read together
constexpr int64_t kLoraBlock = 512;  // output columns per task of the B pass
constexpr int64_t kLoraThreadsFrom = 1 << 19;  // multiply-adds (an upper bound) from which a call splits over threads

// 8 weights as float32: float32 as they are, bf16 widened (its bits are the float's top half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

// The A pass, h[r][j] = dot(a[r], x[j]), for the N rows x[j] of a tile and R rank rows a[r]
// (`len` apart) at once: N·R independent accumulators (eight lanes each) keep the FMA units
// busy where one row's two would wait on each other, and each input vector loaded serves R
// rank rows. Lane k sums the products at k, k + 8, ... in order, then the lanes are summed and
// the tail added: a row's h[r] has the same bits whatever N and R it was computed in.
template <typename W, int N, int R>
inline void dots(const W* a, int64_t len, const float* const* x, float* h) {
  __m256 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 xv[N];
    for (int j = 0; j < N; ++j) xv[j] = _mm256_loadu_ps(x[j] + i);
    for (int r = 0; r < R; ++r) {
      const __m256 av = load8(a + r * len + i);
      for (int j = 0; j < N; ++j) acc[r][j] = _mm256_fmadd_ps(av, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < N; ++j) {
      float sum = hsum(acc[r][j]);
      for (int64_t k = i; k < len; ++k) sum = std::fma(widen(a[r * len + k]), x[j][k], sum);
      h[r * kLoraTile + j] = sum;
    }
  }
}

// h for `ranks` rank rows of a tile of N rows: eight rank rows a block for one row (eight
// accumulators), four for two, two for three or four; the last rows one at a time.
template <typename W, int N>
inline void dots_rows(const W* a, int64_t len, int64_t ranks, const float* const* x, float* h) {
  constexpr int R = N == 1 ? 8 : N == 2 ? 4 : 2;
  int64_t r = 0;
  for (; r + R <= ranks; r += R) dots<W, N, R>(a + r * len, len, x, h + r * kLoraTile);
  for (; r < ranks; ++r) dots<W, N, 1>(a + r * len, len, x, h + r * kLoraTile);
}

template <typename W>
inline void dots_tile(const W* a, int64_t len, int64_t ranks, const float* const* x, int64_t n, float* h) {
  switch (n) {
    case 1: return dots_rows<W, 1>(a, len, ranks, x, h);
    case 2: return dots_rows<W, 2>(a, len, ranks, x, h);
    case 3: return dots_rows<W, 3>(a, len, ranks, x, h);
    default: return dots_rows<W, 4>(a, len, ranks, x, h);
  }
}

// The B pass: out[j][c] += Σ_r h[r][j]·up[r][c] for columns [lo, hi) of one segment (rank rows
// `stride` apart in up), the N rows of a tile. 8·V columns at a time, each row's sums held in
// registers over every rank row (no round trip through memory per rank), then added to the
// output once. Every element is one sum from 0.0 over the rank rows in order, then the add:
// the same bits on the vector and the scalar path, whatever N.
template <typename W, int N, int V>
inline int64_t spread_vectors(const W* up, int64_t stride, int64_t ranks, const float* h, float* const* out, int64_t c,
                              int64_t hi) {
  for (; c + 8 * V <= hi; c += 8 * V) {
    __m256 acc[N][V];
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) acc[j][v] = _mm256_setzero_ps();
    for (int64_t r = 0; r < ranks; ++r) {
      __m256 u[V];
      for (int v = 0; v < V; ++v) u[v] = load8(up + r * stride + c + 8 * v);
      for (int j = 0; j < N; ++j) {
        const __m256 hj = _mm256_broadcast_ss(h + r * kLoraTile + j);
        for (int v = 0; v < V; ++v) acc[j][v] = _mm256_fmadd_ps(hj, u[v], acc[j][v]);
      }
    }
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) {
        float* o = out[j] + c + 8 * v;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[j][v]));
      }
  }
  return c;
}

template <typename W, int N>
inline void spread_rows(const W* up, int64_t stride, int64_t ranks, const float* h, float* const* out, int64_t lo, int64_t hi) {
  constexpr int V = N == 1 ? 4 : 2;  // four independent sums a rank row at least
  int64_t c = spread_vectors<W, N, V>(up, stride, ranks, h, out, lo, hi);
  c = spread_vectors<W, N, 1>(up, stride, ranks, h, out, c, hi);
  for (; c < hi; ++c) {
    for (int j = 0; j < N; ++j) {
      float delta = 0.0f;
      for (int64_t r = 0; r < ranks; ++r) delta = std::fma(h[r * kLoraTile + j], widen(up[r * stride + c]), delta);
      out[j][c] += delta;
    }
  }
}

template <typename W>
inline void spread(const W* up, int64_t stride, int64_t ranks, const float* h, float* const* out, int64_t n, int64_t lo,
                   int64_t hi) {
  switch (n) {
    case 1: return spread_rows<W, 1>(up, stride, ranks, h, out, lo, hi);
    case 2: return spread_rows<W, 2>(up, stride, ranks, h, out, lo, hi);
    case 3: return spread_rows<W, 3>(up, stride, ranks, h, out, lo, hi);
    default: return spread_rows<W, 4>(up, stride, ranks, h, out, lo, hi);
  }
}

struct LoraSegment {
  int64_t first, end, rank_begin, rank_end, offset;  // columns, rank rows, where its rows start in up
};

// One call's adapter work, planned once: its tiles (up to kLoraTile tokens of one adapter, in
// token order), the A pass as items (tile, eight rank rows) and the B pass over any range of
// output columns. Run on its own (lora_add_) or by the threads of the GEMM before it
// (panel_linear_lora): a thread takes a share of the A items before its panels and the B pass
// over its own panels' columns after them, once every A item is done, so the pass wakes no
// threads of its own and reads its weights on every thread the GEMM has. A row's h and each
// output element are the same sums in the same order however the items and columns are split.
class LoraWork {
 public:
  virtual ~LoraWork() = default;
  int64_t items() const { return items_; }
  virtual void a_item(int64_t item) = 0;                                // h of one (tile, eight rank rows)
  virtual void b_columns(float* out, int64_t lo, int64_t hi) const = 0;  // every tile's delta into columns [lo, hi)
  // Takes up to `most` A items not yet taken and computes them.
  void take(int64_t most) {
    for (int64_t k = 0; k < most; ++k) {
      const int64_t item = next_.fetch_add(1, std::memory_order_relaxed);
      if (item >= items_) return;
      a_item(item);
      done_.fetch_add(1, std::memory_order_release);
    }
  }
  // Every A item done: the ones no thread has taken are computed here (so one thread alone
  // finishes, whatever runs inline), then a wait for the ones other threads are computing.
  void finish() {
    take(items_);
    while (done_.load(std::memory_order_acquire) < items_) _mm_pause();
  }

 protected:
  int64_t items_ = 0;

 private:
  std::atomic<int64_t> next_{0}, done_{0};
};

constexpr int64_t kLoraGroup = 8;  // rank rows per A item

template <typename W>
class LoraPlan final : public LoraWork {
 public:
  LoraPlan(const at::Tensor& x, int64_t width, const at::Tensor& slots, at::TensorList downs, at::TensorList ups,
           const std::vector<std::vector<LoraSegment>>& segments, const std::vector<int64_t>& ranks)
      : downs_(downs), ups_(ups), segments_(segments), ranks_(ranks), xp_(x.data_ptr<float>()), in_(x.size(1)), width_(width) {
    const int64_t* slot = slots.data_ptr<int64_t>();
    std::vector<int64_t> open(ranks.size(), -1);
    for (int64_t t = 0; t < x.size(0); ++t) {
      const int64_t s = slot[t];
      if (s < 0 || ranks[s] == 0) continue;
      if (open[s] < 0 || tiles_[open[s]].n == kLoraTile) {
        open[s] = static_cast<int64_t>(tiles_.size());
        tiles_.push_back(Tile{s, 0, {}});
      }
      Tile& tile = tiles_[open[s]];
      tile.token[tile.n++] = t;
    }
    for (const int64_t rank : ranks) widest_ = std::max(widest_, rank);
    groups_ = (widest_ + kLoraGroup - 1) / kLoraGroup;
    items_ = static_cast<int64_t>(tiles_.size()) * groups_;
    low_.resize(tiles_.size() * widest_ * kLoraTile);  // low[(tile, r, j)]: token j's h[r]
  }
  // Multiply-adds, an upper bound: what the call is worth in threads.
  int64_t work() const {
    int64_t sum = 0;
    for (const Tile& tile : tiles_) sum += tile.n * ranks_[tile.adapter] * (in_ + width_);
    return sum;
  }
  void a_item(int64_t item) override {
    const Tile& tile = tiles_[item / groups_];
    const int64_t r = (item % groups_) * kLoraGroup, group = std::min(kLoraGroup, ranks_[tile.adapter] - r);
    if (group <= 0) return;
    const float* rows[kLoraTile];
    for (int64_t j = 0; j < tile.n; ++j) rows[j] = xp_ + tile.token[j] * in_;
    dots_tile(static_cast<const W*>(downs_[tile.adapter].data_ptr()) + r * in_, in_, group, rows, tile.n,
              low_.data() + (item / groups_) * widest_ * kLoraTile + r * kLoraTile);
  }
  // A column is in one segment at most (each projection writes its own columns), whose rank rows it sums.
  void b_columns(float* out, int64_t lo, int64_t hi) const override {
    for (int64_t t = 0; t < tiles(); ++t) b_tile(t, out, lo, hi);
  }
  // One tile's delta into columns [lo, hi) of `out`, rows width_ apart.
  void b_tile(int64_t t, float* out, int64_t lo, int64_t hi) const {
    const Tile& tile = tiles_[t];
    const W* up = static_cast<const W*>(ups_[tile.adapter].data_ptr());
    const float* h = low_.data() + t * widest_ * kLoraTile;
    float* rows[kLoraTile];
    for (int64_t j = 0; j < tile.n; ++j) rows[j] = out + tile.token[j] * width_;
    for (const LoraSegment& seg : segments_[tile.adapter]) {
      const int64_t a = std::max(lo, seg.first), b = std::min(hi, seg.end);
      if (a >= b) continue;
      spread(up + seg.offset - seg.first, seg.end - seg.first, seg.rank_end - seg.rank_begin, h + seg.rank_begin * kLoraTile,
             rows, tile.n, a, b);
    }
  }
  int64_t tiles() const { return static_cast<int64_t>(tiles_.size()); }
  // Asks for the cache lines of every weight the call reads (the adapters some tile uses: each
  // one's down, then its up), all at once.
  void fetch() const {
    std::vector<bool> used(ranks_.size(), false);
    for (const Tile& tile : tiles_) used[tile.adapter] = true;
    for (size_t s = 0; s < used.size(); ++s) {
      if (!used[s]) continue;
      for (const at::Tensor* weights : {&downs_[s], &ups_[s]}) {
        const char* p = static_cast<const char*>(weights->data_ptr());
        const int64_t bytes = weights->numel() * static_cast<int64_t>(weights->element_size());
        for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
      }
    }
  }
  int64_t widest() const { return widest_; }

 private:
  struct Tile {
    int64_t adapter, n, token[kLoraTile];
  };
  at::TensorList downs_, ups_;
  const std::vector<std::vector<LoraSegment>>& segments_;
  const std::vector<int64_t>& ranks_;
  const float* xp_;
  int64_t in_, width_, widest_ = 0, groups_ = 0;
  std::vector<Tile> tiles_;
  std::vector<float> low_;
};

// lora_add_ on its own: every weight it reads asked for at once (the step's GEMMs stream the base
// model's weights through the caches between two calls, so these come from memory, and lines asked
// for together arrive sooner than misses met one at a time by the passes: measured on one decode
// row between the default model's GEMMs, ~5% of the call's time), then the A pass, then the B pass.
template <typename W>
void lora_add_impl(const at::Tensor& out, const at::Tensor& x, const at::Tensor& slots, at::TensorList downs,
                   at::TensorList ups, const std::vector<std::vector<LoraSegment>>& segments, const std::vector<int64_t>& ranks) {
  const int64_t width = out.size(1), in = x.size(1);
  LoraPlan<W> plan(x, width, slots, downs, ups, segments, ranks);
  if (plan.items() == 0) return;
  plan.fetch();
  // Threads only where the work is worth waking them: one decode row's adapter work at a site is
  // ~10^4-10^5 multiply-adds, about what a fork and join of the intra-op pool costs (measured on
  // the default model's shapes: one row took 1.6x the time on two threads with its weights in
  // cache, the same from memory; sixteen rows over four adapters served ~10% faster on two).
  const bool threads = plan.work() >= kLoraThreadsFrom;
  const int64_t items = plan.items();
  at::parallel_for(0, items, threads ? std::max<int64_t>(1, 16384 / std::max<int64_t>(kLoraGroup * in, 1)) : items,
                   [&](int64_t begin, int64_t end) {
                     for (int64_t item = begin; item < end; ++item) plan.a_item(item);
                   });
  // The B pass: one task per (tile, kLoraBlock output columns).
  const int64_t blocks = (width + kLoraBlock - 1) / kLoraBlock, count = plan.tiles() * blocks;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, threads ? std::max<int64_t>(1, 16384 / std::max<int64_t>(plan.widest() * kLoraBlock, 1)) : count,
                   [&](int64_t begin, int64_t end) {
                     for (int64_t item = begin; item < end; ++item) {
                       const int64_t first = (item % blocks) * kLoraBlock;
                       plan.b_tile(item / blocks, op, first, std::min(first + kLoraBlock, width));
                     }
                   });
}

struct LoraArgs {
  std::vector<int64_t> ranks;                     // per adapter (0: nothing at this site)
  std::vector<std::vector<LoraSegment>> segments;  // per adapter
  at::ScalarType weights = at::kFloat;
};

// lora_add_'s lists checked against `tokens` rows of `in` inputs and `width` output columns.
LoraArgs check_lora(int64_t tokens, int64_t in, int64_t width, const at::Tensor& slots, at::TensorList downs,
                    at::TensorList ups, at::TensorList spans) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == tokens && slots.is_contiguous(),
              "lora_add_ slots: int64 [tokens]");
  const int64_t adapters = static_cast<int64_t>(downs.size());
  TORCH_CHECK(static_cast<int64_t>(ups.size()) == adapters && static_cast<int64_t>(spans.size()) == adapters,
              "lora_add_: one down, up and spans per adapter");
  LoraArgs args{std::vector<int64_t>(adapters), std::vector<std::vector<LoraSegment>>(adapters)};
  auto& ranks = args.ranks;
  bool any = false;
  for (int64_t s = 0; s < adapters; ++s) {
    const at::Tensor& down = downs[s];
    ranks[s] = down.numel() == 0 ? 0 : down.size(0);
    if (ranks[s] == 0) continue;
    TORCH_CHECK(down.dim() == 2 && down.is_contiguous() && (down.scalar_type() == at::kFloat || down.scalar_type() == at::kBFloat16),
                "lora_add_ down: a contiguous float32 or bf16 [rank, in] tensor");
    TORCH_CHECK(down.size(1) == in, "lora_add_: an adapter's down is [rank, in]");
    TORCH_CHECK(!any || down.scalar_type() == args.weights, "lora_add_: every adapter's weights in one dtype");
    args.weights = down.scalar_type();
    any = true;
    TORCH_CHECK(ups[s].scalar_type() == args.weights && ups[s].is_contiguous(), "lora_add_ up: contiguous, in its down's dtype");
    const at::Tensor& span = spans[s];
    TORCH_CHECK(span.scalar_type() == at::kLong && span.is_contiguous() && span.dim() == 2 && span.size(1) == 4,
                "lora_add_ spans: int64 [segments, 4] (first column, end column, first rank row, end rank row)");
    const int64_t* sp = span.data_ptr<int64_t>();
    int64_t column = 0, rank = 0, offset = 0;
    for (int64_t k = 0; k < span.size(0); ++k) {
      const LoraSegment seg{sp[4 * k], sp[4 * k + 1], sp[4 * k + 2], sp[4 * k + 3], offset};
      TORCH_CHECK(column <= seg.first && seg.first < seg.end && seg.end <= width && seg.rank_begin == rank && seg.rank_begin < seg.rank_end,
                  "lora_add_: segments in column order, disjoint, inside the output, and their rank rows in turn");
      column = seg.end;
      rank = seg.rank_end;
      offset += (seg.rank_end - seg.rank_begin) * (seg.end - seg.first);
      args.segments[s].push_back(seg);
    }
    TORCH_CHECK(rank == ranks[s] && offset == ups[s].numel(), "lora_add_: the segments cover the down's rank rows and the up");
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= -1 && slot[t] < adapters, "lora_add_: a slot past the adapters");
  return args;
}

// The plan for the GEMM's threads to run (panel_linear_lora), in the adapters' weight dtype.
std::unique_ptr<LoraWork> lora_plan(const at::Tensor& x, int64_t width, const at::Tensor& slots, at::TensorList downs,
                                    at::TensorList ups, const LoraArgs& args) {
  if (args.weights == at::kBFloat16)
    return std::make_unique<LoraPlan<at::BFloat16>>(x, width, slots, downs, ups, args.segments, args.ranks);
  return std::make_unique<LoraPlan<float>>(x, width, slots, downs, ups, args.segments, args.ranks);
}

void lora_add_(const at::Tensor& out, const at::Tensor& x, const at::Tensor& slots, at::TensorList downs,
               at::TensorList ups, at::TensorList spans) {
  check_rows(out, "lora_add_ out");
  check_rows(x, "lora_add_ x");
  TORCH_CHECK(out.size(0) == x.size(0), "lora_add_: out and x have a row per token");
  const LoraArgs args = check_lora(x.size(0), x.size(1), out.size(1), slots, downs, ups, spans);
  if (args.weights == at::kBFloat16) {
    lora_add_impl<at::BFloat16>(out, x, slots, downs, ups, args.segments, args.ranks);
  } else {
    lora_add_impl<float>(out, x, slots, downs, ups, args.segments, args.ranks);
  }
}

// ---- panel_linear (AVX-512F; bf16 pairs: AVX512-BF16) ----
#define TW_AVX512 __attribute__((target("avx512f")))
#define TW_AVX512_BF16 __attribute__((target("avx512f,avx512bf16")))
constexpr int64_t kPanel = 16;   // output columns per panel
constexpr int kTileRows = 6;     // rows per tile
constexpr int kTilePanels = 4;   // panels per tile

// A panel layout: how a step of the reduction reads x and the weights and accumulates.
// Widened<W>: [out / 16, in, 16] float32 or bf16, one input a step: acc += x[k] * w[k] (an FMA).
// Pairs: [out / 16, in / 2, 32] bf16, two inputs a step, x rounded to bf16 first:
//   acc += x[2k] * w[2k] + x[2k+1] * w[2k+1] (one VDPBF16PS, its own fixed rounding).
// NOTE: the tile functions carry both targets, so only what a layout's own functions emit runs:
// Widened emits no AVX512-BF16 instruction (tests/test_cpu_ops.py reads the library's code for
// that), so its panels run on an AVX-512F CPU without BF16. A second copy per target would lift it.
template <typename W>
struct Widened {
  using Weight = W;
  using X = float;
  using V = __m512;  // 16 weights, float32
  using B = __m512;  // one input, broadcast
  static constexpr int64_t kInputs = 1;
  static TW_AVX512 inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static TW_AVX512 inline V load(const at::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    // The maskz forms, all lanes on: GCC 12 warns that the plain forms' unused source may be uninitialized.
    const __mmask16 all = 0xFFFF;
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, raw), 16));
  }
  static TW_AVX512 inline B broadcast(X x) { return _mm512_set1_ps(x); }
  static TW_AVX512 inline __m512 madd(__m512 acc, B x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

struct Pairs {
  using Weight = at::BFloat16;
  using X = int32_t;   // two bf16 inputs
  using V = __m512bh;  // 16 pairs of weights
  using B = __m512bh;  // one pair of inputs, broadcast
  static constexpr int64_t kInputs = 2;
  static TW_AVX512_BF16 inline V load(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static TW_AVX512_BF16 inline B broadcast(X x) { return (__m512bh)_mm512_set1_epi32(x); }
  static TW_AVX512_BF16 inline __m512 madd(__m512 acc, B x, V w) { return _mm512_dpbf16_ps(acc, x, w); }
};

// RX rows × RP panels: out[r][16p + j] for r < RX, p < RP; `steps` reduction steps; rows `steps`
// apart in x, `n` apart in out and the residual.
template <typename L, int RX, int RP>
TW_AVX512_BF16 void panel_tile(const typename L::X* x, int64_t steps, const typename L::Weight* panels, float* out,
                               int64_t n, const float* bias, const float* residual) {
  constexpr int64_t width = kPanel * L::kInputs;  // weights per panel per step
  __m512 acc[RX][RP];
  for (int r = 0; r < RX; ++r)
    for (int p = 0; p < RP; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t stride = steps * width;
  for (int64_t k = 0; k < steps; ++k) {
    typename L::V w[RP];  // each weight read once per tile, for all its rows
    for (int p = 0; p < RP; ++p) w[p] = L::load(panels + p * stride + k * width);
    for (int r = 0; r < RX; ++r) {
      const typename L::B xb = L::broadcast(x[r * steps + k]);
      for (int p = 0; p < RP; ++p) acc[r][p] = L::madd(acc[r][p], xb, w[p]);
    }
  }
  for (int r = 0; r < RX; ++r)
    for (int p = 0; p < RP; ++p) {
      __m512 v = acc[r][p];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * kPanel));
      if (residual != nullptr) v = _mm512_add_ps(_mm512_loadu_ps(residual + r * n + p * kPanel), v);
      _mm512_storeu_ps(out + r * n + p * kPanel, v);
    }
}

// Every row through RP panels: tiles of kTileRows rows, then one tile of the rest.
template <typename L, int RP>
TW_AVX512_BF16 void panel_columns(const typename L::X* x, int64_t rows, int64_t steps,
                                  const typename L::Weight* panels, float* out, int64_t n, const float* bias,
                                  const float* residual) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    panel_tile<L, kTileRows, RP>(x + r * steps, steps, panels, out + r * n, n, bias, residual ? residual + r * n : nullptr);
  const typename L::X* xr = x + r * steps;
  float* o = out + r * n;
  const float* res = residual ? residual + r * n : nullptr;
  switch (rows - r) {
    case 5: panel_tile<L, 5, RP>(xr, steps, panels, o, n, bias, res); break;
    case 4: panel_tile<L, 4, RP>(xr, steps, panels, o, n, bias, res); break;
    case 3: panel_tile<L, 3, RP>(xr, steps, panels, o, n, bias, res); break;
    case 2: panel_tile<L, 2, RP>(xr, steps, panels, o, n, bias, res); break;
    case 1: panel_tile<L, 1, RP>(xr, steps, panels, o, n, bias, res); break;
    default: break;
  }
}

// The threads split a GEMM's `count` panels (columns), never the rows or the reduction: `columns(p,
// std::integral_constant<int, RP>)` runs panels [p, p + RP), kTilePanels at a time, then the 1-3 left at
// a thread's end, RP a compile-time count for the tile functions' templates.
// `lora` (panel_linear_lora): the adapters' pass, run by the same threads (LoraWork): each takes
// its share of the A items before its panels, and after them adds the B pass to its panels'
// columns of `out`.
template <typename F>
void split_panels(int64_t count, LoraWork* lora, float* out, const F& columns) {
  const int64_t share = lora == nullptr ? 0 : (lora->items() + at::get_num_threads() - 1) / at::get_num_threads();
  at::parallel_for(0, count, kTilePanels, [&](int64_t begin, int64_t end) {
    if (lora != nullptr) lora->take(share);
    for (int64_t p = begin; p < end; p += kTilePanels) {
      const int64_t last = std::min(end, p + kTilePanels);
      switch (last - p) {
        case kTilePanels: columns(p, std::integral_constant<int, kTilePanels>{}); break;
        case 3: columns(p, std::integral_constant<int, 3>{}); break;
        case 2: columns(p, std::integral_constant<int, 2>{}); break;
        case 1: columns(p, std::integral_constant<int, 1>{}); break;
        default: break;
      }
    }
    if (lora != nullptr) {
      lora->finish();
      lora->b_columns(out, begin * kPanel, end * kPanel);
    }
  });
}

template <typename L>
void panel_linear_impl(const typename L::X* x, int64_t rows, int64_t steps, const typename L::Weight* panels,
                       int64_t n, float* out, const float* bias, const float* residual, LoraWork* lora) {
  const int64_t per_panel = steps * kPanel * L::kInputs;
  split_panels(n / kPanel, lora, out, [&](int64_t p, auto panels_here) {
    panel_columns<L, decltype(panels_here)::value>(x, rows, steps, panels + p * per_panel, out + p * kPanel, n,
                                                   bias ? bias + p * kPanel : nullptr,
                                                   residual ? residual + p * kPanel : nullptr);
  });
}

// ---- panel_linear on 8-bit weights (AVX-512BW + VNNI) ----
// Weight-only int8: each weight an unsigned byte q with a zero point z and a scale s per 16
// columns' group of `group` inputs (W[c][k] ≈ s·(q − z)), held with the panels: [out / 16,
// groups, 16·group + 48] bytes, per panel and group the weights as 16-bit pairs' bytes (input
// pair k2, column c: q[c][2k2], q[c][2k2 + 1]), then 16 zero points (u8), then 16 scales (f16:
// 1.19 bytes a weight at groups of 16, where f32 scales took 1.31; a step at one row reads them
// all, so it is that much shorter).
// A row's inputs are rounded once to int16 on one scale for the row (max |x| / 32767), its sums
// per group kept. Each output element: per group an exact int32 sum Σ x̂·q (VPDPWSSD, two
// inputs at a time) minus z·Σ x̂, converted and taken times s into one float32 accumulator,
// group after group in order; then times the row's scale, plus the bias and the residual. The
// same arithmetic for a row whatever the tile, the thread or the other rows (batch invariance).
#define TW_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
constexpr int64_t kW8Meta = 16 + 16 * 2;  // per panel and group: 16 u8 zero points, 16 f16 scales
constexpr int kW8TileRows = 3;             // rows per tile (3 × 4 panels × 2 accumulators: 24 registers)

struct W8Rows {
  const int16_t* x;     // [rows, in], rounded
  const int32_t* sums;  // [rows, groups]: Σ x̂ over each group
  const float* scale;   // [rows]
  int64_t in, groups, group;
};

template <int RX, int RP>
TW_AVX512_VNNI void w8_tile(const W8Rows& x, int64_t r0, const uint8_t* panels, int64_t stride, float* out, int64_t n,
                            const float* bias, const float* residual) {
  const int64_t block = 16 * x.group + kW8Meta, pairs = x.group / 2;
  __m512 acc[RX][RP];
  for (int r = 0; r < RX; ++r)
    for (int p = 0; p < RP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    const uint8_t* base = panels + g * block;
    __m512i dot[RX][RP];
    for (int r = 0; r < RX; ++r)
      for (int p = 0; p < RP; ++p) dot[r][p] = _mm512_setzero_si512();
    for (int64_t k2 = 0; k2 < pairs; ++k2) {
      __m512i w[RP];  // each weight widened once per tile, for all its rows
      for (int p = 0; p < RP; ++p)
        w[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + p * stride + k2 * 32)));
      for (int r = 0; r < RX; ++r) {
        int32_t two;
        std::memcpy(&two, x.x + (r0 + r) * x.in + g * x.group + 2 * k2, sizeof(two));
        const __m512i xb = _mm512_set1_epi32(two);
        for (int p = 0; p < RP; ++p) dot[r][p] = _mm512_dpwssd_epi32(dot[r][p], xb, w[p]);
      }
    }
    for (int p = 0; p < RP; ++p) {
      const uint8_t* meta = base + p * stride + 16 * x.group;
      const __mmask16 all = 0xFFFF;  // the maskz forms: GCC 12 warns of the plain forms' unused source (as Widened)
      const __m512i z = _mm512_maskz_cvtepu8_epi32(all, _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta)));
      const __m512 s = _mm512_maskz_cvtph_ps(all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 16)));
      for (int r = 0; r < RX; ++r) {
        const __m512i exact = _mm512_sub_epi32(dot[r][p], _mm512_mullo_epi32(z, _mm512_set1_epi32(x.sums[(r0 + r) * x.groups + g])));
        acc[r][p] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(all, exact), s, acc[r][p]);
      }
    }
  }
  for (int r = 0; r < RX; ++r) {
    const __m512 xs = _mm512_set1_ps(x.scale[r0 + r]);
    for (int p = 0; p < RP; ++p) {
      __m512 v = _mm512_mul_ps(acc[r][p], xs);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * kPanel));
      if (residual != nullptr) v = _mm512_add_ps(_mm512_loadu_ps(residual + (r0 + r) * n + p * kPanel), v);
      _mm512_storeu_ps(out + (r0 + r) * n + p * kPanel, v);
    }
  }
}

template <int RP>
TW_AVX512_VNNI void w8_columns(const W8Rows& x, int64_t rows, const uint8_t* panels, int64_t stride, float* out, int64_t n,
                               const float* bias, const float* residual) {
  int64_t r = 0;
  for (; r + kW8TileRows <= rows; r += kW8TileRows) w8_tile<kW8TileRows, RP>(x, r, panels, stride, out, n, bias, residual);
  switch (rows - r) {
    case 2: w8_tile<2, RP>(x, r, panels, stride, out, n, bias, residual); break;
    case 1: w8_tile<1, RP>(x, r, panels, stride, out, n, bias, residual); break;
    default: break;
  }
}

// A row's inputs rounded to int16 on the row's own scale, and their sums per group.
void w8_round_rows(const float* x, int64_t rows, int64_t in, int64_t group, int16_t* q, int32_t* sums, float* scale) {
  const int64_t groups = in / group;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    float top = 0.f;
    for (int64_t i = 0; i < in; ++i) top = std::max(top, std::fabs(xr[i]));
    const float inv = top > 0.f ? 32767.f / top : 0.f;
    scale[r] = top / 32767.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        const int16_t v = static_cast<int16_t>(std::nearbyint(xr[i] * inv));
        q[r * in + i] = v;
        sum += v;
      }
      sums[r * groups + g] = sum;
    }
  }
}

void w8_linear_impl(const float* x, int64_t rows, int64_t in, int64_t group, const uint8_t* panels, int64_t n, float* out,
                    const float* bias, const float* residual, LoraWork* lora) {
  const int64_t groups = in / group, stride = groups * (16 * group + kW8Meta), count = n / kPanel;
  std::vector<int16_t> q(rows * in);
  std::vector<int32_t> sums(rows * groups);
  std::vector<float> scale(rows);
  w8_round_rows(x, rows, in, group, q.data(), sums.data(), scale.data());
  const W8Rows xr{q.data(), sums.data(), scale.data(), in, groups, group};
  split_panels(count, lora, out, [&](int64_t p, auto panels_here) {
    w8_columns<decltype(panels_here)::value>(xr, rows, panels + p * stride, stride, out + p * kPanel, n,
                                             bias ? bias + p * kPanel : nullptr, residual ? residual + p * kPanel : nullptr);
  });
}

bool cpu_has_avx512vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

bool cpu_has_avx512f() { return __builtin_cpu_supports("avx512f"); }
bool cpu_has_avx512bf16() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"); }

at::Tensor panel_linear_run(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, LoraWork* lora) {
  TORCH_CHECK(cpu_has_avx512f(), "panel_linear: this CPU lacks AVX-512F");
  check_rows(x, "panel_linear x");
  // The layout: 8-bit weights [out / 16, groups, 16 · group + 48], bf16 pairs, or one weight a step.
  const bool bytes = panels.scalar_type() == at::kByte;
  const bool pairs = !bytes && panels.dim() == 3 && panels.size(2) == 2 * kPanel;
  int64_t panel_inputs = 0, group = 0;
  if (bytes) {
    TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) > kW8Meta && (panels.size(2) - kW8Meta) % 32 == 0,
                "panel_linear 8-bit panels: a contiguous uint8 [out / 16, groups, 16 · group + 48] tensor, group even");
    group = (panels.size(2) - kW8Meta) / 16;
    panel_inputs = panels.size(1) * group;
  } else {
    TORCH_CHECK(panels.dim() == 3 && (panels.size(2) == kPanel || pairs) && panels.is_contiguous() &&
                    (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16),
                "panel_linear panels: a contiguous float32 or bf16 [out / 16, in, 16] tensor, or bf16 pairs [out / 16, in / 2, 32]");
    TORCH_CHECK(!pairs || panels.scalar_type() == at::kBFloat16, "panel_linear: pairs [out / 16, in / 2, 32] are bf16");
    panel_inputs = pairs ? 2 * panels.size(1) : panels.size(1);
  }
  const int64_t rows = x.size(0), k_len = x.size(1), n = panels.size(0) * kPanel;
  TORCH_CHECK(panel_inputs == k_len, "panel_linear: x has ", k_len, " columns, the ", bytes ? "8-bit " : "", "panels ",
              panel_inputs);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "panel_linear bias: float32 [out]");
  }
  if (residual.has_value()) {
    check_rows(*residual, "panel_linear residual");
    TORCH_CHECK(residual->size(0) == rows && residual->size(1) == n, "panel_linear residual: [rows, out]");
  }
  // The arguments first (the caller's mistake reads the same on every host), then what this CPU runs.
  TORCH_CHECK(!bytes || cpu_has_avx512vnni(), "panel_linear: 8-bit weights need AVX-512BW and AVX512-VNNI, which this CPU lacks");
  TORCH_CHECK(!pairs || cpu_has_avx512bf16(), "panel_linear: bf16 pairs need AVX512-BF16, which this CPU lacks");
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* res = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  if (bytes) {
    w8_linear_impl(x.data_ptr<float>(), rows, k_len, group, panels.data_ptr<uint8_t>(), n, out.data_ptr<float>(), b, res,
                   lora);
  } else if (pairs) {
    const at::Tensor rounded = x.to(at::kBFloat16);  // round to nearest even, as oneDNN's bf16 GEMM reads it
    const auto* xp = reinterpret_cast<const int32_t*>(rounded.data_ptr<at::BFloat16>());
    panel_linear_impl<Pairs>(xp, rows, k_len / 2, panels.data_ptr<at::BFloat16>(), n, out.data_ptr<float>(), b, res, lora);
  } else if (panels.scalar_type() == at::kBFloat16) {
    panel_linear_impl<Widened<at::BFloat16>>(x.data_ptr<float>(), rows, k_len, panels.data_ptr<at::BFloat16>(), n,
                                             out.data_ptr<float>(), b, res, lora);
  } else {
    panel_linear_impl<Widened<float>>(x.data_ptr<float>(), rows, k_len, panels.data_ptr<float>(), n,
                                      out.data_ptr<float>(), b, res, lora);
  }
  return out;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  return panel_linear_run(x, panels, bias, residual, nullptr);
}

// The shape and dtype panel_linear gives, [rows, out] float32, for torch.compile's fake tensors:
// `--compile-step` traces a step whose int8 layers are the 8-bit panels (its float layers are plain).
at::Tensor panel_linear_meta(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& /*bias*/,
                             const std::optional<at::Tensor>& /*residual*/) {
  return at::empty({x.size(0), panels.size(0) * kPanel}, x.options().dtype(at::kFloat));
}

// panel_linear, then lora_add_ on its output: one call where the native pass makes two at each
// GEMM an adapter adapts (~120 a decode step), the adapters' pass run by the GEMM's own threads
// (split_panels), so it neither wakes the pool again nor reads its weights on one thread. The
// same bits as the two calls.
at::Tensor panel_linear_lora(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, const at::Tensor& slots, at::TensorList downs,
                             at::TensorList ups, at::TensorList spans) {
  check_rows(x, "panel_linear x");
  const int64_t width = panels.dim() == 3 ? panels.size(0) * kPanel : 0;
  const LoraArgs args = check_lora(x.size(0), x.size(1), width, slots, downs, ups, spans);
  const std::unique_ptr<LoraWork> lora = lora_plan(x, width, slots, downs, ups, args);
  return panel_linear_run(x, panels, bias, residual, lora->items() > 0 ? lora.get() : nullptr);
}

// decoder_layers: every decoder layer of a step in one call, on the compiled ops and the panels:
// per layer, rms_norm -> q/k/v GEMM -> rope_ on q and k -> store_kv -> decode_attention -> o GEMM
// plus the residual -> rms_norm -> gate/up GEMM -> silu_mul -> down GEMM plus the residual: the
// calls the native pass makes from Python one by one (~17 a layer with the views between them),
// made here with the same functions in the same order, so the same bits. `biases`: four per
// layer (q/k/v, o, gate/up, down), an empty tensor where a GEMM has none. LoRA: `slots` (one per
// token, as lora_add_ takes them; empty: no adapter in the step) and lora_add_'s lists for each
// GEMM in turn (layer by layer, the four GEMMs in that order), `adapters` entries each: where
// some adapter adapts a GEMM, it runs as panel_linear_lora.
at::Tensor decoder_layers(const at::Tensor& hidden_in, at::TensorList input_norms, at::TensorList qkvs, at::TensorList outs,
                          at::TensorList post_norms, at::TensorList gate_ups, at::TensorList downs, at::TensorList biases,
                          at::TensorList keys, at::TensorList values, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& blocks, const at::Tensor& offsets, const at::Tensor& tables,
                          const at::Tensor& lengths, double eps, double scale, int64_t heads, int64_t kv_heads,
                          int64_t intermediate, const at::Tensor& slots, at::TensorList lora_downs, at::TensorList lora_ups,
                          at::TensorList lora_spans, int64_t adapters) {
  const size_t layers = input_norms.size();
  TORCH_CHECK(qkvs.size() == layers && outs.size() == layers && post_norms.size() == layers && gate_ups.size() == layers &&
                  downs.size() == layers && keys.size() == layers && values.size() == layers && biases.size() == 4 * layers,
              "decoder_layers: one of each weight, keys and values per layer, four biases per layer");
  const bool lora = slots.numel() > 0;
  const size_t per_gemm = lora ? static_cast<size_t>(adapters) : 0;
  TORCH_CHECK(!lora || (adapters > 0 && lora_downs.size() == 4 * layers * per_gemm && lora_ups.size() == lora_downs.size() &&
                        lora_spans.size() == lora_downs.size()),
              "decoder_layers: lora_add_'s lists for each of the four GEMMs of each layer, `adapters` entries each");
  // One GEMM of layer i (gemm: 0 q/k/v, 1 o, 2 gate/up, 3 down), with its adapters where any adapts it.
  auto gemm = [&](size_t i, size_t which, const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual) -> at::Tensor {
    if (lora) {
      const size_t first = (4 * i + which) * per_gemm;
      const at::TensorList d = lora_downs.slice(first, per_gemm), u = lora_ups.slice(first, per_gemm),
                           sp = lora_spans.slice(first, per_gemm);
      if (std::any_of(d.begin(), d.end(), [](const at::Tensor& t) { return t.numel() > 0; }))
        return panel_linear_lora(x, panels, bias, residual, slots, d, u, sp);
    }
    return panel_linear_run(x, panels, bias, residual, nullptr);
  };
  check_rows(hidden_in, "decoder_layers hidden");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) % 2 == 0, "decoder_layers cos: [tokens, head dim]");
  const int64_t tokens = hidden_in.size(0), dim = cos.size(1);
  auto bias = [&](size_t layer, size_t gemm) -> std::optional<at::Tensor> {
    const at::Tensor& b = biases[4 * layer + gemm];
    return b.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(b);
  };
  at::Tensor hidden = hidden_in;
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor normed = rms_norm(hidden, input_norms[i], eps);
    at::Tensor qkv = gemm(i, 0, normed, qkvs[i], bias(i, 0), std::nullopt);
    TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "decoder_layers: q/k/v GEMM width is (heads + 2 kv_heads) x head dim");
    at::Tensor qk = qkv.narrow(1, 0, (heads + kv_heads) * dim).view({tokens, heads + kv_heads, dim});
    rope_(qk, cos, sin);
    store_kv(qkv, keys[i], values[i], blocks, offsets, heads);
    at::Tensor attended = decode_attention(qk.narrow(1, 0, heads).contiguous(), keys[i], values[i], tables, lengths, scale)
                              .reshape({tokens, heads * dim});
    hidden = gemm(i, 1, attended, outs[i], bias(i, 1), hidden);
    normed = rms_norm(hidden, post_norms[i], eps);
    at::Tensor gate_up = gemm(i, 2, normed, gate_ups[i], bias(i, 2), std::nullopt);
    hidden = gemm(i, 3, silu_mul(gate_up, intermediate), downs[i], bias(i, 3), hidden);
  }
  return hidden;
}

// ---- The sampler's passes over a step's logits ([rows, vocab] float32, no NaN in row_top and
// near: the sampler's rows are overflow-safe), one pass each where torch's topk, argmax, compare,
// nonzero and gathers take one or several (sampling.py: RowOps). Row by row: a row's result never
// depends on the others.

// row_top: each row's k largest values and their ids, in no order; of the values tied with the
// k-th largest, any. A buffer holds the best seen so far; a value enters only above its threshold
// (the k-th largest it kept at its last cut), and a full buffer is cut back to its k largest.
// Every value above the row's k-th largest enters, and once k values at or above it are held,
// every cut keeps k of them: the result is a top k.
std::tuple<at::Tensor, at::Tensor> row_top(const at::Tensor& x, int64_t k) {
  check_rows(x, "row_top x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "row_top: k must be in [1, columns]");
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor ids = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    using Entry = std::pair<float, int64_t>;
    const auto larger = [](const Entry& a, const Entry& b) { return a.first > b.first; };
    std::vector<Entry> held;
    held.reserve(static_cast<size_t>(4 * k + 8));
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * n;
      held.clear();
      for (int64_t i = 0; i < k; ++i) held.emplace_back(row[i], i);
      float floor = std::min_element(held.begin(), held.end(), [](const Entry& a, const Entry& b) { return a.first < b.first; })->first;
      const auto take = [&](int64_t i) {
        held.emplace_back(row[i], i);
        if (static_cast<int64_t>(held.size()) >= 4 * k) {
          std::nth_element(held.begin(), held.begin() + (k - 1), held.end(), larger);
          held.resize(static_cast<size_t>(k));
          floor = held[static_cast<size_t>(k - 1)].first;
        }
      };
      int64_t i = k;
      for (; i + 8 <= n; i += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), _mm256_set1_ps(floor), _CMP_GT_OQ));
        while (mask) {
          const int j = __builtin_ctz(static_cast<unsigned>(mask));
          mask &= mask - 1;
          if (row[i + j] > floor) take(i + j);  // the floor may have risen within these 8
        }
      }
      for (; i < n; ++i)
        if (row[i] > floor) take(i);
      std::nth_element(held.begin(), held.begin() + (k - 1), held.end(), larger);
      for (int64_t j = 0; j < k; ++j) {
        vp[r * k + j] = held[static_cast<size_t>(j)].first;
        ip[r * k + j] = held[static_cast<size_t>(j)].second;
      }
    }
  });
  return {values, ids};
}

// row_argmax: each row's first index of its largest value, as torch.argmax takes it (a NaN
// counts as the largest: the first NaN).
at::Tensor row_argmax(const at::Tensor& x) {
  check_rows(x, "row_argmax x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n >= 1, "row_argmax: a row of no columns");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * n;
      __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      __m256 nan = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        best = _mm256_max_ps(best, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, best);
      float top = lanes[0];
      for (int j = 1; j < 8; ++j) top = std::max(top, lanes[j]);
      bool any_nan = _mm256_movemask_ps(nan) != 0;
      for (int64_t t = i; t < n; ++t) {
        any_nan |= std::isnan(row[t]);
        top = std::max(top, row[t]);
      }
      int64_t at = 0;
      if (any_nan) {
        while (!std::isnan(row[at])) ++at;
      } else {
        while (row[at] != top) ++at;
      }
      op[r] = at;
    }
  });
  return out;
}

// noise_uniform: the uniform numbers under the sampler's Gumbel noise (sampling.py: noise_at) for
// token ids [rows or 1, n] and each row's two keys [rows, 2] (int64 values below 2^32):
// ((mix32(mix32(id ^ k0) ^ k1) >> 9) + 0.5) / 2^23, the same bits as its int64 tensor ops give
// (a product of 32-bit values mod 2^32, and exact float32 arithmetic), in one pass.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x5A6CA68Bu;
  x ^= x >> 16;
  x *= 0x2C1B3C6Du;
  return x ^ (x >> 15);
}

inline float uniform_of(int64_t id, int64_t k0, int64_t k1) {
  const uint32_t bits = mix32(mix32(static_cast<uint32_t>(id) ^ static_cast<uint32_t>(k0)) ^ static_cast<uint32_t>(k1)) >> 9;
  return (static_cast<float>(bits) + 0.5f) * (1.0f / 8388608.0f);
}

at::Tensor noise_uniform(const at::Tensor& keys, const at::Tensor& ids) {
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == 2 && keys.scalar_type() == at::kLong && keys.is_contiguous(),
              "noise_uniform keys: a contiguous int64 [rows, 2] tensor");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                  (ids.size(0) == keys.size(0) || ids.size(0) == 1),
              "noise_uniform ids: a contiguous int64 [rows or 1, n] tensor");
  const int64_t rows = keys.size(0), n = ids.size(1), id_stride = ids.size(0) == 1 ? 0 : n;
  at::Tensor out = at::empty({rows, n}, keys.options().dtype(at::kFloat));
  const int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end;) {
      const int64_t r = e / n, stop = std::min(end, (r + 1) * n);
      const int64_t* row_ids = ip + r * id_stride;
      for (; e < stop; ++e) op[e] = uniform_of(row_ids[e - r * n], kp[2 * r], kp[2 * r + 1]);
    }
  });
  return out;
}

// near: the tokens of each row at or above its floor (x[row][column] >= floors[row]), row by row and
// each row's columns in order, as (rows, columns, their values, their noise's uniform numbers as
// noise_uniform gives them, for keys[row]); and each row's count of them. A row with more than
// `most` emits none (the sampler takes the whole row's noise there): its count says so.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> near(const at::Tensor& x, const at::Tensor& keys,
                                                                               const at::Tensor& floors, int64_t most) {
  check_rows(x, "near x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(floors.dim() == 1 && floors.size(0) == rows && floors.scalar_type() == at::kFloat && floors.is_contiguous(),
              "near floors: a contiguous float32 [rows] tensor");
  TORCH_CHECK(keys.dim() == 2 && keys.size(0) == rows && keys.size(1) == 2 && keys.scalar_type() == at::kLong && keys.is_contiguous(),
              "near keys: a contiguous int64 [rows, 2] tensor");
  const float* xp = x.data_ptr<float>();
  const float* fp = floors.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  at::Tensor counts = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* np = counts.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * n;
      const __m256 floor = _mm256_set1_ps(fp[r]);
      int64_t c = 0, i = 0;
      for (; i + 8 <= n; i += 8)
        c += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), floor, _CMP_GE_OQ))));
      for (; i < n; ++i) c += row[i] >= fp[r];
      np[r] = c;
    }
  });
  std::vector<int64_t> starts(static_cast<size_t>(rows + 1), 0);
  for (int64_t r = 0; r < rows; ++r) starts[static_cast<size_t>(r + 1)] = starts[static_cast<size_t>(r)] + (np[r] > most ? 0 : np[r]);
  const int64_t total = starts[static_cast<size_t>(rows)];
  at::Tensor out_rows = at::empty({total}, x.options().dtype(at::kLong));
  at::Tensor out_cols = at::empty({total}, x.options().dtype(at::kLong));
  at::Tensor values = at::empty({total}, x.options());
  at::Tensor uniforms = at::empty({total}, x.options());
  int64_t* rp = out_rows.data_ptr<int64_t>();
  int64_t* cp = out_cols.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  float* up = uniforms.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (np[r] > most) continue;
      const float* row = xp + r * n;
      const float floor = fp[r];
      int64_t o = starts[static_cast<size_t>(r)], i = 0;
      const auto emit = [&](int64_t column) {
        rp[o] = r;
        cp[o] = column;
        vp[o] = row[column];
        up[o++] = uniform_of(column, kp[2 * r], kp[2 * r + 1]);
      };
      for (; i + 8 <= n; i += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), _mm256_set1_ps(floor), _CMP_GE_OQ));
        while (mask) {
          const int j = __builtin_ctz(static_cast<unsigned>(mask));
          mask &= mask - 1;
          emit(i + j);
        }
      }
      for (; i < n; ++i)
        if (row[i] >= floor) emit(i);
    }
  });
  return {out_rows, out_cols, values, uniforms, counts};
}

}  // namespace

TORCH_LIBRARY(tokenwire, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor tables, Tensor lengths, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up, int intermediate) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor slots, Tensor[] downs, Tensor[] ups, Tensor[] spans) -> ()");
  m.def("decoder_layers(Tensor hidden, Tensor[] input_norms, Tensor[] qkvs, Tensor[] outs, Tensor[] post_norms, Tensor[] gate_ups, Tensor[] downs, Tensor[] biases, Tensor[] keys, Tensor[] values, Tensor cos, Tensor sin, Tensor blocks, Tensor offsets, Tensor tables, Tensor lengths, float eps, float scale, int heads, int kv_heads, int intermediate, Tensor slots, Tensor[] lora_downs, Tensor[] lora_ups, Tensor[] lora_spans, int adapters) -> Tensor");
  m.def("panel_linear_lora(Tensor x, Tensor panels, Tensor? bias, Tensor? residual, Tensor slots, Tensor[] downs, Tensor[] ups, Tensor[] spans) -> Tensor");
  m.def("store_kv(Tensor qkv, Tensor(a!) keys, Tensor(b!) values, Tensor blocks, Tensor offsets, int heads) -> ()");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("row_top(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("row_argmax(Tensor x) -> Tensor");
  m.def("noise_uniform(Tensor keys, Tensor ids) -> Tensor");
  m.def("near(Tensor x, Tensor keys, Tensor floors, int most) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("cpu_has_avx512f() -> bool", &cpu_has_avx512f);
  m.def("cpu_has_avx512bf16() -> bool", &cpu_has_avx512bf16);
  m.def("cpu_has_avx512vnni() -> bool", &cpu_has_avx512vnni);
}

TORCH_LIBRARY_IMPL(tokenwire, Meta, m) { m.impl("panel_linear", &panel_linear_meta); }

TORCH_LIBRARY_IMPL(tokenwire, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("store_kv", &store_kv);
  m.impl("lora_add_", &lora_add_);
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_lora", &panel_linear_lora);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("row_top", &row_top);
  m.impl("row_argmax", &row_argmax);
  m.impl("noise_uniform", &noise_uniform);
  m.impl("near", &near);
}
