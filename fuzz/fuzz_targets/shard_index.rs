//! Fuzz the sharded-index parser: it must never panic, and every accepted shard name must be
//! a plain file name (no path separators, no `..`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(idx) = mxrl_ckpt::parse_index("fuzz", data) {
        for f in idx.weight_map.values() {
            assert!(!f.contains('/') && !f.contains('\\') && f != "..");
            assert!(f.ends_with(".safetensors"));
        }
    }
});
