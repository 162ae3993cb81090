"""The MetricSet base class: events, lock, reducers on first use, defaults, and custom.rst."""

from __future__ import annotations

import pickle
import re
import threading
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.envs import StepCounter, TransformedEnv
from torchrl.envs.utils import RandomPolicy
from torchrl.record import CSVLogger
from torchrl.testing.mocking_classes import CountingEnv

import rl_observers
from rl_observers import CollectorBatchMetrics, MetricSet, SampleMetrics, WriteMetrics

from .helpers import scalars

DOCS = Path(__file__).resolve().parent.parent / "docs"


class ActionMagnitude(MetricSet):
    counter_names = ("action_batches",)

    def on_post_collect(self, source, batch):
        self.moments("action_abs", stats=("mean", "max")).fold(batch["action"].abs())
        self.add_to_counter("action_batches", 1)


def _batch(actions):
    return TensorDict({"action": torch.tensor(actions).unsqueeze(-1)}, batch_size=[len(actions)])


def test_folded_events_are_derived_from_the_methods_and_events_still_reads_them():
    assert ActionMagnitude.folded_events == ("post_collect",)
    assert ActionMagnitude.events == ("post_collect",)
    assert ActionMagnitude().events == ("post_collect",)
    assert WriteMetrics.events == WriteMetrics.folded_events == ("post_add", "post_extend")
    assert SampleMetrics.folded_events == ("post_add", "post_extend", "post_sample")
    assert CollectorBatchMetrics.folded_events == ("post_collect",)

    class Declared(MetricSet):  # the former spelling declares the folded events
        events = ("post_sample",)

        def on_post_sample(self, source, batch, info):
            pass

        def on_post_collect(self, source, batch):  # defined, not folded
            pass

    assert Declared.folded_events == Declared.events == ("post_sample",)


def test_events_without_a_method_or_unknown_are_refused():
    with pytest.raises(TypeError, match="defines no on_post_sample method"):

        class Missing(MetricSet):
            folded_events = ("post_sample",)

    with pytest.raises(TypeError, match="must name events among"):

        class Unknown(MetricSet):
            folded_events = ("post_colect",)

            def on_post_colect(self, source, batch):
                pass


def test_defaults_count_pull_checkpoint_and_pickle():
    metrics = ActionMagnitude()
    metrics.on_post_collect(None, _batch([-1.0, 3.0]))
    assert metrics.counters() == {"action_batches": 1}
    assert metrics.stats() == {}
    state = metrics.state_dict()
    clone = pickle.loads(pickle.dumps(metrics))  # with its window
    payload = metrics.pull()
    assert payload["action_batches"] == 1.0
    assert payload["action_abs"].finalize() == {"action_abs_mean": 2.0, "action_abs_max": 3.0}
    assert clone.pull()["action_abs"].finalize() == payload["action_abs"].finalize()
    metrics.on_post_collect(None, _batch([5.0]))
    metrics.load_state_dict(state)  # counters restored, the window dropped
    assert metrics.counters() == {"action_batches": 1}
    assert metrics.pull()["action_abs"].finalize() == {}


def test_the_base_holds_the_lock_around_each_fold():
    seen = []

    class Probe(MetricSet):
        def on_post_collect(self, source, batch):
            seen.append(self._lock._is_owned())

    Probe().on_post_collect(None, None)
    assert seen == [True]
    metrics = ActionMagnitude()
    done = threading.Event()
    with metrics._lock:  # a pull holds it: a fold from another thread waits
        thread = threading.Thread(
            target=lambda: (metrics.on_post_collect(None, _batch([1.0])), done.set())
        )
        thread.start()
        assert not done.wait(0.05)
    thread.join()
    assert metrics.counters() == {"action_batches": 1}


def test_device_tensors_added_to_counters_without_a_sync():
    metrics = ActionMagnitude()
    metrics.add_to_counter("action_batches", torch.tensor(3))
    assert metrics.counters() == {"action_batches": 3}


def _python_blocks(path: Path) -> list[str]:
    text = path.read_text()
    blocks = []
    for match in re.finditer(r"\.\. code-block:: python\n\n((?:   .*\n|\n)+)", text):
        lines = match.group(1).splitlines()
        blocks.append("\n".join(line[3:] for line in lines))
    return blocks


def test_the_custom_metrics_page_runs(tmp_path):
    env = TransformedEnv(CountingEnv(max_steps=50), StepCounter(max_steps=4))
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=10, total_frames=60)
    logger = CSVLogger(exp_name="custom", log_dir=str(tmp_path))
    namespace = {"collector": collector, "logger": logger, "__name__": "custom_docs"}
    blocks = _python_blocks(DOCS / "custom.rst")
    assert len(blocks) >= 8
    try:
        for block in blocks:
            exec(compile(block, str(DOCS / "custom.rst"), "exec"), namespace)
        short = namespace["ActionMagnitude"]()
        batches = []
        for batch in collector:
            short.on_post_collect(collector, batch)
            batches.append(batch.clone())
    finally:
        collector.shutdown()
    assert rl_observers.MetricsChannel.for_logger(logger).flush(timeout=10)
    assert short.pull()["action_abs"].finalize()["action_abs_mean"] >= 0
    # the one-liners, against the data
    truncated = torch.cat([b["next", "truncated"].reshape(-1) for b in batches]).float()
    fraction = scalars(logger, "collector/truncated_fraction")
    assert [step for step, _ in fraction] == [20, 40, 60]
    assert fraction[-1][1] == pytest.approx(truncated[40:].mean().item())
    obs = torch.cat([b["observation"].reshape(-1) for b in batches[4:]]).float()
    assert scalars(logger, "collector/obs_max")[-1][1] == obs.max().item()
    assert scalars(logger, "collector/obs_hist_p50")
    assert scalars(logger, "collector/episode_return_mean")
    # the custom metric set, in a second observer
    assert 0 < scalars(logger, "truncations/truncated_fraction")[-1][1] <= 1  # of finished episodes
    assert scalars(logger, "truncations/truncation_batches")[-1][1] == 6
    # the replay buffer, the policy lag and the provider
    assert scalars(logger, "replay_buffer/reward_written")[0][1] == 100
    assert scalars(logger, "replay_buffer/sampled_reward")[-1] == (20, 1.0)
    lag = scalars(logger, "replay/policy_lag_mean")
    assert [step for step, _ in lag] == [10, 20, 30] and lag[-1][1] > 0
    assert namespace["rb"].stats()["fill"] == 0.1
