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
