//! The training rollouts a learner kept (`rollouts.jsonl`, a few rewarded
//! and a few unrewarded per evaluation step), for a person: filtered and
//! printed by `bapo rollouts`, and a section of the run's report.

use std::{fmt::Write, path::Path};

use anyhow::Context;
use bapo_learner::tracking::samples::RolloutSample;

use super::html::escape;

/// Every sample in `run`'s `rollouts.jsonl`, in the order written; a line
/// that is not one (cut short by a kill) is skipped.
pub fn read(run: &Path) -> anyhow::Result<Vec<RolloutSample>> {
    let path = run.join("rollouts.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (a run's directory, written by a learner with sample_rollouts > 0)",
            path.display()
        )
    })?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Which samples to show.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub step: Option<u64>,
    /// `Some(true)`: rewarded only; `Some(false)`: unrewarded only.
    pub rewarded: Option<bool>,
    pub truncated_only: bool,
    /// Text the prompt or the response must contain.
    pub contains: Option<String>,
}

impl Filter {
    pub fn keeps(&self, s: &RolloutSample) -> bool {
        self.step.is_none_or(|t| s.step == t)
            && self.rewarded.is_none_or(|r| s.rewarded == r)
            && (!self.truncated_only || s.truncated)
            && self
                .contains
                .as_ref()
                .is_none_or(|c| s.prompt.contains(c.as_str()) || s.response().contains(c.as_str()))
    }
}

/// One sample as terminal text: a header line, the prompt, then each part
/// of the response (an environment's marked as such).
pub fn to_text(s: &RolloutSample) -> String {
    let mut out = format!(
        "step {}  group {}  reward {}  {}  versions {}-{}{}\n",
        s.step,
        s.group,
        s.reward,
        if s.rewarded { "rewarded" } else { "unrewarded" },
        s.versions[0],
        s.versions[1],
        if s.truncated { "  TRUNCATED" } else { "" }
    );
    let _ = writeln!(out, "  prompt:   {}", indent(&s.prompt));
    for p in &s.parts {
        let who = if p.by == "policy" {
            "policy:  "
        } else {
            "env:     "
        };
        let _ = writeln!(out, "  {who} {}", indent(&p.text));
    }
    out
}

fn indent(text: &str) -> String {
    text.replace('\n', "\n            ")
}

/// The report's section: one collapsible block per evaluation step, the
/// last one open.
pub fn html_section(samples: &[RolloutSample]) -> String {
    let mut html = String::from("<h2>Sample rollouts</h2>");
    if samples.is_empty() {
        html.push_str("<p>None kept (learner.sample_rollouts = 0, or no evaluation step).</p>");
        return html;
    }
    let _ = write!(
        html,
        "<p>Training rollouts of the batch trained at each evaluation step: up to {} rewarded \
         and as many unrewarded, drawn reproducibly (seeded by the step). All of them: \
         <code>rollouts.jsonl</code>, or <code>bapo rollouts --run DIR</code>.</p>",
        per_side(samples)
    );
    let mut steps: Vec<u64> = samples.iter().map(|s| s.step).collect();
    steps.dedup();
    // The first and the last evaluation open (what the model wrote before
    // and after), the ones between folded into one block.
    let n = steps.len();
    for (i, step) in steps.iter().enumerate() {
        if i == 1 && n > 2 {
            let _ = write!(
                html,
                "<details><summary>{} more evaluation steps</summary><div class=\"between\">",
                n - 2
            );
        }
        let open = i == 0 || i + 1 == n;
        step_block(&mut html, *step, samples, open);
        if i + 2 == n && n > 2 {
            html.push_str("</div></details>");
        }
    }
    html
}

/// One evaluation step's samples as a collapsible table.
fn step_block(html: &mut String, step: u64, samples: &[RolloutSample], open: bool) {
    let mine: Vec<&RolloutSample> = samples.iter().filter(|s| s.step == step).collect();
    let rewarded = mine.iter().filter(|s| s.rewarded).count();
    let _ = write!(
        html,
        "<details{}><summary>step {step}: {rewarded} rewarded, {} unrewarded</summary>\
         <table class=\"rollouts\"><tr><th>reward</th><th>versions</th><th>truncated</th>\
         <th>prompt</th><th>response</th></tr>",
        if open { " open" } else { "" },
        mine.len() - rewarded
    );
    for s in mine {
        let parts: String = s
            .parts
            .iter()
            .map(|p| match p.by.as_str() {
                "policy" => escape(&p.text),
                _ => format!("<span class=\"env\">{}</span>", escape(&p.text)),
            })
            .collect();
        let _ = write!(
            html,
            "<tr class=\"{}\"><td class=\"n\">{}</td><td>{}-{}</td><td>{}</td>\
             <td><pre>{}</pre></td><td><pre>{parts}</pre></td></tr>",
            if s.rewarded { "right" } else { "wrong" },
            s.reward,
            s.versions[0],
            s.versions[1],
            if s.truncated { "yes" } else { "no" },
            escape(&s.prompt),
        );
    }
    html.push_str("</table></details>");
}

/// The most samples of one kind at any step (the learner's setting).
fn per_side(samples: &[RolloutSample]) -> usize {
    let mut counts = std::collections::BTreeMap::new();
    for s in samples {
        *counts.entry((s.step, s.rewarded)).or_insert(0usize) += 1;
    }
    counts.into_values().max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use bapo_learner::tracking::samples::Part;

    use super::*;

    fn sample(step: u64, rewarded: bool, text: &str) -> RolloutSample {
        RolloutSample {
            step,
            group: format!("g{step}"),
            reward: f32::from(u8::from(rewarded)),
            rewarded,
            prompt: "2+2=".into(),
            parts: vec![
                Part {
                    by: "policy".into(),
                    text: text.into(),
                },
                Part {
                    by: "environment".into(),
                    text: "<result>4</result>".into(),
                },
            ],
            versions: [step as u32 - 1, step as u32],
            truncated: !rewarded,
        }
    }

    #[test]
    fn filters_pick_by_step_outcome_and_text() {
        let all = [
            sample(10, true, "4"),
            sample(10, false, "5"),
            sample(20, true, "four"),
        ];
        let keep = |f: Filter| all.iter().filter(|s| f.keeps(s)).count();
        assert_eq!(keep(Filter::default()), 3);
        assert_eq!(
            keep(Filter {
                step: Some(10),
                ..Filter::default()
            }),
            2
        );
        assert_eq!(
            keep(Filter {
                rewarded: Some(false),
                ..Filter::default()
            }),
            1
        );
        assert_eq!(
            keep(Filter {
                truncated_only: true,
                ..Filter::default()
            }),
            1
        );
        let four = Filter {
            contains: Some("four".into()),
            ..Filter::default()
        };
        assert_eq!(keep(four), 1);
    }

    #[test]
    fn the_section_escapes_text_and_marks_the_environment() {
        let html = html_section(&[sample(10, true, "<b>4</b>"), sample(20, false, "5")]);
        assert!(html.contains("&lt;b&gt;4&lt;/b&gt;"), "{html}");
        assert!(html.contains("<span class=\"env\">&lt;result&gt;4&lt;/result&gt;</span>"));
        // Two steps: both open.
        assert_eq!(html.matches("<details open>").count(), 2);
        // Four: the first and last open, the two between folded together.
        let four: Vec<_> = [10, 20, 30, 40].map(|t| sample(t, true, "4")).to_vec();
        let html = html_section(&four);
        assert_eq!(html.matches("<details open>").count(), 2);
        assert!(html.contains("<details><summary>2 more evaluation steps</summary>"));
        let folded = html.split("more evaluation steps").nth(1).unwrap();
        assert!(folded.find("step 20:").unwrap() < folded.find("step 40:").unwrap());
        let text = to_text(&sample(20, false, "5"));
        assert!(
            text.starts_with("step 20  group g20  reward 0  unrewarded  versions 19-20  TRUNCATED")
        );
        assert!(text.contains("env:"));
    }
}
