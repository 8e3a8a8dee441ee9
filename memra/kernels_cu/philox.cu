// Philox4x32-10 streams and exponential-race draws, word for word the host's memra/backend/philox.py.
// Uniform i of stream (seed, counter, tag) = word i % 4 of philox(ctr = (i / 4, counter, tag, 0),
// key = (seed lo, seed hi)), mapped to (w + 0.5) / 2^32. A draw from p is argmax_i p_i / E_i with
// E_i = -log(u_i): token i wins with probability p_i; ties go to the lower index.
#include "common.cuh"

static __device__ __forceinline__ void philox10(unsigned c[4], unsigned k0, unsigned k1) {
    for (int r = 0; r < 10; ++r) {
        const unsigned long long p0 = 0xD2511F53ull * c[0];
        const unsigned long long p1 = 0xCD9E8D57ull * c[2];
        const unsigned n0 = (unsigned)(p1 >> 32) ^ c[1] ^ k0;
        const unsigned n2 = (unsigned)(p0 >> 32) ^ c[3] ^ k1;
        c[1] = (unsigned)p1;
        c[3] = (unsigned)p0;
        c[0] = n0;
        c[2] = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

static __device__ __forceinline__ unsigned stream_word(long long i, unsigned k0, unsigned k1,
                                                       unsigned counter, unsigned tag) {
    unsigned c[4] = {(unsigned)(i >> 2), counter, tag, 0u};
    philox10(c, k0, k1);
    return c[i & 3];
}

extern "C" __global__ void philox_block(const unsigned* ctr, const unsigned* key, unsigned* out) {
    after_predecessor();
    unsigned c[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
    philox10(c, key[0], key[1]);
    for (int j = 0; j < 4; ++j) out[j] = c[j];
}

extern "C" __global__ void philox_uniforms(unsigned k0, unsigned k1, unsigned counter, unsigned tag,
                                           long long n, double* out) {
    after_predecessor();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ((double)stream_word(i, k0, k1, counter, tag) + 0.5) / 4294967296.0;
}

// The race's order: the larger score first, equal scores to the lower index (-1: no candidate).
static __device__ __forceinline__ bool race_before(double ob, long long oa, double b, long long a) {
    return ob > b || (ob == b && oa >= 0 && oa < a);
}

// The race over one span of entries a block: [blockIdx.x * span, + span) below n, thread t scans
// its entries t, t + MEMRA_BLOCK, ... then a fixed tree; the span's winner goes to part_*.
extern "C" __global__ void race_parts(const double* p, long long n, long long span, unsigned k0, unsigned k1,
                                      unsigned counter, unsigned tag, double* part_best, long long* part_arg) {
    after_predecessor();
    __shared__ double best[MEMRA_BLOCK];
    __shared__ long long arg[MEMRA_BLOCK];
    const long long lo = (long long)blockIdx.x * span, hi = lo + span < n ? lo + span : n;
    double b = -1.0;
    long long a = -1;
    for (long long i = lo + threadIdx.x; i < hi; i += MEMRA_BLOCK) {
        const double u = ((double)stream_word(i, k0, k1, counter, tag) + 0.5) / 4294967296.0;
        const double s = p[i] / -log(u);
        if (s > b) { b = s; a = i; }
    }
    block_best(b, a, best, arg, race_before);
    if (threadIdx.x == 0) {
        part_best[blockIdx.x] = b;
        part_arg[blockIdx.x] = a;
    }
}

// The spans' winners, one block: the race's winner (a selection, so any split gives the same).
extern "C" __global__ void race_pick(const double* part_best, const long long* part_arg, int parts,
                                     long long* out) {
    after_predecessor();
    __shared__ double best[MEMRA_BLOCK];
    __shared__ long long arg[MEMRA_BLOCK];
    double b = -1.0;
    long long a = -1;
    for (int j = threadIdx.x; j < parts; j += MEMRA_BLOCK)
        if (race_before(part_best[j], part_arg[j], b, a)) {
            b = part_best[j];
            a = part_arg[j];
        }
    block_best(b, a, best, arg, race_before);
    if (threadIdx.x == 0) out[0] = a;
}
