// Rotary position embedding (rotate-half form), in place. Reference:
// mxrl_tensor::rope::{rope_forward, rope_backward}: the same two products and one sum per output,
// so the result is bitwise the reference's for the same table values.

// x: [n, heads * 2 * half]; cos, sin: [max_pos, half]; pos: [n]. One thread per (row, head, i),
// i < half: with c = cos[pos, i], s = sign * sin[pos, i] (sign = +1 forward, -1 backward),
// x[i] <- x[i]*c - x[i+half]*s, x[i+half] <- x[i+half]*c + x[i]*s. A position >= max_pos has no
// table row: its outputs become NaN (never an out-of-bounds read).
extern "C" __global__ void rope_apply(float* __restrict__ x, const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t, const u32* __restrict__ pos,
                                      u64 n, u32 heads, u32 half, u32 max_pos, float sign) {
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 per_row = (u64)heads * half;
    if (idx >= n * per_row) return;
    const u64 t = idx / per_row;
    const u32 rem = (u32)(idx - t * per_row);
    const u32 h = rem / half, i = rem - h * half;
    float* v = x + (t * heads + h) * (2 * (u64)half);
    const u32 p = pos[t];
    if (p >= max_pos) {
        v[i] = __int_as_float(0x7fc00000);
        v[i + half] = __int_as_float(0x7fc00000);
        return;
    }
    const float c = cos_t[(u64)p * half + i];
    const float s = __fmul_rn(sign, sin_t[(u64)p * half + i]);
    const float a = v[i], b = v[i + half];
    v[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    v[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}
