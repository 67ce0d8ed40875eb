/* CERAR's coding on the CPU, each in one pass over memory (loaded by cerar/comm/native.py).

   cerar_encode: every round's increment of one piece. For each of the piece's w columns q (the
   c neighbouring values x[q*c .. q*c + c - 1]) and each round t < L:

       out[t*ld + q] = sum_j R[t][j] x[q*c + j]          (float32, as torch's product)

   reading the input once for all L rounds (torch's (B, c) x (c, w) products read it once per
   batch of B rounds) and writing each increment once.

   cerar_fused_decode: the decode of one piece. For each column q:

       out[q*c + k] = scale * ( sum_j D[k][j] x[q*c + j] + sum_s W[k][s] obs[s*ld + q] )

   accumulated in double for float32 packets (the only precision whose decode error matches the
   float64 reference: the decoded sum cancels terms about a thousand times larger than itself)
   and in float for 16-bit packets (whose own rounding dwarfs float's). x, the own rows, and out
   may be the same memory: a column's c outputs are written only after its c inputs have been
   read. obs holds the c observation slots, ld values apart, as float32, float16 or bfloat16
   packets. dt is D transposed (dt[j*c + k] = D[k][j]) and wt is W transposed (wt[s*c + k] =
   W[k][s]), both row-major c x c in the accumulator's type, so that one input value updates c
   contiguous accumulators (vectorised across k).

   The torch ops these replace stream a float64 accumulator three times and widen every
   observation into a float64 scratch; this reads the input, the observations and writes the
   output once each. No allocation, no global state: callable from any thread, and ctypes
   releases the GIL around the call. */

#include <stdint.h>
#include <string.h>

enum { PACKET_F32 = 0, PACKET_F16 = 1, PACKET_BF16 = 2 };

/* The widest code the decode is compiled for; wider ones decode with the torch ops. */
#define MAX_C 32

static inline float load_bf16(const void *base, int64_t i) {
    uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* float16: the F16C instruction on x86 (GCC's _Float16 conversion calls libgcc there unless the
   CPU has AVX512-FP16), the compiler's _Float16 on ARM, else by hand. */
#if defined(__F16C__)
#include <immintrin.h>
static inline float load_f16(const void *base, int64_t i) { return _cvtsh_ss(((const uint16_t *)base)[i]); }
#elif defined(__aarch64__) && defined(__FLT16_MAX__)
static inline float load_f16(const void *base, int64_t i) { return (float)((const _Float16 *)base)[i]; }
#else
static inline float load_f16(const void *base, int64_t i) {
    uint32_t h = ((const uint16_t *)base)[i];
    uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {
        float value = (float)mantissa * (1.0f / 16777216.0f); /* subnormal: mantissa * 2^-24 */
        return sign ? -value : value;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}
#endif

/* ---- encode ------------------------------------------------------------------------------ */

/* Blocks of eight columns: their c values (8 x c, row-major) transposed in registers into c
   vectors of 8 columns each, so that each round's 8 outputs are c fused multiply-adds and one
   store (two blocks at once where 16 columns are left, see encode_avx). Written with AVX2/FMA
   intrinsics for c a multiple of 8 up to ENCODE_MAX_C (compilers do not vectorise the
   transpose); elsewhere cerar_encode refuses and the torch product runs. */
#define ENCODE_MAX_C 32
#define MAX_ROUNDS 1024

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

#define HAVE_AVX2 1 /* the encode below and the float decode's registers use it */
/* Columns q0 .. q0 + 8 B - 1 transposed into xt (xt[b][j]: value j of the block's columns 8 b ..). */
static inline void transpose_columns(const float *x, int64_t c, int64_t q0, int blocks, __m256 xt[][ENCODE_MAX_C]) {
    for (int b = 0; b < blocks; ++b)
        for (int64_t j0 = 0; j0 < c; j0 += 8) {
            __m256 block[8];
            for (int q = 0; q < 8; ++q) block[q] = _mm256_loadu_ps(x + (q0 + 8 * b + q) * c + j0);
            transpose8(block);
            for (int j = 0; j < 8; ++j) xt[b][j0 + j] = block[j];
        }
}

/* A streaming store where aligned: the increments (L/c of the input) are written once and read
   rounds later, so an ordinary store would first read every line it writes (write-allocate), a
   third more memory traffic than the encode needs. */
static inline void store_increment(float *target, __m256 value) {
    if (((uintptr_t)target & 31u) == 0)
        _mm256_stream_ps(target, value);
    else
        _mm256_storeu_ps(target, value);
}

static void encode_avx(int64_t w, int64_t c, int64_t rounds, const float *x, const float *rows, int64_t ld,
                       float *out) {
    __m256 xt[2][ENCODE_MAX_C];
    int64_t q0 = 0;
    /* Sixteen columns at a time: each round's store is then a whole 64-byte line of its
       increment, so that the L streams of streaming stores each fill a line before it leaves the
       core (eight columns wrote half lines, L streams at once, more than the core combines). */
    for (; q0 + 16 <= w; q0 += 16) {
        transpose_columns(x, c, q0, 2, xt);
        for (int64_t t = 0; t < rounds; ++t) {
            const float *r = rows + t * c;
            __m256 coefficient = _mm256_broadcast_ss(r);
            __m256 low = _mm256_mul_ps(coefficient, xt[0][0]), high = _mm256_mul_ps(coefficient, xt[1][0]);
            for (int64_t j = 1; j < c; ++j) {
                coefficient = _mm256_broadcast_ss(r + j);
                low = _mm256_fmadd_ps(coefficient, xt[0][j], low);
                high = _mm256_fmadd_ps(coefficient, xt[1][j], high);
            }
            float *target = out + t * ld + q0;
            store_increment(target, low);
            store_increment(target + 8, high);
        }
    }
    for (; q0 + 8 <= w; q0 += 8) {
        transpose_columns(x, c, q0, 1, xt);
        for (int64_t t = 0; t < rounds; ++t) {
            const float *r = rows + t * c;
            __m256 acc = _mm256_mul_ps(_mm256_broadcast_ss(r), xt[0][0]);
            for (int64_t j = 1; j < c; ++j) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(r + j), xt[0][j], acc);
            store_increment(out + t * ld + q0, acc);
        }
    }
    _mm_sfence(); /* the streaming stores are visible to the thread that sends them */
    for (; q0 < w; ++q0) { /* the last columns, fewer than 8 */
        for (int64_t t = 0; t < rounds; ++t) {
            float acc = 0.0f;
            for (int64_t j = 0; j < c; ++j) acc += rows[t * c + j] * x[q0 * c + j];
            out[t * ld + q0] = acc;
        }
    }
}
#else
#define HAVE_AVX2 0
#endif

/* Whether cerar_encode takes codes of c components. */
int cerar_encode_supports(int64_t c) { return HAVE_AVX2 && c % 8 == 0 && c >= 8 && c <= ENCODE_MAX_C; }

/* Returns 0, or -1 for an argument this kernel does not take. rows is the L x c float32 matrix
   of increment rows (row-major), out the L increments, ld values apart. */
int cerar_encode(int64_t w, int64_t c, int64_t rounds, const float *x, const float *rows, int64_t ld, float *out) {
    if (!cerar_encode_supports(c) || w < 0 || rounds < 0 || rounds > MAX_ROUNDS || ld < w) return -1;
#if HAVE_AVX2
    encode_avx(w, c, rounds, x, rows, ld, out);
#endif
    return 0;
}

/* ---- decode ------------------------------------------------------------------------------ */

/* The columns [q0, q0 + w) of one piece, accumulated in ACC (double or float) with the
   matrices dt and wt in ACC: obs points at slot 0's value of column q0 in float32, ld values
   between slots (the packets themselves, or a block of them widened from 16 bits). The own
   part and the observations' part are two sums, added at the end: two independent chains of
   multiply-adds, where one chain would wait on the adder's latency at every step. The scale
   is applied in double: 2**q need not be a float. */
#define DECODE_COLUMNS(C, ACC)                                                              \
    for (int64_t q = 0; q < w; ++q) {                                                      \
        ACC own[MAX_C], seen[MAX_C];                                                        \
        const float *row = x + q * (C);                                                     \
        for (int64_t k = 0; k < (C); ++k) own[k] = seen[k] = 0;                             \
        for (int64_t j = 0; j < (C); ++j) {                                                 \
            const ACC value = (ACC)row[j];                                                  \
            const ACC *column = dt + j * (C);                                               \
            for (int64_t k = 0; k < (C); ++k) own[k] += column[k] * value;                  \
        }                                                                                   \
        for (int64_t s = 0; s < (C); ++s) {                                                 \
            const ACC value = (ACC)obs[s * ld + q];                                         \
            const ACC *column = wt + s * (C);                                               \
            for (int64_t k = 0; k < (C); ++k) seen[k] += column[k] * value;                 \
        }                                                                                   \
        float *target = out + q * (C);                                                      \
        for (int64_t k = 0; k < (C); ++k) target[k] = (float)((double)(own[k] + seen[k]) * scale); \
    }

/* One instance per width up to MAX_C, so that the k loops unroll into a few vector registers
   (with a runtime c the compilers tried kept the accumulators in memory, several times slower
   than the torch ops); cerar_decode_supports refuses wider codes. */
#define DEFINE_DECODE_FLOAT32(NAME, ACC)                                                    \
    static void NAME(int64_t w, int64_t c, const float *x, const float *obs, int64_t ld,   \
                     const ACC *dt, const ACC *wt, double scale, float *out) {              \
        switch (c) {                                                                        \
            case 1: DECODE_COLUMNS(1, ACC) break;                                           \
            case 2: DECODE_COLUMNS(2, ACC) break;                                           \
            case 3: DECODE_COLUMNS(3, ACC) break;                                           \
            case 4: DECODE_COLUMNS(4, ACC) break;                                           \
            case 5: DECODE_COLUMNS(5, ACC) break;                                           \
            case 6: DECODE_COLUMNS(6, ACC) break;                                           \
            case 7: DECODE_COLUMNS(7, ACC) break;                                           \
            case 8: DECODE_COLUMNS(8, ACC) break;                                           \
            case 9: DECODE_COLUMNS(9, ACC) break;                                           \
            case 10: DECODE_COLUMNS(10, ACC) break;                                         \
            case 11: DECODE_COLUMNS(11, ACC) break;                                         \
            case 12: DECODE_COLUMNS(12, ACC) break;                                         \
            case 13: DECODE_COLUMNS(13, ACC) break;                                         \
            case 14: DECODE_COLUMNS(14, ACC) break;                                         \
            case 15: DECODE_COLUMNS(15, ACC) break;                                         \
            case 16: DECODE_COLUMNS(16, ACC) break;                                         \
            case 17: DECODE_COLUMNS(17, ACC) break;                                         \
            case 18: DECODE_COLUMNS(18, ACC) break;                                         \
            case 19: DECODE_COLUMNS(19, ACC) break;                                         \
            case 20: DECODE_COLUMNS(20, ACC) break;                                         \
            case 21: DECODE_COLUMNS(21, ACC) break;                                         \
            case 22: DECODE_COLUMNS(22, ACC) break;                                         \
            case 23: DECODE_COLUMNS(23, ACC) break;                                         \
            case 24: DECODE_COLUMNS(24, ACC) break;                                         \
            case 25: DECODE_COLUMNS(25, ACC) break;                                         \
            case 26: DECODE_COLUMNS(26, ACC) break;                                         \
            case 27: DECODE_COLUMNS(27, ACC) break;                                         \
            case 28: DECODE_COLUMNS(28, ACC) break;                                         \
            case 29: DECODE_COLUMNS(29, ACC) break;                                         \
            case 30: DECODE_COLUMNS(30, ACC) break;                                         \
            case 31: DECODE_COLUMNS(31, ACC) break;                                         \
            case 32: DECODE_COLUMNS(32, ACC) break;                                          \
            default: break;                                                                 \
        }                                                                                   \
    }

DEFINE_DECODE_FLOAT32(decode_f32, double)
DEFINE_DECODE_FLOAT32(decode_f32_in_float_loops, float)

#if HAVE_AVX2
/* In float, c = 8 G: a column's c accumulators in G registers, K times over: the 2c
   multiply-adds of a column go round K independent sums, added at the end, so that each waits on
   the one K steps before it, not on the one before (one chain of 2c dependent multiply-adds
   kept the decode waiting on the adder's latency, not on memory). G and K are constants of each
   instance: with a runtime count the compilers tried kept the accumulators in memory, and each
   multiply-add then waited on the previous one's store (slower than the loops). */
#define DEFINE_DECODE_AVX(NAME, G, K)                                                                  \
    static void NAME(int64_t w, const float *x, const float *obs, int64_t ld, const float *dt,        \
                     const float *wt, double scale, float *out) {                                    \
        const int64_t c = 8 * (G);                                                                     \
        const __m256d factor = _mm256_set1_pd(scale);                                                  \
        for (int64_t q = 0; q < w; ++q) {                                                              \
            __m256 acc[K][G];                                                                          \
            for (int i = 0; i < (K); ++i)                                                              \
                for (int g = 0; g < (G); ++g) acc[i][g] = _mm256_setzero_ps();                         \
            const float *row = x + q * c;                                                              \
            for (int64_t j = 0; j < c; ++j) {                                                          \
                const __m256 value = _mm256_broadcast_ss(row + j);                                     \
                for (int g = 0; g < (G); ++g)                                                          \
                    acc[j % (K)][g] = _mm256_fmadd_ps(value, _mm256_loadu_ps(dt + j * c + 8 * g), acc[j % (K)][g]); \
            }                                                                                          \
            for (int64_t s = 0; s < c; ++s) {                                                          \
                const __m256 value = _mm256_broadcast_ss(obs + s * ld + q);                            \
                for (int g = 0; g < (G); ++g)                                                          \
                    acc[s % (K)][g] = _mm256_fmadd_ps(value, _mm256_loadu_ps(wt + s * c + 8 * g), acc[s % (K)][g]); \
            }                                                                                          \
            for (int g = 0; g < (G); ++g) { /* times 2**q in double: it need not be a float */        \
                __m256 sum = acc[0][g];                                                                \
                for (int i = 1; i < (K); ++i) sum = _mm256_add_ps(sum, acc[i][g]);                     \
                const __m256d low = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(sum)), factor); \
                const __m256d high = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(sum, 1)), factor); \
                _mm256_storeu_ps(out + q * c + 8 * g, _mm256_set_m128(_mm256_cvtpd_ps(high), _mm256_cvtpd_ps(low))); \
            }                                                                                          \
        }                                                                                              \
    }

DEFINE_DECODE_AVX(decode_f32_in_float_16, 2, 2)
DEFINE_DECODE_AVX(decode_f32_in_float_24, 3, 2)
DEFINE_DECODE_AVX(decode_f32_in_float_32, 4, 2)

/* c = 8, in float, in two passes over a block of columns: the own part D x with D's eight
   columns held in registers, into a small scratch, then the observations' part W o with W's
   held in registers, added to it. In one pass neither matrix fits in the sixteen registers
   beside the sums, so each multiply-add loaded its matrix column again: two loads per
   multiply-add (the value broadcast, the column), and the load ports, not the adders or the
   memory, set the decode's speed. Two chains per pass, added at the end (see above). */
#define OWN_BLOCK 128
static void decode_f32_in_float_8(int64_t w, const float *x, const float *obs, int64_t ld, const float *dt,
                                  const float *wt, double scale, float *out) {
    const __m256d factor = _mm256_set1_pd(scale);
    float own[8 * OWN_BLOCK] __attribute__((aligned(32)));
    for (int64_t q0 = 0; q0 < w; q0 += OWN_BLOCK) {
        const int64_t n = w - q0 < OWN_BLOCK ? w - q0 : OWN_BLOCK;
        {
            __m256 m[8];
            for (int j = 0; j < 8; ++j) m[j] = _mm256_loadu_ps(dt + 8 * j);
            for (int64_t q = 0; q < n; ++q) {
                const float *row = x + (q0 + q) * 8;
                __m256 even = _mm256_mul_ps(_mm256_broadcast_ss(row), m[0]);
                __m256 odd = _mm256_mul_ps(_mm256_broadcast_ss(row + 1), m[1]);
                for (int j = 2; j < 8; j += 2) {
                    even = _mm256_fmadd_ps(_mm256_broadcast_ss(row + j), m[j], even);
                    odd = _mm256_fmadd_ps(_mm256_broadcast_ss(row + j + 1), m[j + 1], odd);
                }
                _mm256_store_ps(own + 8 * q, _mm256_add_ps(even, odd));
            }
        }
        __m256 m[8];
        for (int s = 0; s < 8; ++s) m[s] = _mm256_loadu_ps(wt + 8 * s);
        for (int64_t q = 0; q < n; ++q) {
            const float *slots = obs + q0 + q;
            __m256 even = _mm256_fmadd_ps(_mm256_broadcast_ss(slots), m[0], _mm256_load_ps(own + 8 * q));
            __m256 odd = _mm256_mul_ps(_mm256_broadcast_ss(slots + ld), m[1]);
            for (int s = 2; s < 8; s += 2) {
                even = _mm256_fmadd_ps(_mm256_broadcast_ss(slots + s * ld), m[s], even);
                odd = _mm256_fmadd_ps(_mm256_broadcast_ss(slots + (s + 1) * ld), m[s + 1], odd);
            }
            const __m256 sum = _mm256_add_ps(even, odd); /* times 2**q in double: it need not be a float */
            const __m256d low = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(sum)), factor);
            const __m256d high = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(sum, 1)), factor);
            _mm256_storeu_ps(out + (q0 + q) * 8, _mm256_set_m128(_mm256_cvtpd_ps(high), _mm256_cvtpd_ps(low)));
        }
    }
}
#endif

static void decode_f32_in_float(int64_t w, int64_t c, const float *x, const float *obs, int64_t ld,
                                const float *dt, const float *wt, double scale, float *out) {
#if HAVE_AVX2
    if (c == 8) return decode_f32_in_float_8(w, x, obs, ld, dt, wt, scale, out);
    if (c == 16) return decode_f32_in_float_16(w, x, obs, ld, dt, wt, scale, out);
    if (c == 24) return decode_f32_in_float_24(w, x, obs, ld, dt, wt, scale, out);
    if (c == 32) return decode_f32_in_float_32(w, x, obs, ld, dt, wt, scale, out);
#endif
    decode_f32_in_float_loops(w, c, x, obs, ld, dt, wt, scale, out);
}

/* 16-bit packets: a block of columns of every slot widened to float32 into a small scratch (a
   vectorisable loop per slot), then decoded as float32 packets from there, in float: the
   packets' own rounding dwarfs float32's (converting inside the column loop, one value at a
   time, doubled the decode's time). */
#define SCRATCH_VALUES 1024

static void widen_f16(const void *base, int64_t first, int64_t n, float *into) {
    const uint16_t *from = (const uint16_t *)base + first;
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(into + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(from + i))));
#endif
    for (; i < n; ++i) into[i] = load_f16(from, i);
}

static void widen_bf16(const void *base, int64_t first, int64_t n, float *into) {
    for (int64_t i = 0; i < n; ++i) into[i] = load_bf16(base, first + i);
}

#define DEFINE_DECODE_16(NAME, WIDEN)                                                       \
    static void NAME(int64_t w, int64_t c, const float *x, const void *obs, int64_t ld,    \
                     const float *dt, const float *wt, double scale, float *out) {          \
        float scratch[SCRATCH_VALUES];                                                      \
        const int64_t block = SCRATCH_VALUES / c;                                           \
        for (int64_t q0 = 0; q0 < w; q0 += block) {                                         \
            const int64_t width = w - q0 < block ? w - q0 : block;                          \
            for (int64_t s = 0; s < c; ++s) WIDEN(obs, s * ld + q0, width, scratch + s * width); \
            decode_f32_in_float(width, c, x + q0 * c, scratch, width, dt, wt, scale, out + q0 * c); \
        }                                                                                   \
    }

DEFINE_DECODE_16(decode_f16, widen_f16)
DEFINE_DECODE_16(decode_bf16, widen_bf16)

/* Whether cerar_fused_decode takes codes of c components. */
int cerar_decode_supports(int64_t c) { return c >= 1 && c <= MAX_C; }

/* Returns 0, or -1 for an argument this kernel does not take (the caller then uses torch ops).
   dt and wt are doubles for float32 packets, floats for 16-bit ones. */
int cerar_fused_decode(int64_t w, int64_t c, const float *x, const void *obs, int64_t ld, int32_t packet,
                       const void *dt, const void *wt, double scale, float *out) {
    if (w < 0 || !cerar_decode_supports(c) || ld < w) return -1;
    /* MAX_C * 32 <= SCRATCH_VALUES: a 16-bit block is at least 32 columns wide. */
    switch (packet) {
        case PACKET_F32: decode_f32(w, c, x, (const float *)obs, ld, dt, wt, scale, out); return 0;
        case PACKET_F16: decode_f16(w, c, x, obs, ld, dt, wt, scale, out); return 0;
        case PACKET_BF16: decode_bf16(w, c, x, obs, ld, dt, wt, scale, out); return 0;
        default: return -1;
    }
}

/* The build's ABI version: native.py refuses a library whose version it does not know. */
int cerar_native_version(void) { return 4; }

/* ---- block-quantized packets: int8, float8 e4m3fn, packed int4 ----------------------------- */

/* The block-quantized ring's coding (cerar/comm/algorithms/ring/quantize.py holds the torch ops these
   match bit for bit; cerar/coding/blocks.py the format). Values in blocks of `block` (the last
   one of a piece may be shorter). Per block: absmax = max |x|, s = absmax / QMAX (127 for int8,
   448 for float8 e4m3fn, 7 for int4) rounded to the scale's type (float32, float16 or bfloat16,
   to nearest even) and used as that value; codes q = x / s (a division, as torch's), clamped to
   [-QMAX, QMAX], then rounded half to even to int8 and int4, or to nearest even to e4m3fn. A
   block whose s is 0 or not finite gets codes 0 (its dequantized values are then 0, or NaN for
   a NaN/Inf scale). A packet is the nb scales (in the scale's type, little-endian as the
   machine's) followed by the m codes, one byte each, or for int4 two a byte (value 2i in the
   low nibble, 2i + 1 in the high one, two's complement nibbles, an odd count's last high nibble
   0), byte-aligned only: scales are read and written with memcpy. int4 blocks are even, so
   every block's codes start on a whole byte, at value a's byte a / 2.

   cerar_quantize: packet = quantize(x). cerar_dequantize: out = dequantize(packet), or out +=
   it. cerar_dequant_add_requant, a reduce-scatter hop: own += dequantize(arrived) (float32),
   out = quantize(own), and with keep, own = dequantize(out) (the owner keeps what it sends).
   Dequantize is q * s, rounded, then added: no contraction into a fused multiply-add (the
   pragmas below; -march=native offers FMA), else the sums would differ from torch's. */

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

enum { WIRE_INT8 = 0, WIRE_FP8_E4M3 = 1, WIRE_INT4 = 2 };
enum { SCALE_F32 = 0, SCALE_F16 = 1, SCALE_BF16 = 2 };

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 to float16, to nearest even, NaN to a quiet NaN (c10's fp16_ieee_from_fp32_value). */
static inline uint16_t half_from_float(float f) {
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (bits_float(float_bits(f) & 0x7fffffffu) * scale_to_inf) * scale_to_zero;
    const uint32_t w = float_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_float((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = float_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

/* float32 to bfloat16, to nearest even, NaN to 0x7fc0 (c10's round_to_nearest_even). */
static inline uint16_t bf16_from_float(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* float32 (within [-448, 448]) to float8 e4m3fn, to nearest even (c10's fp8e4m3fn_from_fp32_value,
   branch-free so that it vectorises). */
static inline uint8_t fp8_from_float(float f) {
    const uint32_t denorm_mask = 141u << 23;
    uint32_t bits = float_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    const uint32_t small = float_bits(bits_float(bits) + bits_float(denorm_mask)) - denorm_mask;
    const uint32_t normal = (bits + (uint32_t)(-(120 << 23)) + 0x7ffffu + ((bits >> 20) & 1u)) >> 20;
    const uint32_t tiny = 0u - (uint32_t)(bits < (121u << 23)); /* all ones below 2**-6: a mask, not a branch */
    const uint32_t code = (small & tiny) | (normal & ~tiny);
    return (uint8_t)(code | (sign >> 24));
}

/* An e4m3fn code's value (0x7f and 0xff are NaN), branch-free so that it vectorises. */
static inline float fp8_to_float(uint8_t code) {
    const uint32_t c = code, sign = (c & 0x80u) << 24, exponent = (c >> 3) & 15u, mantissa = c & 7u;
    const uint32_t normal = ((exponent + 120u) << 23) | (mantissa << 20);
    const uint32_t small = float_bits((float)(int32_t)mantissa * 0x1.0p-9f); /* exponent 0: mantissa 2**-9 */
    const uint32_t subnormal = 0u - (uint32_t)(exponent == 0), nan = 0u - (uint32_t)((c & 0x7fu) == 0x7fu);
    const uint32_t bits = (small & subnormal) | (normal & ~subnormal);
    return bits_float(((0x7fc00000u & nan) | (bits & ~nan)) | sign);
}

static inline int64_t scale_size(int32_t kind) { return kind == SCALE_F32 ? 4 : 2; }

static inline float wire_qmax(int32_t wire) { return wire == WIRE_INT8 ? 127.0f : wire == WIRE_INT4 ? 7.0f : 448.0f; }

/* The bytes of m codes, and the byte where value a's code starts (a block's start: even for int4). */
static inline int64_t code_bytes(int32_t wire, int64_t m) { return wire == WIRE_INT4 ? (m + 1) / 2 : m; }
static inline int64_t code_at(int32_t wire, int64_t a) { return wire == WIRE_INT4 ? a / 2 : a; }

/* The scale of a block of largest magnitude bits `top` (|x|'s bits: NaN above 0x7f800000), as
   the value used, stored at `at` in the scale's type. */
static inline float put_scale(uint32_t top, float qmax, int32_t kind, uint8_t *at) {
    const float absmax = top > 0x7f800000u ? bits_float(0x7fc00000u) : bits_float(top);
    const float s = absmax / qmax;
    if (kind == SCALE_F32) {
        memcpy(at, &s, 4);
        return s;
    }
    uint16_t h;
    float value;
    if (kind == SCALE_F16) {
        h = half_from_float(s);
        value = load_f16(&h, 0);
    } else {
        h = bf16_from_float(s);
        value = bits_float((uint32_t)h << 16);
    }
    memcpy(at, &h, 2);
    return value;
}

static inline float get_scale(const uint8_t *scales, int64_t i, int32_t kind) {
    if (kind == SCALE_F32) {
        float s;
        memcpy(&s, scales + 4 * i, 4);
        return s;
    }
    uint16_t h;
    memcpy(&h, scales + 2 * i, 2);
    return kind == SCALE_F16 ? load_f16(&h, 0) : bits_float((uint32_t)h << 16);
}

static inline uint32_t block_top(const float *x, int64_t w) {
    uint32_t top = 0;
    for (int64_t j = 0; j < w; ++j) {
        const uint32_t a = float_bits(x[j]) & 0x7fffffffu;
        top = a > top ? a : top;
    }
    return top;
}

/* An int4 code (x / s clamped to [-7, 7], rounded half to even) as its two's complement nibble. */
static inline uint32_t int4_nibble(float x, float s) {
    float q = x / s;
    q = q < -7.0f ? -7.0f : q;
    q = q > 7.0f ? 7.0f : q;
    return (uint32_t)(int32_t)__builtin_rintf(q) & 15u; /* the current mode: to nearest even */
}

/* A nibble's value: the two's complement (n ^ 8) - 8. */
static inline float int4_value(uint32_t nibble) { return (float)((int32_t)(nibble ^ 8u) - 8); }

/* One block's codes at scale s (0 < s < inf, else all codes 0). */
static inline void codes_of(const float *x, int64_t w, int32_t wire, float s, float qmax, uint8_t *codes) {
    if (!(s > 0.0f && s <= 0x1.fffffep+127f)) {
        memset(codes, 0, (size_t)code_bytes(wire, w));
    } else if (wire == WIRE_INT4) {
        const int64_t pairs = w / 2;
        for (int64_t j = 0; j < pairs; ++j) codes[j] = (uint8_t)(int4_nibble(x[2 * j], s) | int4_nibble(x[2 * j + 1], s) << 4);
        if (w & 1) codes[pairs] = (uint8_t)int4_nibble(x[w - 1], s); /* the pad nibble is 0 */
    } else if (wire == WIRE_INT8) {
        for (int64_t j = 0; j < w; ++j) {
            float q = x[j] / s;
            q = q < -qmax ? -qmax : q;
            q = q > qmax ? qmax : q;
            codes[j] = (uint8_t)(int32_t)__builtin_rintf(q); /* the current mode: to nearest even */
        }
    } else {
        for (int64_t j = 0; j < w; ++j) {
            float q = x[j] / s;
            q = q < -qmax ? -qmax : q;
            q = q > qmax ? qmax : q;
            codes[j] = fp8_from_float(q);
        }
    }
}

static inline void quantize_blocks(int64_t m, int64_t block, int32_t wire, int32_t kind, const float *x, uint8_t *packet) {
    const float qmax = wire_qmax(wire);
    const int64_t nb = (m + block - 1) / block;
    uint8_t *codes = packet + nb * scale_size(kind);
    for (int64_t i = 0; i < nb; ++i) {
        const int64_t a = i * block, w = m - a < block ? m - a : block;
        const float s = put_scale(block_top(x + a, w), qmax, kind, packet + i * scale_size(kind));
        codes_of(x + a, w, wire, s, qmax, codes + code_at(wire, a));
    }
}

/* out = q * s, or out += q * s (the product rounded first). */
static inline void dequantize_block(const uint8_t *codes, int64_t w, int32_t wire, float s, float *out,
                                    int accumulate) {
    if (wire == WIRE_INT4) {
        const int64_t pairs = w / 2;
        if (accumulate) {
            for (int64_t j = 0; j < pairs; ++j) {
                const float lo = int4_value(codes[j] & 15u) * s, hi = int4_value((uint32_t)codes[j] >> 4) * s;
                out[2 * j] = out[2 * j] + lo;
                out[2 * j + 1] = out[2 * j + 1] + hi;
            }
            if (w & 1) {
                const float p = int4_value(codes[pairs] & 15u) * s;
                out[w - 1] = out[w - 1] + p;
            }
        } else {
            for (int64_t j = 0; j < pairs; ++j) {
                out[2 * j] = int4_value(codes[j] & 15u) * s;
                out[2 * j + 1] = int4_value((uint32_t)codes[j] >> 4) * s;
            }
            if (w & 1) out[w - 1] = int4_value(codes[pairs] & 15u) * s;
        }
    } else if (wire == WIRE_INT8) {
        if (accumulate) {
            for (int64_t j = 0; j < w; ++j) {
                const float p = (float)(int8_t)codes[j] * s;
                out[j] = out[j] + p;
            }
        } else {
            for (int64_t j = 0; j < w; ++j) out[j] = (float)(int8_t)codes[j] * s;
        }
    } else if (accumulate) {
        for (int64_t j = 0; j < w; ++j) {
            const float p = fp8_to_float(codes[j]) * s;
            out[j] = out[j] + p;
        }
    } else {
        for (int64_t j = 0; j < w; ++j) out[j] = fp8_to_float(codes[j]) * s;
    }
}

/* Whether the kernels below take this wire, scale type and block size (even for int4). */
int cerar_quant_supports(int32_t wire, int32_t kind, int64_t block) {
    return (wire == WIRE_INT8 || wire == WIRE_FP8_E4M3 || (wire == WIRE_INT4 && block % 2 == 0))
        && (kind == SCALE_F32 || kind == SCALE_F16 || kind == SCALE_BF16) && block >= 1;
}

/* The bytes of the packet of m values. */
int64_t cerar_quant_packet_bytes(int64_t m, int64_t block, int32_t wire, int32_t kind) {
    return (m + block - 1) / block * scale_size(kind) + code_bytes(wire, m);
}

/* Each returns 0, or -1 for arguments the kernels do not take (the caller then uses torch ops). */
int cerar_quantize(int64_t m, int64_t block, int32_t wire, int32_t kind, const float *x, uint8_t *packet) {
    if (m < 0 || !cerar_quant_supports(wire, kind, block)) return -1;
    quantize_blocks(m, block, wire, kind, x, packet);
    return 0;
}

int cerar_dequantize(int64_t m, int64_t block, int32_t wire, int32_t kind, const uint8_t *packet, float *out,
                     int32_t accumulate) {
    if (m < 0 || !cerar_quant_supports(wire, kind, block)) return -1;
    const int64_t nb = (m + block - 1) / block;
    const uint8_t *codes = packet + nb * scale_size(kind);
    for (int64_t i = 0; i < nb; ++i) {
        const int64_t a = i * block, w = m - a < block ? m - a : block;
        dequantize_block(codes + code_at(wire, a), w, wire, get_scale(packet, i, kind), out + a, accumulate);
    }
    return 0;
}

int cerar_dequant_add_requant(int64_t m, int64_t block, int32_t wire, int32_t kind, float *own,
                              const uint8_t *arrived, uint8_t *out, int32_t keep) {
    if (m < 0 || !cerar_quant_supports(wire, kind, block)) return -1;
    const float qmax = wire_qmax(wire);
    const int64_t nb = (m + block - 1) / block, size = scale_size(kind);
    const uint8_t *codes_in = arrived + nb * size;
    uint8_t *codes_out = out + nb * size;
    for (int64_t i = 0; i < nb; ++i) { /* a block at a time, while it is in the cache */
        const int64_t a = i * block, w = m - a < block ? m - a : block;
        const int64_t at = code_at(wire, a);
        dequantize_block(codes_in + at, w, wire, get_scale(arrived, i, kind), own + a, 1);
        const float s = put_scale(block_top(own + a, w), qmax, kind, out + i * size);
        codes_of(own + a, w, wire, s, qmax, codes_out + at);
        if (keep) dequantize_block(codes_out + at, w, wire, s, own + a, 0);
    }
    return 0;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
