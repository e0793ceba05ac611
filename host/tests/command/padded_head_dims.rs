//! Head dims without a kernel of their own (multiples of 8 up to 256: candle-transformers' 40, 80
//! and 160, and 120, 200) through the binary: the forward in every dtype, the decode and the
//! backward, each verified against the f64 reference, on the next compiled kernel.

use crate::common::*;

/// The kernel names of a run's launches.
fn kernels(v: &serde_json::Value) -> Vec<String> {
    v["launches"].as_array().unwrap().iter().map(|l| l["kernel"].as_str().unwrap().to_string()).collect()
}

#[test]
fn forward_at_padded_head_dims_verifies_in_every_dtype() {
    for (d, kernel_d) in [("40", 64), ("80", 96), ("120", 128), ("160", 192), ("200", 256)] {
        for dtype in ["f32", "bf16", "f16"] {
            let args = [
                "--backend",
                "vm",
                "--json",
                "run",
                "--dtype",
                dtype,
                "--head-dim",
                d,
                "--heads",
                "2",
                "--heads-kv",
                "1",
                "--seq-q",
                "21",
                "--seq-kv",
                "13",
                "--causal",
            ];
            let o = memattn(&args);
            assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
            let v = json(&o);
            assert_eq!(v["verified"], true, "{args:?}: {v}");
            assert_eq!(v["shape"]["head_dim"].as_u64(), Some(d.parse().unwrap()), "{v}");
            assert_eq!(kernels(&v), [format!("flash_fwd_{dtype}_d{kernel_d}")], "{args:?}");
            // Nothing is copied: the device memory is the tensors at their own head dim.
            assert_eq!(v["peak_device_bytes"], v["analytic_bytes"]["total"], "{args:?}");
        }
    }
}

#[test]
fn decode_at_padded_head_dims_verifies() {
    for (d, dtype, kernel) in [
        ("40", "bf16", "decode_mma_bf16_d64"),
        ("80", "f32", "decode_fwd_f32_d96"),
        ("120", "f16", "decode_mma_f16_d128"),
        ("160", "bf16", "decode_fwd_bf16_d192"),
        ("200", "f16", "decode_fwd_f16_d256"),
    ] {
        let args = [
            "--backend",
            "vm",
            "--json",
            "decode",
            "--dtype",
            dtype,
            "--head-dim",
            d,
            "--batch",
            "2",
            "--heads",
            "4",
            "--heads-kv",
            "2",
            "--cache-len",
            "37,20",
            "--new-tokens",
            "2",
            "--page-size",
            "16",
            "--splits",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "0",
        ];
        let o = memattn(&args);
        assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
        let v = json(&o);
        assert_eq!(v["verified"], true, "{args:?}: {v}");
        assert_eq!(v["verification"]["cache_ok"], true, "{args:?}");
        assert!(kernels(&v).iter().any(|k| k == kernel), "{args:?}: {:?}", kernels(&v));
    }
}

#[test]
fn backward_at_padded_head_dims_verifies() {
    for (d, dtype, main) in [
        ("40", "f32", "flash_bwd_f32_d64"),
        ("80", "bf16", "flash_bwd_bf16_d128"),
        ("120", "f16", "flash_bwd_f16_d128"),
        ("160", "f32", "flash_bwd_f32_d192"),
        ("200", "f32", "flash_bwd_f32_d256"),
    ] {
        let args = [
            "--backend",
            "vm",
            "--json",
            "run",
            "--backward",
            "--dtype",
            dtype,
            "--head-dim",
            d,
            "--heads",
            "2",
            "--heads-kv",
            "1",
            "--seq-q",
            "19",
            "--seq-kv",
            "24",
            "--causal",
        ];
        let o = memattn(&args);
        assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
        let v = json(&o);
        assert_eq!(v["verified"], true, "{args:?}: {v}");
        assert!(kernels(&v).iter().any(|k| k == main), "{args:?}: {:?}", kernels(&v));
        assert_eq!(v["memory_as_expected"], true, "{args:?}");
    }
    // bf16/f16 have no backward kernel past 128: refused naming the rule.
    let o = memattn(&["--backend", "vm", "run", "--backward", "--dtype", "bf16", "--head-dim", "160"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("compiled for head_dim 32, 64 and 128"), "{}", stderr(&o));
}
