//! One check of the per-layer probes a generation records on the device
//! ([`Engine::generate_recording`]), written once and run on every backend: the CPU engine in
//! `mxrl-model`'s tests, the GPU engine in `mxrl-cuda`'s (included there by path).

use mxrl_model::engine::{Engine, Record, Recorded};
use mxrl_model::Model;
use mxrl_tensor::device::Backend;
use mxrl_tensor::sample::SampleParams;

/// `model` cut after its first `layers` decoder layers: the same weights in those layers, the
/// same embedding, final norm and head, the same GEMM precisions.
pub fn truncated(model: &Model, layers: usize) -> Model {
    let mut c = model.config().clone();
    c.num_layers = layers;
    c.mlp_only_layers.retain(|&l| l < layers);
    let mut t = Model::random(&c, 0).unwrap();
    {
        let mut ps = t.params_mut();
        for p in ps.iter_mut() {
            let src = model.params().by_name(&p.name).unwrap();
            p.data.copy_from_slice(&src.data);
        }
    }
    let precisions: Vec<(String, mxrl_model::LinearPrecision)> = model
        .linear_precisions()
        .into_iter()
        .map(|(n, p)| (n.to_string(), p))
        .collect();
    for (n, p) in precisions {
        if t.params().by_name(&n).is_some() {
            t.set_precision(&n, p).unwrap();
        }
    }
    t
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Generates `new` tokens after every prompt (no stop token, so every row is fed every step)
/// on `make()`'s engine of `model`, recording routes and probes, and checks:
///
/// - tokens, logprobs and routes are those of [`Engine::generate`] and
///   [`Engine::generate_capturing`] (recording probes changes nothing else);
/// - every probe, bitwise: the rows of layer `l` at step `t` (all sequences at once, the row
///   count decode runs), put through the final norm and head ([`Engine::head_logits`]), are
///   exactly the logits that `model` cut after layer `l` ([`truncated`]) computes at that
///   step when fed the same tokens — prefill for `t = 0` (the prompt's last position), then
///   one decode step per token. Up to layer `l` the cut model runs the same kernels on the
///   same shapes, so a probe taken at another position, layer or sequence, or from another
///   point of the layer, gives other logits.
///
/// Returns the recorded generations.
pub fn check_generation_probes<B: Backend>(
    model: &Model,
    make: impl Fn() -> B,
    prompts: &[Vec<u32>],
    new: usize,
    p: &SampleParams,
) -> Vec<Recorded> {
    let c = model.config();
    let (hd, v, layers) = (c.hidden_size, c.vocab_size, c.num_layers);
    let refs: Vec<&[u32]> = prompts.iter().map(|q| q.as_slice()).collect();
    let slots = refs.len();
    let longest = refs.iter().map(|q| q.len()).max().unwrap();
    let max_pos = longest + new;
    let e = Engine::from_model(model, make(), max_pos).unwrap();
    let rec = Record {
        routes: true,
        probes: usize::MAX,
    };
    let got = e.generate_recording(&refs, new, p, &[], rec).unwrap();
    let plain = e.generate(&refs, new, p, &[]).unwrap();
    let routed = e.generate_capturing(&refs, new, p, &[]).unwrap();
    for (s, g) in got.iter().enumerate() {
        assert_eq!(
            g.sampled, plain[s],
            "sequence {s}: tokens or logprobs changed"
        );
        assert_eq!(
            g.routes.as_ref(),
            Some(&routed[s].1),
            "sequence {s}: routes"
        );
        let pr = g.probes.as_ref().expect("probes were recorded");
        assert_eq!(pr.len(), layers * new * hd, "sequence {s}");
        assert_eq!(g.sampled.tokens.len(), new);
    }
    // Probes of the first sequences only: theirs are the same rows, the others have none.
    let first = slots.div_ceil(2);
    let part = e
        .generate_recording(
            &refs,
            new,
            p,
            &[],
            Record {
                routes: false,
                probes: first,
            },
        )
        .unwrap();
    for (s, (g, all)) in part.iter().zip(&got).enumerate() {
        assert_eq!(g.sampled, all.sampled, "sequence {s}");
        if s < first {
            assert_eq!(g.probes, all.probes, "sequence {s}: its probes changed");
        } else {
            assert!(
                g.probes.is_none(),
                "sequence {s} has probes it was not asked for"
            );
        }
    }
    // Without probes asked for, none come back.
    let none = e
        .generate_recording(&refs, new, p, &[], Record::default())
        .unwrap();
    assert!(none
        .iter()
        .all(|g| g.probes.is_none() && g.routes.is_none()));
    for l in 0..layers {
        let cut = Engine::from_model(&truncated(model, l + 1), make(), max_pos).unwrap();
        let (mut st, mut want) = cut.prefill(&refs, max_pos).unwrap();
        for t in 0..new {
            if t > 0 {
                let fed: Vec<u32> = got.iter().map(|g| g.sampled.tokens[t - 1]).collect();
                want = cut.decode_step(&mut st, &fed).unwrap();
            }
            let rows: Vec<f32> = got
                .iter()
                .flat_map(|g| {
                    g.probes.as_ref().unwrap()[(l * new + t) * hd..(l * new + t + 1) * hd]
                        .iter()
                        .copied()
                })
                .collect();
            let from_probe = cut.head_logits(&rows, slots).unwrap();
            assert_eq!(from_probe.len(), slots * v);
            assert_eq!(
                bits(&from_probe),
                bits(&want),
                "layer {l}, step {t}: the probes are not the residual stream there"
            );
        }
    }
    got
}
