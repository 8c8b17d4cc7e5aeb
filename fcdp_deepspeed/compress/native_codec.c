/* The blockwise codec's fused CPU kernel (fcdp_deepspeed/compress/native.py loads it; [Note: the fused CPU codec]).
 *
 * Each function computes, element for element, the same IEEE fp32 operations on the same operands in the same
 * order as BlockCodec's torch ops (compress/quant.py), so the bytes and the decoded bits are theirs: it must be built
 * without -ffast-math and with -ffp-contract=off (no fused multiply-adds). A tile of T blocks is held as columns
 * (element i of block t at tile[i * T + t]) so that every butterfly stage and every elementwise step is a run of T
 * independent lanes the compiler vectorises, in L1, one pass over memory in and one out. Unrotated blocks are
 * quantized where they lie, one contiguous block at a time.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define T 16

/* Round-half-to-even of |v| <= 2^22 (torch.round's rounding), by the 1.5 * 2^23 trick. */
static const float MAGIC = 12582912.0f;

static void butterflies(float *tile, int64_t w) {
    for (int64_t h = 1; h < w; h <<= 1)
        for (int64_t g = 0; g < w; g += 2 * h)
            for (int64_t k = g; k < g + h; k++) {
                float *a = tile + k * T, *b = tile + (k + h) * T;
                for (int t = 0; t < T; t++) {
                    float x = a[t], y = b[t];
                    a[t] = x + y;
                    b[t] = x - y;
                }
            }
}

/* |x| as the bits of a non-negative float: their order as integers is the floats' order, NaN above inf. */
static inline uint32_t magnitude(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u & 0x7fffffffu;
}

static inline float from_magnitude(uint32_t m) {
    float f;
    if (m > 0x7f800000u) return NAN; /* some element was NaN */
    memcpy(&f, &m, 4);
    return f;
}

/* Per column: the largest |x| (NaN if any element is NaN), as quant._absmax. */
static void absmax(const float *tile, int64_t w, float *out) {
    uint32_t m[T];
    for (int t = 0; t < T; t++) m[t] = 0;
    for (int64_t i = 0; i < w; i++)
        for (int t = 0; t < T; t++) {
            uint32_t a = magnitude(tile[i * T + t]);
            m[t] = a > m[t] ? a : m[t];
        }
    for (int t = 0; t < T; t++) out[t] = from_magnitude(m[t]);
}

/* The largest |x| of one contiguous block (NaN if any element is NaN). */
static float absmax_run(const float *x, int64_t w) {
    uint32_t m = 0;
    for (int64_t i = 0; i < w; i++) {
        uint32_t a = magnitude(x[i]);
        m = a > m ? a : m;
    }
    return from_magnitude(m);
}

/* The code of one value: v / safe, clamped (before rounding: the same integers, NaN kept), rounded half to even,
 * NaN -> 0 (quant.BlockCodec.encode_rows: div, round_, clamp_, nan_to_num_). */
static inline float code(float v, float safe, float q) {
    v = v / safe;
    v = v < -q ? -q : (v > q ? q : v);
    v = (v + MAGIC) - MAGIC;
    return v != v ? 0.0f : v;
}

static inline float scale_of(float a, float q) { return isfinite(a) ? a / q : NAN; }

static inline float safe_of(float scale) { return scale > 0.0f && isfinite(scale) ? scale : 1.0f; }

/* The rotation of each column (quant._guard, _rotate_columns_ and the final scaling): x * down, butterflies,
 * * s, * (1 / down). */
static void rotate(float *tile, int64_t w, float s) {
    float a[T], down[T], up[T];
    const float thr = FLT_MAX / (float)w, small = 1.0f / (float)w;
    absmax(tile, w, a);
    for (int t = 0; t < T; t++) { down[t] = a[t] > thr ? small : 1.0f; up[t] = 1.0f / down[t]; }
    for (int64_t i = 0; i < w; i++)
        for (int t = 0; t < T; t++) tile[i * T + t] *= down[t];
    butterflies(tile, w);
    for (int64_t i = 0; i < w; i++)
        for (int t = 0; t < T; t++) {
            float v = tile[i * T + t] * s;
            tile[i * T + t] = v * up[t];
        }
}

/* One block's codes (element i at codes[i * stride]) into its bytes: int8, or int4 pairs as (lo + 8) | (hi + 8) << 4
 * (quant: lo + 16 hi + 136, exact small integers). */
static inline void store_codes(const float *codes, int64_t stride, int bits, int64_t w, uint8_t *dst) {
    if (bits == 8) {
        for (int64_t i = 0; i < w; i++) ((int8_t *)dst)[i] = (int8_t)codes[i * stride];
    } else {
        for (int64_t i = 0; i < w / 2; i++)
            dst[i] = (uint8_t)((int)codes[2 * i * stride] + 16 * (int)codes[(2 * i + 1) * stride] + 136);
    }
}

/* One block's bytes -> code * scale (element i at dst[i * stride]). */
static inline void load_codes(const uint8_t *src, int bits, int64_t w, float scale, float *dst, int64_t stride) {
    if (bits == 8) {
        for (int64_t i = 0; i < w; i++) dst[i * stride] = (float)((const int8_t *)src)[i] * scale;
    } else {
        for (int64_t i = 0; i < w / 2; i++) {
            dst[2 * i * stride] = (float)((int)(src[i] & 15) - 8) * scale;
            dst[(2 * i + 1) * stride] = (float)((int)(src[i] >> 4) - 8) * scale;
        }
    }
}

/* Unrotated blocks need no columns: each block is quantized where it lies. */
static int encode_plain(const float *x, int64_t rows, int64_t n, int64_t ldx, uint8_t *out, int64_t ldo, int64_t w,
                        int bits, int64_t nb, float q) {
    const int64_t head = nb * 4;
    float *pad = malloc(sizeof(float) * (size_t)w), *codes = malloc(sizeof(float) * (size_t)w);
    if (!pad || !codes) { free(pad); free(codes); return 1; }
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        uint8_t *o = out + r * ldo;
        for (int64_t blk = 0; blk < nb; blk++) {
            const float *b = xr + blk * w;
            int64_t len = n - blk * w;
            if (len < w) { /* the zero-padded last block */
                len = len < 0 ? 0 : len;
                memcpy(pad, b, sizeof(float) * (size_t)len);
                memset(pad + len, 0, sizeof(float) * (size_t)(w - len));
                b = pad;
            }
            float scale = scale_of(absmax_run(b, w), q), safe = safe_of(scale);
            memcpy(o + blk * 4, &scale, 4);
            for (int64_t i = 0; i < w; i++) codes[i] = code(b[i], safe, q);
            store_codes(codes, 1, bits, w, o + head + blk * (bits == 8 ? w : w / 2));
        }
    }
    free(pad);
    free(codes);
    return 0;
}

static int decode_plain(const uint8_t *p, int64_t rows, int64_t ldp, float *out, int64_t ldo, int64_t w, int bits,
                        int64_t nb) {
    const int64_t head = nb * 4;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *pr = p + r * ldp;
        for (int64_t blk = 0; blk < nb; blk++) {
            float scale;
            memcpy(&scale, pr + blk * 4, 4);
            load_codes(pr + head + blk * (bits == 8 ? w : w / 2), bits, w, scale, out + r * ldo + blk * w, 1);
        }
    }
    return 0;
}

/* Rows of n fp32 values (row r at x + r * ldx) -> packed rows (row r at out + r * ldo): BlockCodec.encode_rows. */
int fcdp_encode_rows(const float *x, int64_t rows, int64_t n, int64_t ldx, uint8_t *out, int64_t ldo, int64_t w,
                     int bits, int rot, double s) {
    const int64_t nb = n > 0 ? (n + w - 1) / w : 1, head = nb * 4;
    const float q = bits == 8 ? 127.0f : 7.0f;
    if (!rot) return encode_plain(x, rows, n, ldx, out, ldo, w, bits, nb, q);
    float *tile = malloc(sizeof(float) * (size_t)(w * T));
    if (!tile) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        uint8_t *o = out + r * ldo;
        for (int64_t b0 = 0; b0 < nb; b0 += T) {
            float a[T], safe[T];
            for (int t = 0; t < T; t++) {
                int64_t start = (b0 + t) * w, len = b0 + t < nb ? n - start : 0;
                len = len < 0 ? 0 : (len > w ? w : len);
                for (int64_t i = 0; i < len; i++) tile[i * T + t] = xr[start + i];
                for (int64_t i = len; i < w; i++) tile[i * T + t] = 0.0f;
            }
            rotate(tile, w, (float)s);
            absmax(tile, w, a);
            for (int t = 0; t < T; t++) {
                float scale = scale_of(a[t], q);
                safe[t] = safe_of(scale);
                if (b0 + t < nb) memcpy(o + (b0 + t) * 4, &scale, 4);
            }
            for (int64_t i = 0; i < w; i++)
                for (int t = 0; t < T; t++) tile[i * T + t] = code(tile[i * T + t], safe[t], q);
            for (int t = 0; t < T && b0 + t < nb; t++)
                store_codes(tile + t, T, bits, w, o + head + (b0 + t) * (bits == 8 ? w : w / 2));
        }
    }
    free(tile);
    return 0;
}

/* Packed rows (row r at p + r * ldp) -> rows of nb * w fp32 values (row r at out + r * ldo):
 * BlockCodec.decode_rows before its narrow to numel. */
int fcdp_decode_rows(const uint8_t *p, int64_t rows, int64_t ldp, int64_t numel, float *out, int64_t ldo, int64_t w,
                     int bits, int rot, double s) {
    const int64_t nb = numel > 0 ? (numel + w - 1) / w : 1, head = nb * 4;
    if (!rot) return decode_plain(p, rows, ldp, out, ldo, w, bits, nb);
    float *tile = malloc(sizeof(float) * (size_t)(w * T));
    if (!tile) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *pr = p + r * ldp;
        float *o = out + r * ldo;
        for (int64_t b0 = 0; b0 < nb; b0 += T) {
            for (int t = 0; t < T; t++) {
                int64_t blk = b0 + t;
                if (blk >= nb) {
                    for (int64_t i = 0; i < w; i++) tile[i * T + t] = 0.0f;
                    continue;
                }
                float scale;
                memcpy(&scale, pr + blk * 4, 4);
                load_codes(pr + head + blk * (bits == 8 ? w : w / 2), bits, w, scale, tile + t, T);
            }
            rotate(tile, w, (float)s);
            for (int t = 0; t < T && b0 + t < nb; t++) {
                float *d = o + (b0 + t) * w;
                for (int64_t i = 0; i < w; i++) d[i] = tile[i * T + t];
            }
        }
    }
    free(tile);
    return 0;
}
