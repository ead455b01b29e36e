// Few-row linear y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 or fp32, that streams W once.
//
// Built on first use by kernels/small_m_gemv.py (torch.utils.cpp_extension.load_inline,
// -mavx512f -mavx512bf16); loading the library registers the CPU kernel of the op
// specc::small_m_linear (defined in Python, whose CompositeExplicitAutograd kernel is the
// plain-torch reference used until then and on CPUs without AVX512_BF16).
//
// Algorithm: W's rows are dot products against the M input rows. For a block of NB
// consecutive output features n the kernel walks K in chunks of 32 bf16 (one cache line
// of each W row): it loads the NB W chunks once, and for every input row m (M <= 16,
// the rows stay in L1) accumulates vdpbf16ps(W chunk, x chunk) into an fp32 16-lane
// accumulator acc[j][m] (a pair of K per lane). NB * M accumulators live in registers
// (NB = 8 / 4 / 2 / 1 for M <= 2 / 4 / 8 / 16). A K tail (K % 32 != 0, odd K included)
// is a masked, zero-filled load of both operands. After the K loop each accumulator is
// summed across lanes, the bias added in fp32 and the result rounded once to bf16.
// The W block is contiguous (NB rows of K), so the stream is sequential; a software
// prefetch PREFETCH_BYTES ahead of each row's chunk keeps loads in flight. Blocks of
// n are split across threads with at::parallel_for (one thread: serial).
//
// That AVX512_BF16 loop is compute-bound from M = 2 on (vdpbf16ps runs ~0.9 G/s on a
// shared Emerald Rapids core: 16 x M MACs per instruction per 32 weights), so where the
// CPU and OS allow AMX (arch_prctl XTILEDATA) and K % 32 == 0, 16-row blocks of W go
// through AMX instead: W's rows are the A tile as they lie in memory (16 rows x 32 bf16,
// stride K), x is repacked once per call into the B tile's pair layout
// (xp[k / 2][m][2] = x[m][k, k + 1], M padded to 16 with zeros), and TDPBF16PS
// accumulates C[n][m] (16 x 16 fp32) for four blocks (64 rows of W) at a time, with a
// prefetch of the next 64 rows' chunk. Rows left over (N % 16) take the AVX512 loop.
// SPECC_GEMV_ISA=avx512 (read once) turns AMX off.
//
// fp32 (block_f32 / rows_f32): the AVX512 walk with FMAs, K in chunks of 16 floats.
// Rows are split into groups of <= 6 run one after another against the same NB = 4
// weight rows (8 for M <= 2) while those sit in L1, so W is read from memory once and
// a group's accumulators fit the registers. Lane sums are done 16 accumulators at a
// time (hsum16), in an order that does not depend on the accumulator's position, so a
// row's result is the same whatever the other rows are. Each W row's chunk gets a
// prefetch into L2 8 KiB ahead and into L1 512 B ahead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t PREFETCH_BYTES = 1024;
constexpr int64_t MAX_ROWS = 16;      // bf16 (AMX: x is one 16-column B tile)
constexpr int64_t MAX_ROWS_F32 = 40;  // fp32: row groups of <= 6; faster than MKL measured up to 40 rows
// fp32 prefetch distances ahead of each W row's chunk, bytes (tuned on SmolLM2's shapes,
// one thread: 8192/512 beat 1024 into L1 only by 1.2x at M = 5, docs/compile.md)
constexpr int64_t F32_PREFETCH_L2 = 8192, F32_PREFETCH_L1 = 512;

inline __m512bh load_bf16(const at::BFloat16* p, __mmask32 mask, bool full) {
  __m512i v = full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask, p);
  return (__m512bh)v;
}

inline uint16_t to_bf16_bits(float f) {  // round to nearest even, like c10::BFloat16
  return c10::BFloat16(f).x;
}

// NB output features x M rows, K in chunks of 32.
template <int M, int NB>
inline void block(const at::BFloat16* __restrict x, const at::BFloat16* __restrict w, const at::BFloat16* bias,
                  at::BFloat16* __restrict y, int64_t n0, int64_t N, int64_t K) {
  __m512 acc[NB][M];
#pragma GCC unroll 16
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  const at::BFloat16* wb = w + n0 * K;
  const int64_t kfull = K / 32 * 32;
  for (int64_t k = 0; k < K; k += 32) {
    const bool full = k < kfull;
    const __mmask32 mask = full ? ~__mmask32(0) : (__mmask32)((1ull << (K - k)) - 1);
    __m512bh wv[NB];
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      const char* p = reinterpret_cast<const char*>(wb + j * K + k);
      _mm_prefetch(p + PREFETCH_BYTES, _MM_HINT_T0);
      wv[j] = load_bf16(wb + j * K + k, mask, full);
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_bf16(x + m * K + k, mask, full);
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv[j], xv);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NB; ++j) {
    const float b = bias ? static_cast<float>(bias[n0 + j]) : 0.f;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const float s = _mm512_reduce_add_ps(acc[j][m]) + b;
      reinterpret_cast<uint16_t*>(y)[m * N + n0 + j] = to_bf16_bits(s);
    }
  }
}

// output features [n_begin, N) for M rows
template <int M>
void rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y, int64_t N,
          int64_t K, int64_t n_begin) {
  constexpr int NB = M <= 2 ? 8 : M <= 4 ? 4 : M <= 8 ? 2 : 1;
  const int64_t nblocks = (N - n_begin) / NB;
  // grain: ~64 KiB of W per task
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (NB * K * 2 + 1));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<M, NB>(x, w, bias, y, n_begin + b * NB, N, K);
  });
  for (int64_t n = n_begin + nblocks * NB; n < N; ++n) block<M, 1>(x, w, bias, y, n, N, K);
}

using RowsFn = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, at::BFloat16*, int64_t,
                        int64_t, int64_t);

template <int... Ms>
constexpr auto table(std::integer_sequence<int, Ms...>) {
  return std::array<RowsFn, sizeof...(Ms)>{&rows<Ms + 1>...};
}


// ---- fp32: the same walk with FMAs, K in chunks of 16 floats (one cache line) ---------
// Lane sums of 16 vectors at once: out[i] = sum of v[i]'s lanes (a transpose-and-add tree,
// 45 shuffles/adds for 16 sums where 16 _mm512_reduce_add_ps take ~130).
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a, b, c, d] partial sums
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: [s0-3, s0-3, s4-7, s4-7] (+ i * 8)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

template <int M, int NB>
inline void block_f32(const float* __restrict x, const float* __restrict w, const float* bias, float* __restrict y,
                      int64_t n0, int64_t N, int64_t K) {
  __m512 acc[NB][M];
#pragma GCC unroll 16
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  const float* wb = w + n0 * K;
  const int64_t kfull = K / 16 * 16;
  for (int64_t k = 0; k < K; k += 16) {
    const bool full = k < kfull;
    const __mmask16 mask = full ? __mmask16(0xFFFF) : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[NB];
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      const float* p = wb + j * K + k;
      // far into L2 (the fill buffers of L1 alone cannot cover the latency), near into L1
      _mm_prefetch(reinterpret_cast<const char*>(p) + F32_PREFETCH_L2, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p) + F32_PREFETCH_L1, _MM_HINT_T0);
      wv[j] = full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask, p);
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const float* q = x + m * K + k;
      const __m512 xv = full ? _mm512_loadu_ps(q) : _mm512_maskz_loadu_ps(mask, q);
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_fmadd_ps(wv[j], xv, acc[j][m]);
    }
  }
  constexpr int A = NB * M, G = (A + 15) / 16;
  const __m512* flat = &acc[0][0];
  alignas(64) float sums[G * 16];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    __m512 v[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) v[i] = g * 16 + i < A ? flat[g * 16 + i] : _mm512_setzero_ps();
    _mm512_store_ps(sums + g * 16, hsum16(v));
  }
#pragma GCC unroll 16
  for (int j = 0; j < NB; ++j) {
    const float b = bias ? bias[n0 + j] : 0.f;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) y[m * N + n0 + j] = sums[j * M + m] + b;
  }
}

// Row groups: M rows are split into groups of at most 6 (as even as possible), each run
// against the same NB rows of W while they sit in L1: W is read from memory once, and a
// group's NB * MG accumulators + NB weight vectors + one x vector fit the 32 zmm registers.
constexpr int F32_GROUP = 6;

template <int NB>
void rows_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  using Fn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t);
  static const Fn fns[F32_GROUP] = {&block_f32<1, NB>, &block_f32<2, NB>, &block_f32<3, NB>,
                                    &block_f32<4, NB>, &block_f32<5, NB>, &block_f32<6, NB>};
  const int64_t groups = (M + F32_GROUP - 1) / F32_GROUP;
  const int64_t nblocks = N / NB;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (NB * K * 4 + 1));
  auto run = [&](int64_t n, auto&& fn_of) {
    for (int64_t g = 0, m0 = 0; g < groups; ++g) {
      const int64_t mg = (M - m0) / (groups - g);  // even split, the larger groups last
      fn_of(mg)(x + m0 * K, w, bias, y + m0 * N, n, N, K);
      m0 += mg;
    }
  };
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) run(b * NB, [](int64_t mg) { return fns[mg - 1]; });
  });
  static const Fn tail[F32_GROUP] = {&block_f32<1, 1>, &block_f32<2, 1>, &block_f32<3, 1>,
                                     &block_f32<4, 1>, &block_f32<5, 1>, &block_f32<6, 1>};
  for (int64_t n = nblocks * NB; n < N; ++n) run(n, [](int64_t mg) { return tail[mg - 1]; });
}

// ---- AMX: 16-row blocks of W against all M rows at once ----------------------------
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_usable() {
  const char* isa = std::getenv("SPECC_GEMV_ISA");
  if (isa && std::strcmp(isa, "avx512") == 0) return false;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return __builtin_cpu_supports("avx512f") && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

__attribute__((target("amx-tile,amx-bf16"))) void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

inline void write_block(const float* c, int M, const at::BFloat16* bias, at::BFloat16* y, int64_t n0, int64_t N) {
  // c: [16 rows n][16 cols m] fp32
  for (int r = 0; r < 16; ++r) {
    const float b = bias ? static_cast<float>(bias[n0 + r]) : 0.f;
    for (int m = 0; m < M; ++m) reinterpret_cast<uint16_t*>(y)[m * N + n0 + r] = to_bf16_bits(c[r * 16 + m] + b);
  }
}

// rows [n_begin, n_end) of W (a multiple of 16), xp the packed x
__attribute__((target("amx-tile,amx-bf16"))) void amx_rows(const at::BFloat16* xp, const at::BFloat16* w,
                                                            const at::BFloat16* bias, at::BFloat16* y, int M,
                                                            int64_t n_begin, int64_t n_end, int64_t N, int64_t K) {
  configure_tiles();
  alignas(64) float c[4][256];
  const int64_t ldw = K * 2;  // bytes
  int64_t n0 = n_begin;
  for (; n0 + 64 <= n_end; n0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const at::BFloat16* wb = w + n0 * K;
    const bool prefetch = n0 + 128 <= n_end;
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, xp + k * 16, 64);
      _tile_loadd(5, wb + k, ldw);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(6, wb + 16 * K + k, ldw);
      _tile_dpbf16ps(1, 6, 4);
      _tile_loadd(7, wb + 32 * K + k, ldw);
      _tile_dpbf16ps(2, 7, 4);
      _tile_loadd(5, wb + 48 * K + k, ldw);
      _tile_dpbf16ps(3, 5, 4);
      if (prefetch) {
        const char* p = reinterpret_cast<const char*>(wb + 64 * K + k);
#pragma GCC unroll 64
        for (int r = 0; r < 64; ++r) _mm_prefetch(p + r * ldw, _MM_HINT_T0);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    for (int b = 0; b < 4; ++b) write_block(c[b], M, bias, y, n0 + 16 * b, N);
  }
  for (; n0 + 16 <= n_end; n0 += 16) {
    _tile_zero(0);
    const at::BFloat16* wb = w + n0 * K;
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, xp + k * 16, 64);
      _tile_loadd(5, wb + k, ldw);
      _tile_dpbf16ps(0, 5, 4);
    }
    _tile_stored(0, c[0], 64);
    write_block(c[0], M, bias, y, n0, N);
  }
  _tile_release();
}

// x [M, K] -> xp [K / 2][16][2] (M padded to 16 with zeros)
void pack_x(const at::BFloat16* x, int M, int64_t K, at::BFloat16* xp) {
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);
  uint32_t* p32 = reinterpret_cast<uint32_t*>(xp);
  std::memset(xp, 0, K / 2 * 16 * 4);
  for (int m = 0; m < M; ++m)
    for (int64_t i = 0; i < K / 2; ++i) p32[i * 16 + m] = x32[m * (K / 2) + i];
}

void amx_linear(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y, int M,
                int64_t N, int64_t K, RowsFn tail) {
  std::vector<at::BFloat16> xp(K / 2 * 32);
  pack_x(x, M, K, xp.data());
  const int64_t n16 = N / 16;
  at::parallel_for(0, n16, 8, [&](int64_t b0, int64_t b1) {
    amx_rows(xp.data(), w, bias, y, M, b0 * 16, b1 * 16, N, K);
  });
  if (n16 * 16 < N) tail(x, w, bias, y, N, K, n16 * 16);
}

at::Tensor small_m_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2, "small_m_linear: weight must be [N, K], got ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "small_m_linear: x ", x.sizes(),
              " does not match weight ", weight.sizes());
  const int64_t K = weight.size(1), N = weight.size(0);
  const int64_t M = K ? x.numel() / K : 0;
  const auto dt = x.scalar_type();
  const bool same = weight.scalar_type() == dt && (!bias || bias->scalar_type() == dt);
  const bool bf16 = same && dt == at::kBFloat16, f32 = same && dt == at::kFloat;
  if (!(bf16 || f32) || M < 1 || M > (f32 ? MAX_ROWS_F32 : MAX_ROWS) || K == 0) {  // the reference: fp32 math, one rounding
    auto y = at::linear(x.to(at::kFloat), weight.to(at::kFloat), bias ? c10::optional<at::Tensor>(bias->to(at::kFloat))
                                                                      : c10::nullopt);
    return y.to(x.scalar_type());
  }
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N), "small_m_linear: bias must be [N]");
  const at::Tensor xc = x.reshape({M, K}).contiguous();
  const at::Tensor wc = weight.contiguous();
  const c10::optional<at::Tensor> bc = bias ? c10::optional<at::Tensor>(bias->contiguous()) : c10::nullopt;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options());
  if (f32) {
    auto fn = M <= 2 ? &rows_f32<8> : &rows_f32<4>;
    fn(xc.data_ptr<float>(), wc.data_ptr<float>(), bc ? bc->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N,
       K);
    return y;
  }
  static const auto fns = table(std::make_integer_sequence<int, MAX_ROWS>{});
  static const bool amx = amx_usable();
  const at::BFloat16* xd = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wd = wc.data_ptr<at::BFloat16>();
  const at::BFloat16* bd = bc ? bc->data_ptr<at::BFloat16>() : nullptr;
  if (amx && K % 32 == 0)
    amx_linear(xd, wd, bd, y.data_ptr<at::BFloat16>(), static_cast<int>(M), N, K, fns[M - 1]);
  else
    fns[M - 1](xd, wd, bd, y.data_ptr<at::BFloat16>(), N, K, 0);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specc, CPU, m) { m.impl("small_m_linear", &small_m_linear_cpu); }
