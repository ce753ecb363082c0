//! The serving containers: how one quantized linear weight `P.weight` of logical shape `[N, K]`
//! is stored as safetensors tensors, with one encoder, one decoder and one detector per layout.
//! Everything in mxrl that writes or reads these layouts goes through this module: `convert`
//! (encode), [`crate::load_quantized`] (decode to a [`QuantizedTensor`]), `dequantize` (detect,
//! decode, then the consumer's formula from `mxrl-formats`), the plan audit and inventory
//! ([`crate::Checkpoint::stored_tensors`]) and `mxrl inspect` (detect).
//!
//! | [`Layout`] | tensors `P.<suffix>` ([`Part`] order) |
//! |---|---|
//! | [`Layout::Mxfp8`] (SGLang) | `weight` F8_E4M3 `[N,K]`, `weight_scale_inv` U8 (UE8M0) `[N,K/32]` |
//! | [`Layout::Nvfp4ModelOpt`] | `weight` U8 `[N,K/2]`, `weight_scale` F8_E4M3 `[N,K/16]`, `weight_scale_2` F32 `[]` = S_dec = 1/S, `input_scale` F32 `[]` |
//! | [`Layout::Nvfp4CompressedTensors`] | `weight_packed` U8 `[N,K/2]`, `weight_scale` F8_E4M3 `[N,K/16]`, `weight_global_scale` F32 `[1]` = S, `input_global_scale` F32 `[1]` |
//! | [`Layout::Fp8Block`] (DeepSeek-V3) | `weight` F8_E4M3 `[N,K]`, `weight_scale_inv` F32 `[ceil(N/128), ceil(K/128)]` |
//!
//! S is the contract's NVFP4 encode scale `fl(2688/amax)`; the containers store S or 1/S, not
//! the amax (see [`mxrl_formats::Nvfp4SecondLevel`] for each consumer's formula). mxrl writes
//! static input scales of 1 (its activations are scaled per token online).
//!
//! Decoding accepts what serving checkpoints vary in and nothing else: the second-level and
//! input scales as F32 of one element (`[]` or `[1]`), an absent static input scale, and
//! compressed-tensors' `weight_shape` companion (ignored). Every other deviation — a missing
//! part, a wrong dtype or shape, a tensor that belongs to no layout — is an error naming the
//! file and the tensor.

use crate::dtype::Dtype;
use crate::error::{CkptError, Result};
use crate::reader::TensorView;
use crate::values::{f32_bytes, f32_from_bytes};
use crate::writer::TensorSpec;
use mxrl_formats::{
    dequantize_nvfp4, Format, Fp8Blocks, Nvfp4SecondLevel, QuantizedTensor, ScaleLayout, Scales,
    Scheme, FP8_BLOCK,
};
use std::collections::BTreeMap;

/// How NVFP4 weights are laid out on disk (the choice `convert --format` makes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Nvfp4Container {
    /// NVIDIA ModelOpt (`quant_method: modelopt`, `hf_quant_config.json`), read by SGLang/vLLM.
    #[default]
    ModelOpt,
    /// compressed-tensors `nvfp4-pack-quantized`, read by vLLM and the compressed-tensors library.
    CompressedTensors,
}

impl Nvfp4Container {
    /// CLI / record name.
    pub fn name(self) -> &'static str {
        match self {
            Nvfp4Container::ModelOpt => "modelopt",
            Nvfp4Container::CompressedTensors => "compressed-tensors",
        }
    }

    /// Parses `modelopt` / `compressed-tensors`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "modelopt" => Some(Nvfp4Container::ModelOpt),
            "compressed-tensors" => Some(Nvfp4Container::CompressedTensors),
            _ => None,
        }
    }
}

/// One serving layout of a quantized linear weight (see the module docs for its tensors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Layout {
    /// SGLang MXFP8: E4M3 weight and UE8M0 `weight_scale_inv` per 1×32 block.
    Mxfp8,
    /// NVIDIA ModelOpt NVFP4: packed E2M1 `weight`, E4M3 `weight_scale`, `weight_scale_2` = 1/S.
    Nvfp4ModelOpt,
    /// compressed-tensors NVFP4: `weight_packed`, E4M3 `weight_scale`, `weight_global_scale` = S.
    Nvfp4CompressedTensors,
    /// DeepSeek-V3 FP8-block: E4M3 weight and F32 `weight_scale_inv` per 128×128 tile.
    Fp8Block,
}

/// The role of one stored tensor of a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The elements (E4M3, or packed E2M1).
    Data,
    /// The block scales (UE8M0, E4M3 or F32 `scale_inv`).
    Scale,
    /// NVFP4's FP32 second-level scale (1/S or S).
    Global,
    /// NVFP4's static FP32 input scale (optional when decoding).
    Input,
}

impl Part {
    /// Short role name (`inspect` labels).
    pub fn role(self) -> &'static str {
        match self {
            Part::Data => "data",
            Part::Scale => "block scale",
            Part::Global => "second-level scale",
            Part::Input => "input scale",
        }
    }
}

/// One tensor of a layout: its role, name suffix, dtype, and what it is (in messages).
struct PartSpec {
    part: Part,
    suffix: &'static str,
    dtype: Dtype,
    what: &'static str,
}

const fn spec(part: Part, suffix: &'static str, dtype: Dtype, what: &'static str) -> PartSpec {
    PartSpec {
        part,
        suffix,
        dtype,
        what,
    }
}

const MXFP8_PARTS: [PartSpec; 2] = [
    spec(Part::Data, "weight", Dtype::F8E4m3, "MXFP8 weight"),
    spec(
        Part::Scale,
        "weight_scale_inv",
        Dtype::U8,
        "MXFP8 UE8M0 scale",
    ),
];
const MODELOPT_PARTS: [PartSpec; 4] = [
    spec(Part::Data, "weight", Dtype::U8, "packed NVFP4 weight"),
    spec(
        Part::Scale,
        "weight_scale",
        Dtype::F8E4m3,
        "NVFP4 block scale",
    ),
    spec(
        Part::Global,
        "weight_scale_2",
        Dtype::F32,
        "ModelOpt weight_scale_2 (= 1/S)",
    ),
    spec(
        Part::Input,
        "input_scale",
        Dtype::F32,
        "ModelOpt input_scale",
    ),
];
const CT_PARTS: [PartSpec; 4] = [
    spec(
        Part::Data,
        "weight_packed",
        Dtype::U8,
        "packed NVFP4 weight",
    ),
    spec(
        Part::Scale,
        "weight_scale",
        Dtype::F8E4m3,
        "NVFP4 block scale",
    ),
    spec(
        Part::Global,
        "weight_global_scale",
        Dtype::F32,
        "compressed-tensors weight_global_scale (= S)",
    ),
    spec(
        Part::Input,
        "input_global_scale",
        Dtype::F32,
        "compressed-tensors input_global_scale",
    ),
];
const FP8_BLOCK_PARTS: [PartSpec; 2] = [
    spec(Part::Data, "weight", Dtype::F8E4m3, "FP8-block weight"),
    spec(
        Part::Scale,
        "weight_scale_inv",
        Dtype::F32,
        "FP8-block scale_inv",
    ),
];

/// compressed-tensors' optional `weight_shape` companion (accepted and ignored).
const CT_WEIGHT_SHAPE: &str = "weight_shape";

/// Every name suffix that belongs to a weight group: `weight` and its companions.
pub const GROUP_SUFFIXES: [&str; 9] = [
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_scale_inv",
    "weight_scale_2",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    CT_WEIGHT_SHAPE,
];

/// Splits a stored name into the weight prefix `P` and its suffix when the suffix is `weight`
/// or one of its companions ([`GROUP_SUFFIXES`]); `None` for any other tensor (biases, norms
/// are `weight`s too and form single-member groups).
pub fn split_name(name: &str) -> Option<(&str, &str)> {
    let (p, last) = name.rsplit_once('.')?;
    GROUP_SUFFIXES.contains(&last).then_some((p, last))
}

/// The weight prefix `P` of a logical weight name `P.weight`, or an error naming it.
fn prefix_of(weight: &str) -> Result<&str> {
    weight.strip_suffix(".weight").ok_or_else(|| {
        CkptError::tensor(
            weight,
            "only `*.weight` tensors have a quantized serving layout",
        )
    })
}

fn view_err(t: &TensorView<'_>, msg: String) -> CkptError {
    CkptError::TensorEntry {
        file: t.file.into(),
        tensor: t.name.into(),
        msg,
    }
}

impl Layout {
    /// Every layout, in a stable order.
    pub const ALL: [Layout; 4] = [
        Layout::Mxfp8,
        Layout::Nvfp4ModelOpt,
        Layout::Nvfp4CompressedTensors,
        Layout::Fp8Block,
    ];

    /// Display name (`mxfp8`, `nvfp4 (modelopt)`, `nvfp4 (compressed-tensors)`, `fp8_block`).
    pub fn name(self) -> &'static str {
        match self {
            Layout::Mxfp8 => "mxfp8",
            Layout::Nvfp4ModelOpt => "nvfp4 (modelopt)",
            Layout::Nvfp4CompressedTensors => "nvfp4 (compressed-tensors)",
            Layout::Fp8Block => "fp8_block",
        }
    }

    /// Who reads it (`inspect` labels).
    pub fn consumer(self) -> &'static str {
        match self {
            Layout::Mxfp8 => "SGLang",
            Layout::Nvfp4ModelOpt => "ModelOpt",
            Layout::Nvfp4CompressedTensors => "compressed-tensors",
            Layout::Fp8Block => "DeepSeek-V3",
        }
    }

    /// The plan format it stores.
    pub fn format(self) -> Format {
        match self {
            Layout::Mxfp8 => Format::Mxfp8,
            Layout::Nvfp4ModelOpt | Layout::Nvfp4CompressedTensors => Format::Nvfp4,
            Layout::Fp8Block => Format::Fp8Block,
        }
    }

    /// The scheme of the decoded [`QuantizedTensor`].
    pub fn scheme(self) -> Scheme {
        match self {
            Layout::Mxfp8 => Scheme::MXFP8_ROW,
            Layout::Nvfp4ModelOpt | Layout::Nvfp4CompressedTensors => Scheme::NVFP4_TENSOR,
            Layout::Fp8Block => Scheme::FP8_BLOCK_WEIGHT,
        }
    }

    /// NVFP4: the form of the stored second-level scale.
    pub fn nvfp4_form(self) -> Option<Nvfp4SecondLevel> {
        match self {
            Layout::Nvfp4ModelOpt => Some(Nvfp4SecondLevel::DecodeScale),
            Layout::Nvfp4CompressedTensors => Some(Nvfp4SecondLevel::EncodeScale),
            Layout::Mxfp8 | Layout::Fp8Block => None,
        }
    }

    /// The layout that stores `format` (NVFP4 in `nvfp4`'s container); `None` for BF16.
    pub fn for_format(format: Format, nvfp4: Nvfp4Container) -> Option<Layout> {
        match (format, nvfp4) {
            (Format::Bf16, _) => None,
            (Format::Mxfp8, _) => Some(Layout::Mxfp8),
            (Format::Nvfp4, Nvfp4Container::ModelOpt) => Some(Layout::Nvfp4ModelOpt),
            (Format::Nvfp4, Nvfp4Container::CompressedTensors) => {
                Some(Layout::Nvfp4CompressedTensors)
            }
            (Format::Fp8Block, _) => Some(Layout::Fp8Block),
        }
    }

    fn parts(self) -> &'static [PartSpec] {
        match self {
            Layout::Mxfp8 => &MXFP8_PARTS,
            Layout::Nvfp4ModelOpt => &MODELOPT_PARTS,
            Layout::Nvfp4CompressedTensors => &CT_PARTS,
            Layout::Fp8Block => &FP8_BLOCK_PARTS,
        }
    }

    /// The roles of its tensors, in the order [`Layout::specs`] and [`Layout::encode`] write
    /// them.
    pub fn part_list(self) -> Vec<Part> {
        self.parts().iter().map(|p| p.part).collect()
    }

    fn part_spec(self, part: Part) -> Option<&'static PartSpec> {
        self.parts().iter().find(|p| p.part == part)
    }

    /// The name suffix of `part` (`None` if the layout has no such part).
    pub fn suffix(self, part: Part) -> Option<&'static str> {
        self.part_spec(part).map(|p| p.suffix)
    }

    /// The stored name of `part` of the logical weight `weight` (`P.weight` → `P.<suffix>`).
    ///
    /// # Errors
    /// A name without `.weight`, or a part the layout does not have.
    pub fn tensor_name(self, weight: &str, part: Part) -> Result<String> {
        let p = prefix_of(weight)?;
        let s = self.suffix(part).ok_or_else(|| {
            CkptError::tensor(weight, format!("{} has no {}", self.name(), part.role()))
        })?;
        Ok(format!("{p}.{s}"))
    }

    /// What `part` is, as messages name it.
    pub fn what(self, part: Part) -> &'static str {
        self.part_spec(part).map_or("tensor", |p| p.what)
    }

    /// The role of the tensor with name suffix `suffix`, if it belongs to this layout.
    pub fn part_of_suffix(self, suffix: &str) -> Option<Part> {
        self.parts()
            .iter()
            .find(|p| p.suffix == suffix)
            .map(|p| p.part)
    }

    fn k_block(self) -> usize {
        self.format()
            .k_block()
            .expect("quantized layouts have a K block")
    }

    /// The stored shape of `part` for a logical `[n, k]` weight.
    fn shape(self, part: Part, [n, k]: [usize; 2]) -> Vec<usize> {
        match (self, part) {
            (Layout::Mxfp8 | Layout::Fp8Block, Part::Data) => vec![n, k],
            (Layout::Nvfp4ModelOpt | Layout::Nvfp4CompressedTensors, Part::Data) => vec![n, k / 2],
            (Layout::Mxfp8, Part::Scale) => vec![n, k / 32],
            (Layout::Nvfp4ModelOpt | Layout::Nvfp4CompressedTensors, Part::Scale) => {
                vec![n, k / 16]
            }
            (Layout::Fp8Block, Part::Scale) => vec![n.div_ceil(FP8_BLOCK), k.div_ceil(FP8_BLOCK)],
            (Layout::Nvfp4CompressedTensors, Part::Global | Part::Input) => vec![1],
            (_, Part::Global | Part::Input) => vec![],
        }
    }

    /// Whether a logical `[n, k]` weight fits the layout's blocks along K (FP8-block pads).
    fn check_k(self, weight: &str, [n, k]: [usize; 2]) -> Result<()> {
        let b = self.k_block();
        if self != Layout::Fp8Block && !k.is_multiple_of(b) {
            return Err(CkptError::tensor(
                weight,
                format!(
                    "{} needs K % {b} == 0, but the shape is {:?}",
                    self.format(),
                    [n, k]
                ),
            ));
        }
        Ok(())
    }

    /// The tensors written for the logical weight `weight` (`P.weight`) of shape `[n, k]`, in
    /// [`Layout::part_list`] order.
    ///
    /// # Errors
    /// A name without `.weight`, or K that the layout's blocks cannot take.
    pub fn specs(self, weight: &str, shape: [usize; 2]) -> Result<Vec<TensorSpec>> {
        let p = prefix_of(weight)?;
        self.check_k(weight, shape)?;
        Ok(self
            .parts()
            .iter()
            .map(|s| {
                TensorSpec::new(
                    format!("{p}.{}", s.suffix),
                    s.dtype,
                    self.shape(s.part, shape),
                )
            })
            .collect())
    }

    /// Encodes `q` as the tensors of the logical weight `weight` (names, dtypes, shapes and
    /// bytes), in [`Layout::specs`] order: [`Stored::from_quantized`], then [`Stored::encode`].
    pub fn encode(self, weight: &str, q: &QuantizedTensor) -> Result<Vec<(TensorSpec, Vec<u8>)>> {
        Stored::from_quantized(self, weight, q)?.encode(weight)
    }

    /// Checks the stored tensors of `weight` that `get` returns per role (presence, dtype,
    /// shape) and returns them with the logical `[N, K]`. `get` returns `Ok(None)` for a
    /// tensor that is not there (an error only for required parts).
    fn check<'a>(
        self,
        weight: &str,
        get: &dyn Fn(Part) -> Result<Option<TensorView<'a>>>,
    ) -> Result<(Vec<Option<TensorView<'a>>>, [usize; 2])> {
        let prefix = weight.strip_suffix(".weight").unwrap_or(weight);
        let mut views = Vec::with_capacity(self.parts().len());
        for s in self.parts() {
            let v = get(s.part)?;
            if v.is_none() && s.part != Part::Input {
                let data_file = views
                    .first()
                    .and_then(|d: &Option<TensorView<'_>>| d.as_ref())
                    .map(|d| format!(" (its data `{}` is in {})", d.name, d.file))
                    .unwrap_or_default();
                return Err(CkptError::tensor(
                    format!("{prefix}.{}", s.suffix),
                    format!(
                        "is missing: `{weight}` stored as {} needs its {}{data_file}",
                        self.name(),
                        s.what
                    ),
                ));
            }
            views.push(v);
        }
        let d = views[0].as_ref().expect("the data part is required");
        let spec0 = &self.parts()[0];
        let (&[rows, cols], true) = (d.shape, d.dtype == spec0.dtype) else {
            return Err(view_err(
                d,
                format!(
                    "{} must be a 2-D {} tensor, found {} {:?}",
                    spec0.what, spec0.dtype, d.dtype, d.shape
                ),
            ));
        };
        let nk = match self.format() {
            Format::Nvfp4 => [rows, 2 * cols],
            _ => [rows, cols],
        };
        self.check_k(d.name, nk).map_err(|_| {
            view_err(
                d,
                format!(
                    "{} needs K % {} == 0, found stored shape {:?}",
                    self.format(),
                    self.k_block(),
                    d.shape
                ),
            )
        })?;
        for (s, v) in self.parts().iter().zip(&views) {
            let Some(v) = v else { continue };
            let want = self.shape(s.part, nk);
            let ok_shape = match s.part {
                // One F32 value, as `[]` or `[1]`.
                Part::Global | Part::Input => v.shape.len() <= 1 && v.numel() == 1,
                Part::Data | Part::Scale => v.shape == want.as_slice(),
            };
            if v.dtype != s.dtype || !ok_shape {
                return Err(view_err(
                    v,
                    format!(
                        "{} must be {} {want:?}, found {} {:?}",
                        s.what, s.dtype, v.dtype, v.shape
                    ),
                ));
            }
        }
        Ok((views, nk))
    }

    /// Checks the stored tensors of `weight` that `get` returns per role — presence, dtype and
    /// shape, without reading data — and returns the logical `[N, K]`.
    ///
    /// # Errors
    /// As [`Layout::decode`].
    pub fn validate<'a>(
        self,
        weight: &str,
        get: &dyn Fn(Part) -> Result<Option<TensorView<'a>>>,
    ) -> Result<[usize; 2]> {
        Ok(self.check(weight, get)?.1)
    }

    /// Decodes the stored tensors of the logical weight `weight` that `get` returns per role.
    ///
    /// # Errors
    /// A missing required tensor, a wrong dtype or shape, K that the blocks cannot take —
    /// naming the file and the tensor.
    pub fn decode<'a>(
        self,
        weight: &str,
        get: &dyn Fn(Part) -> Result<Option<TensorView<'a>>>,
    ) -> Result<Stored> {
        let (views, shape) = self.check(weight, get)?;
        let view = |p: Part| {
            let i = self.parts().iter().position(|s| s.part == p)?;
            views[i].as_ref()
        };
        let d = view(Part::Data).expect("checked");
        let s = view(Part::Scale).expect("checked");
        let scalar = |p: Part| view(p).map(|t| f32_from_bytes(t.data)[0]);
        Ok(Stored {
            layout: self,
            shape,
            data: d.data.to_vec(),
            scales: match self {
                Layout::Fp8Block => Scales::F32(f32_from_bytes(s.data)),
                _ => Scales::Bytes(s.data.to_vec()),
            },
            global: scalar(Part::Global),
            input: scalar(Part::Input),
        })
    }

    /// [`Layout::decode`] into the [`QuantizedTensor`] the contract quantizer gives
    /// (validated). NVFP4 needs the tensor's `amax` (the containers store S or 1/S, not the
    /// amax): the stored second-level scale must be the one `amax` gives, bit for bit.
    ///
    /// # Errors
    /// Those of [`Layout::decode`]; an NVFP4 weight without `amax`, or whose stored
    /// second-level scale disagrees with it (naming that tensor and file).
    pub fn decode_quantized<'a>(
        self,
        weight: &str,
        get: &dyn Fn(Part) -> Result<Option<TensorView<'a>>>,
        amax: Option<f32>,
    ) -> Result<QuantizedTensor> {
        let stored = self.decode(weight, get)?;
        if let (Some(form), Some(amax)) = (self.nvfp4_form(), amax) {
            let got = stored.global.expect("NVFP4 has a second-level scale");
            let want = form.stored_value(amax);
            if got.to_bits() != want.to_bits() {
                let g = get(Part::Global)?.expect("checked by decode");
                return Err(view_err(
                    &g,
                    format!(
                        "{} is {got:e} (0x{:08X}), but the amax recorded for `{weight}` ({amax:e}, 0x{:08X}) gives {want:e} (0x{:08X})",
                        self.what(Part::Global),
                        got.to_bits(),
                        amax.to_bits(),
                        want.to_bits()
                    ),
                ));
            }
        }
        stored.to_quantized(amax).map_err(|e| {
            CkptError::tensor(
                weight,
                format!("stored tensors do not form a valid {}: {e}", self.scheme()),
            )
        })
    }
}

/// One linear weight as a serving layout stores it: the bytes of every part, decoded from
/// (or to be encoded as) its tensors. Unlike a [`QuantizedTensor`] it carries NVFP4's
/// second-level scale in the container's own form (S or 1/S), so a checkpoint written by
/// another tool decodes and dequantizes without knowing the amax.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    /// The layout.
    pub layout: Layout,
    /// Logical `[N, K]`.
    pub shape: [usize; 2],
    /// Element bytes as stored: E4M3 `[N, K]` (FP8-block unpadded), or packed E2M1
    /// `[N, K/2]`.
    pub data: Vec<u8>,
    /// Compact block scales: UE8M0 / E4M3 bytes, or FP8-block's F32 `scale_inv`.
    pub scales: Scales,
    /// NVFP4: the second-level scale as stored (ModelOpt 1/S, compressed-tensors S).
    pub global: Option<f32>,
    /// NVFP4: the static input scale as stored (`None`: absent).
    pub input: Option<f32>,
}

impl Stored {
    /// The container form of `q` (named `weight` in errors): a 2-D tensor of the layout's
    /// scheme, compact scales (swizzled ones are un-swizzled), NVFP4 with one per-tensor amax
    /// (stored as the layout's second-level scale, with a static input scale of 1), FP8-block
    /// padding dropped.
    ///
    /// # Errors
    /// Another scheme, another rank, padding (MXFP8 / NVFP4), an invalid tensor.
    pub fn from_quantized(layout: Layout, weight: &str, q: &QuantizedTensor) -> Result<Stored> {
        let bad = |msg: String| CkptError::tensor(weight, msg);
        let same_scheme = match (layout.scheme(), q.scheme) {
            (Scheme::Fp8Block(a), Scheme::Fp8Block(b)) => {
                a.blocks == b.blocks && b.blocks == Fp8Blocks::Weight128x128
            }
            (a, b) => a == b,
        };
        if !same_scheme {
            return Err(bad(format!(
                "a {} tensor cannot be stored as {} (which holds {})",
                q.scheme,
                layout.name(),
                layout.scheme()
            )));
        }
        let q = q
            .clone()
            .with_scale_layout(ScaleLayout::Compact)
            .map_err(|e| bad(e.to_string()))?;
        let (&[n, k], &[np, kp]) = (q.shape.as_slice(), q.padded_shape.as_slice()) else {
            return Err(bad(format!(
                "{} stores 2-D [N, K] weights, found shape {:?}",
                layout.name(),
                q.shape
            )));
        };
        if layout != Layout::Fp8Block && (np, kp) != (n, k) {
            return Err(bad(format!(
                "{} stores unpadded weights, found shape {:?} padded to {:?}",
                layout.name(),
                q.shape,
                q.padded_shape
            )));
        }
        let data = if (np, kp) == (n, k) {
            q.data
        } else {
            let mut d = Vec::with_capacity(n * k);
            for i in 0..n {
                d.extend_from_slice(&q.data[i * kp..i * kp + k]);
            }
            d
        };
        let (global, input) = match layout.nvfp4_form() {
            Some(form) => {
                let &[amax] = q.amax.as_slice() else {
                    return Err(bad(format!(
                        "{} stores one per-tensor amax, found {} values",
                        layout.name(),
                        q.amax.len()
                    )));
                };
                (Some(form.stored_value(amax)), Some(1.0))
            }
            None => (None, None),
        };
        Ok(Stored {
            layout,
            shape: [n, k],
            data,
            scales: q.scales,
            global,
            input,
        })
    }

    /// The tensors of the logical weight `weight` (`P.weight`): names, dtypes, shapes and
    /// bytes, in [`Layout::specs`] order (an absent input scale is not written).
    ///
    /// # Errors
    /// A name without `.weight`, a shape the layout cannot take, buffers of the wrong length.
    pub fn encode(&self, weight: &str) -> Result<Vec<(TensorSpec, Vec<u8>)>> {
        let specs = self.layout.specs(weight, self.shape)?;
        let mut out = Vec::with_capacity(specs.len());
        for (s, spec) in self.layout.parts().iter().zip(specs) {
            let bytes = match s.part {
                Part::Data => self.data.clone(),
                Part::Scale => match &self.scales {
                    Scales::Bytes(b) => b.clone(),
                    Scales::F32(v) => f32_bytes(v),
                },
                Part::Global => match self.global {
                    Some(g) => g.to_le_bytes().to_vec(),
                    None => {
                        return Err(CkptError::tensor(
                            spec.name,
                            "has no value: the NVFP4 second-level scale is missing",
                        ))
                    }
                },
                Part::Input => match self.input {
                    Some(v) => v.to_le_bytes().to_vec(),
                    None => continue,
                },
            };
            if bytes.len() != spec.nbytes() {
                return Err(CkptError::tensor(
                    spec.name.clone(),
                    format!(
                        "{} {:?} needs {} bytes, the value has {}",
                        spec.dtype,
                        spec.shape,
                        spec.nbytes(),
                        bytes.len()
                    ),
                ));
            }
            out.push((spec, bytes));
        }
        Ok(out)
    }

    /// The contract's [`QuantizedTensor`] (FP8-block re-padded to whole tiles with code 0, as
    /// the quantizer pads). NVFP4 needs its amax; the stored second-level scale is not checked
    /// here ([`Layout::decode_quantized`] does).
    pub fn to_quantized(&self, amax: Option<f32>) -> Result<QuantizedTensor, String> {
        let [n, k] = self.shape;
        let (np, kp) = match self.layout {
            Layout::Fp8Block => (
                n.div_ceil(FP8_BLOCK) * FP8_BLOCK,
                k.div_ceil(FP8_BLOCK) * FP8_BLOCK,
            ),
            _ => (n, k),
        };
        let data = if (np, kp) == (n, k) {
            self.data.clone()
        } else {
            if self.data.len() != n * k {
                return Err(format!(
                    "data has {} bytes, [{n}, {k}] needs {}",
                    self.data.len(),
                    n * k
                ));
            }
            let mut d = vec![0u8; np * kp];
            for i in 0..n {
                d[i * kp..i * kp + k].copy_from_slice(&self.data[i * k..(i + 1) * k]);
            }
            d
        };
        let amax = match (self.layout.nvfp4_form(), amax) {
            (None, _) => Vec::new(),
            (Some(_), Some(a)) => vec![a],
            (Some(_), None) => {
                return Err(format!(
                    "{} needs the tensor's amax (the container stores only S or 1/S)",
                    self.layout.name()
                ))
            }
        };
        let q = QuantizedTensor {
            scheme: self.layout.scheme(),
            shape: vec![n, k],
            padded_shape: vec![np, kp],
            data,
            scales: self.scales.clone(),
            scale_layout: ScaleLayout::Compact,
            amax,
        };
        q.validate().map_err(|e| e.to_string())?;
        Ok(q)
    }

    /// Dequantizes to f32 `[N, K]` with the formula of the layout's consumer (all in
    /// `mxrl-formats`): MXFP8 and FP8-block by the contract ([`QuantizedTensor::dequantize`]),
    /// NVFP4 by [`mxrl_formats::dequantize_nvfp4`] with the stored second-level scale in the
    /// layout's form ([`Layout::nvfp4_form`]). `weight` names it in errors.
    pub fn dequantize(&self, weight: &str) -> Result<Vec<f32>> {
        let err = |e: String| CkptError::tensor(weight, e);
        match (self.layout.nvfp4_form(), &self.scales) {
            (Some(form), Scales::Bytes(s)) => {
                let g = self
                    .global
                    .ok_or_else(|| err("the NVFP4 second-level scale is missing".into()))?;
                dequantize_nvfp4(&self.data, s, self.shape[0], self.shape[1], form, g)
                    .map_err(|e| err(e.to_string()))
            }
            (Some(_), Scales::F32(_)) => Err(err("NVFP4 block scales must be bytes".into())),
            (None, _) => self
                .to_quantized(None)
                .map_err(err)?
                .dequantize()
                .map_err(|e| err(e.to_string())),
        }
    }
}

/// What a weight group stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    /// A BF16 / F16 / F32 `weight` without companions.
    Unquantized,
    /// A quantized serving layout.
    Quantized(Layout),
}

/// A logical weight `P.weight` and the stored tensors of its group (`P.<suffix>` for every
/// suffix of [`GROUP_SUFFIXES`] present), as found in a checkpoint or file.
#[derive(Debug, Clone)]
pub struct Group<'a> {
    /// `P`.
    pub prefix: String,
    /// The stored tensors by suffix.
    pub parts: BTreeMap<String, TensorView<'a>>,
}

/// Splits tensors into weight groups (by prefix, sorted) and the other tensors (in the order
/// given).
pub fn groups<'a>(
    views: impl IntoIterator<Item = TensorView<'a>>,
) -> (Vec<Group<'a>>, Vec<TensorView<'a>>) {
    let mut g: BTreeMap<String, BTreeMap<String, TensorView<'a>>> = BTreeMap::new();
    let mut singles = Vec::new();
    for v in views {
        match split_name(v.name) {
            Some((p, s)) => {
                g.entry(p.to_string()).or_default().insert(s.to_string(), v);
            }
            None => singles.push(v),
        }
    }
    let groups = g
        .into_iter()
        .map(|(prefix, parts)| Group { prefix, parts })
        .collect();
    (groups, singles)
}

impl<'a> Group<'a> {
    /// `P.weight`.
    pub fn weight_name(&self) -> String {
        format!("{}.weight", self.prefix)
    }

    /// The main tensor: `weight`, else `weight_packed`, else the first member.
    pub fn main(&self) -> &TensorView<'a> {
        self.parts
            .get("weight")
            .or_else(|| self.parts.get("weight_packed"))
            .or_else(|| self.parts.values().next())
            .expect("a group has at least one member")
    }

    fn lookup(&self, layout: Layout) -> impl Fn(Part) -> Result<Option<TensorView<'a>>> + '_ {
        move |p| Ok(layout.suffix(p).and_then(|s| self.parts.get(s)).cloned())
    }

    /// Which layout the group is in, every member checked (dtype, shape, no tensor that the
    /// layout does not have); reads no data.
    ///
    /// # Errors
    /// A group that is no layout, or a layout with a missing, mistyped or misshapen member,
    /// naming the file and the tensor.
    pub fn detect(&self) -> Result<Detected> {
        let has = |s: &str| self.parts.contains_key(s);
        let main = self.main();
        let others = || {
            self.parts
                .values()
                .filter(|v| v.name != main.name)
                .map(|v| format!("`{}` {}", v.name, v.dtype))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let layout = if has("weight_packed") {
            if has("weight") {
                return Err(view_err(
                    main,
                    format!(
                        "found beside `{}.weight_packed`: a weight is stored either packed (compressed-tensors) or not",
                        self.prefix
                    ),
                ));
            }
            Layout::Nvfp4CompressedTensors
        } else if has("weight") {
            match main.dtype {
                Dtype::Bf16 | Dtype::F16 | Dtype::F32 => {
                    if self.parts.len() > 1 {
                        return Err(view_err(
                            main,
                            format!(
                                "a {} weight is not quantized, but the checkpoint also stores {}",
                                main.dtype,
                                others()
                            ),
                        ));
                    }
                    return Ok(Detected::Unquantized);
                }
                Dtype::F8E4m3 => match self.parts.get("weight_scale_inv") {
                    Some(s) if s.dtype == Dtype::U8 => Layout::Mxfp8,
                    Some(_) => Layout::Fp8Block,
                    None => {
                        return Err(view_err(
                            main,
                            format!(
                                "an F8_E4M3 weight needs `{}.weight_scale_inv` (U8: MXFP8, F32: FP8-block); found {}",
                                self.prefix,
                                if self.parts.len() > 1 { others() } else { "no companion".into() }
                            ),
                        ))
                    }
                },
                Dtype::U8 => Layout::Nvfp4ModelOpt,
                other => {
                    return Err(view_err(
                        main,
                        format!(
                            "a {other} weight is no serving layout (expected BF16/F16/F32, or F8_E4M3 / U8 with scales)"
                        ),
                    ))
                }
            }
        } else {
            return Err(view_err(
                main,
                format!(
                    "scale tensors without a weight: no `{0}.weight` or `{0}.weight_packed` beside {1}",
                    self.prefix,
                    self.parts
                        .keys()
                        .map(|s| format!("`{}.{s}`", self.prefix))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        for (suffix, v) in &self.parts {
            let known = layout.part_of_suffix(suffix).is_some()
                || (layout == Layout::Nvfp4CompressedTensors && suffix == CT_WEIGHT_SHAPE);
            if !known {
                return Err(view_err(
                    v,
                    format!(
                        "does not belong to the {} layout of `{}` ({})",
                        layout.name(),
                        self.weight_name(),
                        layout
                            .parts()
                            .iter()
                            .map(|p| p.suffix)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
        layout.check(&self.weight_name(), &self.lookup(layout))?;
        Ok(Detected::Quantized(layout))
    }

    /// Decodes a quantized group ([`Group::detect`], then [`Layout::decode`]); `None` for an
    /// unquantized weight.
    pub fn decode(&self) -> Result<Option<Stored>> {
        match self.detect()? {
            Detected::Unquantized => Ok(None),
            Detected::Quantized(l) => Ok(Some(l.decode(&self.weight_name(), &self.lookup(l))?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mxrl_formats::{quantize, quantize_nvfp4_with_amax, Padding};

    const FILE: &str = "test.safetensors";

    /// Header entries of one group: name, dtype, shape.
    type Header = &'static [(&'static str, Dtype, &'static [usize])];

    /// Owned tensors standing in for a file: name → (dtype, shape, bytes).
    struct Tensors(Vec<(String, Dtype, Vec<usize>, Vec<u8>)>);

    impl Tensors {
        fn from_encoded(t: Vec<(TensorSpec, Vec<u8>)>) -> Self {
            Tensors(
                t.into_iter()
                    .map(|(s, b)| (s.name, s.dtype, s.shape, b))
                    .collect(),
            )
        }
        /// Header-only entries (zero bytes of the right length).
        fn headers(entries: &[(&str, Dtype, &[usize])]) -> Self {
            Tensors(
                entries
                    .iter()
                    .map(|&(n, d, s)| {
                        let bytes = vec![0u8; s.iter().product::<usize>() * d.size()];
                        (n.to_string(), d, s.to_vec(), bytes)
                    })
                    .collect(),
            )
        }
        fn views(&self) -> Vec<TensorView<'_>> {
            self.0
                .iter()
                .map(|(n, d, s, b)| TensorView {
                    name: n,
                    dtype: *d,
                    shape: s,
                    data: b,
                    file: FILE,
                })
                .collect()
        }
        fn group(&self) -> Group<'_> {
            let (g, singles) = groups(self.views());
            assert!(singles.is_empty());
            assert_eq!(g.len(), 1);
            g.into_iter().next().unwrap()
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
                ((h % 4001) as f32 / 1000.0 - 2.0) * if i.is_multiple_of(7) { 8.0 } else { 1.0 }
            })
            .collect()
    }

    /// A quantized tensor of each layout's scheme, from the contract quantizer.
    fn quantized(layout: Layout, [n, k]: [usize; 2]) -> QuantizedTensor {
        let x = values(n * k, layout as u32);
        match layout.scheme() {
            Scheme::Nvfp4(s) => quantize_nvfp4_with_amax(
                &x,
                &[n, k],
                s,
                Padding::Reject,
                &[mxrl_formats::amax_of(x.iter().copied()) * 1.5],
            )
            .unwrap(),
            s @ Scheme::Fp8Block(_) => quantize(&x, &[n, k], s, Padding::Zero).unwrap(),
            s => quantize(&x, &[n, k], s, Padding::Reject).unwrap(),
        }
    }

    /// encode → decode gives back the quantized tensor byte for byte, and encode(decode(t))
    /// gives back the tensors byte for byte, for every layout (FP8-block with partial tiles).
    #[test]
    fn every_layout_round_trips_byte_exact() {
        for layout in Layout::ALL {
            let shape = if layout == Layout::Fp8Block {
                [200, 96]
            } else {
                [48, 64]
            };
            let q = quantized(layout, shape);
            let enc = layout.encode("m.proj.weight", &q).unwrap();
            let names: Vec<&str> = enc.iter().map(|(s, _)| s.name.as_str()).collect();
            let suffixes: Vec<&str> = layout.parts().iter().map(|p| p.suffix).collect();
            assert_eq!(
                names,
                suffixes
                    .iter()
                    .map(|s| format!("m.proj.{s}"))
                    .collect::<Vec<_>>(),
                "{layout:?}"
            );
            let files = Tensors::from_encoded(enc.clone());
            let g = files.group();
            assert_eq!(g.detect().unwrap(), Detected::Quantized(layout));
            let amax = q.amax.first().copied();
            let back = layout
                .decode_quantized("m.proj.weight", &g.lookup(layout), amax)
                .unwrap();
            assert_eq!(back, q, "{layout:?}");
            let stored = g.decode().unwrap().unwrap();
            let again = stored.encode("m.proj.weight").unwrap();
            assert_eq!(again, enc, "{layout:?}");
        }
    }

    /// Detection on hand-written headers of each layout (names, dtypes and shapes as the
    /// serving engines' loaders expect them).
    #[test]
    fn each_layout_is_detected_from_its_tensors() {
        use Dtype::*;
        let cases: [(Header, Detected); 6] = [
            (&[("a.weight", Bf16, &[64, 64])], Detected::Unquantized),
            (
                &[
                    ("a.weight", F8E4m3, &[64, 64]),
                    ("a.weight_scale_inv", U8, &[64, 2]),
                ],
                Detected::Quantized(Layout::Mxfp8),
            ),
            (
                &[
                    ("a.weight", U8, &[64, 32]),
                    ("a.weight_scale", F8E4m3, &[64, 4]),
                    ("a.weight_scale_2", F32, &[]),
                    ("a.input_scale", F32, &[]),
                ],
                Detected::Quantized(Layout::Nvfp4ModelOpt),
            ),
            (
                &[
                    ("a.weight_packed", U8, &[64, 32]),
                    ("a.weight_scale", F8E4m3, &[64, 4]),
                    ("a.weight_global_scale", F32, &[1]),
                    ("a.input_global_scale", F32, &[1]),
                ],
                Detected::Quantized(Layout::Nvfp4CompressedTensors),
            ),
            (
                // compressed-tensors without input scale, with its weight_shape.
                &[
                    ("a.weight_packed", U8, &[64, 32]),
                    ("a.weight_scale", F8E4m3, &[64, 4]),
                    ("a.weight_global_scale", F32, &[1]),
                    ("a.weight_shape", I64, &[2]),
                ],
                Detected::Quantized(Layout::Nvfp4CompressedTensors),
            ),
            (
                &[
                    ("a.weight", F8E4m3, &[200, 300]),
                    ("a.weight_scale_inv", F32, &[2, 3]),
                ],
                Detected::Quantized(Layout::Fp8Block),
            ),
        ];
        for (entries, want) in cases {
            let t = Tensors::headers(entries);
            assert_eq!(t.group().detect().unwrap(), want, "{entries:?}");
            // What convert writes for that layout is exactly these headers.
            let Detected::Quantized(layout) = want else {
                continue;
            };
            if !entries.iter().any(|e| e.0 == "a.weight_shape") {
                let logical = if layout == Layout::Fp8Block {
                    [200, 300]
                } else {
                    [64, 64]
                };
                let specs = layout.specs("a.weight", logical).unwrap();
                let got: Vec<(&str, Dtype, &[usize])> = specs
                    .iter()
                    .map(|s| (s.name.as_str(), s.dtype, s.shape.as_slice()))
                    .collect();
                assert_eq!(got, entries, "{layout:?}");
            }
        }
    }

    /// Malformed groups: the error names the file, the offending tensor and what was expected.
    #[test]
    fn malformed_groups_are_refused_naming_the_tensor() {
        use Dtype::*;
        let cases: [(Header, &[&str]); 9] = [
            // Missing scale.
            (
                &[("a.weight", F8E4m3, &[64, 64])],
                &["a.weight", "weight_scale_inv", FILE],
            ),
            (
                &[
                    ("a.weight", U8, &[64, 32]),
                    ("a.weight_scale", F8E4m3, &[64, 4]),
                ],
                &["a.weight_scale_2", "is missing", FILE],
            ),
            (
                &[
                    ("a.weight_packed", U8, &[64, 32]),
                    ("a.weight_global_scale", F32, &[1]),
                ],
                &["a.weight_scale", "is missing", "NVFP4 block scale"],
            ),
            // Wrong shape.
            (
                &[
                    ("a.weight", F8E4m3, &[64, 64]),
                    ("a.weight_scale_inv", U8, &[64, 4]),
                ],
                &[
                    FILE,
                    "a.weight_scale_inv",
                    "MXFP8 UE8M0 scale must be U8 [64, 2]",
                ],
            ),
            (
                &[
                    ("a.weight", F8E4m3, &[200, 300]),
                    ("a.weight_scale_inv", F32, &[3, 2]),
                ],
                &[
                    FILE,
                    "a.weight_scale_inv",
                    "FP8-block scale_inv must be F32 [2, 3]",
                ],
            ),
            // Wrong dtype.
            (
                &[
                    ("a.weight", U8, &[64, 32]),
                    ("a.weight_scale", U8, &[64, 4]),
                    ("a.weight_scale_2", F32, &[]),
                ],
                &[
                    FILE,
                    "a.weight_scale",
                    "NVFP4 block scale must be F8_E4M3 [64, 4], found U8",
                ],
            ),
            (
                &[
                    ("a.weight_packed", U8, &[64, 32]),
                    ("a.weight_scale", F8E4m3, &[64, 4]),
                    ("a.weight_global_scale", Bf16, &[1]),
                ],
                &[FILE, "a.weight_global_scale", "must be F32", "found BF16"],
            ),
            (
                &[
                    ("a.weight_packed", F8E4m3, &[64, 32]),
                    ("a.weight_scale", F8E4m3, &[64, 4]),
                    ("a.weight_global_scale", F32, &[1]),
                ],
                &[
                    FILE,
                    "a.weight_packed",
                    "must be a 2-D U8 tensor, found F8_E4M3",
                ],
            ),
            // A companion of no layout.
            (
                &[
                    ("a.weight", F8E4m3, &[64, 64]),
                    ("a.weight_scale_inv", U8, &[64, 2]),
                    ("a.weight_scale_2", F32, &[]),
                ],
                &[
                    FILE,
                    "a.weight_scale_2",
                    "does not belong to the mxfp8 layout",
                ],
            ),
        ];
        for (entries, want) in cases {
            let t = Tensors::headers(entries);
            let e = t.group().detect().unwrap_err().to_string();
            for w in want {
                assert!(e.contains(w), "{entries:?}: `{w}` not in: {e}");
            }
            // Decoding refuses it the same way.
            assert_eq!(t.group().decode().unwrap_err().to_string(), e);
        }
    }

    /// Biases, norms and other tensors stay outside the weight groups; a norm `weight` alone is
    /// an unquantized group.
    #[test]
    fn only_weights_and_their_companions_are_grouped() {
        use Dtype::*;
        let t = Tensors::headers(&[
            ("a.q_proj.weight", Bf16, &[8, 8]),
            ("a.q_proj.bias", Bf16, &[8]),
            ("a.norm.weight", F32, &[8]),
            ("a.q_proj.weight_scale_inv_x", F32, &[1]),
        ]);
        let (g, singles) = groups(t.views());
        let names: Vec<String> = g.iter().map(Group::weight_name).collect();
        assert_eq!(names, ["a.norm.weight", "a.q_proj.weight"]);
        let singles: Vec<&str> = singles.iter().map(|v| v.name).collect();
        assert_eq!(singles, ["a.q_proj.bias", "a.q_proj.weight_scale_inv_x"]);
        for g in g {
            assert_eq!(g.detect().unwrap(), Detected::Unquantized);
        }
    }

    /// NVFP4 decode checks the stored second-level scale against the amax, naming the tensor.
    #[test]
    fn nvfp4_second_level_scale_must_match_the_amax() {
        for layout in [Layout::Nvfp4ModelOpt, Layout::Nvfp4CompressedTensors] {
            let q = quantized(layout, [16, 32]);
            let files = Tensors::from_encoded(layout.encode("w.weight", &q).unwrap());
            let g = files.group();
            let e = layout
                .decode_quantized("w.weight", &g.lookup(layout), Some(q.amax[0] * 2.0))
                .unwrap_err()
                .to_string();
            let global = format!("w.{}", layout.suffix(Part::Global).unwrap());
            assert!(
                e.contains(FILE) && e.contains(&global) && e.contains("amax"),
                "{e}"
            );
            let e = layout
                .decode_quantized("w.weight", &g.lookup(layout), None)
                .unwrap_err()
                .to_string();
            assert!(e.contains("w.weight") && e.contains("amax"), "{e}");
        }
    }

    /// Consumer dequantization: ModelOpt and compressed-tensors apply their own formulas to
    /// the stored S / 1/S; MXFP8 and FP8-block equal the contract dequantizer. The expected
    /// NVFP4 values are written out here from the codes, independently of mxrl-formats.
    #[test]
    fn stored_weights_dequantize_with_their_consumers_formula() {
        let e2m1 = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        let e4m3 = |b: u8| {
            let (e, m) = ((b >> 3) & 0xF, (b & 7) as f32);
            if e == 0 {
                m / 8.0 * 2f32.powi(-6)
            } else {
                (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7)
            }
        };
        for layout in Layout::ALL {
            let q = quantized(layout, [128, 64]);
            let s = Stored::from_quantized(layout, "w.weight", &q).unwrap();
            let got = s.dequantize("w.weight").unwrap();
            let want: Vec<f32> = match layout.nvfp4_form() {
                None => q.dequantize().unwrap(),
                Some(_) => {
                    let g = s.global.unwrap();
                    let sc = q.scales.as_bytes().unwrap();
                    (0..128 * 64)
                        .map(|i| {
                            let (r, c) = (i / 64, i % 64);
                            let code = (q.data[i / 2] >> (4 * (i % 2))) & 0xF;
                            let v =
                                e2m1[(code & 7) as usize] * if code & 8 != 0 { -1.0 } else { 1.0 };
                            let sf = e4m3(sc[r * 4 + c / 16]);
                            if layout == Layout::Nvfp4ModelOpt {
                                (v * sf) * g
                            } else {
                                v * (sf / g)
                            }
                        })
                        .collect()
                }
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{layout:?}");
        }
    }

    /// A tensor of another scheme, or padded MXFP8, cannot be encoded.
    #[test]
    fn encode_refuses_what_the_layout_cannot_store() {
        let q = quantized(Layout::Mxfp8, [32, 64]);
        let e = Layout::Nvfp4ModelOpt
            .encode("x.weight", &q)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x.weight") && e.contains("nvfp4 (modelopt)"),
            "{e}"
        );
        let e = Layout::Mxfp8.encode("x.bias", &q).unwrap_err().to_string();
        assert!(e.contains("x.bias") && e.contains("*.weight"), "{e}");
        let x = values(30 * 40, 3);
        let padded = quantize(&x, &[30, 40], Scheme::MXFP8_ROW, Padding::Zero).unwrap();
        let e = Layout::Mxfp8
            .encode("x.weight", &padded)
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.weight") && e.contains("padded"), "{e}");
        let e = Layout::Mxfp8
            .specs("x.weight", [32, 40])
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.weight") && e.contains("K % 32"), "{e}");
    }
}
