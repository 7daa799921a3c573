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
 * One work item is a sequence and a run of its KV heads (all of them unless their query heads' state, [heads,
 * max(head_dim, TILE)] floats, would pass MAX_ELEMS). A slot's rows of those heads are adjacent in the engine's
 * cache, so an item reads each block's K and V as two forward runs, each row once from memory for all the query
 * heads that share it (no gathered copy). By the time a layer's attention runs, its weights have pushed the cache
 * out of the CPU's caches: the kernel's time is its memory reads (bench/RESULTS.md, "CPU: decode attention walks
 * each KV row once").
 *
 * Keys are walked TILE at a time, whatever the block size: scores for the tile, an online softmax step in float32,
 * then the tile's V rows, while the next tile's rows are prefetched (the hardware's prefetcher does not follow the
 * table from block to block). Only slots below seq_len are ever read, so the stale tail of a block and the table's
 * padding may hold anything (NaN too). Work items run in parallel under OpenMP; each is computed serially in a
 * fixed order, so a row's result does not depend on the thread count or on the other sequences of the batch.
 *
 * dtype 0: float32 throughout. dtype 1: bfloat16 q, cache and out, widened to float32 on load (a tile's rows of one
 * KV head at a time) and rounded to nearest even on store. The inner loops are GCC vector extensions, VEC floats
 * wide (one AVX-512 register, two AVX2 ones: -march=native picks), specialized for head_dim 64 and 128 so that a
 * query row and an accumulator row stay in registers; no -ffast-math, so the sums keep a fixed order.
 * The caller (kernels/paged_attention_cpu.py) guarantees group * max(head_dim, TILE) <= MAX_ELEMS and head_dim <=
 * MAX_HEAD_DIM: an item's buffers live on its thread's stack.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 32            /* keys per online-softmax step, a multiple of VEC */
#define VEC 16             /* floats per vector */
#define MAX_ELEMS 8192     /* floats of one item's per-head arrays (q, acc: head_dim a head; scores: TILE) */
#define MAX_HEAD_DIM 256   /* bfloat16 rows are widened into a [TILE, head_dim] buffer */

typedef float vf __attribute__((vector_size(VEC * sizeof(float))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VEC * sizeof(int32_t))));

static inline vf load_vf(const float *p) { /* unaligned */
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void store_vf(float *p, vf x) { memcpy(p, &x, sizeof x); }

static inline float hsum(vf x) { /* a fixed pairwise order */
    vf8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
            + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

_Static_assert(VEC == 16 && TILE % VEC == 0, "hsum_each's shuffles are written for 16 lanes");

/* The sums of VEC vectors, one a lane: out[j] = the lanes of x[j] summed (pairwise, in a fixed order). A shuffle
 * tree: each level halves the vectors and the lanes each key still spans, ~3 VEC instructions where VEC separate
 * reductions would take ~7 VEC. */
static inline vf hsum_each(const vf x[VEC]) {
    vf t[8], u[4], w[2];
    for (int k = 0; k < 8; k++) /* t[k]: 8 lanes of key 2k, then 8 of key 2k + 1 */
        t[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(x[2 * k], x[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                         29, 30, 31);
    for (int k = 0; k < 4; k++) /* u[k]: 4 lanes each of keys 4k .. 4k + 3 */
        u[k] = __builtin_shufflevector(t[2 * k], t[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(t[2 * k], t[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                         30, 31);
    for (int k = 0; k < 2; k++) /* w[k]: 2 lanes each of keys 8k .. 8k + 7 */
        w[k] = __builtin_shufflevector(u[2 * k], u[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
               + __builtin_shufflevector(u[2 * k], u[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                                         30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* exp of VEC floats <= 0 (the softmax's s - max), within 1 ulp of glibc's expf (a sweep of [-90, 0]): 2^n *
 * exp(r), |r| <= ln 2 / 2, exp(r) by Cephes' degree-6 polynomial; below -87.3 (near float32's smallest normal) and
 * at -inf, 0. A scalar expf call per score was ~40% of the kernel's time on warm caches. */
static inline vf exp_vf(vf x) {
    const vf lo = x - x - 87.3f; /* a broadcast, in the vector's own type */
    const vi keep = x >= lo;     /* -1 where x is in range */
    x = (vf)((vi)x & keep) + (vf)((vi)lo & ~keep); /* out of range (and -inf): a finite value, masked below */
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, kept in the low mantissa bits */
    const vf t = x * 1.44269504088896341f + magic;
    const vf n = t - magic;
    const vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi pow2n = ((vi)t - (vi)(x - x + magic) + 127) << 23; /* 2^n, n in [-126, 0] */
    return (vf)((vi)(p * (vf)pow2n) & keep);
}

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

/* The n rows base + off[j] + head_off (j < n) as float32: pointers into the cache (float32), or into buf, where
 * they are widened (bfloat16); rows[n:TILE] repeat row 0. */
static inline void tile_rows(const char *base, const int64_t *off, int64_t head_off, int n, int dtype, int D,
                             float *buf, const float **rows) {
    for (int j = 0; j < n; j++) {
        if (dtype == 0) {
            rows[j] = (const float *)base + off[j] + head_off;
        } else {
            const uint16_t *src = (const uint16_t *)base + off[j] + head_off;
            for (int d = 0; d < D; d++) buf[j * D + d] = bf16_to_f32(src[d]);
            rows[j] = buf + j * D;
        }
    }
    for (int j = n; j < TILE; j++) rows[j] = rows[0]; /* a short tile's rest: read, then masked */
}

/* Asks for the rows of KV heads [kv0, kv1) of keys [t0, t1), K and V, every cache line, into L2 (prefetcht2: a
 * tile's 48 KB at SmolLM2's shapes would thrash L1). Stops at a block id outside the cache, so that no address is
 * formed from it (attend reports it). */
static inline void prefetch_keys(const char *kc, int64_t kc_b, int64_t kc_s, int64_t kc_h,
                                 const char *vc, int64_t vc_b, int64_t vc_s, int64_t vc_h,
                                 const int32_t *bt_row, int64_t num_blocks, int t0, int t1, int block_size,
                                 int kv0, int kv1, int D, int esz) {
    const int adjacent = kc_h == D && vc_h == D; /* a slot's rows of these heads are one run of bytes */
    const int run = (adjacent ? kv1 - kv0 : 1) * D * esz, runs = adjacent ? 1 : kv1 - kv0;
    for (int key = t0; key < t1; key++) {
        const int32_t b = bt_row[key / block_size];
        if (b < 0 || b >= num_blocks) return;
        const int64_t o = key % block_size;
        for (int r = 0; r < runs; r++) {
            const char *kp = kc + (b * kc_b + o * kc_s + (int64_t)(kv0 + r) * kc_h) * esz;
            const char *vp = vc + (b * vc_b + o * vc_s + (int64_t)(kv0 + r) * vc_h) * esz;
            for (int x = 0; x < run; x += 64) {
                __builtin_prefetch(kp + x, 0, 1);
                __builtin_prefetch(vp + x, 0, 1);
            }
        }
    }
}

/* Attends query row `row` of query heads [kv0 * G, kv1 * G) to seq_len keys. D is a literal in the specialized
 * copies (attend_64, attend_128), where the C = D / VEC vectors of a row are registers. Returns 1 for a block id
 * outside the cache. */
static inline __attribute__((always_inline)) int attend(
    char *out, int64_t out_s, int64_t out_h,
    const char *q, int64_t q_s, int64_t q_h,
    const char *kc, int64_t kc_b, int64_t kc_s, int64_t kc_h,
    const char *vc, int64_t vc_b, int64_t vc_s, int64_t vc_h,
    const int32_t *bt_row, int64_t num_blocks, int64_t row, int seq_len,
    int kv0, int kv1, int G, const int D, int block_size, float scale, int dtype) {
    const int NH = (kv1 - kv0) * G, C = D / VEC, h0 = kv0 * G;
    float qf[NH * D], acc[NH * D], s[NH * TILE], m[NH], l[NH], alpha[NH];
    float kbuf[dtype ? TILE * D : 1];
    int64_t koff[TILE], voff[TILE];
    const float *rows[TILE];

    for (int h = 0; h < NH; h++) { /* qf = q * scale, so that the dots are the scores */
        const int64_t o = row * q_s + (int64_t)(h0 + h) * q_h;
        for (int d = 0; d < D; d++)
            qf[h * D + d] = (dtype == 0 ? ((const float *)q)[o + d] : bf16_to_f32(((const uint16_t *)q)[o + d]))
                            * scale;
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof acc);

    const int esz = dtype == 0 ? 4 : 2;
    prefetch_keys(kc, kc_b, kc_s, kc_h, vc, vc_b, vc_s, vc_h, bt_row, num_blocks, 0, seq_len < TILE ? seq_len : TILE,
                  block_size, kv0, kv1, D, esz);
    for (int t0 = 0; t0 < seq_len; t0 += TILE) {
        const int n = seq_len - t0 < TILE ? seq_len - t0 : TILE;
        if (t0 + TILE < seq_len) /* the next tile, while this one computes */
            prefetch_keys(kc, kc_b, kc_s, kc_h, vc, vc_b, vc_s, vc_h, bt_row, num_blocks, t0 + TILE,
                          t0 + 2 * TILE < seq_len ? t0 + 2 * TILE : seq_len, block_size, kv0, kv1, D, esz);
        for (int j = 0; j < n; j++) {
            const int key = t0 + j;
            const int32_t b = bt_row[key / block_size];
            if (b < 0 || b >= num_blocks) return 1;
            koff[j] = b * kc_b + (int64_t)(key % block_size) * kc_s;
            voff[j] = b * vc_b + (int64_t)(key % block_size) * vc_s;
        }
        for (int kh = kv0; kh < kv1; kh++) { /* s[h, :n] = qf[h] . K[:n, kh] */
            tile_rows(kc, koff, (int64_t)kh * kc_h, n, dtype, D, kbuf, rows);
            for (int h = (kh - kv0) * G; h < (kh - kv0 + 1) * G; h++) {
                const float *qh = qf + h * D;
                vf qv[C > 0 ? C : 1];
                for (int c = 0; c < C; c++) qv[c] = load_vf(qh + VEC * c);
                for (int j0 = 0; j0 < n; j0 += VEC) { /* VEC keys' dots, reduced together */
                    vf a[VEC];
                    for (int j = 0; j < VEC; j++) {
                        a[j] = (vf){0};
                        for (int c = 0; c < C; c++) a[j] += qv[c] * load_vf(rows[j0 + j] + VEC * c);
                    }
                    store_vf(s + h * TILE + j0, hsum_each(a));
                    for (int j = 0; j < VEC && C * VEC < D; j++) /* head_dim off the vector width */
                        for (int d = C * VEC; d < D; d++) s[h * TILE + j0 + j] += qh[d] * rows[j0 + j][d];
                }
            }
        }
        for (int h = 0; h < NH; h++) { /* online softmax: s becomes the tile's weights, l and acc are rescaled */
            float *sh = s + h * TILE;
            float mt = m[h];
            for (int j = 0; j < n; j++) mt = sh[j] > mt ? sh[j] : mt;
            alpha[h] = expf(m[h] - mt); /* 0 on the first tile (m = -inf), where acc and l are 0 */
            for (int j = n; j < TILE; j++) sh[j] = -INFINITY; /* a short tile's weights: 0 */
            vf sum = {0};
            for (int j = 0; j < TILE; j += VEC) {
                const vf e = exp_vf(load_vf(sh + j) - mt);
                store_vf(sh + j, e);
                sum += e;
            }
            l[h] = l[h] * alpha[h] + hsum(sum);
            m[h] = mt;
        }
        for (int kh = kv0; kh < kv1; kh++) { /* acc[h] = alpha * acc[h] + s[h, :n] @ V[:n, kh] */
            tile_rows(vc, voff, (int64_t)kh * vc_h, n, dtype, D, kbuf, rows);
            for (int h = (kh - kv0) * G; h < (kh - kv0 + 1) * G; h++) {
                float *ah = acc + h * D;
                const float *sh = s + h * TILE;
                vf a[C > 0 ? C : 1];
                for (int c = 0; c < C; c++) a[c] = load_vf(ah + VEC * c) * alpha[h];
                for (int d = C * VEC; d < D; d++) ah[d] *= alpha[h];
                for (int j = 0; j < n; j++) {
                    const float *vr = rows[j];
                    const float p = sh[j];
                    for (int c = 0; c < C; c++) a[c] += p * load_vf(vr + VEC * c);
                    for (int d = C * VEC; d < D; d++) ah[d] += p * vr[d];
                }
                for (int c = 0; c < C; c++) store_vf(ah + VEC * c, a[c]);
            }
        }
    }

    for (int h = 0; h < NH; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f; /* seq_len 0: zeros, as the reference */
        const int64_t o = row * out_s + (int64_t)(h0 + h) * out_h;
        if (dtype == 0) {
            float *dst = (float *)out + o;
            for (int d = 0; d < D; d++) dst[d] = acc[h * D + d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)out + o;
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[h * D + d] * inv);
        }
    }
    return 0;
}

#define ATTEND_PARAMS char *out, int64_t out_s, int64_t out_h, const char *q, int64_t q_s, int64_t q_h, \
    const char *kc, int64_t kc_b, int64_t kc_s, int64_t kc_h, const char *vc, int64_t vc_b, int64_t vc_s, \
    int64_t vc_h, const int32_t *bt_row, int64_t num_blocks, int64_t row, int seq_len, int kv0, int kv1, int G, \
    int head_dim, int block_size, float scale, int dtype
#define ATTEND_ARGS(D) out, out_s, out_h, q, q_s, q_h, kc, kc_b, kc_s, kc_h, vc, vc_b, vc_s, vc_h, bt_row, \
    num_blocks, row, seq_len, kv0, kv1, G, D, block_size, scale, dtype

static int attend_64(ATTEND_PARAMS) { (void)head_dim; return attend(ATTEND_ARGS(64)); }
static int attend_128(ATTEND_PARAMS) { (void)head_dim; return attend(ATTEND_ARGS(128)); }
static int attend_any(ATTEND_PARAMS) { return attend(ATTEND_ARGS(head_dim)); }

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
    const int width = head_dim > TILE ? head_dim : TILE;
    int per_item = MAX_ELEMS / (group * width); /* KV heads an item takes; >= 1 (the caller's guarantee) */
    if (per_item > num_kv_heads) per_item = num_kv_heads;
    const int chunks = (num_kv_heads + per_item - 1) / per_item;
    int (*fn)(ATTEND_PARAMS) = head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any;
    const int64_t items = (int64_t)num_seqs * chunks;
    int bad = num_seqs; /* the smallest failing sequence */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && items > 1)
    for (int64_t it = 0; it < items; it++) {
        const int i = (int)(it / chunks), kv0 = (int)(it % chunks) * per_item;
        const int kv1 = kv0 + per_item < num_kv_heads ? kv0 + per_item : num_kv_heads;
        const int64_t row = query_start_loc[i];
        if (query_start_loc[i + 1] - row != 1) continue;
        const int seq_len = seq_lens[i];
        int err = seq_len < 0 || (int64_t)seq_len > max_blocks * block_size;
        if (!err)
            err = fn((char *)out, out_s, out_h, (const char *)q, q_s, q_h,
                     (const char *)k_cache, kc_b, kc_s, kc_h, (const char *)v_cache, vc_b, vc_s, vc_h,
                     block_tables + i * bt_s, num_blocks, row, seq_len, kv0, kv1, group,
                     head_dim, block_size, scale, dtype);
        if (err) {
#pragma omp critical
            if (i < bad) bad = i;
        }
    }
    return bad == num_seqs ? 0 : 1 + bad;
}
