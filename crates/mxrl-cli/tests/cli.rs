//! End-to-end runs of the `mxrl` binary: vector-file reproduction and check, ordinary-tensor
//! quantization (2-D, stacked, 3-D), and inspect.

use std::path::PathBuf;
use std::process::Command;

fn mxrl() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mxrl"))
}

fn public_vectors() -> PathBuf {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../vectors/quant-public.safetensors");
    assert!(p.exists(), "public vector file missing at {}", p.display());
    p
}

#[test]
fn vectors_check_reports_every_case_passed() {
    let out = mxrl()
        .args(["quantize", "--vectors"])
        .arg(public_vectors())
        .arg("--check")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.lines().last(), Some("48 passed, 0 failed"));
    assert_eq!(stdout.lines().filter(|l| l.ends_with("PASS")).count(), 48);
}

#[test]
fn vectors_written_by_mxrl_check_against_themselves_and_tampering_fails() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("mine.safetensors");
    let st = mxrl()
        .args(["quantize", "--vectors"])
        .arg(public_vectors())
        .arg(&out_path)
        .status()
        .unwrap();
    assert!(st.success());
    let out = mxrl()
        .args(["quantize", "--vectors"])
        .arg(&out_path)
        .arg("--check")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().lines().last(),
        Some("48 passed, 0 failed")
    );
    // The bytes of the written file equal the public file's expected outputs tensor by tensor
    // (checked above); now flip one data byte of the public file and expect a failure.
    let off = {
        let f = mxrl_ckpt::SafetensorsFile::open(&public_vectors()).unwrap();
        let h = f.header();
        let t = h
            .tensors
            .iter()
            .find(|t| t.name == "c009/mxfp8.row.data")
            .unwrap();
        h.data_start + t.begin
    };
    let mut raw = std::fs::read(public_vectors()).unwrap();
    raw[off] ^= 0x01;
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, &raw).unwrap();
    let out = mxrl()
        .args(["quantize", "--vectors"])
        .arg(&bad)
        .arg("--check")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().last(), Some("47 passed, 1 failed"));
    assert!(stdout
        .lines()
        .any(|l| l.starts_with("c009") && l.contains("DIFF(data)") && l.ends_with("FAIL")));
}

fn write_input(path: &std::path::Path) {
    // gate [64, 128] f32, up [32, 128] bf16-as-f32, experts [2, 32, 128], bias [128] (1-D, copied).
    let mut tensors = Vec::new();
    let mk = |n: usize, s: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|i| (((i * 7919) % 1000) as f32 / 100.0 * s - 5.0 * s).to_le_bytes())
            .collect()
    };
    let gate = mk(64 * 128, 1.0);
    let up = mk(64 * 128, 2.0);
    let experts = mk(2 * 32 * 128, 0.5);
    let bias = mk(128, 1.0);
    let views = [
        ("gate", vec![64, 128], &gate),
        ("up", vec![64, 128], &up),
        ("experts", vec![2, 32, 128], &experts),
        ("bias", vec![128], &bias),
    ];
    for (n, s, b) in &views {
        tensors.push((
            n.to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
        ));
    }
    std::fs::write(path, safetensors::serialize(tensors, &None).unwrap()).unwrap();
}

#[test]
fn quantize_format_writes_all_tensors_and_inspect_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    write_input(&input);
    let out = dir.path().join("nv.safetensors");
    let st = mxrl()
        .args(["quantize", "--format", "nvfp4", "--stack", "gate,up"])
        .arg(&input)
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    let raw = std::fs::read(&out).unwrap();
    let f = safetensors::SafeTensors::deserialize(&raw).unwrap();
    let amax = |n: &str| f.tensor(n).unwrap().data().to_vec();
    // gate and up share one amax (up is 2× gate, so the shared amax is up's).
    assert_eq!(amax("gate/nvfp4.tensor.amax"), amax("up/nvfp4.tensor.amax"));
    assert_eq!(f.tensor("experts/nvfp4.tensor.amax").unwrap().shape(), &[2]);
    assert_eq!(
        f.tensor("experts/nvfp4.tensor.data").unwrap().shape(),
        &[2, 32, 64]
    );
    assert_eq!(f.tensor("bias").unwrap().shape(), &[128]);

    let out2 = dir.path().join("mx.safetensors");
    let st = mxrl()
        .args(["quantize", "--format", "mxfp8", "--usage", "both"])
        .arg(&input)
        .arg(&out2)
        .status()
        .unwrap();
    assert!(st.success());
    let ins = mxrl().arg("inspect").arg(dir.path()).output().unwrap();
    let text = String::from_utf8(ins.stdout).unwrap();
    assert!(ins.status.success(), "{text}");
    assert!(
        text.contains("experts/mxfp8.col.scale") && text.contains("mxfp8.col scale"),
        "{text}"
    );
    assert!(text.contains(mxrl_formats_hash()), "{text}");
    assert!(text.contains("matches this build"), "{text}");

    // K not a multiple of the block is refused without --pad (and no output appears).
    let bad_out = dir.path().join("fp8.safetensors");
    let res = mxrl()
        .args(["quantize", "--format", "fp8-block"])
        .arg(&input)
        .arg(&bad_out)
        .output()
        .unwrap();
    assert!(!res.status.success());
    assert!(String::from_utf8_lossy(&res.stderr).contains("not a multiple"));
    assert!(!bad_out.exists());
    let ok = mxrl()
        .args(["quantize", "--format", "fp8-block", "--pad"])
        .arg(&input)
        .arg(&bad_out)
        .status()
        .unwrap();
    assert!(ok.success() && bad_out.exists());
}

/// `bench model --json-out` (written through `mxrl_ckpt::write_bytes_atomic`, whose own tests
/// show the replacement happens only on success): an existing file is replaced by the complete
/// results, and nothing else (no hidden temporary) is left in the directory.
#[test]
fn bench_model_json_out_replaces_the_file_and_leaves_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bench.json");
    std::fs::write(&out, "previous run").unwrap();
    let res = mxrl()
        .args([
            "bench",
            "model",
            "--small",
            "--layers",
            "1",
            "--prefill",
            "8",
        ])
        .args([
            "--batches",
            "1",
            "--prompt",
            "4",
            "--steps",
            "1",
            "--reps",
            "1",
        ])
        .args(["--train-seqs", "0", "--json-out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(r["device"], "cpu", "{r}");
    assert_eq!(r["prefill_tokens"], 8, "{r}");
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["bench.json"], "{names:?}");
}

fn mxrl_formats_hash() -> &'static str {
    mxrl_formats::contract_hash()
}
