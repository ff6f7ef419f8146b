//! The one table of config keys: type, default, meaning. Validation, typo suggestions, defaults
//! and `docs/CONFIG.md` are all derived from it, so a key is added in exactly one place (plus
//! its typed field in `types.rs`, which a test keeps in sync with this table).

use serde_json::Value;

use super::choices::{
    ActivationCheckpointing, Architecture, AttentionBackend, DeviceChoice, DistBackendChoice,
    DtypeChoice, FaultChoice, GuardPolicy, MemoryCheck, MuonAdjust, OomPhase, OptimizerChoice,
    PipelineSchedule, ReduceDtype, ZeroStage,
};

/// What a key accepts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// A whole number >= 0.
    UInt,
    /// A whole number >= 1 (a count that cannot be zero).
    Count,
    /// Any finite number.
    Float,
    Bool,
    Str,
    /// One of a fixed set of strings.
    Choice(&'static [&'static str]),
    /// A string, or null for "not set".
    OptStr,
    /// A whole number >= 0, or null for "not set".
    OptUInt,
    /// One of a fixed set of whole numbers.
    UIntIn(&'static [u64]),
    /// A list of objects with these fields (`data.sources`); each field's kind is a scalar one.
    Records(&'static [Field]),
    /// A list of strings (`--set` also takes them comma-separated).
    StrList,
}

/// One field of a [`Kind::Records`] entry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Field {
    pub name: &'static str,
    pub kind: Kind,
    /// Every entry must have it (else it may be left out).
    pub required: bool,
}

/// The fields of a `data.sources` entry (`types::SourceConfig`).
pub const SOURCE_FIELDS: &[Field] = &[
    Field {
        name: "path",
        kind: Kind::Str,
        required: true,
    },
    Field {
        name: "weight",
        kind: Kind::Float,
        required: true,
    },
    Field {
        name: "text_field",
        kind: Kind::Str,
        required: false,
    },
    Field {
        name: "name",
        kind: Kind::Str,
        required: false,
    },
];

impl Kind {
    pub fn describe(self) -> String {
        match self {
            Kind::UInt => "integer >= 0".into(),
            Kind::Count => "integer >= 1".into(),
            Kind::Float => "number".into(),
            Kind::Bool => "true or false".into(),
            Kind::Str => "string".into(),
            Kind::Choice(c) => format!("one of {}", c.join(" | ")),
            Kind::OptStr => "string or null".into(),
            Kind::OptUInt => "integer >= 0 or null".into(),
            Kind::StrList => "list of strings".into(),
            Kind::UIntIn(n) => {
                let n: Vec<String> = n.iter().map(u64::to_string).collect();
                format!("one of {}", n.join(" | "))
            }
            Kind::Records(fields) => {
                let fields: Vec<String> = fields
                    .iter()
                    .map(|f| {
                        let opt = if f.required { "" } else { "?" };
                        format!("{}{opt}: {}", f.name, f.kind.describe())
                    })
                    .collect();
                format!("list of {{{}}}", fields.join(", "))
            }
        }
    }

    /// What is wrong with `v` for this kind, naming the entry and field of a list of records
    /// (`[1].weight`, an unknown field with the nearest known one); None when `v` fits.
    pub fn problem(self, v: &Value) -> Option<String> {
        let Kind::Records(fields) = self else {
            return (!self.accepts(v)).then(|| format!("expected {}", self.describe()));
        };
        let Some(entries) = v.as_array() else {
            return Some(format!("expected {}", self.describe()));
        };
        for (i, entry) in entries.iter().enumerate() {
            let Some(obj) = entry.as_object() else {
                return Some(format!("[{i}] = {entry} must be an object {{...}}"));
            };
            for (name, value) in obj {
                let Some(field) = fields.iter().find(|f| f.name == name) else {
                    let names: Vec<&str> = fields.iter().map(|f| f.name).collect();
                    let near = names
                        .iter()
                        .min_by_key(|n| strsim::levenshtein(n, name))
                        .filter(|n| strsim::levenshtein(n, name) <= 3)
                        .map_or_else(String::new, |n| format!(" (did you mean \"{n}\"?)"));
                    return Some(format!(
                        "[{i}] has an unknown field \"{name}\"{near}; fields are {}",
                        names.join(", ")
                    ));
                };
                if !field.kind.accepts(value) {
                    return Some(format!(
                        "[{i}].{name} = {value} is not allowed; expected {}",
                        field.kind.describe()
                    ));
                }
            }
            if let Some(missing) = fields
                .iter()
                .find(|f| f.required && !obj.contains_key(f.name))
            {
                return Some(format!(
                    "[{i}] has no \"{}\"; every entry needs it",
                    missing.name
                ));
            }
        }
        None
    }

    /// `v` (which this kind accepts) as the typed config reads it: an integral float of an
    /// integer kind (`2.0`) becomes the integer, which `usize` fields deserialize.
    pub fn normalized(self, v: Value) -> Value {
        let integer = matches!(
            self,
            Kind::UInt | Kind::Count | Kind::OptUInt | Kind::UIntIn(_)
        );
        match v.as_f64() {
            Some(f) if integer && v.as_u64().is_none() => Value::from(f as u64),
            _ => v,
        }
    }

    /// Whether `v` has this kind. Integral floats count as integers (JSON writers emit `8.0`).
    pub fn accepts(self, v: &Value) -> bool {
        let uint = |v: &Value| {
            v.as_u64().is_some()
                || v.as_f64()
                    .is_some_and(|f| f >= 0.0 && f.fract() == 0.0 && f < 9.0e15)
        };
        match self {
            Kind::UInt => uint(v),
            Kind::Count => uint(v) && v.as_f64().is_some_and(|f| f >= 1.0),
            Kind::Float => v.as_f64().is_some_and(f64::is_finite),
            Kind::Bool => v.is_boolean(),
            Kind::Str => v.is_string(),
            Kind::Choice(c) => v.as_str().is_some_and(|s| c.contains(&s)),
            Kind::OptStr => v.is_null() || v.is_string(),
            Kind::OptUInt => v.is_null() || uint(v),
            Kind::StrList => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
            Kind::UIntIn(n) => uint(v) && v.as_f64().is_some_and(|f| n.contains(&(f as u64))),
            Kind::Records(_) => self.problem(v).is_none(),
        }
    }
}

pub struct KeySpec {
    /// `section.key`.
    pub key: &'static str,
    pub kind: Kind,
    /// Default as JSON text (before any preset).
    pub default: &'static str,
    pub doc: &'static str,
}

/// Old or alternative names that users' files carry: (alias, canonical key).
pub const ALIASES: &[(&str, &str)] = &[
    ("training.grad_accum_steps", "training.grad_accum_nums"),
    (
        "training.gradient_accumulation_steps",
        "training.grad_accum_nums",
    ),
    ("model.init_from", "model.model_path"),
];

pub const SECTIONS: &[&str] = &[
    "model",
    "data",
    "training",
    "system",
    "logging",
    "checkpoint",
    "debug",
];

macro_rules! keys {
    ($($key:literal, $kind:expr, $default:literal, $doc:literal;)*) => {
        pub const KEYS: &[KeySpec] = &[$(KeySpec { key: $key, kind: $kind, default: $default, doc: $doc },)*];
    };
}

keys! {
    "model.architecture", Kind::Choice(Architecture::NAMES), "\"auto\"", "The model family: llama, qwen3 (Llama's layers with q_norm/k_norm, an RMSNorm of each query and key head before RoPE), qwen3_moe (Qwen3's attention, mixture-of-experts MLPs), mixtral (Llama's attention, mixture-of-experts MLPs), or auto = model.model_path's model_type (config.json), else llama. Set with model_path, it must match the directory's model_type.";
    "model.model_path", Kind::OptStr, "null", "Hugging Face Llama, Qwen3, Qwen3-MoE or Mixtral directory (config.json + model.safetensors or a sharded index) to start from, or a Hugging Face id owner/name[@revision] from the local hub cache, downloaded into it when missing (HF_ENDPOINT, HF_TOKEN; never with HF_HUB_OFFLINE=1); its config.json sets the model shape. Alias: model.init_from.";
    "model.num_layers", Kind::Count, "4", "Decoder layers. With model_path, keeps only the first N layers of the checkpoint.";
    "model.hidden_size", Kind::Count, "4096", "Residual stream width.";
    "model.num_attention_heads", Kind::Count, "32", "Query heads; must divide hidden_size, and hidden_size / heads must be even (RoPE).";
    "model.num_key_value_heads", Kind::Count, "8", "Key/value heads (grouped-query attention); must divide num_attention_heads.";
    "model.head_dim", Kind::OptUInt, "null", "Width of one attention head; null = hidden_size / num_attention_heads. Qwen3 sets it apart (Qwen3-8B: hidden 4096, 32 heads of 128). Must be even (RoPE).";
    "model.intermediate_size", Kind::Count, "14336", "SwiGLU MLP width.";
    "model.num_experts", Kind::UInt, "0", "Experts of each mixture-of-experts MLP (architecture qwen3_moe or mixtral; Qwen3-30B-A3B: 128, Mixtral-8x7B: 8); 0 = a dense model (llama, qwen3). Every token goes to model.num_experts_per_tok of them, dropless (docs/models.md).";
    "model.num_experts_per_tok", Kind::Count, "2", "Experts each token is routed to (top-k of the router's softmax); at most model.num_experts.";
    "model.moe_intermediate_size", Kind::OptUInt, "null", "SwiGLU width of one expert; null = model.intermediate_size (Mixtral's convention). Qwen3-MoE sets it apart (Qwen3-30B-A3B: 768, its dense layers' intermediate_size 6144).";
    "model.decoder_sparse_step", Kind::Count, "1", "Layer i is a mixture of experts where i + 1 is a multiple of this (Qwen3-MoE's decoder_sparse_step; 1 = every layer), a dense MLP of model.intermediate_size otherwise.";
    "model.norm_topk_prob", Kind::Bool, "true", "Renormalise each token's k routing weights to sum to 1 (Qwen3-MoE's norm_topk_prob; Mixtral always does).";
    "model.router_aux_loss_coef", Kind::Float, "0.001", "Weight of the load-balancing loss (Switch Transformer's, as transformers' load_balancing_loss_func computes it over all MoE layers of a micro-batch) in the training objective; logged as aux_loss. 0 = none.";
    "model.router_z_loss_coef", Kind::Float, "0.0", "Weight of the router z-loss (ST-MoE: the mean squared log-sum-exp of each MoE layer's router logits, summed over layers) in the training objective; logged as z_loss when set. 0 = none.";
    "model.vocab_size", Kind::OptUInt, "null", "Embedding rows; null = the tokenizer's vocabulary size. Must be >= the tokenizer's.";
    "model.max_position_embeddings", Kind::UInt, "131072", "Longest context the model supports; training.context_length may not exceed it.";
    "model.rope_theta", Kind::Float, "500000.0", "RoPE base frequency.";
    "model.rms_norm_eps", Kind::Float, "1e-5", "RMSNorm epsilon.";
    "model.tie_word_embeddings", Kind::Bool, "false", "Share the token embedding with the LM head.";
    "model.attention_backend", Kind::Choice(AttentionBackend::NAMES), "\"sdpa\"", "sdpa (alias flash_attention_2) = libtorch scaled_dot_product_attention, which picks flash/memory-efficient kernels; math (alias eager) = explicit softmax(QK^T/sqrt(d))V, for debugging.";
    "model.init_std", Kind::Float, "0.02", "Standard deviation of the normal init of linear and embedding weights (RMSNorm weights start at 1).";
    "data.path", Kind::Str, "\"builtin:shakespeare\"", "Corpus: builtin:shakespeare (Shakespeare's works, 5 MB, compiled into lockstep: works from any directory), a .txt/.jsonl/.parquet file, a directory of them, a glob pattern, a Hugging Face dataset in the local hub cache (owner/name[/config]; used when no such local path exists), or a prepared .tok / nanoGPT .bin / llm.c shard. Relative to the working directory.";
    "data.tokenizer", Kind::Str, "\"gpt2\"", "gpt2 (= r50k_base), p50k_base, cl100k_base, o200k_base (embedded, offline), a path to a tokenizer.json, or a Hugging Face id owner/name[@revision] (its tokenizer.json from the local hub cache, downloaded into it when missing unless HF_HUB_OFFLINE=1).";
    "data.text_field", Kind::Str, "\"text\"", "Field (.jsonl) or string column (.parquet) holding the document text.";
    "data.val_fraction", Kind::Float, "0.05", "Fraction of the token stream held out for validation (0 = none); each source of data.sources keeps its own.";
    "data.num_samples", Kind::OptUInt, "null", "Use only the first N documents of the corpus (of each source of data.sources); null = all.";
    "data.sources", Kind::Records(SOURCE_FIELDS), "[]", "A weighted mixture instead of data.path: each entry a corpus as data.path accepts it, with its sampling weight (relative; normalised over the list), optionally its own text_field and a name for logs (default: the file or directory name). Each source is prepared and cached on its own, keeps its own held-out split (per-source val_loss), and gets training samples in proportion to its weight from a seeded schedule; a source that runs out starts its next epoch with a new order. Empty = the one source data.path.";
    "data.document_masking", Kind::Bool, "false", "Packed windows hold several documents (each ending with EOS): a token attends only to earlier tokens of its own document. Boundaries come from the .tok file's document offsets (a nanoGPT .bin or llm.c shard has none). CPU: SDPA with a block-diagonal causal mask; CUDA bf16: variable-length flash attention where libtorch has it, else the mask.";
    "data.reset_position_ids", Kind::Bool, "false", "RoPE positions restart at 0 at each document start inside a window, as if each document were its own sequence. Beside data.document_masking it changes results only by rounding (RoPE sees the distance between tokens, and masked attention never crosses a document); alone, it changes the distances at which documents see each other.";
    "data.cache_dir", Kind::Str, "\".lockstep/cache\"", "Where prepared token files are cached, keyed by what changes the tokens: tokenizer, dataset files (the built-in corpus by content hash), text field, data.val_fraction and sample count (another training.context_length is a cache hit).";
    "data.allow_new_data_on_resume", Kind::Bool, "false", "A resume whose data differ from the checkpoint's (sources, weights, tokenizer or token content, as recorded in its trainer.json) is refused, since the data order would change without a word. true: continue the model and optimizer on the new data, with the data order starting anew at its first sample (said in the log).";
    "training.batch_size", Kind::Count, "1", "Sequences per micro-batch per rank.";
    "training.learning_rate", Kind::Float, "1e-5", "Peak learning rate (after warmup).";
    "training.min_lr", Kind::Float, "1e-6", "Floor of the cosine decay; must be <= learning_rate.";
    "training.warmup_steps", Kind::UInt, "10", "Linear warmup steps from 0 to learning_rate.";
    "training.max_steps", Kind::Count, "100", "Optimizer steps to train for.";
    "training.context_length", Kind::Count, "8192", "Tokens per sequence; <= model.max_position_embeddings.";
    "training.grad_accum_nums", Kind::Count, "1", "Micro-batches per optimizer step. Alias: grad_accum_steps.";
    "training.num_workers", Kind::UInt, "0", "Threads that tokenize in `prepare` (0 = all cores). Batches come straight from the memory-mapped token file and need no workers.";
    "training.dtype", Kind::Choice(DtypeChoice::NAMES), "\"auto\"", "Compute precision; bf16 keeps fp32 master weights and AdamW moments. auto = bf16 on CUDA, fp32 on CPU.";
    "training.optimizer", Kind::Choice(OptimizerChoice::NAMES), "\"adamw\"", "adamw = AdamW on every parameter (torch.optim.AdamW). muon = Muon (torch.optim.Muon: Nesterov momentum, then the update orthogonalized by a quintic Newton-Schulz iteration in bf16) on every 2-D weight inside the decoder layers (attention and MLP projections, the router, each expert's matrices on their own), AdamW with the settings below on the embeddings, the LM head and every 1-D parameter. Under ZeRO, hybrid sharding, tensor and expert parallelism each matrix is assembled whole on one owner rank, orthogonalized there and its parts sent back (docs/distributed.md). A checkpoint of one optimizer resumes with the other only with training.reset_optimizer.";
    "training.weight_decay", Kind::Float, "0.1", "Decoupled weight decay (p *= 1 - learning rate x weight_decay), applied to matrices and embeddings only (not norms or biases); the same for Muon's matrices.";
    "training.beta1", Kind::Float, "0.9", "AdamW beta1.";
    "training.beta2", Kind::Float, "0.95", "AdamW beta2.";
    "training.adam_eps", Kind::Float, "1e-8", "AdamW epsilon.";
    "training.muon_momentum", Kind::Float, "0.95", "Muon's momentum (Nesterov), in [0, 1).";
    "training.muon_ns_steps", Kind::Count, "5", "Newton-Schulz iterations per Muon update (1 to 99; torch.optim.Muon's ns_steps).";
    "training.muon_adjust_lr", Kind::Choice(MuonAdjust::NAMES), "\"match_rms_adamw\"", "How Muon scales the learning rate for an A x B matrix: match_rms_adamw = 0.2 sqrt(max(A, B)), so the update's RMS matches AdamW's and one learning rate serves both optimizers; original = sqrt(max(1, A / B)) (Keller Jordan's; wants a learning rate ~20x AdamW's).";
    "training.reset_optimizer", Kind::Bool, "false", "On resume, load the checkpoint's weights only and start the optimizer afresh (zero moments and momentum, AdamW's bias correction from step 1); the step count, data order and learning-rate schedule continue. Needed to resume a checkpoint of one training.optimizer with the other. The reset happens once: a checkpoint written by a run with this key set resumes with its own optimizer state (so restarts and rollbacks stay exact); to reset again, resume once without the key.";
    "training.max_grad_norm", Kind::Float, "1.0", "Clip the global gradient norm to this (0 = no clipping).";
    "training.eval_interval", Kind::UInt, "0", "Validation loss every N steps and at the end (0 = only at the end).";
    "training.eval_batches", Kind::UInt, "4", "Batches of the held-out split per validation (0 = no validation).";
    "training.eval_tasks", Kind::StrList, "[]", "Downstream evaluation (docs/evaluation.md): multiple-choice task files, .jsonl with query/choices/gold (or HellaSwag's ctx/endings/label) per line, or directories of them, each a task named by its file's stem (`--set training.eval_tasks=hellaswag.jsonl,arc.jsonl`; relative to the working directory). Evaluated every training.eval_interval steps and at the end, after validation, on the data ranks together; scored as lm-evaluation-harness 0.4 scores multiple_choice (acc, acc_norm) with data.tokenizer, a row longer than training.context_length losing tokens from the left; logged as eval/<task>/acc and eval/<task>/acc_norm. A bad file stops the run before training, naming the file, line and field.";
    "training.eval_tasks_limit", Kind::UInt, "0", "Evaluate only the first N items of each of training.eval_tasks (0 = all of them).";
    "training.eval_tasks_batch_size", Kind::Count, "32", "Rows (one choice of one item each) per forward pass of downstream evaluation, on each data rank. `lockstep eval --task` uses the same number by default.";
    "training.nan_check", Kind::Bool, "true", "Stop on a non-finite loss or gradient norm, with a per-tensor report of where NaN/Inf appear.";
    "training.nan_policy", Kind::Choice(GuardPolicy::NAMES), "\"abort\"", "On a NaN/Inf loss or gradient norm (after the report, a nan_step_N checkpoint and a debug dump): abort (exit code 3), skip (drop the update, go on), or rollback (reload the latest checkpoint, multiply the LR by rollback_lr_factor, go on with new data).";
    "training.max_nan_skips", Kind::UInt, "10", "Skips plus rollbacks (NaN or spike) allowed in one run before it aborts with exit code 3.";
    "training.rollback_lr_factor", Kind::Float, "0.5", "LR multiplier applied at each rollback (cumulative; saved in checkpoints).";
    "training.spike_zscore", Kind::Float, "0.0", "Loss-spike detection: a loss this many standard deviations above the recent window triggers training.spike_policy (0 = off).";
    "training.spike_window", Kind::UInt, "100", "Recent losses the spike detector compares against.";
    "training.activation_checkpointing", Kind::Choice(ActivationCheckpointing::NAMES), "\"none\"", "Activation memory of the decoder layers. none = keep what autograd saves; full = keep only each layer's input ([batch, context, hidden] fp32) and recompute the layer in backward (about one more forward); selective = keep the attention half of each layer (RMSNorm, q/k/v after RoPE, the attention output and log-sum-exp, the o_proj input, the residual after attention) and recompute the MLP half (post-attention RMSNorm, gate/up projections, SiLU, product, down projection). Gradients are the same in every mode (bit for bit on CPU, where recomputation is deterministic).";
    "training.loss_chunk_tokens", Kind::UInt, "1024", "LM head + cross-entropy in chunks of this many tokens, each chunk's logits computed, reduced and back-propagated before the next, so the [tokens, vocab] logits never exist at once (0 = one chunk of the whole micro-batch). 1024 tokens of fp32 logits are 206 MB at vocabulary 50257 and 525 MB at 128256.";
    "training.spike_policy", Kind::Choice(GuardPolicy::NAMES), "\"skip\"", "What a loss spike does: skip the update, roll back, or abort.";
    "system.device", Kind::Choice(DeviceChoice::NAMES), "\"auto\"", "auto = CUDA when available, else CPU.";
    "system.device_id", Kind::UInt, "0", "CUDA device index for a single-process run.";
    "system.seed", Kind::UInt, "1337", "Seed of the initial weights and the data order.";
    "system.num_threads", Kind::UInt, "0", "CPU threads for libtorch (0 = all cores, or OMP_NUM_THREADS, which `lockstep run` sets to cores / workers).";
    "system.max_memory_gb", Kind::Float, "0.0", "Warn when a rank's resident memory exceeds this many GB (0 = never).";
    "system.collective_timeout_s", Kind::Count, "600", "Seconds a collective (all-reduce, broadcast, barrier) may make no progress before the rank fails with a message naming the missing rank.";
    "system.bucket_mb", Kind::Float, "25.0", "Cap of the flat buckets every bucketed collective packs tensors into, in MiB: the gradients' all-reduce or reduce-scatter, the initial broadcast of the parameters and the zero stages' all-gathers.";
    "system.overlap_comm", Kind::Bool, "true", "Average each bucket of gradients across ranks as soon as backward has finished its layers, on a communication thread, while the lower layers' backward runs (results bitwise equal to false, which reduces after backward). Applies to the TCP ring; NCCL ranks reduce after backward until the overlap is verified on GPUs.";
    "system.zero_stage", Kind::UIntIn(ZeroStage::NUMBERS), "0", "Sharded data parallelism: 0 = replicated (every rank holds all optimizer state), 1 = AdamW moments and fp32 master weights sharded across ranks, 2 = gradients reduce-scattered to their owner's shard too, 3 = the working parameters sharded too (each unit - a decoder layer, the embedding, the final norm, the LM head - is all-gathered just before its forward and again before its backward, and freed after each).";
    "system.shard_degree", Kind::UInt, "0", "At zero_stage >= 1: how many consecutive ranks shard one copy of the training state (0 = all of them). Smaller: hybrid sharding (HSDP) - the ranks form groups of this size, each group shards parameters, gradients and optimizer state among its members, and the groups hold replicas, kept equal by averaging the gradient slices across them (shard inside a node over NVLink, replicate across nodes). Must divide the world size.";
    "system.tensor_parallel", Kind::Count, "1", "Tensor parallelism: ranks that split every layer between them (T). Ranks r with the same r / T form one TP group (keep it inside a node: T should divide the GPUs per node); the q, k, v, gate and up projections are split by output (column-parallel), o and down by input (row-parallel), the embedding and LM head by vocabulary (with a vocabulary-parallel cross-entropy: no rank holds a token's full logits). T must divide the attention heads, the KV heads and the number of ranks; zero_stage, shard_degree and reduce_dtype then act on the data-parallel ranks (the ranks with the same position in their TP group). Checkpoints keep full Hugging Face tensors, so any layout resumes any other.";
    "system.sequence_parallel", Kind::Bool, "true", "With tensor_parallel > 1: keep the residual stream and the RMSNorms split along the tokens between the layers' matmuls (all-gather before attention and the MLP, reduce-scatter after), which divides their activations by T at the same traffic as an all-reduce after each row-parallel matmul (false). training.context_length must be a multiple of T.";
    "system.context_parallel", Kind::Count, "1", "Context parallelism: ranks that split every sequence between them (C), so a context whose activations do not fit on one rank trains. Each sequence is cut into 2C chunks and rank i of a CP group holds chunks i and 2C−1−i (every rank gets the same share of the causal mask's work); attention all-gathers the keys and values of the group and merges its blocks by log-sum-exp, everything else (norms, MLP, LM head, loss) stays on the rank's own tokens. The mesh is data × context × tensor ranks (tensor innermost, then context): the C ranks of a CP group read the same samples; zero_stage, shard_degree and gradient averaging act on all the ranks that hold the same parameters (data × context). 2C must divide training.context_length, C the ranks over tensor_parallel. Checkpoints are unchanged: any layout resumes any other.";
    "system.expert_parallel", Kind::Count, "1", "Expert parallelism (mixture-of-experts models): ranks that split every MoE layer's experts between them (E). E consecutive ranks of the data dimension (the replicas: data × context ranks) form an expert-parallel group; rank p of it holds experts [p·N/E, (p+1)·N/E) of each layer's N, and every token travels to its experts' ranks and back by all-to-all (NCCL on GPUs, the TCP ring on CPU ranks), dropless. Attention, the router and the dense layers stay data-parallel. An expert's gradient is averaged over the ranks holding the same experts; the optimizer and checkpoints see whole Hugging Face tensors, so any E resumes any other. E must divide the experts per layer and the replicas, and with hybrid sharding system.shard_degree (the experts' state is then sharded among their holders in each shard group). At zero_stage 3 a decoder layer's experts are gathered over their holders only, with the layer. With tensor_parallel T the group is E replicas of one tensor index (E·T consecutive ranks: keep them inside a node) and each expert is also split by its width over the tensor group.";
    "system.pipeline_parallel", Kind::Count, "1", "Pipeline parallelism: ranks that split the decoder layers between them by depth (P). The mesh is pipeline × data × context × tensor ranks, pipeline outermost (its stages send only activations, so it is the dimension to put across nodes): the layers are cut into contiguous stages (P, or P·V with system.virtual_stages), the embedding on the first stage and the final norm, LM head and loss on the last; a step's training.grad_accum_nums micro-batches flow through the stages in the order of system.pipeline_schedule. P must divide the ranks and the stages may not outnumber model.num_layers. `lockstep plan` models it (per-stage memory, the bubble, the point-to-point bytes); training with P > 1 is not built yet.";
    "system.pipeline_schedule", Kind::Choice(PipelineSchedule::NAMES), "\"1f1b\"", "With pipeline_parallel > 1, the order of each rank's forwards and backwards: 1f1b = one stage per rank, P − 1 − r warm-up forwards on rank r, then one forward and one backward in turn (bubble (P−1)/(m+P−1) of the step for m micro-batches); interleaved = system.virtual_stages V ≥ 2 stages per rank (stage v·P + r on rank r; bubble (P−1)/(V·m+P−1); training.grad_accum_nums a multiple of P); zbv = two stages per rank in a V (r and 2P−1−r) with each backward split into its input and weight gradients, the weight gradients filling the bubble (ZB-V; system.virtual_stages stays 1).";
    "system.virtual_stages", Kind::Count, "1", "With system.pipeline_schedule = interleaved: stages per pipeline rank (V ≥ 2; stage v·P + r on rank r). More stages shrink the bubble V times and send V times as many activations; P·V may not exceed model.num_layers.";
    "system.reduce_dtype", Kind::Choice(ReduceDtype::NAMES), "\"fp32\"", "The dtype gradients travel in between ranks: fp32, or bf16 (half the bytes on NCCL; gradients and their averages are rounded to bf16 on the way; they are accumulated into fp32). The CPU ring carries bf16 values as fp32, so on CPU ranks it costs precision and saves nothing.";
    "system.prefetch_units", Kind::UInt, "1", "At zero_stage = 3: units whose all-gather is issued ahead of the one computing, so the gather hides behind compute (0 = gather each unit when it is needed). Each costs one unit of full parameters in memory.";
    "system.memory_check", Kind::Choice(MemoryCheck::NAMES), "\"refuse\"", "Before building the model, `train` estimates each rank's peak memory as `lockstep plan` does and compares it with system.memory_budget_gb: refuse = exit with code 2 and the cheapest change that fits when it does not; warn = print that and start anyway; off = no estimate.";
    "system.memory_budget_gb", Kind::Float, "0.0", "Memory one rank may use, in GB, for system.memory_check: 0 = what the device has free at start (CPU: MemAvailable of /proc/meminfo divided among the node's ranks; CUDA: the GPU's free memory from NVML).";
    "system.dist_backend", Kind::Choice(DistBackendChoice::NAMES), "\"auto\"", "Collectives of a multi-rank run. auto = NCCL on CUDA ranks (gradients and parameters on the GPU; scalars and barriers on the CPU ring, which names a missing rank), the Rust TCP ring on CPU ranks. ring = the TCP ring everywhere (CUDA tensors go through host memory: slow, a fallback when NCCL is broken).";
    "logging.interval", Kind::Count, "1", "Print the step line every N steps.";
    "logging.dir", Kind::Str, "\"runs\"", "Parent directory of run directories.";
    "logging.verbose", Kind::Bool, "false", "Also print a per-phase timing line (data, forward+backward, optimizer) at each log step.";
    "logging.tensorboard", Kind::Bool, "true", "Rank 0 writes TensorBoard event files (loss, lr, grad norm, tokens/s, MFU, validation, RSS) to <run dir>/tensorboard/ at every logged step.";
    "logging.memory_interval", Kind::UInt, "100", "Log resident memory (and the peak) every N steps (0 = only the peak at the end).";
    "logging.run_name", Kind::OptStr, "null", "Run directory name under logging.dir; null = the preset's name.";
    "logging.straggler_pct", Kind::Float, "20.0", "Every logging.interval steps, rank 0 names the slowest rank when its time per step on its own work (data, forward, backward, optimizer; not waiting for others) exceeds the median of all ranks by more than this many percent (0 = off; one small all-reduce per check).";
    "logging.wandb.project", Kind::OptStr, "null", "Weights & Biases project; setting it turns W&B on. Rank 0 runs the official `wandb` client in a sidecar process (Python, fed over a pipe, never waited for by training) and logs every step line's values, validation, guard events and the resolved config. The W&B run id is kept in <run dir>/wandb.json, so --resume and restarts continue one W&B run; a fresh start begins a new one.";
    "logging.wandb.entity", Kind::OptStr, "null", "W&B entity (user or team); null = the API key's default entity (or WANDB_ENTITY).";
    "logging.wandb.name", Kind::OptStr, "null", "W&B run display name; null = the run directory's name.";
    "logging.wandb.group", Kind::OptStr, "null", "W&B run group (e.g. one sweep or ablation).";
    "logging.wandb.tags", Kind::StrList, "[]", "W&B run tags (`--set logging.wandb.tags=a,b`).";
    "logging.wandb.mode", Kind::OptStr, "null", "online | offline | disabled; null = WANDB_MODE, else online. offline writes the run under logging.wandb.dir for `wandb sync` (clusters without internet).";
    "logging.wandb.dir", Kind::OptStr, "null", "Where W&B keeps its files (it makes a wandb/ folder inside); null = the run directory.";
    "logging.wandb.python", Kind::OptStr, "null", "The Python that runs the W&B sidecar (it must have the `wandb` package); null = the Python environment a pip-installed lockstep runs from, else the project venv lockstep was built with when it exists, else python3 on PATH.";
    "logging.mlflow.tracking_uri", Kind::OptStr, "null", "MLflow tracking server (http://host:port); setting it, or MLFLOW_TRACKING_URI, turns MLflow on. Rank 0 logs through MLflow's REST API from a background thread: the step line's values and validation as metrics, the resolved config as params, FINISHED / FAILED / KILLED at the end. The run id is kept in <run dir>/mlflow.json, so resumes and restarts continue one MLflow run. Auth: MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or http://user:password@host (taken out of the address when the config is resolved and sent only as the Authorization header: never written to config.json, trainer.json, the workers' spec or a tracker; the variables keep it off the command line, which `ps` shows).";
    "logging.mlflow.experiment", Kind::OptStr, "null", "MLflow experiment name (created when missing); null = MLFLOW_EXPERIMENT_NAME, else lockstep.";
    "logging.mlflow.run_name", Kind::OptStr, "null", "MLflow run name; null = the run directory's name.";
    "checkpoint.interval", Kind::UInt, "0", "Save every N steps (0 = only at the end); always saves at the end.";
    "checkpoint.keep_last", Kind::Count, "3", "Complete checkpoints to keep; older ones are deleted.";
    "checkpoint.keep_every", Kind::UInt, "0", "Also keep every checkpoint whose step is a multiple of N forever, besides the last checkpoint.keep_last (0 = off; e.g. 1000 keeps step_1000, step_2000, ...). A multiple of checkpoint.interval (saves happen only there).";
    "checkpoint.async", Kind::Bool, "true", "Save in the background: at a checkpoint step each rank copies what it owns into a host staging buffer (pinned on CUDA, reused between saves) and training goes on while a writer thread writes, fsyncs and commits the same files as a synchronous save. One save in flight at a time; the end of training, SIGTERM/SIGINT, the NaN guard and rollbacks wait for it; a failed background write fails the run at the next step. Falls back to a synchronous save, saying so, when the staging copy would not fit in the host's available memory. false = every rank waits until the checkpoint is written.";
    "debug.fault", Kind::Choice(FaultChoice::NAMES), "\"none\"", "Testing aid (fault injection): at the start of step debug.fault_step, rank debug.fault_rank exits with debug.fault_exit_code (exit), the same once its part of the checkpoint in flight is written and reported (exit_after_save), or stops itself with SIGSTOP (stop, a hung rank); slow makes it sleep debug.fault_delay_ms at the start of that step and every later one (a straggler). Used by the launcher, timeout, restart and straggler tests.";
    "debug.fault_rank", Kind::UInt, "0", "Testing aid: the rank that debug.fault hits.";
    "debug.fault_step", Kind::UInt, "1", "Testing aid: the step (1-based) at whose start debug.fault fires.";
    "debug.fault_exit_code", Kind::UInt, "3", "Testing aid: exit code for debug.fault = exit.";
    "debug.fault_delay_ms", Kind::UInt, "0", "Testing aid: milliseconds debug.fault = slow sleeps per step.";
    "debug.save_report_delay_ms", Kind::UInt, "0", "Testing aid: each rank's checkpoint writer waits this long once its files are durable before reporting them (rank 0: once every rank has reported, before committing), so a fault can land between the reports and the commit.";
    "debug.inject_nan_at_step", Kind::UInt, "0", "Testing aid: make step N (1-based) non-finite to exercise training.nan_policy (0 = off).";
    "debug.inject_nan_param", Kind::OptStr, "null", "Testing aid: with inject_nan_at_step, put the NaN into this parameter's gradient (HF name) instead of the loss.";
    "debug.inject_oom", Kind::Choice(OomPhase::NAMES), "\"none\"", "Testing aid: provoke a real allocation failure (a petabyte) in this phase of step debug.inject_oom_step (model_build: before the model is built), to exercise the out-of-memory report.";
    "debug.inject_oom_step", Kind::UInt, "1", "Testing aid: the step (1-based) in which debug.inject_oom fires.";
    "debug.muon_all_gather", Kind::Bool, "false", "Benchmark aid: with training.optimizer = muon, every rank that holds a piece of a matrix gathers the whole update and orthogonalizes it itself (the all-gather variant), instead of one owner per matrix sending the pieces of its result back (BENCHMARKS.md §22 compares them; the results are bitwise the same).";
    "checkpoint.dir", Kind::OptStr, "null", "Checkpoint directory; null = <logging.dir>/<run>/checkpoints. A relative path is relative to the directory train starts in (recorded in the run directory, checkpoint_dir.txt).";
}

pub fn find(key: &str) -> Option<&'static KeySpec> {
    KEYS.iter().find(|k| k.key == key)
}

/// Whether `key` names a group of keys inside a section (`logging.wandb`).
pub fn is_group(key: &str) -> bool {
    !group_keys(key).is_empty()
}

/// The leaf names of the keys in group `key` (`project`, `entity`, ... for `logging.wandb`).
pub fn group_keys(key: &str) -> Vec<&'static str> {
    KEYS.iter()
        .filter_map(|k| k.key.strip_prefix(key)?.strip_prefix('.'))
        .collect()
}

pub fn canonical(key: &str) -> &str {
    ALIASES
        .iter()
        .find(|(alias, _)| *alias == key)
        .map_or(key, |(_, canon)| canon)
}

/// The known key closest to a misspelt one, if any is close enough to be a plausible typo.
pub fn suggest(key: &str) -> Option<&'static str> {
    let leaf = key.rsplit('.').next().unwrap_or(key);
    KEYS.iter()
        .map(|k| k.key)
        .chain(ALIASES.iter().map(|(a, _)| *a))
        .map(|cand| {
            let cand_leaf = cand.rsplit('.').next().unwrap_or(cand);
            // A right leaf in the wrong section is the commonest mistake; score it as close.
            let d = strsim::levenshtein(key, cand).min(strsim::levenshtein(leaf, cand_leaf) + 1);
            (d, cand)
        })
        .min_by_key(|(d, _)| *d)
        .filter(|(d, _)| *d <= 3.max(leaf.len() / 3))
        .map(|(_, c)| c)
}

/// The markdown table in docs/CONFIG.md.
pub fn markdown_table() -> String {
    let mut out = String::from(
        "<!-- generated by `lockstep config --markdown`; a test checks it is current -->\n\
         # Configuration keys\n\n\
         Resolution order: preset (`--preset`, default `production`; `--debug` = `--preset debug`) < \
         `--config FILE.json` (deep merge) < `--set section.key=value` < named flags (`--max-steps`). \
         Unknown keys are errors that suggest the nearest known key.\n\n\
         | key | type | default | meaning |\n|---|---|---|---|\n",
    );
    for k in KEYS {
        out.push_str(&format!(
            "| `{}` | {} | `{}` | {} |\n",
            k.key,
            // A bare `|` would end the table cell.
            k.kind.describe().replace(" | ", " \\| "),
            k.default,
            k.doc
        ));
    }
    out.push_str("\nAliases accepted in files and `--set`: ");
    let aliases: Vec<String> = ALIASES
        .iter()
        .map(|(a, c)| format!("`{a}` → `{c}`"))
        .collect();
    out.push_str(&aliases.join(", "));
    out.push_str(".\n\nPresets (`config/presets/*.json`) override these defaults:\n\n");
    for (name, text) in super::presets::PRESETS {
        out.push_str(&format!("- `{name}`: `{}`\n", compact(text)));
    }
    out
}

fn compact(json: &str) -> String {
    serde_json::from_str::<Value>(json).map_or_else(|_| json.to_string(), |v| v.to_string())
}
