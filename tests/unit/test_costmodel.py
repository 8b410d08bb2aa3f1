"""The speculative-decoding arithmetic and the verify-cost measurement."""

import json
import math
import time

import pytest
import torch

from specdec import costmodel
from specdec.costmodel import (best_k, expected_tokens, measure_verify_cost, predicted_speedup, verify_cost_at)
from tests.conftest import GPU_LIKE_COST, LLAMACPP_CPU_COST, quiet


def test_expected_tokens_is_one_when_nothing_is_accepted():
    assert expected_tokens(0.0, 8) == 1.0


def test_expected_tokens_is_k_plus_one_when_everything_is_accepted():
    assert expected_tokens(1.0, 5) == 6.0


def test_expected_tokens_matches_the_geometric_sum():
    alpha, k = 0.7, 4
    assert math.isclose(expected_tokens(alpha, k), sum(alpha ** i for i in range(k + 1)))


def test_expected_tokens_rejects_alpha_outside_unit_interval():
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.5, 3)


def test_predicted_speedup_with_free_drafts_and_flat_verify_is_expected_tokens():
    assert math.isclose(predicted_speedup(0.8, 4, 0.0, lambda m: 1.0), expected_tokens(0.8, 4))


def test_predicted_speedup_divides_by_draft_and_verify_cost():
    v = {1: 1.0, 5: 2.0}
    assert math.isclose(predicted_speedup(0.5, 4, 0.25, v), expected_tokens(0.5, 4) / (4 * 0.25 + 2.0))


def test_verify_cost_interpolates_between_measured_points():
    assert math.isclose(verify_cost_at({1: 1.0, 3: 2.0}, 2), 1.5)


def test_verify_cost_extrapolates_past_the_last_point():
    assert math.isclose(verify_cost_at({1: 1.0, 2: 1.5}, 4), 2.5)


def test_best_k_prefers_long_blocks_when_verification_is_flat_and_drafts_are_free():
    assert best_k(0.9, 0.0, lambda m: 1.0, ks=range(1, 9)) == 8


def test_best_k_shrinks_when_verification_cost_grows_with_k():
    assert best_k(0.5, 0.0, lambda m: float(m), ks=range(1, 9)) == 1


def test_measure_verify_cost_returns_one_at_k1_and_a_positive_ratio_per_k(tiny_target):
    curve = measure_verify_cost(tiny_target, ks=[1, 2, 8], context_len=16, repeats=2, warmup=1)
    assert sorted(curve) == [1, 2, 8]
    assert curve[1] == 1.0
    assert all(v > 0 for v in curve.values())


def test_measure_verify_cost_leaves_no_slots_behind(tiny_target):
    # The measurement rolls back every timed forward; a leak would show as a growing context.
    cache = tiny_target.new_cache(1)
    tiny_target.prefill(cache, [[3, 4, 5]])
    costmodel._timed_forward(tiny_target, cache, torch.tensor([[6, 7, 8, 9]]))
    assert cache.num_slots == 3 and int(cache.lengths[0]) == 3


def test_measure_verify_cost_rejects_a_context_longer_than_the_model(tiny_target):
    with pytest.raises(ValueError, match="positions"):
        measure_verify_cost(tiny_target, ks=[1, 64], context_len=tiny_target.max_positions)


def test_parse_ks_expands_ranges_and_lists():
    from specdec.bench.cli import parse_ks

    assert parse_ks("1-3,8,2") == [1, 2, 3, 8]


def test_parse_ks_rejects_garbage_with_a_clear_error():
    from specdec.bench.cli import parse_ks
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="--ks"):
        parse_ks("1-x")


def test_measure_verify_cost_in_cpu_time_gives_the_same_keys(tiny_target):
    curve = measure_verify_cost(tiny_target, ks=[1, 4], context_len=8, repeats=2, warmup=1, cpu_time=True)
    assert curve[1] == 1.0 and curve[4] > 0


# --- CostStore: measured once per machine, model, backend and thread count ---------------------

def _store(tmp_path, **kw):
    measured: list[str] = []
    kw.setdefault("others_busy", quiet)  # (these tests are about keys and files)
    return costmodel.CostStore(tmp_path / "costs", notify=measured.append, **kw), measured


def test_a_timing_taken_while_other_processes_load_the_machine_is_used_but_not_kept(tmp_path, tiny_target):
    busy, lines = _store(tmp_path, others_busy=lambda measure: (measure(), 1.0))
    curve = busy.verify_cost(tiny_target)
    assert busy.verify_cost(tiny_target) == curve  # this process keeps using it
    assert not list((tmp_path / "costs").glob("verify_cost-*.json"))  # the next one measures again
    assert any("1.0 CPUs busy" in line and "not kept" in line for line in lines)
    quiet, _ = _store(tmp_path)
    quiet.verify_cost(tiny_target)
    assert len(list((tmp_path / "costs").glob("verify_cost-*.json"))) == 1
    verdict, _ = _store(tmp_path / "v", others_busy=lambda measure: (measure(), 2.0))
    verdict.figure({"figure": "probe", "x": 1}, "a verdict", lambda: {"ok": True}, timed=False)
    assert len(list((tmp_path / "v" / "costs").glob("probe-*.json"))) == 1  # a verdict is kept whatever the load


def test_the_load_of_other_processes_is_read_from_the_machine():
    import subprocess
    import sys

    quiet = costmodel.measure_with_others_busy(lambda: time.sleep(0.3))[1]
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)  # (the child is running)
        value, busy = costmodel.measure_with_others_busy(lambda: time.sleep(1.0) or 42)
    finally:
        burner.kill()
        burner.wait()
    assert value == 42
    assert busy > quiet + 0.5, f"a process spinning a CPU was seen as {busy:.2f} CPUs (quiet: {quiet:.2f})"
    own = costmodel.measure_with_others_busy(lambda: sum(i * i for i in range(3_000_000)))[1]
    assert own < 0.5 + quiet  # this process's own work is not the others' load


def test_cost_store_reads_a_later_process_figure_from_disk_without_measuring(tmp_path, tiny_target):
    first, measured_first = _store(tmp_path)
    curve = first.verify_cost(tiny_target)
    assert len(measured_first) == 1 and len(list((tmp_path / "costs").glob("verify_cost-*.json"))) == 1
    later, measured_later = _store(tmp_path)  # a new process: nothing in memory
    assert later.verify_cost(tiny_target) == curve
    assert measured_later == []


def test_cost_store_keeps_the_draft_cost_apart_from_the_verify_cost(tmp_path, tiny_target, tiny_draft):
    store, measured = _store(tmp_path)
    c = store.draft_cost(tiny_draft, tiny_target)
    store.verify_cost(tiny_target)
    again, measured_again = _store(tmp_path)
    assert again.draft_cost(tiny_draft, tiny_target) == c and c > 0
    assert len(measured) == 2 and measured_again == []


def test_cost_store_does_not_reuse_a_figure_from_another_cpu_or_library_version(tmp_path, tiny_target):
    store, _ = _store(tmp_path)
    store.verify_cost(tiny_target)
    [path] = (tmp_path / "costs").glob("verify_cost-*.json")
    for field, value in (("cpu", "Some Other CPU"), ("torch", "0.0.1")):
        stored = json.loads(path.read_text())
        stored["key"]["machine"][field] = value
        stored["value"] = {"1": 1.0, "2": 99.0}
        path.write_text(json.dumps(stored))
        fresh, measured = _store(tmp_path)
        assert fresh.verify_cost(tiny_target)[2] != 99.0
        assert len(measured) == 1


def test_cost_store_measures_each_model_and_thread_count_on_its_own(tmp_path, tiny_target, tiny_draft):
    store, measured = _store(tmp_path)
    store.verify_cost(tiny_target)
    store.verify_cost(tiny_draft)  # other weights
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        store.verify_cost(tiny_target)
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 3
    assert len(list((tmp_path / "costs").glob("verify_cost-*.json"))) == 3


def test_cost_store_refresh_measures_again_and_replaces_the_figure(tmp_path, tiny_target):
    store, _ = _store(tmp_path)
    store.verify_cost(tiny_target)
    refreshed, measured = _store(tmp_path, refresh=True)
    refreshed.verify_cost(tiny_target)
    assert len(measured) == 1
    assert len(list((tmp_path / "costs").glob("verify_cost-*.json"))) == 1


def test_cost_store_survives_a_corrupt_file(tmp_path, tiny_target):
    store, _ = _store(tmp_path)
    store.verify_cost(tiny_target)
    [path] = (tmp_path / "costs").glob("verify_cost-*.json")
    path.write_text("{not json")
    fresh, measured = _store(tmp_path)
    assert fresh.verify_cost(tiny_target)[1] == 1.0 and len(measured) == 1


# --- auto from measured acceptance ------------------------------------------------------------

def test_choose_method_takes_the_best_predicted_speedup_and_plain_below_the_margin():
    candidates = {"prompt-lookup": (0.3, 0.0), "draft": (0.8, 0.05)}
    assert costmodel.choose_method(GPU_LIKE_COST, candidates) == "draft"
    assert costmodel.choose_method(GPU_LIKE_COST, {"prompt-lookup": (0.3, 0.0), "draft": (0.2, 0.3)}) == "prompt-lookup"
    assert costmodel.choose_method(LLAMACPP_CPU_COST, candidates) == "plain"  # nothing pays where k tokens cost ~k steps
    assert costmodel.choose_method(GPU_LIKE_COST, {"draft": (0.05, 0.5)}) == "plain"
    # prompt lookup at a measured acceptance of 0.05 is not worth it even where verifying is free
    assert costmodel.target_local_method(GPU_LIKE_COST) == "prompt-lookup"
    assert costmodel.target_local_method(GPU_LIKE_COST, alpha=0.05) == "plain"


def test_acceptance_is_counted_per_method_kept_for_later_processes_and_follows_recent_runs(tmp_path, tiny_target):
    store, _ = _store(tmp_path)
    assert store.acceptance(tiny_target, "draft") is None
    store.add_acceptance(tiny_target, "draft", drafted=100, accepted=80)
    store.add_acceptance(tiny_target, "draft", drafted=100, accepted=40)
    store.add_acceptance(tiny_target, "draft", drafted=0, accepted=0)  # nothing drafted: nothing learnt
    assert store.acceptance(tiny_target, "draft") == pytest.approx(0.6)
    assert store.acceptance(tiny_target, "draft", proposer="other/draft") is None
    assert store.acceptance(tiny_target, "prompt-lookup") is None
    later, _ = _store(tmp_path)
    assert later.acceptance(tiny_target, "draft") == pytest.approx(0.6)
    # beyond the window the old counts fade: a long run at 0.1 brings the figure near 0.1
    later.add_acceptance(tiny_target, "draft", drafted=20 * costmodel.ACCEPTANCE_WINDOW,
                         accepted=2 * costmodel.ACCEPTANCE_WINDOW)
    assert later.acceptance(tiny_target, "draft") == pytest.approx(0.1, abs=0.03)


def test_auto_turns_to_the_draft_once_it_has_run_well_here_and_away_from_a_lookup_that_did_not(tmp_path,
                                                                                                 tiny_target):
    from specdec.engine import Engine
    from specdec.models import LoadedModel
    from specdec.testing import perturbed_copy
    from specdec.types import StopConditions
    from tests.conftest import FixedCosts

    class Costs(FixedCosts):
        def draft_cost(self, draft, target) -> float:
            return 0.05

    costs = Costs(GPU_LIKE_COST)
    engine = Engine.from_models(LoadedModel(tiny_target, None, "tiny"),
                                draft=LoadedModel(perturbed_copy(tiny_target, noise=0.02, seed=1), None, "draft"),
                                costs=costs)
    assert engine.resolve_method("auto") == "prompt-lookup"  # nothing measured yet: a half assumed
    stop = StopConditions(max_new_tokens=24, eos_token_ids=(10_000,))
    prompts = [[5, 17, 33, 2, 40], [9, 9, 60, 12]]
    engine.generate_ids(prompts, "draft", stop=stop, k=4)  # a draft that is nearly the target
    assert costs.acceptance(tiny_target, "draft") > 0.8
    assert engine.resolve_method("auto") == "draft"
    costs.add_acceptance(tiny_target, "prompt-lookup", drafted=1000, accepted=10)
    costs.add_acceptance(tiny_target, "draft", drafted=costmodel.ACCEPTANCE_WINDOW * 4, accepted=0)
    assert engine.resolve_method("auto") == "plain"  # both measured poor


def test_speculation_can_pay_only_where_a_perfect_free_draft_would_clear_the_margin():
    assert costmodel.speculation_can_pay(GPU_LIKE_COST)
    assert not costmodel.speculation_can_pay(LLAMACPP_CPU_COST)
    assert costmodel.speculation_can_pay({1: 1.0, 2: 1.05, 3: 1.6, 5: 2.4, 9: 3.5})  # float32 torch on a CPU


def test_acceptance_upper_bound_is_above_the_rate_and_tightens_with_evidence():
    from specdec.costmodel import acceptance_upper_bound

    assert acceptance_upper_bound(0, 0) == 1.0
    assert acceptance_upper_bound(0, 2) < 0.6  # two rejections: a draft needing 0.6 is ruled out
    for accepted, judged in ((1, 10), (50, 100), (90, 100), (10, 10)):
        assert accepted / judged <= acceptance_upper_bound(accepted, judged) <= 1.0
    bounds = [acceptance_upper_bound(n // 5, n) for n in (5, 20, 100, 1000)]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] < 0.23


def test_acceptance_can_pay_follows_the_verify_cost():
    from specdec.costmodel import acceptance_can_pay

    host = {1: 1.0, 2: 1.44, 3: 1.9, 5: 3.19, 9: 6.0}  # llama.cpp at 2 threads on the hosts measured
    assert acceptance_can_pay(host, 0.9) and not acceptance_can_pay(host, 0.2)
    assert acceptance_can_pay({1: 1.0, 64: 1.05}, 0.2)  # a GPU: a draft right a fifth of the time could pay
