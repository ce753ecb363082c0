//! Bytes a training forward keeps for backward ([`mxrl_model::Tape::nbytes`]) per recipe.
//!
//! `cargo run --release -p mxrl-model --example tape_bytes -- [tiny|20m] [batch] [seq_len]`
//!
//! Baselines of the same run: the reference tape ([`Model::forward_recompute_reference`]:
//! f32 inputs of every linear, re-quantized in backward) and the `bf16` recipe.

use mxrl_model::{ForwardOptions, Model, SeqInput};

mod common;
use common::config;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map(String::as_str).unwrap_or("tiny");
    let batch: usize = args.get(2).map(|s| s.parse().expect("batch")).unwrap_or(4);
    let len: usize = args
        .get(3)
        .map(|s| s.parse().expect("seq_len"))
        .unwrap_or(64);
    let c = config(name);
    let base = Model::random(&c, 0).expect("valid config");
    let inv = mxrl_plan::Inventory::from_config_json(&c.to_json(), name).expect("inventory");
    let v = c.vocab_size as u32;
    let seqs: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..len + 1)
                .map(|t| ((b * 131 + t * 17) as u32) % v)
                .collect()
        })
        .collect();
    let inputs: Vec<SeqInput> = seqs.iter().map(|s| SeqInput::next_token(s)).collect();
    println!(
        "config {name}: {} params, batch {batch} × {len} tokens",
        base.params().num_elements()
    );
    let mut baseline = None;
    for preset in [
        "bf16", "mxfp8", "mxfp8-hp", "mxfp8-dq", "nvfp4-hp", "nvfp4-dq",
    ] {
        let plan = mxrl_plan::resolve(&inv, &mxrl_plan::Recipe::load(preset).expect("preset"))
            .expect("plan");
        let mut m = base.clone();
        m.apply_plan(&plan).expect("apply plan");
        let opts = ForwardOptions {
            train: true,
            ..Default::default()
        };
        let tape_bytes =
            |out: mxrl_model::ForwardOutput| out.tape.expect("train forward keeps a tape").nbytes();
        let saved = tape_bytes(m.forward(&inputs, &opts).expect("forward"));
        let reference = tape_bytes(
            m.forward_recompute_reference(&inputs, &opts)
                .expect("forward"),
        );
        let b0 = *baseline.get_or_insert(saved);
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        println!(
            "{preset:>9}: tape {saved:>10} B ({:.2} MiB), reference {reference:>10} B ({:.2} MiB): {:.3}× reference, {:.3}× bf16",
            mib(saved),
            mib(reference),
            saved as f64 / reference as f64,
            saved as f64 / b0 as f64
        );
    }
}
