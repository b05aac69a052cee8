/* Decode attention over a paged, head-major KV cache of fp32 or fp8, reading every block in place.
 *
 * One work item is one (sequence, KV head) pair: the query heads that share the KV head are scored
 * together, so each key and value row is read from memory once per step. Scores live in a per-item
 * scratch row; softmax is exact (max-subtracted), not online, because contexts fit in that row.
 *
 * With AVX-512 (and PAGED_ATTENTION_NO_AVX512 undefined) the common shapes, head_dim 32, 64 or 128 with up to
 * 4 query heads per KV head, take a path specialised at compile time: a block's 16 keys are scored against a
 * query head at once (16 partial dot products summed across lanes in one transpose-add tree instead of one
 * horizontal sum per key), and the output accumulators stay in registers while the values stream past.
 * Other shapes, and CPUs without AVX-512, take the generic loop. `paged_attention_isa` says which build this is.
 *
 * An fp8 cache (paged_decode_attention_fp8) holds one byte per value, value / scale in e4m3 or e5m2: the generic
 * loop decodes each byte through the caller's 256-entry table of that format, and the per-tensor scales multiply
 * the scores and the finished output instead of every element.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#if defined(__AVX512F__) && !defined(PAGED_ATTENTION_NO_AVX512)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
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

int paged_attention_isa(void) { return HAVE_AVX512 ? 512 : 0; }

/* A sequence's blocks lie wherever the allocator found room, so the hardware prefetcher, which follows one
 * address stream, stalls at every block boundary. Each pass over a sequence's blocks therefore asks for the
 * block about 8 KiB ahead of the one it reads (4 blocks of 2 KiB, 2 of 4 KiB or more) into L2: one block ahead
 * is too close to hide a memory access, and into L1 the requests crowd out the lines being read. Measured
 * with bench/cpu_attention.py against asking for the next block into L1: about 20-35% faster when sequences'
 * blocks interleave or scatter, and about 20% faster when they lie in a row. */
#define PREFETCH_BYTES 8192

static inline int64_t blocks_ahead(int64_t block_bytes) {
    const int64_t blocks = PREFETCH_BYTES / block_bytes;
    return blocks < 2 ? 2 : blocks;
}

static inline void prefetch_block(const char *block, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(block + offset, 0, 2);
}

/* Before a pass over a sequence's blocks: ask for the ones the pass reads before its own requests run ahead.
 * Caches are addressed in bytes, so one helper serves fp32 and fp8 blocks alike. */
static inline __attribute__((always_inline)) void prefetch_first_blocks(
    const char *cache, const int64_t *blocks, int64_t ctx, int64_t block_size, int64_t block_bytes)
{
    const int64_t ahead = blocks_ahead(block_bytes);
    for (int64_t b = 1; b < ahead && b * block_size < ctx; b++)
        prefetch_block(cache + blocks[b] * block_bytes, block_bytes);
}

/* A sequence's block holding context position t0 in one head's cache, and in *rows how many of its positions
 * the context fills; the block `blocks_ahead` further on is asked for while this one is read. */
static inline __attribute__((always_inline)) const char *context_block(
    const char *cache, const int64_t *blocks, int64_t t0, int64_t ctx, int64_t block_size, int64_t block_bytes,
    int64_t *rows)
{
    *rows = ctx - t0 < block_size ? ctx - t0 : block_size;
    const int64_t ahead = t0 + blocks_ahead(block_bytes) * block_size;
    if (ahead < ctx) prefetch_block(cache + blocks[ahead / block_size] * block_bytes, block_bytes);
    return cache + blocks[t0 / block_size] * block_bytes;
}

#if HAVE_AVX512
/* r[j] = the sum of p[j]'s 16 lanes, for j < 16: pairs, then quads within 128-bit lanes, then across lanes. */
static inline __attribute__((always_inline)) __m512 sum_lanes_16(const __m512 *p) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One (sequence, KV head) item for head_dim HD (a multiple of 16) and G query heads; both constants where it is
 * inlined. Blocks of 16 keys (block_size 16) are scored 16 at a time; other block sizes 16 keys of a block at a
 * time too, with the last group of a block masked. */
static inline __attribute__((always_inline)) void item_avx512(
    const int HD, const int G, const float *queries, const float *keys, const float *values, const int64_t *blocks,
    int64_t ctx, int64_t first, int64_t block_size, float scale, float *scores, float *out, int64_t block_bytes)
{
    enum { MAXV = 8 };  /* HD / 16 for HD up to 128 */
    const int NV = HD / 16;
    __m512 qv[4][MAXV];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++) qv[g][c] = _mm512_loadu_ps(queries + g * HD + 16 * c);
    const __m512 scale_v = _mm512_set1_ps(scale);
    __m512 max_v[4];
    for (int g = 0; g < G; g++) max_v[g] = _mm512_set1_ps(-1e30f);
    const int64_t t_begin = first / block_size * block_size;
    prefetch_first_blocks((const char *)keys, blocks + t_begin / block_size, ctx - t_begin, block_size, block_bytes);
    for (int64_t t0 = t_begin; t0 < ctx; t0 += block_size) {
        int64_t rows;
        const float *k_block =
            (const float *)context_block((const char *)keys, blocks, t0, ctx, block_size, block_bytes, &rows);
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            const int64_t count = rows - r0 < 16 ? rows - r0 : 16;
            __mmask16 live = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
            /* Keys before the window's first position are neither stored nor counted in the max. */
            const int64_t before = first - (t0 + r0);
            if (before >= 16) continue;
            if (before > 0) live &= (__mmask16)~((1u << before) - 1);
            for (int g = 0; g < G; g++) {
                __m512 part[16];
                for (int j = 0; j < 16; j++) {
                    if (j < count) {
                        const float *k = k_block + (r0 + j) * HD;
                        __m512 a = _mm512_mul_ps(qv[g][0], _mm512_loadu_ps(k));
                        for (int c = 1; c < NV; c++) a = _mm512_fmadd_ps(qv[g][c], _mm512_loadu_ps(k + 16 * c), a);
                        part[j] = a;
                    } else {
                        part[j] = _mm512_setzero_ps();
                    }
                }
                const __m512 dots = _mm512_mul_ps(sum_lanes_16(part), scale_v);
                _mm512_mask_storeu_ps(scores + g * ctx + t0 + r0, live, dots);
                max_v[g] = _mm512_mask_max_ps(max_v[g], live, max_v[g], dots);
            }
        }
    }
    float inv[4];
    for (int g = 0; g < G; g++) {
        const float max_score = _mm512_reduce_max_ps(max_v[g]);
        float *row = scores + g * ctx;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = first; t < ctx; t++) {
            row[t] = expf(row[t] - max_score);
            sum += row[t];
        }
        inv[g] = 1.0f / sum;
    }
    __m512 acc[4][MAXV];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++) acc[g][c] = _mm512_setzero_ps();
    prefetch_first_blocks((const char *)values, blocks + t_begin / block_size, ctx - t_begin, block_size, block_bytes);
    for (int64_t t0 = t_begin; t0 < ctx; t0 += block_size) {
        int64_t rows;
        const float *v_block =
            (const float *)context_block((const char *)values, blocks, t0, ctx, block_size, block_bytes, &rows);
        for (int64_t r = first > t0 ? first - t0 : 0; r < rows; r++) {
            const float *v = v_block + r * HD;
            __m512 vv[MAXV];
            for (int c = 0; c < NV; c++) vv[c] = _mm512_loadu_ps(v + 16 * c);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(scores[g * ctx + t0 + r]);
                for (int c = 0; c < NV; c++) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const __m512 scale_out = _mm512_set1_ps(inv[g]);
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(out + g * HD + 16 * c, _mm512_mul_ps(acc[g][c], scale_out));
    }
}

/* 1 when (head_dim, group) has a specialised path, which then ran. */
static int item_specialised(int64_t head_dim, int64_t group, const float *queries, const float *keys,
                            const float *values, const int64_t *blocks, int64_t ctx, int64_t first,
                            int64_t block_size, float scale, float *scores, float *out, int64_t block_bytes)
{
#define CASE(hd, g) if (head_dim == hd && group == g) { \
        item_avx512(hd, g, queries, keys, values, blocks, ctx, first, block_size, scale, scores, out, block_bytes); \
        return 1; }
    CASE(64, 1) CASE(64, 2) CASE(64, 3) CASE(64, 4)
    CASE(32, 1) CASE(32, 2) CASE(32, 3) CASE(32, 4)
    CASE(128, 1) CASE(128, 2) CASE(128, 3) CASE(128, 4)
#undef CASE
    return 0;
}
#endif

/* Element d of a cache row: fp32 as stored, or an fp8 byte through its format's table. `table` is a constant
 * NULL at the fp32 call site, so that copy compiles to plain float loads. */
#define CACHE_ELEM(row, d, table) ((table) != NULL ? (table)[((const uint8_t *)(row))[d]] : ((const float *)(row))[d])

/* One (sequence, KV head) item, any shape: scores = q.k * scale (softcapped), exact softmax with the head's sink,
 * out = out_scale * sum(w v) / denominator. `first` is the window's first position. */
static inline __attribute__((always_inline)) void item_generic(
    const float *queries, const char *keys, const char *values, const float *table, const int64_t *blocks,
    int64_t ctx, int64_t first, int64_t group, int64_t head_dim, int64_t block_size, int64_t block_bytes,
    float scale, float softcap, float out_scale, const float *head_sinks, float *scores, float *out)
{
    const int64_t row_bytes = block_bytes / block_size;
    const int64_t t_begin = first / block_size * block_size;
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float max_score[MAX_GROUP];
    float denom[MAX_GROUP];

    /* A sink takes part in the max too, so exp(sink - max) cannot overflow. */
    for (int64_t g = 0; g < group; g++) max_score[g] = head_sinks != NULL ? head_sinks[g] : -1e30f;
    prefetch_first_blocks(keys, blocks + t_begin / block_size, ctx - t_begin, block_size, block_bytes);
    for (int64_t t0 = t_begin; t0 < ctx; t0 += block_size) {
        int64_t rows;
        const char *k_block = context_block(keys, blocks, t0, ctx, block_size, block_bytes, &rows);
        for (int64_t r = first > t0 ? first - t0 : 0; r < rows; r++) {
            const char *k = k_block + r * row_bytes;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = queries + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * CACHE_ELEM(k, d, table);
                dot *= scale;
                if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
                scores[g * ctx + t0 + r] = dot;
                if (dot > max_score[g]) max_score[g] = dot;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * ctx;
        float sum = 0.0f;
        for (int64_t t = first; t < ctx; t++) {
            row[t] = expf(row[t] - max_score[g]);
            sum += row[t];
        }
        denom[g] = head_sinks != NULL ? sum + expf(head_sinks[g] - max_score[g]) : sum;
        for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
    }
    prefetch_first_blocks(values, blocks + t_begin / block_size, ctx - t_begin, block_size, block_bytes);
    for (int64_t t0 = t_begin; t0 < ctx; t0 += block_size) {
        int64_t rows;
        const char *v_block = context_block(values, blocks, t0, ctx, block_size, block_bytes, &rows);
        for (int64_t r = first > t0 ? first - t0 : 0; r < rows; r++) {
            const char *v = v_block + r * row_bytes;
            for (int64_t g = 0; g < group; g++) {
                const float w = scores[g * ctx + t0 + r];
                float *a = acc[g];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += w * CACHE_ELEM(v, d, table);
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *o = out + g * head_dim;
        const float inv = out_scale / denom[g];
        for (int64_t d = 0; d < head_dim; d++) o[d] = acc[g][d] * inv;
    }
}

/* Both entry points: `fp8_table` NULL for an fp32 cache; else the cache holds bytes, decoded through it, and
 * k_scale/v_scale (one float each) are the per-tensor scales the bytes were divided by. */
static void paged_decode(
    const float *q, const void *key_cache, const void *value_cache, const int64_t *block_table,
    const int64_t *context_lens, float *out, int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t num_slots, int64_t max_blocks, int64_t block_size, float scale, int64_t window, float softcap,
    const float *sinks, const float *fp8_table, float k_scale, float v_scale)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t items = n * num_kv_heads;
    const int64_t row_bytes = head_dim * (fp8_table != NULL ? 1 : (int64_t)sizeof(float));
    const int64_t block_bytes = block_size * row_bytes;

#pragma omp parallel
    {
    SAVE_FLOAT_MODE();
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t seq = item / num_kv_heads;
        const int64_t kv_head = item % num_kv_heads;
        const int64_t ctx = context_lens[seq];
        const int64_t first = window > 0 && ctx > window ? ctx - window : 0;
        const int64_t *blocks = block_table + seq * max_blocks;
        const char *keys = (const char *)key_cache + kv_head * num_slots * row_bytes;
        const char *values = (const char *)value_cache + kv_head * num_slots * row_bytes;
        const float *queries = q + (seq * num_heads + kv_head * group) * head_dim;
        float *item_out = out + (seq * num_heads + kv_head * group) * head_dim;
        const float *head_sinks = sinks != NULL ? sinks + kv_head * group : NULL;
        float *scores = (float *)malloc(sizeof(float) * group * ctx);
        if (fp8_table != NULL) {
            item_generic(queries, keys, values, fp8_table, blocks, ctx, first, group, head_dim, block_size,
                         block_bytes, scale * k_scale, softcap, v_scale, head_sinks, scores, item_out);
        } else {
#if HAVE_AVX512
            /* The specialised paths have no softcap and no sinks: such layers take the generic loop. */
            if (softcap <= 0.0f && sinks == NULL &&
                item_specialised(head_dim, group, queries, (const float *)keys, (const float *)values, blocks, ctx,
                                 first, block_size, scale, scores, item_out, block_bytes)) {
                free(scores);
                continue;
            }
#endif
            item_generic(queries, keys, values, NULL, blocks, ctx, first, group, head_dim, block_size, block_bytes,
                         scale, softcap, 1.0f, head_sinks, scores, item_out);
        }
        free(scores);
    }
    RESTORE_FLOAT_MODE();
    }
}

void paged_decode_attention_f32(
    const float *q,               /* [n, num_heads, head_dim] */
    const float *key_cache,       /* [num_kv_heads, num_slots, head_dim] */
    const float *value_cache,     /* [num_kv_heads, num_slots, head_dim] */
    const int64_t *block_table,   /* [n, max_blocks] */
    const int64_t *context_lens,  /* [n] */
    float *out,                   /* [n, num_heads, head_dim] */
    int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t num_slots, int64_t max_blocks, int64_t block_size, float scale,
    int64_t window,               /* > 0: each query sees only the last `window` positions of its context */
    float softcap,                /* > 0: scores become softcap * tanh(score / softcap) (Gemma 2) */
    const float *sinks)           /* [num_heads] or NULL: a per-head logit that joins the softmax's denominator
                                   * only, with no value (gpt-oss); last, so a caller may leave it out */
{
    paged_decode(q, key_cache, value_cache, block_table, context_lens, out, n, num_heads, num_kv_heads, head_dim,
                 num_slots, max_blocks, block_size, scale, window, softcap, sinks, NULL, 1.0f, 1.0f);
}

/* The same over an fp8 cache (one byte per value): `fp8_table` [256] decodes a byte of its format to float;
 * k_scale and v_scale point at the per-tensor scales (float32 scalars) the values were divided by. */
void paged_decode_attention_fp8(
    const float *q, const uint8_t *key_cache, const uint8_t *value_cache, const int64_t *block_table,
    const int64_t *context_lens, float *out, int64_t n, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t num_slots, int64_t max_blocks, int64_t block_size, float scale, int64_t window, float softcap,
    const float *sinks, const float *fp8_table, const float *k_scale, const float *v_scale)
{
    paged_decode(q, key_cache, value_cache, block_table, context_lens, out, n, num_heads, num_kv_heads, head_dim,
                 num_slots, max_blocks, block_size, scale, window, softcap, sinks, fp8_table, *k_scale, *v_scale);
}
