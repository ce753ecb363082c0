//! Subcommands, one module each.

pub mod ablate;
pub mod bench;
pub mod bench_model;
pub mod ckpt_bench;
pub mod convert;
pub mod demo;
pub mod dequantize;
pub mod device;
pub mod forward;
pub mod generate;
pub mod inspect;
pub mod plan;
mod progress;
pub mod quantize;
pub mod report;
pub mod rl;
pub mod rollout_server;
pub mod sft;
pub mod synth;
pub mod tokenizer;
pub mod validate;
pub mod verify;
