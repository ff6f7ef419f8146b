//! One `metrics.jsonl` record and its named series: the schema telemetry owns. The trainer's
//! recorder fills a [`MetricsRecord`]; metrics.jsonl is its JSON, and TensorBoard, W&B and
//! MLflow show its [`MetricsRecord::series`] (one list, so the three agree); `lockstep
//! wandb-sync` reads metrics.jsonl back into it.
//!
//! ```text
//! {"step": 120, "loss": 3.21, "lr": 2.9e-4, "grad_norm": 0.81, "tokens_per_s": 51234.0,
//!  "samples_consumed": 3840, "val_loss": null, "rss_gb": 1.52, "guard_events": 0,
//!  "mfu": 0.41, "val_time_s": …, "gpu_used_gb": …, "guard": {"spike": 1},
//!  "tokens_by_source": {"web": …}, "val_loss_by_source": {"web": …},
//!  "eval": {"hellaswag": {"acc": 0.31, "acc_norm": 0.35, "acc_stderr": 0.0046,
//!           "acc_norm_stderr": 0.0048, "n": 10042}}, "eval_time_s": …}
//! ```
//! `val_loss` and `mfu` are always there (null: no validation at this step; the device's peak
//! is unknown); the keys after them only where they apply.

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricsRecord {
    /// The optimizer step the record is of.
    pub step: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Tokens per second over all ranks, since the previous record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Samples consumed globally (all ranks) so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_consumed: Option<u64>,
    /// The validation loss (null: none at this step).
    #[serde(default)]
    pub val_loss: Option<f64>,
    /// Rank 0's resident memory in GB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_gb: Option<f64>,
    /// Guard events (skips, rollbacks) so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard_events: Option<u64>,
    /// Model FLOPs utilisation (null where the device's peak is unknown).
    #[serde(default)]
    pub mfu: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_time_s: Option<f64>,
    /// What NVML says rank 0's GPU has in use, GB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_used_gb: Option<f64>,
    /// Guard events since the previous record, by kind (nonfinite, spike).
    #[serde(default, skip_serializing_if = "IndexMap::is_empty")]
    pub guard: IndexMap<String, u64>,
    /// A mixture's tokens so far, by source.
    #[serde(default, skip_serializing_if = "IndexMap::is_empty")]
    pub tokens_by_source: IndexMap<String, u64>,
    /// A mixture's validation loss, by source (with `val_loss`).
    #[serde(default, skip_serializing_if = "IndexMap::is_empty")]
    pub val_loss_by_source: IndexMap<String, Option<f64>>,
    /// Downstream evaluation at this step (`training.eval_tasks`), by task.
    #[serde(default, skip_serializing_if = "IndexMap::is_empty")]
    pub eval: IndexMap<String, TaskMetrics>,
    /// Seconds the downstream evaluation took (not counted in tokens_per_s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_time_s: Option<f64>,
    /// A mixture of experts: the load-balancing loss (unweighted), mean over rank 0's
    /// micro-batches since the previous record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// The router z-loss (unweighted) likewise, where `model.router_z_loss_coef` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub z_loss: Option<f64>,
    /// Per MoE layer (its decoder layer index), the tokens each expert got on every rank
    /// since the previous record (k per token; each token once, though a tensor-parallel
    /// group routes it on each of its ranks).
    #[serde(default, skip_serializing_if = "IndexMap::is_empty")]
    pub expert_load: IndexMap<String, Vec<u64>>,
    /// With expert parallelism (E > 1), per MoE layer the tokens each position of an
    /// expert-parallel group got, summed over the groups: [E] each, position p holding experts
    /// [p·N/E, (p+1)·N/E) of the layer's N.
    #[serde(default, skip_serializing_if = "IndexMap::is_empty")]
    pub expert_rank_load: IndexMap<String, Vec<u64>>,
}

/// One multiple-choice task's scores, as lm-evaluation-harness reports them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskMetrics {
    pub acc: f64,
    pub acc_norm: f64,
    /// null for a single item (lm-eval: N/A).
    pub acc_stderr: Option<f64>,
    pub acc_norm_stderr: Option<f64>,
    /// Items scored.
    pub n: u64,
}

impl MetricsRecord {
    /// The named series, as TensorBoard, W&B and MLflow show them: `train/loss`, `train/lr`,
    /// `train/grad_norm`, `perf/tokens_per_s`, `perf/mfu`, `val/loss`, `val/time_s`,
    /// `val/ppl`, `val/loss/<source>`, `eval/<task>/acc`, `eval/<task>/acc_norm`,
    /// `eval/time_s`, `data/tokens/<source>`, `guard/<kind>`,
    /// `data/samples_consumed`, `memory/rss_gb`, `memory/gpu_used_gb`, `guard/events`,
    /// `train/aux_loss`, `train/z_loss`, `moe/imbalance/layer_<L>`,
    /// `moe/rank_imbalance/layer_<L>`. An absent value gives no point.
    pub fn series(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        let mut put = |name: String, v: Option<f64>| {
            if let Some(v) = v {
                out.push((name, v));
            }
        };
        let count = |n: Option<u64>| n.map(|n| n as f64);
        put("train/loss".into(), self.loss);
        put("train/lr".into(), self.lr);
        put("train/grad_norm".into(), self.grad_norm);
        put("perf/tokens_per_s".into(), self.tokens_per_s);
        put("perf/mfu".into(), self.mfu);
        put("val/loss".into(), self.val_loss);
        put("val/time_s".into(), self.val_time_s);
        put("val/ppl".into(), self.val_loss.map(f64::exp));
        for (name, v) in &self.val_loss_by_source {
            put(format!("val/loss/{name}"), *v);
        }
        for (task, m) in &self.eval {
            put(format!("eval/{task}/acc"), Some(m.acc));
            put(format!("eval/{task}/acc_norm"), Some(m.acc_norm));
        }
        put("eval/time_s".into(), self.eval_time_s);
        for (name, n) in &self.tokens_by_source {
            put(format!("data/tokens/{name}"), Some(*n as f64));
        }
        for (kind, n) in &self.guard {
            put(format!("guard/{kind}"), Some(*n as f64));
        }
        put("data/samples_consumed".into(), count(self.samples_consumed));
        put("memory/rss_gb".into(), self.rss_gb);
        put("memory/gpu_used_gb".into(), self.gpu_used_gb);
        put("guard/events".into(), count(self.guard_events));
        put("train/aux_loss".into(), self.aux_loss);
        put("train/z_loss".into(), self.z_loss);
        // Each MoE layer's busiest expert over the mean (1 = even load), and with expert
        // parallelism its busiest rank's.
        let over_mean = |load: &[u64]| {
            let total: u64 = load.iter().sum();
            let max = load.iter().copied().max().unwrap_or(0);
            let mean = total as f64 / load.len().max(1) as f64;
            (mean > 0.0).then(|| max as f64 / mean)
        };
        for (layer, load) in &self.expert_load {
            put(format!("moe/imbalance/layer_{layer}"), over_mean(load));
        }
        for (layer, load) in &self.expert_rank_load {
            put(format!("moe/rank_imbalance/layer_{layer}"), over_mean(load));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_gives_its_named_series_and_round_trips_through_its_json() {
        let line = r#"{"step":7,"loss":2.5,"lr":0.0001,"grad_norm":0.5,"tokens_per_s":1000.0,"samples_consumed":56,"val_loss":0.0,"rss_gb":1.5,"guard_events":0,"mfu":null,"tokens_by_source":{"web":10,"code":20},"val_loss_by_source":{"web":0.0,"code":null},"eval":{"hs":{"acc":0.5,"acc_norm":0.25,"acc_stderr":0.1,"acc_norm_stderr":null,"n":4}},"eval_time_s":1.5}"#;
        let record: MetricsRecord = serde_json::from_str(line).unwrap();
        let names: Vec<String> = record.series().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "train/loss",
                "train/lr",
                "train/grad_norm",
                "perf/tokens_per_s",
                "val/loss",
                "val/ppl",
                "val/loss/web",
                "eval/hs/acc",
                "eval/hs/acc_norm",
                "eval/time_s",
                "data/tokens/web",
                "data/tokens/code",
                "data/samples_consumed",
                "memory/rss_gb",
                "guard/events"
            ]
        );
        assert_eq!(record.series()[5].1, 1.0); // ppl = exp(0)
                                               // metrics.jsonl's line is the record's JSON, key for key.
        assert_eq!(serde_json::to_string(&record).unwrap(), line);
        // A step without validation or a known peak says so with nulls.
        let bare = MetricsRecord {
            step: 1,
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&bare).unwrap(),
            r#"{"step":1,"val_loss":null,"mfu":null}"#
        );
        // A mixture of experts at EP 2: each layer's busiest expert and rank over the mean.
        let moe = r#"{"step":2,"val_loss":null,"mfu":null,"aux_loss":1.1,"expert_load":{"0":[6,2,0,0]},"expert_rank_load":{"0":[8,0]}}"#;
        let record: MetricsRecord = serde_json::from_str(moe).unwrap();
        assert_eq!(
            record.series(),
            [
                ("train/aux_loss".to_string(), 1.1),
                ("moe/imbalance/layer_0".to_string(), 3.0),
                ("moe/rank_imbalance/layer_0".to_string(), 2.0)
            ]
        );
        assert_eq!(serde_json::to_string(&record).unwrap(), moe);
    }
}
