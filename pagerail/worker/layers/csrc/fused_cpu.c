// Fused float32 CPU kernels for the small per-layer operations of a forward pass: RMSNorm (with the residual add),
// rotary position embedding in place, the paged KV cache write and the gated SiLU activation. Each replaces a chain
// of torch operations on tensors of a few hundred kilobytes, where a step spends more time dispatching and walking
// memory than computing.
#include <math.h>
#include <stdint.h>

// Rows below this many elements are done by one thread: the parallel region would cost more than it saves.
#define PARALLEL_ELEMENTS 65536

static void norm_row(const float *x, const float *weight, float *out, int64_t dim, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; i++) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    // The same order as the reference: normalise, then scale by the weight.
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (x[i] * scale);
}

// out[r] = rmsnorm(x[r]); with residual (not NULL), sum_out[r] = residual[r] + x[r] and out[r] = rmsnorm(sum_out[r]).
// Rows of x are x_stride floats apart; residual, out and sum_out are contiguous [rows, dim].
void rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *sum_out,
                  int64_t rows, int64_t dim, int64_t x_stride, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        if (residual != 0) {
            float *sum = sum_out + r * dim;
            const float *res = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) sum[i] = res[i] + row[i];
            row = sum;
        }
        norm_row(row, weight, out + r * dim, dim, eps);
    }
}

static void rotate_heads(float *x, int64_t num_heads, int64_t head_dim, const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        float *x1 = x + h * head_dim;
        float *x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

// Neox-style rotary embedding of q [tokens, q_heads * head_dim] and k [tokens, k_heads * head_dim] in place, rows
// q_stride and k_stride floats apart; cos and sin are contiguous [tokens, head_dim / 2] for each token's position.
void rotary_f32(float *q, float *k, const float *cos, const float *sin, int64_t tokens, int64_t q_heads,
                int64_t k_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * (q_heads + k_heads) * head_dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        rotate_heads(q + t * q_stride, q_heads, head_dim, cos + t * half, sin + t * half);
        rotate_heads(k + t * k_stride, k_heads, head_dim, cos + t * half, sin + t * half);
    }
}

// Each token's keys and values ([kv_heads * head_dim] each, rows k_stride and v_stride floats apart) into its slot of
// the head-major caches [kv_heads, num_slots, head_dim]. Returns the index of the first token whose slot is out of
// range (nothing of it is written), or -1 when every token was written.
int64_t write_kv_f32(const float *k, const float *v, int64_t k_stride, int64_t v_stride, const int64_t *slots,
                     float *key_cache, float *value_cache, int64_t tokens, int64_t kv_heads, int64_t head_dim,
                     int64_t num_slots) {
    int64_t bad = -1;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) {
            if (bad < 0) bad = t;
            continue;
        }
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *ks = k + t * k_stride + h * head_dim;
            const float *vs = v + t * v_stride + h * head_dim;
            float *kd = key_cache + (h * num_slots + slot) * head_dim;
            float *vd = value_cache + (h * num_slots + slot) * head_dim;
            for (int64_t i = 0; i < head_dim; i++) {
                kd[i] = ks[i];
                vd[i] = vs[i];
            }
        }
    }
    return bad;
}

// out [rows, d] = silu(x[:, :d]) * x[:, d:], rows of x x_stride floats apart: the gated MLP activation in one pass.
void silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int64_t x_stride) {
#pragma omp parallel for schedule(static) if (rows * d >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride;
        const float *up = gate + d;
        float *o = out + r * d;
        for (int64_t i = 0; i < d; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
