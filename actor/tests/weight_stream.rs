//! The weight stream is outside input: whatever the learner's socket
//! delivers (a bogus header, chunks that overrun or stop short, a payload
//! that is garbage under a valid checksum), assembling and loading it ends
//! in the new weights or a named `TransferError`, never a panic.

use std::sync::OnceLock;

use bapo_actor::subscription::{Assembly, TransferError};
use bapo_policy::{burn::prelude::*, weights};
use bapo_proto::v1::WeightUpdate;
use proptest::prelude::*;

/// One real update of the tiny model: its announcement and payload.
fn published() -> &'static (WeightUpdate, Vec<u8>) {
    static P: OnceLock<(WeightUpdate, Vec<u8>)> = OnceLock::new();
    P.get_or_init(|| {
        let p = bapo_policy::testing::tiny_policy(7);
        let config = p.config.clone();
        let (header, payload) = weights::encode(&p.model, 7).unwrap();
        let update = WeightUpdate {
            version: 7,
            header: header.to_bytes().to_vec().into(),
            payload_len: payload.len() as u64,
            chunks: 1,
            model_config_json: serde_json::to_string(&config).unwrap(),
            incarnation: 3,
            ..Default::default()
        };
        (update, payload.to_vec())
    })
}

/// Feeds `payload` in chunks of the given sizes (the rest in one), then
/// loads: `Ok(None)` when the stream ended before the payload did.
fn deliver(
    update: WeightUpdate,
    payload: &[u8],
    cuts: &[usize],
) -> Result<Option<u64>, TransferError> {
    let mut a = Assembly::new(update);
    let mut rest = payload;
    let mut done = false;
    for &c in cuts.iter().chain(std::iter::once(&usize::MAX)) {
        let (chunk, tail) = rest.split_at(c.min(rest.len()));
        rest = tail;
        done = a.push(chunk)?;
        if done || rest.is_empty() {
            break;
        }
    }
    if !done {
        return Ok(None);
    }
    a.finish(&Device::flex(), Default::default(), None)
        .and_then(bapo_actor::subscription::Loaded::policy)
        .map(|v| Some(v.version))
}

#[test]
fn an_intact_update_loads_in_any_chunking() {
    let (u, payload) = published();
    for cuts in [vec![], vec![1], vec![7, 1000, 3], vec![payload.len() - 1]] {
        assert_eq!(deliver(u.clone(), payload, &cuts).unwrap(), Some(7));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_flipped_bit_anywhere_is_refused_by_name(
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
        in_header in any::<bool>(),
    ) {
        let (u, payload) = published();
        let (mut u, mut payload) = (u.clone(), payload.clone());
        if in_header {
            let mut h = u.header.to_vec();
            let i = at.index(h.len());
            h[i] ^= 1 << bit;
            u.header = h.into();
        } else {
            let i = at.index(payload.len());
            payload[i] ^= 1 << bit;
        }
        let r = deliver(u, &payload, &[]);
        prop_assert!(matches!(r, Err(TransferError::Invalid { .. })), "{r:?}");
    }

    #[test]
    fn truncated_or_overlong_payloads_never_load(
        keep in any::<prop::sample::Index>(),
        extra in prop::collection::vec(any::<u8>(), 1..64),
        cuts in prop::collection::vec(1usize..4096, 0..6),
        overlong in any::<bool>(),
    ) {
        let (u, payload) = published();
        let mut bytes = payload.clone();
        if overlong {
            bytes.extend_from_slice(&extra);
        } else {
            bytes.truncate(keep.index(payload.len()));
        }
        match deliver(u.clone(), &bytes, &cuts) {
            Ok(None) => prop_assert!(!overlong, "an overlong payload must be refused"),
            Ok(Some(_)) => prop_assert!(false, "a damaged payload loaded"),
            Err(e) => prop_assert!(matches!(e, TransferError::Invalid { .. }), "{e}"),
        }
    }

    /// Garbage that carries a valid checksum reaches the burnpack decoder
    /// itself, and must still come back as an error.
    #[test]
    fn garbage_under_a_valid_checksum_is_refused(
        garbage in prop::collection::vec(any::<u8>(), 0..2048),
        announced in any::<u64>(),
        config_json in prop_oneof![
            Just(String::new()),
            Just("{}".to_string()),
            "[a-z{}\":,0-9 ]{0,64}",
        ],
        use_real_config in any::<bool>(),
    ) {
        let (u, _) = published();
        let header = weights::WeightsHeader {
            policy_version: 7,
            payload_len: garbage.len() as u64,
            crc32: crc32fast::hash(&garbage),
        };
        let mut bogus = WeightUpdate {
            version: 7,
            header: header.to_bytes().to_vec().into(),
            payload_len: garbage.len() as u64,
            chunks: 1,
            model_config_json: if use_real_config { u.model_config_json.clone() } else { config_json },
            incarnation: 1,
            ..Default::default()
        };
        prop_assert!(deliver(bogus.clone(), &garbage, &[]).is_err() || garbage.is_empty());
        // An absurd announced length must not allocate it up front.
        bogus.payload_len = announced;
        let _ = deliver(bogus, &garbage, &[64]);
    }
}

/// An adapter update is applied only to the base it names: without a
/// base, or with another one, it is refused by name; with it, it loads.
#[test]
fn adapters_load_only_onto_the_base_they_name() {
    use bapo_actor::subscription::{Base, Loaded};
    use bapo_policy::{lora, weights::Encoding};
    let p = bapo_policy::testing::tiny_policy(8);
    let adapted = lora::attach(p.model.clone(), &p.config, &Default::default());
    let adapters = adapted.lora.as_ref().unwrap();
    let fp = lora::fingerprint(&p.model);
    let (header, payload) = weights::encode_adapters(adapters, 4, Encoding::F32, fp).unwrap();
    let update = WeightUpdate {
        version: 4,
        header: header.to_bytes_adapters(Encoding::F32).to_vec().into(),
        payload_len: payload.len() as u64,
        chunks: 1,
        model_config_json: serde_json::to_string(&p.config).unwrap(),
        incarnation: 3,
        base_fingerprint: fp,
        ..Default::default()
    };
    let load = |base: Option<&Base>| {
        let mut a = Assembly::new(update.clone());
        assert!(a.push(&payload).unwrap());
        a.finish(&Device::flex(), Default::default(), base)
    };
    let held = |fingerprint| Base {
        fingerprint,
        config: p.config.clone(),
        model: p.model.clone(),
    };
    for base in [None, Some(held(fp ^ 1))] {
        let Err(e) = load(base.as_ref()) else {
            panic!("adapters loaded without their base");
        };
        let e = e.to_string();
        assert!(e.contains("does not hold"), "{e}");
    }
    match load(Some(&held(fp))).unwrap() {
        Loaded::Policy(v) => assert!(v.policy().unwrap().model.lora.is_some() && v.version == 4),
        Loaded::Base(_) => panic!("adapters loaded as a base"),
    }
}
