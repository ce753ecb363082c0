//! mxrl-tensor: the compute core shared by the trainer and the rollout engine.
//!
//! The CPU backend here is the permanent reference every other device must match.
#![deny(missing_docs)]

pub mod gemm;
