//! The grouped-GEMM problems the GEMM tests (`ops_gemm`, `ops_qgemm`) share.

// Each test file uses part of it.
#![allow(dead_code)]

use mxrl_cuda::ops::gemm::Grouped;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A grouped problem: per-expert row counts (packed expert-major), N, K, and `extra` rows
/// after the last expert that belong to no expert.
#[derive(Debug, Clone)]
pub struct Case {
    pub counts: Vec<usize>,
    pub n: usize,
    pub k: usize,
    pub extra: usize,
}

impl Case {
    pub fn rows(&self) -> usize {
        self.counts.iter().sum::<usize>() + self.extra
    }
    pub fn shape(&self) -> Grouped {
        Grouped {
            experts: self.counts.len(),
            rows: self.rows(),
            n: self.n,
            k: self.k,
        }
    }
    pub fn offsets(&self) -> Vec<u32> {
        offsets_of(&self.counts)
    }
    pub fn expert_of(&self, row: usize) -> Option<usize> {
        let o = self.offsets();
        (0..self.counts.len()).find(|&e| (o[e] as usize..o[e + 1] as usize).contains(&row))
    }
}

/// Row offsets of groups of `counts` rows (`counts.len() + 1` entries).
pub fn offsets_of(counts: &[usize]) -> Vec<u32> {
    let mut o = vec![0u32];
    for c in counts {
        o.push(o.last().unwrap() + *c as u32);
    }
    o
}

/// `tokens` tokens each routed to 8 distinct experts of 64 (the benchmark model's top-8).
pub fn routed(tokens: usize, seed: u64, n: usize, k: usize) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut counts = vec![0usize; 64];
    for _ in 0..tokens {
        for e in rand::seq::index::sample(&mut rng, 64, 8) {
            counts[e] += 1;
        }
    }
    Case {
        counts,
        n,
        k,
        extra: 0,
    }
}
