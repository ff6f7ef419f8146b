//! The SwiGLU MLP, `down(silu(gate(h)) · up(h))`: a dense layer's MLP and each expert of a
//! mixture (moe.rs, expert_parallel.rs), given the model's matmul.

use tch::Tensor;

/// A SwiGLU MLP's matrices: down(silu(gate(h)) · up(h)) — the dense MLP, or one expert.
pub(super) struct SwiGlu {
    /// [width, hidden] (this rank's rows under tensor parallelism).
    pub(super) gate: Tensor,
    /// [width, hidden].
    pub(super) up: Tensor,
    /// [hidden, width] (this rank's columns).
    pub(super) down: Tensor,
}

/// A matmul of the model's: `x · w^T` in its compute dtype (`Llama::linear`).
pub(super) type Linear<'a> = &'a dyn Fn(&Tensor, &Tensor) -> Tensor;

impl SwiGlu {
    /// down(silu(gate(h)) * up(h)) of the normed `h`.
    pub(super) fn forward(&self, h: &Tensor, linear: Linear) -> Tensor {
        let gate = linear(h, &self.gate).silu();
        linear(&(gate * linear(h, &self.up)), &self.down)
    }
}
