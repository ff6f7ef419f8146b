//! The log-likelihood of chosen tokens: what multiple-choice evaluation (`data::tasks`) scores
//! each choice by. The LM head runs in chunks of `loss_chunk_tokens` tokens in the compute
//! dtype, its logits cast to fp32 before the log-softmax, as validation's loss does.

use tch::{Kind, Reduction, Tensor};

use super::llama::Llama;
use super::units::{chunks, concat, UnitEvents};

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
            // This rank's tokens of each row: all of them, or its chunks with CP.
            let (inputs, targets) = match &self.cp {
                Some(cp) => cp.begin(inputs, targets, None)?,
                None => (inputs.shallow_clone(), targets.shallow_clone()),
            };
            let targets = targets.reshape([-1]);
            // Only the positions whose targets count go through the LM head: a continuation is
            // a few tokens of its row, and the head is most of a small model's work.
            let counted = targets.ne(-100).nonzero().squeeze_dim(1);
            let picked = targets.index_select(0, &counted);
            let losses = match &self.tp {
                Some(_) => self.token_losses_split(&inputs, &counted, &picked, units)?,
                None => self.token_losses(&inputs, &counted, &picked, units)?,
            };
            let every = Tensor::zeros([targets.size()[0]], (Kind::Float, targets.device()))
                .index_copy(0, &counted, &losses);
            let mine = -every
                .view([b, -1])
                .sum_dim_intlist([1].as_slice(), false, Kind::Float);
            self.sequence_loss(mine)
        })
    }

    /// The cross-entropy (fp32 [k]) of the tokens at flat positions `counted` [k] of a whole
    /// model's pass over `inputs`, against their targets `picked` [k].
    fn token_losses(
        &self,
        inputs: &Tensor,
        counted: &Tensor,
        picked: &Tensor,
        units: &mut dyn UnitEvents,
    ) -> anyhow::Result<Tensor> {
        let hidden = self.hidden(inputs, None, units)?;
        let rows = hidden.view([-1, hidden.size()[2]]).index_select(0, counted);
        units.before(self.head_unit())?;
        let parts: Vec<Tensor> = chunks(rows.size()[0], self.activation_memory().loss_chunk_tokens)
            .map(|(at, len)| {
                let t = picked.narrow(0, at, len);
                self.chunk_cross_entropy(&rows.narrow(0, at, len), &t, Reduction::None)
            })
            .collect();
        units.after(self.head_unit())?;
        Ok(concat(parts, picked.device()))
    }
}
