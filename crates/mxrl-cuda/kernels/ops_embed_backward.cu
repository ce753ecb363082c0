// Embedding backward without atomics: dtable[tok] += dx[r] for every row r with tokens[r] = tok,
// in increasing r — the order of the CPU model's loop in mxrl_model::Model::backward, so the
// result is bitwise the reference's. The host (which knows the ids) uploads a CSR grouping of
// the rows by token (mxrl_cuda::ops::embed_backward::EmbedGrouping).

// Block u < gridDim.x handles token uniq[u]: for each column j (threads stride over h),
// acc = dtable[tok, j]; acc += dx[rows[k], j] for k in offsets[u] .. offsets[u+1]; write back.
extern "C" __global__ void embed_backward(float* __restrict__ dtable, const float* __restrict__ dx,
                                          const u32* __restrict__ uniq,
                                          const u32* __restrict__ offsets,
                                          const u32* __restrict__ rows, u64 h) {
    const u64 u = blockIdx.x;
    const u64 tok = uniq[u];
    const u32 k0 = offsets[u], k1 = offsets[u + 1];
    for (u64 j = threadIdx.x; j < h; j += blockDim.x) {
        float acc = dtable[tok * h + j];
        for (u32 k = k0; k < k1; ++k) acc = __fadd_rn(acc, dx[(u64)rows[k] * h + j]);
        dtable[tok * h + j] = acc;
    }
}
