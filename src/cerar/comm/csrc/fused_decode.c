/* CERAR's decode of one piece in one pass over memory (loaded by cerar/comm/native.py).

   For each of the piece's w columns q (the c neighbouring values x[q*c .. q*c + c - 1]):

       out[q*c + k] = scale * ( sum_j D[k][j] x[q*c + j] + sum_s W[k][s] obs[s*ld + q] )

   accumulated in double (float64 packets aside, the only precision whose decode error matches
   the float64 reference: the decoded sum cancels terms about a thousand times larger than
   itself). x, the own rows, and out may be the same memory: a column's c outputs are written
   only after its c inputs have been read. obs holds the c observation slots, ld values apart,
   as float32, float16 or bfloat16 packets. dt is D transposed (dt[j*c + k] = D[k][j]) and wt is
   W transposed (wt[s*c + k] = W[k][s]), both row-major c x c doubles, so that one input value
   updates c contiguous accumulators (vectorised across k).

   The torch ops this replaces stream a float64 accumulator three times and widen every
   observation into a float64 scratch; this reads the input, the observations and writes the
   output once each. No allocation, no global state: callable from any thread, and ctypes
   releases the GIL around the call. */

#include <stdint.h>
#include <string.h>

enum { PACKET_F32 = 0, PACKET_F16 = 1, PACKET_BF16 = 2 };

/* Wider codes fall back to a loop over a runtime c (arrays sized for cerar's MAX_COMPONENTS). */
#define MAX_C 256

static inline float load_f32(const void *base, int64_t i) { return ((const float *)base)[i]; }

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

/* The columns [q0, q0 + w) of one piece: obs points at slot 0's value of column q0 in float32,
   ld values between slots (the packets themselves, or a block of them widened by
   decode_block). */
#define DECODE_COLUMNS(C)                                                                   \
    for (int64_t q = 0; q < w; ++q) {                                                      \
        double acc[MAX_C];                                                                  \
        const float *row = x + q * (C);                                                     \
        for (int64_t k = 0; k < (C); ++k) acc[k] = 0.0;                                     \
        for (int64_t j = 0; j < (C); ++j) {                                                 \
            const double value = (double)row[j];                                            \
            const double *column = dt + j * (C);                                            \
            for (int64_t k = 0; k < (C); ++k) acc[k] += column[k] * value;                  \
        }                                                                                   \
        for (int64_t s = 0; s < (C); ++s) {                                                 \
            const double value = (double)obs[s * ld + q];                                   \
            const double *column = wt + s * (C);                                            \
            for (int64_t k = 0; k < (C); ++k) acc[k] += column[k] * value;                  \
        }                                                                                   \
        float *target = out + q * (C);                                                      \
        for (int64_t k = 0; k < (C); ++k) target[k] = (float)(acc[k] * scale);              \
    }

/* Specialised for the common widths, so that the k loops unroll into a few vector registers. */
static void decode_f32(int64_t w, int64_t c, const float *x, const float *obs, int64_t ld, const double *dt,
                       const double *wt, double scale, float *out) {
    switch (c) {
        case 4: DECODE_COLUMNS(4) break;
        case 8: DECODE_COLUMNS(8) break;
        case 16: DECODE_COLUMNS(16) break;
        default: DECODE_COLUMNS(c) break;
    }
}

/* 16-bit packets: a block of columns of every slot widened to float32 into a small scratch (a
   vectorisable loop per slot), then decoded as float32 packets from there; converting inside
   the column loop, one value at a time, doubled the decode's time. */
#define SCRATCH_VALUES 4096

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
                     const double *dt, const double *wt, double scale, float *out) {        \
        float scratch[SCRATCH_VALUES];                                                      \
        const int64_t block = SCRATCH_VALUES / c;                                           \
        for (int64_t q0 = 0; q0 < w; q0 += block) {                                         \
            const int64_t width = w - q0 < block ? w - q0 : block;                          \
            for (int64_t s = 0; s < c; ++s) WIDEN(obs, s * ld + q0, width, scratch + s * width); \
            decode_f32(width, c, x + q0 * c, scratch, width, dt, wt, scale, out + q0 * c);  \
        }                                                                                   \
    }

DEFINE_DECODE_16(decode_f16, widen_f16)
DEFINE_DECODE_16(decode_bf16, widen_bf16)

/* Returns 0, or -1 for an argument this kernel does not take (the caller then uses torch ops). */
int cerar_fused_decode(int64_t w, int64_t c, const float *x, const void *obs, int64_t ld, int32_t packet,
                       const double *dt, const double *wt, double scale, float *out) {
    if (w < 0 || c < 1 || c > MAX_C || ld < w) return -1;
    /* MAX_C * 16 <= SCRATCH_VALUES: a 16-bit block is at least 16 columns wide. */
    switch (packet) {
        case PACKET_F32: decode_f32(w, c, x, (const float *)obs, ld, dt, wt, scale, out); return 0;
        case PACKET_F16: decode_f16(w, c, x, obs, ld, dt, wt, scale, out); return 0;
        case PACKET_BF16: decode_bf16(w, c, x, obs, ld, dt, wt, scale, out); return 0;
        default: return -1;
    }
}

/* The build's ABI version: native.py refuses a library whose version it does not know. */
int cerar_native_version(void) { return 1; }
