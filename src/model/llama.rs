//! The LLaMA decoder: embedding, N × (RMSNorm → GQA attention with RoPE → residual, RMSNorm →
//! SwiGLU MLP → residual), final RMSNorm, LM head. Variables live in a `tch::nn::VarStore` under
//! Hugging Face names (`model.layers.3.self_attn.q_proj.weight`), so a checkpoint is a
//! transformers checkpoint.
//!
//! Precision: master weights are fp32. With `compute = BFloat16` every matmul runs on bf16 casts
//! of the weights and activations (autocast semantics), while RMSNorm statistics, the residual
//! stream and the loss stay fp32.

use std::collections::HashMap;
use std::sync::Arc;

use tch::nn::{Init, Path};
use tch::{Kind, Reduction, Tensor};

use super::context_parallel::ContextParallel;
use super::documents::DocumentMask;
use super::expert_parallel::ExpertParallel;
use super::flash;
use super::moe::{Mlp, RouterLog, RouterLogCell, Routing, SwiGlu};
use super::params::Parameters;
use super::rope::Rope;
use super::shape::{AttentionBackend, LlamaShape};
use super::split::TensorParallel;
use super::units::{
    chunks, counted_targets, wide, ActivationMemory, GradUnit, NoEvents, UnitEvents,
};

pub(super) struct Layer {
    pub(super) input_layernorm: Tensor,
    pub(super) q_proj: Tensor,
    pub(super) k_proj: Tensor,
    pub(super) v_proj: Tensor,
    pub(super) o_proj: Tensor,
    /// Qwen3: the RMSNorm weights [head_dim] of each query and key head, before RoPE.
    pub(super) q_norm: Option<Tensor>,
    pub(super) k_norm: Option<Tensor>,
    pub(super) post_attention_layernorm: Tensor,
    /// The dense SwiGLU MLP or a mixture of experts (moe.rs).
    pub(super) mlp: Mlp,
}

/// A decoder layer's two halves, each `x + B(norm(x))`: attention, then the SwiGLU MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Half {
    Attention,
    Mlp,
}

/// A micro-batch's rows: batch and sequence length (a tensor-parallel rank's residual stream
/// is flat tokens; attention needs the rows).
#[derive(Debug, Clone, Copy)]
pub(super) struct Rows {
    pub(super) batch: i64,
    pub(super) seq: i64,
}

impl Rows {
    /// The rows of token ids [batch, seq].
    pub(super) fn of(tokens: &Tensor) -> Rows {
        let size = tokens.size();
        Rows {
            batch: size[0],
            seq: size[1],
        }
    }
}

pub struct Llama {
    /// The whole model's shape (with tensor parallelism, each rank holds a part of it).
    pub shape: LlamaShape,
    /// [vocab, hidden]; with tensor parallelism this rank's rows of the padded vocabulary.
    pub(super) embed_tokens: Tensor,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: Tensor,
    /// None when tied to `embed_tokens`.
    lm_head: Option<Tensor>,
    rope: Rope,
    compute: Kind,
    memory: ActivationMemory,
    /// Attention and KV heads this rank computes (all of them without tensor parallelism).
    heads: usize,
    kv_heads: usize,
    /// Tensor parallelism: this rank's place in its group and the group's collectives.
    pub(super) tp: Option<TensorParallel>,
    /// Context parallelism: this rank's place in its group, the group's collectives and the
    /// micro-batch in flight.
    pub(super) cp: Option<ContextParallel>,
    /// Expert parallelism: this rank's place in its group (whose experts it holds) and the
    /// group's all-to-alls.
    pub(super) ep: Option<ExpertParallel>,
    /// Every parameter: name, whole shape, initialisation, split, unit.
    parameters: Arc<Parameters>,
    /// Weight of the router z-loss in the training objective (`model.router_z_loss_coef`).
    router_z_loss: f64,
    /// The router's figures since the trainer last read them (MoE models).
    router_log: RouterLogCell,
}

/// A whole model's training objective through autograd ([`Llama::objective`]).
pub struct Objective {
    /// The mean next-token cross-entropy (0-dim fp32): the loss the log shows.
    pub cross_entropy: Tensor,
    /// A MoE model's load-balancing loss (transformers' `aux_loss`, unweighted).
    pub aux: Option<Tensor>,
    /// A MoE model's router z-loss (unweighted).
    pub z: Option<Tensor>,
    /// Their weights (`model.router_aux_loss_coef`, `model.router_z_loss_coef`).
    weights: (f64, f64),
}

impl Objective {
    /// What training minimises: the cross-entropy plus the weighted router losses.
    pub fn total(&self) -> Tensor {
        // Out of place: tch's `+=` is add_, which would change `cross_entropy` itself.
        let aux = self.aux.as_ref().map(|aux| aux * self.weights.0);
        let z = self.z.as_ref().filter(|_| self.weights.1 > 0.0);
        let z = z.map(|z| z * self.weights.1);
        [aux, z]
            .into_iter()
            .flatten()
            .fold(self.cross_entropy.shallow_clone(), |t, term| t + term)
    }
}

/// Keys and values of the tokens seen so far, per layer, for KV-cached decoding: buffers of
/// [batch, kv_heads, capacity, head_dim] in the compute dtype, filled up to `len` positions.
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// Room for `capacity` positions of `batch` sequences (at most the model's RoPE table).
    pub fn new(model: &Llama, batch: usize, capacity: usize) -> KvCache {
        let s = &model.shape;
        let dims = [
            batch as i64,
            model.kv_heads as i64,
            capacity as i64,
            s.head_dim() as i64,
        ];
        let opts = (model.compute, model.embed_tokens.device());
        let layers = (0..s.num_layers)
            .map(|_| (Tensor::zeros(dims, opts), Tensor::zeros(dims, opts)))
            .collect();
        KvCache {
            layers,
            len: 0,
            capacity,
        }
    }

    /// Positions already cached (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Creates one parameter: `make(full name, shape, initialisation)` gives the tensor the model
/// holds ([`init_parameter`] for the whole value; zero stage 3 an empty placeholder).
pub type MakeParameter<'a> = dyn FnMut(&str, &[i64], Init) -> Tensor + 'a;

/// A parameter's initial value (what `Llama::new` gives it), drawn from libtorch's global RNG.
pub fn init_parameter(dims: &[i64], init: Init, device: tch::Device) -> Tensor {
    tch::nn::init(init, dims, device)
}

/// The parameter `name` (dotted, HF) with `value`, registered in the VarStore under `root` as
/// trainable.
fn register(root: &Path, name: &str, value: Tensor) -> Tensor {
    let (path, leaf) = name.rsplit_once('.').unwrap_or(("", name));
    let p = path
        .split('.')
        .filter(|c| !c.is_empty())
        .fold(root.clone(), |p, c| &p / c);
    p.add(leaf, value, true)
}

impl Llama {
    /// Creates the variables under `root` (normal(0, init_std) for matrices, ones for norms) and
    /// precomputes RoPE tables for `max_seq` positions.
    pub fn new(root: &Path, shape: &LlamaShape, max_seq: usize, compute: Kind) -> Llama {
        let device = root.device();
        Self::new_with(root, shape, max_seq, compute, &mut |_, dims, init| {
            init_parameter(dims, init, device)
        })
    }

    /// [`Llama::new`] with each parameter made by `make`, in creation order (the order of the
    /// random draws of a fresh initialisation): zero stage 3 builds the model from empty
    /// placeholders and initialises each rank's slices one parameter at a time, so no rank
    /// ever holds the whole model.
    pub fn new_with(
        root: &Path,
        shape: &LlamaShape,
        max_seq: usize,
        compute: Kind,
        make: &mut MakeParameter,
    ) -> Llama {
        Self::build(root, shape, max_seq, compute, (None, None), make)
    }

    /// [`Llama::new_with`] for one rank of a tensor-parallel group: every parameter is made
    /// whole by `make` (the same random draws as one rank's model) and this rank keeps its
    /// part ([`Split`]); a placeholder without elements (zero stage 3) is kept as it is.
    pub fn new_split(
        root: &Path,
        shape: &LlamaShape,
        max_seq: usize,
        compute: Kind,
        tp: TensorParallel,
        make: &mut MakeParameter,
    ) -> anyhow::Result<Llama> {
        Self::new_parallel(root, shape, max_seq, compute, (Some(tp), None), make)
    }

    /// [`Llama::new_with`] for one rank of a tensor-parallel group (`tp`, as
    /// [`Llama::new_split`]) and of an expert-parallel group (`ep`: of every MoE layer, this
    /// rank keeps its own experts only, `ExpertParallel::local_experts`; the others are made,
    /// so the random draws stay one rank's, and dropped).
    pub fn new_parallel(
        root: &Path,
        shape: &LlamaShape,
        max_seq: usize,
        compute: Kind,
        (tp, ep): (Option<TensorParallel>, Option<ExpertParallel>),
        make: &mut MakeParameter,
    ) -> anyhow::Result<Llama> {
        if let Some(tp) = &tp {
            crate::config::check_tensor_parallel(
                tp.size,
                (shape.num_heads, shape.num_kv_heads, &shape.mlp_widths()),
                "the model",
            )?;
        }
        if let Some(ep) = &ep {
            let experts = shape.moe.as_ref().map_or(0, |m| m.num_experts);
            anyhow::ensure!(
                experts > 0 && experts.is_multiple_of(ep.size),
                "system.expert_parallel = {} splits every MoE layer's experts among {} ranks, \
                 and the model has {experts} experts per layer (valid: a divisor of them)",
                ep.size,
                ep.size
            );
        }
        Ok(Self::build(root, shape, max_seq, compute, (tp, ep), make))
    }

    fn build(
        root: &Path,
        shape: &LlamaShape,
        max_seq: usize,
        compute: Kind,
        (tp, ep): (Option<TensorParallel>, Option<ExpertParallel>),
        make: &mut MakeParameter,
    ) -> Llama {
        let s = shape;
        let table = Arc::new(Parameters::of(s));
        let experts = s.moe.as_ref().map_or(0, |m| m.num_experts);
        let (first, local) = ep
            .as_ref()
            .map_or((0, experts), |e| e.local_experts(experts));
        let kept = |p: &super::params::Parameter| {
            p.expert.is_none_or(|e| (first..first + local).contains(&e))
        };
        // Each parameter made whole, in the table's order (the random draws'), and kept whole
        // or as this rank's part of it; a placeholder without elements (zero stage 3) as it is.
        // Another rank's experts are made and dropped.
        let mut made: HashMap<String, Tensor> = table
            .iter()
            .filter_map(|p| {
                let mut value = make(&p.name, &p.shape, p.init);
                if !kept(p) {
                    return None;
                }
                if let (Some(tp), true) = (&tp, value.numel() > 0) {
                    value = p.split.shard(&value, tp.rank, tp.size);
                }
                Some((p.name.clone(), register(root, &p.name, value)))
            })
            .collect();
        let mut take = |name: &str| {
            made.remove(name)
                .unwrap_or_else(|| panic!("internal: {name} is not in Llama's table"))
        };
        let embed_tokens = take("model.embed_tokens.weight");
        let layers = (0..s.num_layers)
            .map(|i| {
                let qk_norm = s.family.qk_norm();
                let mut at = |name: &str| take(&format!("model.layers.{i}.{name}.weight"));
                let mlp = match s.family.moe_names().filter(|_| s.is_sparse(i)) {
                    Some(n) => {
                        let b = n.block;
                        Mlp::Experts {
                            router: at(&format!("{b}.gate")),
                            experts: (first..first + local)
                                .map(|e| SwiGlu {
                                    gate: at(&format!("{b}.experts.{e}.{}", n.gate)),
                                    up: at(&format!("{b}.experts.{e}.{}", n.up)),
                                    down: at(&format!("{b}.experts.{e}.{}", n.down)),
                                })
                                .collect(),
                        }
                    }
                    None => Mlp::Dense(SwiGlu {
                        gate: at("mlp.gate_proj"),
                        up: at("mlp.up_proj"),
                        down: at("mlp.down_proj"),
                    }),
                };
                Layer {
                    q_norm: qk_norm.then(|| at("self_attn.q_norm")),
                    k_norm: qk_norm.then(|| at("self_attn.k_norm")),
                    input_layernorm: at("input_layernorm"),
                    q_proj: at("self_attn.q_proj"),
                    k_proj: at("self_attn.k_proj"),
                    v_proj: at("self_attn.v_proj"),
                    o_proj: at("self_attn.o_proj"),
                    post_attention_layernorm: at("post_attention_layernorm"),
                    mlp,
                }
            })
            .collect();
        let norm = take("model.norm.weight");
        let lm_head = (!s.tie_word_embeddings).then(|| take("lm_head.weight"));
        assert!(
            made.is_empty(),
            "internal: Llama's table holds parameters it does not use"
        );
        let hd = s.head_dim();
        let rope = Rope::new(hd, s.rope_theta, s.rope_scaling, max_seq, root.device());
        let parts = tp.as_ref().map_or(1, |t| t.size);
        Llama {
            heads: s.num_heads / parts,
            kv_heads: s.num_kv_heads / parts,
            tp,
            cp: None,
            ep,
            parameters: table,
            shape: s.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            compute,
            memory: ActivationMemory::default(),
            router_z_loss: 0.0,
            router_log: RouterLogCell::default(),
        }
    }

    /// Logits [batch, seq, vocab] for token ids [batch, seq] (int64), in the compute dtype.
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        self.forward_with(tokens, None)
    }

    /// `forward` of packed rows whose documents attend only within themselves and/or restart
    /// their positions, as `docs` says (None = plain causal rows).
    pub fn forward_with(&self, tokens: &Tensor, docs: Option<&DocumentMask>) -> Tensor {
        let hidden = self.hidden(tokens, docs, &mut NoEvents);
        self.lm_head(&hidden.expect("a whole model's logits"))
    }

    /// The final-normed hidden states [batch, seq, hidden] (fp32) the LM head reads, with a
    /// graph when called with one (a whole model only); `units` hears of each unit's use as in
    /// `forward_backward`.
    pub(super) fn hidden(
        &self,
        tokens: &Tensor,
        docs: Option<&DocumentMask>,
        units: &mut dyn UnitEvents,
    ) -> anyhow::Result<Tensor> {
        anyhow::ensure!(
            self.tp.is_none() && self.cp.is_none(),
            "internal: logits of a tensor- or context-parallel rank (its loss is `loss_units`)"
        );
        Ok(self.hidden_routed(tokens, docs, units)?.0)
    }

    /// [`Llama::hidden`] and how each MoE layer routed the tokens (decoder layer index, its
    /// routing), with their graph when called with one.
    fn hidden_routed(
        &self,
        tokens: &Tensor,
        docs: Option<&DocumentMask>,
        units: &mut dyn UnitEvents,
    ) -> anyhow::Result<(Tensor, Vec<(usize, Routing)>)> {
        let (x, routings) = self.stack_routed(tokens, docs, units)?;
        units.before(GradUnit::FinalNorm)?;
        let normed = self.final_norm(&x);
        units.after(GradUnit::FinalNorm)?;
        Ok((normed, routings))
    }

    /// The embedding and the decoder layers on this rank's tokens: the last layer's output,
    /// before the final norm — [batch, seq, hidden] on one rank, this rank's tokens [n/T,
    /// hidden] (all n of them without sequence parallelism) of a tensor-parallel one. With a
    /// graph when called with one (one rank only: a split model's graph is cut, backward.rs).
    pub(super) fn stack(
        &self,
        tokens: &Tensor,
        docs: Option<&DocumentMask>,
        units: &mut dyn UnitEvents,
    ) -> anyhow::Result<Tensor> {
        Ok(self.stack_routed(tokens, docs, units)?.0)
    }

    /// [`Llama::stack`] and each MoE layer's routing (its index, the routing).
    fn stack_routed(
        &self,
        tokens: &Tensor,
        docs: Option<&DocumentMask>,
        units: &mut dyn UnitEvents,
    ) -> anyhow::Result<(Tensor, Vec<(usize, Routing)>)> {
        let rows = Rows::of(tokens);
        units.before(GradUnit::Embedding)?;
        let mut x = self.leave(&self.embed_local(tokens))?;
        units.after(GradUnit::Embedding)?;
        let mut routings = Vec::new();
        for i in 0..self.layers.len() {
            units.before(GradUnit::Layer(i))?;
            let (out, routing) = self.layer(&x, i, docs, rows)?;
            units.after(GradUnit::Layer(i))?;
            routings.extend(routing.map(|r| (i, r)));
            x = out;
        }
        Ok((x, routings))
    }

    /// The token embeddings [batch, seq, hidden] (fp32) of ids [batch, seq]: the residual stream.
    pub(super) fn embed(&self, tokens: &Tensor) -> Tensor {
        let seq = tokens.size()[1] as usize;
        assert!(
            seq <= self.rope.max_len(),
            "sequence {seq} longer than the RoPE table"
        );
        // The residual stream is fp32 even when the weights themselves are bf16 (a sharded
        // optimizer keeps the fp32 masters apart); a no-op for fp32 weights.
        Tensor::embedding(&self.embed_tokens, tokens, -1, false, false).to_kind(wide(self.compute))
    }

    /// Decoder layer `i` on the residual stream `x`: its attention half, then its MLP half;
    /// the output, and a MoE layer's routing.
    pub(super) fn layer(
        &self,
        x: &Tensor,
        i: usize,
        docs: Option<&DocumentMask>,
        rows: Rows,
    ) -> anyhow::Result<(Tensor, Option<Routing>)> {
        let (mid, _) = self.half(Half::Attention, x, i, docs, rows)?;
        self.half(Half::Mlp, &mid, i, docs, rows)
    }

    /// Half `half` of decoder layer `i` on the residual stream `x`: `x + B(f(norm(x)))`, B the
    /// half's matmuls (attention or the MLP) and f the tokens they read — `norm(x)` itself on
    /// one rank, all of the micro-batch's on a tensor-parallel rank, whose partial output the
    /// group then sums (g, `leave`). `x` is [batch, seq, hidden] on one rank, this rank's
    /// tokens [n/T, hidden] (or [n, hidden]) of a split model, whose graph this does not cut:
    /// call it without one there (the training pass's split half is `half_forward`). With the
    /// output comes a MoE half's routing.
    pub(super) fn half(
        &self,
        half: Half,
        x: &Tensor,
        i: usize,
        docs: Option<&DocumentMask>,
        rows: Rows,
    ) -> anyhow::Result<(Tensor, Option<Routing>)> {
        let layer = &self.layers[i];
        let normed = self.rms_norm(x, self.half_norm(half, layer));
        let (partial, routing) =
            self.half_matmuls(half, &self.matmul_input(&normed)?, layer, docs, rows)?;
        // Out of place on purpose: tch's `+=` is add_, which would clobber a tensor autograd
        // saved for backward.
        Ok((x + self.leave(&partial)?, routing))
    }

    /// A half's matmuls on the normed tokens it reads (`matmul_input`): its (partial) output,
    /// in their shape, and a MoE half's routing. A split model's tokens are flat [n, hidden];
    /// attention takes them as `rows`.
    pub(super) fn half_matmuls(
        &self,
        half: Half,
        h: &Tensor,
        layer: &Layer,
        docs: Option<&DocumentMask>,
        rows: Rows,
    ) -> anyhow::Result<(Tensor, Option<Routing>)> {
        Ok(match half {
            Half::Attention if h.dim() == 3 => (self.attention(h, layer, docs)?, None),
            Half::Attention => {
                let d = h.size()[1];
                let rows = h.view([rows.batch, rows.seq, d]);
                (self.attention(&rows, layer, docs)?.view([-1, d]), None)
            }
            Half::Mlp => {
                let linear = |x: &Tensor, w: &Tensor| self.linear(x, w);
                let moe = self.shape.moe.as_ref();
                layer
                    .mlp
                    .forward(h, moe, self.ep.as_ref(), &linear, self.compute)?
            }
        })
    }

    /// The RMSNorm weight in front of a half.
    pub(super) fn half_norm<'a>(&self, half: Half, layer: &'a Layer) -> &'a Tensor {
        match half {
            Half::Attention => &layer.input_layernorm,
            Half::Mlp => &layer.post_attention_layernorm,
        }
    }

    /// The RMSNorm after the last decoder layer.
    pub(super) fn final_norm(&self, x: &Tensor) -> Tensor {
        self.rms_norm(x, &self.norm)
    }

    /// Logits (compute dtype) of final-normed hidden states.
    pub(super) fn lm_head(&self, h: &Tensor) -> Tensor {
        self.linear(h, self.head_weight())
    }

    /// The LM head's weight [vocab, hidden] (the embedding matrix when tied).
    pub(super) fn head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// The dtype the matmuls run in.
    pub(super) fn compute(&self) -> Kind {
        self.compute
    }

    /// The model's parameter table.
    pub fn parameters(&self) -> &Arc<Parameters> {
        &self.parameters
    }

    /// Whether the LM head is the embedding matrix (no separate `lm_head.weight`).
    pub fn tied(&self) -> bool {
        self.lm_head.is_none()
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Logits [batch, t, vocab] of `tokens` [batch, t] placed at positions `cache.len()..+t`,
    /// attending to the cached keys and values and appending their own to `cache`. With an
    /// empty cache this is `forward`. Inference only: call it under `tch::no_grad`.
    pub fn forward_with_cache(&self, tokens: &Tensor, cache: &mut KvCache) -> Tensor {
        assert!(
            self.tp.is_none(),
            "internal: KV-cached decoding of a tensor-parallel rank (generate loads the whole model)"
        );
        let (b, t) = (tokens.size()[0], tokens.size()[1] as usize);
        let pos = cache.len;
        assert!(
            pos + t <= cache.capacity && pos + t <= self.rope.max_len(),
            "KV cache holds {} positions (RoPE table {}); {pos} cached + {t} new do not fit",
            cache.capacity,
            self.rope.max_len()
        );
        assert_eq!(
            b,
            cache.layers.first().map_or(b, |(k, _)| k.size()[0]),
            "batch size differs from the cache's"
        );
        let rows = Rows::of(tokens);
        let mut x = Tensor::embedding(&self.embed_tokens, tokens, -1, false, false);
        for (i, (layer, kv)) in self.layers.iter().zip(cache.layers.iter()).enumerate() {
            let h = self.rms_norm(&x, &layer.input_layernorm);
            let mid = &x + self.attention_cached(&h, layer, kv, pos);
            x = self
                .half(Half::Mlp, &mid, i, None, rows)
                .expect("a whole model's MLP")
                .0;
        }
        cache.len = pos + t;
        self.lm_head(&self.final_norm(&x))
    }

    /// Mean next-token cross-entropy (fp32) of a whole model's `inputs` [b, s] predicting
    /// `targets` [b, s] (targets of -100 are ignored), through autograd: with a graph it is the
    /// loss of one plain backward (the reference the training pass, `forward_backward`, is
    /// tested against). The LM head runs in chunks of `activation_memory().loss_chunk_tokens`
    /// tokens, each chunk's logits kept for backward. Validation goes through `loss_units`.
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor) -> Tensor {
        self.loss_with(inputs, targets, None)
    }

    /// `loss` of packed rows with document structure `docs` (see `forward_with`).
    pub fn loss_with(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        docs: Option<&DocumentMask>,
    ) -> Tensor {
        let hidden = self
            .hidden(inputs, docs, &mut NoEvents)
            .expect("a whole model's loss");
        self.head_loss(&hidden, targets)
    }

    /// The mean cross-entropy of final-normed hidden states [b, s, hidden] predicting
    /// `targets` [b, s], the LM head in chunks, through autograd.
    fn head_loss(&self, hidden: &Tensor, targets: &Tensor) -> Tensor {
        let d = hidden.size()[2];
        let flat = hidden.view([-1, d]);
        let targets = targets.reshape([-1]);
        let mut total: Option<Tensor> = None;
        for (start, len) in chunks(flat.size()[0], self.memory.loss_chunk_tokens) {
            let (rows, t) = (flat.narrow(0, start, len), targets.narrow(0, start, len));
            let part = self
                .lm_head(&rows)
                .to_kind(Kind::Float)
                .cross_entropy_loss::<Tensor>(&t, None, Reduction::Sum, -100, 0.0);
            total = Some(match total {
                Some(t) => t + part,
                None => part,
            });
        }
        total.expect("at least one token") / counted_targets(&targets)
    }

    /// The training objective of a whole model's `inputs` [b, s] predicting `targets`, through
    /// autograd (the reference the training pass is tested against, as `loss`): the mean
    /// cross-entropy and, for a mixture of experts, the load-balancing and z-losses of every
    /// MoE layer's routing (moe.rs).
    pub fn objective(&self, inputs: &Tensor, targets: &Tensor) -> Objective {
        let (hidden, routings) = self
            .hidden_routed(inputs, None, &mut NoEvents)
            .expect("a whole model's loss");
        let cross_entropy = self.head_loss(&hidden, targets);
        let Some(moe) = self.shape.moe.as_ref().filter(|_| !routings.is_empty()) else {
            return Objective {
                cross_entropy,
                aux: None,
                z: None,
                weights: (0.0, 0.0),
            };
        };
        let e = moe.num_experts;
        let mut counts = vec![0i64; e];
        let mut rows = 0;
        for (_, r) in &routings {
            counts.iter_mut().zip(&r.counts).for_each(|(a, b)| *a += b);
            rows += r.tokens();
        }
        let n = rows as f64;
        let share = Tensor::from_slice(&counts).to_kind(Kind::Float) / n;
        let probs = routings
            .iter()
            .map(|(_, r)| r.probs.sum_dim_intlist(0, false, Kind::Float))
            .reduce(|a, b| a + b)
            .expect("a MoE layer")
            / n;
        let aux = (share * probs).sum(Kind::Float) * e as f64;
        let z = routings
            .iter()
            .map(|(_, r)| {
                let lse = r.logits.to_kind(Kind::Float).logsumexp(&[-1i64][..], false);
                lse.square().mean(Kind::Float)
            })
            .reduce(|a, b| a + b)
            .expect("a MoE layer");
        Objective {
            cross_entropy,
            aux: Some(aux),
            z: Some(z),
            weights: (moe.aux_loss_coef, self.router_z_loss),
        }
    }

    /// Each MoE layer's experts for every token of `tokens` [b, s]: (decoder layer index,
    /// [b·s, k] int64, in descending order of the router's probability). A whole model,
    /// inference only.
    pub fn router_choices(&self, tokens: &Tensor) -> Vec<(usize, Tensor)> {
        let (_, routings) = tch::no_grad(|| self.hidden_routed(tokens, None, &mut NoEvents))
            .expect("a whole model's routing");
        routings.into_iter().map(|(i, r)| (i, r.choices)).collect()
    }

    /// Sets the router z-loss's weight in the training objective (`model.router_z_loss_coef`;
    /// 0, the default, leaves it out).
    pub fn set_router_z_loss(&mut self, coef: f64) {
        self.router_z_loss = coef;
    }

    pub(super) fn router_z_loss(&self) -> f64 {
        self.router_z_loss
    }

    /// The router's figures (mean auxiliary losses, per-expert token counts) of the training
    /// passes since the last call; empty for a dense model.
    pub fn take_router_log(&self) -> RouterLog {
        self.router_log.with(std::mem::take)
    }

    pub(super) fn router_log(&self) -> &RouterLogCell {
        &self.router_log
    }

    /// This rank's tokens of rows `inputs` and `targets` [b, s], and the documents its pass
    /// reads: all of them; with context parallelism its chunks [b, 2m], the micro-batch in
    /// flight then holding their documents (`ContextParallel::begin`; a training pass ends it).
    pub(super) fn local_rows<'d>(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        docs: Option<&'d DocumentMask>,
    ) -> anyhow::Result<(Tensor, Tensor, Option<&'d DocumentMask>)> {
        match &self.cp {
            Some(cp) => {
                let (inputs, targets) = cp.begin(inputs, targets, docs)?;
                Ok((inputs, targets, None))
            }
            None => Ok((inputs.shallow_clone(), targets.shallow_clone(), docs)),
        }
    }

    /// The targets a mean divides by (not -100), as an fp32 tensor: this rank's, or with
    /// context parallelism the whole sequence's (the group's sum).
    pub(super) fn counted_targets(&self, targets: &Tensor) -> anyhow::Result<Tensor> {
        let count = counted_targets(targets);
        match &self.cp {
            Some(cp) => cp.sum(&count),
            None => Ok(count),
        }
    }

    /// What a rank's loss gradient is scaled by so that the gradients averaged over the ranks
    /// that hold the same parameters are the step's: with context parallelism each rank's
    /// tokens give a 1/C part of its sequence's gradient, so C × that part (the CP group's
    /// mean is then its sum); 1 otherwise.
    pub(super) fn gradient_share(&self) -> f64 {
        self.cp.as_ref().map_or(1.0, |cp| cp.size as f64)
    }

    /// The mean loss of the whole sequence from this rank's part of it (its tokens' sum over
    /// the whole count): itself, or with context parallelism the group's sum.
    pub(super) fn sequence_loss(&self, part: Tensor) -> anyhow::Result<Tensor> {
        match &self.cp {
            Some(cp) => cp.sum(&part),
            None => Ok(part),
        }
    }

    /// How the training pass trades memory for compute (set from the config by the trainer).
    pub fn activation_memory(&self) -> ActivationMemory {
        self.memory
    }

    pub fn set_activation_memory(&mut self, memory: ActivationMemory) {
        self.memory = memory;
    }

    /// Makes this model one rank of a context-parallel group: from here its training pass and
    /// its loss take the group's same rows and compute on this rank's chunks of them
    /// (context_parallel.rs).
    /// Whether the experts are split among ranks, so that every forward is a collective of
    /// the expert-parallel group.
    pub fn expert_parallel(&self) -> bool {
        self.ep.is_some()
    }

    /// This rank's position in its expert-parallel group (0 without one).
    pub fn expert_rank(&self) -> usize {
        self.ep.as_ref().map_or(0, |e| e.rank)
    }

    pub fn set_context_parallel(&mut self, cp: ContextParallel) {
        self.cp = Some(cp);
    }

    /// Finishes the backward of layer attention whose forward was cut out of the graph
    /// (context parallelism; nothing otherwise): call after the graph above it has run.
    pub(super) fn finish_attention(&self) -> anyhow::Result<()> {
        match &self.cp {
            Some(cp) => cp.finish(),
            None => Ok(()),
        }
    }

    pub(super) fn linear(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        if self.compute == Kind::Float {
            x.linear::<Tensor>(weight, None)
        } else {
            x.to_kind(self.compute)
                .linear::<Tensor>(&weight.to_kind(self.compute), None)
        }
    }

    /// transformers' LlamaRMSNorm: statistics in fp32, weight applied after the cast back.
    pub(super) fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        let kind = wide(self.compute);
        let xf = x.to_kind(kind);
        let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, kind);
        let normed = xf * (var + self.shape.rms_norm_eps).rsqrt();
        weight * normed.to_kind(x.kind())
    }

    /// Query, key and value heads of `h` ([b, heads, t, head_dim]), rotated for positions
    /// pos..pos + t, or for per-token `positions` [b, t] where given.
    fn qkv(
        &self,
        h: &Tensor,
        layer: &Layer,
        pos: usize,
        positions: Option<&Tensor>,
    ) -> (Tensor, Tensor, Tensor) {
        let s = &self.shape;
        let (b, t) = (h.size()[0], h.size()[1]);
        let hd = s.head_dim() as i64;
        // [b, n, t, head_dim], each head RMS-normed first where the family does (Qwen3),
        // back in the projection's dtype.
        let heads = |w: &Tensor, n: usize, norm: Option<&Tensor>| {
            let x = self.linear(h, w).view([b, t, n as i64, hd]);
            let x = match norm {
                Some(weight) => self.rms_norm(&x, weight).to_kind(x.kind()),
                None => x,
            };
            x.transpose(1, 2)
        };
        let rotate = |x: Tensor| match positions {
            Some(p) => self.rope.apply_positions(&x, p),
            None => self.rope.apply_at(&x, pos),
        };
        let q = rotate(heads(&layer.q_proj, self.heads, layer.q_norm.as_ref()));
        let k = rotate(heads(&layer.k_proj, self.kv_heads, layer.k_norm.as_ref()));
        (q, k, heads(&layer.v_proj, self.kv_heads, None))
    }

    /// Causal attention of queries at positions past..past + t over keys and values at
    /// positions 0..past + t (within each document where `docs` masks), then the output
    /// projection.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        past: usize,
        layer: &Layer,
        docs: Option<&DocumentMask>,
    ) -> Tensor {
        let s = &self.shape;
        let t = q.size()[2];
        let total = past as i64 + t;
        // Query head h reads kv head h / group. SDPA does the grouping itself (enable_gqa, as
        // transformers asks for it), which saves materialising repeated keys and values.
        let group = (self.heads / self.kv_heads) as i64;
        let docs = docs.filter(|d| d.masks_attention());
        // On CUDA, packed documents take variable-length flash attention where it runs.
        let varlen = docs
            .filter(|_| s.attention == AttentionBackend::Sdpa)
            .and_then(|d| flash::varlen_attention(q, k, v, d));
        let y = match (s.attention, varlen) {
            (_, Some(y)) => y,
            (AttentionBackend::Sdpa, None) => {
                // Packed documents see only their own document (block-diagonal causal mask).
                // Training and a prefill are the plain causal case; one new token sees every
                // cached position; several new tokens after cached ones need the offset mask.
                let (mask, causal) = if let Some(d) = docs {
                    (Some(d.attention_mask().shallow_clone()), false)
                } else if past == 0 {
                    (None, true)
                } else if t == 1 {
                    (None, false)
                } else {
                    (
                        Some(offset_causal_mask(t, total, q.device()).logical_not()),
                        false,
                    )
                };
                Tensor::scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    mask.as_ref(),
                    0.0,
                    causal,
                    None,
                    group > 1,
                )
            }
            (AttentionBackend::Math, None) => {
                let repeat = |x: &Tensor| {
                    if group > 1 {
                        x.repeat_interleave_self_int(group, 1, None)
                    } else {
                        x.shallow_clone()
                    }
                };
                let masked = match docs {
                    Some(d) => d.attention_mask().logical_not(),
                    None => offset_causal_mask(t, total, q.device()),
                };
                math_attention(q, &repeat(k), &repeat(v), &masked)
            }
        };
        self.project(&y, layer)
    }

    pub(super) fn attention(
        &self,
        h: &Tensor,
        layer: &Layer,
        docs: Option<&DocumentMask>,
    ) -> anyhow::Result<Tensor> {
        if let Some(cp) = &self.cp {
            // This rank's chunks of the sequence: positions and documents come from the
            // micro-batch in flight (`ContextParallel::begin`).
            let (q, k, v) = self.qkv(h, layer, 0, Some(&cp.positions()?));
            let y = cp.attend(&q, &k, &v)?;
            return Ok(self.project(&y, layer));
        }
        let (q, k, v) = self.qkv(h, layer, 0, docs.and_then(DocumentMask::positions));
        Ok(self.attend(&q, &k, &v, 0, layer, docs))
    }

    /// The output projection of attention heads `y` [b, heads, t, head_dim].
    fn project(&self, y: &Tensor, layer: &Layer) -> Tensor {
        let (b, t) = (y.size()[0], y.size()[2]);
        let y = y
            .transpose(1, 2)
            .reshape([b, t, self.heads as i64 * self.shape.head_dim() as i64]);
        self.linear(&y, &layer.o_proj)
    }

    /// `attention` for new tokens at positions pos..pos + t: their keys and values are written
    /// into the cache, and the queries attend to every cached position up to their own.
    fn attention_cached(
        &self,
        h: &Tensor,
        layer: &Layer,
        (k_buf, v_buf): &(Tensor, Tensor),
        pos: usize,
    ) -> Tensor {
        let (q, k_new, v_new) = self.qkv(h, layer, pos, None);
        let t = h.size()[1];
        k_buf
            .narrow(2, pos as i64, t)
            .copy_(&k_new.to_kind(k_buf.kind()));
        v_buf
            .narrow(2, pos as i64, t)
            .copy_(&v_new.to_kind(v_buf.kind()));
        let total = pos as i64 + t;
        self.attend(
            &q,
            &k_buf.narrow(2, 0, total),
            &v_buf.narrow(2, 0, total),
            pos,
            layer,
            None,
        )
    }

    /// Every parameter with its HF name, in creation order.
    pub fn named_parameters(vs: &tch::nn::VarStore) -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        v.sort_by_key(|(name, _)| param_order(name));
        v
    }
}

/// Sorts names the way HF lists them: embeddings, layers by number, norm, head.
fn param_order(name: &str) -> (usize, usize, String) {
    let layer = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse::<usize>().ok());
    match (name, layer) {
        (n, _) if n.starts_with("model.embed_tokens") => (0, 0, n.to_string()),
        (n, Some(i)) => (1, i, n.to_string()),
        (n, None) if n.starts_with("lm_head") => (3, 0, n.to_string()),
        (n, None) => (2, 0, n.to_string()),
    }
}

/// [t, total] bool, true where query i (at position total - t + i) must NOT see key j (j later).
fn offset_causal_mask(t: i64, total: i64, device: tch::Device) -> Tensor {
    let queries = Tensor::arange_start(total - t, total, (Kind::Int64, device)).unsqueeze(1);
    let keys = Tensor::arange(total, (Kind::Int64, device)).unsqueeze(0);
    keys.gt_tensor(&queries)
}

/// softmax(QK^T / sqrt(d), masked) V with fp32 softmax, as transformers' eager path;
/// `masked` is true where a query must not see a key.
fn math_attention(q: &Tensor, k: &Tensor, v: &Tensor, masked: &Tensor) -> Tensor {
    let scale = 1.0 / (q.size()[3] as f64).sqrt();
    let scores = q.matmul(&k.transpose(-2, -1)) * scale;
    let scores = scores.masked_fill(masked, f64::NEG_INFINITY);
    scores
        .softmax(-1, wide(q.kind()))
        .to_kind(q.kind())
        .matmul(v)
}
