/* Decode attention over the paged KV cache on the CPU, reading the cache in place.
 *
 * Every sequence with exactly one query (query_start_loc[i + 1] - query_start_loc[i] == 1) attends with it to its
 * seq_lens[i] cached tokens; other sequences are left alone (the caller computes prefill chunks). Layouts, as
 * kernels/paged_attention.py's paged_attention_ref reads them:
 *   q, out        [num_tokens, num_heads, head_dim]                    strides (token, head), last dim contiguous
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]     strides (block, slot, head), last dim contiguous
 *   block_tables  [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32, query_start_loc [num_seqs + 1] int32
 * Query head h reads KV head h / (num_heads / num_kv_heads).
 *
 * One work item is (sequence, KV head): the group's query heads are scored together, so each K and V row is read
 * once from memory for all of them, straight from its block (no gathered copy). Keys are walked TILE at a time,
 * whatever the block size, with an online softmax in float32; only slots below seq_len are ever read, so the stale
 * tail of a block and the table's padding may hold anything (NaN too). Work items run in parallel under OpenMP;
 * each is computed serially in a fixed order, so a row's result does not depend on the thread count or on the
 * other sequences of the batch.
 *
 * dtype 0: float32 throughout. dtype 1: bfloat16 q, cache and out, widened to float32 on load and rounded to
 * nearest even on store. Loops are plain C for gcc -O3 -march=native to vectorize (AVX-512 or AVX2); the dot
 * products keep LANES partial sums so that their vectorization needs no reassociation (no -ffast-math).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16 /* partial sums per dot product: one AVX-512 register of floats, two AVX2 ones */
#define TILE 32  /* keys per online-softmax step */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's BFloat16 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f)) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* A row of head_dim values as float32: the row itself (float32) or its widened copy in buf (bfloat16). */
static inline const float *load_row(const char *base, int64_t elem_off, int dtype, int head_dim, float *buf) {
    if (dtype == 0) return (const float *)base + elem_off;
    const uint16_t *src = (const uint16_t *)base + elem_off;
    for (int d = 0; d < head_dim; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float part[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int t = 0; t < LANES; t++) part[t] += a[d + t] * b[d + t];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int t = 0; t < w; t++) part[t] += part[t + w];
    float s = part[0];
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

static int attend_one(
    char *out, int64_t out_s, int64_t out_h,
    const char *q, int64_t q_s, int64_t q_h,
    const char *kc, int64_t kc_b, int64_t kc_s, int64_t kc_h,
    const char *vc, int64_t vc_b, int64_t vc_s, int64_t vc_h,
    const int32_t *bt_row, int64_t num_blocks, int64_t row, int kv_head, int seq_len,
    int group, int head_dim, int block_size, float scale, int dtype) {
    const int D = head_dim, G = group;
    float qf[G * D], acc[G * D], s[G * TILE], m[G], l[G], kbuf[D], vbuf[D];
    int32_t blk[TILE], off[TILE];
    const int h0 = kv_head * G;

    for (int g = 0; g < G; g++) {
        const float *qr = load_row(q, row * q_s + (int64_t)(h0 + g) * q_h, dtype, D, kbuf);
        memcpy(qf + g * D, qr, sizeof(float) * D);
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof acc);

    for (int t0 = 0; t0 < seq_len; t0 += TILE) {
        const int n = seq_len - t0 < TILE ? seq_len - t0 : TILE;
        for (int j = 0; j < n; j++) { /* scores [G, n] */
            const int key = t0 + j;
            const int32_t b = bt_row[key / block_size];
            if (b < 0 || b >= num_blocks) return 1;
            blk[j] = b;
            off[j] = key % block_size;
            const float *kr = load_row(kc, b * kc_b + off[j] * kc_s + kv_head * kc_h, dtype, D, kbuf);
            for (int g = 0; g < G; g++) s[g * TILE + j] = dot(qf + g * D, kr, D) * scale;
        }
        for (int g = 0; g < G; g++) { /* online softmax: s becomes the tile's weights, acc and l are rescaled */
            float *sg = s + g * TILE;
            float mt = m[g];
            for (int j = 0; j < n; j++) mt = sg[j] > mt ? sg[j] : mt;
            const float alpha = expf(m[g] - mt); /* 0 on the first tile (m = -inf), where acc and l are 0 */
            float sum = 0.0f;
            for (int j = 0; j < n; j++) {
                sg[j] = expf(sg[j] - mt);
                sum += sg[j];
            }
            l[g] = l[g] * alpha + sum;
            m[g] = mt;
            float *ag = acc + g * D;
            for (int d = 0; d < D; d++) ag[d] *= alpha;
        }
        for (int j = 0; j < n; j++) { /* acc [G, D] += weights [G, n] @ V [n, D] */
            const float *vr = load_row(vc, blk[j] * vc_b + off[j] * vc_s + kv_head * vc_h, dtype, D, vbuf);
            for (int g = 0; g < G; g++) {
                const float p = s[g * TILE + j];
                float *restrict ag = acc + g * D;
                for (int d = 0; d < D; d++) ag[d] += p * vr[d];
            }
        }
    }

    for (int g = 0; g < G; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* seq_len 0: zeros, as the reference */
        const int64_t o = row * out_s + (int64_t)(h0 + g) * out_h;
        if (dtype == 0) {
            float *dst = (float *)out + o;
            for (int d = 0; d < D; d++) dst[d] = acc[g * D + d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)out + o;
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[g * D + d] * inv);
        }
    }
    return 0;
}

/* Returns 0, or 1 + the index of the first sequence whose seq_len or block table is out of range (its rows are
 * then not written). Strides are in elements. */
int paged_decode_attention(
    void *out, int64_t out_s, int64_t out_h,
    const void *q, int64_t q_s, int64_t q_h,
    const void *k_cache, int64_t kc_b, int64_t kc_s, int64_t kc_h,
    const void *v_cache, int64_t vc_b, int64_t vc_s, int64_t vc_h,
    const int32_t *block_tables, int64_t bt_s, int64_t max_blocks, int64_t num_blocks,
    const int32_t *seq_lens, const int32_t *query_start_loc,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int dtype, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t items = (int64_t)num_seqs * num_kv_heads;
    int bad = num_seqs; /* the smallest failing sequence */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && items > 1)
    for (int64_t it = 0; it < items; it++) {
        const int i = (int)(it / num_kv_heads), h = (int)(it % num_kv_heads);
        const int64_t row = query_start_loc[i];
        if (query_start_loc[i + 1] - row != 1) continue;
        const int seq_len = seq_lens[i];
        int err = seq_len < 0 || (int64_t)seq_len > max_blocks * block_size;
        if (!err)
            err = attend_one((char *)out, out_s, out_h, (const char *)q, q_s, q_h,
                             (const char *)k_cache, kc_b, kc_s, kc_h, (const char *)v_cache, vc_b, vc_s, vc_h,
                             block_tables + i * bt_s, num_blocks, row, h, seq_len,
                             group, head_dim, block_size, scale, dtype);
        if (err) {
#pragma omp critical
            if (i < bad) bad = i;
        }
    }
    return bad == num_seqs ? 0 : 1 + bad;
}
