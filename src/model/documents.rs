//! Packed windows of several documents (`data.document_masking`, `data.reset_position_ids`):
//! what attention and RoPE need so that each document behaves as its own sequence.
//!
//! A batch's rows are cut into pieces at document starts (`TokenFile::document_pieces`). From
//! those lengths this builds, on the batch's device: the restarted RoPE positions, the
//! block-diagonal causal mask that SDPA and the math backend take, and the cumulative sequence
//! lengths that variable-length flash attention takes on CUDA (`flash.rs`), where the mask is
//! never built.

use std::cell::OnceCell;

use tch::{Device, Kind, Tensor};

/// The document structure of one batch of packed rows.
pub struct DocumentMask {
    /// Attention stays inside documents (`data.document_masking`).
    masking: bool,
    /// RoPE position of every token, restarting at 0 at each document start: [batch, seq]
    /// int64 (`data.reset_position_ids`).
    positions: Option<Tensor>,
    /// Document number of every token within its row: [batch, seq] int64.
    doc_ids: Tensor,
    /// Where each piece starts in the flattened batch, and the total: [pieces + 1] int32.
    cu_seqlens: Tensor,
    /// The longest piece.
    max_len: i64,
    /// [batch, 1, seq, seq] bool, true where a query may see a key; built on first use.
    allowed: OnceCell<Tensor>,
}

impl DocumentMask {
    /// `pieces[r]` are the lengths of row r's documents in order (each row sums to the same
    /// sequence length). `masking` and `reset_positions` say which of the two effects apply.
    pub fn new(
        pieces: &[Vec<usize>],
        masking: bool,
        reset_positions: bool,
        device: Device,
    ) -> DocumentMask {
        let rows = pieces.len();
        let seq: usize = pieces.first().map_or(0, |p| p.iter().sum());
        let mut doc_ids = Vec::with_capacity(rows * seq);
        let mut positions = Vec::with_capacity(rows * seq);
        let mut cu = vec![0i32];
        let mut max_len = 0;
        for row in pieces {
            assert_eq!(
                row.iter().sum::<usize>(),
                seq,
                "every row of a batch has the same length"
            );
            for (d, &len) in row.iter().enumerate() {
                doc_ids.extend(std::iter::repeat_n(d as i64, len));
                positions.extend(0..len as i64);
                cu.push(cu.last().expect("starts with 0") + len as i32);
                max_len = max_len.max(len as i64);
            }
        }
        let shape = [rows as i64, seq as i64];
        let upload = |v: &[i64]| Tensor::from_slice(v).view(shape).to_device(device);
        DocumentMask {
            masking,
            positions: reset_positions.then(|| upload(&positions)),
            doc_ids: upload(&doc_ids),
            cu_seqlens: Tensor::from_slice(&cu).to_device(device),
            max_len,
            allowed: OnceCell::new(),
        }
    }

    /// Whether attention is confined to documents.
    pub fn masks_attention(&self) -> bool {
        self.masking
    }

    /// Restarted RoPE positions [batch, seq], when they are reset.
    pub fn positions(&self) -> Option<&Tensor> {
        self.positions.as_ref()
    }

    /// [batch, 1, seq, seq] bool, true where query i may attend to key j: same document and
    /// j <= i. Built once per batch and shared by every layer.
    pub fn attention_mask(&self) -> &Tensor {
        self.allowed.get_or_init(|| {
            let seq = self.doc_ids.size()[1];
            let same_doc = self
                .doc_ids
                .unsqueeze(2)
                .eq_tensor(&self.doc_ids.unsqueeze(1));
            let causal = Tensor::ones([seq, seq], (Kind::Bool, self.doc_ids.device())).tril(0);
            same_doc.logical_and(&causal).unsqueeze(1)
        })
    }

    /// Document number of every token within its row: [batch, seq] int64 (context parallelism
    /// builds its blocks' masks from it).
    pub fn doc_ids(&self) -> &Tensor {
        &self.doc_ids
    }

    /// Cumulative piece lengths over the flattened batch (int32) and the longest piece: the
    /// `cu_seqlens` / `max_seqlen` of variable-length attention.
    pub fn cu_seqlens(&self) -> (&Tensor, i64) {
        (&self.cu_seqlens, self.max_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_positions_and_lengths_follow_the_pieces() {
        let d = DocumentMask::new(&[vec![2, 3], vec![5]], true, true, Device::Cpu);
        let pos: Vec<i64> = Vec::try_from(d.positions().unwrap().reshape([-1])).unwrap();
        assert_eq!(pos, [0, 1, 0, 1, 2, 0, 1, 2, 3, 4]);
        let (cu, max) = d.cu_seqlens();
        assert_eq!(Vec::<i32>::try_from(cu).unwrap(), [0, 2, 5, 10]);
        assert_eq!(max, 5);
        let m = d.attention_mask();
        assert_eq!(m.size(), [2, 1, 5, 5]);
        let row0: Vec<i64> =
            Vec::try_from(m.get(0).get(0).to_kind(Kind::Int64).reshape([-1])).unwrap();
        #[rustfmt::skip]
        assert_eq!(row0, [
            1, 0, 0, 0, 0,
            1, 1, 0, 0, 0,
            0, 0, 1, 0, 0,
            0, 0, 1, 1, 0,
            0, 0, 1, 1, 1,
        ]);
        // One document is the plain causal mask.
        let causal = Tensor::ones([5, 5], (Kind::Bool, Device::Cpu)).tril(0);
        assert!(m.get(1).get(0).equal(&causal));
        assert!(DocumentMask::new(&[vec![5]], true, false, Device::Cpu)
            .positions()
            .is_none());
    }
}
