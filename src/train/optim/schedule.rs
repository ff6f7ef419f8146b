//! The learning rate of each step.

/// Linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to `floor` at `total`.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub peak: f64,
    pub floor: f64,
    pub warmup: usize,
    pub total: usize,
}

impl Schedule {
    pub fn from_config(t: &crate::config::TrainingConfig) -> Schedule {
        Schedule {
            peak: t.learning_rate,
            floor: t.min_lr,
            warmup: t.warmup_steps,
            total: t.max_steps,
        }
    }

    /// Learning rate of optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        self.floor
            + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (self.peak - self.floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let s = Schedule {
            peak: 1e-3,
            floor: 1e-4,
            warmup: 10,
            total: 110,
        };
        assert!((s.lr(0) - 1e-4).abs() < 1e-12);
        assert!((s.lr(9) - 1e-3).abs() < 1e-12);
        assert!((s.lr(10) - 1e-3).abs() < 1e-12);
        assert!((s.lr(60) - 5.5e-4).abs() < 1e-12, "midpoint of the cosine");
        assert!((s.lr(110) - 1e-4).abs() < 1e-12);
        assert!(
            (s.lr(500) - 1e-4).abs() < 1e-12,
            "stays at the floor past the end"
        );
        for i in 10..110 {
            assert!(s.lr(i + 1) <= s.lr(i));
        }
    }
}
