//! The typed `mxrl.json`: what `convert` writes parses back into the same record, and a
//! malformed record is refused by every reader with an error naming the file and the field.

use mxrl_ckpt::synth::{write_synthetic, Arch, SynthSpec};
use mxrl_ckpt::{
    convert, load_quantized, verify, ConvertOptions, MxrlRecord, NoProgress, MXRL_JSON,
};
use mxrl_formats::{contract_hash, CONTRACT_VERSION};
use mxrl_plan::Recipe;
use serde_json::Value;
use std::path::Path;

fn converted(root: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let src = root.join("src");
    write_synthetic(&SynthSpec::tiny(Arch::Qwen3Moe), &src).unwrap();
    let dst = root.join("q");
    convert(
        &src,
        &Recipe::preset("nvfp4-hp").unwrap(),
        "nvfp4-hp",
        &dst,
        &ConvertOptions::default(),
        &NoProgress,
    )
    .unwrap();
    (src, dst)
}

#[test]
fn convert_writes_a_record_that_parses_back() {
    let d = tempfile::tempdir().unwrap();
    let (_, dst) = converted(d.path());
    let path = dst.join(MXRL_JSON);
    let (rec, value) = MxrlRecord::read_with_value(&path).unwrap();
    assert_eq!(rec.contract.version, CONTRACT_VERSION);
    assert_eq!(rec.contract.hash, contract_hash());
    assert_eq!(rec.recipe.source, "nvfp4-hp");
    assert_eq!(rec.quantized_format.as_deref(), Some("nvfp4"));
    // Serializing the typed record gives back exactly the JSON on disk.
    assert_eq!(rec.to_value(), value);
    let nvfp4: Vec<_> = rec
        .tensors
        .iter()
        .filter(|(_, t)| t.format == "nvfp4")
        .collect();
    assert!(!nvfp4.is_empty());
    for (name, t) in nvfp4 {
        assert_eq!(t.amax_from_bits(), t.amax, "{name}");
        let fused = name.ends_with(".gate_proj.weight") || name.ends_with(".up_proj.weight");
        assert_eq!(t.amax_shared_with.is_some(), fused, "{name}: {t:?}");
    }
}

#[test]
fn malformed_records_are_refused_naming_file_and_field() {
    let d = tempfile::tempdir().unwrap();
    let (src, dst) = converted(d.path());
    let path = dst.join(MXRL_JSON);
    let good: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let first = good["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, t)| t["format"] == "nvfp4")
        .map(|(n, _)| n.clone())
        .unwrap();
    type Edit<'a> = Box<dyn Fn(&mut Value) + 'a>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "amax bits of the wrong type",
            Box::new(|v: &mut Value| v["tensors"][&first]["amax_bits"] = 5.into()),
            "amax_bits",
        ),
        (
            "unknown top-level field",
            Box::new(|v: &mut Value| v["extra"] = 1.into()),
            "extra",
        ),
        (
            "contract version missing",
            Box::new(|v: &mut Value| {
                v["contract"].as_object_mut().unwrap().remove("version");
            }),
            "version",
        ),
        (
            "stored names not a list",
            Box::new(|v: &mut Value| v["tensors"][&first]["stored"] = "x".into()),
            "stored",
        ),
    ];
    for (what, edit, field) in cases {
        let mut v = good.clone();
        edit(&mut v);
        std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
        let e = load_quantized(&dst).unwrap_err().to_string();
        assert!(
            e.contains(field) && e.contains(MXRL_JSON),
            "{what}: load: {e}"
        );
        let e = verify(&src, &dst, &NoProgress).unwrap_err().to_string();
        assert!(
            e.contains(field) && e.contains(MXRL_JSON),
            "{what}: verify: {e}"
        );
    }
    // A well-typed but wrong amax is caught against the stored second-level scale.
    let mut v = good.clone();
    v["tensors"][&first]["amax_bits"] = "0x3F800000".into();
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let e = load_quantized(&dst).unwrap_err().to_string();
    assert!(e.contains(&first), "{e}");
}
