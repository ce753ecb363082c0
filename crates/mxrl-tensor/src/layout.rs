//! Packed variable-length batches.

/// A batch of `B` variable-length sequences packed token-major: sequence `b` occupies rows
/// `offsets[b] .. offsets[b] + lens[b]` of every `[N, ...]` activation, `N = Σ lens`.
/// Positions inside a sequence start at 0 (prefill from an empty cache).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqLayout {
    lens: Vec<usize>,
    offsets: Vec<usize>,
}

impl SeqLayout {
    /// Layout of sequences with the given lengths (zero-length sequences are allowed).
    pub fn new(lens: &[usize]) -> Self {
        let mut offsets = Vec::with_capacity(lens.len() + 1);
        let mut acc = 0;
        for &l in lens {
            offsets.push(acc);
            acc += l;
        }
        offsets.push(acc);
        SeqLayout {
            lens: lens.to_vec(),
            offsets,
        }
    }

    /// Number of sequences `B`.
    pub fn num_seqs(&self) -> usize {
        self.lens.len()
    }

    /// Total number of tokens `N`.
    pub fn num_tokens(&self) -> usize {
        *self.offsets.last().expect("offsets has B+1 entries")
    }

    /// Length of sequence `b`.
    pub fn len(&self, b: usize) -> usize {
        self.lens[b]
    }

    /// Whether the batch holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.num_tokens() == 0
    }

    /// First row of sequence `b`.
    pub fn offset(&self, b: usize) -> usize {
        self.offsets[b]
    }

    /// All sequence lengths.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Position of every packed token inside its sequence (`[N]`).
    pub fn positions(&self) -> Vec<usize> {
        let mut p = Vec::with_capacity(self.num_tokens());
        for &l in &self.lens {
            p.extend(0..l);
        }
        p
    }
}
