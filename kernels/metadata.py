"""What one forward pass tells the attention kernels about its batch.

A batch is a list of sequences, each contributing `query_len` new tokens
(a prefill chunk has many, a decode has one) laid end to end in one token
dimension. Sequence `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`
and has `seq_lens[i]` tokens of context *including* those new ones, so its
new tokens sit at context positions `seq_lens[i] - query_len .. seq_lens[i] - 1`
and new token `j` attends causally to context positions `<= seq_lens[i] - query_len + j`.

Context token `p` of sequence `i` lives in block `block_table[i, p // block_size]`
at offset `p % block_size`. The paged cache of one layer is a tensor
`[2, num_blocks, block_size, num_kv_heads, head_dim]`: index 0 holds K, 1 holds V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Batch layout shared by every layer of one forward pass.

    All tensors live on the model's device. The two `max_*` ints are kept on
    the host so kernels can size their grids without a device sync.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot (block * block_size + offset)
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: prefix sum of query lengths
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length incl. the new tokens
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    max_query_len: int
    max_seq_len: int
    # True when every sequence has query_len == 1 (a pure decode batch); lets
    # backends pick a cheaper path without inspecting device tensors.
    decode_only: bool = False
    # Host-side, per sequence: how many of its query rows (the first ones)
    # are prompt tokens; the rest are output tokens. The CPU attention runs
    # prompt rows with its prefill kernels and output rows with its decode
    # kernels whatever the step's shape, so a token's arithmetic does not
    # depend on how it was scheduled (a prompt's last token recomputed alone
    # after a prefix hit, a P/D decode pod's first output token computed in
    # one chunk with the prompt's tail). Empty: not told; a sequence of one
    # row is then a decode, a longer one a prefill (kernels/torch_attention.py).
    prompt_rows: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
