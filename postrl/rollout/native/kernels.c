/* Fused fp32 CPU kernels for the native engine's decode step (see kernels.py).
 *
 * Built at first use with the system C compiler (cc -O3 -march=native -fopenmp, see kernels.py)
 * and called through ctypes on tensor data pointers.
 *
 * Arithmetic follows the HF reference formulas: RMSNorm is w * (x * (1 / sqrt(mean(x^2) + eps))),
 * RoPE is x*cos + rotate_half(x)*sin. The softmax uses exp(s - max) with a polynomial exp (range
 * reduction to [-ln2/2, ln2/2], degree-6 polynomial, ~1 ulp). Summation order and fused
 * multiply-adds differ from torch's kernels, so results agree to float rounding (~1e-6), not
 * bit for bit.
 *
 * Layouts (all contiguous, row-major):
 *   qkv    (B, (H + 2*Hkv) * D)   q heads, then k heads, then v heads
 *   cache  (S, Hkv, Tmax, D)      one layer of the prefix store or of the slot store
 *   out    (B, H * D)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h" /* exp_nonpos, dot: postrl/kernels/simd.h */

static inline void rms_row(const float *x, const float *w, float *o, int64_t n, float eps) {
    float ss = dot(x, x, n);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = w[i] * (x[i] * inv);
}

/* Row loops go parallel over torch's OpenMP threads only when there is enough work (a decode
 * step's 128 x 256 rows are cheaper on one thread than the fork/join). */
#define PAR_MIN_ELEMS 65536
#ifdef _OPENMP
#include <omp.h>
#define TOP_LEVEL (!omp_in_parallel()) /* inside a row-split step every loop is already one thread's share */
#else
#define TOP_LEVEL 1
#endif

/* out[r] = w * (x[r] / rms(x[r])) for r < rows. */
void postrl_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (TOP_LEVEL && rows * dim >= PAR_MIN_ELEMS)
#endif
    for (int64_t r = 0; r < rows; r++) rms_row(x + r * dim, w, out + r * dim, dim, eps);
}

/* out[r, i] = silu(gu[r, i]) * gu[r, I + i]: SwiGLU on the fused gate/up projection (rows, 2I).
 * silu(x) = x * sigmoid(x), sigmoid from exp(-|x|) so the exponent is never positive. */
void postrl_silu_mul(const float *gu, float *out, int64_t rows, int64_t I) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (TOP_LEVEL && rows * I >= PAR_MIN_ELEMS)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *o = out + r * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            const float x = g[i], e = exp_nonpos(x < 0.0f ? x : -x);
            const float sig = x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
            o[i] = x * sig * u[i];
        }
    }
}

static inline void rope_head(float *restrict x, const float *restrict c, const float *restrict s, int64_t D) {
    const int64_t half = D / 2;
    float *restrict hi = x + half;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = hi[i];
        x[i] = a * c[i] + (-b) * s[i];
        hi[i] = b * c[half + i] + a * s[half + i];
    }
}

/* In place on qkv (N rows): optional q/k RMSNorm over head_dim (Qwen3), RoPE on the q and k
 * heads of row r at position pos[r]; then its k and v heads are written to kcache / vcache
 * (S, Hkv, Tmax, D) at slot[r], offset off[r]. cos/sin: (T_rope, D) plain (not sign-folded)
 * tables. Decode: one row per running sequence; prefill: one row per prompt token. */
void postrl_rope_kv(float *qkv, int64_t N, int64_t H, int64_t Hkv, int64_t D, const float *cos_t,
                    const float *sin_t, const int64_t *pos, const int64_t *slot, const int64_t *off,
                    const float *q_norm, const float *k_norm, float eps, float *kcache, float *vcache,
                    int64_t Tmax) {
    const int64_t row = (H + 2 * Hkv) * D;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (TOP_LEVEL && N * row >= PAR_MIN_ELEMS / 2) /* scattered cache writes: more misses in flight */
#endif
    for (int64_t b = 0; b < N; b++) {
        float nbuf[1024];
        float *r = qkv + b * row;
        const float *c = cos_t + pos[b] * D, *s = sin_t + pos[b] * D;
        for (int64_t h = 0; h < H + Hkv; h++) {
            float *x = r + h * D;
            const float *nw = h < H ? q_norm : k_norm;
            if (nw) {
                rms_row(x, nw, nbuf, D, eps);
                for (int64_t i = 0; i < D; i++) x[i] = nbuf[i];
            }
            rope_head(x, c, s, D);
        }
        for (int64_t j = 0; j < Hkv; j++) {
            float *kd = kcache + ((slot[b] * Hkv + j) * Tmax + off[b]) * D;
            float *vd = vcache + ((slot[b] * Hkv + j) * Tmax + off[b]) * D;
            const float *ks = r + (H + j) * D, *vs = r + (H + Hkv + j) * D;
            for (int64_t i = 0; i < D; i++) {
                kd[i] = ks[i];
                vd[i] = vs[i];
            }
        }
    }
}

typedef struct {
    const float *qkv, *pk, *pv, *kc, *vc;
    const int64_t *pid, *plen, *pos;
    float *out;
    int64_t b0, b1, H, Hkv, D, Tmax;
    float scale;
    int status;
} attn_job;

/* 8-float vectors (GCC/Clang vector extension): AVX2/AVX-512 ymm on x86, 2 x NEON on arm64.
 * Loads/stores go through memcpy, so no alignment is assumed. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 ld8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void st8(float *p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

static inline float hsum8(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* s[g*ld + t] = scale * q_g . K[t] for t < n, g < G; q: G heads of D floats (D % 8 == 0). Each K
 * row pair is loaded once for all G heads (independent accumulators for ILP). */
/* Software prefetch PF_AHEAD rows ahead within a K or V stream. The completion K/V come from
 * memory, in short runs (one per head and sequence) split over 4 KB pages, which hardware
 * prefetchers do not cross: measured 10 -> 22 GB/s at 2 threads (T = 100, 128 sequences). */
#define PF_AHEAD 8

static inline void prefetch_row(const float *row, int64_t D) {
    const char *a = (const char *)row;
    for (int64_t z = 0; z < D * (int64_t)sizeof(float); z += 64) __builtin_prefetch(a + z, 0, 3);
}

static void scores_g(const float *q, int64_t G, const float *K, int64_t n, int64_t D, float scale, float *s,
                     int64_t ld) {
    const int64_t nv = D / 8;
    int64_t t = 0;
    for (; t + 1 < n; t += 2) {
        const float *k0 = K + t * D, *k1 = k0 + D;
        if (t + PF_AHEAD + 1 < n) {
            prefetch_row(k0 + PF_AHEAD * D, D);
            prefetch_row(k1 + PF_AHEAD * D, D);
        }
        int64_t g = 0;
        for (; g + 1 < G; g += 2) {
            const float *q0 = q + g * D, *q1 = q0 + D;
            v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0};
            for (int64_t c = 0; c < nv; c++) {
                v8 x0 = ld8(k0 + 8 * c), x1 = ld8(k1 + 8 * c), y0 = ld8(q0 + 8 * c), y1 = ld8(q1 + 8 * c);
                a00 += y0 * x0;
                a01 += y0 * x1;
                a10 += y1 * x0;
                a11 += y1 * x1;
            }
            s[g * ld + t] = hsum8(a00) * scale;
            s[g * ld + t + 1] = hsum8(a01) * scale;
            s[(g + 1) * ld + t] = hsum8(a10) * scale;
            s[(g + 1) * ld + t + 1] = hsum8(a11) * scale;
        }
        for (; g < G; g++) {
            v8 a0 = {0}, a1 = {0};
            for (int64_t c = 0; c < nv; c++) {
                v8 y = ld8(q + g * D + 8 * c);
                a0 += y * ld8(k0 + 8 * c);
                a1 += y * ld8(k1 + 8 * c);
            }
            s[g * ld + t] = hsum8(a0) * scale;
            s[g * ld + t + 1] = hsum8(a1) * scale;
        }
    }
    for (; t < n; t++) {
        const float *k0 = K + t * D;
        for (int64_t g = 0; g < G; g++) {
            v8 a0 = {0};
            for (int64_t c = 0; c < nv; c++) a0 += ld8(q + g * D + 8 * c) * ld8(k0 + 8 * c);
            s[g * ld + t] = hsum8(a0) * scale;
        }
    }
}

/* o[g] += sum_t p[g*ld + t] * V[t] for g < G (o: G x D floats). Blocks of 2 heads x 32 columns
 * keep 8 accumulators in registers while t streams over the (L1-resident) V rows. */
static void pv_g(const float *p, int64_t ld, int64_t G, const float *V, int64_t n, int64_t D, float *o) {
    for (int64_t c = 0; c < D; c += 32) {
        const int64_t w = D - c < 32 ? D - c : 32; /* 8, 16, 24 or 32 columns */
        int64_t g = 0;
        for (; g < G; g += 2) {
            const int two = g + 1 < G;
            const float *p0 = p + g * ld, *p1 = p + (g + two) * ld;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            if (w == 32) {
                for (int64_t t = 0; t < n; t++) {
                    const float *v = V + t * D + c;
                    if (c == 0 && g == 0 && t + PF_AHEAD < n) prefetch_row(V + (t + PF_AHEAD) * D, D);
                    v8 v0 = ld8(v), v1 = ld8(v + 8), v2 = ld8(v + 16), v3 = ld8(v + 24);
                    const float x = p0[t], y = p1[t];
                    a0 += x * v0; a1 += x * v1; a2 += x * v2; a3 += x * v3;
                    b0 += y * v0; b1 += y * v1; b2 += y * v2; b3 += y * v3;
                }
            } else {
                for (int64_t t = 0; t < n; t++) {
                    const float *v = V + t * D + c;
                    if (c == 0 && g == 0 && t + PF_AHEAD < n) prefetch_row(V + (t + PF_AHEAD) * D, D);
                    const float x = p0[t], y = p1[t];
                    v8 v0 = ld8(v);
                    a0 += x * v0; b0 += y * v0;
                    if (w > 8) { v8 v1 = ld8(v + 8); a1 += x * v1; b1 += y * v1; }
                    if (w > 16) { v8 v2 = ld8(v + 16); a2 += x * v2; b2 += y * v2; }
                }
            }
            v8 acc[2][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}};
            for (int h = 0; h <= two; h++)
                for (int64_t k = 0; k < w / 8; k++) {
                    float *dst = o + (g + h) * D + c + 8 * k;
                    st8(dst, ld8(dst) + acc[h][k]);
                }
        }
    }
}

/* ---- 16-wide variants (head_dim % 16 == 0), used only where a v16 is one register (AVX-512
 * zmm, 32 of them). The score of a K row is a dot product over head_dim; rather than reducing
 * each one horizontally (~10 shuffle/add ops per score), 16 accumulators (8 rows x 2 heads) are
 * reduced together by a transpose-and-add tree: 15 pair steps for 16 scores. On AVX2 a v16 is
 * two of the 16 ymm registers, so the 16 accumulators alone overflow the register file and the
 * loops spill: decode attention measured 4x slower than with the v8 variants there (an
 * x86-64-v3 build on an AVX-512 Xeon). On arm64 a v16 is four of 32 NEON registers, the same
 * overflow (not measured there): every ISA without AVX-512 takes the v8 variants. */
#if defined(__AVX512F__)
#define ATTN_G16 1
#else
#define ATTN_G16 0
#endif
#if ATTN_G16
typedef float v16 __attribute__((vector_size(64)));

static inline v16 ld16(const float *p) {
    v16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void st16(float *p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

#define SHUF __builtin_shufflevector
/* a: 16 partials of row i, b: of row j -> lanes 0-7 hold 8 partials of i, lanes 8-15 of j */
static inline v16 fold2(v16 a, v16 b) {
    return SHUF(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
/* two vectors of (8, 8) partials -> (4, 4, 4, 4): rows of a, then rows of b */
static inline v16 fold4(v16 a, v16 b) {
    return SHUF(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUF(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
/* (4 x 4) + (4 x 4) -> 8 rows x 2 partials */
static inline v16 fold8(v16 a, v16 b) {
    return SHUF(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUF(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
/* (8 x 2) + (8 x 2) -> 16 sums */
static inline v16 fold16(v16 a, v16 b) {
    return SHUF(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUF(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef SHUF

/* lane i of the result = the sum of the 16 lanes of a[i] */
static inline v16 hsum16x16(const v16 *a) {
    v16 l1[8], l2[4];
    for (int j = 0; j < 8; j++) l1[j] = fold2(a[2 * j], a[2 * j + 1]);
    for (int j = 0; j < 4; j++) l2[j] = fold4(l1[2 * j], l1[2 * j + 1]);
    return fold16(fold8(l2[0], l2[1]), fold8(l2[2], l2[3]));
}

static inline float hsum16(v16 a) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += a[i];
    return s;
}

/* scores_g for head_dim % 16 == 0: blocks of 8 K rows (L1-resident while every head pair reads
 * them), 16 dot products per block and head pair reduced at once. */
static void scores_g16(const float *q, int64_t G, const float *K, int64_t n, int64_t D, float scale, float *s,
                       int64_t ld) {
    const int64_t nv = D / 16;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const float *k = K + t * D;
        if (t + 8 + PF_AHEAD <= n)
            for (int r = 0; r < PF_AHEAD; r++) prefetch_row(k + (8 + r) * D, D);
        for (int64_t g = 0; g < G; g += 2) {
            const int two = g + 1 < G;
            const float *q0 = q + g * D, *q1 = q + (g + two) * D;
            v16 acc[16];
            for (int r = 0; r < 16; r++) acc[r] = (v16){0};
            for (int64_t c = 0; c < nv; c++) {
                const v16 x = ld16(q0 + 16 * c), y = ld16(q1 + 16 * c);
                for (int r = 0; r < 8; r++) {
                    const v16 kr = ld16(k + r * D + 16 * c);
                    acc[r] += x * kr;
                    acc[8 + r] += y * kr;
                }
            }
            const v16 sum = hsum16x16(acc) * scale;
            for (int r = 0; r < 8; r++) s[g * ld + t + r] = sum[r];
            if (two)
                for (int r = 0; r < 8; r++) s[(g + 1) * ld + t + r] = sum[8 + r];
        }
    }
    for (; t < n; t++)
        for (int64_t g = 0; g < G; g++) {
            v16 a = {0};
            for (int64_t c = 0; c < nv; c++) a += ld16(q + g * D + 16 * c) * ld16(K + t * D + 16 * c);
            s[g * ld + t] = hsum16(a) * scale;
        }
}

/* pv_g for head_dim % 16 == 0: blocks of 2 heads x 64 columns (8 accumulators). */
static void pv_g16(const float *p, int64_t ld, int64_t G, const float *V, int64_t n, int64_t D, float *o) {
    for (int64_t c = 0; c < D; c += 64) {
        const int64_t w = D - c < 64 ? (D - c) / 16 : 4; /* 1..4 vectors */
        for (int64_t g = 0; g < G; g += 2) {
            const int two = g + 1 < G;
            const float *p0 = p + g * ld, *p1 = p + (g + two) * ld;
            v16 a[4] = {{0}, {0}, {0}, {0}}, b[4] = {{0}, {0}, {0}, {0}};
            if (w == 4) {
                for (int64_t t = 0; t < n; t++) {
                    const float *v = V + t * D + c;
                    if (c == 0 && g == 0 && t + PF_AHEAD < n) prefetch_row(V + (t + PF_AHEAD) * D, D);
                    const v16 v0 = ld16(v), v1 = ld16(v + 16), v2 = ld16(v + 32), v3 = ld16(v + 48);
                    const float x = p0[t], y = p1[t];
                    a[0] += x * v0; a[1] += x * v1; a[2] += x * v2; a[3] += x * v3;
                    b[0] += y * v0; b[1] += y * v1; b[2] += y * v2; b[3] += y * v3;
                }
            } else {
                for (int64_t t = 0; t < n; t++) {
                    const float *v = V + t * D + c;
                    if (c == 0 && g == 0 && t + PF_AHEAD < n) prefetch_row(V + (t + PF_AHEAD) * D, D);
                    const float x = p0[t], y = p1[t];
                    for (int64_t k = 0; k < w; k++) {
                        const v16 vk = ld16(v + 16 * k);
                        a[k] += x * vk;
                        b[k] += y * vk;
                    }
                }
            }
            for (int64_t k = 0; k < w; k++) {
                float *d0 = o + g * D + c + 16 * k;
                st16(d0, ld16(d0) + a[k]);
                if (two) {
                    float *d1 = o + (g + 1) * D + c + 16 * k;
                    st16(d1, ld16(d1) + b[k]);
                }
            }
        }
    }
}

#endif /* ATTN_G16 */

/* Rows b0..b1-1: each query head attends its prompt (prefix row pid[b], positions < plen[b])
 * and its own completion (slot b, offsets 0..pos[b]-plen[b]) under one softmax. */
static void attn_rows(attn_job *j) {
    const int64_t H = j->H, Hkv = j->Hkv, D = j->D, Tmax = j->Tmax, G = H / Hkv;
    const int64_t row = (H + 2 * Hkv) * D;
    int64_t nmax = 1;
    for (int64_t b = j->b0; b < j->b1; b++)
        if (j->pos[b] + 1 > nmax) nmax = j->pos[b] + 1; /* prompt + own tokens */
    float *sc = (float *)malloc(sizeof(float) * (size_t)(G * nmax));
    if (!sc) {
        j->status = 1;
        return;
    }
    for (int64_t b = j->b0; b < j->b1; b++) {
        const int64_t n1 = j->plen[b], n2 = j->pos[b] - j->plen[b] + 1, n = n1 + n2;
        for (int64_t kh = 0; kh < Hkv; kh++) {
            const int64_t pre = (j->pid[b] * Hkv + kh) * Tmax * D, own = (b * Hkv + kh) * Tmax * D;
            const float *q = j->qkv + b * row + kh * G * D;
            /* stream heads: this head's first V rows (read after the scores) and the next head's
             * first K rows, so no stream starts with a cold miss */
            for (int64_t t = 0; t < PF_AHEAD; t++) {
                if (t < n1) prefetch_row(j->pv + pre + t * D, D);
                if (t < n2) prefetch_row(j->vc + own + t * D, D);
            }
            {
                const int64_t nb = kh + 1 < Hkv ? b : b + 1, nkh = kh + 1 < Hkv ? kh + 1 : 0;
                if (nb < j->b1) {
                    const int64_t npre = (j->pid[nb] * Hkv + nkh) * Tmax * D, nown = (nb * Hkv + nkh) * Tmax * D;
                    for (int64_t t = 0; t < PF_AHEAD; t++) {
                        if (t < j->plen[nb]) prefetch_row(j->pk + npre + t * D, D);
                        if (t <= j->pos[nb] - j->plen[nb]) prefetch_row(j->kc + nown + t * D, D);
                    }
                }
            }
#if ATTN_G16
            if (D % 16 == 0) {
                scores_g16(q, G, j->pk + pre, n1, D, j->scale, sc, n);
                scores_g16(q, G, j->kc + own, n2, D, j->scale, sc + n1, n);
            } else
#endif
            {
                scores_g(q, G, j->pk + pre, n1, D, j->scale, sc, n);
                scores_g(q, G, j->kc + own, n2, D, j->scale, sc + n1, n);
            }
            for (int64_t g = 0; g < G; g++) {
                float *s = sc + g * n, m;
                const float inv = 1.0f / exp_shifted(s, n, &m);
#pragma omp simd
                for (int64_t t = 0; t < n; t++) s[t] *= inv;
            }
            float *o = j->out + b * H * D + kh * G * D;
            for (int64_t c = 0; c < G * D; c++) o[c] = 0.0f;
#if ATTN_G16
            if (D % 16 == 0) {
                pv_g16(sc, n, G, j->pv + pre, n1, D, o);
                pv_g16(sc + n1, n, G, j->vc + own, n2, D, o);
            } else
#endif
            {
                pv_g(sc, n, G, j->pv + pre, n1, D, o);
                pv_g(sc + n1, n, G, j->vc + own, n2, D, o);
            }
        }
    }
    free(sc);
}

/* Decode attention for rows 0..B-1, split over `threads` OpenMP threads. Built with -fopenmp the
 * library shares torch's (already loaded) libgomp, so its pool is torch's pool: no second team
 * of spinning threads. Returns 0 on success, nonzero when a score buffer could not be allocated. */
int postrl_decode_attention(const float *qkv, const float *pk, const float *pv, const float *kc,
                            const float *vc, const int64_t *pid, const int64_t *plen,
                            const int64_t *pos, float *out, int64_t B, int64_t H, int64_t Hkv,
                            int64_t D, int64_t Tmax, float scale, int64_t threads) {
    if (threads < 1) threads = 1;
    if (threads > B) threads = B > 0 ? B : 1;
    int status = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(| : status) if (threads > 1)
#endif
    for (int64_t t = 0; t < threads; t++) {
        attn_job j = {qkv, pk, pv, kc, vc, pid, plen, pos, out, B * t / threads, B * (t + 1) / threads,
                      H, Hkv, D, Tmax, scale, 0};
        attn_rows(&j);
        status |= j.status;
    }
    return status;
}

/* ------------------------------------------------------------------------------------------
 * The whole decode step in one call: no Python, no dispatcher, no allocation per op. The GEMMs
 * go to the BLAS `sgemm_` that torch itself uses (resolved by kernels.py from torch's library
 * and passed in), so they are the same MKL/OpenBLAS kernels on the same OpenMP pool.
 */
typedef void (*sgemm_fn)(const char *ta, const char *tb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b,
                         const int *ldb, const float *beta, float *c, const int *ldc);

/* C (M x N, row-major) = X (M x K, row-major) . W^T (W: N x K row-major) + beta * C */
static void gemm_xwt(sgemm_fn gemm, const float *X, const float *W, float *C, int64_t M, int64_t N,
                     int64_t K, float beta) {
    const int m = (int)N, n = (int)M, k = (int)K, lda = (int)K, ldb = (int)K, ldc = (int)N;
    const float one = 1.0f;
    gemm("T", "N", &m, &n, &k, &one, W, &lda, X, &ldb, &beta, C, &ldc);
}

static void add_bias(float *C, const float *bias, int64_t M, int64_t N) {
    for (int64_t r = 0; r < M; r++) {
        float *c = C + r * N;
#pragma omp simd
        for (int64_t i = 0; i < N; i++) c[i] += bias[i];
    }
}

/* Per-layer pointer table, in this order (0 = absent). */
enum { L_LN1, L_WQKV, L_BQKV, L_WO, L_BO, L_QN, L_KN, L_LN2, L_WGU, L_WDOWN, L_K, L_V, L_PK, L_PV, L_N };

/* Rows b0..b1-1 of a decode step through every layer (see postrl_decode_step). Row-local from
 * the embedding to the logits: nothing couples two rows, so row ranges can run concurrently. */
static int decode_rows(sgemm_fn gemm, const int64_t *dims, const int64_t *layers, const float *embed,
                       const float *norm, const float *lm_head, const float *cos_t, const float *sin_t,
                       const int64_t *tokens, const int64_t *pos, const int64_t *plen, const int64_t *pid,
                       const int64_t *slot, int64_t *off, int64_t B, int64_t b0, int64_t b1, float eps,
                       float scale, int64_t threads, float *scratch, float *logits) {
    const int64_t hid = dims[0], I = dims[1], H = dims[2], Hkv = dims[3], D = dims[4], Tmax = dims[5],
                  V = dims[6], L = dims[7], QKV = (H + 2 * Hkv) * D, n = b1 - b0;
    /* scratch arrays hold all B rows; this range uses rows b0..b1-1 of each */
    float *x = scratch + b0 * hid, *h = scratch + B * hid + b0 * hid, *qkv0 = scratch + 2 * B * hid,
          *qkv = qkv0 + b0 * QKV, *att0 = qkv0 + B * QKV, *att = att0 + b0 * H * D,
          *gu = att0 + B * H * D + b0 * 2 * I, *act = att0 + B * H * D + B * 2 * I + b0 * I;
    int status = 0;
    for (int64_t b = b0; b < b1; b++) {
        const float *e = embed + tokens[b] * hid;
        for (int64_t i = 0; i < hid; i++) scratch[b * hid + i] = e[i];
        off[b] = pos[b] - plen[b];
    }
    for (int64_t li = 0; li < L; li++) {
        const int64_t *p = layers + li * L_N;
#define P(i) ((float *)(intptr_t)p[i])
        postrl_rms_norm(x, P(L_LN1), h, n, hid, eps);
        if (P(L_BQKV)) {
            for (int64_t b = 0; b < n; b++)
                for (int64_t i = 0; i < QKV; i++) qkv[b * QKV + i] = P(L_BQKV)[i];
            gemm_xwt(gemm, h, P(L_WQKV), qkv, n, QKV, hid, 1.0f);
        } else {
            gemm_xwt(gemm, h, P(L_WQKV), qkv, n, QKV, hid, 0.0f);
        }
        postrl_rope_kv(qkv, n, H, Hkv, D, cos_t, sin_t, pos + b0, slot + b0, off + b0, P(L_QN), P(L_KN), eps,
                       P(L_K), P(L_V), Tmax);
        if (threads > 1) {
            status |= postrl_decode_attention(qkv0, P(L_PK), P(L_PV), P(L_K), P(L_V), pid, plen, pos, att0, b1, H,
                                              Hkv, D, Tmax, scale, threads); /* b0 == 0 here */
        } else {
            attn_job j = {qkv0, P(L_PK), P(L_PV), P(L_K), P(L_V), pid, plen, pos, att0, b0, b1, H, Hkv, D, Tmax,
                          scale, 0};
            attn_rows(&j);
            status |= j.status;
        }
        gemm_xwt(gemm, att, P(L_WO), x, n, hid, H * D, 1.0f); /* x += att . Wo^T */
        if (P(L_BO)) add_bias(x, P(L_BO), n, hid);
        postrl_rms_norm(x, P(L_LN2), h, n, hid, eps);
        gemm_xwt(gemm, h, P(L_WGU), gu, n, 2 * I, hid, 0.0f);
        postrl_silu_mul(gu, act, n, I);
        gemm_xwt(gemm, act, P(L_WDOWN), x, n, hid, I, 1.0f); /* x += act . Wdown^T */
#undef P
    }
    postrl_rms_norm(x, norm, h, n, hid, eps);
    gemm_xwt(gemm, h, lm_head, logits + b0 * V, n, V, hid, 0.0f);
    return status;
}

/* One decode step for rows 0..B-1 (see forward.decode_fused for the math). `layers` holds
 * L_N pointers per layer; `scratch` >= B * (2*hidden + QKV + H*D + 3*I) floats; `logits` (B, V).
 * dims = {hidden, I, H, Hkv, D, Tmax, V, L}.
 *
 * row_split = 0: every op over all rows, each op parallel inside (GEMMs in BLAS, attention over
 * `threads`). row_split = 1: the rows are split over `threads` threads and each thread takes its
 * share through the whole step with single-threaded ops — one fork/join per step instead of
 * ~10 per layer, and one thread's memory-bound attention overlaps another's compute-bound GEMMs.
 * Returns 0, or nonzero when attention scratch could not be allocated. */
int postrl_decode_step(sgemm_fn gemm, const int64_t *dims, const int64_t *layers, const float *embed,
                       const float *norm, const float *lm_head, const float *cos_t, const float *sin_t,
                       const int64_t *tokens, const int64_t *pos, const int64_t *plen, const int64_t *pid,
                       const int64_t *slot, int64_t *off, int64_t B, float eps, float scale,
                       int64_t threads, int64_t row_split, float *scratch, float *logits) {
    if (threads < 1) threads = 1;
    if (!row_split || threads == 1 || B < 2 * threads)
        return decode_rows(gemm, dims, layers, embed, norm, lm_head, cos_t, sin_t, tokens, pos, plen, pid, slot,
                           off, B, 0, B, eps, scale, threads, scratch, logits);
    int status = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(| : status)
#endif
    for (int64_t t = 0; t < threads; t++)
        status |= decode_rows(gemm, dims, layers, embed, norm, lm_head, cos_t, sin_t, tokens, pos, plen, pid,
                              slot, off, B, B * t / threads, B * (t + 1) / threads, eps, scale, 1, scratch,
                              logits);
    return status;
}

/* ------------------------------------------------------------------------------------------
 * Sampling without top-k / top-p, the same arithmetic as sampler.sample_tokens: per row the
 * counter-based uniform u = hash(seed, counter) / 2^32 (lowbias32 chain), the inverse CDF over
 * softmax(logits / T) in vocabulary order (cumsum accumulated in double, as torch does), greedy
 * rows (T <= 0) take the first argmax; the returned log-prob is log_softmax(logits / T')[token]
 * with T' = 1 for greedy rows.
 */
static inline uint64_t mix32(uint64_t x) {
    const uint64_t m = 0xFFFFFFFFull;
    x &= m;
    x ^= x >> 16;
    x = (x * 0x7FEB352Dull) & m;
    x ^= x >> 15;
    x = (x * 0x846CA68Bull) & m;
    return x ^ (x >> 16);
}

static inline uint64_t counter_hash(int64_t seed, int64_t counter) {
    uint64_t h = mix32((uint64_t)(seed ^ 0x9E3779B9ll));
    h = mix32(h ^ ((uint64_t)(seed >> 32) * 0x85EBCA6Bull));
    return mix32(h ^ ((uint64_t)counter * 0xC2B2AE35ull));
}

/* scratch: B * V floats (one row each, so rows can go parallel). */
void postrl_sample(const float *logits, int64_t B, int64_t V, const float *temp, const int64_t *seeds,
                   const int64_t *counters, int64_t *tokens, float *logp, float *scratch) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (TOP_LEVEL && B * V >= PAR_MIN_ELEMS / 2)
#endif
    for (int64_t b = 0; b < B; b++) {
        const float *l = logits + b * V;
        const int greedy = temp[b] <= 0.0f;
        const float t = greedy ? 1.0f : temp[b];
        float *e = scratch + b * V;
        float m = l[0] / t;
        int64_t amax = 0;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < V; i++) {
            e[i] = l[i] / t;
            m = e[i] > m ? e[i] : m;
        }
        if (greedy)
            for (int64_t i = 1; i < V; i++)
                if (l[i] > l[amax]) amax = i; /* first maximum, as torch.argmax */
        const float ly = (l[amax] / t - m); /* greedy: the argmax's scaled logit minus max */
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < V; i++) {
            e[i] = exp_nonpos(e[i] - m);
            sum += e[i];
        }
        const float ls = logf(sum);
        int64_t y = amax;
        if (!greedy) {
            const float u = (float)((double)counter_hash(seeds[b], counters[b]) / 4294967296.0);
            double acc = 0.0;
            for (int64_t i = 0; i < V; i++) { /* cdf_i, stored over e */
                acc += (double)(e[i] / sum);
                e[i] = (float)acc;
            }
            const float target = u * e[V - 1];
            y = V - 1;
            for (int64_t i = 0; i < V; i++)
                if (e[i] > target) {
                    y = i;
                    break;
                }
            logp[b] = (l[y] / t - m) - ls; /* torch's order: (x - max) - log(sum) */
        } else {
            logp[b] = ly - ls;
        }
        tokens[b] = y;
    }
}
