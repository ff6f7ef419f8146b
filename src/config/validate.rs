//! Checks that need more than one key or a range: each error names the key(s), the value(s) and
//! what would be allowed.

use super::error::ConfigError;
use super::{Config, DeviceChoice, DistBackendChoice};

pub fn check(c: &Config) -> Result<(), ConfigError> {
    let mut problems = Vec::new();
    let mut bad = |msg: String| problems.push(msg);
    check_shape(c, &mut bad);
    check_tensor_parallel_static(c, &mut bad);
    check_expert_parallel_static(c, &mut bad);
    check_pipeline_static(c, &mut bad);
    check_ranges(c, &mut bad);
    check_system(c, &mut bad);
    check_sources(c, &mut bad);
    check_paths(c, &mut bad);
    check_trackers(c, &mut bad);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError(format!(
            "invalid config:\n  - {}",
            problems.join("\n  - ")
        )))
    }
}

/// The model's shape: heads that divide, an even head dimension, a context within the
/// positions.
fn check_shape(c: &Config, bad: &mut impl FnMut(String)) {
    // Counts that cannot be zero are `Kind::Count` in the schema, refused where they are set.
    let (m, t) = (&c.model, &c.training);
    if m.vocab_size == Some(0) {
        bad(
            "model.vocab_size = 0: must be at least the tokenizer's vocabulary size (null = \
             exactly the tokenizer's)"
                .into(),
        );
    }
    if let Some(hd) = m.head_dim {
        if hd == 0 || !hd.is_multiple_of(2) {
            bad(format!(
                "model.head_dim = {hd}: RoPE needs an even head dimension of at least 2 (null = \
                 model.hidden_size / model.num_attention_heads)"
            ));
        }
    } else if m.num_attention_heads > 0 && !m.hidden_size.is_multiple_of(m.num_attention_heads) {
        bad(format!(
            "model.num_attention_heads = {} does not divide model.hidden_size = {}; pick a head count that divides it (e.g. {})",
            m.num_attention_heads,
            m.hidden_size,
            nearest_divisor(m.hidden_size, m.num_attention_heads)
        ));
    } else if m.num_attention_heads > 0
        && !(m.hidden_size / m.num_attention_heads).is_multiple_of(2)
    {
        bad(format!(
            "model.hidden_size / model.num_attention_heads = {} / {} = {} is odd; RoPE needs an even head dimension",
            m.hidden_size,
            m.num_attention_heads,
            m.hidden_size / m.num_attention_heads
        ));
    }
    if m.num_key_value_heads > 0 && !m.num_attention_heads.is_multiple_of(m.num_key_value_heads) {
        bad(format!(
            "model.num_key_value_heads = {} does not divide model.num_attention_heads = {}; pick one that divides it (e.g. {})",
            m.num_key_value_heads,
            m.num_attention_heads,
            nearest_divisor(m.num_attention_heads, m.num_key_value_heads)
        ));
    }
    check_experts(m, bad);
    if t.context_length > m.max_position_embeddings {
        bad(format!(
            "training.context_length = {} exceeds model.max_position_embeddings = {}; lower the context or raise the model maximum",
            t.context_length, m.max_position_embeddings
        ));
    }
}

/// The mixture-of-experts keys against the family: experts for a MoE family only (a model
/// from `model.model_path` brings its own, checked when it is read), k within the experts,
/// loss weights that do not reward imbalance.
fn check_experts(m: &super::ModelConfig, bad: &mut impl FnMut(String)) {
    use super::Architecture as A;
    let moe_family = matches!(m.architecture, A::Qwen3Moe | A::Mixtral);
    if m.model_path.is_none() {
        if m.num_experts > 0 && !moe_family {
            bad(format!(
                "model.num_experts = {}: model.architecture = \"{}\" is a dense family; set \
                 model.architecture to qwen3_moe or mixtral for a mixture of experts, or \
                 model.num_experts = 0",
                m.num_experts, m.architecture
            ));
        }
        if m.num_experts == 0 && moe_family {
            bad(format!(
                "model.architecture = \"{}\" is a mixture of experts and model.num_experts = 0; \
                 set model.num_experts (e.g. 8) or a dense architecture (llama, qwen3)",
                m.architecture
            ));
        }
        if m.num_experts > 0 && m.num_experts_per_tok > m.num_experts {
            bad(format!(
                "model.num_experts_per_tok = {} exceeds model.num_experts = {}: a token goes \
                 to at most every expert; valid: 1..={}",
                m.num_experts_per_tok, m.num_experts, m.num_experts
            ));
        }
        if m.architecture == A::Mixtral
            && m.moe_intermediate_size
                .is_some_and(|w| w != m.intermediate_size)
        {
            bad(format!(
                "model.moe_intermediate_size = {}: a Mixtral expert is model.intermediate_size \
                 = {} wide (Mixtral's config.json has one width); set it to null",
                m.moe_intermediate_size.unwrap_or(0),
                m.intermediate_size
            ));
        }
        if m.architecture == A::Mixtral && m.decoder_sparse_step != 1 {
            bad(format!(
                "model.decoder_sparse_step = {}: every Mixtral layer is a mixture of experts; \
                 set it to 1 (or model.architecture = qwen3_moe for dense layers between)",
                m.decoder_sparse_step
            ));
        }
        if m.moe_intermediate_size == Some(0) {
            bad(
                "model.moe_intermediate_size = 0: an expert needs a width of at least 1 (null = \
                 model.intermediate_size)"
                    .into(),
            );
        }
    }
    for (key, v) in [
        ("model.router_aux_loss_coef", m.router_aux_loss_coef),
        ("model.router_z_loss_coef", m.router_z_loss_coef),
    ] {
        if v < 0.0 {
            bad(format!(
                "{key} = {v}: a negative weight rewards the imbalance the loss measures; use 0 \
                 (off) or more"
            ));
        }
    }
}

/// Tensor parallelism against the configured shape and micro-batch (the world is checked by
/// `check_world`, a model from `model.model_path` when it is loaded).
fn check_tensor_parallel_static(c: &Config, bad: &mut impl FnMut(String)) {
    let (m, s, t) = (&c.model, &c.system, &c.training);
    let tp = s.tensor_parallel;
    if tp <= 1 {
        return;
    }
    if m.model_path.is_none() {
        if let Err(e) = check_tensor_parallel(
            tp,
            (m.num_attention_heads, m.num_key_value_heads, &mlp_widths(m)),
            "the model (model.num_attention_heads, model.num_key_value_heads, \
             model.intermediate_size, model.moe_intermediate_size)",
        ) {
            bad(e.0);
        }
    }
    // Every batch a rank runs (a validation batch may have fewer rows) splits evenly.
    if s.sequence_parallel && !t.context_length.is_multiple_of(tp) {
        bad(format!(
            "system.sequence_parallel splits the tokens of every batch among \
             system.tensor_parallel = {tp} ranks, and training.context_length = {} is not a \
             multiple of {tp}: use a context of a multiple of {tp} (e.g. {}), or set \
             system.sequence_parallel = false",
            t.context_length,
            t.context_length.next_multiple_of(tp)
        ));
    }
}

/// Learning-rate, optimizer and guard settings within their ranges.
fn check_ranges(c: &Config, bad: &mut impl FnMut(String)) {
    let (m, t) = (&c.model, &c.training);
    for (key, v) in [
        ("model.rope_theta", m.rope_theta),
        ("model.rms_norm_eps", m.rms_norm_eps),
        ("model.init_std", m.init_std),
        ("training.learning_rate", t.learning_rate),
        ("training.adam_eps", t.adam_eps),
    ] {
        if v <= 0.0 {
            bad(format!("{key} = {v}: must be > 0"));
        }
    }
    if t.min_lr < 0.0 || t.min_lr > t.learning_rate {
        bad(format!(
            "training.min_lr = {} must be between 0 and training.learning_rate = {}",
            t.min_lr, t.learning_rate
        ));
    }
    for (key, v) in [
        ("training.beta1", t.beta1),
        ("training.beta2", t.beta2),
        ("training.muon_momentum", t.muon_momentum),
    ] {
        if !(0.0..1.0).contains(&v) {
            bad(format!("{key} = {v}: must be in [0, 1)"));
        }
    }
    for (key, v) in [
        ("training.weight_decay", t.weight_decay),
        ("training.max_grad_norm", t.max_grad_norm),
        ("logging.straggler_pct", c.logging.straggler_pct),
    ] {
        if v < 0.0 {
            bad(format!("{key} = {v}: must be >= 0"));
        }
    }
    if t.muon_ns_steps >= 100 {
        bad(format!(
            "training.muon_ns_steps = {}: must be 1 to 99 (torch.optim.Muon's limit; 5 is the \
             default, and more steps cost time without a better update)",
            t.muon_ns_steps
        ));
    }
    if !(t.rollback_lr_factor > 0.0 && t.rollback_lr_factor <= 1.0) {
        bad(format!(
            "training.rollback_lr_factor = {}: must be in (0, 1]",
            t.rollback_lr_factor
        ));
    }
    if t.spike_zscore < 0.0 {
        bad(format!(
            "training.spike_zscore = {}: must be >= 0 (0 = off)",
            t.spike_zscore
        ));
    }
    if !(0.0..1.0).contains(&c.data.val_fraction) {
        bad(format!(
            "data.val_fraction = {}: must be in [0, 1)",
            c.data.val_fraction
        ));
    }
}

/// The device, buckets, memory budget, timeouts and fault injection.
fn check_system(c: &Config, bad: &mut impl FnMut(String)) {
    let k = &c.checkpoint;
    if k.keep_every > 0 && k.interval == 0 {
        bad(format!(
            "checkpoint.keep_every = {} keeps the checkpoints of steps that are multiples of \
             {}, but checkpoint.interval = 0 saves only at the end, so it keeps nothing; set \
             checkpoint.interval (e.g. {}), or checkpoint.keep_every = 0",
            k.keep_every, k.keep_every, k.keep_every
        ));
    } else if k.keep_every > 0 && !k.keep_every.is_multiple_of(k.interval) {
        bad(format!(
            "checkpoint.keep_every = {} is not a multiple of checkpoint.interval = {}: saves \
             happen every {} steps, so only multiples of {} would be kept; use a multiple of {} \
             (e.g. {})",
            k.keep_every,
            k.interval,
            k.interval,
            lcm(k.keep_every, k.interval),
            k.interval,
            k.keep_every.div_ceil(k.interval) * k.interval
        ));
    }
    if c.system.device == DeviceChoice::Cpu {
        if let Err(e) = check_backend_device(c.system.dist_backend, false, "system.device = cpu") {
            bad(e.0);
        }
    }
    if c.system.bucket_mb <= 0.0 {
        bad(format!(
            "system.bucket_mb = {}: must be > 0",
            c.system.bucket_mb
        ));
    }
    if c.system.memory_budget_gb < 0.0 {
        bad(format!(
            "system.memory_budget_gb = {}: must be >= 0 (0 = what the device has free)",
            c.system.memory_budget_gb
        ));
    }
    if !(1..=255).contains(&c.debug.fault_exit_code) {
        bad(format!(
            "debug.fault_exit_code = {}: must be in 1..=255",
            c.debug.fault_exit_code
        ));
    }
}

/// Paths: the model to start from, and the run directory's name.
fn check_paths(c: &Config, bad: &mut impl FnMut(String)) {
    if let Some(path) = &c.model.model_path {
        if path.trim().is_empty() {
            bad(
                "model.model_path is an empty string; use null for a randomly initialised model"
                    .into(),
            );
        }
    }
    if let Some(name) = &c.logging.run_name {
        if let Err(why) = plain_name(name) {
            bad(format!(
                "logging.run_name = {name:?} {why}; the run directory is logging.dir/<run_name>, \
                 so the name must be one plain folder name (e.g. --set logging.run_name=exp1); \
                 put the runs elsewhere with logging.dir"
            ));
        }
    }
}

/// W&B's mode and project, MLflow's address: a mistake here would otherwise only show as a
/// tracker's warning once training has started.
fn check_trackers(c: &Config, bad: &mut impl FnMut(String)) {
    let (w, m) = (&c.logging.wandb, &c.logging.mlflow);
    if let Some(mode) = &w.mode {
        if !crate::config::WANDB_MODES.contains(&mode.as_str()) {
            bad(format!(
                "logging.wandb.mode = {mode:?} is not a W&B mode; use one of {} (or null for \
                 WANDB_MODE, else online)",
                crate::config::WANDB_MODES.join(", ")
            ));
        }
    }
    for (key, value) in [
        ("logging.wandb.project", &w.project),
        ("logging.wandb.entity", &w.entity),
        ("logging.mlflow.tracking_uri", &m.tracking_uri),
        ("logging.mlflow.experiment", &m.experiment),
    ] {
        if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
            bad(format!(
                "{key} is an empty string; give a name, or null to leave it unset"
            ));
        }
    }
    // MLflow's own limits (its database columns), so the server never answers with a
    // confusing error about them.
    for (key, value, most) in [
        ("logging.mlflow.run_name", &m.run_name, MLFLOW_RUN_NAME_MAX),
        (
            "logging.mlflow.experiment",
            &m.experiment,
            MLFLOW_EXPERIMENT_MAX,
        ),
    ] {
        if let Some(v) = value.as_deref().filter(|v| v.chars().count() > most) {
            bad(format!(
                "{key} is {} characters long; MLflow keeps at most {most}: shorten it",
                v.chars().count()
            ));
        }
    }
    if let Some(uri) = m.tracking_uri.as_deref().filter(|u| !u.trim().is_empty()) {
        if !(uri.starts_with("http://") || uri.starts_with("https://")) {
            bad(format!(
                "logging.mlflow.tracking_uri = {uri:?}: lockstep talks to an MLflow tracking \
                 server over HTTP; give its address (e.g. http://127.0.0.1:5000; start one with \
                 `mlflow server`), not a file store or other scheme"
            ));
        }
    }
}

/// MLflow's longest run name (its runs.name column).
pub const MLFLOW_RUN_NAME_MAX: usize = 250;
/// MLflow's longest experiment name (its experiments.name column).
pub const MLFLOW_EXPERIMENT_MAX: usize = 256;

/// `Ok` when `name` is one plain path component: not empty, not `.` or `..`, no `/`, no NUL or
/// other control character, at most 255 bytes.
/// Names the problem otherwise.
pub fn plain_name(name: &str) -> Result<(), String> {
    // The longest file name Linux file systems (ext4, xfs, btrfs, tmpfs) hold, in bytes.
    const NAME_MAX: usize = 255;
    if name.trim().is_empty() {
        Err("is empty".into())
    } else if name == "." || name == ".." {
        Err("names a directory relative to logging.dir, not a folder of its own".into())
    } else if name.contains('/') {
        Err("contains '/' (a path, which could lead outside logging.dir)".into())
    } else if let Some(c) = name.chars().find(|c| c.is_control()) {
        // A newline or tab in a directory name breaks log lines, shell commands and listings.
        Err(format!(
            "contains the control character {:?} (U+{:04X})",
            c, c as u32
        ))
    } else if name.len() > NAME_MAX {
        Err(format!(
            "is {} bytes long; a folder name holds at most {NAME_MAX} bytes",
            name.len()
        ))
    } else {
        Ok(())
    }
}

/// The smallest share of the mixture a source may have: the schedule deals samples in blocks
/// (`data::mixture`) whose length grows as the smallest share shrinks.
pub const MIN_SOURCE_SHARE: f64 = 1e-4;

/// `data.sources`: weights, paths and names that make a mixture, and no `data.path` beside it.
fn check_sources(c: &Config, bad: &mut impl FnMut(String)) {
    let sources = &c.data.sources;
    if sources.is_empty() {
        return;
    }
    let default_path: String = super::schema::find("data.path")
        .and_then(|k| serde_json::from_str(k.default).ok())
        .unwrap_or_default();
    if c.data.path != default_path {
        bad(format!(
            "data.path = {:?} and data.sources are both set; list {:?} as one of data.sources (with a weight) or remove data.path",
            c.data.path, c.data.path
        ));
    }
    let total: f64 = sources.iter().map(|s| s.weight.max(0.0)).sum();
    let mut names = std::collections::HashSet::new();
    for (i, s) in sources.iter().enumerate() {
        if s.weight <= 0.0 {
            bad(format!(
                "data.sources[{i}].weight = {}: must be > 0 (leave the source out to skip it)",
                s.weight
            ));
        } else if total > 0.0 && s.weight / total < MIN_SOURCE_SHARE {
            bad(format!(
                "data.sources[{i}].weight = {} is {:.1e} of the total {total}; a source needs a share of at least {MIN_SOURCE_SHARE:e}",
                s.weight,
                s.weight / total
            ));
        }
        if s.path.trim().is_empty() {
            bad(format!(
                "data.sources[{i}].path is empty; give the corpus to read"
            ));
        }
        if let Some(name) = &s.name {
            if name.trim().is_empty() {
                bad(format!("data.sources[{i}].name is empty; leave it out to name the source after its path"));
            } else if !names.insert(name.as_str()) {
                bad(format!(
                    "data.sources[{i}].name = {name:?} is used twice; source names must differ"
                ));
            }
        }
    }
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

/// The divisor of `n` closest to `want`, for a concrete suggestion in an error.
fn nearest_divisor(n: usize, want: usize) -> usize {
    (1..=n.max(1))
        .filter(|d| n.is_multiple_of(*d))
        .min_by_key(|d| d.abs_diff(want))
        .unwrap_or(1)
}

/// The rules that need the number of ranks, checked alike by `train` (every rank, at start),
/// `lockstep run` (before any worker starts) and `plan`: `system.shard_degree` divides the
/// ranks, and sharding below all of them needs a stage that shards. Returns the shard degree
/// (the ranks that shard one copy of the state; 0 = all).
pub fn check_world(c: &Config, world: usize) -> Result<usize, ConfigError> {
    let pp = c.system.pipeline_parallel.max(1);
    if !world.is_multiple_of(pp) {
        let valid: Vec<String> = (1..=world)
            .filter(|p| world.is_multiple_of(*p))
            .map(|p| p.to_string())
            .collect();
        return Err(ConfigError(format!(
            "system.pipeline_parallel = {pp}: must divide the number of ranks, {world}; valid \
             here: {}",
            valid.join(", ")
        )));
    }
    // Everything else is the mesh of one pipeline stage: the ranks over P.
    check_stage_world(c, world / pp).map_err(|e| match pp {
        1 => e,
        _ => ConfigError(format!(
            "{} (per pipeline stage: the {world} ranks over system.pipeline_parallel = {pp} \
             are {} ranks)",
            e.0,
            world / pp
        )),
    })
}

/// The mesh of one pipeline stage of `world` ranks.
fn stage_mesh(c: &Config, world: usize) -> super::MeshShape {
    super::MeshShape {
        pipeline: 1,
        ..super::MeshShape::of(c, world)
    }
}

/// [`check_world`] of the `world` ranks of one pipeline stage.
fn check_stage_world(c: &Config, world: usize) -> Result<usize, ConfigError> {
    let tp = c.system.tensor_parallel.max(1);
    if !world.is_multiple_of(tp) {
        let valid: Vec<String> = (1..=world)
            .filter(|t| world.is_multiple_of(*t) && divides_heads(c, *t))
            .map(|t| t.to_string())
            .collect();
        return Err(ConfigError(format!(
            "system.tensor_parallel = {tp}: must divide the number of ranks, {world}; valid here: {}",
            valid.join(", ")
        )));
    }
    check_context_parallel(c, world)?;
    check_expert_parallel(c, world)?;
    // The replicas: the ranks that hold the same parameters (data × context), which the state
    // is sharded over.
    let mesh = stage_mesh(c, world);
    let replicas = mesh.replicas();
    let degree = match c.system.shard_degree {
        0 => replicas,
        d => d,
    };
    if degree > replicas || !replicas.is_multiple_of(degree) {
        let cp = c.system.context_parallel.max(1);
        let over = match (tp > 1, cp > 1) {
            (false, false) => format!("the number of ranks, {world} (e.g. the ranks of one node)"),
            (true, false) => format!(
                "the {replicas} replicas (the ranks that hold the same parameters: the {world} \
                 ranks over system.tensor_parallel = {tp})"
            ),
            (_, true) => format!(
                "the {replicas} replicas (the ranks that hold the same parameters: {} data × {cp} \
                 context-parallel ranks, the {world} ranks over system.tensor_parallel = {tp})",
                mesh.data()
            ),
        };
        let valid: Vec<String> = (1..=replicas)
            .filter(|d| replicas.is_multiple_of(*d))
            .map(|d| d.to_string())
            .collect();
        return Err(ConfigError(format!(
            "system.shard_degree = {degree}: must divide {over}, or be 0 for all of them; valid \
             here: 0, {}",
            valid.join(", ")
        )));
    }
    if degree < replicas && !c.system.zero_stage.shards_optimizer() {
        return Err(ConfigError(format!(
            "system.shard_degree = {degree} shards the training state at zero_stage >= 1, and \
             system.zero_stage = 0 replicates everything; set system.zero_stage (e.g. 3) or \
             system.shard_degree = 0"
        )));
    }
    Ok(degree)
}

/// The pipeline's keys together: `system.virtual_stages` only with the interleaved schedule
/// (and at least 2 there), the interleaved schedule's micro-batches in groups of P, and no more
/// stages than `model.num_layers` (a `model.model_path` model's layers are checked with its
/// config.json, [`check_pipeline_layers`]).
fn check_pipeline_static(c: &Config, bad: &mut impl FnMut(String)) {
    use super::PipelineSchedule;
    let s = &c.system;
    let (pp, v) = (s.pipeline_parallel.max(1), s.virtual_stages.max(1));
    match s.pipeline_schedule {
        PipelineSchedule::Interleaved if v < 2 => bad(format!(
            "system.pipeline_schedule = interleaved puts system.virtual_stages stages on every \
             pipeline rank, and system.virtual_stages = {v}; set it to 2 or more (e.g. 2), or \
             system.pipeline_schedule = \"1f1b\""
        )),
        PipelineSchedule::Interleaved => {
            let m = c.training.grad_accum_nums;
            if !m.is_multiple_of(pp) {
                bad(format!(
                    "system.pipeline_schedule = interleaved takes a step's micro-batches in \
                     groups of system.pipeline_parallel = {pp}, and training.grad_accum_nums = \
                     {m} is not a multiple of {pp}; use {} (or {}), or system.pipeline_schedule \
                     = \"1f1b\"",
                    m.next_multiple_of(pp),
                    (m / pp * pp).max(pp),
                ))
            }
        }
        other if v > 1 => bad(format!(
            "system.virtual_stages = {v} is for system.pipeline_schedule = interleaved, and the \
             schedule is {other}{}; set system.virtual_stages = 1, or system.pipeline_schedule \
             = \"interleaved\"",
            if other == PipelineSchedule::Zbv {
                " (which always puts two stages on every rank, in a V)"
            } else {
                ""
            }
        )),
        _ => {}
    }
    if c.model.model_path.is_none() {
        if let Err(e) = check_pipeline_layers(c, c.model.num_layers, "model.num_layers") {
            bad(e.0);
        }
    }
}

/// The pipeline's stages against a model of `layers` decoder layers (`source` names where that
/// number comes from): every stage needs one.
pub fn check_pipeline_layers(c: &Config, layers: usize, source: &str) -> Result<(), ConfigError> {
    let s = &c.system;
    let pp = s.pipeline_parallel.max(1);
    let each = s.pipeline_schedule.stages_per_rank(s.virtual_stages);
    let stages = pp * each;
    if stages <= layers || pp == 1 {
        return Ok(());
    }
    let per_rank = match s.pipeline_schedule {
        super::PipelineSchedule::OneFOneB => String::new(),
        super::PipelineSchedule::Interleaved => format!(" × system.virtual_stages = {each}"),
        super::PipelineSchedule::Zbv => " × 2 (zbv puts two on every rank)".to_string(),
    };
    Err(ConfigError(format!(
        "system.pipeline_parallel = {pp}{per_rank} = {stages} pipeline stages, and the model has \
         {layers} decoder layers ({source}): every stage needs at least one; use at most {} \
         pipeline ranks here, or fewer stages per rank",
        (layers / each).max(1)
    )))
}

/// `train` with a setting only `lockstep plan` models yet: pipeline stages.
pub fn check_trains(c: &Config) -> Result<(), ConfigError> {
    let pp = c.system.pipeline_parallel;
    if pp > 1 {
        return Err(ConfigError(format!(
            "system.pipeline_parallel = {pp}: `lockstep plan` models pipeline stages, and \
             training with them is not built yet; set system.pipeline_parallel = 1 (tensor, \
             context and data parallelism with zero_stage 3 cover what fits without it)"
        )));
    }
    Ok(())
}

/// `system.expert_parallel` = E against the ranks: E divides the replicas (the data × context
/// ranks that hold the same parameters), which it is carved out of.
fn check_expert_parallel(c: &Config, world: usize) -> Result<(), ConfigError> {
    let ep = c.system.expert_parallel.max(1);
    let replicas = stage_mesh(c, world).replicas();
    let degree = c.system.shard_degree;
    // Hybrid sharding: each expert-parallel group inside one shard group, so that the
    // experts' holders shard their state there as the other parameters are sharded.
    if ep > 1 && degree > 0 && degree < replicas && !degree.is_multiple_of(ep) {
        let valid: Vec<String> = (1..=replicas)
            .filter(|s| replicas.is_multiple_of(*s) && s.is_multiple_of(ep))
            .map(|s| s.to_string())
            .collect();
        return Err(ConfigError(format!(
            "system.expert_parallel = {ep} must divide system.shard_degree = {degree} (an \
             expert-parallel group lies inside one shard group of hybrid sharding over \
             {replicas} replicas); valid shard degrees here: {}, or 0 for all of them",
            valid.join(", ")
        )));
    }
    if ep == 1 || replicas.is_multiple_of(ep) && world > 1 {
        return Ok(());
    }
    let valid: Vec<String> = (1..=replicas)
        .filter(|e| replicas.is_multiple_of(*e))
        .map(|e| e.to_string())
        .collect();
    let one = if world == 1 {
        "; one rank has no group to split the experts over: launch several ranks \
         (`lockstep run --nproc 2`) or set system.expert_parallel = 1"
    } else {
        ""
    };
    Err(ConfigError(format!(
        "system.expert_parallel = {ep}: must divide the {replicas} data-parallel ranks (the \
         {world} ranks over system.tensor_parallel = {}); valid here: {}{one}",
        c.system.tensor_parallel.max(1),
        valid.join(", ")
    )))
}

/// `system.expert_parallel` = E against a model of `experts` experts per MoE layer (0: a
/// dense model), read from `source`.
pub fn check_expert_parallel_model(
    ep: usize,
    experts: usize,
    source: &str,
) -> Result<(), ConfigError> {
    if ep <= 1 || (experts > 0 && experts.is_multiple_of(ep)) {
        return Ok(());
    }
    if experts == 0 {
        return Err(ConfigError(format!(
            "system.expert_parallel = {ep} splits a mixture of experts' experts among ranks, and \
             {source} is a dense model; set system.expert_parallel = 1 (or train a MoE \
             architecture: qwen3_moe, mixtral)"
        )));
    }
    let valid: Vec<String> = (1..=experts)
        .filter(|e| experts.is_multiple_of(*e))
        .map(|e| e.to_string())
        .collect();
    Err(ConfigError(format!(
        "system.expert_parallel = {ep} must divide the {experts} experts per layer of {source}; \
         valid: {}",
        valid.join(", ")
    )))
}

/// Expert parallelism against the configured model's experts (a `model.model_path` model is
/// checked on its config.json when it is built).
fn check_expert_parallel_static(c: &Config, bad: &mut impl FnMut(String)) {
    let (m, ep) = (&c.model, c.system.expert_parallel);
    if ep <= 1 {
        return;
    }
    if m.model_path.is_none() {
        if let Err(e) =
            check_expert_parallel_model(ep, m.num_experts, "the model (model.num_experts)")
        {
            bad(e.0);
        }
    }
}

/// `system.context_parallel` = C against everything it must fit at once: the ranks over T
/// (C divides them; one rank has no group), the context (cut into 2C equal chunks) and, under
/// sequence parallelism, each rank's tokens split by T. The first rule broken is named, and
/// the values offered pass every rule, so following the advice never meets another refusal.
fn check_context_parallel(c: &Config, world: usize) -> Result<(), ConfigError> {
    let (s, ctx) = (&c.system, c.training.context_length);
    let (tp, cp) = (s.tensor_parallel.max(1), s.context_parallel.max(1));
    let ranks = world / tp;
    let splits_sp = |n: usize| !(tp > 1 && s.sequence_parallel) || (ctx / n).is_multiple_of(tp);
    let fits = |n: usize| {
        n == 1
            || (world > 1 && ranks.is_multiple_of(n) && ctx.is_multiple_of(2 * n) && splits_sp(n))
    };
    if fits(cp) {
        return Ok(());
    }
    let valid: Vec<String> = (1..=ranks)
        .filter(|n| fits(*n))
        .map(|n| n.to_string())
        .collect();
    let valid = format!("valid here: {}", valid.join(", "));
    let over = if tp > 1 {
        format!("the {ranks} ranks left over system.tensor_parallel = {tp} (of {world})")
    } else {
        format!("the number of ranks, {world}")
    };
    Err(ConfigError(if world == 1 || !ranks.is_multiple_of(cp) {
        let one = if world == 1 {
            "; one rank has no group to split a sequence over: launch several ranks \
             (`lockstep run --nproc 2`) or set system.context_parallel = 1"
        } else {
            ""
        };
        format!("system.context_parallel = {cp}: must divide {over}; {valid}{one}")
    } else if !ctx.is_multiple_of(2 * cp) {
        format!(
            "system.context_parallel = {cp} cuts every sequence into 2 × {cp} = {} chunks, and \
             training.context_length = {ctx} is not a multiple of {}: use a context of a \
             multiple of {} (e.g. {}), or another system.context_parallel ({valid})",
            2 * cp,
            2 * cp,
            2 * cp,
            ctx.next_multiple_of(2 * cp),
        )
    } else {
        format!(
            "system.sequence_parallel splits each rank's {} tokens per sequence \
             (training.context_length = {ctx} over system.context_parallel = {cp}) among \
             system.tensor_parallel = {tp} ranks, which does not divide them: use a context of \
             a multiple of {} (e.g. {}), set system.sequence_parallel = false, or another \
             system.context_parallel ({valid})",
            ctx / cp,
            2 * cp * tp,
            ctx.next_multiple_of(2 * cp * tp),
        )
    }))
}

/// Whether `t` ranks can split the configured model's attention and KV heads (a model read
/// from `model.model_path` is checked on its own shape when it is loaded).
fn divides_heads(c: &Config, t: usize) -> bool {
    let m = &c.model;
    m.model_path.is_some()
        || tensor_parallel_splits(
            t,
            (m.num_attention_heads, m.num_key_value_heads, &mlp_widths(m)),
        )
}

/// The MLP widths tensor parallelism splits in the configured model: the dense MLP's, and
/// one expert's where it has experts (as `LlamaShape::mlp_widths`).
fn mlp_widths(m: &super::ModelConfig) -> Vec<usize> {
    let mut w = vec![m.intermediate_size];
    if m.num_experts > 0 {
        w.push(m.moe_intermediate_size.unwrap_or(m.intermediate_size));
    }
    w
}

/// The tensor-parallel rule, written once: `t` ranks split a model of `heads` attention
/// heads, `kv_heads` KV heads and MLPs of `ffn` features (the dense MLP's and one expert's,
/// `LlamaShape::mlp_widths`) when each divides evenly, so every rank holds whole heads and
/// an equal part of every MLP and expert.
pub fn tensor_parallel_splits(t: usize, (heads, kv_heads, ffn): (usize, usize, &[usize])) -> bool {
    heads.is_multiple_of(t) && kv_heads.is_multiple_of(t) && ffn.iter().all(|f| f.is_multiple_of(t))
}

/// `system.tensor_parallel` against a model of `heads` attention heads, `kv_heads` KV heads
/// and an MLP of `ffn` features: each must be split evenly. `source` names where the shape
/// came from.
pub fn check_tensor_parallel(
    tp: usize,
    (heads, kv_heads, ffn): (usize, usize, &[usize]),
    source: &str,
) -> Result<(), ConfigError> {
    let fits = |t: usize| tensor_parallel_splits(t, (heads, kv_heads, ffn));
    if tp <= 1 || fits(tp) {
        return Ok(());
    }
    let valid: Vec<String> = (1..=kv_heads.max(1))
        .filter(|t| fits(*t))
        .map(|t| t.to_string())
        .collect();
    Err(ConfigError(format!(
        "system.tensor_parallel = {tp}: must divide the attention heads ({heads}), the KV heads \
         ({kv_heads}) and the MLP's intermediate size ({}) of {source}, so every rank holds \
         whole heads and an equal part of the MLP{}; valid: {}",
        ffn[0],
        match ffn.get(1) {
            Some(e) => format!(" and of each expert (width {e})"),
            None => String::new(),
        },
        valid.join(", ")
    )))
}

/// `system.prefetch_units` as it runs for a model of `layers` decoder layers: at most the
/// units stage 3 gathers besides the one in use (the embedding, the layers, the final norm and
/// an untied LM head).
pub fn prefetch_units(c: &Config, layers: usize) -> usize {
    let units = layers + if c.model.tie_word_embeddings { 2 } else { 3 };
    c.system.prefetch_units.min(units - 1)
}

/// Settings accepted on `world` ranks (`cuda`: GPU ranks) for a model of `layers` decoder
/// layers that buy nothing there: one warning line each, printed by `train` (rank 0) and
/// `plan`.
pub fn world_notes(c: &Config, world: usize, cuda: bool, layers: usize) -> Vec<String> {
    let s = &c.system;
    let mut notes = Vec::new();
    if s.reduce_dtype == super::ReduceDtype::Bf16 && !cuda && world > 1 {
        notes.push(
            "system.reduce_dtype = bf16 on CPU ranks rounds every gradient to bf16 on its way \
             through the TCP ring, and CPU ranks rarely wait on the ring's bytes: it costs \
             precision and saves little; fp32 (the default) keeps it"
                .to_string(),
        );
    }
    // One replica: a single rank, or ranks that all split one copy by tensor parallelism.
    if s.zero_stage.shards_optimizer() && super::MeshShape::of(c, world).replicas() <= 1 {
        let alone = if world == 1 {
            "on a single rank".to_string()
        } else {
            format!(
                "with one replica (the {world} ranks form one system.tensor_parallel = {} group)",
                s.tensor_parallel
            )
        };
        notes.push(format!(
            "system.zero_stage = {} {alone}: there is no other rank holding the same parameters \
             to shard the state over, so it saves no memory{}; zero_stage = 0 trains the same",
            s.zero_stage,
            if s.zero_stage.shards_parameters() {
                " and gathers every unit for nothing"
            } else {
                ""
            }
        ));
    }
    let prefetch = prefetch_units(c, layers);
    if s.zero_stage.shards_parameters() && prefetch < s.prefetch_units {
        notes.push(format!(
            "system.prefetch_units = {} is more than the {prefetch} units this model has \
             besides the one in use; {prefetch} are gathered ahead",
            s.prefetch_units
        ));
    }
    notes
}

/// Every rule a layout on `world` ranks must pass, on CUDA ranks or not (`runs_on` says which,
/// for the message): the one check `train`'s ranks, `lockstep run` and `lockstep plan` make, so
/// that `plan` refuses exactly what a run would. Returns the resolved shard degree.
pub fn check_ranks(
    c: &Config,
    world: usize,
    cuda: bool,
    runs_on: &str,
) -> Result<usize, ConfigError> {
    check_backend_device(c.system.dist_backend, cuda, runs_on)?;
    check_world(c, world)
}

/// The one rule tying `system.dist_backend` to the device: NCCL reduces on CUDA devices only.
/// Checked wherever the device becomes known: statically for `system.device = cpu`, by the
/// launcher for CPU workers, and by a rank whose `auto` device came up as CPU. `runs_on` says
/// which ("lockstep run starts CPU workers").
pub fn check_backend_device(
    backend: DistBackendChoice,
    cuda: bool,
    runs_on: &str,
) -> Result<(), ConfigError> {
    if backend == DistBackendChoice::Nccl && !cuda {
        return Err(ConfigError(format!(
            "system.dist_backend = nccl needs CUDA ranks, but {runs_on}; use system.dist_backend=auto or ring, or run on GPUs"
        )));
    }
    Ok(())
}
