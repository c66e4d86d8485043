//! The decoder-only transformer of the Llama/Qwen2 family, in the order data
//! flows through it: embedding, N × (RMSNorm → grouped-query attention with
//! rotary positions → residual, RMSNorm → SwiGLU MLP → residual), final
//! RMSNorm, LM head (tied to the embedding or not).
//!
//! Field names follow the Hugging Face checkpoints (`layers.N.self_attn.
//! q_proj`, ...), so loading one is a matter of the `model.` prefix and
//! Burn's names for norm scales. Weights are immutable during generation;
//! the per-request state lives in [`KvCache`].

use burn::{
    module::Initializer,
    nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig},
    prelude::*,
};

use crate::{
    adapters::{Adapters, LayerAdapters, LoraPair, Target},
    cache::KvCache,
    config::ModelConfig,
    device::Precision,
    kernels,
    packing::Segments,
    rope::{Rope, SegmentTables},
};

/// A layer's adapters and how to apply them, when the model has any.
type LayerLora<'a> = Option<(&'a Adapters, &'a LayerAdapters)>;

/// Where a pass's tokens sit: the rotary tables, and either the absolute
/// position of the first token (after a cache) or the packed sequences of
/// each row (`packing.rs`) with their tables, positions restarting per
/// sequence.
#[derive(Clone, Copy)]
struct At<'a> {
    rope: &'a Rope,
    start: usize,
    segments: Option<&'a Segments>,
    tables: Option<&'a SegmentTables>,
}

impl At<'_> {
    fn rotate(&self, x: Tensor<4>) -> Tensor<4> {
        match self.tables {
            Some(t) => Rope::apply_tables(x, t),
            None => self.rope.apply(x, self.start),
        }
    }
}

/// HF's `initializer_range` default.
const INIT_STD: f64 = 0.02;

fn dense(d_in: usize, d_out: usize, bias: bool, device: &Device) -> Linear {
    LinearConfig::new(d_in, d_out)
        .with_bias(bias)
        .with_initializer(Initializer::Normal {
            mean: 0.0,
            std: INIT_STD,
        })
        .init(device)
}

#[derive(Module, Debug)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl Attention {
    fn init(c: &ModelConfig, device: &Device) -> Self {
        let (h, hd) = (c.hidden_size, c.head_dim());
        let (nh, nkv) = (c.num_attention_heads, c.kv_heads());
        Self {
            q_proj: dense(h, nh * hd, c.qkv_bias(), device),
            k_proj: dense(h, nkv * hd, c.qkv_bias(), device),
            v_proj: dense(h, nkv * hd, c.qkv_bias(), device),
            o_proj: dense(nh * hd, h, false, device),
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        }
    }

    /// `x`: `[batch·seq, hidden]`, the rows of `batch` sequences of `seq`
    /// tokens placed by `at`.
    fn forward(
        &self,
        x: Tensor<2>,
        (b, t): (usize, usize),
        at: At<'_>,
        cache: Option<(&mut KvCache, usize)>,
        lora: LayerLora<'_>,
    ) -> Tensor<2> {
        let (nh, nkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let proj = |l: &Linear, t: Target, x: Tensor<2>| project(l, adapter(lora, t), x);
        // The fused kernels read the projections in their own
        // `[b, t, heads, hd]` layout: no transpose is materialised.
        let heads = |y: Tensor<2>, n: usize| y.reshape([b, t, n, hd]);
        let q = at.rotate(heads(proj(&self.q_proj, Target::Q, x.clone()), nh));
        let k = at.rotate(heads(proj(&self.k_proj, Target::K, x.clone()), nkv));
        let v = heads(proj(&self.v_proj, Target::V, x), nkv);
        let out = match (cache, at.segments) {
            (Some((c, layer)), _) => {
                let (kc, vc) = c.append(layer, k, v);
                kernels::cached_attention(q, kc, vc, at.start)
            }
            // Whole sequences (training, scoring), one or several a row.
            (None, Some(s)) => kernels::segment_attention(q, k, v, s),
            (None, None) => kernels::causal_attention(q, k, v),
        };
        proj(&self.o_proj, Target::O, out.reshape([b * t, nh * hd]))
    }
}

/// The adapter of projection `t`, with the adapters' settings.
fn adapter(lora: LayerLora<'_>, t: Target) -> Option<(&Adapters, &LoraPair)> {
    lora.and_then(|(all, layer)| layer.get(t).map(|p| (all, p)))
}

/// A Burn `Linear` (its record is the HF checkpoint's projection) applied
/// through [`kernels::linear`], which speeds up decoding. The weight is
/// cast to the activations' dtype: a no-op at f32, and under autodiff the
/// cast's backward returns the gradient to the f32 master weight. An
/// adapter adds its low-rank update on the side (`lora.rs`).
fn project(l: &Linear, lora: Option<(&Adapters, &LoraPair)>, x: Tensor<2>) -> Tensor<2> {
    let dt = x.dtype();
    let delta = lora.map(|(all, pair)| all.delta(pair, x.clone()));
    let y = kernels::linear(
        x,
        l.weight.val().cast(dt),
        l.bias.as_ref().map(|b| b.val().cast(dt)),
    );
    match delta {
        Some(d) => y + d,
        None => y,
    }
}

/// Burn's `RmsNorm` module (its record is the HF checkpoint's norm
/// weight) applied through the fused kernel. Always computed in f32, as
/// HF's `LlamaRMSNorm` does: a mean of squares overflows f16 once an
/// activation passes 256.
fn norm(n: &RmsNorm, x: Tensor<2>) -> Tensor<2> {
    let dt = x.dtype();
    let f32 = burn::tensor::FloatDType::F32;
    kernels::rms_norm(x.cast(f32), n.gamma.val().cast(f32), n.epsilon).cast(dt)
}

#[derive(Module, Debug)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    fn init(c: &ModelConfig, device: &Device) -> Self {
        let (h, f) = (c.hidden_size, c.intermediate_size);
        Self {
            gate_proj: dense(h, f, false, device),
            up_proj: dense(h, f, false, device),
            down_proj: dense(f, h, false, device),
        }
    }

    fn forward(&self, x: Tensor<2>, lora: LayerLora<'_>) -> Tensor<2> {
        let gate = project(&self.gate_proj, adapter(lora, Target::Gate), x.clone());
        let up = project(&self.up_proj, adapter(lora, Target::Up), x);
        project(
            &self.down_proj,
            adapter(lora, Target::Down),
            kernels::swiglu(gate, up),
        )
    }
}

#[derive(Module, Debug)]
pub struct DecoderLayer {
    pub input_layernorm: RmsNorm,
    pub self_attn: Attention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: Mlp,
}

impl DecoderLayer {
    /// The residual stream after this layer: `x` plus attention, plus the
    /// MLP, on `[batch·seq, hidden]` rows.
    fn forward(
        &self,
        x: Tensor<2>,
        (b, t): (usize, usize),
        at: At<'_>,
        cache: Option<(&mut KvCache, usize)>,
        lora: LayerLora<'_>,
    ) -> Tensor<2> {
        let h = norm(&self.input_layernorm, x.clone());
        let x = x + self.self_attn.forward(h, (b, t), at, cache, lora);
        let h = self
            .mlp
            .forward(norm(&self.post_attention_layernorm, x.clone()), lora);
        x + h
    }

    fn init(c: &ModelConfig, device: &Device) -> Self {
        let norm = || {
            RmsNormConfig::new(c.hidden_size)
                .with_epsilon(c.rms_norm_eps)
                .init(device)
        };
        Self {
            input_layernorm: norm(),
            self_attn: Attention::init(c, device),
            post_attention_layernorm: norm(),
            mlp: Mlp::init(c, device),
        }
    }
}

#[derive(Module, Debug)]
pub struct Transformer {
    pub embed_tokens: Embedding,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// `None` when tied to `embed_tokens`.
    pub lm_head: Option<Linear>,
    /// The dtype activations and matmuls run in; not part of the record.
    /// The weights keep their own dtype (f32 masters on the learner) and
    /// are cast at use; logits leave in f32.
    #[module(skip)]
    pub compute: Precision,
    /// LoRA adapters beside the projections, when the base is frozen and
    /// only they train (`lora.rs`).
    pub lora: Option<Adapters>,
}

impl Transformer {
    /// Random weights (normal, std 0.02; norms at 1), as HF initialises.
    pub fn init(c: &ModelConfig, device: &Device) -> Self {
        Self {
            embed_tokens: EmbeddingConfig::new(c.vocab_size, c.hidden_size)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: INIT_STD,
                })
                .init(device),
            layers: (0..c.num_hidden_layers)
                .map(|_| DecoderLayer::init(c, device))
                .collect(),
            norm: RmsNormConfig::new(c.hidden_size)
                .with_epsilon(c.rms_norm_eps)
                .init(device),
            lm_head: (!c.tie_word_embeddings)
                .then(|| dense(c.hidden_size, c.vocab_size, false, device)),
            compute: Precision::F32,
            lora: None,
        }
    }

    /// The same weights, computing in `precision`.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.compute = precision;
        self
    }

    /// Logits `[batch, seq, vocab]` for `tokens` `[batch, seq]`. With a
    /// cache, the tokens continue the cached positions and the cache grows.
    pub fn forward(
        &self,
        tokens: Tensor<2, Int>,
        rope: &Rope,
        cache: Option<&mut KvCache>,
    ) -> Tensor<3> {
        let [b, t] = tokens.dims();
        let logits = self.head(self.hidden(tokens, rope, cache, None));
        let v = logits.dims()[1];
        logits.reshape([b, t, v])
    }

    /// [`Transformer::forward`] of rows that each pack several whole
    /// sequences (`segments`): every sequence's logits as if it were alone.
    pub fn forward_packed(
        &self,
        tokens: Tensor<2, Int>,
        rope: &Rope,
        segments: &Segments,
    ) -> Tensor<3> {
        let [b, t] = tokens.dims();
        let logits = self.head(self.hidden(tokens, rope, None, Some(segments)));
        let v = logits.dims()[1];
        logits.reshape([b, t, v])
    }

    /// Logits `[batch, vocab]` of the last position only: what decoding
    /// needs, without the LM head over the rest of a prompt.
    pub fn forward_last(
        &self,
        tokens: Tensor<2, Int>,
        rope: &Rope,
        cache: Option<&mut KvCache>,
    ) -> Tensor<2> {
        let [b, t] = tokens.dims();
        let x = self.hidden(tokens, rope, cache, None);
        let h = x.dims()[1];
        let last = if t == 1 {
            x
        } else {
            x.reshape([b, t, h]).narrow(1, t - 1, 1).reshape([b, h])
        };
        self.head(last)
    }

    /// The residual stream after the last layer, `[batch·seq, hidden]`.
    fn hidden(
        &self,
        tokens: Tensor<2, Int>,
        rope: &Rope,
        mut cache: Option<&mut KvCache>,
        segments: Option<&Segments>,
    ) -> Tensor<2> {
        let [b, t] = tokens.dims();
        let start = cache.as_ref().map_or(0, |c| c.len());
        let tables = segments.and_then(|s| rope.segment_tables(s));
        let at = At {
            rope,
            start,
            segments,
            tables: tables.as_ref(),
        };
        // The residual stream is kept as `[batch·seq, hidden]` rows: every
        // projection is then one 2-D matmul that packs its weight once. As
        // `[batch, seq, hidden]` Burn runs a batched matmul that re-packs
        // the weight for every sequence (measured: the LM head alone took
        // 16 packings of the embedding per training step at batch 16).
        let mut x = self.embed(tokens);
        for (i, layer) in self.layers.iter().enumerate() {
            let lora = self.lora.as_ref().map(|a| (a, &a.layers[i]));
            let cache = cache.as_deref_mut().map(|c| (c, i));
            x = layer.forward(x, (b, t), at, cache, lora);
        }
        if let Some(c) = cache {
            c.advance(t);
        }
        x
    }

    /// The embedded tokens `[batch, seq]` as `[batch·seq, hidden]` rows in
    /// the compute dtype: the residual stream before the first layer.
    pub fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<2> {
        let [b, t] = tokens.dims();
        self.embed_tokens
            .forward(tokens)
            .reshape([b * t, self.embed_tokens.weight.dims()[1]])
            .cast(self.compute.dtype())
    }

    /// Layer `i` alone on the residual stream `x` of `batch` rows of
    /// `seq` tokens (no cache), each row one sequence or the packed
    /// `segments`: what a pass that checkpoints layers recomputes one at a
    /// time.
    pub fn layer(
        &self,
        i: usize,
        x: Tensor<2>,
        (b, t): (usize, usize),
        rope: &Rope,
        segments: Option<&Segments>,
    ) -> Tensor<2> {
        let lora = self.lora.as_ref().map(|a| (a, &a.layers[i]));
        let tables = segments.and_then(|s| rope.segment_tables(s));
        let at = At {
            rope,
            start: 0,
            segments,
            tables: tables.as_ref(),
        };
        self.layers[i].forward(x, (b, t), at, None, lora)
    }

    /// Final norm and LM head: `[rows, hidden]` → `[rows, vocab]`, in f32
    /// whatever the compute dtype (log-probs and sampling read them).
    pub fn head(&self, x: Tensor<2>) -> Tensor<2> {
        let x = norm(&self.norm, x);
        let dt = x.dtype();
        let logits = match &self.lm_head {
            Some(head) => project(head, None, x),
            // Tied: the embedding matrix `[vocab, hidden]` read transposed.
            None => kernels::linear(x, self.embed_tokens.weight.val().cast(dt).transpose(), None),
        };
        logits.cast(burn::tensor::FloatDType::F32)
    }
}
