//! Subcommands, one module each.

pub mod inspect;
pub mod quantize;
