"""N-gram prompt lookup: draft tokens copied from the request's own history.

For each request, the longest suffix of its tokens (between ``min_n`` and
``max_n`` tokens long) that also occurs earlier in its prompt or output
proposes the tokens that followed its most recent earlier occurrence, up
to ``k`` of them. Workloads that copy from the prompt (rewriting, code
edits, extraction) get long accepted runs; free text mostly gets none, and
then nothing is proposed.

One pass per n over the whole batch with numpy: no per-request Python loop
but the final split into lists.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class NgramProposer:
    def __init__(self, k: int, min_n: int = 1, max_n: int = 4) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1, got {k}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min/max: need 1 <= min ({min_n}) <= max ({max_n})")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(
        self, token_ids: npt.NDArray[np.int64], num_tokens: npt.NDArray[np.int64]
    ) -> list[list[int]]:
        """``token_ids[i, :num_tokens[i]]`` is request i's history (the rest
        of the row is ignored). Returns each request's drafts (maybe none)."""
        batch = token_ids.shape[0]
        if batch == 0:
            return []
        width = int(num_tokens.max())
        tokens = token_ids[:, :width]
        lengths = num_tokens.astype(np.int64)
        # Where each row's drafts start (the token after the match), -1: none yet.
        follow = np.full(batch, -1, np.int64)
        for n in range(self.max_n, self.min_n - 1, -1):
            rows = np.flatnonzero((follow < 0) & (lengths > n))
            if rows.size == 0 or width < n + 1:
                continue
            follow[rows] = self._match(tokens[rows], lengths[rows], n)
        return self._drafts(tokens, lengths, follow)

    @staticmethod
    def _match(
        tokens: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], n: int
    ) -> npt.NDArray[np.int64]:
        """For each row: the index after the most recent earlier occurrence
        of its last ``n`` tokens, or -1."""
        suffix_at = lengths[:, None] - n + np.arange(n)
        suffix = np.take_along_axis(tokens, suffix_at, axis=1)  # [b, n]
        # hits[:, s]: tokens[s : s + n] equals the suffix. One comparison of
        # the whole batch per suffix position, ANDed in place (a [b, w, n]
        # window array cost 3-5x more).
        span = tokens.shape[1] - n + 1
        hits = tokens[:, :span] == suffix[:, :1]
        for j in range(1, n):
            hits &= tokens[:, j : j + span] == suffix[:, j : j + 1]
        # An occurrence must be followed by a token before the end:
        # start + n < length, which also excludes the suffix itself.
        starts = np.arange(hits.shape[1])
        hits &= starts[None, :] + n < lengths[:, None]
        last = hits.shape[1] - 1 - np.argmax(hits[:, ::-1], axis=1)
        return np.where(hits.any(axis=1), last + n, -1)

    def _drafts(
        self,
        tokens: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        follow: npt.NDArray[np.int64],
    ) -> list[list[int]]:
        at = follow[:, None] + np.arange(self.k)
        counts = np.where(follow >= 0, np.minimum(self.k, lengths - follow), 0)
        picked = np.take_along_axis(tokens, np.clip(at, 0, tokens.shape[1] - 1), axis=1)
        return [row[:count] for row, count in zip(picked.tolist(), counts.tolist(), strict=True)]
