//! The log-likelihood of chosen tokens: what multiple-choice evaluation (`data::tasks`) scores
//! each choice by. The LM head runs in chunks of `loss_chunk_tokens` tokens in the compute
//! dtype, its logits cast to fp32 before the log-softmax, as validation's loss does.

use tch::{Kind, Reduction, Tensor};

use super::llama::Llama;
use super::units::{chunks, UnitEvents};

impl Llama {
    /// Each row's log-likelihood of its targets: Σ_t log p(targets[r, t] | inputs[r, ..=t])
    /// over the targets that count (not -100), fp32 [b] for `inputs` and `targets` [b, s]
    /// (int64). The same on every rank of a tensor- or context-parallel group, which take the
    /// same rows (context parallelism cuts s into 2C chunks: s must be a multiple of 2C; with
    /// sequence parallelism b·s a multiple of T). Without gradients; `units` hears of each
    /// unit's use as in `loss_units`.
    pub fn row_log_likelihoods(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        units: &mut dyn UnitEvents,
    ) -> anyhow::Result<Tensor> {
        let b = inputs.size()[0];
        tch::no_grad(|| {
            let (inputs, targets) = match &self.cp {
                Some(cp) => cp.begin(inputs, targets, None)?,
                None => (inputs.shallow_clone(), targets.shallow_clone()),
            };
            let losses = match &self.tp {
                Some(_) => self.token_losses_split(&inputs, &targets, units)?,
                None => self.token_losses(&inputs, &targets, units)?,
            };
            // This rank's tokens of each row: all of them, or its chunks with CP.
            let mine = -losses
                .view([b, -1])
                .sum_dim_intlist([1].as_slice(), false, Kind::Float);
            self.sequence_loss(mine)
        })
    }

    /// Each token's cross-entropy (fp32 [b·s], 0 where the target is -100) of a whole model.
    fn token_losses(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        units: &mut dyn UnitEvents,
    ) -> anyhow::Result<Tensor> {
        let hidden = self.hidden(inputs, None, units)?;
        let flat = hidden.view([-1, hidden.size()[2]]);
        let targets = targets.reshape([-1]);
        units.before(self.head_unit())?;
        let parts: Vec<Tensor> = chunks(flat.size()[0], self.activation_memory().loss_chunk_tokens)
            .map(|(at, len)| {
                self.lm_head(&flat.narrow(0, at, len))
                    .to_kind(Kind::Float)
                    .cross_entropy_loss::<Tensor>(
                        &targets.narrow(0, at, len),
                        None,
                        Reduction::None,
                        -100,
                        0.0,
                    )
            })
            .collect();
        units.after(self.head_unit())?;
        Ok(Tensor::cat(&parts, 0))
    }
}
