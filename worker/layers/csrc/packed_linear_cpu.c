/* fp32 y = x W^T on the CPU, over a weight packed once into panels of 16 output features.
 *
 * Decode batches are small (1-64 rows), where a BLAS call spends more on packing its operands and picking a
 * path than on arithmetic, and some libraries take slow paths on CPUs of other vendors. Here the weight is
 * packed at load into [ceil(N/16)][K][16] panels, so each call streams every panel from memory once, and
 * rows of x are multiplied into it from registers: 6 rows x 16 outputs of accumulators per pass (12 of
 * the 16 AVX registers). Threads split the panels; x is taken in chunks of rows that stay in L2.
 * Needs AVX2 and FMA (`packed_linear_supported` says whether this build has them).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_FMA 1
#else
#define HAVE_AVX2_FMA 0
#endif

#define PANEL 16
#define ROWS_PER_PASS 6
/* Rows of x handled per sweep over the panels: their x block (ROWS_CHUNK x K floats) stays in L2. */
#define ROWS_CHUNK 96
/* Below this many multiply-adds a call runs on the calling thread: waking the others costs more than it saves. */
#define PARALLEL_MIN_WORK (1 << 18)

int packed_linear_panel(void) { return PANEL; }

int packed_linear_supported(void) { return HAVE_AVX2_FMA; }

/* w [n, k] row-major → packed [ceil(n/16)][k][16], zeros past n. */
void pack_linear_weight_f32(const float *w, float *packed, int64_t n, int64_t k) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * PANEL;
        for (int64_t j = 0; j < PANEL; j++) {
            const int64_t row = p * PANEL + j;
            if (row < n) {
                const float *src = w + row * k;
                for (int64_t i = 0; i < k; i++) dst[i * PANEL + j] = src[i];
            } else {
                for (int64_t i = 0; i < k; i++) dst[i * PANEL + j] = 0.0f;
            }
        }
    }
}

#if HAVE_AVX2_FMA
static inline __attribute__((always_inline)) void pass(
    const int rows, const float *x, int64_t ldx, const float *panel, int64_t k, float *out, int64_t ldo,
    int64_t cols)
{
    /* Named accumulators, not an array: gcc keeps each in a register only when it can see them apart. */
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
    for (int64_t i = 0; i < k; i++) {
        /* 32 steps (2 KB) ahead: the first pass over a panel reads it from memory, and the hardware prefetcher
         * alone leaves 16-32-row batches waiting on it (10-15% slower). */
        __builtin_prefetch(panel + (i + 32) * PANEL, 0, 3);
        const __m256 w0 = _mm256_load_ps(panel + i * PANEL);
        const __m256 w1 = _mm256_load_ps(panel + i * PANEL + 8);
        __m256 xv;
#define ROW(r) if (rows > r) { xv = _mm256_broadcast_ss(x##r + i); \
            a##r##0 = _mm256_fmadd_ps(xv, w0, a##r##0); a##r##1 = _mm256_fmadd_ps(xv, w1, a##r##1); }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
    float tail[PANEL];
#define STORE(r) if (rows > r) { \
        if (cols == PANEL) { _mm256_storeu_ps(out + r * ldo, a##r##0); _mm256_storeu_ps(out + r * ldo + 8, a##r##1); } \
        else { _mm256_storeu_ps(tail, a##r##0); _mm256_storeu_ps(tail + 8, a##r##1); \
               memcpy(out + r * ldo, tail, (size_t)cols * sizeof(float)); } }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}

static void panel_rows(const float *x, int64_t ldx, int64_t m, const float *panel, int64_t k,
                       float *out, int64_t ldo, int64_t cols)
{
    int64_t r = 0;
    for (; r + ROWS_PER_PASS <= m; r += ROWS_PER_PASS)
        pass(ROWS_PER_PASS, x + r * ldx, ldx, panel, k, out + r * ldo, ldo, cols);
    switch (m - r) {
    case 5: pass(5, x + r * ldx, ldx, panel, k, out + r * ldo, ldo, cols); break;
    case 4: pass(4, x + r * ldx, ldx, panel, k, out + r * ldo, ldo, cols); break;
    case 3: pass(3, x + r * ldx, ldx, panel, k, out + r * ldo, ldo, cols); break;
    case 2: pass(2, x + r * ldx, ldx, panel, k, out + r * ldo, ldo, cols); break;
    case 1: pass(1, x + r * ldx, ldx, panel, k, out + r * ldo, ldo, cols); break;
    default: break;
    }
}

void packed_linear_f32(const float *x, int64_t ldx, const float *packed, float *out, int64_t ldo,
                       int64_t m, int64_t n, int64_t k)
{
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    for (int64_t m0 = 0; m0 < m; m0 += ROWS_CHUNK) {
        const int64_t mc = m - m0 < ROWS_CHUNK ? m - m0 : ROWS_CHUNK;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
            panel_rows(x + m0 * ldx, ldx, mc, packed + p * k * PANEL, k, out + m0 * ldo + p * PANEL, ldo, cols);
        }
    }
}
#else
void packed_linear_f32(const float *x, int64_t ldx, const float *packed, float *out, int64_t ldo,
                       int64_t m, int64_t n, int64_t k)
{
    (void)x; (void)ldx; (void)packed; (void)out; (void)ldo; (void)m; (void)n; (void)k;
}
#endif
