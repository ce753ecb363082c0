//! mxrl-formats: the bit-exact quantizer contract of mxrl (see `quant-contract.md`).
//!
//! Every quantizer in mxrl — conversion, training forward, rollout, live weight export —
//! goes through this crate, so that the trainer and the rollout engine produce the same bytes.
#![deny(missing_docs)]

mod format;

pub use format::Format;
