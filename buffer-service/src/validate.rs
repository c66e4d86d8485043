//! What makes a rollout unacceptable on its own, before it touches any
//! shared state. Each check names the rollout, the field and the value, so an
//! actor author can find the bug from the ack alone.

use bapo_proto::packed;

use crate::{lineage::Lineage, rollout::Rollout};

/// gRPC-compatible classification of a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectCode {
    /// The rollout is malformed and will never be accepted.
    InvalidArgument,
    /// The rollout is well-formed but cannot be accepted in the buffer's
    /// current state (its group is sealed, it is too stale, ...).
    FailedPrecondition,
}

impl RejectCode {
    /// The `google.rpc.Code` number.
    pub fn grpc_code(self) -> i32 {
        match self {
            RejectCode::InvalidArgument => 3,
            RejectCode::FailedPrecondition => 9,
        }
    }
}

/// Why one rollout was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub rollout_id: String,
    pub group_id: String,
    pub code: RejectCode,
    /// Metric label: a short, bounded set of values.
    pub label: &'static str,
    pub reason: String,
}

impl Rejection {
    pub fn new(r: &Rollout, code: RejectCode, label: &'static str, reason: String) -> Self {
        Self::for_ids(&r.id, &r.group_id, code, label, reason)
    }

    pub fn for_ids(
        rollout_id: &str,
        group_id: &str,
        code: RejectCode,
        label: &'static str,
        reason: String,
    ) -> Self {
        // Echoed ids are cut short: a refusal must not carry (or log) the
        // megabyte an abusive id may be.
        let (rollout_id, group_id) = (shorten(rollout_id), shorten(group_id));
        Self {
            reason: format!("rollout {rollout_id:?} (group {group_id:?}): {reason}"),
            rollout_id,
            group_id,
            code,
            label,
        }
    }
}

/// Longest id (rollout, group, actor) accepted, in bytes.
pub const MAX_ID_BYTES: usize = 256;
/// Longest task name accepted, in bytes.
pub const MAX_TASK_BYTES: usize = 128;
/// Most metadata entries per rollout, and longest key and value in bytes.
pub const MAX_METADATA_ENTRIES: usize = 64;
pub const MAX_METADATA_KEY_BYTES: usize = 128;
pub const MAX_METADATA_VALUE_BYTES: usize = 4096;

/// `s`, or its first [`MAX_ID_BYTES`] bytes (on a character boundary) and
/// how long it was.
fn shorten(s: &str) -> String {
    if s.len() <= MAX_ID_BYTES {
        return s.to_string();
    }
    let mut end = MAX_ID_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &s[..end], s.len())
}

/// A group id named outside a rollout (a lease request): not empty, and
/// within the id bound. The error names the field and is not echoed whole.
pub fn check_group_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("group_id is empty".into());
    }
    if id.len() > MAX_ID_BYTES {
        return Err(format!(
            "group_id {} is over the limit of {MAX_ID_BYTES} bytes",
            shorten(id)
        ));
    }
    Ok(())
}

/// The first string field of `r` over its length bound, named.
fn overlong(r: &Rollout) -> Option<String> {
    let fields = [
        ("rollout_id", r.id.len(), MAX_ID_BYTES),
        ("group_id", r.group_id.len(), MAX_ID_BYTES),
        ("actor_id", r.actor_id.len(), MAX_ID_BYTES),
        ("task", r.task.len(), MAX_TASK_BYTES),
    ];
    for (name, len, max) in fields {
        if len > max {
            return Some(format!("{name} is {len} bytes, over the limit of {max}"));
        }
    }
    if r.metadata.len() > MAX_METADATA_ENTRIES {
        return Some(format!(
            "metadata has {} entries, over the limit of {MAX_METADATA_ENTRIES}",
            r.metadata.len()
        ));
    }
    r.metadata.iter().find_map(|(k, v)| {
        if k.len() > MAX_METADATA_KEY_BYTES {
            Some(format!(
                "a metadata key is {} bytes, over the limit of {MAX_METADATA_KEY_BYTES}",
                k.len()
            ))
        } else if v.len() > MAX_METADATA_VALUE_BYTES {
            Some(format!(
                "metadata {:?} is {} bytes, over the limit of {MAX_METADATA_VALUE_BYTES}",
                shorten(k),
                v.len()
            ))
        } else {
            None
        }
    })
}

/// Limits a rollout is checked against.
#[derive(Debug, Clone, Copy)]
pub struct Limits<'a> {
    pub max_tokens: usize,
    pub max_rollout_bytes: usize,
    pub learner_version: u64,
    /// The learner's history; `None` (or empty) judges by version only.
    pub lineage: Option<&'a Lineage>,
}

/// Checks one rollout. `encoded_len` is its size on the wire.
pub fn check(r: &Rollout, encoded_len: usize, limits: Limits) -> Result<(), Rejection> {
    use RejectCode::*;
    let reject = |code, label, reason: String| Err(Rejection::new(r, code, label, reason));
    if encoded_len > limits.max_rollout_bytes {
        return reject(
            InvalidArgument,
            "too_large",
            format!(
                "message is {encoded_len} bytes, over the limit of {} bytes",
                limits.max_rollout_bytes
            ),
        );
    }
    if let Some(reason) = overlong(r) {
        return reject(InvalidArgument, "too_long", reason);
    }
    if r.id.is_empty() {
        return reject(InvalidArgument, "missing_id", "rollout_id is empty".into());
    }
    if r.group_id.is_empty() {
        return reject(InvalidArgument, "missing_id", "group_id is empty".into());
    }
    let n = r.len();
    if n == 0 {
        return reject(
            InvalidArgument,
            "empty_response",
            "response_tokens is empty".into(),
        );
    }
    let n_logprobs = r.behavior_logprobs.len() / 4;
    if n_logprobs != n || r.versions.len() != n {
        return reject(
            InvalidArgument,
            "length_mismatch",
            format!(
                "length mismatch: response_tokens has {n}, behavior_logprobs {n_logprobs}, token_versions {}",
                r.versions.len()
            ),
        );
    }
    let n_rewards = r.token_rewards.len() / 4;
    if n_rewards != 0 && n_rewards != n {
        return reject(
            InvalidArgument,
            "length_mismatch",
            format!("length mismatch: token_rewards has {n_rewards}, response_tokens {n}"),
        );
    }
    let n_prompt = r.prompt_tokens.len() / 4;
    let total = n + n_prompt;
    if total > limits.max_tokens {
        return reject(
            InvalidArgument,
            "too_many_tokens",
            format!(
                "{total} tokens (prompt {n_prompt} + response {n}) exceed max_tokens = {}",
                limits.max_tokens
            ),
        );
    }
    // One pass for the common case; the exact defect is found only when
    // there is one.
    // Without short-circuiting, so the common all-good case vectorises.
    let clean =
        packed::f32s(&r.behavior_logprobs).fold(true, |ok, lp| ok & (lp <= 0.0) & lp.is_finite());
    if let Some((i, lp)) = (!clean)
        .then(|| {
            packed::f32s(&r.behavior_logprobs)
                .enumerate()
                .find(|(_, lp)| !lp.is_finite())
        })
        .flatten()
    {
        return reject(
            InvalidArgument,
            "non_finite",
            format!("behavior_logprobs[{i}] = {lp} is not finite"),
        );
    }
    if let Some((i, lp)) = (!clean)
        .then(|| {
            packed::f32s(&r.behavior_logprobs)
                .enumerate()
                .find(|&(_, lp)| lp > 0.0)
        })
        .flatten()
    {
        return reject(
            InvalidArgument,
            "positive_logprob",
            format!("behavior_logprobs[{i}] = {lp} is > 0 (a log-probability is at most 0)"),
        );
    }
    if !r.reward.is_finite() {
        return reject(
            InvalidArgument,
            "non_finite",
            format!("reward = {} is not finite", r.reward),
        );
    }
    if let Some((i, x)) = packed::f32s(&r.token_rewards)
        .enumerate()
        .find(|(_, x)| !x.is_finite())
    {
        return reject(
            InvalidArgument,
            "non_finite",
            format!("token_rewards[{i}] = {x} is not finite"),
        );
    }
    if let Some(reason) = turns_defect(r, n) {
        return reject(InvalidArgument, "bad_turns", reason);
    }
    if let Some(lineage) = limits.lineage {
        check_history(r, lineage, limits.learner_version)?;
    }
    if let Some(newest) = r.versions.newest()
        && newest > limits.learner_version
    {
        return reject(
            FailedPrecondition,
            "future_version",
            format!(
                "token_versions holds version {newest}, newer than the learner's version {}",
                limits.learner_version
            ),
        );
    }
    Ok(())
}

/// What is wrong with a rollout's multi-turn arrays, named: a loss mask of
/// another length, with a byte other than 0 or 1, or with no policy token
/// to train on; turn ids of another length or falling.
fn turns_defect(r: &Rollout, n: usize) -> Option<String> {
    let m = r.loss_mask.len();
    if m != 0 && m != n {
        return Some(format!(
            "length mismatch: loss_mask has {m}, response_tokens {n}"
        ));
    }
    if let Some(i) = r.loss_mask.iter().position(|&b| b > 1) {
        return Some(format!("loss_mask[{i}] = {} is not 0 or 1", r.loss_mask[i]));
    }
    if m != 0 && !r.loss_mask.contains(&1) {
        return Some("loss_mask marks no token as the policy's (all 0)".into());
    }
    let t = r.turn_ids.len() / 4;
    if t != 0 && t != n {
        return Some(format!(
            "length mismatch: turn_ids has {t}, response_tokens {n}"
        ));
    }
    let mut prev = 0;
    for (i, id) in packed::u32s(&r.turn_ids).enumerate() {
        if id < prev {
            return Some(format!("turn_ids[{i}] = {id} falls below {prev}"));
        }
        prev = id;
    }
    None
}

/// Refuses a rollout whose tokens are not in the learner's history (weights
/// of a learner incarnation that a resumed one rolled back). Checked before
/// `future_version`: such tokens are usually newer than the rolled-back
/// version, and `rolled_back` says why they will never be accepted.
pub fn check_history(r: &Rollout, lineage: &Lineage, version: u64) -> Result<(), Rejection> {
    let (oldest, newest) = (r.oldest_version(), r.newest_version());
    // The current incarnation's range is left open above: its versions
    // beyond the learner's are `future_version`, not rolled back.
    if r.learner_incarnation == 0
        || lineage.contains(r.learner_incarnation, oldest, newest, u64::MAX)
    {
        return Ok(());
    }
    let reason = format!(
        "learner_incarnation {:016x}, versions {oldest}..={newest}, is not in the learner's history \
         (current incarnation {:016x} at version {version}): those weights were rolled back",
        r.learner_incarnation,
        lineage.current_id(),
    );
    Err(Rejection::new(
        r,
        RejectCode::FailedPrecondition,
        "rolled_back",
        reason,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::{FinishReason, VersionRuns};
    use packed::{pack_f32, pack_u32};

    fn rollout() -> Rollout {
        Rollout {
            id: "r1".into(),
            group_id: "g1".into(),
            prompt_tokens: pack_u32(&[1, 2, 3]),
            response_tokens: pack_u32(&[4, 5]),
            behavior_logprobs: pack_f32(&[-0.5, -1.0]),
            versions: VersionRuns::from_tokens(&[2, 3]),
            reward: 1.0,
            token_rewards: Default::default(),
            loss_mask: Default::default(),
            turn_ids: Default::default(),
            finish_reason: FinishReason::Stop,
            actor_id: "a".into(),
            task: "arith".into(),
            metadata: Default::default(),
            learner_incarnation: 0,
            sampling: None,
        }
    }

    const LIMITS: Limits = Limits {
        max_tokens: 8,
        max_rollout_bytes: 1000,
        learner_version: 3,
        lineage: None,
    };

    fn label(r: &Rollout, len: usize) -> &'static str {
        check(r, len, LIMITS).unwrap_err().label
    }

    #[test]
    fn multi_turn_arrays_are_checked_by_name() {
        let mut r = rollout();
        r.loss_mask = vec![1u8, 0].into();
        r.turn_ids = pack_u32(&[0, 0]);
        assert!(check(&r, 100, LIMITS).is_ok());
        let bad = |f: &dyn Fn(&mut Rollout)| {
            let mut r = rollout();
            f(&mut r);
            let e = check(&r, 100, LIMITS).unwrap_err();
            assert_eq!(e.label, "bad_turns", "{}", e.reason);
            e.reason
        };
        assert!(bad(&|r| r.loss_mask = vec![1u8].into()).contains("loss_mask has 1"));
        assert!(bad(&|r| r.loss_mask = vec![1u8, 2].into()).contains("loss_mask[1] = 2"));
        assert!(bad(&|r| r.loss_mask = vec![0u8, 0].into()).contains("no token"));
        assert!(bad(&|r| r.turn_ids = pack_u32(&[0])).contains("turn_ids has 1"));
        assert!(bad(&|r| r.turn_ids = pack_u32(&[1, 0])).contains("turn_ids[1] = 0 falls"));
    }

    #[test]
    fn overlong_ids_names_and_metadata_are_refused_by_name_and_not_echoed() {
        let limits = Limits {
            max_rollout_bytes: 8 << 20,
            ..LIMITS
        };
        let mut r = rollout();
        r.id = "x".repeat(1 << 20);
        let e = check(&r, r.id.len() + 100, limits).unwrap_err();
        assert_eq!(e.label, "too_long");
        assert!(
            e.reason.contains("rollout_id is 1048576 bytes"),
            "{}",
            e.reason
        );
        assert!(e.reason.len() < 1024 && e.rollout_id.len() < 1024);
        let mut r = rollout();
        r.task = "t".repeat(MAX_TASK_BYTES + 1);
        assert!(
            check(&r, 100, limits)
                .unwrap_err()
                .reason
                .contains("task is")
        );
        let mut r = rollout();
        r.group_id = "g".repeat(MAX_ID_BYTES + 1);
        assert!(
            check(&r, 100, limits)
                .unwrap_err()
                .reason
                .contains("group_id is")
        );
        let mut r = rollout();
        r.metadata
            .insert("k".into(), "v".repeat(MAX_METADATA_VALUE_BYTES + 1));
        assert_eq!(check(&r, 100, limits).unwrap_err().label, "too_long");
        let mut r = rollout();
        r.id = "é".repeat(MAX_ID_BYTES);
        let e = check(&r, 1000, limits).unwrap_err();
        assert!(e.rollout_id.ends_with("bytes)"), "{}", e.rollout_id);
    }

    #[test]
    fn good_rollout_passes() {
        check(&rollout(), 100, LIMITS).unwrap();
    }

    #[test]
    fn each_defect_is_named() {
        let mut r = rollout();
        r.response_tokens.clear();
        assert_eq!(label(&r, 10), "empty_response");

        let mut r = rollout();
        r.behavior_logprobs = pack_f32(&[-0.5]);
        let e = check(&r, 10, LIMITS).unwrap_err();
        assert_eq!(e.label, "length_mismatch");
        assert!(e.reason.contains("behavior_logprobs 1"), "{}", e.reason);
        assert!(e.reason.contains("\"r1\""), "{}", e.reason);

        let mut r = rollout();
        r.behavior_logprobs = pack_f32(&[-0.5, f32::NAN]);
        let e = check(&r, 10, LIMITS).unwrap_err();
        assert!(
            e.reason.contains("behavior_logprobs[1] = NaN"),
            "{}",
            e.reason
        );

        let mut r = rollout();
        r.reward = f32::INFINITY;
        assert_eq!(label(&r, 10), "non_finite");

        let mut r = rollout();
        r.behavior_logprobs = pack_f32(&[0.25, -1.0]);
        assert_eq!(label(&r, 10), "positive_logprob");

        let mut r = rollout();
        r.versions = VersionRuns::from_tokens(&[3, 4]);
        let e = check(&r, 10, LIMITS).unwrap_err();
        assert_eq!(e.code, RejectCode::FailedPrecondition);
        assert!(e.reason.contains("version 4"), "{}", e.reason);

        let mut r = rollout();
        r.response_tokens = pack_u32(&[1; 6]);
        r.behavior_logprobs = pack_f32(&[-1.0; 6]);
        r.versions = VersionRuns::from_tokens(&[1; 6]);
        assert_eq!(label(&r, 10), "too_many_tokens");

        assert_eq!(label(&rollout(), 1001), "too_large");

        let mut r = rollout();
        r.token_rewards = pack_f32(&[0.0]);
        assert_eq!(label(&r, 10), "length_mismatch");
    }

    mod props {
        use super::*;
        use crate::{lineage::Lineage, wire};
        use bapo_proto::{lineage::Incarnation, v1};
        use bytes::Bytes;
        use proptest::prelude::*;

        const LABELS: &[&str] = &[
            "too_large",
            "missing_id",
            "empty_response",
            "length_mismatch",
            "too_many_tokens",
            "non_finite",
            "positive_logprob",
            "rolled_back",
            "future_version",
            "malformed_array",
        ];

        /// Packed arrays of any length (ragged ones included), with values
        /// biased towards the edges: NaN, infinities, 0, tiny and huge.
        fn array() -> impl Strategy<Value = Bytes> {
            let value = prop_oneof![
                any::<u32>(),
                prop::sample::select(vec![
                    0,
                    1,
                    f32::NAN.to_bits(),
                    f32::INFINITY.to_bits(),
                    (-0.5f32).to_bits(),
                    u32::MAX,
                ]),
            ];
            let whole = prop::collection::vec(value, 0..12).prop_map(|v| pack_u32(&v));
            let ragged = prop::collection::vec(any::<u8>(), 0..9).prop_map(Bytes::from);
            prop_oneof![4 => whole, 1 => ragged]
        }

        fn wire_rollout() -> impl Strategy<Value = v1::Rollout> {
            let ids = (
                prop::sample::select(vec!["", "r", "r\"quoted\""]),
                prop::sample::select(vec!["", "g"]),
            );
            let arrays = (array(), array(), array(), array(), array());
            let scalars = (any::<f32>(), any::<i32>(), 0u64..4);
            (ids, arrays, scalars).prop_map(|((id, g), (p, t, lp, v, tr), (reward, fin, inc))| {
                v1::Rollout {
                    rollout_id: id.into(),
                    group_id: g.into(),
                    prompt_tokens: p,
                    response_tokens: t,
                    behavior_logprobs: lp,
                    token_versions: v,
                    reward,
                    token_rewards: tr,
                    finish_reason: fin,
                    learner_incarnation: inc,
                    ..Default::default()
                }
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

            #[test]
            fn any_rollout_is_accepted_or_refused_by_name(
                w in wire_rollout(),
                len in 0usize..2000,
                version in any::<u64>(),
                max_tokens in 0usize..16,
                lineage in any::<bool>(),
            ) {
                let id = w.rollout_id.clone();
                let history = Lineage::new(vec![
                    Incarnation { id: 1, first_version: 0 },
                    Incarnation { id: 2, first_version: version / 2 },
                ], version).unwrap();
                let limits = Limits {
                    max_tokens,
                    max_rollout_bytes: 1000,
                    learner_version: version,
                    lineage: lineage.then_some(&history),
                };
                let judged = wire::rollout_from_wire(w).and_then(|r| check(&r, len, limits));
                if let Err(e) = judged {
                    prop_assert!(LABELS.contains(&e.label), "unknown label {}", e.label);
                    prop_assert!(e.reason.contains(&format!("{id:?}")), "{}", e.reason);
                    prop_assert!(e.reason.len() > id.len() + 20, "{}", e.reason);
                }
            }
        }
    }
}
