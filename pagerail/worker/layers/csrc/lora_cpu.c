/* fp32 LoRA deltas on the CPU: out[r] += (x[r] A_s) B_s for every row r of a step that runs with adapter slot s.
 *
 * A decode step of a small model spends more on dispatching a grouped LoRA in torch (a gather, two batched
 * matmuls, a gather back and an add per projection, each on matrices of a few kilobytes) than on its arithmetic.
 * Here one call does all of a projection's adapters: the caller lists the adapter rows grouped by slot
 * (`segments`), and each block of up to ROWS rows of one slot is shrunk to its rank (h = x A) and expanded
 * (out += h B) from registers, reading that slot's A and B once per block. Base-model rows are not listed and
 * are left alone.
 *
 * A fused projection stacks its parts (q/k/v, gate/up): A is [slots, in, parts × rank] and B is block-diagonal
 * [slots, parts × rank, out]. `parts` lists, per part, its columns of h and its columns of out, so the expand
 * reads only the diagonal blocks (the rest of B is zero).
 *
 * Layouts, all float32 and row-major: x [rows, k] with rows ldx floats apart; out [rows, n], ldo apart;
 * a_t [slots, k, w]; b [slots, w, n]; rows: int64 row indices, grouped by slot; segments: int64 [groups][3] =
 * (slot, first, end) into rows; parts: int64 [num_parts][4] = (first h column, h columns, first out column,
 * end out column).
 */
#include <stdint.h>

#define ROWS 4
#define CHUNK 16
/* Below this many multiply-adds a call runs on the calling thread: waking the others costs more than it saves. */
#define PARALLEL_MIN_WORK (1 << 18)

/* CHUNK floats as one value (one zmm with AVX-512, two ymm with AVX2), loadable from any float address. */
typedef float chunk_t __attribute__((vector_size(CHUNK * sizeof(float)), aligned(4)));

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* h[r][0..w) = x_r A for the block's rows (rows past the block's count repeat its last row; their h is unused). */
static void shrink(const float *const xr[ROWS], const float *a, int64_t k, int64_t w, float *h) {
    int64_t c = 0;
    for (; c + CHUNK <= w; c += CHUNK) {
        chunk_t acc[ROWS] = {0};
        for (int64_t i = 0; i < k; i++) {
            const chunk_t ai = *(const chunk_t *)(a + i * w + c);
            for (int r = 0; r < ROWS; r++) acc[r] += xr[r][i] * ai;
        }
        for (int r = 0; r < ROWS; r++) *(chunk_t *)(h + r * w + c) = acc[r];
    }
    if (c < w) { /* the last columns when w is not a multiple of CHUNK */
        const int64_t width = w - c;
        float acc[ROWS][CHUNK] = {{0}};
        for (int64_t i = 0; i < k; i++) {
            const float *ai = a + i * w + c;
            for (int r = 0; r < ROWS; r++)
                for (int64_t j = 0; j < width; j++) acc[r][j] += xr[r][i] * ai[j];
        }
        for (int r = 0; r < ROWS; r++)
            for (int64_t j = 0; j < width; j++) h[r * w + c + j] = acc[r][j];
    }
}

/* out_r[first..end) += h_r[hf..hf+hw) B[hf..hf+hw, first..end) for the block's `count` rows. */
static void expand(const float *h, int64_t w, const float *b, int64_t n, int64_t hf, int64_t hw, int64_t first,
                   int64_t end, float *const outr[ROWS], int count) {
    int64_t c = first;
    for (; c + CHUNK <= end; c += CHUNK) {
        chunk_t acc[ROWS] = {0};
        for (int64_t q = hf; q < hf + hw; q++) {
            const chunk_t bq = *(const chunk_t *)(b + q * n + c);
            for (int r = 0; r < ROWS; r++) acc[r] += h[r * w + q] * bq;
        }
        for (int r = 0; r < count; r++) *(chunk_t *)(outr[r] + c) += acc[r];
    }
    if (c < end) {
        const int64_t width = end - c;
        float acc[ROWS][CHUNK] = {{0}};
        for (int64_t q = hf; q < hf + hw; q++) {
            const float *bq = b + q * n + c;
            for (int r = 0; r < ROWS; r++)
                for (int64_t j = 0; j < width; j++) acc[r][j] += h[r * w + q] * bq[j];
        }
        for (int r = 0; r < count; r++)
            for (int64_t j = 0; j < width; j++) outr[r][c + j] += acc[r][j];
    }
}

void lora_delta_f32(const float *x, int64_t ldx, float *out, int64_t ldo, const float *a_t, const float *b,
                    int64_t k, int64_t w, int64_t n, const int64_t *rows, const int64_t *segments, int64_t groups,
                    const int64_t *parts, int64_t num_parts) {
    /* Blocks of up to ROWS rows of one slot, numbered across the groups, so threads can share them out. */
    int64_t blocks = 0;
    for (int64_t g = 0; g < groups; g++) blocks += (segments[3 * g + 2] - segments[3 * g + 1] + ROWS - 1) / ROWS;
    const int64_t listed = groups ? segments[3 * (groups - 1) + 2] : 0;
    const int64_t work = listed * (k * w + w * n);
#pragma omp parallel for schedule(dynamic, 1) if (work >= PARALLEL_MIN_WORK)
    for (int64_t block = 0; block < blocks; block++) {
        int64_t g = 0, skipped = block;
        for (;; g++) {
            const int64_t in_group = (segments[3 * g + 2] - segments[3 * g + 1] + ROWS - 1) / ROWS;
            if (skipped < in_group) break;
            skipped -= in_group;
        }
        const int64_t slot = segments[3 * g], first = segments[3 * g + 1] + skipped * ROWS;
        const int count = (int)min64(ROWS, segments[3 * g + 2] - first);
        const float *xr[ROWS];
        float *outr[ROWS];
        for (int r = 0; r < ROWS; r++) {
            const int64_t row = rows[first + (r < count ? r : count - 1)];
            xr[r] = x + row * ldx;
            outr[r] = out + row * ldo;
        }
        float h[ROWS * w];
        shrink(xr, a_t + slot * k * w, k, w, h);
        const float *bs = b + slot * w * n;
        for (int64_t p = 0; p < num_parts; p++) {
            const int64_t *part = parts + 4 * p;
            expand(h, w, bs, n, part[0], part[1], part[2], part[3], outr, count);
        }
    }
}
