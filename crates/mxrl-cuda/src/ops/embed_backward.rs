//! Embedding backward `dtable[tokens[r]] += dx[r]` without atomics (kernel
//! `kernels/ops_embed_backward.cu`).
//!
//! The host, which knows the token ids, groups the rows by token ([`EmbedGrouping`], a CSR of
//! row indices in increasing order per distinct token) and uploads it; one block per distinct
//! token adds its rows in increasing row order — the order of the CPU model's loop in
//! `mxrl_model::Model::backward` — so the result is bitwise the reference's.
#![allow(unsafe_code)]

use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_embed_backward.cu");

const THREADS: u32 = 256;

/// Rows grouped by token id (host side): `uniq[u]` is the `u`-th distinct token (ascending),
/// its rows are `rows[offsets[u] .. offsets[u + 1]]` in increasing order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbedGrouping {
    /// Distinct token ids, ascending.
    pub uniq: Vec<u32>,
    /// `uniq.len() + 1` offsets into `rows`.
    pub offsets: Vec<u32>,
    /// Row indices grouped by token (a stable sort of `0..n` by token).
    pub rows: Vec<u32>,
}

impl EmbedGrouping {
    /// Groups `tokens` (one per row); every id must be `< vocab`.
    ///
    /// # Errors
    /// A token id `≥ vocab` (named with its row), or more than `u32::MAX` rows.
    pub fn new(tokens: &[u32], vocab: usize) -> Result<Self, String> {
        if tokens.len() > u32::MAX as usize {
            return Err(format!("{} rows exceed u32 indexing", tokens.len()));
        }
        if let Some((r, &t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(format!(
                "token {t} at row {r} is outside the vocabulary of {vocab}"
            ));
        }
        let mut rows: Vec<u32> = (0..tokens.len() as u32).collect();
        rows.sort_by_key(|&r| tokens[r as usize]); // stable: rows ascending within a token
        let mut uniq = Vec::new();
        let mut offsets = Vec::new();
        for (k, &r) in rows.iter().enumerate() {
            let t = tokens[r as usize];
            if uniq.last() != Some(&t) {
                uniq.push(t);
                offsets.push(k as u32);
            }
        }
        offsets.push(rows.len() as u32);
        Ok(EmbedGrouping {
            uniq,
            offsets,
            rows,
        })
    }
}

/// A grouping uploaded to the device.
pub struct DeviceGrouping {
    uniq: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    rows: CudaSlice<u32>,
    n_uniq: usize,
    n_rows: usize,
    max_token: u32,
}

/// The loaded kernel.
pub struct EmbedBackward {
    gpu: Gpu,
    f: CudaFunction,
}

impl EmbedBackward {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_embed_backward", SOURCE)?;
        let f = m
            .load_function("embed_backward")
            .map_err(|x| gpu.err(format!("kernel embed_backward: {x:?}")))?;
        Ok(EmbedBackward {
            gpu: gpu.clone(),
            f,
        })
    }

    /// Uploads a grouping (validated: offsets ascending from 0 to `rows.len()`, tokens strictly
    /// ascending, row indices below `rows.len()`).
    ///
    /// # Errors
    /// An inconsistent grouping; out of device memory.
    pub fn upload(&self, g: &EmbedGrouping) -> Result<DeviceGrouping, DeviceError> {
        let ok = g.offsets.len() == g.uniq.len() + 1
            && g.offsets.first() == Some(&0)
            && g.offsets.windows(2).all(|w| w[0] <= w[1])
            && *g.offsets.last().expect("non-empty") as usize == g.rows.len()
            && g.uniq.windows(2).all(|w| w[0] < w[1])
            && g.rows.iter().all(|&r| (r as usize) < g.rows.len());
        if !ok {
            return Err(self.gpu.err("embed backward: inconsistent row grouping"));
        }
        Ok(DeviceGrouping {
            uniq: self.gpu.upload(&g.uniq)?,
            offsets: self.gpu.upload(&g.offsets)?,
            rows: self.gpu.upload(&g.rows)?,
            n_uniq: g.uniq.len(),
            n_rows: g.rows.len(),
            max_token: g.uniq.iter().copied().max().unwrap_or(0),
        })
    }

    /// `dtable [vocab, h] += Σ_rows dx [rows, h]` scattered by the grouping's tokens (f32, adds
    /// in increasing row order per token). Reference: the embedding loop of
    /// `mxrl_model::Model::backward`; bitwise.
    ///
    /// # Errors
    /// A token `≥ vocab`, a row index beyond `dx`, short buffers; launch errors.
    pub fn run(
        &self,
        dtable: &mut CudaViewMut<'_, f32>,
        vocab: usize,
        dx: &CudaView<'_, f32>,
        rows: usize,
        h: usize,
        grouping: &DeviceGrouping,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        if grouping.n_rows != rows {
            return Err(g.err(format!(
                "embed backward: grouping of {} rows for {rows} rows of dx",
                grouping.n_rows
            )));
        }
        if grouping.n_uniq > 0 && grouping.max_token as usize >= vocab {
            return Err(g.err(format!(
                "embed backward: token {} outside the vocabulary of {vocab}",
                grouping.max_token
            )));
        }
        if dtable.len() < vocab * h || dx.len() < rows * h {
            return Err(g.err(format!(
                "embed backward: dtable {} (want {}), dx {} (want {})",
                dtable.len(),
                vocab * h,
                dx.len(),
                rows * h
            )));
        }
        if grouping.n_uniq == 0 || h == 0 {
            return Ok(());
        }
        let h64 = h as u64;
        let cfg = LaunchConfig {
            grid_dim: (grouping.n_uniq as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = g.stream().launch_builder(&self.f);
        b.arg(dtable)
            .arg(dx)
            .arg(&grouping.uniq)
            .arg(&grouping.offsets)
            .arg(&grouping.rows)
            .arg(&h64);
        // SAFETY: block u < n_uniq reads uniq[u] (< vocab, checked at upload via max_token),
        // offsets[u], offsets[u+1] (n_uniq + 1 held, ascending, last = n_rows = rows, checked at
        // upload) and rows[k] for k < rows; every row index is < rows by construction of the
        // grouping (a permutation of 0..rows); it reads dx[row·h + j] (rows·h held) and
        // reads/writes dtable[tok·h + j] (vocab·h held). Distinct blocks touch distinct tokens.
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }
}
