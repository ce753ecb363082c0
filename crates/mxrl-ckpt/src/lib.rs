//! mxrl-ckpt: Hugging Face checkpoints in and out of mxrl.
//!
//! - **Reading** ([`Checkpoint`], [`SafetensorsFile`]): the one safetensors reader of the
//!   project. `model.safetensors` or a sharded `model.safetensors.index.json`, memory-mapped,
//!   with strict validation ([`parse_header`], [`parse_index`], then the `safetensors` crate's
//!   own check): truncation, overlapping or out-of-file offsets, unknown or mismatched dtypes,
//!   missing shards and index entries are errors that name the file, tensor and field. Every
//!   command reads checkpoints through it (inspect, plan inventory and audit
//!   ([`model_inventory`], [`audit_dir`]), convert, verify, dequantize, model loading, RL
//!   checkpoints); `config.json` is validated first by `mxrl_plan::HfConfig`.
//! - **Writing** ([`ShardWriter`], [`StagedDir`], [`write_atomic`]): shards are streamed tensor
//!   by tensor after a header computed up front; single files go through a temporary name and
//!   a rename; an output directory is built as `DST.partial` and renamed to `DST` only when
//!   complete, an existing `DST` is only replaced on request and kept until the new one is in
//!   place, and staging or backup paths that are or lie in the source are refused.
//! - **Serving containers** ([`container`]): SGLang MXFP8, ModelOpt and compressed-tensors
//!   NVFP4, FP8-block — one [`Layout`] each with its encoder, decoder and detector, used by
//!   convert, loading, dequantize, the plan audit and inspect; the formulas that turn stored
//!   bytes into values are in `mxrl-formats`.
//! - **Loading converted checkpoints** ([`load_quantized`]): the stored quantized bytes of
//!   every weight (never re-quantized), the recorded recipe and plan, NVFP4 amax checked
//!   against the stored second-level scales; [`stack_rows`] fuses gate/up parts.
//! - **Synthetic checkpoints** ([`synth`]): small models in the real HF layouts of Qwen3-MoE,
//!   Qwen2-MoE and DeepSeek-V3 (incl. block-FP8 storage), sharded so expert gate/up pairs
//!   straddle shards.
#![deny(missing_docs)]

pub mod container;
pub mod convert;
pub mod dequant;
mod dtype;
mod error;
mod header;
pub mod load;
mod reader;
mod record;
mod scan;
pub mod synth;
mod values;
pub mod verify;
mod writer;

pub use container::{Detected, Layout, Nvfp4Container, Part, Stored};
pub use convert::{
    convert, ConvertOptions, ConvertSummary, Method, NoProgress, Progress, HF_QUANT_CONFIG,
    MXRL_JSON,
};
pub use dequant::{dequantize, DequantSummary};
pub use dtype::Dtype;
pub use error::{CkptError, Result};
pub use header::{
    index_json, parse_header, parse_index, Header, Index, TensorInfo, MAX_HEADER_LEN,
};
pub use load::{is_converted, load_quantized, stack_rows, QuantizedCheckpoint, StoredWeight};
pub use reader::{Checkpoint, SafetensorsFile, TensorView, CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
pub use record::{ContractRecord, MxrlRecord, RecipeRecord, TensorRecord, MAX_RECORD_BYTES};
pub use scan::{audit_dir, model_inventory};
pub use values::{
    check_finite, count_nonfinite, f32_bytes, f32_from_bytes, f32_to_bf16_bytes, to_f32,
};
pub use verify::{verify, VerifyItem, VerifyReport};
pub use writer::{
    backup_path, check_output_vs_source, copy_other_files, header_bytes, partial_path,
    write_atomic, write_bytes_atomic, write_json, write_safetensors, write_safetensors_atomic,
    ShardWriter, StagedDir, TensorSpec, STAGING_MARKER,
};
