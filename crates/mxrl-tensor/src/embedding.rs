//! Token embedding: the gather forward and the scatter-add backward.

/// Embedding forward: `out[r, :] = table[tokens[r], :]` (`table: [vocab, h]`, `out: [n, h]`).
///
/// # Panics
/// If a token id is not below `table.len() / h` (callers validate ids first).
pub fn embedding_forward(table: &[f32], tokens: &[u32], h: usize, out: &mut [f32]) {
    assert_eq!(out.len(), tokens.len() * h);
    for (r, &tok) in tokens.iter().enumerate() {
        let t = tok as usize;
        out[r * h..(r + 1) * h].copy_from_slice(&table[t * h..(t + 1) * h]);
    }
}

/// Embedding backward: `dtable[tokens[r], :] += dx[r, :]` for `r = 0, 1, …` in increasing
/// order (f32), the order the model's backward has always used; `dtable: [vocab, h]`,
/// `dx: [n, h]`.
///
/// # Panics
/// If a token id is not below `dtable.len() / h`.
pub fn embedding_backward(dtable: &mut [f32], dx: &[f32], tokens: &[u32], h: usize) {
    assert_eq!(dx.len(), tokens.len() * h);
    for (r, &tok) in tokens.iter().enumerate() {
        let t = tok as usize;
        let row = &mut dtable[t * h..(t + 1) * h];
        for (a, b) in row.iter_mut().zip(&dx[r * h..(r + 1) * h]) {
            *a += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_accumulates_repeated_tokens_and_forward_gathers() {
        let table: Vec<f32> = (0..12).map(|i| i as f32).collect(); // vocab 4, h 3
        let tokens = [2u32, 0, 2];
        let mut out = vec![0.0; 9];
        embedding_forward(&table, &tokens, 3, &mut out);
        assert_eq!(out, [6.0, 7.0, 8.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0]);
        let mut d = vec![0.5; 12];
        let dx: Vec<f32> = (0..9).map(|i| i as f32).collect();
        embedding_backward(&mut d, &dx, &tokens, 3);
        assert_eq!(
            d,
            [3.5, 4.5, 5.5, 0.5, 0.5, 0.5, 6.5, 8.5, 10.5, 0.5, 0.5, 0.5]
        );
    }
}
