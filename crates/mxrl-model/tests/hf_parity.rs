//! Parity with Hugging Face `transformers` (`Qwen3MoeForCausalLM`, `Qwen2MoeForCausalLM`).
//!
//! Fixtures: `tests/fixtures/<arch>/` written by `tests/fixtures/gen_fixtures.py` (versions
//! pinned in its header; format version 1). Regenerate with
//! `python3 crates/mxrl-model/tests/fixtures/gen_fixtures.py OUT && cp -r OUT/* crates/mxrl-model/tests/fixtures/`.
//!
//! # Tolerances
//! Both sides compute the same f32 function with different summation orders (and PyTorch's
//! `exp`/`rsqrt`/`cos` may differ from Rust's by an ulp). Each output is a composition whose
//! longest chain of dependent f32 roundings is at most
//! `N = L·(H + 2·F_max + T·D + Hq·D + 8) + H + V` (per layer: the H-long norm and q/k/v
//! reductions, the expert/dense MLP reductions, the attention scores and weighted sums, the
//! o-projection; then the final norm and the vocabulary reduction), so each output differs from
//! the exact value by at most `γ_N` relative to the magnitude `S` of the terms it sums. We take
//! `S` as the largest absolute value of the compared tensor (logits of a row, gradient of a
//! tensor), times the factor 2 for the two independent implementations:
//! `|ours − ref| ≤ 2·γ_N·S`.

use mxrl_model::{hf::hf_names, ForwardOptions, Model, SeqInput};
use mxrl_tensor::gradcheck::gamma;
use safetensors::SafeTensors;
use std::path::PathBuf;

fn fixture(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(arch)
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("fixture tensor {name}: {e}"));
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn i32s(st: &SafeTensors<'_>, name: &str) -> Vec<u32> {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("fixture tensor {name}: {e}"));
    assert_eq!(t.dtype(), safetensors::Dtype::I32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect()
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, &b| a.max(b.abs()))
}

fn parity(arch: &str) {
    let dir = fixture(arch);
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; regenerate with tests/fixtures/gen_fixtures.py",
            dir.display()
        )
    });
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap_or_default();
    assert_eq!(
        meta.get("format_version").map(String::as_str),
        Some("1"),
        "fixture format version mismatch: regenerate with tests/fixtures/gen_fixtures.py"
    );
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let model = Model::load_hf(&dir).unwrap();
    let c = model.config().clone();
    let fmax = c
        .intermediate_size
        .max(c.moe_intermediate_size)
        .max(c.shared_expert_intermediate_size);
    let seqs: Vec<Vec<u32>> = (0..2)
        .map(|i| i32s(&st, &format!("seq{i}/tokens")))
        .collect();
    let tmax = seqs.iter().map(|s| s.len()).max().unwrap();
    let n = c.num_layers
        * (c.hidden_size + 2 * fmax + tmax * c.head_dim + c.num_heads * c.head_dim + 8)
        + c.hidden_size
        + c.vocab_size;
    let tol = 2.0 * gamma(n) as f32;
    let batch: Vec<SeqInput> = seqs.iter().map(|s| SeqInput::next_token(s)).collect();
    let out = model
        .forward(
            &batch,
            &ForwardOptions {
                return_logits: true,
                train: true,
                ..Default::default()
            },
        )
        .unwrap();
    let v = c.vocab_size;
    let mut worst = 0.0f32;
    for (i, s) in seqs.iter().enumerate() {
        let want = f32s(&st, &format!("seq{i}/logits"));
        let got = &out.logits.as_ref().unwrap()[i];
        for t in 0..s.len() - 1 {
            let (w, g) = (&want[t * v..(t + 1) * v], &got[t * v..(t + 1) * v]);
            let bound = tol * max_abs(w);
            for (a, b) in g.iter().zip(w) {
                worst = worst.max((a - b).abs() / max_abs(w));
                assert!(
                    (a - b).abs() <= bound,
                    "{arch} seq {i} pos {t}: logit {a} vs {b} (bound {bound})"
                );
            }
        }
        let want = f32s(&st, &format!("seq{i}/logprobs"));
        let bound = tol * max_abs(&want).max(1.0);
        for (t, (a, b)) in out.logprobs[i].iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= bound,
                "{arch} seq {i} pos {t}: logprob {a} vs {b}"
            );
        }
        let mut moe = out.routing[i].layers.iter();
        for l in 0..c.num_layers {
            match c
                .is_moe_layer(l)
                .then(|| moe.next().expect("routes of every MoE layer"))
            {
                Some(r) => {
                    let ids = i32s(&st, &format!("seq{i}/layer{l}/ids"));
                    let w = f32s(&st, &format!("seq{i}/layer{l}/weights"));
                    assert_eq!(
                        &r.ids[..],
                        &ids[..ids.len() - r.top_k],
                        "{arch} seq {i} layer {l} expert ids"
                    );
                    for (a, b) in r.weights.iter().zip(&w) {
                        assert!(
                            (a - b).abs() <= tol,
                            "{arch} seq {i} layer {l}: weight {a} vs {b}"
                        );
                    }
                }
                None => assert!(
                    st.tensor(&format!("seq{i}/layer{l}/ids")).is_err(),
                    "{arch}: layer {l} is MoE in transformers but dense here"
                ),
            }
        }
    }
    eprintln!("{arch}: worst logit |Δ|/max|logit| = {worst:e} (bound {tol:e})");
    // gradients of L = Σ r·logprob
    let dl: Vec<Vec<f32>> = (0..2)
        .map(|i| f32s(&st, &format!("seq{i}/dlogprobs")))
        .collect();
    let grads = model
        .backward(out.tape.as_ref().unwrap(), &dl, 0.0)
        .unwrap();
    let gtol = 2.0 * gamma(2 * n) as f32;
    let mut worst = 0.0f32;
    let mut checked = 0;
    for (id, p) in model.params().iter().enumerate() {
        let g = grads.get(id);
        let names = hf_names(&p.name);
        let want: Vec<f32> = names
            .iter()
            .flat_map(|nm| f32s(&st, &format!("grad/{nm}")))
            .collect();
        assert_eq!(want.len(), g.len(), "{}", p.name);
        let s = max_abs(&want);
        checked += 1;
        if s == 0.0 {
            // an expert no token chose: both sides must give exactly zero
            assert!(
                g.iter().all(|&x| x == 0.0),
                "{arch}: {} should have zero gradient",
                p.name
            );
            continue;
        }
        for (j, (a, b)) in g.iter().zip(&want).enumerate() {
            worst = worst.max((a - b).abs() / s);
            assert!(
                (a - b).abs() <= gtol * s,
                "{arch} grad {}[{j}]: {a} vs {b} (bound {})",
                p.name,
                gtol * s
            );
        }
    }
    assert_eq!(checked, model.params().len());
    eprintln!("{arch}: worst grad |Δ|/max|g| = {worst:e} (bound {gtol:e})");
}

#[test]
fn qwen3_moe_matches_transformers() {
    parity("qwen3_moe");
}

#[test]
fn qwen2_moe_matches_transformers() {
    parity("qwen2_moe");
}
