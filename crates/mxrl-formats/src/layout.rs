//! Byte layouts: E2M1 nibble packing and the 128×4 scale swizzle (contract §3 step 5, §4).

/// Pack E2M1 codes two per byte: element 2i in the **low** nibble of byte i, element 2i+1 in
/// the high nibble. An odd count leaves the last high nibble 0. Only the low 4 bits of each
/// code are used.
pub fn pack_nibbles(codes: &[u8]) -> Vec<u8> {
    codes
        .chunks(2)
        .map(|p| (p[0] & 0xF) | (p.get(1).copied().unwrap_or(0) & 0xF) << 4)
        .collect()
}

/// Inverse of [`pack_nibbles`]: the first `n` codes (low nibble first).
///
/// # Panics
/// If `packed` holds fewer than `n` nibbles (a broken invariant of the caller).
pub fn unpack_nibbles(packed: &[u8], n: usize) -> Vec<u8> {
    assert!(
        packed.len() * 2 >= n,
        "unpack_nibbles: {} bytes cannot hold {n} codes",
        packed.len()
    );
    (0..n)
        .map(|i| (packed[i / 2] >> (4 * (i % 2))) & 0xF)
        .collect()
}

/// Byte offset of scale (r, c) in the 128×4-swizzled layout of a `[rows, cols]` scale matrix
/// (contract §4): `((r/128)·(Cp/4) + c/4)·512 + (r%32)·16 + ((r%128)/32)·4 + c%4` with
/// `Cp = roundup(cols, 4)`.
#[inline]
pub fn swizzle_offset(r: usize, c: usize, cols: usize) -> usize {
    let cp = cols.div_ceil(4) * 4;
    ((r / 128) * (cp / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4
}

/// Size in bytes of the swizzled form of a `[rows, cols]` scale matrix:
/// `roundup(rows, 128) · roundup(cols, 4)`.
pub fn swizzled_len(rows: usize, cols: usize) -> usize {
    rows.div_ceil(128) * 128 * cols.div_ceil(4) * 4
}

/// Compact row-major `[rows, cols]` → 128×4 swizzled (padding bytes 0x00).
///
/// # Panics
/// If `compact.len() != rows * cols`.
pub fn swizzle_128x4(compact: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert_eq!(
        compact.len(),
        rows * cols,
        "swizzle_128x4: buffer is not [{rows}, {cols}]"
    );
    let mut out = vec![0u8; swizzled_len(rows, cols)];
    for r in 0..rows {
        for c in 0..cols {
            out[swizzle_offset(r, c, cols)] = compact[r * cols + c];
        }
    }
    out
}

/// 128×4 swizzled → compact row-major `[rows, cols]` (padding dropped).
///
/// # Panics
/// If `swizzled.len() != swizzled_len(rows, cols)`.
pub fn unswizzle_128x4(swizzled: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert_eq!(
        swizzled.len(),
        swizzled_len(rows, cols),
        "unswizzle_128x4: buffer is not a swizzled [{rows}, {cols}]"
    );
    let mut out = vec![0u8; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = swizzled[swizzle_offset(r, c, cols)];
        }
    }
    out
}

/// Transpose a row-major `[rows, cols]` byte matrix.
pub(crate) fn transpose_bytes(src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; src.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = src[r * cols + c];
        }
    }
    out
}
