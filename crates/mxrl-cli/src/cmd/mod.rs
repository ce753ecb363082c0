//! Subcommands, one module each.

pub mod bench;
pub mod inspect;
pub mod plan;
pub mod quantize;
