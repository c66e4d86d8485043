//! Names of the actor's Prometheus metrics.

pub const TOKENS: &str = "bapo_actor_tokens_total";
pub const GROUPS: &str = "bapo_actor_groups_total";
pub const REWARD: &str = "bapo_actor_reward";
pub const RESPONSE_TOKENS: &str = "bapo_actor_response_tokens";
pub const WEIGHT_VERSION: &str = "bapo_actor_weight_version";
pub const VERSIONS_BEHIND: &str = "bapo_actor_versions_behind";
pub const BACKPRESSURE_SECONDS: &str = "bapo_actor_backpressure_seconds";
pub const GROUP_SECONDS: &str = "bapo_actor_group_seconds";
pub const RECONNECTS: &str = "bapo_actor_reconnects_total";
pub const WEIGHT_APPLY_SECONDS: &str = "bapo_actor_weight_apply_seconds";
/// CRC32 of the payload of the version in use (the learner's
/// `bapo_learner_weight_crc` for the same version).
pub const WEIGHT_CRC: &str = "bapo_actor_weight_crc";
/// Label `kind`: `snapshot` or `delta`; and deltas refused, by `reason`.
pub const WEIGHT_UPDATES: &str = "bapo_actor_weight_updates_total";
pub const WEIGHT_DELTAS_REFUSED: &str = "bapo_actor_weight_deltas_refused_total";
pub const ABORTED_GROUPS: &str = "bapo_actor_aborted_groups_total";
pub const SLOT_FAILURES: &str = "bapo_actor_slot_failures_total";
pub const PROBLEMS_SKIPPED: &str = "bapo_actor_problems_skipped_total";
pub const REWARD_SECONDS: &str = "bapo_actor_reward_seconds";
pub const REWARD_ERRORS: &str = "bapo_actor_reward_errors_total";
pub const REWARD_GROUPS_DROPPED: &str = "bapo_actor_reward_groups_dropped_total";
pub const REWARD_SUB_SCORE: &str = "bapo_actor_reward_sub_score";
pub const LEASE_WAIT_SECONDS: &str = "bapo_actor_lease_wait_seconds";
pub const LEASE_WEIGHT_WAIT_SECONDS: &str = "bapo_actor_lease_weight_wait_seconds";
pub const LEASE_WEIGHT_TIMEOUTS: &str = "bapo_actor_lease_weight_timeouts_total";
pub const LEASES_RELEASED: &str = "bapo_actor_leases_released_total";
pub const ENGINE_RELOAD_SECONDS: &str = "bapo_actor_engine_reload_seconds";
pub const ENGINE_RELOAD_FAILURES: &str = "bapo_actor_engine_reload_failures_total";
/// Patches the transfer engine refused (the version then came by reload).
pub const ENGINE_TRANSFER_FALLBACKS: &str = "bapo_actor_engine_transfer_fallbacks_total";
pub const ENGINE_PATCH_BYTES: &str = "bapo_actor_engine_patch_bytes_total";
pub const ENGINE_RESTARTS: &str = "bapo_actor_engine_restarts_total";
pub const ENGINE_DOWN_GROUPS: &str = "bapo_actor_engine_down_groups_total";
pub const ENV_SECONDS: &str = "bapo_actor_env_seconds";
pub const ENV_ERRORS: &str = "bapo_actor_env_errors_total";
pub const EPISODES_DROPPED: &str = "bapo_actor_episodes_dropped_total";
pub const EPISODE_TURNS: &str = "bapo_actor_episode_turns";
pub const OBSERVATION_TOKEN_SHARE: &str = "bapo_actor_observation_token_share";
pub const OBSERVATIONS_TRUNCATED: &str = "bapo_actor_observations_truncated_total";
pub const TOOL_CALLS: &str = "bapo_actor_tool_calls_total";

pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(TOKENS, "Response tokens generated");
    describe_histogram!(
        ENV_SECONDS,
        Unit::Seconds,
        "Environment calls (reset, step), retries included, by call"
    );
    describe_counter!(
        ENV_ERRORS,
        "Environment calls that failed, by call and reason (each attempt)"
    );
    describe_counter!(
        EPISODES_DROPPED,
        "Episodes given up, by reason (their group is not pushed)"
    );
    describe_histogram!(EPISODE_TURNS, "Model turns per finished episode");
    describe_histogram!(
        OBSERVATION_TOKEN_SHARE,
        "Share of an episode's response tokens written by the environment"
    );
    describe_counter!(
        OBSERVATIONS_TRUNCATED,
        "Observations cut to actor.env.max_observation_tokens"
    );
    describe_counter!(TOOL_CALLS, "Steps the environment marked as tool calls");
    describe_histogram!(
        ENGINE_RELOAD_SECONDS,
        Unit::Seconds,
        "vLLM engine: one weight version from arrival to served, by path (transfer: a patch in place; reload: from a file)"
    );
    describe_counter!(
        ENGINE_TRANSFER_FALLBACKS,
        "vLLM engine: patches that failed; the version was reloaded from a file"
    );
    describe_counter!(
        ENGINE_PATCH_BYTES,
        Unit::Bytes,
        "vLLM engine: bytes of the weight patches written for the transfer engine"
    );
    describe_counter!(
        ENGINE_RELOAD_FAILURES,
        "vLLM engine: weight reloads that failed (the version is retried)"
    );
    describe_counter!(
        ENGINE_RESTARTS,
        "vLLM engine: restarts of a server the actor started"
    );
    describe_counter!(
        ENGINE_DOWN_GROUPS,
        "vLLM engine: groups dropped because the server went down while generating"
    );
    describe_counter!(
        GROUPS,
        "Groups generated, scored and accepted by the buffer"
    );
    describe_histogram!(REWARD, "Reward of each response");
    describe_histogram!(RESPONSE_TOKENS, "Length of each response in tokens");
    describe_gauge!(WEIGHT_VERSION, "Policy version of the weights in use");
    describe_gauge!(
        WEIGHT_CRC,
        "CRC32 of the payload of the weights in use (the learner's for that version)"
    );
    describe_counter!(
        WEIGHT_UPDATES,
        "Weight versions received, by kind (snapshot, delta)"
    );
    describe_counter!(
        WEIGHT_DELTAS_REFUSED,
        "Deltas refused (another base, a corrupted result, malformed), by reason; a snapshot follows"
    );
    describe_gauge!(
        VERSIONS_BEHIND,
        "Learner version (as the buffer reports it) minus the version in use"
    );
    describe_histogram!(
        BACKPRESSURE_SECONDS,
        Unit::Seconds,
        "Per group, the time from the first push attempt to the buffer's ack"
    );
    describe_histogram!(
        GROUP_SECONDS,
        Unit::Seconds,
        "Time to generate and score a group"
    );
    describe_counter!(RECONNECTS, "Reconnections, by peer (buffer, learner)");
    describe_histogram!(
        WEIGHT_APPLY_SECONDS,
        Unit::Seconds,
        "From a weight update's announcement to the new weights in use"
    );
    describe_counter!(
        ABORTED_GROUPS,
        "In-flight groups thrown away (restart mode, new learner incarnation, shutdown)"
    );
    describe_counter!(
        SLOT_FAILURES,
        "Generation slots that failed; the actor exits non-zero after the first"
    );
    describe_counter!(
        PROBLEMS_SKIPPED,
        "Problems skipped before generation, by reason (prompt_too_long)"
    );
    describe_histogram!(
        REWARD_SECONDS,
        Unit::Seconds,
        "Per scoring call (built-in verifier or reward service), its duration"
    );
    describe_counter!(
        REWARD_ERRORS,
        "Failed scoring calls, by reason (timeout, unavailable, capacity, not_found, refused, unauthorized, error, \
         bad_range, bad_answer, not_finite, out_of_range); each is retried"
    );
    describe_counter!(
        REWARD_GROUPS_DROPPED,
        "Groups dropped unscored after the last retry, by the last call's reason"
    );
    describe_histogram!(
        REWARD_SUB_SCORE,
        "Named sub-scores a reward service returns (format, correctness...), by name"
    );
    describe_histogram!(
        LEASE_WAIT_SECONDS,
        Unit::Seconds,
        "Per group, from the first lease request to the buffer's grant"
    );
    describe_histogram!(
        LEASE_WEIGHT_WAIT_SECONDS,
        Unit::Seconds,
        "Per leased group, from the grant to weights at least as new as its learner version"
    );
    describe_counter!(
        LEASE_WEIGHT_TIMEOUTS,
        "Leased groups generated with older weights after lease_weight_wait_s (learner down?)"
    );
    describe_counter!(
        LEASES_RELEASED,
        "Leases given back to the buffer because their group was dropped (its room freed at once)"
    );
}
