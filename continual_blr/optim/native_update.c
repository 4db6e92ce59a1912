/* The diagonal BLR update after the estimates, in place, as one loop over the coordinates (CPU).
 *
 * The same algebra as continual_blr.optim.diag_state.diag_update, one line of the algorithm per line:
 *
 *   h = g_data * eps / r                                  (Price, one sample; H_FROM_SAMPLE)
 *   d = (m - m0) * s0 + g;   u = lerp(u, d, 1 - beta1)     (MOMENTUM)
 *   D = D + rho (h - D) [+ rho^2/2 (D - h)^2 / (s0 + D)]   (FRESH; [.]: POSITIVITY, IVON's correction)
 *   Dbar = lerp(Dbar, h, rho_avg)                          (FRESH and SEPARATE)
 *   step = u / (s0 + D [+ N gamma]);  clip to [-radius, radius];  * 1/(1 - beta1^t)
 *   m = m - lr * step;   r = 1/sqrt(s0 + D)                (the next sample's scale)
 *
 * Built by continual_blr/optim/native.py (float; double with -D T_DOUBLE) with one -D per flag, so each setting is its own
 * loop with no branch inside. No fast-math: IEEE division and square root, no contraction into FMAs, so the
 * result is each line's correctly rounded operations in the order above (lerp as torch's: a + w (b - a) for
 * |w| < 1/2, else b - (b - a)(1 - w)).
 *
 * Nothing is written unless every g (and h, when it is its own input) is finite: then the return is 0 and
 * counts[1] the number of clipped coordinates; otherwise the return is 1 and no buffer was touched.
 */
#include <stdint.h>
#include <math.h>
#include <float.h>

#ifdef T_DOUBLE
#define T double
#define T_MAX DBL_MAX
#define ABS fabs
#define SQRT sqrt
#else
#define T float
#define T_MAX FLT_MAX
#define ABS fabsf
#define SQRT sqrtf
#endif

/* torch.lerp's two forms; `small` (|w| < 1/2) is a constant in every specialised loop below. */
static inline __attribute__((always_inline)) T lerp_t(T a, T b, T w, const int small) {
    const T diff = b - a;
    return small ? a + w * diff : b - diff * ((T)1 - w);
}

/* The update's loop, specialised by the caller for each choice of torch.lerp's form (the vectoriser does not
 * take a loop-invariant select between the two forms). Returns the number of clipped coordinates. */
static inline __attribute__((always_inline)) int64_t update_loop(
        int64_t n, const T *restrict g, const T *restrict h, const T *restrict mean_in, T *restrict mean_out,
        const T *restrict m0, const T *restrict s0, T *restrict data, T *restrict avg, T *restrict mom,
        const T *restrict eps, T *restrict r, const double *restrict scalars,
        const int small_mom, const int small_data, const int small_avg) {
    const T one_minus_beta1 = (T)scalars[0], rho = (T)scalars[1], rho_avg = (T)scalars[2], unbias = (T)scalars[3];
    const T neg_lr = (T)(-scalars[4]), radius = (T)scalars[5], damp = (T)scalars[6];
    const T half_rho2 = (T)(0.5 * scalars[1] * scalars[1]);
    int n_clip = 0;
    for (int64_t i = 0; i < n; i++) {
#ifdef H_FROM_SAMPLE
        const T hi = (h[i] * eps[i]) / r[i];
#else
        const T hi = h[i];
#endif
        const T m = mean_in[i];
        const T d = (m - m0[i]) * s0[i] + g[i];
#ifdef MOMENTUM
        const T u = lerp_t(mom[i], d, one_minus_beta1, small_mom);
        mom[i] = u;
#else
        const T u = d;
#endif
        T dd = data[i];
#if defined(FRESH) && defined(POSITIVITY)
        {
            const T diff = dd - hi;
            dd = ((diff * diff) / (s0[i] + dd)) * half_rho2 + dd - diff * rho;
        }
        data[i] = dd;
#elif defined(FRESH)
        dd = lerp_t(dd, hi, rho, small_data);
        data[i] = dd;
#endif
#if defined(SEPARATE) && defined(FRESH)
        avg[i] = lerp_t(avg[i], hi, rho_avg, small_avg);
#endif
        const T s = s0[i] + dd;
#ifdef DAMPING
        T step = u / (s + damp);
#else
        T step = u / s;
#endif
#ifdef CLIP
        n_clip += ABS(step) > radius;
        step = step > radius ? radius : (step < -radius ? -radius : step);
#endif
#ifdef MOMENTUM
        step = step * unbias;
#endif
        mean_out[i] = step * neg_lr + m;
        r[i] = (T)1 / SQRT(s);
    }
    (void)one_minus_beta1; (void)rho_avg; (void)unbias; (void)radius; (void)damp; (void)half_rho2; (void)eps;
    (void)avg; (void)mom; (void)rho; (void)small_mom; (void)small_data; (void)small_avg; (void)h;
    return n_clip;
}

int blr_diag_update(int64_t n, const T *restrict g, const T *restrict h, const T *restrict mean_in,
                    T *restrict mean_out, const T *restrict m0, const T *restrict s0, T *restrict data,
                    T *restrict avg, T *restrict mom, const T *restrict eps, T *restrict r,
                    const double *restrict scalars, int64_t *restrict counts) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !(ABS(g[i]) <= T_MAX);
#if !defined(H_FROM_SAMPLE) && defined(FRESH)
    for (int64_t i = 0; i < n; i++) bad += !(ABS(h[i]) <= T_MAX);
#endif
    counts[0] = bad;
    counts[1] = 0;
    if (bad) return 1;
#define SMALL(k) (ABS((T)scalars[k]) < (T)0.5)
#define LOOP(a, b, c) update_loop(n, g, h, mean_in, mean_out, m0, s0, data, avg, mom, eps, r, scalars, a, b, c)
    const int which = 4 * SMALL(0) + 2 * SMALL(1) + SMALL(2);
    switch (which) {
        case 0: counts[1] = LOOP(0, 0, 0); break;
        case 1: counts[1] = LOOP(0, 0, 1); break;
        case 2: counts[1] = LOOP(0, 1, 0); break;
        case 3: counts[1] = LOOP(0, 1, 1); break;
        case 4: counts[1] = LOOP(1, 0, 0); break;
        case 5: counts[1] = LOOP(1, 0, 1); break;
        case 6: counts[1] = LOOP(1, 1, 0); break;
        default: counts[1] = LOOP(1, 1, 1); break;
    }
    return 0;
}
