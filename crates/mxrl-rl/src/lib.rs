//! mxrl-rl: the RL loop of mxrl — tasks and rewards, rollout, GRPO trainer, live weight sync,
//! mismatch metrics, the ablation runner and its report.
//!
//! Design:
//! - The loop talks to models through two small traits ([`RolloutPolicy`], [`TrainPolicy`]):
//!   the rollout engine holds its own copy of the weights in the plan's formats; the trainer's
//!   model (the CPU `mxrl_model::Model` or the device `Engine`) owns the f32 masters and their
//!   gradients and exports the plan-quantized bytes that a weight update ships.
//! - Weight updates ([`sync`]) carry a version and the quantizer contract hash, travel in
//!   checksummed buckets and are applied atomically; a mismatched hash is refused.
//! - Every step writes one JSON line of metrics ([`metrics`]); the report ([`report`]) is
//!   regenerated from those files alone.
#![deny(missing_docs)]

pub mod ablate;
pub mod engine;
pub mod grpo;
pub mod manifest;
pub mod metrics;
pub mod moe;
pub mod optim;
pub mod policy;
pub mod proto;
pub mod report;
pub mod runner;
pub mod sampling;
pub mod server;
pub mod session;
pub mod sync;
pub mod tabular;
pub mod task;
pub mod text;
pub mod wire;

pub use policy::{
    LayerProbes, LocalExport, ParamMut, PolicyError, RolloutPolicy, RoutingTrace, Sample,
    SamplingConfig, Scored, TrainForward, TrainPolicy, TrainSeq, WireTensor,
};
