/* One AdamW update of a job whose moments are stored int8 (infinity/optim/moment_codes.py), fused:
 * each 256-element block of both moments is decoded into a stack buffer, every param group's
 * elements in it updated, and the block encoded back, so each byte of state is read once and
 * written once. The torch path (CpuAdamW._update_blocks) does the same in about fifteen passes over
 * a work chunk; this is its one-pass form, called by infinity/optim/native.py through ctypes.
 *
 * Bitwise contract with the torch path: decoding, the stochastic rounding, the choice of scale, the
 * fp8 conversion (c10's fp8e4m3fn_from_fp32_value, round to nearest even), the bf16 rounding of
 * the parameter (split_master.round_bf16_: ties away from zero) and the split master's join and
 * split are the same integer and IEEE operations, so given the same updated fp32 values the codes,
 * scales and parameters are the same bits (tests/optim/test_native_adamw.py). The Adam arithmetic
 * is plain fp32 in torch's order without fused multiply-adds; torch's fused kernel uses them in its
 * vector lanes, so updated values may differ from it in the last bit.
 *
 * Build: -O3 -ffp-contract=off (no FMA contraction: vector lanes and scalar tails round alike, so
 * results do not depend on where a call's range starts), -fno-math-errno -fno-trapping-math (sqrtf
 * and the selects vectorize; neither changes a result).
 * Subnormals must not be flushed (decoding reads subnormal fp32 patterns): no -ffast-math.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define ROW_BYTES (BLOCK + 4)
#define FP8_MAX 448.0f
#define KEPT_BITS 0xFFF00000u /* fp32 keeps 23 mantissa bits, e4m3 3: the low 20 are rounded off */
#define DITHER_MASK ((INT64_C(1) << 20) - 1)
#define MIN_EXPONENT (-100)
#define MAX_EXPONENT 126

enum { PARAM_FP32 = 0, PARAM_REMAINDER = 1 };   /* fp32 master, or int16 remainder beside bf16 */
enum { OUT_NONE = 0, OUT_BF16 = 1, OUT_FP32 = 2 };
enum { GRAD_FP32 = 0, GRAD_BF16 = 1 };
enum { H_DECAY, H_LERP, H_BETA2, H_ONE_MINUS_BETA2, H_BC2_SQRT, H_EPS, H_STEP_SIZE, H_COUNT };

static inline uint32_t bits_of(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }
static inline float float_of(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }
static inline float power_of_two(int e) { return float_of((uint32_t)(e + 127) << 23); }

/* moment_codes.decode_codes_ on one row: code bits moved to an fp32 pattern (value * 2**-120),
 * times scale * 2**120 (in two exact steps where that gain overflows) */
static void decode_row(const uint8_t *row, float *out) {
    float scale;
    memcpy(&scale, row + BLOCK, 4);
    const float gain = scale * 0x1p120f;
    if (isinf(gain)) {
        for (int i = 0; i < BLOCK; i++) {
            uint32_t c = row[i];
            out[i] = float_of(((c & 0x7Fu) << 20) | ((c & 0x80u) << 24)) * 0x1p120f * scale;
        }
    } else {
        for (int i = 0; i < BLOCK; i++) {
            uint32_t c = row[i];
            out[i] = float_of(((c & 0x7Fu) << 20) | ((c & 0x80u) << 24)) * gain;
        }
    }
}

/* torch.frexp's exponent of amax / 448, less one where the fraction is exactly 0.5, clamped:
 * the power of two that puts the block's largest magnitude in (224, 448] */
static int scale_exponent(float amax) {
    const float q = amax / FP8_MAX;
    const uint32_t b = bits_of(q);
    const int biased = (int)((b >> 23) & 0xFF);
    int e;
    if (biased == 0)
        e = q == 0.0f ? 0 : MIN_EXPONENT;   /* zero: frexp gives 0; a subnormal clamps */
    else if (biased == 0xFF)
        e = 0;                              /* inf, NaN: frexp gives 0 */
    else
        e = biased - 126 - ((b & 0x7FFFFFu) == 0);
    return e < MIN_EXPONENT ? MIN_EXPONENT : (e > MAX_EXPONENT ? MAX_EXPONENT : e);
}

/* c10::detail::fp8e4m3fn_from_fp32_value (round to nearest even) of a value the stochastic rounding
 * left with 3 mantissa bits and the clamp within 448: in fp8's normal range that is exact, so the
 * code is the pattern's exponent and mantissa moved down (c10's rounding bias adds nothing there);
 * below 2**-6 fp8 has fewer mantissa bits, and c10's float add rounds to them; NaN gives 0x7F.
 * Written as selects of both results, so the encode loop vectorizes. */
static inline uint32_t fp8_of(float f) {
    const uint32_t denorm_mask = UINT32_C(141) << 23;  /* adding it rounds below 2**-6 to a subnormal */
    const uint32_t bits = bits_of(f);
    const uint32_t f_bits = bits & 0x7FFFFFFFu;
    const uint32_t subnormal = bits_of(float_of(f_bits) + float_of(denorm_mask)) - denorm_mask;
    const uint32_t normal = (f_bits - ((uint32_t)(127 - 7) << 23)) >> 20;
    uint32_t result = f_bits < (UINT32_C(121) << 23) ? subnormal : normal;
    result = f_bits > UINT32_C(0x7F800000) ? 0x7F : result;
    return result | ((bits >> 24) & 0x80u);
}

/* moment_codes.encode_ on one row (x already square-rooted for the second moment), rounding
 * stochastically with dither[i] (table[start + i] of the doubled table) */
static void encode_row(const float *x, uint8_t *row, const int32_t *dither) {
    uint32_t amax_bits = 0;   /* the largest magnitude's pattern: NaN patterns are larger still */
    for (int i = 0; i < BLOCK; i++) {
        const uint32_t m = bits_of(x[i]) & 0x7FFFFFFFu;
        amax_bits = m > amax_bits ? m : amax_bits;
    }
    const int e = scale_exponent(float_of(amax_bits));
    const float inv = power_of_two(-e), scale = power_of_two(e);
    uint32_t codes[BLOCK];   /* narrowed to bytes in a loop of its own: GCC 12 does not vectorize one that does both */
    for (int i = 0; i < BLOCK; i++) {
        float y = float_of((bits_of(x[i] * inv) + (uint32_t)dither[i]) & KEPT_BITS);
        y = y > FP8_MAX ? FP8_MAX : (y < -FP8_MAX ? -FP8_MAX : y);   /* NaN stays NaN */
        codes[i] = fp8_of(y);
    }
    for (int i = 0; i < BLOCK; i++) row[i] = (uint8_t)codes[i];
    memcpy(row + BLOCK, &scale, 4);
}

/* split_master.round_bf16_: nearest, ties away from zero; a NaN keeps its sign and top payload */
static inline uint16_t bf16_of(uint32_t b) {
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x0040u);
    return (uint16_t)((b + 0x8000u) >> 16);
}

/* Elements [a, e) of the job (i - base indexes the block buffers m, s: s holds square roots of
 * the second moment, updated to the new square root). Kinds are arguments so that each call
 * site below inlines to a specialized loop. */
static inline void update(int64_t a, int64_t e, int64_t base, float *m, float *s, void *param,
                          int param_kind, void *out, int out_kind, const void *grad, int grad_kind,
                          float grad_scale, const float *h) {
    const float decay = h[H_DECAY], lerp = h[H_LERP], beta2 = h[H_BETA2];
    const float one_minus_beta2 = h[H_ONE_MINUS_BETA2], bc2_sqrt = h[H_BC2_SQRT];
    const float eps = h[H_EPS], step_size = h[H_STEP_SIZE];
    for (int64_t i = a; i < e; i++) {
        float g = grad_kind == GRAD_FP32 ? ((const float *)grad)[i]
                                         : float_of((uint32_t)((const uint16_t *)grad)[i] << 16);
        g = g * grad_scale;
        float p;
        if (param_kind == PARAM_FP32)
            p = ((float *)param)[i];
        else   /* join: (param_bits << 16) + remainder, wrapping as int32 arithmetic does */
            p = float_of(((uint32_t)((uint16_t *)out)[i] << 16) + (uint32_t)(int32_t)((int16_t *)param)[i]);
        p = p * decay;
        const int64_t j = i - base;
        const float m0 = m[j];
        const float m1 = lerp < 0.5f ? m0 + lerp * (g - m0) : g - (g - m0) * (1.0f - lerp);   /* torch.lerp */
        const float v0 = s[j] * s[j];
        const float v1 = v0 * beta2 + one_minus_beta2 * (g * g);
        const float root = sqrtf(v1);
        const float denom = root / bc2_sqrt + eps;
        p = p + (-step_size) * (m1 / denom);
        m[j] = m1;
        s[j] = root;
        const uint32_t pb = bits_of(p);
        if (param_kind == PARAM_REMAINDER) {
            ((int16_t *)param)[i] = (int16_t)(uint16_t)(pb & 0xFFFFu);
            ((uint16_t *)out)[i] = bf16_of(pb);
        } else {
            ((float *)param)[i] = p;
            if (out_kind == OUT_BF16) ((uint16_t *)out)[i] = bf16_of(pb);
            else if (out_kind == OUT_FP32) ((float *)out)[i] = p;
        }
    }
}

#define UPDATE(PK, OK, GK) update(a, e, base, m, s, param, PK, out, OK, grad, GK, grad_scale, h)

static void update_any(int64_t a, int64_t e, int64_t base, float *m, float *s, void *param,
                       int param_kind, void *out, int out_kind, const void *grad, int grad_kind,
                       float grad_scale, const float *h) {
    if (param_kind == PARAM_REMAINDER) {
        if (grad_kind == GRAD_FP32) UPDATE(PARAM_REMAINDER, OUT_BF16, GRAD_FP32);
        else UPDATE(PARAM_REMAINDER, OUT_BF16, GRAD_BF16);
    } else if (out_kind == OUT_BF16) {
        if (grad_kind == GRAD_FP32) UPDATE(PARAM_FP32, OUT_BF16, GRAD_FP32);
        else UPDATE(PARAM_FP32, OUT_BF16, GRAD_BF16);
    } else if (out_kind == OUT_FP32) {
        if (grad_kind == GRAD_FP32) UPDATE(PARAM_FP32, OUT_FP32, GRAD_FP32);
        else UPDATE(PARAM_FP32, OUT_FP32, GRAD_BF16);
    } else {
        if (grad_kind == GRAD_FP32) UPDATE(PARAM_FP32, OUT_NONE, GRAD_FP32);
        else UPDATE(PARAM_FP32, OUT_NONE, GRAD_BF16);
    }
}

/* The torch path squares the decoded root and takes the root again before encoding: the same for
 * elements of a block that no segment updates (a block shared with padding) */
static void reroot(float *s, int64_t a, int64_t e) {
    for (int64_t j = a; j < e; j++) s[j] = sqrtf(s[j] * s[j]);
}

/* CpuAdamW.step_segments_ over blocks [block_lo, block_hi) of a job: segments are sorted,
 * disjoint element ranges seg[2k], seg[2k+1] with hyper-parameters hyper[H_COUNT k ...]; blocks no
 * segment touches are left as they are. table: the doubled dither table; dither_m, dither_v: the
 * table offsets (mod 2**20) of the job's element 0 for each moment. Returns 0. */
int infinity_adamw_int8(int64_t block_lo, int64_t block_hi, void *param, int param_kind, void *out,
                        int out_kind, const void *grad, int grad_kind, float grad_scale,
                        uint8_t *m_rows, uint8_t *v_rows, int64_t nseg, const int64_t *seg,
                        const float *hyper, const int32_t *table, int64_t dither_m, int64_t dither_v) {
    float m[BLOCK], s[BLOCK];
    int64_t k = 0;
    for (int64_t b = block_lo; b < block_hi; b++) {
        const int64_t lo = b * BLOCK, hi = lo + BLOCK;
        while (k < nseg && seg[2 * k + 1] <= lo) k++;
        if (k == nseg || seg[2 * k] >= hi) continue;   /* no segment in this block */
        uint8_t *m_row = m_rows + b * ROW_BYTES, *v_row = v_rows + b * ROW_BYTES;
        decode_row(m_row, m);
        decode_row(v_row, s);
        int64_t done = lo;
        for (int64_t j = k; j < nseg && seg[2 * j] < hi; j++) {
            const int64_t a = seg[2 * j] > lo ? seg[2 * j] : lo;
            const int64_t e = seg[2 * j + 1] < hi ? seg[2 * j + 1] : hi;
            reroot(s, done - lo, a - lo);
            update_any(a, e, lo, m, s, param, param_kind, out, out_kind, grad, grad_kind, grad_scale,
                       hyper + H_COUNT * j);
            done = e;
        }
        reroot(s, done - lo, BLOCK);
        encode_row(m, m_row, table + ((dither_m + lo) & DITHER_MASK));
        encode_row(s, v_row, table + ((dither_v + lo) & DITHER_MASK));
    }
    return 0;
}
