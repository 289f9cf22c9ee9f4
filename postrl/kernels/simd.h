/* Vector math shared by postrl's C kernels (rollout/native/kernels.c, kernels/train.c).
 * Written so gcc/clang vectorise the loops that call them (-O3 -march=native). */
#ifndef POSTRL_SIMD_H
#define POSTRL_SIMD_H
#include <stdint.h>

/* exp(x) for x <= 0 (softmax arguments), vectorisable: 2^n * p(r), x = n ln2 + r. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* s[t] = exp(s[t] - max(s)) in place (softmax's numerators); returns their sum, *max = max(s). */
static inline float exp_shifted(float *s, int64_t n, float *max) {
    float m = s[0];
    for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_nonpos(s[t] - m);
        sum += s[t];
    }
    *max = m;
    return sum;
}

#endif
