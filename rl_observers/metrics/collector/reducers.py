"""What a collector batch is folded into: the set's reducers, counters and episode window (:class:`BatchReducers`)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

import torch

from rl_observers.metrics.collector.window import EpisodeWindow
from rl_observers.stats import (
    CountReducer,
    MomentsGroupReducer,
    MomentsReducer,
    ObservedCounters,
    QuantileReducer,
)

# Implementation of CollectorBatchMetrics: nothing public here (see docs/api.rst).
__all__: list[str] = []


@dataclass(slots=True, eq=False)
class BatchReducers:
    """The reducers, counters and episode window the fold paths of a collector batch fold into.

    ``reward``, ``dones``, ``episodes`` and ``episode`` (returns and lengths
    together) are ``None`` when not reported; ``quantiles`` holds a sketch per
    episode quantity; ``window`` is the ``episode_window`` or ``None``.

    Examples:
        >>> import torch
        >>> from rl_observers.stats import ObservedCounters, ReducerBank
        >>> bank = ReducerBank()
        >>> reducers = BatchReducers(
        ...     ObservedCounters(("frames", "batches", "episodes")),
        ...     reward=bank.moments("reward"),
        ...     episode=bank.moments_group([("episode_return", ("mean",))]),
        ... )
        >>> reducers.fold_reward(torch.tensor([[1.0], [3.0]]), None, torch.Size([2]))
        >>> closing = torch.tensor([[False, True]])
        >>> reducers.fold_episodes(torch.tensor([[[0.0, 4.0]]], dtype=torch.float64), closing)
        >>> reducers.count_frames_and_episodes(torch.count_nonzero(closing), None, torch.Size([2]))
        >>> reducers.counts
        {'frames': 2, 'batches': 0, 'episodes': 1}
        >>> window = bank.pull()
        >>> window["reward"].finalize()["reward_mean"], window["episode_return"].finalize()
        (2.0, {'episode_return_mean': 4.0})
    """

    counters: ObservedCounters
    _: KW_ONLY
    reward: MomentsReducer | None = None
    dones: CountReducer | None = None
    episodes: CountReducer | None = None
    episode: MomentsGroupReducer | None = None
    quantiles: tuple[QuantileReducer, ...] = ()
    window: EpisodeWindow | None = None
    counts: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.counts = self.counters.values

    def fold_reward(
        self, reward: torch.Tensor, mask: torch.Tensor | None, batch_size: torch.Size
    ) -> None:
        """Folds a batch's per-step ``reward`` (``[*B, T, ...]``), at the steps ``mask`` keeps."""
        if mask is None:
            self.reward.fold(reward)  # type: ignore[union-attr]
        else:
            extra = (1,) * (reward.ndim - len(batch_size))
            self.reward.fold(reward, mask.reshape(*batch_size, *extra))  # type: ignore[union-attr]

    def count_frames_and_episodes(
        self, n_closed: torch.Tensor, mask: torch.Tensor | None, batch_size: torch.Size
    ) -> None:
        """Counts a batch's frames (its steps, or the steps ``mask`` keeps) and its episodes."""
        counters = self.counters
        if mask is None:
            self.counts["frames"] += batch_size.numel()
            counters.add_observed(("episodes",), n_closed)
        else:
            counters.add_observed(
                ("frames", "episodes"), torch.stack((torch.count_nonzero(mask), n_closed))
            )

    def fold_episodes(
        self,
        values: torch.Tensor,
        closing: torch.Tensor | None,
        *,
        staged: bool = True,
        base: tuple[int, int] | None = None,
    ) -> None:
        """Folds episode quantities (``values[k]``: return, length) into their moments, sketches and window.

        ``closing``: where the episodes close (``None``: one episode per column);
        ``base``: the window's clocks at the first batch (``None``: current).
        """
        self.episode.fold(values, closing, staged=staged)  # type: ignore[union-attr]
        if self.quantiles:  # (iterating over values would unbind them)
            for reducer, quantity in zip(self.quantiles, values):
                reducer.fold(quantity, None if closing is None else closing.view(quantity.shape))
        if self.window is not None:
            self.window.fold(values, closing, base)  # type: ignore[arg-type]
