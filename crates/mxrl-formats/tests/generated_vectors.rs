//! A second vector file in the §6 layout, written by the committed independent generator
//! `tests/gen/gen_vectors.py` (numpy, from the contract text) with other shapes, seeds and
//! families (rows of wildly different magnitude, outliers, tiny values and f32 subnormals,
//! values on and between grid points, −0.0, NaN/±Inf): every output byte-equal through the
//! reference and the fast path.

mod common;

use safetensors::SafeTensors;
use std::path::PathBuf;

/// Format version of the generated file this test understands (the generator's
/// `FORMAT_VERSION`).
const GENERATOR_FORMAT_VERSION: &str = "1";
const REGENERATE: &str = "python3 crates/mxrl-formats/tests/gen/gen_vectors.py \
                          crates/mxrl-formats/tests/data/quant-gen.safetensors";

fn path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant-gen.safetensors")
}

#[test]
fn generated_vector_file_has_the_expected_format_version() {
    let raw = common::read_file(&path());
    let (_, meta) = SafeTensors::read_metadata(&raw).expect("safetensors header");
    let meta = meta.metadata().clone().unwrap_or_default();
    let v = meta.get("generator_format_version").map(String::as_str);
    assert_eq!(
        v,
        Some(GENERATOR_FORMAT_VERSION),
        "tests/data/quant-gen.safetensors has generator format version {v:?}, this test \
         expects {GENERATOR_FORMAT_VERSION}; regenerate it from the repository root with:\n  \
         {REGENERATE}"
    );
}

#[test]
fn generated_vectors_are_byte_equal() {
    let n = common::check_vector_file(&path());
    // 72 cases × outputs (3, 3, 5, 5, 5, 5 per shape for M = 2, 5, 16, 32, 48, 64; 12 cases
    // each) × 2 paths.
    assert_eq!(n, 2 * 12 * (3 + 3 + 4 + 5 + 4 + 5));
}
