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
// A row's result never depends on the other rows: the work is split over rows only.
//
// Built with -mavx2 -mfma by kernels/__init__.py, loaded only where the CPU has both.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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

}  // namespace

TORCH_LIBRARY(tokenwire, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor tables, Tensor lengths, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up, int intermediate) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("store_kv(Tensor qkv, Tensor(a!) keys, Tensor(b!) values, Tensor blocks, Tensor offsets, int heads) -> ()");
}

TORCH_LIBRARY_IMPL(tokenwire, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("store_kv", &store_kv);
}
