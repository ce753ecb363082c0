//! The messages and services of `proto/rollout.proto` (package `mxrl.rollout.v1`), generated at
//! build time by `tonic-prost-build` from the descriptor `protox` compiles. The `.proto` file is
//! the protocol's documentation.
#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("mxrl.rollout.v1");

/// Name of the binary trailer carrying a [`Refusal`] on every failed call.
pub const REFUSAL_TRAILER: &str = "mxrl-refusal-bin";
