"""The autotuner's pure parts: the search, the sampling, its settings and messages."""

from __future__ import annotations

import csv
import logging
import pickle

import pytest

from hvd_spark import config as cfg
from hvd_spark.collectives import autotune
from hvd_spark.collectives import messages as m
from hvd_spark.collectives.autotune import Autotuner, CoordinateSearch, Params
from hvd_spark.collectives.coordinator import Coordinator
from hvd_spark.config import AutotuneConfig, EngineConfig
from hvd_spark.errors import ConfigError

START = Params(64 << 20, 1.0, 1 << 20)
GRIDS = autotune.grids(START, (), tune_chunk=True)


def run_search(search: CoordinateSearch, score_of) -> list[Params]:
    tried = []
    while (p := search.candidate()) is not None:
        tried.append(p)
        search.report(score_of(p))
    return tried


def test_flat_scores_keep_the_start_and_stay_bounded():
    search = CoordinateSearch(START, GRIDS)
    tried = run_search(search, lambda p: 100.0)
    assert search.best == START
    # Start, then every other grid value per parameter: no final check needed.
    assert tried[0] == START and len(tried) == 1 + 4 * 3
    assert search.done and search.candidate() is None


def test_finds_the_best_chunk_and_confirms_it():
    # Throughput grows with the chunk; the other parameters do not matter.
    search = CoordinateSearch(START, GRIDS)
    tried = run_search(search, lambda p: p.chunk_bytes / 1e4)
    assert search.best == Params(64 << 20, 1.0, 4 << 20)
    # The scan goes outwards from the start: neighbours first.
    assert [p.chunk_bytes >> 10 for p in tried[1:5]] == [512, 2048, 256, 4096]
    # The final check measures start and best back to back.
    assert tried[-2:] == [START, search.best]
    assert [phase for _, _, phase in search.history[-2:]] == ["check", "check"]


def test_a_gain_past_a_flat_stretch_is_found():
    # 2 MiB gains nothing over 1 MiB, 4 MiB gains 20%: a hill climb would stop at 2 MiB.
    search = CoordinateSearch(START, GRIDS)
    run_search(search, lambda p: 120.0 if p.chunk_bytes == 4 << 20 else 100.0)
    assert search.best.chunk_bytes == 4 << 20


def test_smaller_values_are_found_too():
    search = CoordinateSearch(START, GRIDS)
    run_search(search, lambda p: 1e9 / p.fusion_threshold)
    assert search.best.fusion_threshold == 4 << 20


def test_gains_within_the_margin_are_noise():
    search = CoordinateSearch(START, GRIDS, margin=0.05)
    run_search(search, lambda p: 100.0 * (1.04 if p.chunk_bytes == 4 << 20 else 1.0))
    assert search.best == START


def test_the_final_check_reverts_a_choice_that_was_luck():
    seen: set[Params] = set()
    search = CoordinateSearch(START, GRIDS)

    def score(p):  # the 512 KiB chunk was lucky the first time only
        lucky = p.chunk_bytes == 512 << 10 and p not in seen
        seen.add(p)
        return 150.0 if lucky else 100.0

    run_search(search, score)
    assert search.best == START


def test_candidates_are_capped():
    search = CoordinateSearch(START, GRIDS, max_candidates=5)
    tried = run_search(search, lambda p: p.chunk_bytes / 1e4 + 1e9 / p.fusion_threshold)
    assert len(tried) <= 5


def test_fixed_parameters_and_untunable_chunk_are_not_searched():
    grids = autotune.grids(START, {"fusion_threshold"}, tune_chunk=False)
    assert grids["fusion_threshold"] == (64 << 20,) and grids["chunk_bytes"] == (1 << 20,)
    assert len(grids["cycle_time_ms"]) > 1
    nothing = autotune.grids(START, {"fusion_threshold", "cycle_time_ms"}, tune_chunk=False)
    search = CoordinateSearch(START, nothing)
    assert search.done and search.best == START


def test_start_values_off_the_grid_are_included():
    odd = Params(5 << 20, 3.0, 1 << 20)
    grids = autotune.grids(odd, (), tune_chunk=True)
    assert 5 << 20 in grids["fusion_threshold"] and 3.0 in grids["cycle_time_ms"]
    assert list(grids["fusion_threshold"]) == sorted(grids["fusion_threshold"])


def test_largest_chunk_candidate_is_the_slot_size():
    assert max(autotune.CHUNK_GRID) == cfg.AUTOTUNE_MAX_CHUNK_BYTES


def feed_steps(tuner: Autotuner, steps: int, step_s, names=("a", "b", "c"), nbytes=1000):
    """Drive the tuner with ``steps`` training steps; return the switches it asked for."""
    now, switches = 0.0, []
    for _ in range(steps):
        for name in names:
            change = tuner.observe([name], nbytes, now)
            if change is not None:
                switches.append(change)
        now += step_s(tuner.current)
    return switches


def test_sampling_scores_steps_and_switches_to_the_faster_setting(tmp_path, caplog):
    log_path = tmp_path / "tune.csv"
    config = AutotuneConfig(warmup_samples=1, steps_per_sample=2, samples=3,
                            log_path=str(log_path))
    tuner = Autotuner(config, START)
    with caplog.at_level(logging.INFO, logger="hvd_spark.collectives.autotune"):
        switches = feed_steps(tuner, 400, lambda p: 0.1 if p.chunk_bytes == 4 << 20 else 0.2)
    assert tuner.done and tuner.search.best.chunk_bytes == 4 << 20
    assert switches[-1] == tuner.search.best == tuner.current
    assert tuner.observe(["a"], 1, 1e6) is None  # frozen: nothing more
    assert any("autotune chose" in r.getMessage() and "chunk_bytes=4096 KiB" in r.getMessage()
               for r in caplog.records)
    rows = list(csv.DictReader(log_path.open()))
    assert rows[0]["phase"] == "start" and rows[-1]["phase"] == "chosen"
    assert int(rows[-1]["chunk_bytes"]) == 4 << 20
    # 3 samples of 2 steps of 3000 bytes at 0.2 s a step: 15 kB/s for the start.
    assert float(rows[0]["score_bytes_per_s"]) == pytest.approx(15000, rel=1e-6)


def test_sampling_is_bounded_and_keeps_defaults_when_nothing_helps(caplog):
    config = AutotuneConfig(warmup_samples=2, steps_per_sample=3, samples=2, max_candidates=6)
    tuner = Autotuner(config, START)
    with caplog.at_level(logging.INFO, logger="hvd_spark.collectives.autotune"):
        feed_steps(tuner, 1000, lambda p: 0.1)
    assert tuner.done and tuner.current == START
    # warm-up + per candidate (one settling sample + its samples), at most 6 candidates
    assert tuner.samples <= 2 + 6 * 3
    assert any("kept the configured parameters" in r.getMessage() for r in caplog.records)


def test_names_that_never_repeat_still_end_samples():
    config = AutotuneConfig(warmup_samples=0, steps_per_sample=1, samples=1, max_candidates=2)
    tuner = Autotuner(config, START)
    for i in range(5000):
        tuner.observe([f"unique.{i}"], 10, i * 1e-3)
    assert tuner.done


def test_engine_config_reads_autotune_and_horovod_names(monkeypatch):
    monkeypatch.delenv("HVD_SPARK_AUTOTUNE", raising=False)
    assert EngineConfig.from_env().autotune is None
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    monkeypatch.setenv("HOROVOD_AUTOTUNE_LOG", "/x/tune.csv")
    monkeypatch.setenv("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "1")
    monkeypatch.setenv("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "4")
    monkeypatch.setenv("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "7")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(8 << 20))
    config = EngineConfig.from_env()
    tune = config.autotune
    assert tune is not None and tune.log_path == "/x/tune.csv"
    assert (tune.warmup_samples, tune.steps_per_sample, tune.max_candidates) == (1, 4, 7)
    assert tune.fixed == {"fusion_threshold"}
    assert config.slot_bytes == cfg.AUTOTUNE_MAX_CHUNK_BYTES  # the chunk may grow to it
    monkeypatch.setenv("HVD_SPARK_CHUNK_BYTES", str(1 << 20))
    assert EngineConfig.from_env().slot_bytes == 1 << 20  # fixed by the user: not tuned


@pytest.mark.parametrize("field,value", [("steps_per_sample", 0), ("samples", 0),
                                         ("warmup_samples", -1), ("max_candidates", 0),
                                         ("margin", 1.5)])
def test_bad_autotune_settings_are_refused(field, value):
    with pytest.raises(ConfigError):
        AutotuneConfig(**{field: value})


def test_chunk_change_rides_on_the_next_response_and_survives_the_wire():
    coord = Coordinator(2, 64 << 20)
    for rank in (0, 1):
        coord.add(rank, m.Request("t", m.ALLREDUCE, "float32", (10,)), 0.0)
    coord.next_chunk_bytes = 256 << 10
    (response,) = coord.take_responses()
    assert response.chunk_bytes == 256 << 10 and coord.taken_bytes == 40
    assert pickle.loads(pickle.dumps(response)) == response
    for rank in (0, 1):
        coord.add(rank, m.Request("u", m.ALLREDUCE, "float32", (10,)), 0.0)
    assert coord.take_responses()[0].chunk_bytes is None  # once only


def test_a_gain_smaller_than_the_samples_spread_is_not_taken():
    search = CoordinateSearch(START, GRIDS, margin=0.05)
    while (p := search.candidate()) is not None:
        # 4 MiB looks 20% better, but its samples spread +-30%.
        better = p.chunk_bytes == 4 << 20
        search.report(120.0 if better else 100.0, noise=0.3 if better else 0.02)
    assert search.best == START
