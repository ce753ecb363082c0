//! Shared loader for vector files in the quant-contract §6 layout (included by tests).
#![allow(dead_code)]

use mxrl_formats::{Padding, QuantizedTensor, Scheme};
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

/// `<repo root>/vectors/<name>`: the conformance vectors kept in the repository.
pub fn repo_vector_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../vectors")
        .join(name)
}

pub fn read_file(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| {
        panic!(
            "vector file {} is missing or unreadable: {e}",
            path.display()
        )
    })
}

#[derive(serde::Deserialize, Debug)]
pub struct Case {
    pub case: String,
    pub shape: Vec<usize>,
    pub family: String,
    pub dtype: String,
    pub outputs: Vec<String>,
}

pub fn manifest(
    st: &SafeTensors<'_>,
    raw: &[u8],
) -> (Vec<Case>, std::collections::HashMap<String, String>) {
    let (_, meta) = SafeTensors::read_metadata(raw).expect("safetensors header");
    let meta = meta.metadata().clone().expect("vector file has metadata");
    let m = meta.get("manifest").expect("metadata key `manifest`");
    let _ = st;
    (serde_json::from_str(m).expect("manifest JSON"), meta)
}

pub fn u8_tensor(st: &SafeTensors<'_>, name: &str) -> Vec<u8> {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("tensor {name}: {e}"));
    assert_eq!(t.dtype(), Dtype::U8, "{name} dtype");
    t.data().to_vec()
}

pub fn f32_tensor(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("tensor {name}: {e}"));
    assert_eq!(t.dtype(), Dtype::F32, "{name} dtype");
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Quantize case input `c/x` with `scheme` through `quant` (reference or fast path).
pub fn quantize_case(
    st: &SafeTensors<'_>,
    case: &Case,
    scheme: Scheme,
    fast: bool,
) -> QuantizedTensor {
    let t = st.tensor(&format!("{}/x", case.case)).expect("case input");
    assert_eq!(t.shape(), case.shape.as_slice(), "{} shape", case.case);
    let bytes = t.data();
    let shape = &case.shape;
    let run = |r: Result<QuantizedTensor, mxrl_formats::FormatError>| r.expect("quantize");
    match t.dtype() {
        Dtype::BF16 => {
            let x: Vec<half::bf16> = bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                .collect();
            if fast {
                run(mxrl_formats::quantize(&x, shape, scheme, Padding::Reject))
            } else {
                run(mxrl_formats::reference::quantize(
                    &x,
                    shape,
                    scheme,
                    Padding::Reject,
                ))
            }
        }
        Dtype::F32 => {
            let x: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            if fast {
                run(mxrl_formats::quantize(&x, shape, scheme, Padding::Reject))
            } else {
                run(mxrl_formats::reference::quantize(
                    &x,
                    shape,
                    scheme,
                    Padding::Reject,
                ))
            }
        }
        other => panic!("{}: unexpected input dtype {other:?}", case.case),
    }
}

/// Check every output of every case of the vector file at `path` byte-equal, through both the
/// reference and the fast path. Returns the number of outputs compared.
pub fn check_vector_file(path: &std::path::Path) -> usize {
    let raw = read_file(path);
    let st = SafeTensors::deserialize(&raw).expect("valid safetensors");
    let (cases, _) = manifest(&st, &raw);
    assert!(!cases.is_empty(), "{}: empty manifest", path.display());
    let mut compared = 0;
    let mut failures = Vec::new();
    for case in &cases {
        for out in &case.outputs {
            let scheme = Scheme::from_name(out)
                .unwrap_or_else(|| panic!("{}: unknown output {out}", case.case));
            let want_data = u8_tensor(&st, &format!("{}/{out}.data", case.case));
            let want_scale = u8_tensor(&st, &format!("{}/{out}.scale", case.case));
            let want_amax = out
                .starts_with("nvfp4")
                .then(|| f32_tensor(&st, &format!("{}/{out}.amax", case.case)));
            for fast in [false, true] {
                let q = quantize_case(&st, case, scheme, fast);
                let path_name = if fast { "fast" } else { "reference" };
                let mut bad = Vec::new();
                if q.data != want_data {
                    bad.push("data");
                }
                if q.scales.as_bytes() != Some(want_scale.as_slice()) {
                    bad.push("scale");
                }
                if let Some(a) = &want_amax {
                    let got: Vec<u32> = q.amax.iter().map(|v| v.to_bits()).collect();
                    let want: Vec<u32> = a.iter().map(|v| v.to_bits()).collect();
                    if got != want {
                        bad.push("amax");
                    }
                }
                if !bad.is_empty() {
                    failures.push(format!(
                        "{} {} {:?} {} {}: {path_name} differs in {bad:?}",
                        case.case, out, case.shape, case.family, case.dtype
                    ));
                }
                compared += 1;
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    compared
}
