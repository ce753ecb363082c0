//! FP8-block linears of [`CudaBackend`] (routed experts and dense linears): the stored
//! weights as [`QExperts`] keeps them (E4M3 codes `[E, N, K]` in `codes`, the f32
//! `scale_inv [E, N/128, K/128]` as little-endian bytes in `scales`, no amax), quantized on
//! the device with the contract kernels and multiplied by the one-launch FP8-block GEMMs
//! ([`crate::ops::fp8block`], [`QGemm::grouped_nt_staged_fp8_block`]), chosen by the rows
//! per weight on average:
//! - from [`STAGED_ROWS_PER_EXPERT`] rows — up to [`super::QFRAG_ROWS_PER_EXPERT`] for routed
//!   experts, any number for a dense weight (one group of every row) — the staged kernels,
//!   on binary16 operands from [`QGemm::quant_act_fp8_block`]; routed experts without a tape
//!   quantize the tokens' rows once and gather their operands; dense weights run on the
//!   deeper-staged dense kernels ([`QGemm::dense_nt_staged_fp8_block_multi`]), up to three
//!   weights on one input (q, k, v) in one launch;
//! - fewer rows: routed experts on the fragment kernels (sm_89+), dense weights on the tiled
//!   kernels; more rows per routed expert: the tiled kernels.
//!
//! References: the CPU backend's `upload_experts`,
//! `quantize_weights`, `grouped_qlinear`, `qlinear` and `stored_weights` on
//! `mxrl_tensor::qlinear::PreparedWeight` (bytes equal; GEMM outputs within
//! `mxrl_tensor::tolerance::fp8_block_sum_bound`). The backward of a `high_precision` FP8-block
//! linear multiplies BF16 operands from the f32 masters (`grouped_qlinear_backward`), as for
//! the other formats.

use super::{de, CudaBackend, QExperts, RouteBufs, QFRAG_ROWS_PER_EXPERT};
use crate::cuda::{f32_from_le_bytes, f32_le_bytes};
use crate::ops::fp8block::{Fp8Block, Fp8FragMma, FRAG_ROWS_PER_EXPERT};
use crate::ops::gemm::Grouped;
use crate::ops::qgemm::{
    fp8_staged_smem_bytes, frag_rows, QGemm, FP8_DENSE_STAGES_PICK, FP8_ROUTED_STAGES_PICK,
    STAGED_ROWS_PER_EXPERT, STAGED_SMEM_MAX,
};
use cudarc::driver::CudaSlice;
use mxrl_formats::{Format, QuantizedTensor, ScaleLayout, ScaleRule, Scales, Scheme, FP8_BLOCK};
use mxrl_tensor::device::{DResult, DeviceError};
use mxrl_tensor::qlinear::{LinearSpec, PreparedWeight};

impl CudaBackend {
    fn fp8_err(&self, m: String) -> DeviceError {
        DeviceError::new(self.gpu.name(), m)
    }

    /// The FP8-block kernels, or why they did not load.
    fn fp8_ops(&self, what: &str) -> DResult<&Fp8Block> {
        self.fp8
            .as_ref()
            .map_err(|e| self.fp8_err(format!("{what}: the FP8-block kernels did not load: {e}")))
    }

    /// Chooses how the FP8-block fragment kernels (routed experts at decode) sum on the tensor
    /// cores (default [`Fp8FragMma::F16`], see [`Fp8Block::set_frag_mma`]); a no-op when the
    /// FP8-block kernels did not load.
    pub fn set_fp8_frag_mma(&self, mma: Fp8FragMma) {
        if let Ok(ops) = &self.fp8 {
            ops.set_frag_mma(mma);
        }
    }

    /// Stored FP8-block weights as [`QExperts`] keeps them.
    pub(super) fn fp8_experts(
        &self,
        spec: LinearSpec,
        e: usize,
        n: usize,
        k: usize,
        codes: CudaSlice<u8>,
        scales: CudaSlice<u8>,
    ) -> DResult<QExperts> {
        Ok(QExperts {
            format: Format::Fp8Block,
            e,
            n,
            k,
            codes,
            scales,
            // Unused for FP8 block (QExperts::bytes counts amax for NVFP4 only).
            amax: self.gpu.upload(&[0.0f32]).map_err(de)?,
            spec,
            fast_decode: super::FastDecode::known(false),
            train: std::cell::OnceCell::new(),
            serve: std::cell::OnceCell::new(),
        })
    }

    /// `adamw_requantize` for FP8-block weights (N and K multiples of 128): the AdamW step and
    /// the 128×128-tile quantization of the new master in one pass (`QGemm::adamw_fp8_block`:
    /// the bits of `adamw` followed by `quantize_weights`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn adamw_fp8_block(
        &self,
        q: &QGemm,
        param: &mut CudaSlice<f32>,
        grad: &CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        update: &mxrl_tensor::device::AdamWUpdate<'_>,
        op: Option<&mut CudaSlice<u16>>,
        stored: &mxrl_tensor::device::StoredLayout<'_>,
    ) -> DResult<QExperts> {
        let (groups, n, k) = (stored.groups, stored.n, stored.k);
        let len = groups * n * k;
        let tiles = (groups * n / FP8_BLOCK) * (k / FP8_BLOCK);
        let scale = self.grad_scale_buffer(update.grad_scale)?;
        let mut codes = self.gpu.empty::<u8>(len.max(1)).map_err(de)?;
        let mut scales = self.gpu.empty::<u8>((4 * tiles).max(4)).map_err(de)?;
        super::with_adamw_param(param, grad, m, v, op, len, update.weight_decay, |p| {
            q.adamw_fp8_block(
                p,
                &scale.as_view(),
                update.step,
                update.cfg,
                k,
                &mut codes.as_view_mut(),
                &mut scales.as_view_mut(),
            )
        })
        .map_err(|e| self.fp8_err(format!("{}: {e}", (stored.name)(0))))?;
        self.fp8_experts(stored.spec, groups, n, k, codes, scales)
    }

    /// `upload_experts` for FP8 block: every weight's stored codes and f32 scales, checked to
    /// be 128×128 weight tiles of `[n, k]` with N and K multiples of 128.
    pub(super) fn fp8_upload_experts(&self, experts: Vec<PreparedWeight>) -> DResult<QExperts> {
        let first = &experts[0];
        let (spec, n, k) = (first.spec(), first.n(), first.k());
        if !n.is_multiple_of(FP8_BLOCK) || !k.is_multiple_of(FP8_BLOCK) {
            return Err(self.fp8_err(format!(
                "upload_experts: {} is [{n}, {k}]; the device runs FP8-block weights with N and \
                 K multiples of 128",
                first.name()
            )));
        }
        let (mut codes, mut scales) = (Vec::new(), Vec::new());
        for pw in &experts {
            let q = pw
                .stored()
                .ok_or_else(|| self.fp8_err(format!("{}: no stored bytes", pw.name())))?
                .clone()
                .with_scale_layout(ScaleLayout::Compact)
                .map_err(|e| self.fp8_err(format!("{}: {e}", pw.name())))?;
            let Scales::F32(sv) = &q.scales else {
                return Err(self.fp8_err(format!("{}: FP8-block scales are f32", pw.name())));
            };
            if q.scheme != Scheme::FP8_BLOCK_WEIGHT
                || q.shape != [n, k]
                || q.padded_shape != q.shape
            {
                return Err(self.fp8_err(format!(
                    "{}: {} {:?} (padded {:?}); the device keeps {} [{n}, {k}] (128×128 tiles, \
                     exact f32 scales)",
                    pw.name(),
                    q.scheme,
                    q.shape,
                    q.padded_shape,
                    Scheme::FP8_BLOCK_WEIGHT
                )));
            }
            codes.extend_from_slice(&q.data);
            scales.extend(f32_le_bytes(sv));
        }
        let codes = self.gpu.upload(&codes).map_err(de)?;
        let scales = self.gpu.upload(&scales).map_err(de)?;
        self.fp8_experts(spec, experts.len(), n, k, codes, scales)
    }

    /// `quantize_weights` for FP8 block: the `groups` weights of `master` quantized on the
    /// device as one `[groups·n, k]` stack (no 128-row tile crosses two weights when
    /// `n % 128 == 0`; other shapes are refused, naming the weight, as the CPU refuses them).
    pub(super) fn fp8_quantize_weights(
        &self,
        master: &CudaSlice<f32>,
        groups: usize,
        n: usize,
        k: usize,
        spec: LinearSpec,
        name: &(dyn Fn(usize) -> String + Sync),
    ) -> DResult<QExperts> {
        let ops = self.fp8_ops(&name(0))?;
        let len = groups * n * k;
        if master.len() < len {
            return Err(self.fp8_err(format!(
                "quantize_weights {}: master of {} values for [{groups}·{n}, {k}]",
                name(0),
                master.len()
            )));
        }
        let q = ops
            .quantize_weights(&name(0), &master.slice(0..len), groups, n, k)
            .map_err(de)?;
        self.fp8_experts(spec, groups, n, k, q.codes, q.scales)
    }

    /// The FP8-block linears' checks: `w` stored as FP8 block `[experts, n, k]`, `x` holding
    /// `x_rows` rows of `k` and `y` `rows` rows of `n` elements.
    #[allow(clippy::too_many_arguments)]
    fn fp8_check(
        &self,
        op: &str,
        w: &QExperts,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        x_len: usize,
        y_len: usize,
        x_rows: usize,
    ) -> DResult<()> {
        if (w.format, w.e, w.n, w.k) != (Format::Fp8Block, experts, n, k) {
            return Err(self.fp8_err(format!(
                "{op}: {:?} weights stored as [{}, {}, {}], called as FP8 block [{experts}, \
                 {n}, {k}]",
                w.format, w.e, w.n, w.k
            )));
        }
        if x_len < x_rows * k || y_len < rows * n {
            return Err(self.fp8_err(format!(
                "{op}: x of {x_len} and y of {y_len} elements for {x_rows} input and {rows} \
                 output rows [{n}, {k}]"
            )));
        }
        Ok(())
    }

    /// `grouped_qlinear` / `qlinear` for FP8 block: the activations quantized 1×128 on the
    /// device, then the FP8-block GEMM (`offsets = None`: one dense weight over all rows) the
    /// module doc names: the staged kernels where they take the step, else the fragment
    /// kernels for routed experts with up to [`FRAG_ROWS_PER_EXPERT`] rows per expert on
    /// average where the device runs them (sm_89+), the tiled kernels otherwise. All follow
    /// the same contract arithmetic and bound.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fp8_forward(
        &self,
        x: &CudaSlice<f32>,
        w: &QExperts,
        offsets: Option<&CudaSlice<u32>>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> DResult<()> {
        let op = if offsets.is_some() {
            "grouped_qlinear"
        } else {
            "qlinear"
        };
        self.fp8_check(op, w, experts, rows, k, n, x.len(), y.len(), rows)?;
        let ops = self.fp8_ops(op)?;
        if rows == 0 {
            return Ok(());
        }
        if let Some(q) = self.fp8_staged(rows, experts, n, k, offsets.is_some()) {
            let (xh, xs) = self.fp8_act_f16(q, x, rows, k)?;
            return match offsets {
                Some(o) => {
                    let s = Grouped {
                        experts,
                        rows,
                        n,
                        k,
                    };
                    self.fp8_staged_gemm(q, &xh, &xs, w, o, y, s)
                }
                // A dense weight: one group of every row, on the dense kernels' stages.
                None => self.fp8_staged_dense(q, &xh, &xs, &mut [(w, n, y)], rows, k),
            };
        }
        let qx = ops
            .quantize_act(&x.slice(0..rows * k), rows, k)
            .map_err(de)?;
        let s = Grouped {
            experts,
            rows,
            n,
            k,
        };
        let off = offsets.map(|o| o.as_view());
        let (xc, xs) = (qx.codes.as_view(), qx.scales.as_view());
        let (wc, ws) = (w.codes.as_view(), w.scales.as_view());
        match &off {
            // Decode: the fragment kernels stream the used experts' codes into the mma operands.
            Some(o) if ops.frag_supported() && rows <= FRAG_ROWS_PER_EXPERT * experts => ops
                .gemm_nt_frag(&xc, &xs, &wc, &ws, o, &mut y.as_view_mut(), s)
                .map_err(de),
            _ => ops
                .gemm_nt(&xc, &xs, &wc, &ws, off.as_ref(), &mut y.as_view_mut(), s)
                .map_err(de),
        }
    }

    /// The low-byte kernels when the staged FP8-block kernels take a step of `rows` rows over
    /// `experts` weights `[n, k]` (`routed`, or one dense weight): from
    /// [`STAGED_ROWS_PER_EXPERT`] rows per weight on average — up to [`QFRAG_ROWS_PER_EXPERT`]
    /// for routed experts, any number for a dense weight (its passes spread over the grid) —
    /// with `n` and `k` multiples of 128 and the stages within shared memory; `None`
    /// otherwise (the fragment or tiled kernels). Measured on an H200 (`bench_fp8block
    /// --staged --busy`, BENCHMARKS.md): 0.60–0.81× the fragment kernels' time and 0.36–0.55×
    /// the tiled kernels' from 16 to 512 rows per expert.
    fn fp8_staged(
        &self,
        rows: usize,
        experts: usize,
        n: usize,
        k: usize,
        routed: bool,
    ) -> Option<&QGemm> {
        let s = Grouped {
            experts,
            rows,
            n,
            k,
        };
        let avg = rows.div_ceil(experts.max(1));
        let most = if routed {
            QFRAG_ROWS_PER_EXPERT
        } else {
            usize::MAX
        };
        let stages = if routed {
            FP8_ROUTED_STAGES_PICK
        } else {
            FP8_DENSE_STAGES_PICK
        };
        let fits = (STAGED_ROWS_PER_EXPERT..=most).contains(&avg)
            && n.is_multiple_of(FP8_BLOCK)
            && k.is_multiple_of(FP8_BLOCK)
            && fp8_staged_smem_bytes(k, frag_rows(s, None), stages) <= STAGED_SMEM_MAX;
        fits.then(|| self.qgemm.as_ref().ok()).flatten()
    }

    /// `x [rows, k]` quantized 1×128 as the staged kernels' operand: binary16 code values and
    /// f32 `scale_inv [rows, k/128]` (the bytes of [`Scheme::FP8_BLOCK_ACT`]).
    fn fp8_act_f16(
        &self,
        q: &QGemm,
        x: &CudaSlice<f32>,
        rows: usize,
        k: usize,
    ) -> DResult<(CudaSlice<u16>, CudaSlice<f32>)> {
        let Scheme::Fp8Block(act) = Scheme::FP8_BLOCK_ACT else {
            return Err(self.fp8_err("FP8_BLOCK_ACT is not an FP8-block scheme".into()));
        };
        let pow2 = act.scale_rule == ScaleRule::F32PowerOfTwo;
        let mut xh = self.gpu.empty::<u16>(rows * k).map_err(de)?;
        let mut xs = self
            .gpu
            .empty::<f32>((rows * k / FP8_BLOCK).max(1))
            .map_err(de)?;
        q.quant_act_fp8_block(
            &x.slice(0..rows * k),
            rows,
            k,
            pow2,
            &mut xh.as_view_mut(),
            &mut xs.slice_mut(0..rows * k / FP8_BLOCK),
        )
        .map_err(de)?;
        Ok((xh, xs))
    }

    /// `y = x · Wᵀ` of the stored FP8-block weights `w` (`experts` of them, rows grouped by
    /// `offsets`) on the staged kernels, from `x`'s operand `xh` and scale rows `xs` as
    /// [`CudaBackend::fp8_act_f16`] writes them.
    #[allow(clippy::too_many_arguments)]
    fn fp8_staged_gemm(
        &self,
        q: &QGemm,
        xh: &CudaSlice<u16>,
        xs: &CudaSlice<f32>,
        w: &QExperts,
        offsets: &CudaSlice<u32>,
        y: &mut CudaSlice<f32>,
        s: Grouped,
    ) -> DResult<()> {
        q.grouped_nt_staged_fp8_block(
            &xh.as_view(),
            &xs.slice(0..s.rows * s.k / FP8_BLOCK),
            &w.codes.as_view(),
            &w.scales.as_view(),
            &offsets.as_view(),
            &mut y.as_view_mut(),
            s,
        )
        .map_err(de)
    }

    /// `y = x · Wᵀ` of dense FP8-block weights on one input `x` (operand `xh`, scale rows
    /// `xs`), up to three weights per launch of the dense staged kernels (q, k and v in one):
    /// each output's blocks are the ones its own launch would run, so the bits are the same.
    #[allow(clippy::type_complexity)]
    fn fp8_staged_dense(
        &self,
        q: &QGemm,
        xh: &CudaSlice<u16>,
        xs: &CudaSlice<f32>,
        outs: &mut [(&QExperts, usize, &mut CudaSlice<f32>)],
        rows: usize,
        k: usize,
    ) -> DResult<()> {
        for group in outs.chunks_mut(3) {
            let mut views: Vec<_> = group
                .iter_mut()
                .map(|(w, n, y)| (w.codes.as_view(), w.scales.as_view(), y.as_view_mut(), *n))
                .collect();
            q.dense_nt_staged_fp8_block_multi(
                &xh.as_view(),
                &xs.slice(0..rows * k / FP8_BLOCK),
                &self.whole_rows.as_view(),
                &mut views,
                rows,
                k,
            )
            .map_err(de)?;
        }
        Ok(())
    }

    /// `grouped_qlinear_gathered` for FP8-block experts: on the staged kernels (where they
    /// take the step) the tokens' rows quantized once and their operands and scale rows
    /// gathered — each row's blocks are its own, so these are the gathered rows' operands;
    /// else the f32 rows gathered, then [`CudaBackend::fp8_forward`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fp8_forward_gathered(
        &self,
        x: &CudaSlice<f32>,
        route: &RouteBufs<Self>,
        tokens: usize,
        top_k: usize,
        w: &QExperts,
        experts: usize,
        k: usize,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> DResult<()> {
        let rows = tokens * top_k;
        let Some(q) = self.fp8_staged(rows, experts, n, k, true) else {
            let xg = self.gather_token_rows_f32(x, route, tokens, top_k, experts, k)?;
            return self.fp8_forward(&xg, w, Some(&route.offsets), experts, rows, k, n, y);
        };
        self.fp8_check(
            "grouped_qlinear",
            w,
            experts,
            rows,
            k,
            n,
            x.len(),
            y.len(),
            tokens,
        )?;
        let (xh, xs) = self.fp8_act_f16(q, x, tokens, k)?;
        let kb = k / FP8_BLOCK;
        let xg = self.gather_token_rows_u16(&xh, route, tokens, top_k, experts, k)?;
        let sg = self.gather_token_rows_f32(&xs, route, tokens, top_k, experts, kb)?;
        let s = Grouped {
            experts,
            rows,
            n,
            k,
        };
        self.fp8_staged_gemm(q, &xg, &sg, w, &route.offsets, y, s)
    }

    /// `qlinear_shared` for dense FP8-block weights: `x` quantized 1×128 once, then each
    /// weight's GEMM on those operands (what `fp8_forward` does per weight).
    #[allow(clippy::type_complexity)]
    pub(super) fn fp8_forward_shared(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        k: usize,
        outs: &mut [(&QExperts, usize, &mut CudaSlice<f32>)],
    ) -> DResult<()> {
        let ops = self.fp8_ops("qlinear")?;
        for (w, n, y) in outs.iter() {
            self.fp8_check("qlinear", w, 1, rows, k, *n, x.len(), y.len(), rows)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let staged = outs
            .iter()
            .map(|(_, n, _)| self.fp8_staged(rows, 1, *n, k, false))
            .collect::<Option<Vec<_>>>();
        if let Some(q) = staged.and_then(|v| v.first().copied()) {
            let (xh, xs) = self.fp8_act_f16(q, x, rows, k)?;
            return self.fp8_staged_dense(q, &xh, &xs, outs, rows, k);
        }
        let qx = ops
            .quantize_act(&x.slice(0..rows * k), rows, k)
            .map_err(de)?;
        let (xc, xs) = (qx.codes.as_view(), qx.scales.as_view());
        for (w, n, y) in outs.iter_mut() {
            let s = Grouped {
                experts: 1,
                rows,
                n: *n,
                k,
            };
            let (wc, ws) = (w.codes.as_view(), w.scales.as_view());
            ops.gemm_nt(&xc, &xs, &wc, &ws, None, &mut y.as_view_mut(), s)
                .map_err(de)?;
        }
        Ok(())
    }

    /// `stored_weights` for FP8 block: per weight its codes and f32 `scale_inv` tiles.
    pub(super) fn fp8_stored_weights(&self, w: &QExperts) -> DResult<Vec<QuantizedTensor>> {
        let codes = self.gpu.download(&w.codes).map_err(de)?;
        let scales = f32_from_le_bytes(&self.gpu.download(&w.scales).map_err(de)?);
        let (cg, sg) = (w.n * w.k, (w.n / FP8_BLOCK) * (w.k / FP8_BLOCK));
        if codes.len() != w.e * cg || scales.len() != w.e * sg {
            return Err(self.fp8_err(format!(
                "stored_weights: {} codes and {} scales for {} FP8-block weights [{}, {}]",
                codes.len(),
                scales.len(),
                w.e,
                w.n,
                w.k
            )));
        }
        (0..w.e)
            .map(|g| {
                let q = QuantizedTensor {
                    scheme: Scheme::FP8_BLOCK_WEIGHT,
                    shape: vec![w.n, w.k],
                    padded_shape: vec![w.n, w.k],
                    data: codes[g * cg..(g + 1) * cg].to_vec(),
                    scales: Scales::F32(scales[g * sg..(g + 1) * sg].to_vec()),
                    scale_layout: ScaleLayout::Compact,
                    amax: Vec::new(),
                };
                q.validate()
                    .map_err(|e| self.fp8_err(format!("stored weight {g}: {e}")))?;
                Ok(q)
            })
            .collect()
    }
}
