//! Contract version and the stable hash of its parameters (contract §5).

use crate::element::{ElementRule, E2M1_MAX, E4M3_MAX, E5M2_MAX};
use crate::layout::swizzle_offset;
use crate::scheme::{ScaleRule, ALL_SCHEMES, R2688, R448, R6};
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// Version of the quantizer contract this crate implements (`quant-contract.md` v1).
pub const CONTRACT_VERSION: u32 = 1;

/// Safetensors metadata key carrying [`CONTRACT_VERSION`] (as a decimal string).
pub const META_CONTRACT_VERSION: &str = "mxrl.contract_version";
/// Safetensors metadata key carrying [`contract_hash`].
pub const META_CONTRACT_HASH: &str = "mxrl.contract_hash";

/// The canonical text of every contract parameter: version, element rules, scale rules,
/// schemes with their block shapes, constants (as f32 bit patterns), edge rules and the
/// swizzle formula (sampled). [`contract_hash`] is the SHA-256 of this text. Any change to a
/// rule, constant or layout must change this text (and bump [`CONTRACT_VERSION`]).
pub fn contract_params() -> String {
    let mut s = String::new();
    s.push_str(&format!("mxrl-quant-contract v{CONTRACT_VERSION}\n"));
    s.push_str("arith: ieee-binary32 rne, no-ftz, no-fma-contraction; bf16/f16 widened exactly\n");
    s.push_str("amax: max|x| ignoring NaN, start +0\n");
    for r in ElementRule::ALL {
        s.push_str(&format!("element {}\n", r.name()));
    }
    for r in ScaleRule::ALL {
        s.push_str(&format!("scale {}\n", r.name()));
    }
    for sc in ALL_SCHEMES {
        let [br, bc] = sc.scale_block();
        let [tr, tc] = sc.amax_tile();
        s.push_str(&format!(
            "scheme {} format={} usage={} scale_block={br}x{bc} amax_tile={tr}x{tc} rule={}\n",
            sc.name(),
            sc.format(),
            sc.usage().name(),
            sc.scale_rule().name()
        ));
    }
    for (name, v) in [
        ("R448", R448),
        ("R6", R6),
        ("R2688", R2688),
        ("E4M3_MAX", E4M3_MAX),
        ("E5M2_MAX", E5M2_MAX),
        ("E2M1_MAX", E2M1_MAX),
        ("NVFP4_NUMERATOR", 2688.0f32),
    ] {
        s.push_str(&format!("const {name}=0x{:08X}\n", v.to_bits()));
    }
    s.push_str("edge e4m3: nan->0x7F, |x|>=464|inf->0x7E|sign, |x|<=2^-10->sign|0\n");
    s.push_str("edge e5m2: nan->0x7F, |x|>=61440|inf->0x7B|sign\n");
    s.push_str("edge e2m1: nan->0x7, inf->0x7|sign\n");
    s.push_str("edge ue8m0: nan->0xFF, inf->0xFE, decode(0)=0x00400000, recip(254)=0x00400000\n");
    s.push_str("edge nvfp4: S=min(fl(2688/amax),MAX); amax==0|S==0 -> S=1; enc=min(fl(1/fl(sf*Sdec)),MAX)\n");
    s.push_str("edge fp8_block: amax==0|inf -> scale=1; inf scale -> MAX\n");
    s.push_str("dequant mxfp8: fl(ue8m0(s)*e4m3(q)); nvfp4: fl(e2m1(c)*fl(fl(sf*amax)*R2688)); fp8_block: fl(e4m3(q)*scale_inv)\n");
    s.push_str("pack e2m1: element 2i low nibble, 2i+1 high nibble\n");
    s.push_str(
        "layout compact: row-major [rows, K/block]; mxfp8 col scales [M/32, K], data [M, K]\n",
    );
    s.push_str("layout swizzle128x4:");
    for (r, c) in [(0, 0), (1, 0), (32, 0), (0, 1), (0, 4), (127, 3), (130, 5)] {
        s.push_str(&format!(" ({r},{c})->{}", swizzle_offset(r, c, 8)));
    }
    s.push('\n');
    s
}

/// Short stable hash of [`contract_params`]: the first 16 hex digits of its SHA-256.
/// Quantized checkpoints and weight-update messages carry it; consumers refuse a mismatch.
pub fn contract_hash() -> &'static str {
    static HASH: OnceLock<String> = OnceLock::new();
    HASH.get_or_init(|| {
        let digest = Sha256::digest(contract_params().as_bytes());
        digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
    })
}
