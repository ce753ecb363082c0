//! Every case of the public vector file (torchao MXFP8 RCEIL, TE NVFP4 reference) is
//! reproduced byte for byte — data, scales and amax — by the reference and the fast path.

mod common;

#[test]
fn public_vectors_are_byte_equal() {
    let path = common::repo_vector_path("quant-public.safetensors");
    let n = common::check_vector_file(&path);
    // 48 cases: 3 outputs for M ∈ {1, 3}, 4 for M = 16, 5 for M ∈ {32, 128, 64}; ×2 paths.
    assert_eq!(n, 2 * (16 * 3 + 8 * 4 + 24 * 5));
}
