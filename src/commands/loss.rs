//! `bapo loss`: one policy loss on a JSON batch, printed as JSON, for parity
//! checks against Python implementations (verl and friends).
//!
//! Input: `{"advantages": [...], "logp_old": [...], "logp": [...],
//! "logp_behav": [...]?, "mask": [...]?, "seq_ids": [...]?, "turn_ids": [...]?}`
//! (`turn_ids`: each token's turn in its sequence, for `turn-ppo`); Python's
//! `json.dumps` spellings `NaN`, `Infinity` and `-Infinity` are read too, so
//! that a bad value is reported by field and index rather than as a JSON
//! syntax error. Output: `{"loss", "grad", "metrics"}` (non-finite metrics
//! print as null).

use std::{collections::BTreeMap, path::PathBuf};

use anyhow::{Context, bail};
use bapo_learner::{
    loss::{
        Aggregation, Denominators, TokenBatch,
        bapo::BapoMode,
        rec::RecWeight,
        registry::{self, LossOptions},
    },
    stats,
};
use clap::{Args, ValueEnum};
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Mode {
    Paper,
    Code,
    /// The official example script's setting.
    CodeExample,
}

#[derive(Debug, Args)]
pub struct LossArgs {
    /// Loss name: bapo, ppo, grpo, dr-grpo, dapo, gspo, sapo, cispo, opmd,
    /// asymre, decoupled, tis, rec-onesided, rec-twosided, rec-ring, spear,
    /// remix.
    #[arg(long)]
    pub algo: String,
    /// JSON batch file; `-` reads standard input.
    #[arg(long)]
    pub input: PathBuf,
    /// BAPO bound search: the paper's Algorithm 1, the official code's
    /// yaml, or its example script.
    #[arg(long, value_enum)]
    pub bapo_mode: Option<Mode>,
    /// BAPO's target positive share ρ0 in (0, 1).
    #[arg(long)]
    pub bapo_rho0: Option<f64>,
    /// BAPO's c_low search: START,MAX,STEP.
    #[arg(long, value_parser = parse_range)]
    pub bapo_low: Option<[f64; 3]>,
    /// BAPO's c_high search: START,MAX,STEP.
    #[arg(long, value_parser = parse_range)]
    pub bapo_high: Option<[f64; 3]>,
    /// REC's weight of in-range tokens: none (NoIS), is, tis.
    #[arg(long, value_enum)]
    pub rec_weight: Option<RecWeightArg>,
    /// REC's ring bounds ε'_l,ε'_h (TIS truncates at them too).
    #[arg(long, value_parser = parse_pair)]
    pub rec_ring: Option<[f64; 2]>,
    /// ε_low of fixed-bound losses (and ε_high unless given).
    #[arg(long)]
    pub clip_eps: Option<f64>,
    #[arg(long)]
    pub clip_eps_high: Option<f64>,
    /// Dual clip constant for negative advantages (> 1; 0 disables); BAPO
    /// code mode applies 3 unless told otherwise, the other losses none.
    #[arg(long)]
    pub dual_clip: Option<f64>,
    /// token-mean, seq-mean-token-mean, seq-mean-token-sum,
    /// seq-mean-token-sum-norm.
    #[arg(long)]
    pub agg: Option<String>,
}

/// REC's weights, as `--rec-weight` spells them.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RecWeightArg {
    None,
    Is,
    Tis,
}

/// `A,B` as two numbers.
fn parse_pair(s: &str) -> Result<[f64; 2], String> {
    let v = parse_numbers(s)?;
    <[f64; 2]>::try_from(v).map_err(|_| format!("{s:?}: want two numbers A,B"))
}

fn parse_numbers(s: &str) -> Result<Vec<f64>, String> {
    s.split(',')
        .map(|x| x.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{s:?}: {e}"))
}

/// `START,MAX,STEP` as three numbers.
fn parse_range(s: &str) -> Result<[f64; 3], String> {
    let v = parse_numbers(s)?;
    <[f64; 3]>::try_from(v).map_err(|_| format!("{s:?}: want START,MAX,STEP"))
}

/// Quotes the non-JSON number spellings Python writes, outside strings.
fn quote_python_specials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            rest = &rest[c.len_utf8()..];
            continue;
        }
        if c == '"' {
            in_string = true;
        }
        let special = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|s| rest.starts_with(s));
        if let Some(s) = special {
            out.push('"');
            out.push_str(s);
            out.push('"');
            rest = &rest[s.len()..];
        } else {
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

fn number(v: &Value, field: &str, i: usize) -> anyhow::Result<f64> {
    match v {
        Value::Number(n) => n
            .as_f64()
            .with_context(|| format!("{field}[{i}]: {n} is not a number")),
        Value::String(s) if s == "NaN" => Ok(f64::NAN),
        Value::String(s) if s == "Infinity" => Ok(f64::INFINITY),
        Value::String(s) if s == "-Infinity" => Ok(f64::NEG_INFINITY),
        other => bail!("{field}[{i}]: expected a number, got {other}"),
    }
}

fn array<'a>(
    obj: &'a serde_json::Map<String, Value>,
    field: &str,
) -> anyhow::Result<Option<&'a Vec<Value>>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(other) => bail!("{field}: expected an array, got {other}"),
    }
}

fn floats(obj: &serde_json::Map<String, Value>, field: &str) -> anyhow::Result<Option<Vec<f64>>> {
    array(obj, field)?
        .map(|a| {
            a.iter()
                .enumerate()
                .map(|(i, v)| number(v, field, i))
                .collect()
        })
        .transpose()
}

fn required(obj: &serde_json::Map<String, Value>, field: &str) -> anyhow::Result<Vec<f64>> {
    floats(obj, field)?.with_context(|| format!("{field}: missing (required)"))
}

/// Reads a batch from JSON text, naming the first bad field.
pub fn parse_batch(text: &str) -> anyhow::Result<TokenBatch> {
    let value: Value =
        serde_json::from_str(&quote_python_specials(text)).context("input is not JSON")?;
    let Value::Object(obj) = value else {
        bail!("input: expected a JSON object with advantages, logp_old, logp");
    };
    const KNOWN: &[&str] = &[
        "advantages",
        "logp_old",
        "logp",
        "logp_behav",
        "mask",
        "seq_ids",
        "turn_ids",
    ];
    if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        bail!("{k}: unknown field (known: {})", KNOWN.join(", "));
    }
    let mask = array(&obj, "mask")?
        .map(|a| {
            a.iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::Bool(b) => Ok(*b),
                    Value::Number(n) if n.as_f64() == Some(0.0) => Ok(false),
                    Value::Number(n) if n.as_f64() == Some(1.0) => Ok(true),
                    other => bail!("mask[{i}]: expected 0, 1, true or false, got {other}"),
                })
                .collect::<anyhow::Result<Vec<bool>>>()
        })
        .transpose()?;
    let seq_ids = ids(&obj, "seq_ids")?;
    let turn_ids = ids(&obj, "turn_ids")?;
    Ok(TokenBatch::new(
        required(&obj, "advantages")?,
        required(&obj, "logp")?,
        required(&obj, "logp_old")?,
        floats(&obj, "logp_behav")?,
        mask,
        seq_ids,
    )?
    .with_turns(turn_ids.unwrap_or_default())?)
}

/// An optional array of non-negative integer ids.
fn ids(obj: &serde_json::Map<String, Value>, key: &str) -> anyhow::Result<Option<Vec<u32>>> {
    array(obj, key)?
        .map(|a| {
            a.iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .with_context(|| {
                            format!("{key}[{i}]: expected a non-negative integer, got {v}")
                        })
                })
                .collect()
        })
        .transpose()
}

/// Computes the loss and returns the output document.
pub fn evaluate(args: &LossArgs, text: &str) -> anyhow::Result<Value> {
    let agg = match &args.agg {
        Some(s) => Some(Aggregation::parse(s).with_context(|| {
            let names: Vec<_> = Aggregation::ALL.iter().map(|a| a.name()).collect();
            format!("agg: unknown mode {s:?} (known: {})", names.join(", "))
        })?),
        None => None,
    };
    let options = LossOptions {
        bapo_mode: args.bapo_mode.map(|m| match m {
            Mode::Paper => BapoMode::Paper,
            Mode::Code => BapoMode::Code,
            Mode::CodeExample => BapoMode::CodeExample,
        }),
        bapo_low: args.bapo_low,
        bapo_high: args.bapo_high,
        rec_weight: args.rec_weight.map(|w| match w {
            RecWeightArg::None => RecWeight::None,
            RecWeightArg::Is => RecWeight::Is,
            RecWeightArg::Tis => RecWeight::Tis,
        }),
        rec_ring: args.rec_ring,
        clip_eps: args.clip_eps,
        clip_eps_high: args.clip_eps_high,
        dual_clip: args.dual_clip,
        agg,
        clip_cov: None,
        bapo_rho0: args.bapo_rho0,
    };
    let loss = registry::build(&args.algo, &options)?;
    let batch = parse_batch(text)?;
    let out = loss.compute(&batch, &Denominators::of(&batch));
    let mut metrics: BTreeMap<String, f64> = stats::ratio_metrics(&batch);
    metrics.extend(out.metrics);
    Ok(json!({
        "algo": loss.name(),
        "aggregation": loss.aggregation().name(),
        "loss": out.loss,
        "grad": out.grad,
        "metrics": metrics,
    }))
}

pub fn run(args: LossArgs) -> anyhow::Result<()> {
    let text = if args.input.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading standard input")?
    } else {
        std::fs::read_to_string(&args.input)
            .with_context(|| format!("reading {}", args.input.display()))?
    };
    let doc = evaluate(&args, &text)?;
    println!("{}", serde_json::to_string_pretty(&doc)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_specials_are_quoted_outside_strings_only() {
        let s = r#"{"a": [NaN, -Infinity, Infinity, 1.5], "b": "NaN \" Infinity"}"#;
        let q = quote_python_specials(s);
        assert_eq!(
            q,
            r#"{"a": ["NaN", "-Infinity", "Infinity", 1.5], "b": "NaN \" Infinity"}"#
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let err = |t: &str| format!("{:#}", parse_batch(t).unwrap_err());
        let e = err(r#"{"advantages": [1, 2], "logp_old": [-1, -1], "logp": [-1]}"#);
        assert!(e.contains("logp") && e.contains("1 entries"), "{e}");
        let e = err(r#"{"advantages": [1, NaN], "logp_old": [-1, -1], "logp": [-1, -1]}"#);
        assert!(e.contains("advantages[1]"), "{e}");
        let e = err(r#"{"advantages": [1], "logp_old": [-1], "logp": [NaN]}"#);
        assert!(e.contains("logp[0]"), "{e}");
        let e = err(r#"{"advantages": [1], "logp_old": [-1]}"#);
        assert!(e.contains("logp: missing"), "{e}");
        let e = err(r#"{"advantages": [1], "logp_old": [-1], "logp": [-1], "mask": [2]}"#);
        assert!(e.contains("mask[0]"), "{e}");
        let e = err(r#"{"advantages": [1], "logp_old": [-1], "logp": [-1], "logpp": [-1]}"#);
        assert!(e.contains("logpp: unknown field"), "{e}");
    }

    mod fuzz {
        //! `bapo loss` reads outside input: whatever the JSON says, every
        //! loss answers with a result or a named error, never a panic.
        use proptest::prelude::*;

        use super::super::*;

        fn args(algo: &str) -> LossArgs {
            LossArgs {
                algo: algo.into(),
                input: "-".into(),
                bapo_mode: None,
                bapo_rho0: None,
                bapo_low: None,
                bapo_high: None,
                rec_weight: None,
                rec_ring: None,
                clip_eps: None,
                clip_eps_high: None,
                dual_clip: None,
                agg: None,
            }
        }

        fn value() -> impl Strategy<Value = String> {
            prop_oneof![
                (-50.0f64..50.0).prop_map(|x| format!("{x}")),
                (-1e300f64..1e300).prop_map(|x| format!("{x:e}")),
                Just("0".to_string()),
                Just("-0.0".to_string()),
                Just("NaN".to_string()),
                Just("Infinity".to_string()),
                Just("-Infinity".to_string()),
                Just("1e999".to_string()),
                Just("true".to_string()),
                Just("null".to_string()),
                Just("\"x\"".to_string()),
            ]
        }

        fn array(max: usize) -> impl Strategy<Value = String> {
            prop::collection::vec(value(), 0..max).prop_map(|v| format!("[{}]", v.join(",")))
        }

        /// Batches that are mostly well formed, with lengths, masks and
        /// sequence ids that may disagree.
        fn batch() -> impl Strategy<Value = String> {
            (
                array(6),
                array(6),
                array(6),
                prop::option::of(array(6)),
                prop::option::of(prop::collection::vec(0u8..3, 0..6)),
                prop::option::of(prop::collection::vec(0u32..4, 0..6)),
            )
                .prop_map(|(a, lp, old, behav, mask, seq)| {
                    let mut s = format!(r#"{{"advantages":{a},"logp":{lp},"logp_old":{old}"#);
                    if let Some(b) = behav {
                        s += &format!(r#","logp_behav":{b}"#);
                    }
                    if let Some(m) = mask {
                        let m: Vec<String> = m.iter().map(u8::to_string).collect();
                        s += &format!(r#","mask":[{}]"#, m.join(","));
                    }
                    if let Some(q) = seq {
                        let q: Vec<String> = q.iter().map(u32::to_string).collect();
                        s += &format!(r#","seq_ids":[{}]"#, q.join(","));
                    }
                    s + "}"
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            #[test]
            fn every_loss_answers_any_batch_without_panicking(
                text in batch(),
                algo in prop::sample::select(registry::names()),
            ) {
                if let Ok(doc) = evaluate(&args(algo), &text) {
                    prop_assert!(doc["loss"].is_number() || doc["loss"].is_null(), "{doc}");
                }
            }

            #[test]
            fn arbitrary_text_never_panics_and_every_error_names_its_cause(
                text in "\\PC{0,200}",
            ) {
                if let Err(e) = evaluate(&args("bapo"), &text) {
                    // "input is not JSON", or "<field>: <what is wrong>".
                    let msg = format!("{e:#}");
                    prop_assert!(msg.contains("JSON") || msg.contains(": "), "{msg}");
                }
            }
        }
    }
}
