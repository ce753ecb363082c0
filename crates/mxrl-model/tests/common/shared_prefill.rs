//! One check of the shared prefill ([`Engine::set_shared_prefill`]), written once and run on
//! every backend: the CPU engine in `mxrl-model`'s tests, the GPU engine in `mxrl-cuda`'s
//! (included there by path).

use mxrl_model::engine::{Engine, Record};
use mxrl_model::Model;
use mxrl_tensor::device::Backend;
use mxrl_tensor::sample::SampleParams;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Prompts `prompts` (some repeated) prefilled with the shared prefill must give every slot
/// exactly what the prefill of the distinct prompts alone (no repeats, so nothing shared)
/// gives that slot's prompt — on every backend the same shapes run the same kernels, so
/// bit for bit:
///
/// - the logits of the prompt's last position;
/// - the KV cache of every layer at the prompt's positions, and zeros past them;
/// - the routes recorded at the prompt's positions, and the first probe of every layer;
/// - the prefill runs the distinct prompts' tokens only ([`GenTiming::prefill_tokens`]),
///   every slot's with the shared prefill off.
///
/// A copy from the wrong slot, position or table row fails one of these.
///
/// [`GenTiming::prefill_tokens`]: mxrl_model::engine::GenTiming::prefill_tokens
pub fn check_shared_prefill<B: Backend>(model: &Model, make: impl Fn() -> B, prompts: &[Vec<u32>]) {
    let c = model.config();
    let (v, hd, layers, kk) = (
        c.vocab_size,
        c.hidden_size,
        c.num_layers,
        c.num_experts_per_tok,
    );
    let kvd = c.num_kv_heads * c.head_dim;
    let refs: Vec<&[u32]> = prompts.iter().map(|q| q.as_slice()).collect();
    let mut distinct: Vec<&[u32]> = Vec::new();
    let src: Vec<usize> = refs
        .iter()
        .map(|q| match distinct.iter().position(|d| d == q) {
            Some(i) => i,
            None => {
                distinct.push(q);
                distinct.len() - 1
            }
        })
        .collect();
    assert!(
        distinct.len() < refs.len(),
        "no prompt repeats: nothing to share"
    );
    let longest = refs.iter().map(|q| q.len()).max().unwrap();
    let max_len = longest + 3;
    let e = Engine::from_model(model, make(), max_len).unwrap();

    let (st, logits) = e.prefill(&refs, max_len).unwrap();
    let (sd, logits_d) = e.prefill(&distinct, max_len).unwrap();
    for (s, &d) in src.iter().enumerate() {
        assert_eq!(
            bits(&logits[s * v..(s + 1) * v]),
            bits(&logits_d[d * v..(d + 1) * v]),
            "slot {s}: logits"
        );
    }
    for li in 0..layers {
        let (k, vv) = e.kv_cache(&st, li).unwrap();
        let (kd, vd) = e.kv_cache(&sd, li).unwrap();
        for (s, &d) in src.iter().enumerate() {
            let len = refs[s].len();
            let row = |slot: usize, p: usize| (slot * max_len + p) * kvd;
            for (name, got, want) in [("keys", &k, &kd), ("values", &vv, &vd)] {
                assert_eq!(
                    &got[row(s, 0)..row(s, len)],
                    &want[row(d, 0)..row(d, len)],
                    "layer {li} slot {s}: cached {name}"
                );
                assert!(
                    got[row(s, len)..row(s, max_len)].iter().all(|&b| b == 0),
                    "layer {li} slot {s}: {name} past the prompt"
                );
            }
            assert!(
                k[row(s, 0)..row(s, len)].iter().any(|&b| b != 0),
                "layer {li} slot {s}: an empty cache tests nothing"
            );
        }
    }

    let p = SampleParams::greedy();
    let rec = Record {
        routes: true,
        probes: refs.len(),
    };
    let (got, tg) = e.generate_timed(&refs, 2, &p, &[], rec).unwrap();
    let (want, td) = e.generate_timed(&distinct, 1, &p, &[], rec).unwrap();
    let tokens = |q: &[&[u32]]| q.iter().map(|x| x.len() as u64).sum::<u64>();
    assert_eq!(
        tg.prefill_tokens,
        tokens(&distinct),
        "shared prefill tokens"
    );
    assert_eq!(td.prefill_tokens, tokens(&distinct));
    for (s, &d) in src.iter().enumerate() {
        let len = refs[s].len();
        let (gr, wr) = (
            got[s].routes.as_ref().unwrap(),
            want[d].routes.as_ref().unwrap(),
        );
        assert_eq!(gr.layers.len(), wr.layers.len());
        for (l, (a, b)) in gr.layers.iter().zip(&wr.layers).enumerate() {
            assert_eq!(
                a.ids[..len * kk],
                b.ids[..len * kk],
                "slot {s} MoE layer {l}: ids"
            );
            assert_eq!(
                bits(&a.weights[..len * kk]),
                bits(&b.weights[..len * kk]),
                "slot {s} MoE layer {l}: weights"
            );
        }
        // [L, R, H]: R = 2 here, 1 for the distinct prompts.
        let (gp, wp) = (
            got[s].probes.as_ref().unwrap(),
            want[d].probes.as_ref().unwrap(),
        );
        for l in 0..layers {
            assert_eq!(
                bits(&gp[l * 2 * hd..][..hd]),
                bits(&wp[l * hd..][..hd]),
                "slot {s} layer {l}: first probe"
            );
        }
    }
    let mut apart = Engine::from_model(model, make(), max_len).unwrap();
    apart.set_shared_prefill(false);
    let (_, ta) = apart.generate_timed(&refs, 1, &p, &[], rec).unwrap();
    assert_eq!(ta.prefill_tokens, tokens(&refs), "prefill per slot");
}
