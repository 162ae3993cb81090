"""Reducers: device folds + host merges equal the statistic over the union."""

from __future__ import annotations

import base64
import contextlib
import math
import pickle
import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_observers.stats import (
    MOMENT_STATS,
    BinCounts,
    Count,
    LatestWindow,
    Moments,
    Partial,
    ReducerBank,
    Scalar,
    reducers,
)

ALL_STATS = ("count", "mean", "std", "var", "min", "max")
_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


def _split(values: list, cuts: list[int]) -> list[list]:
    cuts = sorted({c % (len(values) + 1) for c in cuts})
    bounds = [0, *cuts, len(values)]
    return [values[a:b] for a, b in zip(bounds, bounds[1:])]


def _merge_randomly(partials: list[Partial], rng: random.Random) -> Partial:
    """Merges in a random order and a random grouping (a random binary tree)."""
    pool = list(partials)
    rng.shuffle(pool)
    while len(pool) > 1:
        i = rng.randrange(len(pool) - 1)
        a, b = pool[i], pool[i + 1]
        merged = a.merge(b) if rng.random() < 0.5 else b.merge(a)
        pool[i : i + 2] = [merged]
    return pool[0]


def _fold_chunks(chunks: list[list[float]], dtype: torch.dtype, masks=None) -> list[Partial]:
    """Device side: one bank, one pull per chunk (what a worker does per window)."""
    bank = ReducerBank()
    moments = bank.moments("x", stats=ALL_STATS)
    count = bank.count("n")
    out = []
    for i, chunk in enumerate(chunks):
        values = torch.tensor(chunk, dtype=dtype)
        if masks is None:
            moments.fold(values)
            count.add(len(chunk))
        else:
            mask = torch.tensor(masks[i], dtype=torch.bool)
            moments.fold(values, mask)
            count.fold_true(mask)
        pulled = bank.pull()
        out.append((pulled["x"], pulled["n"]))
    return out


def _expected(values: list[float]) -> dict[str, float]:
    if not values:
        return {"x_count": 0.0}
    return {
        "x_count": float(len(values)),
        "x_mean": statistics.fmean(values),
        "x_std": statistics.pstdev(values),
        "x_var": statistics.pvariance(values),
        "x_min": min(values),
        "x_max": max(values),
    }


def _assert_close(got: dict[str, float], want: dict[str, float], scale: float) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        tol = 1e-9 * max(scale, 1.0)
        if key.endswith("var"):
            tol *= max(scale, 1.0)
        assert got[key] == pytest.approx(value, rel=1e-9, abs=tol), key


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(_finite, max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=8),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]),
)
def test_folded_and_merged_equals_union(values, cuts, seed, dtype):
    values = torch.tensor(values, dtype=torch.float64).to(dtype).tolist()  # what the device holds
    chunks = _split(values, cuts)
    pairs = _fold_chunks(chunks, dtype)
    rng = random.Random(seed)
    moments = _merge_randomly([m for m, _ in pairs], rng)
    count = _merge_randomly([c for _, c in pairs], rng)
    scale = max((abs(v) for v in values), default=1.0)
    _assert_close(moments.finalize(), _expected(values), scale)
    assert count.finalize() == {"n": float(len(values))}


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(st.tuples(_finite, st.booleans()), max_size=50),
    cuts=st.lists(st.integers(min_value=0, max_value=50), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_masked_folds_equal_union_of_kept_values(data, cuts, seed):
    _check_masked_folds(data, cuts, seed)


def _check_masked_folds(data, cuts, seed):
    """Folds masked chunks and checks that any merge of them is the union of the kept values."""
    chunks = _split(data, cuts)
    pairs = _fold_chunks(
        [[v for v, _ in c] for c in chunks],
        torch.float64,
        masks=[[m for _, m in c] for c in chunks],
    )
    rng = random.Random(seed)
    kept = [v for v, m in data if m]
    scale = max((abs(v) for v in kept), default=1.0)
    _assert_close(_merge_randomly([m for m, _ in pairs], rng).finalize(), _expected(kept), scale)
    assert _merge_randomly([c for _, c in pairs], rng).finalize() == {"n": float(len(kept))}


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(st.tuples(_finite, st.booleans()), max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=12),
    rows=st.integers(2, 4),
)
def test_many_folds_in_one_window_are_combined_on_the_device(data, cuts, rows):
    # More folds than rows: the rows are combined on the device (Chan, vectorised).
    bank = ReducerBank()
    plain = bank.moments("x", stats=ALL_STATS, rows=rows)
    masked = bank.moments("m", stats=ALL_STATS, rows=rows)
    for chunk in _split(data, cuts):
        plain.fold(torch.tensor([v for v, _ in chunk], dtype=torch.float64))
        masked.fold(
            torch.tensor([v for v, _ in chunk], dtype=torch.float64),
            torch.tensor([m for _, m in chunk], dtype=torch.bool),
        )
    out = bank.pull()
    values = [v for v, _ in data]
    kept = [v for v, m in data if m]
    scale = max((abs(v) for v in values), default=1.0)
    _assert_close(out["x"].finalize(), _expected(values), scale)
    _assert_close(out["m"].finalize(), _expected_named(kept, "m"), scale)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(_finite, max_size=30), seed=st.integers(0, 2**16))
def test_host_partials_merge_like_device_folds(values, seed):
    rng = random.Random(seed)
    singles = [Moments.from_values("x", [v], stats=ALL_STATS) for v in values]
    empties = [Moments("x", stats=ALL_STATS) for _ in range(3)]
    merged = _merge_randomly(singles + empties, rng)
    scale = max((abs(v) for v in values), default=1.0)
    _assert_close(merged.finalize(), _expected(values), scale)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(_finite, min_size=1, max_size=20))
def test_empty_partials_are_identities(values):
    full = Moments.from_values("x", values, stats=ALL_STATS)
    empty = Moments("x", stats=ALL_STATS)
    for merged in (full.merge(empty), empty.merge(full)):
        assert merged is not full
        assert (merged.count, merged.mean, merged.m2, merged.min, merged.max) == (
            full.count,
            full.mean,
            full.m2,
            full.min,
            full.max,
        )
    assert Count("n", len(values)).merge(Count("n")).finalize() == {"n": float(len(values))}
    assert Count("n").merge(Count("n", 3)).n == 3.0


def test_merge_is_exactly_commutative():
    a = Moments.from_values("x", [0.1, 0.7, 1e6])
    b = Moments.from_values("x", [3.3, -2.0])
    ab, ba = a.merge(b), b.merge(a)
    assert (ab.count, ab.mean, ab.m2, ab.min, ab.max) == (ba.count, ba.mean, ba.m2, ba.min, ba.max)


def test_merge_leaves_operands_untouched():
    a = Moments.from_values("x", [1.0, 2.0])
    b = Moments.from_values("x", [10.0])
    a.merge(b)
    assert (a.count, a.mean, a.max) == (2.0, 1.5, 2.0)
    assert (b.count, b.mean) == (1.0, 10.0)


def test_std_is_the_population_std():
    values = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    bank = ReducerBank()
    bank.moments("x", stats=("std",)).fold(values)
    got = bank.pull()["x"].finalize()["x_std"]
    assert got == pytest.approx(values.std(correction=0).item(), rel=1e-12)
    assert got != pytest.approx(values.std().item(), rel=1e-3)


def test_float32_input_is_accumulated_in_float64():
    # 2**24 + 1 is not a float32: a float32 accumulator would lose every +1.
    values = torch.tensor([2.0**24] + [1.0] * 999, dtype=torch.float32)
    bank = ReducerBank()
    bank.moments("x", stats=("count", "mean")).fold(values)
    out = bank.pull()["x"].finalize()
    assert out["x_count"] * out["x_mean"] == pytest.approx(2.0**24 + 999, abs=1e-6)


def test_integer_and_bool_inputs_fold():
    bank = ReducerBank()
    lengths = bank.moments("len", stats=("mean", "min", "max"))
    flags = bank.count("flags")
    lengths.fold(torch.tensor([3, 5, 10]))
    flags.fold_true(
        torch.tensor([[True, False], [True, True]]), torch.tensor([[True, True], [False, True]])
    )
    out = bank.pull()
    assert out["len"].finalize() == {"len_mean": 6.0, "len_min": 3.0, "len_max": 10.0}
    assert out["flags"].finalize() == {"flags": 2.0}


def test_finalize_names_and_empty_partials():
    assert Moments("reward").finalize() == {}
    assert Moments("reward", stats=("count", "mean")).finalize() == {"reward_count": 0.0}
    assert Count("dones").finalize() == {"dones": 0.0}
    m = Moments.from_values("episode_return", [1.0, 3.0], stats=MOMENT_STATS)
    assert list(m.finalize()) == [f"episode_return_{s}" for s in MOMENT_STATS]
    assert Moments.from_values("", [2.0], stats=("mean",)).finalize() == {"mean": 2.0}


def test_pull_resets_the_window_and_before_any_fold_is_empty():
    bank = ReducerBank()
    r = bank.moments("r")
    n = bank.count("n")
    assert bank.device is None
    pulled = bank.pull()
    assert pulled["r"].count == 0 and pulled["n"].n == 0
    r.fold(torch.tensor([1.0, 2.0]))
    n.add(2)
    assert bank.device == torch.device("cpu")
    assert bank.pull()["r"].count == 2
    again = bank.pull()
    assert again["r"].finalize() == {} and again["n"].finalize() == {"n": 0.0}
    r.fold(torch.tensor([5.0]))
    assert bank.pull()["r"].finalize()["r_min"] == 5.0  # min was reset to +inf


def test_empty_tensors_and_fully_masked_folds_change_nothing():
    bank = ReducerBank()
    r = bank.moments("r", stats=ALL_STATS)
    r.fold(torch.tensor([]))
    r.fold(torch.tensor([7.0, 8.0]), torch.tensor([False, False]))
    r.fold(torch.tensor([1.0, 3.0]))
    r.fold(torch.tensor([9.0]), torch.tensor([False]))
    assert bank.pull()["r"].finalize() == _expected_named([1.0, 3.0], "r")


def _expected_named(values, name):
    return {k.replace("x_", f"{name}_"): v for k, v in _expected(values).items()}


def test_partials_pickle_round_trip():
    bank = ReducerBank()
    reward = bank.moments("reward", stats=ALL_STATS)
    dones = bank.count("dones")
    reward.fold(torch.randn(100))
    dones.add(torch.tensor(4))
    for partial in bank.pull().values():
        clone = pickle.loads(pickle.dumps(partial))
        assert type(clone) is type(partial)
        assert clone.finalize() == partial.finalize()
        assert not hasattr(clone, "__dict__")  # __slots__


def test_bank_pickles_with_its_window():
    bank = ReducerBank()
    r = bank.moments("r")
    r.fold(torch.tensor([1.0, 2.0]))
    clone = pickle.loads(pickle.dumps(bank))
    clone._reducers[0].fold(torch.tensor([3.0]))
    assert clone.pull()["r"].finalize()["r_mean"] == 2.0
    assert bank.pull()["r"].finalize()["r_mean"] == 1.5


# A bank with a MomentsReducer("r", rows=2), a MomentsGroupReducer of "x" (rows=2) and a
# CountReducer("c"), nothing folded, as the previous release pickled it (protocol 4).
_BANK_PICKLED_BEFORE = base64.b64decode(
    "gASV9AEAAAAAAACMG3JsX29ic2VydmVycy5zdGF0cy5yZWR1Y2Vyc5SMC1JlZHVjZXJCYW5rlJOUKYGU"
    "fZQojAlfcmVkdWNlcnOUXZQoaACMDk1vbWVudHNSZWR1Y2VylJOUKYGUfZQojAhwcmVmaXhlc5SMAXKU"
    "hZSMCHN0YXRzX29mlCiMBG1lYW6UjANzdGSUjANtaW6UjANtYXiUdJSFlIwEcm93c5RLAowFX3VzZWSU"
    "SwCMCl9yb3dfdmlld3OUTowGX3N0YWdllE6MC19zdGFnZV9tYXNrlE6MDF9zdGFnZV9zbG90c5ROjAtf"
    "bWFza19zbG90c5ROjAhfc3RhZ2VfbpRLAIwHX3N0YWdlZJRLAIwHX3NwcmVhZJSIjAVfYmFua5RoA4wH"
    "X29mZnNldJRLAIwDa2V5lGgMjAVfdmlld5ROdWJoAIwTTW9tZW50c0dyb3VwUmVkdWNlcpSTlCmBlH2U"
    "KGgLjAF4lIWUaA5oD4WUhZRoFUsCaBZLAGgXTmgYTmgZTmgaTmgbTmgcSwBoHUsAaB6JaB9oA2ggSwpo"
    "IWgnaCJOdWJoAIwMQ291bnRSZWR1Y2VylJOUKYGUfZQoaB9oA2ggSxRoIYwBY5RoIk51YmWMBl93aWR0"
    "aJRLFYwGX3N0YXRllE6MCl9ob3N0X3ZpZXeUTnViLg=="
)


def test_a_bank_pickled_by_the_previous_release_loads_folds_and_grows():
    bank = pickle.loads(_BANK_PICKLED_BEFORE)
    assert bank.keys == ("r", "x", "c")
    r, x, c = bank._reducers
    r.fold(torch.tensor([1.0, 3.0]))
    x.fold(torch.tensor([[2.0, 4.0]]))
    c.add(2)
    bank.count("new").add(1)  # registering checks the keys of the loaded reducers
    pulled = {key: partial.finalize() for key, partial in bank.pull().items()}
    assert pulled == {
        "r": {"r_mean": 2.0, "r_std": 1.0, "r_min": 1.0, "r_max": 3.0},
        "x": {"x_mean": 3.0},
        "c": {"c": 2.0},
        "new": {"new": 1.0},
    }


def test_count_add_allocates_at_a_first_number_on_the_device_asked():
    bank = ReducerBank()
    bank.count("n").add(2, device=torch.device("meta"))
    assert bank.device == torch.device("meta")
    bank = ReducerBank()
    bank.count("n").add(2)
    assert bank.device == torch.device("cpu")


def test_fold_never_reads_a_value_on_the_host():
    # Meta tensors carry no data: any .item(), bool(), .tolist(), nonzero or
    # boolean-mask indexing raises. Folding must work; pulling must not.
    bank = ReducerBank()
    r = bank.moments("r", stats=ALL_STATS)
    n = bank.count("n")
    values = torch.empty(5, 3, device="meta")
    mask = torch.empty(5, 1, dtype=torch.bool, device="meta")
    r.fold(values)
    r.fold(values, mask)
    n.fold_true(mask)
    n.add(torch.empty((), dtype=torch.int64, device="meta"))
    n.add(3)
    assert bank.device == torch.device("meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        bank.pull()


def test_validation_errors():
    with pytest.raises(ValueError, match="stats must be"):
        Moments("x", stats=("median",))
    with pytest.raises(ValueError, match="stats must be"):
        Moments("x", stats=())
    with pytest.raises(TypeError, match="stats must be a sequence"):
        Moments("x", stats="mean")
    with pytest.raises(TypeError, match="prefix must be a str"):
        Moments(3)
    with pytest.raises(ValueError, match="count must be non-negative"):
        Moments("x", count=-1)
    with pytest.raises(ValueError, match="cannot merge"):
        Moments("x").merge(Moments("y"))
    with pytest.raises(ValueError, match="cannot merge"):
        Moments("x", stats=("mean",)).merge(Moments("x"))
    with pytest.raises(ValueError, match="cannot merge"):
        Count("a").merge(Count("b"))
    with pytest.raises(ValueError, match="cannot merge"):
        Count("a").merge(Moments("a"))
    bank = ReducerBank()
    bank.count("n")
    with pytest.raises(ValueError, match="already registered"):
        bank.moments("n")
    bank.count("m").add(1)
    with pytest.raises(ValueError, match="already registered"):
        bank.count("m")
    with pytest.raises(ValueError, match="rows must be an int >= 2"):
        ReducerBank().moments("x", rows=1)
    # the name is checked first, as the bank always did
    with pytest.raises(TypeError, match="prefix must be a str"):
        ReducerBank().moments(3, rows=1)
    with pytest.raises(TypeError, match="prefix must be a str"):
        ReducerBank().moments_group([(3, ("mean",))], rows=1)


def test_min_max_of_infinite_values():
    bank = ReducerBank()
    r = bank.moments("r", stats=("min", "max"))
    r.fold(torch.tensor([-math.inf, 0.0, math.inf]))
    assert bank.pull()["r"].finalize() == {"r_min": -math.inf, "r_max": math.inf}


# -- staged folds, groups and the CPU shortcuts ----------------------------------------


@contextlib.contextmanager
def cpu_mask_shortcuts(enabled: bool):
    """Turns the CPU-only masked-reduction shortcuts on or off (off: the device path)."""
    previous = reducers._CPU_MASK_SHORTCUTS
    reducers._CPU_MASK_SHORTCUTS = enabled
    try:
        yield
    finally:
        reducers._CPU_MASK_SHORTCUTS = previous


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(st.tuples(_finite, st.booleans()), max_size=50),
    cuts=st.lists(st.integers(min_value=0, max_value=50), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_masked_folds_on_the_device_path_equal_union(data, cuts, seed):
    # The where-based reduction that non-CPU devices run, checked for its values on the CPU.
    with cpu_mask_shortcuts(False):
        _check_masked_folds(data, cuts, seed)


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(st.tuples(_finite, st.booleans()), max_size=400),
    size=st.integers(1, 9),
    rows=st.integers(2, 4),
    masked=st.booleans(),
    shortcuts=st.booleans(),
)
def test_staged_folds_equal_union(data, size, rows, masked, shortcuts):
    # Equal-sized small folds are staged and reduced 16 at a time; a shorter last fold
    # flushes the stage early; with 2 to 4 rows the table is also compacted on the device.
    bank = ReducerBank()
    r = bank.moments("x", stats=ALL_STATS, rows=rows)
    kept = []
    with cpu_mask_shortcuts(shortcuts):
        for start in range(0, len(data), size):
            chunk = data[start : start + size]
            values = torch.tensor([v for v, _ in chunk], dtype=torch.float64)
            if masked:
                r.fold(values, torch.tensor([m for _, m in chunk]))
                kept += [v for v, m in chunk if m]
            else:
                r.fold(values)
                kept += [v for v, _ in chunk]
        out = bank.pull()["x"].finalize()
    scale = max((abs(v) for v in kept), default=1.0)
    _assert_close(out, _expected(kept), scale)


@pytest.mark.parametrize("shortcuts", [True, False])
def test_moments_group_folds_like_one_reducer_per_quantity(shortcuts):
    bank = ReducerBank()
    group = bank.moments_group([("a", ALL_STATS), ("b", ("mean", "max"))], rows=2)
    assert bank.keys == ("a", "b")
    rng = torch.Generator().manual_seed(0)
    a_kept, b_kept = [], []
    with cpu_mask_shortcuts(shortcuts):
        for n, p in ((5, 0.5), (5, 0.5), (3000, 0.02), (3000, 1.0), (7, 0.0), (5, 0.5)):
            values = torch.randn(2, n, generator=rng, dtype=torch.float64) * 100
            mask = torch.rand(n, generator=rng) < p  # sparse, full and empty masks
            group.fold(values, mask)
            a_kept += values[0][mask].tolist()
            b_kept += values[1][mask].tolist()
        group.fold(torch.ones(2, 4, 3), torch.tensor([True, False, True, False]).unsqueeze(-1))
        a_kept += [1.0] * 6
        b_kept += [1.0] * 6
        out = bank.pull()
    _assert_close(out["a"].finalize(), _expected_named(a_kept, "a"), 300.0)
    assert out["b"].finalize() == pytest.approx(
        {"b_mean": statistics.fmean(b_kept), "b_max": max(b_kept)}, rel=1e-12
    )
    assert bank.pull()["b"].finalize() == {}


def test_moments_group_validation():
    bank = ReducerBank()
    with pytest.raises(TypeError, match="specs must be a non-empty sequence"):
        bank.moments_group([])
    with pytest.raises(TypeError, match="specs must be a non-empty sequence"):
        bank.moments_group(["a"])
    with pytest.raises(ValueError, match="stats must be"):
        bank.moments_group([("a", ("median",))])
    group = bank.moments_group([("a", ("mean",)), ("b", ("mean",))])
    with pytest.raises(ValueError, match="already registered"):
        bank.moments_group([("b", ("mean",))])
    with pytest.raises(ValueError, match="already registered"):
        ReducerBank().moments_group([("c", ("mean",)), ("c", ("max",))])
    with pytest.raises(ValueError, match=r"expects values of shape \[2, ...\], got \[3, 4\]"):
        group.fold(torch.zeros(3, 4))


def test_staged_and_compacted_folds_never_read_a_value_on_the_host():
    # Staged folds are reduced when their stage fills (inside fold), the table is compacted
    # when its rows are used up, and large folds are reduced at once: all on meta tensors.
    bank = ReducerBank()
    r = bank.moments("r", stats=ALL_STATS, rows=2)
    group = bank.moments_group([("a", ("mean",)), ("b", ("max",))], rows=2)
    small = torch.empty(7, device="meta")
    small_mask = torch.empty(7, dtype=torch.bool, device="meta")
    for _ in range(16 * 5):
        r.fold(small, small_mask)
        group.fold(torch.empty(2, 7, device="meta"), small_mask)
    for _ in range(16 * 5):
        r.fold(small)
    for _ in range(5):
        r.fold(torch.empty(5000, device="meta"))
        r.fold(torch.empty(5000, device="meta"), torch.empty(5000, dtype=torch.bool, device="meta"))
        group.fold(torch.empty(2, 5000, device="meta"), torch.empty(5000, dtype=torch.bool, device="meta"))
    r._flush()
    group._flush()
    assert bank.device == torch.device("meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        bank.pull()


def test_bank_pickles_with_folds_still_staged():
    bank = ReducerBank()
    r = bank.moments("r", stats=ALL_STATS)
    values = [float(v) for v in range(40)]
    for start in range(0, 20, 2):  # ten staged folds of two values
        r.fold(torch.tensor(values[start : start + 2]))
    assert r._staged == 10
    clone = pickle.loads(pickle.dumps(bank))
    for reducer, other in ((bank._reducers[0], clone._reducers[0]),):
        for start in range(20, 40, 2):
            reducer.fold(torch.tensor(values[start : start + 2]))
            other.fold(torch.tensor(values[start : start + 2]))
    want = _expected_named(values, "r")
    _assert_close(bank.pull()["r"].finalize(), want, 40.0)
    _assert_close(clone.pull()["r"].finalize(), want, 40.0)


@pytest.mark.parametrize("shortcuts", [True, False])
def test_reducers_registered_after_the_first_fold_keep_the_window(shortcuts):
    with cpu_mask_shortcuts(shortcuts):
        bank = ReducerBank()
        early = bank.moments("early", stats=("count", "mean"))
        staged = torch.tensor([1.0, 2.0])
        early.fold(staged)  # small: staged, not reduced yet
        late = bank.count("late")  # widens the state on the device
        late.fold_true(torch.tensor([True, False, True]))
        early.fold(torch.tensor([3.0, 4.0]), mask=torch.tensor([True, False]))
        group = bank.moments_group([("a", ("count",)), ("b", ("max",))])
        group.fold(torch.tensor([[1.0, 1.0], [5.0, 7.0]]))
        out = bank.pull()
        assert out["early"].finalize() == {"early_count": 3.0, "early_mean": 2.0}
        assert out["late"].finalize() == {"late": 2.0}
        assert out["a"].finalize() == {"a_count": 2.0}
        assert out["b"].finalize() == {"b_max": 7.0}
        clone = pickle.loads(pickle.dumps(bank))
        clone.count("later").add(1)
        assert clone.pull()["later"].finalize() == {"later": 1.0}
        # Widened after a pull: the next pull reads the new state, not the one it read before.
        early.fold(torch.tensor([6.0]))
        bank.count("latest").add(2)
        out = bank.pull()
        assert out["early"].finalize() == {"early_count": 1.0, "early_mean": 6.0}
        assert out["latest"].finalize() == {"latest": 2.0}


# -- exact sums, NaN and complex values ------------------------------------------------


@pytest.mark.parametrize("shortcuts", [True, False])
@pytest.mark.parametrize("rows", [2, 32])
def test_sums_of_integers_are_exact_through_folds_compactions_and_merges(rows, shortcuts):
    # A sum derived from the mean (mean * n) is off by rounding (27.000000000000004); the
    # rows, the compactions and the merges keep the sum itself, so integer data sums exactly.
    rng = random.Random(0)
    parts, truth, kept_truth, n = [], 0, 0, 0
    with cpu_mask_shortcuts(shortcuts):
        for _window in range(3):  # three windows: partials merged on the host
            bank = ReducerBank()
            plain = bank.moments("x", stats=("count", "mean"), rows=rows)
            masked = bank.moments("m", stats=("count", "mean"), rows=rows)
            for _ in range(rng.randint(1, 80)):
                size = rng.choice((1, 1, 3, 3000))  # staged, and reduced at once
                values = [rng.randint(0, 7) for _ in range(size)]
                mask = [rng.random() < 0.5 for _ in range(size)]
                plain.fold(torch.tensor(values))
                masked.fold(torch.tensor(values), torch.tensor(mask))
                truth += sum(values)
                kept_truth += sum(v for v, k in zip(values, mask) if k)
                n += size
            parts.append(bank.pull())
    for key, want in (("x", truth), ("m", kept_truth)):
        for seed in range(4):
            assert _merge_randomly([p[key] for p in parts], random.Random(seed)).sum == want
    merged = _merge_randomly([p["x"] for p in parts], random.Random(0))
    assert merged.count == n and merged.mean == truth / n  # divided once, from the exact sum


def test_host_moments_keep_an_exact_sum():
    values = [random.Random(1).randint(0, 7) for _ in range(100)]
    singles = [Moments.from_values("x", [v], stats=("count", "mean")) for v in values]
    merged = _merge_randomly(singles, random.Random(2))
    assert merged.sum == sum(values) and merged.mean == sum(values) / len(values)
    # A partial built from its sum, its mean, or both.
    assert Moments("x", count=4, sum=10.0).mean == 2.5
    assert Moments("x", count=3, mean=0.1).mean == 0.1
    assert Moments("x", count=3, mean=0.1).sum == 0.1 * 3
    assert Moments("x", count=2, mean=1.0, sum=2.0).merge(Moments("x", count=2, sum=4.0)).sum == 6.0
    assert Moments("x").sum == 0.0 and Moments("x", sum=5.0).sum == 0.0  # no count: empty
    # math.fsum refuses inf - inf; the partial reads it as NaN, as float addition does.
    both = Moments.from_values("x", [math.inf, -math.inf], stats=("mean", "min", "max"))
    assert math.isnan(both.finalize()["x_mean"])
    assert (both.min, both.max) == (-math.inf, math.inf)


def _is_nan_everywhere(out: dict[str, float], names: tuple[str, ...]) -> bool:
    return all(math.isnan(out[name]) for name in names)


def test_nan_makes_min_and_max_nan_whatever_the_order_of_merges():
    nan = Moments.from_values("r", [math.nan], stats=ALL_STATS)
    numbers = Moments.from_values("r", [1.0, 2.0], stats=ALL_STATS)
    for merged in (nan.merge(numbers), numbers.merge(nan)):
        out = merged.finalize()
        assert out["r_count"] == 3.0
        assert _is_nan_everywhere(out, ("r_mean", "r_std", "r_var", "r_min", "r_max"))
    for values in ([math.nan, 1.0, 2.0], [1.0, math.nan, 2.0], [1.0, 2.0, math.nan]):
        out = Moments.from_values("r", values, stats=("min", "max")).finalize()
        assert _is_nan_everywhere(out, ("r_min", "r_max")), values
    # Python's min/max keep the first operand when a NaN is compared: a Scalar merges like torch.
    for rule in ("min", "max"):
        a, b = Scalar("s", rule, math.nan), Scalar("s", rule, 5.0)
        assert math.isnan(a.merge(b).value) and math.isnan(b.merge(a).value)
    entries = [((1,), (math.nan,)), ((2,), (1.0,)), ((3,), (2.0,))]
    stats = [("count", "mean", "min", "max", "median")]
    out = LatestWindow(3, ("r",), stats=stats, entries=entries).finalize()
    assert out["r_count_last_3"] == 3.0
    assert _is_nan_everywhere(out, ("r_mean_last_3", "r_min_last_3", "r_max_last_3", "r_median_last_3"))


@pytest.mark.parametrize("shortcuts", [True, False])
@pytest.mark.parametrize("size", [2, 3000])  # staged, and reduced at once
def test_nan_in_any_fold_makes_the_reducer_min_and_max_nan(size, shortcuts):
    nan_fold = torch.full((size,), math.nan)
    numbers = torch.arange(1.0, size + 1.0)
    with cpu_mask_shortcuts(shortcuts):
        for order in ((numbers, nan_fold), (nan_fold, numbers), (numbers, nan_fold, numbers)):
            for rows in (2, 32):  # also combined on the device
                bank = ReducerBank()
                r = bank.moments("r", stats=("mean", "min", "max"), rows=rows)
                for values in order:
                    for _ in range(17 if size < 16 else 1):  # small folds: past a stage of 16
                        r.fold(values)
                out = bank.pull()["r"].finalize()
                assert _is_nan_everywhere(out, ("r_mean", "r_min", "r_max")), (order, rows)
        # A NaN the mask leaves out is not in the data.
        bank = ReducerBank()
        r = bank.moments("r", stats=("mean", "min", "max"))
        keep = torch.cat((torch.zeros(size, dtype=torch.bool), torch.ones(size, dtype=torch.bool)))
        r.fold(torch.cat((nan_fold, numbers)), keep)
        assert bank.pull()["r"].finalize() == {"r_mean": (size + 1) / 2, "r_min": 1.0, "r_max": float(size)}


def test_bin_counts_count_nan_apart_and_merge_it():
    edges = (0.0, 1.0, 2.0)
    a = BinCounts.from_values("h", [math.nan, 0.5, 5.0], edges=edges, quantiles=(0.5,))
    b = BinCounts.from_values("h", [1.5, math.nan], edges=edges, quantiles=(0.5,))
    assert a.counts == (0.0, 1.0, 0.0, 1.0) and a.nan == 1.0
    for merged in (a.merge(b), b.merge(a)):
        assert merged.counts == (0.0, 1.0, 1.0, 1.0) and merged.nan == 2.0
        assert merged.finalize() == {"h_count": 3.0, "h_p50": 1.5, "h_nan_count": 2.0}
    assert "h_nan_count" not in BinCounts.from_values("h", [0.5], edges=edges).finalize()
    assert pickle.loads(pickle.dumps(a)).nan == 1.0


def test_reducers_refuse_complex_values():
    bank = ReducerBank()
    with pytest.raises(TypeError, match=r"MomentsReducer\('z'\): cannot fold complex values"):
        bank.moments("z").fold(torch.tensor([1 + 2j]))
    with pytest.raises(TypeError, match="cannot fold complex values"):
        group = bank.moments_group([("a", ("mean",)), ("b", ("mean",))])
        group.fold(torch.ones(2, 3, dtype=torch.complex64))
    assert bank.pull()["z"].finalize() == {}
