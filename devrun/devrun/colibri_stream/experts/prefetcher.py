"""Next-layer expert prediction: layer l's MoE input through the routers of the next MoE layers.

Residual streams change little from one layer to the next, so layer l+1's router applied to layer l's MoE input
(the hidden state right after l's attention) picks most of the experts that l+1 will pick. The store loads the
predicted blocks in the background while layer l computes; a prediction that misses costs a wasted load, an
expert that was not predicted is loaded on demand. With `lookahead` > 1 the same input also predicts the layers
after that (less accurately, with more time to load).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .stats import ExpertStats


class Prefetcher:
    """Predicts experts of later MoE layers and keeps the recall statistics (`settle`)."""

    def __init__(self, routers: Sequence[np.ndarray], top_k: int, lookahead: int = 1):
        self.routers = [np.asarray(r, np.float32) for r in routers]  # per MoE-layer rank: [E, H]
        self.top_k = top_k
        self.lookahead = lookahead
        self._predicted: list[set[int]] = [set() for _ in routers]  # per rank: predicted for its coming step

    def predict(self, rank: int, x: np.ndarray) -> list[tuple[int, list[int]]]:
        """Predictions from the MoE input x [T, H] of layer `rank`: (later rank, its experts, most likely first).

        Each token's top-k under the later layer's router; an expert's score is its softmax probability summed
        over the tokens that pick it.
        """
        x = np.asarray(x, np.float32)  # [T, H]
        predictions = []
        for target in range(rank + 1, min(rank + 1 + self.lookahead, len(self.routers))):
            logits = x @ self.routers[target].T  # [T, E]
            probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            top = np.argsort(-probs, axis=-1, kind="stable")[:, : self.top_k]  # [T, k]
            score = np.zeros(probs.shape[1])  # [E]
            np.add.at(score, top, np.take_along_axis(probs, top, axis=-1))
            ranked = sorted(np.unique(top).tolist(), key=lambda e: (-score[e], e))
            self._predicted[target].update(ranked)
            predictions.append((target, ranked))
        return predictions

    def settle(self, rank: int, needed: Sequence[int], stats: ExpertStats) -> None:
        """Layer `rank`'s step needs `needed`: count how many of them were predicted."""
        predicted = self._predicted[rank]
        if predicted:
            stats.predicted[rank] += len(predicted)
            stats.predicted_used[rank] += len(predicted.intersection(needed))
        self._predicted[rank] = set()
