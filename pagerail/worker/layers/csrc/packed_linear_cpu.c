/* fp32 y = x W^T on the CPU, over a weight packed once into panels of 16 output features.
 *
 * Decode batches are small (1-64 rows), where a BLAS call spends more on packing its operands and picking a
 * path than on arithmetic, and some libraries take slow paths on CPUs of other vendors. Here the weight is
 * packed at load into [ceil(N/16)][K][16] panels, so each call streams every panel from memory once, and
 * rows of x are multiplied into it from registers. Threads split the panels; x is taken in chunks of rows
 * that stay in L2.
 *
 * Two builds of the same layout, chosen by what -march=native offers:
 *   AVX-512: a panel row is one zmm register; a pass takes two panels (32 outputs) and up to 12 rows of x,
 *            24 accumulators of the 32 registers, two fused multiply-adds per loaded x value.
 *   AVX2:    a panel row is two ymm registers; a pass takes one panel and up to 6 rows, 12 accumulators of 16.
 * Defining PACKED_LINEAR_NO_AVX512 keeps the AVX2 build on an AVX-512 CPU (how the tests reach it there).
 * `packed_linear_isa` says which build this is: 512, 256, or 0 when the CPU has neither (the kernel is unusable).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_FMA 1
#else
#define HAVE_AVX2_FMA 0
#endif
#if HAVE_AVX2_FMA && defined(__AVX512F__) && !defined(PACKED_LINEAR_NO_AVX512)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

#define PANEL 16
#define ROWS_PER_PASS 6
#define ROWS_PER_PASS_512 12
/* Rows of x handled per sweep over the panels: their x block (ROWS_CHUNK x K floats) stays in L2. */
#define ROWS_CHUNK 96
/* Below this many multiply-adds a call runs on the calling thread: waking the others costs more than it saves. */
#define PARALLEL_MIN_WORK (1 << 18)

int packed_linear_panel(void) { return PANEL; }

int packed_linear_supported(void) { return HAVE_AVX2_FMA; }

int packed_linear_isa(void) { return HAVE_AVX512 ? 512 : HAVE_AVX2_FMA ? 256 : 0; }

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
/* How many of panel p's 16 outputs exist: the last panel of a weight may be short. */
static inline int64_t panel_cols(int64_t n, int64_t p) { return n - p * PANEL < PANEL ? n - p * PANEL : PANEL; }
#endif

#if HAVE_AVX512
#define PANELS_PER_PASS 2
/* One pass: `rows` rows of x times one panel (two == 0) or two neighbouring panels (two == 1); cols0 and cols1
 * are how many of each panel's 16 outputs exist (the last panel of a weight may be short). */
static inline __attribute__((always_inline)) void pass512(
    const int rows, const int two, const float *x, int64_t ldx, const float *p0, const float *p1, int64_t k,
    float *out, int64_t ldo, int64_t cols0, int64_t cols1)
{
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    __m512 a40 = a00, a41 = a00, a50 = a00, a51 = a00, a60 = a00, a61 = a00, a70 = a00, a71 = a00;
    __m512 a80 = a00, a81 = a00, a90 = a00, a91 = a00, aA0 = a00, aA1 = a00, aB0 = a00, aB1 = a00;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
    const float *x6 = x + 6 * ldx, *x7 = x + 7 * ldx, *x8 = x + 8 * ldx, *x9 = x + 9 * ldx;
    const float *xA = x + 10 * ldx, *xB = x + 11 * ldx;
    for (int64_t i = 0; i < k; i++) {
        /* One cache line of each panel per step; 32 steps ahead, as in the AVX2 build. */
        __builtin_prefetch(p0 + (i + 32) * PANEL, 0, 3);
        if (two) __builtin_prefetch(p1 + (i + 32) * PANEL, 0, 3);
        const __m512 w0 = _mm512_load_ps(p0 + i * PANEL);
        const __m512 w1 = two ? _mm512_load_ps(p1 + i * PANEL) : w0;
        __m512 xv;
#define ROW(r) if (rows > 0x##r) { xv = _mm512_set1_ps(x##r[i]); a##r##0 = _mm512_fmadd_ps(xv, w0, a##r##0); \
            if (two) a##r##1 = _mm512_fmadd_ps(xv, w1, a##r##1); }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(A) ROW(B)
#undef ROW
    }
    const __mmask16 m0 = cols0 >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << cols0) - 1);
    const __mmask16 m1 = cols1 >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << cols1) - 1);
#define STORE(r) if (rows > 0x##r) { _mm512_mask_storeu_ps(out + 0x##r * ldo, m0, a##r##0); \
            if (two) _mm512_mask_storeu_ps(out + 0x##r * ldo + PANEL, m1, a##r##1); }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7) STORE(8) STORE(9) STORE(A) STORE(B)
#undef STORE
}

#define PASS_CASE(n) case n: pass512(n, two, x, ldx, p0, p1, k, out, ldo, cols0, cols1); break;

/* Rows `m` (at most ROWS_PER_PASS_512) of x through one or two panels; `rows` and `two` reach pass512 as
 * constants, so each variant keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void pass512_rows(
    const int two, const int64_t m, const float *x, int64_t ldx, const float *p0, const float *p1, int64_t k,
    float *out, int64_t ldo, int64_t cols0, int64_t cols1)
{
    switch (m) {
    PASS_CASE(12) PASS_CASE(11) PASS_CASE(10) PASS_CASE(9) PASS_CASE(8) PASS_CASE(7)
    PASS_CASE(6) PASS_CASE(5) PASS_CASE(4) PASS_CASE(3) PASS_CASE(2) PASS_CASE(1)
    default: break;
    }
}
#undef PASS_CASE

/* Rows `m` of x through `count` (1 or 2) neighbouring panels from panel p. */
static void run_panels(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t p, int64_t count,
                       int64_t n, int64_t k, float *out, int64_t ldo)
{
    const float *p0 = packed + p * k * PANEL, *p1 = p0 + k * PANEL;
    const int64_t cols0 = panel_cols(n, p), cols1 = count == 2 ? panel_cols(n, p + 1) : 0;
    out += p * PANEL;
    for (int64_t r = 0; r < m; r += ROWS_PER_PASS_512) {
        const int64_t rows = m - r < ROWS_PER_PASS_512 ? m - r : ROWS_PER_PASS_512;
        if (count == 2) pass512_rows(1, rows, x + r * ldx, ldx, p0, p1, k, out + r * ldo, ldo, cols0, cols1);
        else pass512_rows(0, rows, x + r * ldx, ldx, p0, p0, k, out + r * ldo, ldo, cols0, cols1);
    }
}
#elif HAVE_AVX2_FMA
#define PANELS_PER_PASS 1
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

/* Rows `m` of x through panel p (`count` is always 1 in this build). */
static void run_panels(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t p, int64_t count,
                       int64_t n, int64_t k, float *out, int64_t ldo)
{
    (void)count;
    panel_rows(x, ldx, m, packed + p * k * PANEL, k, out + p * PANEL, ldo, panel_cols(n, p));
}
#endif

#if HAVE_AVX2_FMA
void packed_linear_f32(const float *x, int64_t ldx, const float *packed, float *out, int64_t ldo,
                       int64_t m, int64_t n, int64_t k)
{
    const int64_t panels = (n + PANEL - 1) / PANEL;
    /* Threads split units of the panels one pass takes. A single row streams one panel at a time: pairing saves
     * no x loads there, and one stream per thread reads memory faster than two. */
    const int64_t step = m > 1 ? PANELS_PER_PASS : 1;
    const int64_t units = (panels + step - 1) / step;
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    for (int64_t m0 = 0; m0 < m; m0 += ROWS_CHUNK) {
        const int64_t mc = m - m0 < ROWS_CHUNK ? m - m0 : ROWS_CHUNK;
#pragma omp for schedule(static)
        for (int64_t q = 0; q < units; q++) {
            const int64_t p = step * q;
            run_panels(x + m0 * ldx, ldx, mc, packed, p, panels - p < step ? panels - p : step, n, k,
                       out + m0 * ldo, ldo);
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
