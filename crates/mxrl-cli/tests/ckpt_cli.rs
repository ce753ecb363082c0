//! `mxrl synth → convert → inspect → verify → dequantize → inspect` through the binary, and
//! the exit codes of refusals and of verify on a tampered checkpoint.

use std::path::Path;
use std::process::Command;

fn mxrl(args: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_mxrl"))
        .args(args)
        .output()
        .expect("run mxrl");
    let mut s = String::from_utf8_lossy(&o.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&o.stderr));
    (o.status.success(), s)
}

fn ok(args: &[&str]) -> String {
    let (ok, out) = mxrl(args);
    assert!(ok, "mxrl {args:?} failed:\n{out}");
    out
}

fn p(x: &Path) -> &str {
    x.to_str().unwrap()
}

#[test]
fn convert_inspect_verify_dequantize_round_trip() {
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("src");
    let out = ok(&["synth", "--arch", "qwen2-moe", "--out", p(&src)]);
    assert!(out.contains("3 shard(s)"), "{out}");
    for (fmt, marker) in [
        ("modelopt", "weight_scale_2"),
        ("compressed-tensors", "weight_packed"),
    ] {
        let dst = root.path().join(format!("nv-{fmt}"));
        let out = ok(&[
            "convert",
            "--model",
            p(&src),
            "--recipe",
            "nvfp4-hp",
            "--out",
            p(&dst),
            "--format",
            fmt,
        ]);
        assert!(out.contains("nvfp4") && out.contains("GB/s"), "{out}");
        // inspect reads what convert wrote: every shard carries this build's contract.
        let ins = ok(&["inspect", p(&dst)]);
        assert_eq!(ins.matches("matches this build").count(), 3, "{ins}");
        assert!(
            ins.contains(&format!("model.layers.0.mlp.experts.0.up_proj.{marker}")),
            "{ins}"
        );
        let v = ok(&["verify", "--source", p(&src), "--converted", p(&dst)]);
        assert!(v.contains(" 0 difference(s)"), "{v}");
        let deq = root.path().join(format!("deq-{fmt}"));
        ok(&["dequantize", "--model", p(&dst), "--out", p(&deq)]);
        let ins = ok(&["inspect", "--summary", p(&deq)]);
        assert!(
            !ins.contains("nvfp4") && ins.contains("unquantized"),
            "{ins}"
        );
        assert!(ins.contains("contract: none recorded"), "{ins}");
    }
    // MXFP8 and FP8-block outputs of a block-FP8 DeepSeek-V3 source, through inspect too.
    let ds = root.path().join("ds");
    ok(&[
        "synth",
        "--arch",
        "deepseek-v3",
        "--fp8",
        "pow2",
        "--out",
        p(&ds),
    ]);
    let fp8_recipe = root.path().join("fp8.toml");
    std::fs::write(
        &fp8_recipe,
        "name = \"fp8\"\nbackward = \"high_precision\"\ndefault = \"fp8_block\"\nnvfp4_activation_scale = \"per_token\"\n[[rule]]\nrole = \"mla_kv_b\"\nformat = \"bf16\"\n[[rule]]\nrole = \"router\"\nformat = \"bf16\"\n[[rule]]\nrole = \"lm_head\"\nformat = \"bf16\"\n",
    )
    .unwrap();
    for (i, (recipe, label)) in [("mxfp8", "mxfp8 data"), (p(&fp8_recipe), "fp8_block data")]
        .into_iter()
        .enumerate()
    {
        let dst = root.path().join(format!("ds-{i}"));
        ok(&[
            "convert",
            "--model",
            p(&ds),
            "--recipe",
            recipe,
            "--out",
            p(&dst),
        ]);
        let ins = ok(&["inspect", p(&dst)]);
        assert_eq!(ins.matches("matches this build").count(), 3, "{ins}");
        assert!(ins.contains(label), "{ins}");
        ok(&[
            "verify",
            "--source",
            p(&ds),
            "--converted",
            p(&dst),
            "--quiet",
        ]);
        let deq = root.path().join(format!("ds-deq-{i}"));
        ok(&["dequantize", "--model", p(&dst), "--out", p(&deq)]);
        let ins = ok(&["inspect", "--summary", p(&deq)]);
        assert!(!ins.contains("fp8") && !ins.contains("mxfp8"), "{ins}");
    }
    // Refusal: existing output without --force exits non-zero and keeps it.
    let dst = root.path().join("nv-modelopt");
    let (okk, out) = mxrl(&[
        "convert",
        "--model",
        p(&src),
        "--recipe",
        "mxfp8",
        "--out",
        p(&dst),
    ]);
    assert!(!okk && out.contains("--force"), "{out}");
    assert!(dst.join("hf_quant_config.json").exists());
    // Tamper with one byte: verify reports it and exits non-zero.
    let shard = dst.join("model-00002-of-00003.safetensors");
    let mut b = std::fs::read(&shard).unwrap();
    let n = b.len();
    b[n - 1] ^= 0x40;
    std::fs::write(&shard, b).unwrap();
    let (okk, out) = mxrl(&[
        "verify",
        "--source",
        p(&src),
        "--converted",
        p(&dst),
        "--quiet",
    ]);
    assert!(!okk, "{out}");
    assert!(
        out.contains("DIFF") && out.contains("1 difference(s)"),
        "{out}"
    );
}
