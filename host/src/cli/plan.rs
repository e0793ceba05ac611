//! `memattn plan`: the memory budget of an inference workload before anything runs, and
//! `--verify`: the attention part of one layer, scaled down, run in the VM against the same model.

use super::args::{Cli, PlanArgs};
use super::{device_options, evidence, print_json};
use kernels_gpu::variants::{Elem, KernelId};
use memattn_cli::charts;
use memattn_cli::device::{self, BackendChoice};
use memattn_cli::error::{exit, Error};
use memattn_cli::memory::AnalyticBytes;
use memattn_cli::plan::{
    best_change, bytes_label, changes, check_layers, cp_terms, largest_batch, layer_attention, longest_context,
    smallest_cp, terms, Model, StoreType, Terms, Workload,
};
use memattn_cli::problem::KernelKind;
use memattn_cli::report::{human_bytes, table};
use memattn_cli::runner::RunSpec;

/// Largest `--config` read (a Hugging Face config is a few KiB).
const MAX_CONFIG_BYTES: u64 = 16 << 20;

fn usage(s: impl Into<String>) -> Error {
    Error::Usage(s.into())
}

/// The model from `--config` and/or the flags (flags override the config).
pub fn model(a: &PlanArgs) -> Result<(Model, String), Error> {
    let (mut m, origin) = match &a.config {
        Some(path) => {
            let bytes = memattn_cli::files::read_regular(path, MAX_CONFIG_BYTES, "config")?;
            let text = String::from_utf8(bytes)
                .map_err(|e| usage(format!("cannot read config {}: not UTF-8 text: {e}", path.display())))?;
            let origin = path.display().to_string();
            (Model::from_config(&text, &origin).map_err(usage)?, origin)
        }
        None => {
            let need =
                |v: Option<u32>, flag: &str| v.ok_or_else(|| usage(format!("{flag} is needed (or --config FILE)")));
            let layers = need(a.layers, "--layers")?;
            check_layers(layers).map_err(|e| usage(format!("--layers: {e}")))?;
            let heads = need(a.heads, "--heads")?;
            let head_dim = need(a.head_dim, "--head-dim")?;
            let given = [a.hidden.is_some(), a.intermediate.is_some(), a.vocab.is_some()];
            if given.iter().any(|g| *g) && !given.iter().all(|g| *g) {
                let missing: Vec<&str> = ["--hidden", "--intermediate", "--vocab"]
                    .into_iter()
                    .zip(given)
                    .filter(|(_, g)| !g)
                    .map(|(n, _)| n)
                    .collect();
                return Err(usage(format!(
                    "weights need --hidden, --intermediate and --vocab together; missing {}",
                    missing.join(", ")
                )));
            }
            let mut notes = Vec::new();
            if !given[0] {
                notes.push(
                    "weights and activations not counted: give --hidden, --intermediate and --vocab (or --config)"
                        .into(),
                );
            }
            let m = Model {
                model_type: "flags".into(),
                layers,
                heads,
                heads_kv: a.heads_kv.unwrap_or(heads),
                head_dim,
                hidden: a.hidden.unwrap_or(0),
                intermediate: a.intermediate.unwrap_or(0),
                vocab: a.vocab.unwrap_or(0),
                tied_embeddings: a.tied_embeddings,
                qkv_bias: false,
                norms_per_layer: 2,
                windows: vec![a.sliding_window; layers as usize],
                max_position_embeddings: None,
                torch_dtype: None,
                notes,
            };
            (m, "flags".to_string())
        }
    };
    if a.config.is_some() {
        if let Some(l) = a.layers {
            check_layers(l).map_err(|e| usage(format!("--layers: {e}")))?;
            let old = m.windows.clone();
            m.windows = (0..l as usize).map(|i| if old.is_empty() { None } else { old[i % old.len()] }).collect();
            m.layers = l;
        }
        m.heads = a.heads.unwrap_or(m.heads);
        m.heads_kv = a.heads_kv.unwrap_or(m.heads_kv);
        m.head_dim = a.head_dim.unwrap_or(m.head_dim);
        m.hidden = a.hidden.unwrap_or(m.hidden);
        m.intermediate = a.intermediate.unwrap_or(m.intermediate);
        m.vocab = a.vocab.unwrap_or(m.vocab);
        if let Some(w) = a.sliding_window {
            m.windows = vec![Some(w); m.layers as usize];
        }
        if a.tied_embeddings {
            m.tied_embeddings = true;
        }
    }
    m.validate().map_err(|e| usage(format!("{origin}: {e}")))?;
    Ok((m, origin))
}

fn store_type(s: &Option<String>, flag: &str) -> Result<Option<StoreType>, Error> {
    match s {
        None => Ok(None),
        Some(v) => StoreType::parse(v)
            .map(Some)
            .ok_or_else(|| usage(format!("{flag}: unknown type `{v}` (known: f32, bf16, f16, fp8)"))),
    }
}

pub fn workload(a: &PlanArgs, m: &Model) -> Result<(Workload, Vec<String>), Error> {
    let mut notes = Vec::new();
    let dtype = match store_type(&a.dtype, "--dtype")? {
        Some(d) => d,
        None => match m.torch_dtype {
            Some(d) => d,
            None => {
                notes.push("dtype bf16 (no --dtype and no torch_dtype in the config)".into());
                StoreType::Bf16
            }
        },
    };
    let w = Workload {
        batch: a.batch,
        context: a.context,
        new_tokens: a.new_tokens,
        dtype,
        kv_dtype: store_type(&a.kv_dtype, "--kv-dtype")?.unwrap_or(dtype),
        kernel: a.kernel.unwrap_or(KernelKind::Flash),
        page: a.page,
    };
    if a.page == Some(0) {
        return Err(usage("--page must be at least 1 token (got 0)"));
    }
    w.validate().map_err(usage)?;
    if let Some(max) = m.max_position_embeddings {
        if w.context as u64 > max {
            notes.push(format!(
                "warning: --context {} is beyond max_position_embeddings {max}; it needs RoPE scaling (planned anyway)",
                w.context
            ));
        }
    }
    Ok((w, notes))
}

/// The memory limit: `--vram` or the free memory of the device this command would use.
fn limit(cli: &Cli, a: &PlanArgs) -> Result<(u64, String), Error> {
    if let Some(v) = &a.vram {
        let b = memattn_cli::plan::parse_size(v).map_err(|e| usage(format!("--vram: {e}")))?;
        return Ok((b, format!("--vram {v}")));
    }
    let opened = device::open(&device_options(cli)?)?;
    let mut dev = opened.device;
    let caps = dev.caps()?;
    Ok((caps.free_memory_bytes, format!("free memory of {} - {} ({})", dev.backend(), dev.name(), opened.reason)))
}

fn share(part: u64, total: u64) -> String {
    if total == 0 || total == u64::MAX {
        return "-".into();
    }
    let p = 100.0 * part as f64 / total as f64;
    if p > 0.0 && p < 0.01 {
        "< 0.01%".into()
    } else {
        format!("{p:.2}%")
    }
}

/// The dominant term of a plan.
fn dominant(t: &Terms) -> (&'static str, u64) {
    [
        ("weights", t.weights),
        ("KV cache", t.kv_cache),
        ("attention workspace", t.workspace.total),
        ("largest activation", t.activation.bytes),
    ]
    .into_iter()
    .max_by_key(|x| x.1)
    .unwrap_or(("weights", 0))
}

fn describe_model(m: &Model) -> String {
    let windows = match m.windowed_layers() {
        0 => "full attention on every layer".to_string(),
        n => {
            let sizes: std::collections::BTreeSet<u32> = m.windows.iter().flatten().copied().collect();
            let sizes: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
            format!("{n} of {} layers with a {}-token sliding window", m.layers, sizes.join("/"))
        }
    };
    format!(
        "{} layers, {} heads / {} KV heads, head_dim {}, hidden {}, intermediate {}, vocab {}, {} embeddings, {windows}",
        m.layers,
        m.heads,
        m.heads_kv,
        m.head_dim,
        m.hidden,
        m.intermediate,
        m.vocab,
        if m.tied_embeddings { "tied" } else { "untied" }
    )
}

pub fn plan(cli: &Cli, a: &PlanArgs) -> Result<i32, Error> {
    let (m, origin) = model(a)?;
    let (w, mut notes) = workload(a, &m)?;
    notes.extend(m.notes.iter().cloned());
    let (limit, limit_source) = limit(cli, a)?;
    let naive = terms(&m, &Workload { kernel: KernelKind::Naive, ..w });
    let flash = terms(&m, &Workload { kernel: KernelKind::Flash, ..w });
    let chosen = if w.kernel == KernelKind::Naive { &naive } else { &flash };
    let (dom_name, dom_bytes) = dominant(chosen);
    let fits = chosen.total <= limit;
    let batch_max = largest_batch(&m, &w, limit);
    let context_max = longest_context(&m, &w, limit);
    let options = changes(&m, &w, limit);
    let best = best_change(&options).cloned();
    let fp8_run = best.as_ref().filter(|b| b.option == "kv-dtype" && b.flag.contains("fp8")).map(|_| fp8_decode(&m));
    evidence::expect(serde_json::json!({
        "plan_total_bytes": chosen.total, "limit_bytes": limit, "fits": fits, "kernel": w.kernel,
    }));

    let verify = if a.verify { Some(verify(cli, &m, &w)?) } else { None };
    let mut plot_path = None;
    if let Some(path) = &a.plot {
        charts::plan_chart(path, &m, &w, limit, &format!("{} ({origin})", m.model_type))?;
        plot_path = Some(path.display().to_string());
    }

    let refusal = if batch_max.is_none() {
        Some(format!(
            "does not fit at batch 1: the {} alone needs {} ({} bytes) at batch {}, and batch 1 needs {} ({} bytes), over the limit of {} ({} bytes, {limit_source})",
            dom_name,
            bytes_label(dom_bytes),
            dom_bytes,
            w.batch,
            bytes_label(terms(&m, &Workload { batch: 1, ..w }).total),
            terms(&m, &Workload { batch: 1, ..w }).total,
            human_bytes(limit),
            limit
        ))
    } else {
        None
    };
    let verified = verify.as_ref().is_none_or(|v| v.1);
    // --cp: the question is per device.
    const MAX_CP: u32 = 4096;
    let cp = match a.cp {
        Some(0) => return Err(Error::Usage("--cp must be at least 1 device".into())),
        Some(n) if n > MAX_CP => return Err(Error::Usage(format!("--cp must be at most {MAX_CP} devices (got {n})"))),
        Some(n) => Some((
            cp_terms(&m, &Workload { kernel: KernelKind::Flash, ..w }, n),
            smallest_cp(&m, &Workload { kernel: KernelKind::Flash, ..w }, limit, MAX_CP),
        )),
        None => None,
    };
    let refusal = match &cp {
        Some((t, smallest)) if t.total > limit => Some(format!(
            "does not fit on {} devices: {} ({} bytes) per device over the limit of {} ({} bytes, {limit_source}); {}",
            t.devices,
            bytes_label(t.total),
            t.total,
            human_bytes(limit),
            limit,
            match smallest {
                Some(s) => format!("the smallest context-parallel group that fits is {s} devices"),
                None => format!("no group of up to {MAX_CP} devices fits (every device holds all the weights)"),
            }
        )),
        Some(_) => None,
        None => refusal,
    };
    let code = if refusal.is_some() {
        exit::BAD_INPUT
    } else if !verified {
        exit::VERIFICATION_FAILED
    } else {
        exit::SUCCESS
    };
    let v = serde_json::json!({
        "command": "plan",
        "model": m,
        "source": origin,
        "workload": w,
        "limit_bytes": limit,
        "limit_source": limit_source,
        "naive": naive,
        "flash": flash,
        "dominant": {"term": dom_name, "bytes": dom_bytes},
        "fits": fits,
        "largest_batch": batch_max,
        "longest_context": context_max,
        "changes": options,
        "best_change": best,
        "fp8_decode": fp8_run.as_ref().map(|(cmd, per)| serde_json::json!({"command": cmd, "kv_bytes_per_token_per_layer": per})),
        "verify": verify.as_ref().map(|v| &v.0),
        "cp": cp.as_ref().map(|(t, smallest)| serde_json::json!({"per_device": t, "fits": t.total <= limit, "smallest_devices": smallest})),
        "plot": plot_path,
        "notes": notes,
        "error": refusal,
        "exit_code": code,
    });
    super::save_evidence(cli, &v)?;
    if let Some(r) = &refusal {
        evidence::message(r);
        eprintln!("error: {r}");
    }
    if cli.json {
        print_json(&v);
        return Ok(code);
    }
    println!("model     {} ({origin}): {}", m.model_type, describe_model(&m));
    println!(
        "workload  batch {}, context {}, new tokens {}{}, weights {}, KV cache {}, kernel {}{}",
        w.batch,
        w.context,
        w.new_tokens,
        if w.new_tokens == 1 { " (one decode step)" } else { "" },
        w.dtype,
        w.kv_dtype,
        w.kernel,
        w.page.map(|p| format!(", paged KV cache ({p}-token pages)")).unwrap_or_default()
    );
    println!("limit     {} ({limit_source})", human_bytes(limit));
    for n in &notes {
        println!("note      {n}");
    }
    println!();
    let header: Vec<String> =
        ["term", "naive", "flash", &format!("share ({})", w.kernel)].iter().map(|s| s.to_string()).collect();
    let row = |name: String, n: String, f: String, s: String| vec![name, n, f, s];
    let both = |name: String, n: u64, f: u64| {
        row(
            name,
            bytes_label(n),
            bytes_label(f),
            share(if w.kernel == KernelKind::Naive { n } else { f }, chosen.total),
        )
    };
    let keys = flash.workspace.keys;
    let rows = vec![
        both(format!("weights ({} params x {} B)", group(flash.params), w.dtype.bytes()), naive.weights, flash.weights),
        both(format!("KV cache ({} sequences)", w.batch), naive.kv_cache, flash.kv_cache),
        row(
            format!(
                "  per token ({} layers x 2 x {} KV heads x {} x {} B)",
                m.layers,
                m.heads_kv,
                m.head_dim,
                w.kv_dtype.bytes()
            ),
            String::new(),
            bytes_label(flash.kv_per_token),
            String::new(),
        ),
        row(
            format!(
                "  per sequence ({} tokens{})",
                w.context,
                if m.windowed_layers() > 0 { ", windowed layers capped" } else { "" }
            ),
            String::new(),
            bytes_label(flash.kv_per_sequence),
            String::new(),
        ),
        both("attention workspace (one layer)".into(), naive.workspace.total, flash.workspace.total),
        row(
            format!("  S f32 [{}, {}, {}, {keys}]", w.batch, m.heads, w.new_tokens),
            bytes_label(naive.workspace.scores),
            "-".into(),
            String::new(),
        ),
        row(
            format!("  LSE f32 [{}, {}, {}]", w.batch, m.heads, w.new_tokens),
            bytes_label(naive.workspace.lse),
            bytes_label(flash.workspace.lse),
            String::new(),
        ),
        row("  split-KV partials".into(), "-".into(), "0 B (no split-KV)".into(), String::new()),
        both(format!("largest activation: {}", flash.activation.name), naive.activation.bytes, flash.activation.bytes),
        both("total".into(), naive.total, flash.total),
        row("limit".into(), human_bytes(limit), human_bytes(limit), String::new()),
        row("fits".into(), fit_word(naive.total, limit), fit_word(flash.total, limit), String::new()),
    ];
    print!("{}", table(&header, &rows));
    println!();
    println!(
        "dominant term: {dom_name}, {} = {} of the {} total; naive -> flash changes the total by {} ({})",
        bytes_label(dom_bytes),
        share(dom_bytes, chosen.total),
        w.kernel,
        bytes_label(naive.total.saturating_sub(flash.total)),
        share(naive.total.saturating_sub(flash.total), naive.total)
    );
    if fits {
        println!("fits: yes, {} free of {}", human_bytes(limit - chosen.total), human_bytes(limit));
    } else {
        println!("fits: NO, {} over {}", bytes_label(chosen.total.saturating_sub(limit)), human_bytes(limit));
    }
    match batch_max {
        Some(b) => println!("largest batch that fits: {} (at context {})", b, w.context),
        None => println!("largest batch that fits: none (batch 1 does not fit)"),
    }
    match context_max {
        Some(c) if c == u32::MAX => {
            println!("longest context that fits: no limit up to {c} (every layer's cache is capped at its window)")
        }
        Some(c) => println!("longest context that fits: {c} tokens (at batch {})", w.batch),
        None => println!("longest context that fits: none (not even {} tokens)", w.new_tokens),
    }
    if let Some(b) = &best {
        println!(
            "the one option that changes the outcome most: {} -> total {} ({} {}{})",
            b.flag,
            bytes_label(b.total_after),
            if b.saved >= 0 { "saves" } else { "costs" },
            human_bytes(b.saved.unsigned_abs() as u64),
            if b.fits_after { ", fits" } else { ", still does not fit" }
        );
    }
    if let Some((cmd, per)) = &fp8_run {
        println!(
            "run one layer of it (FP8 KV cache, scaled down to 2 sequences of 256 keys; {per} B of K and V per token per layer as planned):\n  {cmd}"
        );
    }
    for c in &options {
        println!(
            "  {:<18} -> {:>11}  ({}{}; {})",
            c.flag,
            bytes_label(c.total_after),
            match c.saved {
                0 => "no change".to_string(),
                s if s > 0 => format!("-{}", human_bytes(s as u64)),
                s => format!("+{}", human_bytes(s.unsigned_abs() as u64)),
            },
            if c.fits_after { ", fits" } else { ", does not fit" },
            c.note
        );
    }
    if let Some((t, smallest)) = &cp {
        println!();
        println!(
            "context parallel over {} devices (flash, the sequence split; every device holds the weights), per device:",
            t.devices
        );
        for (name, b) in [
            ("weights", t.weights),
            ("KV cache slice", t.kv_cache),
            ("ring: 2 K/V blocks of one layer in flight", t.ring_buffers),
            ("merge state f32 (o, lse) of its rows", t.merge_state),
            ("largest activation (its rows)", t.activation),
            ("total", t.total),
        ] {
            println!("  {name:<42} {:>12}", bytes_label(b));
        }
        println!("  {:<42} {:>12}", "fits", fit_word(t.total, limit));
        match smallest {
            Some(s) => println!("smallest context-parallel group that fits: {s} devices"),
            None => println!("smallest context-parallel group that fits: none up to 4096 devices (every device holds all the weights)"),
        }
    }
    if let Some((vj, _)) = &verify {
        print_verify(vj);
    }
    if let Some(p) = &plot_path {
        println!("plot: {p}");
    }
    Ok(code)
}

fn fit_word(total: u64, limit: u64) -> String {
    if total <= limit {
        "yes".into()
    } else {
        "NO".into()
    }
}

/// `8030261248` -> `8,030,261,248`.
fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The `memattn decode` command that runs one layer of the model's attention over an FP8 e4m3
/// cache, scaled down (2 sequences of 256 keys, one new token, paged by the plan's page size),
/// with the model's heads, KV heads and head dim, and the KV bytes per token and layer the plan
/// counts for it (`2 * heads_kv * head_dim` bytes).
pub fn fp8_decode(m: &Model) -> (String, u64) {
    let per = 2 * m.heads_kv as u64 * m.head_dim as u64 * StoreType::Fp8.bytes();
    let cmd = format!(
        "memattn decode --kv-dtype fp8 --heads {} --heads-kv {} --head-dim {} --batch 2 --cache-len 255 --new-tokens 1 --page-size {}",
        m.heads, m.heads_kv, m.head_dim, memattn_cli::plan::PAGE_TOKENS
    );
    (cmd, per)
}

/// Runs the attention part of one layer, scaled down, in the VM with naive and flash, and checks
/// that the measured peak equals the plan's per-layer bytes and the kernels' memory model.
fn verify(cli: &Cli, m: &Model, w: &Workload) -> Result<(serde_json::Value, bool), Error> {
    let keys = (0..m.layers as usize).map(|l| m.keys(l, w.context)).max().unwrap_or(w.context);
    let context = keys.min(200);
    // GQA kept: one KV head with its query heads (at most 8), or up to 4 dense heads.
    let group = m.heads / m.heads_kv.max(1);
    let (heads, heads_kv) = if group <= 1 { (m.heads.min(4), m.heads.min(4)) } else { (group.min(8), 1) };
    // At the model's head dim when the variant table has flash kernels for it in every dtype;
    // others verify at 64.
    let compiled = [Elem::F32, Elem::Bf16, Elem::F16].iter().all(|&e| KernelId::flash(e, m.head_dim).is_some());
    let head_dim = if compiled { m.head_dim } else { 64 };
    // The scaled-down layer keeps the model's grouping, so the plan's K/V terms at `heads_kv`
    // heads are compared with what a GQA forward run really allocates.
    let sm = Model { layers: 1, heads, heads_kv, head_dim, windows: vec![None], ..m.clone() };
    let mut opts = device_options(cli)?;
    opts.backend = BackendChoice::Vm;
    let mut dev = device::open(&opts)?.device;
    let mut runs = Vec::new();
    let mut all_ok = true;
    for kernel in KernelKind::ALL {
        let sw = Workload {
            batch: w.batch.min(2),
            context,
            new_tokens: w.new_tokens.min(context).min(37),
            kernel,
            page: None,
            ..*w
        };
        let layer = layer_attention(&sm, &sw);
        let problem = memattn_cli::plan::attention_problem(&sm, &sw, context);
        let model_bytes = AnalyticBytes::new(&problem, kernel);
        let report = memattn_cli::runner::run(dev.as_mut(), &RunSpec::new(problem, kernel), None)?;
        let ok = report.peak_device_bytes == layer.total && layer.total == model_bytes.total && report.verified;
        all_ok &= ok;
        runs.push(serde_json::json!({
            "kernel": kernel,
            "shape": problem.shape_json(),
            "dtype": problem.dtype,
            "plan_bytes": layer,
            "memory_model_bytes": model_bytes,
            "measured_peak_bytes": report.peak_device_bytes,
            "measured_source": report.memory.source,
            "verified": report.verified,
            "rel_rms_err": report.rel_rms_err,
            "ok": ok,
        }));
    }
    let note = if group > 8 {
        format!("scaled to {heads} query heads on 1 KV head (the model groups {group} query heads per KV head)")
    } else {
        String::new()
    };
    Ok((serde_json::json!({"runs": runs, "passed": all_ok, "note": note, "device": dev.name()}), all_ok))
}

fn print_verify(v: &serde_json::Value) {
    println!(
        "\nverify: the attention part of one layer, scaled down, in the VM ({})",
        v["device"].as_str().unwrap_or("")
    );
    if let Some(n) = v["note"].as_str().filter(|n| !n.is_empty()) {
        println!("  {n}");
    }
    for r in v["runs"].as_array().into_iter().flatten() {
        let s = &r["shape"];
        println!(
            "  {:<5} batch {} heads {} heads_kv {} seq_q {} seq_kv {} head_dim {} {}: expected {} B (plan) = {} B (memory model), measured {} B  {}  O rel RMS {:.2e}",
            r["kernel"].as_str().unwrap_or(""),
            s["batch"],
            s["heads"],
            s["heads_kv"],
            s["seq_q"],
            s["seq_kv"],
            s["head_dim"],
            r["dtype"].as_str().unwrap_or(""),
            r["plan_bytes"]["total"],
            r["memory_model_bytes"]["total"],
            r["measured_peak_bytes"],
            if r["ok"] == true { "PASS" } else { "FAIL" },
            r["rel_rms_err"].as_f64().unwrap_or(f64::NAN)
        );
    }
}
