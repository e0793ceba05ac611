//! candle-flash-attn 0.11.1's whole public API is here with the same types: every function
//! assigned to a `fn` pointer of candle-flash-attn's signature, both structs built from exactly
//! their fields (a missing or extra field does not compile), both ops `CustomOp3`; and the
//! signatures as text against `tests/fixtures/candle-flash-attn-0.11.1-api.txt`, an extract of the
//! published source, which is itself checked against that source when cargo's registry cache has
//! it (no network needed).

use candle_core::{CustomOp3, Result, Tensor};
use candle_flash_attn::*;

type Attn = fn(&Tensor, &Tensor, &Tensor, f32, bool) -> Result<Tensor>;
type Windowed = fn(&Tensor, &Tensor, &Tensor, f32, Option<usize>, Option<usize>) -> Result<Tensor>;
type Alibi = fn(&Tensor, &Tensor, &Tensor, &Tensor, f32, bool) -> Result<Tensor>;
type AlibiWindowed = fn(&Tensor, &Tensor, &Tensor, &Tensor, f32, Option<usize>, Option<usize>) -> Result<Tensor>;
type AlibiWindowedSoftcap =
    fn(&Tensor, &Tensor, &Tensor, Option<&Tensor>, f32, Option<usize>, Option<usize>, f32) -> Result<Tensor>;
type Varlen = fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, usize, usize, f32, bool) -> Result<Tensor>;
type VarlenWindowed =
    fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, usize, usize, f32, Option<usize>, Option<usize>) -> Result<Tensor>;
type VarlenPagedWindowed = fn(
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    Option<&Tensor>,
    usize,
    usize,
    f32,
    Option<usize>,
    Option<usize>,
    usize,
    Option<f32>,
) -> Result<Tensor>;
type VarlenAlibi = fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, &Tensor, usize, usize, f32, bool) -> Result<Tensor>;
type VarlenAlibiWindowed = fn(
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    &Tensor,
    usize,
    usize,
    f32,
    Option<usize>,
    Option<usize>,
) -> Result<Tensor>;
type VarlenAlibiWindowedSoftcap = fn(
    &Tensor,
    &Tensor,
    &Tensor,
    Option<&Tensor>,
    &Tensor,
    &Tensor,
    usize,
    usize,
    f32,
    Option<usize>,
    Option<usize>,
    f32,
) -> Result<Tensor>;

#[test]
fn every_function_has_candle_flash_attns_signature() {
    let _: Attn = flash_attn;
    let _: Windowed = flash_attn_windowed;
    let _: Alibi = flash_attn_alibi;
    let _: AlibiWindowed = flash_attn_alibi_windowed;
    let _: AlibiWindowedSoftcap = flash_attn_alibi_windowed_softcap;
    let _: Varlen = flash_attn_varlen;
    let _: VarlenWindowed = flash_attn_varlen_windowed;
    let _: VarlenPagedWindowed = flash_attn_varlen_paged_windowed;
    let _: VarlenAlibi = flash_attn_varlen_alibi;
    let _: VarlenAlibiWindowed = flash_attn_varlen_alibi_windowed;
    let _: VarlenAlibiWindowedSoftcap = flash_attn_varlen_alibi_windowed_softcap;
}

fn custom_op3<T: CustomOp3>(_: &T) {}

#[test]
fn both_ops_have_exactly_candle_flash_attns_fields() -> Result<()> {
    let t = Tensor::zeros(2, candle_core::DType::U32, &candle_core::Device::Cpu)?;
    let op = FlashAttn {
        softmax_scale: 1.0,
        alibi_slopes: None::<Tensor>,
        window_size_left: None::<usize>,
        window_size_right: Some(0usize),
        softcap: None::<f32>,
    };
    custom_op3(&op);
    let op = FlashAttnVarLen {
        softmax_scale: 1.0f32,
        max_seqlen_q: 1usize,
        max_seqlen_k: 1usize,
        seqlens_q: t.clone(),
        seqlens_k: t.clone(),
        block_table: Some(t.clone()),
        mm_prefix_ranges: None::<Tensor>,
        page_block_size: Some(16usize),
        alibi_slopes: None::<Tensor>,
        window_size_left: None::<usize>,
        window_size_right: None::<usize>,
        softcap: None::<f32>,
    };
    custom_op3(&op);
    Ok(())
}

/// Each `pub fn`'s signature and each struct's `pub` fields, whitespace removed (the fixture's
/// format; a trailing comma before `)` dropped, as rustfmt adds it to long lists).
fn extract(text: &str) -> Vec<String> {
    let squeeze = |s: &str| s.split_whitespace().collect::<String>().replace(",)", ")");
    let mut out = Vec::new();
    for (i, _) in text.match_indices("pub fn ") {
        let end = i + text[i..].find('{').expect("a body after the signature");
        out.push(format!("fn {}", squeeze(&text[i + 4..end])));
    }
    for (i, _) in text.match_indices("struct ") {
        let rest = &text[i + "struct ".len()..];
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let after = rest[name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue;
        }
        let body = &after[1..after.find('}').expect("a closing brace")];
        for line in body.lines().map(str::trim).filter(|l| l.starts_with("pub ")) {
            out.push(format!("field {name} {}", squeeze(&line[4..]).trim_end_matches(',')));
        }
    }
    out.sort();
    out
}

fn fixture() -> Vec<String> {
    let text = include_str!("fixtures/candle-flash-attn-0.11.1-api.txt");
    text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).map(String::from).collect()
}

#[test]
fn signatures_as_text_equal_the_published_ones() {
    let ours = extract(include_str!("../src/lib.rs"));
    let theirs = fixture();
    assert_eq!(theirs.len(), 28, "11 functions and 17 fields");
    assert_eq!(ours, theirs, "this crate's public items differ from candle-flash-attn 0.11.1's");
}

/// The fixture against candle-flash-attn 0.11.1's own source in cargo's registry cache, when a
/// build on this machine has downloaded it (`cargo info candle-flash-attn@0.11.1` does).
#[test]
fn fixture_equals_the_published_source_when_cached() {
    let home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo")));
    let found = home.and_then(|h| std::fs::read_dir(h.join("registry/src")).ok()).and_then(|dirs| {
        dirs.flatten().map(|d| d.path().join("candle-flash-attn-0.11.1/src/lib.rs")).find(|p| p.is_file())
    });
    let Some(path) = found else {
        eprintln!("note: candle-flash-attn 0.11.1's source is not in cargo's registry cache; checked against the fixture only");
        return;
    };
    let published = extract(&std::fs::read_to_string(&path).expect("readable source"));
    assert_eq!(published, fixture(), "the fixture no longer matches {}", path.display());
}
