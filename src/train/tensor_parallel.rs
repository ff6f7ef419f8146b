//! The model's tensor-parallel collectives ([`TpComm`]) over a process group: the trainer's
//! side of `model::tensor_parallel`, which knows how a layer is split but not who splits it.
//! Each collective is counted by kind, so a test can assert how many a step runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use crate::dist::group::gather_equal;
use crate::dist::{on_group, SharedGroup};
use crate::model::TpComm;

/// Collectives run so far, by kind.
#[derive(Debug, Default)]
pub struct Counts {
    pub all_gather: AtomicUsize,
    pub reduce_scatter: AtomicUsize,
    pub all_reduce: AtomicUsize,
    pub all_to_all: AtomicUsize,
}

impl Counts {
    /// (all-gathers, reduce-scatters, all-reduces).
    pub fn get(&self) -> (usize, usize, usize) {
        (
            self.all_gather.load(Ordering::Relaxed),
            self.reduce_scatter.load(Ordering::Relaxed),
            self.all_reduce.load(Ordering::Relaxed),
        )
    }
}

/// [`TpComm`] on this rank's tensor-parallel group.
pub struct GroupComm {
    group: SharedGroup,
    size: usize,
    rank: usize,
    counts: Arc<Counts>,
}

impl GroupComm {
    pub fn new(group: SharedGroup) -> Result<GroupComm> {
        let (rank, size) = {
            let g = group
                .lock()
                .map_err(|_| anyhow::anyhow!("a tensor-parallel collective panicked earlier"))?;
            (g.rank(), g.world_size())
        };
        Ok(GroupComm {
            group,
            size,
            rank,
            counts: Arc::default(),
        })
    }

    /// The counts this comm adds to (shared: read them while the model holds the comm).
    pub fn counts(&self) -> Arc<Counts> {
        self.counts.clone()
    }

    fn run<T>(
        &self,
        count: &AtomicUsize,
        f: impl FnOnce(&mut dyn crate::dist::ProcessGroup) -> Result<T>,
    ) -> Result<T> {
        count.fetch_add(1, Ordering::Relaxed);
        let mut unused = crate::dist::SingleProcess;
        on_group(Some(&self.group), &mut unused, f)
    }
}

impl TpComm for GroupComm {
    fn all_reduce_sum(&mut self, t: &Tensor) -> Result<()> {
        anyhow::ensure!(
            t.is_contiguous(),
            "internal: tensor-parallel all-reduce of a strided tensor"
        );
        self.run(&self.counts.all_reduce, |g| g.all_reduce_sum_tensor(t))
    }

    fn all_gather(&mut self, t: &Tensor) -> Result<Tensor> {
        let buffer = self.run(&self.counts.all_gather, |g| gather_equal(g, t))?;
        let mut shape = t.size();
        shape[0] *= self.size as i64;
        Ok(buffer.view(shape.as_slice()))
    }

    fn reduce_scatter(&mut self, t: &Tensor) -> Result<Tensor> {
        let mut shape = t.size();
        anyhow::ensure!(
            shape[0] % self.size as i64 == 0,
            "internal: reduce-scatter of {} rows over {} ranks",
            shape[0],
            self.size
        );
        // A copy: the caller's tensor may be saved for its backward.
        let buffer = tch::no_grad(|| t.reshape(-1).copy());
        let n = buffer.numel() / self.size;
        let splits = vec![n; self.size];
        self.run(&self.counts.reduce_scatter, |g| {
            g.reduce_scatter_sum_tensor(&buffer, &splits)
        })?;
        shape[0] /= self.size as i64;
        Ok(buffer
            .narrow(0, (n * self.rank) as i64, n as i64)
            .view(shape.as_slice()))
    }

    fn all_to_all(
        &mut self,
        t: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Tensor> {
        self.run(&self.counts.all_to_all, |g| {
            g.all_to_all_tensor(t, send_rows, recv_rows)
        })
    }
}

#[cfg(test)]
mod tests {
    //! Expert parallelism at the model: P ranks (threads of this process on a ring), each
    //! holding E/P experts of every MoE layer and passing its own rows, against one rank
    //! holding every expert and passing all the rows.

    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tch::nn::VarStore;
    use tch::{Device, Kind, Tensor};

    use super::GroupComm;
    use crate::config::ActivationCheckpointing;
    use crate::dist::ring::tests::run_ranks;
    use crate::dist::ProcessGroup;
    use crate::model::{ActivationMemory, ExpertParallel, Llama, LlamaShape, NoEvents};

    /// A 3-layer Qwen3-MoE model: layers 0 and 2 route to 2 of 4 experts of width 24, layer
    /// 1 is a dense MLP; the load-balancing loss weighted 0.05.
    fn moe_shape(architecture: crate::config::Architecture) -> LlamaShape {
        use crate::config::Architecture;
        let mut m = crate::config::resolve(&crate::config::Sources::default())
            .unwrap()
            .config
            .model;
        m.architecture = architecture;
        (m.num_layers, m.hidden_size) = (3, 64);
        (m.num_attention_heads, m.num_key_value_heads) = (4, 2);
        (m.num_experts, m.num_experts_per_tok) = (4, 2);
        m.router_aux_loss_coef = 0.05;
        if architecture == Architecture::Qwen3Moe {
            // Qwen3-MoE: experts of their own width, the middle layer dense.
            m.intermediate_size = 96;
            m.moe_intermediate_size = Some(24);
            let mut shape = LlamaShape::from_config(&m, 96).unwrap();
            shape.moe.as_mut().unwrap().dense_layers = vec![1];
            return shape;
        }
        // Mixtral: every layer a mixture, experts of intermediate_size.
        m.intermediate_size = 24;
        LlamaShape::from_config(&m, 96).unwrap()
    }

    /// Values that threads share (a tensor is not `Sync`): by name, its elements and shape.
    type Init = HashMap<String, (Vec<f32>, Vec<i64>)>;

    /// The same initial weights for every model: drawn once, by name.
    fn weights(shape: &LlamaShape, zero_router: bool) -> Init {
        tch::manual_seed(5);
        let vs = VarStore::new(Device::Cpu);
        let _ = Llama::new(&vs.root(), shape, 64, Kind::Float);
        Llama::named_parameters(&vs)
            .into_iter()
            .map(|(n, p)| {
                let zero = zero_router && n.ends_with(".gate.weight"); // both families' routers
                let p = if zero { p.zeros_like() } else { p.detach() };
                let values = Vec::<f32>::try_from(p.reshape(-1)).unwrap();
                (n, (values, p.size()))
            })
            .collect()
    }

    /// Forward and backward of one model over each of `batches` (rows [b, 17]: inputs, then
    /// targets shifted) with its loss scaled by `scale`: its gradients by name.
    fn pass(
        model: &Llama,
        vs: &VarStore,
        batches: &[Tensor],
        scale: f64,
    ) -> HashMap<String, Tensor> {
        for rows in batches {
            let (x, y) = (rows.narrow(1, 0, 16), rows.narrow(1, 1, 16));
            let _ = model
                .forward_backward(&x, &y, None, scale, &mut NoEvents)
                .unwrap();
        }
        Llama::named_parameters(vs)
            .into_iter()
            .map(|(n, p)| {
                // An expert that got no tokens has no gradient: zero.
                let g = p.grad();
                (
                    n,
                    if g.defined() {
                        g.copy()
                    } else {
                        p.zeros_like()
                    },
                )
            })
            .collect()
    }

    fn model_with(
        shape: &LlamaShape,
        init: &Init,
        ep: Option<ExpertParallel>,
        mode: ActivationCheckpointing,
    ) -> (VarStore, Llama) {
        let vs = VarStore::new(Device::Cpu);
        let mut model = Llama::new_parallel(
            &vs.root(),
            shape,
            64,
            Kind::Float,
            (None, ep),
            &mut |name, _, _| {
                let (values, shape) = &init[name];
                Tensor::from_slice(values).view(shape.as_slice())
            },
        )
        .unwrap();
        model.set_activation_memory(ActivationMemory {
            checkpointing: mode,
            ..ActivationMemory::default()
        });
        (vs, model)
    }

    /// EP 2 and EP 4 against one rank that accumulates the same micro-batches (each rank's
    /// rows, the loss scaled 1/P; the load-balancing loss is each micro-batch's own, as on
    /// data-parallel ranks): every gradient within 1e-5 of the whole model's (the dense ones
    /// averaged over the ranks, each expert's divided by P: the mean over the ranks' losses),
    /// in every checkpointing mode; and with a zero router (every token to experts 2 and 3:
    /// EP 2's rank 0 and EP 4's ranks 0 and 1 receive nothing). Qwen3-MoE (a dense layer
    /// between two mixtures) and Mixtral (mixtures only, its HF names).
    #[test]
    fn expert_parallel_gradients_equal_one_ranks() {
        use crate::config::Architecture;
        for architecture in [Architecture::Qwen3Moe, Architecture::Mixtral] {
            expert_parallel_gradients_equal_one_ranks_for(architecture);
        }
    }

    fn expert_parallel_gradients_equal_one_ranks_for(architecture: crate::config::Architecture) {
        let shape = moe_shape(architecture);
        let moe = shape.moe.as_ref().unwrap();
        let moe_layers = shape.num_layers - moe.dense_layers.len();
        let ids: Vec<i64> = (0..4 * 17).map(|i| (i * 7919 + 13) % 96).collect();
        let rows = || Tensor::from_slice(&ids).view([4, 17]);
        for zero_router in [false, true] {
            let init = weights(&shape, zero_router);
            for mode in [
                ActivationCheckpointing::None,
                ActivationCheckpointing::Full,
                ActivationCheckpointing::Selective,
            ] {
                for p in [2, 4] {
                    let (vs, whole) = model_with(&shape, &init, None, mode);
                    let batches: Vec<Tensor> = (0..p)
                        .map(|r| rows().narrow(0, (r * 4 / p) as i64, 4 / p as i64))
                        .collect();
                    let want = pass(&whole, &vs, &batches, 1.0 / p as f64);
                    let block = match architecture {
                        crate::config::Architecture::Mixtral => "block_sparse_moe.experts.3.w2",
                        _ => "mlp.experts.3.down_proj",
                    };
                    assert!(want.keys().any(|n| n.contains(block)), "{block}");
                    let per = 4 / p;
                    let got = run_ranks(p, Duration::from_secs(30), |r, g| {
                        let group = Arc::new(Mutex::new(Box::new(g) as Box<dyn ProcessGroup>));
                        let comm = GroupComm::new(group).unwrap();
                        let counts = comm.counts();
                        let ep = ExpertParallel::new(r, p, Box::new(comm));
                        let (vs, model) = model_with(&shape, &init, Some(ep), mode);
                        let mine = rows().narrow(0, (r * 4 / p) as i64, 4 / p as i64);
                        let grads = pass(&model, &vs, &[mine], 1.0);
                        (
                            grads,
                            counts.all_to_all.load(std::sync::atomic::Ordering::Relaxed),
                        )
                    });
                    // Each MoE layer 3 forward + 2 backward, the forward again where
                    // recomputed.
                    let calls = moe_layers
                        * match mode {
                            ActivationCheckpointing::None => 5,
                            _ => 8,
                        };
                    let what =
                        format!("{architecture:?} EP {p}, {mode:?}, zero router {zero_router}");
                    assert!(got.iter().all(|(_, c)| *c == calls), "{what}: all-to-alls");
                    for (name, w) in &want {
                        let expert = name
                            .split(".experts.")
                            .nth(1)
                            .map(|t| t.split('.').next().unwrap().parse::<usize>().unwrap());
                        let g = match expert {
                            Some(e) => &got[e / per].0[name] / p as f64,
                            None => {
                                got.iter()
                                    .map(|(g, _)| g[name].shallow_clone())
                                    .reduce(|a, b| a + b)
                                    .unwrap()
                                    / p as f64
                            }
                        };
                        for (r, (grads, _)) in got.iter().enumerate() {
                            let held = expert.is_none_or(|e| e / per == r);
                            assert_eq!(grads.contains_key(name), held, "{what}: {name} on {r}");
                        }
                        let scale = w.abs().max().double_value(&[]).max(1e-30);
                        let err = (&g - w).abs().max().double_value(&[]) / scale;
                        assert!(err < 1e-5, "{what}: {name} rel {err:.2e}");
                        if zero_router && name.contains(".experts.0.") {
                            assert_eq!(scale, 1e-30, "{what}: expert 0 got tokens");
                        }
                    }
                }
            }
        }
    }
}
