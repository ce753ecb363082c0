//! Contracts of the CPU backend's ops that the engine relies on (the reference every device
//! backend is checked against).

use mxrl_tensor::device::{Backend, CpuBackend, RouteBufs};
use mxrl_tensor::gradcheck::test_values;
use mxrl_tensor::moe::combine_backward;
use mxrl_tensor::routing::Routes;

/// `combine_backward` overwrites `dweights` (the device kernels do; the engine passes a buffer
/// with unspecified contents): a NaN-filled buffer and a zeroed one give the same bits, which
/// are the per-expert reference accumulated into zeros.
#[test]
fn combine_backward_overwrites_dweights() {
    let b = CpuBackend;
    let (n, e, k, h) = (5usize, 4usize, 2usize, 6usize);
    let logits = test_values(n * e, 1, 2.0);
    let mut route = RouteBufs::<CpuBackend> {
        ids: vec![],
        weights: vec![],
        probs: vec![],
        offsets: vec![],
        perm: vec![],
        row_of: vec![],
    };
    b.route(&logits, n, e, k, true, None, &mut route).unwrap();
    let dout = test_values(n * h, 2, 1.0);
    let y = test_values(n * k * h, 3, 1.0);
    let run = |fill: f32| {
        let (mut dy, mut dw) = (vec![fill; n * k * h], vec![fill; n * k]);
        b.combine_backward(&dout, &y, &route, n, e, k, h, &mut dy, &mut dw)
            .unwrap();
        (dy, dw)
    };
    let (dy_nan, dw_nan) = run(f32::NAN);
    let (dy_zero, dw_zero) = run(0.0);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&dw_nan), bits(&dw_zero));
    assert_eq!(bits(&dy_nan), bits(&dy_zero));
    // The reference, expert by expert into zeros.
    let routes = Routes {
        top_k: k,
        ids: route.ids.clone(),
        weights: route.weights.clone(),
    };
    let mut want = vec![0.0f32; n * k];
    for x in 0..e {
        let (a, c) = (route.offsets[x] as usize, route.offsets[x + 1] as usize);
        let rows: Vec<(u32, u32)> = route.perm[a..c]
            .iter()
            .map(|&ts| (ts / k as u32, ts % k as u32))
            .collect();
        combine_backward(&dout, &y[a * h..c * h], h, &rows, &routes, &mut want);
    }
    assert_eq!(bits(&dw_nan), bits(&want));
}

/// `grouped_qlinear_backward` takes `x` and `dy` already rounded to BF16 where the mode
/// multiplies only their BF16 values, with the bits of the f32 inputs, and refuses them, naming
/// the weight and the mode, where the mode quantizes the f32 values (`x`: every mode but
/// `high_precision`; `dy`: `lowp`); a kept forward operand is refused in every mode (the CPU
/// backend keeps none).
#[test]
fn grouped_qlinear_backward_takes_bf16_inputs_only_where_the_mode_rounds_them() {
    use mxrl_formats::Format;
    use mxrl_tensor::device::{GradWrite, OutGrad, SavedX};
    use mxrl_tensor::qlinear::{BackwardMode, LinearSpec};
    let b = CpuBackend;
    let (groups, n, k, rows) = (2usize, 32usize, 64usize, 10usize);
    let offsets = [0u32, 4, 10];
    let master = test_values(groups * n * k, 11, 1.0);
    let x = test_values(rows * k, 12, 2.0);
    let dy = test_values(rows * n, 13, 0.5);
    let round = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|&a| half::bf16::from_f32(a).to_f32())
            .collect()
    };
    let (xb, dyb) = (round(&x), round(&dy));
    let bits = |v: &[f32]| v.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
    for (format, mode) in [
        (Format::Mxfp8, BackwardMode::HighPrecision),
        (Format::Mxfp8, BackwardMode::Dequantized),
        (Format::Mxfp8, BackwardMode::Lowp),
        (Format::Nvfp4, BackwardMode::HighPrecision),
        (Format::Nvfp4, BackwardMode::Dequantized),
    ] {
        let spec = LinearSpec::new(format, mode).unwrap();
        let name = |g: usize| format!("w{g}");
        let w = b
            .quantize_weights(&master, groups, n, k, spec, &name, 0)
            .unwrap();
        let run = |x: SavedX<'_, Vec<f32>, Vec<f32>>, dy: OutGrad<'_, Vec<f32>, Vec<f32>>| {
            let (mut dx, mut dw) = (vec![0f32; rows * k], vec![0f32; groups * n * k]);
            b.grouped_qlinear_backward(
                x,
                &w,
                &master,
                None,
                dy,
                None,
                &offsets,
                rows,
                k,
                n,
                &mut dx,
                &mut dw,
                GradWrite::Overwrite,
            )
            .map(|()| (bits(&dx), bits(&dw)))
            .map_err(|e| e.to_string())
        };
        let want = run(SavedX::F32(&x), OutGrad::F32(&dy)).unwrap();
        let with_x = run(SavedX::Bf16(&xb), OutGrad::F32(&dy));
        match mode {
            BackwardMode::HighPrecision => assert_eq!(with_x.unwrap(), want, "{spec}: BF16 x"),
            _ => {
                let e = with_x.unwrap_err();
                assert!(
                    e.contains("w0") && e.contains("takes x in f32"),
                    "{spec}: {e}"
                );
            }
        }
        // The CPU backend keeps no forward operand: refused in every mode.
        assert!(!b.keeps_forward_operand(&spec, k), "{spec}");
        let e = run(SavedX::Operand(&xb), OutGrad::F32(&dy)).unwrap_err();
        assert!(e.contains("keeps no forward operand"), "{spec}: {e}");
        let with_dy = run(SavedX::F32(&x), OutGrad::Bf16(&dyb));
        match mode {
            BackwardMode::Lowp => {
                let e = with_dy.unwrap_err();
                assert!(
                    e.contains("w0") && e.contains("takes dy in f32"),
                    "{spec}: {e}"
                );
            }
            _ => assert_eq!(with_dy.unwrap(), want, "{spec}: BF16 dy"),
        }
    }
}
