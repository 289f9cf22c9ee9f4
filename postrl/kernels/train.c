/* Fused fp32 CPU kernels for the training forward and backward (see train.py).
 *
 * Built at first use by kernels/build.py (cc -O3 -march=native -fopenmp) and called through
 * ctypes on tensor data pointers; train.py wraps each forward/backward pair in an autograd
 * Function. What they replace are the small memory-bound ops around the update's GEMMs, each a
 * dispatch, an allocation and a pass over memory in eager torch: RMSNorm, SwiGLU and the
 * padding-free attention's gathers, batched matmuls, masks, softmax and scatter-adds.
 *
 * Determinism: every loop has a fixed order; work is split over threads by rows, by fixed
 * chunks or by (group, kv head) jobs whose outputs no other job touches, so no result depends on
 * the thread count or on which thread ran a job (no atomics, no reductions across threads).
 *
 * Formulas (the HF references, float rounding apart):
 *   RMSNorm   y = w * (x * r),  r = 1 / sqrt(mean(x^2) + eps)
 *             dx = r * (g - xh * mean(g * xh)),  g = dy * w,  xh = x * r;  dw = sum_rows dy * xh
 *   SwiGLU    h = silu(a) * u,  silu(a) = a * sigmoid(a)
 *             da = dh * u * sigmoid(a) * (1 + a * (1 - sigmoid(a))),  du = dh * silu(a)
 *   RoPE      y = x * cos + rotate_half(x) * sin,  rotate_half(x) = [-x2, x1]
 *             dx = dy * cos + rotate_half^T(dy * sin),  rotate_half^T(z) = [z2, -z1], which is
 *             the same kernel on dy with sin' = -[sin2, sin1] (train.py passes it)
 *   attention o_i = sum_j p_ij v_j,  p_ij = softmax_j(scale * q_i . k_j) over the keys query i may
 *             see; lse_i = log sum_j exp(scale * q_i . k_j) is kept for the backward, which
 *             recomputes p_ij (FlashAttention-2's, Dao 2023, arXiv 2307.08691, eq. in sec. 2.2):
 *             dv_j += p_ij do_i,  ds_ij = p_ij (do_i . v_j - do_i . o_i),
 *             dq_i += scale ds_ij k_j,  dk_j += scale ds_ij q_i.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Denormals (fp32 below 1.2e-38: tiny probabilities times gradients) take a microcode path
 * ~100x slower on x86. Each thread of the heavy kernels flushes them (FTZ/DAZ) for the kernel's
 * duration and restores its own setting after, whatever torch.set_flush_denormal said when the
 * thread was created; values that small change no result above float rounding. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FTZ_ENTER const unsigned int mxcsr_saved_ = _mm_getcsr(); _mm_setcsr(mxcsr_saved_ | 0x8040u)
#define FTZ_LEAVE _mm_setcsr(mxcsr_saved_)
#else
#define FTZ_ENTER
#define FTZ_LEAVE
#endif

#define PAR_MIN_ELEMS 32768

/* ---------------------------------------------------------------- RMSNorm */

/* y[r] = w * x[r] * rstd[r]; rstd[r] = 1/sqrt(mean(x[r]^2) + eps) is written for the backward. */
void postrl_t_rms_fwd(const float *x, const float *w, float *y, float *rstd, int64_t rows,
                      int64_t dim, float eps, int threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= PAR_MIN_ELEMS)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        const float inv = 1.0f / sqrtf(dot(xr, xr, dim) / (float)dim + eps);
        rstd[r] = inv;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* dx (rows, dim); dw_part (chunks, dim): chunk c sums rows [c*rows/chunks, (c+1)*rows/chunks) in
 * order (the caller sums the chunks), so dw does not depend on the thread count. */
void postrl_t_rms_bwd(const float *x, const float *w, const float *rstd, const float *dy,
                      float *dx, float *dw_part, int64_t rows, int64_t dim, int64_t chunks,
                      int threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= PAR_MIN_ELEMS)
#endif
    for (int64_t c = 0; c < chunks; c++) {
        float *dw = dw_part + c * dim;
        memset(dw, 0, sizeof(float) * (size_t)dim);
        for (int64_t r = c * rows / chunks; r < (c + 1) * rows / chunks; r++) {
            const float *xr = x + r * dim, *dyr = dy + r * dim;
            float *dxr = dx + r * dim;
            const float inv = rstd[r];
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < dim; i++) acc += dyr[i] * w[i] * (xr[i] * inv);
            const float mean = acc / (float)dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) {
                const float xh = xr[i] * inv;
                dxr[i] = inv * (dyr[i] * w[i] - xh * mean);
                dw[i] += dyr[i] * xh;
            }
        }
    }
}

/* ---------------------------------------------------------------- SwiGLU */

static inline float sigmoid_of(float a) {
    const float e = exp_nonpos(a < 0.0f ? a : -a);
    return a < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

void postrl_t_swiglu_fwd(const float *a, const float *u, float *h, int64_t n, int threads) {
#ifdef _OPENMP
#pragma omp parallel for simd schedule(static) num_threads(threads) if (n >= PAR_MIN_ELEMS)
#endif
    for (int64_t i = 0; i < n; i++) h[i] = a[i] * sigmoid_of(a[i]) * u[i];
}

void postrl_t_swiglu_bwd(const float *a, const float *u, const float *dh, float *da, float *du,
                         int64_t n, int threads) {
#ifdef _OPENMP
#pragma omp parallel for simd schedule(static) num_threads(threads) if (n >= PAR_MIN_ELEMS)
#endif
    for (int64_t i = 0; i < n; i++) {
        const float s = sigmoid_of(a[i]);
        da[i] = dh[i] * u[i] * (s * (1.0f + a[i] * (1.0f - s)));
        du[i] = dh[i] * (a[i] * s);
    }
}

/* ---------------------------------------------------------------- RoPE */

/* out (N, H, D) contiguous from x (token n, head h at x + n*xt + h*xh, D contiguous) rotated by
 * the token's cos/sin rows (N, D). */
void postrl_t_rope_fwd(const float *x, int64_t xt, int64_t xh, const float *cos, const float *sin,
                       float *out, int64_t N, int64_t H, int64_t D, int threads) {
    const int64_t half = D / 2;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (N * H * D >= PAR_MIN_ELEMS)
#endif
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos + n * D, *s = sin + n * D;
        for (int64_t h = 0; h < H; h++) {
            const float *xi = x + n * xt + h * xh;
            float *o = out + (n * H + h) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = xi[i], b = xi[i + half];
                o[i] = a * c[i] - b * s[i];
                o[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* ---------------------------------------------------------------- attention over packed segments
 *
 * The packed row holds G groups one after another; group g's tokens are its segments
 * seg[grp_off[g]] .. seg[grp_off[g+1]-1], contiguous and in order: first its prompt, then each
 * of its responses. A prompt token attends causally within the prompt; a response token attends
 * to the whole prompt and causally within its own response. (Without prefix sharing every row is
 * a group of one prompt and one response.)
 *
 * q: token t, head h at q + t*qt + h*qh (the head's D floats contiguous); k, v alike with Hkv
 * heads. o (N, H, D) and lse (N, H) contiguous. One job per group: it owns the dq, dk and dv
 * rows of its group's tokens, so jobs never write the same memory. (Jobs per (group, kv head)
 * were tried: two threads then write neighbouring rows of the same tokens, and the backward ran
 * 2-4x slower on 2 threads than on one.)
 */

#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *q, *k, *v;
    int64_t qt, qh, kt, kh, vt, vh;
    int64_t H, Hkv, D;
    float scale;
    const int64_t *seg_start, *seg_len, *grp_off;
} attn_args;

/* The keys token t (in segment sg of its group, at offset i) sees: [p0, p0 + np) and [r0, t]. */
static inline void key_ranges(const attn_args *A, int64_t first, int64_t sg, int64_t i,
                              int64_t *p0, int64_t *np, int64_t *r0, int64_t *nr) {
    const int64_t ps = A->seg_start[first], pl = A->seg_len[first];
    if (sg == first) { /* a prompt token: causal within the prompt */
        *p0 = ps;
        *np = i + 1;
        *r0 = 0;
        *nr = 0;
    } else {
        *p0 = ps;
        *np = pl;
        *r0 = A->seg_start[sg];
        *nr = i + 1;
    }
}

INLINE float dotD(const float *a, const float *b, int64_t D) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}

INLINE void axpyD(float *y, float a, const float *x, int64_t D) {
#pragma omp simd
    for (int64_t d = 0; d < D; d++) y[d] += a * x[d];
}

/* scores of query qv against keys [p0, p0+np) then [r0, r0+nr) into s (np + nr) */
INLINE void scores(const attn_args *A, const float *qv, int64_t hk, int64_t p0, int64_t np,
                   int64_t r0, int64_t nr, float *s, const int64_t D) {
    const float *kb = A->k + hk * A->kh;
    for (int64_t j = 0; j < np; j++) s[j] = A->scale * dotD(qv, kb + (p0 + j) * A->kt, D);
    for (int64_t j = 0; j < nr; j++) s[np + j] = A->scale * dotD(qv, kb + (r0 + j) * A->kt, D);
}

static inline int64_t key_token(int64_t j, int64_t p0, int64_t np, int64_t r0) {
    return j < np ? p0 + j : r0 + (j - np);
}

INLINE void attn_fwd_job(const attn_args *A, int64_t g, int64_t hk, float *o, float *lse,
                         float *s, const int64_t D) {
    const int64_t H = A->H, gh = H / A->Hkv;
    const int64_t first = A->grp_off[g], last = A->grp_off[g + 1];
    const float *vb = A->v + hk * A->vh;
    for (int64_t sg = first; sg < last; sg++) {
        for (int64_t i = 0; i < A->seg_len[sg]; i++) {
            const int64_t t = A->seg_start[sg] + i;
            int64_t p0, np, r0, nr;
            key_ranges(A, first, sg, i, &p0, &np, &r0, &nr);
            const int64_t nk = np + nr;
            for (int64_t h = hk * gh; h < (hk + 1) * gh; h++) {
                scores(A, A->q + t * A->qt + h * A->qh, hk, p0, np, r0, nr, s, D);
                float m;
                const float l = exp_shifted(s, nk, &m);
                float *ov = o + (t * H + h) * D;
                memset(ov, 0, sizeof(float) * (size_t)D);
                const float inv = 1.0f / l;
                for (int64_t j = 0; j < nk; j++)
                    axpyD(ov, s[j] * inv, vb + key_token(j, p0, np, r0) * A->vt, D);
                lse[t * H + h] = m + logf(l);
            }
        }
    }
}

/* One query token t, all gh query heads of kv head hk at once: first each head's probabilities
 * p and score gradients ds over the token's keys (buffers P, DS: gh x nk), then one pass over
 * the keys that loads k_j and v_j once for all heads and accumulates dq in a local buffer. */
INLINE void attn_bwd_job(const attn_args *A, int64_t g, int64_t hk, const float *o,
                         const float *lse, const float *dout, float *dq, float *dk, float *dv,
                         float *buf, int64_t nkmax, const int64_t D) {
    const int64_t H = A->H, Hkv = A->Hkv, gh = H / Hkv;
    const int64_t first = A->grp_off[g], last = A->grp_off[g + 1];
    const float *kb = A->k + hk * A->kh, *vb = A->v + hk * A->vh;
    float *P = buf, *DS = buf + gh * nkmax, *DQ = buf + 2 * gh * nkmax;
    for (int64_t sg = first; sg < last; sg++) {
        for (int64_t i = 0; i < A->seg_len[sg]; i++) {
            const int64_t t = A->seg_start[sg] + i;
            int64_t p0, np, r0, nr;
            key_ranges(A, first, sg, i, &p0, &np, &r0, &nr);
            const int64_t nk = np + nr;
            for (int64_t e = 0; e < gh; e++) {
                const int64_t h = hk * gh + e;
                const float *dov = dout + (t * H + h) * D;
                const float di = dotD(dov, o + (t * H + h) * D, D);
                const float m = lse[t * H + h];
                float *p = P + e * nkmax, *ds = DS + e * nkmax;
                scores(A, A->q + t * A->qt + h * A->qh, hk, p0, np, r0, nr, p, D);
                for (int64_t j = 0; j < nk; j++) {
                    const float x = p[j] - m;
                    p[j] = exp_nonpos(x < 0.0f ? x : 0.0f);
                    ds[j] = p[j] * (dotD(dov, vb + key_token(j, p0, np, r0) * A->vt, D) - di) *
                            A->scale;
                }
            }
            memset(DQ, 0, sizeof(float) * (size_t)(gh * D));
            for (int64_t j = 0; j < nk; j++) {
                const int64_t kt = key_token(j, p0, np, r0);
                const float *kj = kb + kt * A->kt;
                float *dkj = dk + (kt * Hkv + hk) * D, *dvj = dv + (kt * Hkv + hk) * D;
                for (int64_t e = 0; e < gh; e++) {
                    const int64_t h = hk * gh + e;
                    const float pj = P[e * nkmax + j], dsj = DS[e * nkmax + j];
                    const float *qv = A->q + t * A->qt + h * A->qh, *dov = dout + (t * H + h) * D;
                    float *dqe = DQ + e * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) {
                        dvj[d] += pj * dov[d];
                        dkj[d] += dsj * qv[d];
                        dqe[d] += dsj * kj[d];
                    }
                }
            }
            for (int64_t e = 0; e < gh; e++)
                memcpy(dq + (t * H + hk * gh + e) * D, DQ + e * D, sizeof(float) * (size_t)D);
        }
    }
}

/* A thread's scratch buffer, on cache lines of its own (no false sharing with another thread's). */
static float *scratch(size_t floats) {
    void *p = NULL;
    return posix_memalign(&p, 64, (floats * sizeof(float) + 63) / 64 * 64) ? NULL : (float *)p;
}

static int64_t max_keys(const attn_args *A, int64_t G) {
    int64_t best = 1;
    for (int64_t g = 0; g < G; g++) {
        int64_t pl = A->seg_len[A->grp_off[g]], rl = 0;
        for (int64_t sg = A->grp_off[g] + 1; sg < A->grp_off[g + 1]; sg++)
            rl = A->seg_len[sg] > rl ? A->seg_len[sg] : rl;
        best = pl + rl > best ? pl + rl : best;
    }
    return best;
}

/* The tensors of one attention call: forward writes o and lse; backward reads them and dout and
 * writes dq, dk and dv. */
typedef struct {
    float *o, *lse;
    const float *dout;
    float *dq, *dk, *dv;
} attn_io;

typedef void (*group_fn)(const attn_args *A, int64_t g, const attn_io *io, float *s, int64_t nk);

static void fwd_group(const attn_args *A, int64_t g, const attn_io *io, float *s, int64_t nk) {
    (void)nk;
    for (int64_t hk = 0; hk < A->Hkv; hk++)
        if (A->D == 64) attn_fwd_job(A, g, hk, io->o, io->lse, s, 64);
        else if (A->D == 128) attn_fwd_job(A, g, hk, io->o, io->lse, s, 128);
        else attn_fwd_job(A, g, hk, io->o, io->lse, s, A->D);
}

static void bwd_group(const attn_args *A, int64_t g, const attn_io *io, float *s, int64_t nk) {
    for (int64_t hk = 0; hk < A->Hkv; hk++)
        if (A->D == 64)
            attn_bwd_job(A, g, hk, io->o, io->lse, io->dout, io->dq, io->dk, io->dv, s, nk, 64);
        else if (A->D == 128)
            attn_bwd_job(A, g, hk, io->o, io->lse, io->dout, io->dq, io->dk, io->dv, s, nk, 128);
        else
            attn_bwd_job(A, g, hk, io->o, io->lse, io->dout, io->dq, io->dk, io->dv, s, nk, A->D);
}

/* fn over every group, one group per job (dynamic schedule: which thread runs a job changes no
 * result), each thread with a scratch buffer of floats_per_key * max_keys + extra floats and
 * denormals flushed. Returns 0, or 1 when a thread could not allocate its buffer. */
static int attn_groups(const attn_args *A, int64_t G, const attn_io *io, int64_t floats_per_key,
                       int64_t extra, group_fn fn, int threads) {
    const int64_t nk = max_keys(A, G);
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        FTZ_ENTER;
        float *s = scratch((size_t)(floats_per_key * nk + extra));
        if (!s) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t g = 0; g < G; g++)
            if (s) fn(A, g, io, s, nk);
        free(s);
        FTZ_LEAVE;
    }
    return failed;
}

/* o (N, H, D), lse (N, H). Returns 0, or 1 when a thread could not allocate its score buffer. */
int postrl_t_attn_fwd(const float *q, const float *k, const float *v, int64_t qt, int64_t qh,
                      int64_t kt, int64_t kh, int64_t vt, int64_t vh, int64_t H, int64_t Hkv,
                      int64_t D, float scale, const int64_t *seg_start, const int64_t *seg_len,
                      const int64_t *grp_off, int64_t G, float *o, float *lse, int threads) {
    attn_args A = {q, k, v, qt, qh, kt, kh, vt, vh, H, Hkv, D, scale, seg_start, seg_len, grp_off};
    attn_io io = {o, lse, NULL, NULL, NULL, NULL};
    return attn_groups(&A, G, &io, 1, 0, fwd_group, threads);
}

/* dq (N, H, D), dk and dv (N, Hkv, D), all contiguous; dk and dv must be zeroed by the caller
 * (a token outside every segment keeps a zero gradient). */
int postrl_t_attn_bwd(const float *q, const float *k, const float *v, int64_t qt, int64_t qh,
                      int64_t kt, int64_t kh, int64_t vt, int64_t vh, int64_t H, int64_t Hkv,
                      int64_t D, float scale, const int64_t *seg_start, const int64_t *seg_len,
                      const int64_t *grp_off, int64_t G, const float *o, const float *lse,
                      const float *dout, float *dq, float *dk, float *dv, int threads) {
    attn_args A = {q, k, v, qt, qh, kt, kh, vt, vh, H, Hkv, D, scale, seg_start, seg_len, grp_off};
    attn_io io = {(float *)o, (float *)lse, dout, dq, dk, dv};
    const int64_t gh = H / Hkv;
    return attn_groups(&A, G, &io, 2 * gh, gh * D, bwd_group, threads);
}
