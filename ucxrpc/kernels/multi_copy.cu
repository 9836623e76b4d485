// ucxrpc: copy many byte ranges on the GPU with one launch.
//
// Range r goes from src[r] to dst[r] and is nbytes[r] long.  The host splits
// every range into chunks of `chunk` bytes and lists them (chunk_range,
// chunk_start; every array is 64-bit so that one upload carries them all);
// block b copies chunk b.  Packing many small tensors into one buffer (and
// unpacking them on the other side) is this copy with the destinations (or
// sources) at offsets in one allocation.
//
// Loaded with CuPy (NVRTC) by ucxrpc/_kernels.py, only when CUDA is used.

extern "C" __global__ void multi_copy(const unsigned long long* __restrict__ src,
                                      const unsigned long long* __restrict__ dst,
                                      const unsigned long long* __restrict__ nbytes,
                                      const unsigned long long* __restrict__ chunk_range,
                                      const unsigned long long* __restrict__ chunk_start,
                                      long long chunk)
{
    const unsigned long long r = chunk_range[blockIdx.x];
    const long long start = (long long)chunk_start[blockIdx.x];
    const long long size = (long long)nbytes[r];
    const long long end = start + chunk < size ? start + chunk : size;
    const unsigned char* s = (const unsigned char*)src[r];
    unsigned char* d = (unsigned char*)dst[r];
    long long i = start;
    // 16-byte loads and stores where both sides are 16-byte aligned.
    if (((src[r] | dst[r] | (unsigned long long)start) & 15ULL) == 0ULL) {
        const long long nvec = (end - start) / 16;
        const uint4* s4 = (const uint4*)(s + start);
        uint4* d4 = (uint4*)(d + start);
        for (long long v = threadIdx.x; v < nvec; v += blockDim.x) {
            d4[v] = s4[v];
        }
        i = start + nvec * 16;
    }
    for (long long k = i + threadIdx.x; k < end; k += blockDim.x) {
        d[k] = s[k];
    }
}
