"""The benchmark end to end on a tiny model and 2 prompts, so it cannot rot."""

import json
from dataclasses import replace

import pytest

from specdec.bench.methods import BASELINE, BenchConfig, BenchPrompt, run_bench, select_rows, summarize, RunRecord
from specdec.errors import InvalidRequest
from specdec.models import LoadedModel
from specdec.testing import perturbed_copy, tiny_llama

PROMPTS = [BenchPrompt("a", "code", (3, 4, 5, 6, 3, 4, 5)), BenchPrompt("b", "chat", (9, 8, 7, 9, 8))]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    target = tiny_llama(seed=0, vocab_size=96, num_layers=2, hidden_size=48)
    draft = perturbed_copy(target, noise=0.25, seed=1)
    config = BenchConfig(max_new_tokens=12, k=3, out=out, backends=("hf", "fast"), warmup_tokens=2)
    result = run_bench(config, target=LoadedModel(target, None, "tiny"), draft=LoadedModel(draft, None, "tiny-draft"),
                       prompts=PROMPTS)
    return out, result


def test_bench_writes_the_table_the_plot_and_the_raw_results(tiny_run):
    out, _ = tiny_run
    assert (out / "results.md").read_text().startswith("# specdec benchmark")
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "results.json").read_text())["records"]


def test_bench_runs_the_peers_and_every_engine_method_on_every_backend(tiny_run):
    from specdec.proposers import method_names

    _, result = tiny_run
    ran = {r["method"] for r in result["records"]}
    assert {"hf-generate", "hf-assisted", "hf-prompt-lookup"} <= ran
    for method in method_names():
        for backend in ("hf", "fast"):
            label = f"{method}@{backend}"
            assert label in ran or label in result["missing"], label


def test_bench_lossless_methods_reproduce_the_baseline_on_the_tiny_model(tiny_run):
    _, result = tiny_run
    overall = {r["method"]: r for r in result["rows"] if r["category"] == "all"}
    for name in ("hf-generate", "plain@hf", "plain@fast", "draft@hf", "draft@fast", "prompt-lookup@fast"):
        assert overall[name]["equal_hf"] == len(PROMPTS), name


def test_bench_reports_tau_and_alpha_for_speculative_methods(tiny_run):
    _, result = tiny_run
    overall = {r["method"]: r for r in result["rows"] if r["category"] == "all"}
    assert overall["draft@hf"]["tau"] > 1.0 and 0.0 < overall["draft@hf"]["alpha"] <= 1.0
    assert overall["plain@hf"]["tau"] == 1.0 and overall["plain@hf"]["alpha"] is None
    assert overall[BASELINE]["speedup_vs_hf"] == 1.0


def test_select_rows_is_a_fixed_sample_per_category():
    rows = [{"id": f"{c}{i}", "category": c} for c in "xy" for i in range(10)]
    a = select_rows(rows, 3, (), seed=0)
    assert a == select_rows(rows, 3, (), seed=0)
    assert sorted(r["category"] for r in a) == ["x"] * 3 + ["y"] * 3
    assert len(select_rows(rows, 0, ("y",), seed=0)) == 10


def test_select_rows_rejects_an_unknown_category():
    with pytest.raises(InvalidRequest, match="categories"):
        select_rows([{"id": "1", "category": "x"}], 1, ("nope",), seed=0)


def test_summarize_flags_an_output_that_differs_from_the_baseline():
    recs = [RunRecord(BASELINE, "p", "c", (1, 2), 1.0, 2), RunRecord("m", "p", "c", (1, 3), 0.5, 1, 1, 0)]
    rows = {r.method: r for r in summarize(recs, [BASELINE, "m"]) if r.category == "all"}
    assert rows["m"].equal_hf == 0 and rows[BASELINE].equal_hf == 1
    assert rows["m"].speedup_vs_hf == pytest.approx(2.0)


@pytest.mark.real_model
def test_gpu_script_runs_its_cpu_subset_and_writes_table_and_plot(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(root / "bench" / "gpu.sh"), str(tmp_path), "--methods", "hf-generate,plain"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "results.md").read_text()
    assert "| hf-generate |" in table and "| plain |" in table
    assert (tmp_path / "speedup.png").stat().st_size > 0


def test_a_method_that_raises_is_dropped_and_reported_not_fatal():
    from specdec.bench.methods import run_interleaved

    def ok(prompt):
        return RunRecord("", prompt.id, prompt.category, (1,), 0.1, 1)

    def broken(prompt):
        raise RuntimeError("boom")

    records, failed = run_interleaved({BASELINE: ok, "broken": broken}, PROMPTS)
    assert {r.method for r in records} == {BASELINE} and len(records) == len(PROMPTS)
    assert "boom" in failed["broken"]


def test_bench_runs_a_specdec_draft_directory_on_both_backends(tmp_path):
    import torch

    from specdec.bench.methods import _on_backend, load_draft_for_bench
    from specdec.backends.subset_head import SubsetHeadLM
    from specdec.drafts import build_from_target, save_draft
    from specdec.backends.fast import FastLlamaLM

    target = LoadedModel(tiny_llama(seed=0, vocab_size=96, num_layers=2, hidden_size=48), None, "tiny")
    save_draft(tmp_path / "d", build_from_target(target.lm, [0]), torch.arange(0, 96, 2), {"target": "tiny"},
               dtype=torch.float32)
    hf = load_draft_for_bench(str(tmp_path / "d"), target, "cpu")
    fast = _on_backend(hf, "fast")
    back = _on_backend(fast, "hf")
    assert isinstance(hf.lm, SubsetHeadLM) and isinstance(fast.lm, FastLlamaLM) and isinstance(back.lm, SubsetHeadLM)
    ids = torch.tensor([[5, 17, 33, 2]])
    logits = [m.lm.forward(m.lm.new_cache(1), ids).logits for m in (hf, fast, back)]
    finite = torch.isfinite(logits[0])
    assert int(finite[0, 0].sum()) == 48
    for other in logits[1:]:
        assert torch.equal(finite, torch.isfinite(other))
        torch.testing.assert_close(logits[0][finite], other[finite], rtol=1e-4, atol=1e-4)


def test_bench_reports_drafting_cost_and_the_speedup_predicted_at_v1(tiny_run):
    _, result = tiny_run
    overall = {r["method"]: r for r in result["rows"] if r["category"] == "all"}
    assert overall["plain@hf"]["draft_cost"] == 0.0 and overall["plain@hf"]["predicted_v1"] == 1.0
    draft = overall["draft@hf"]
    assert draft["draft_cost"] > 0.0  # a draft model's forwards take time
    assert draft["predicted_v1"] == pytest.approx(draft["tau"] / (1.0 + draft["draft_cost"]))
    assert overall["hf-assisted"]["predicted_v1"] is None  # the peer's drafting time is not measured
    assert all(r["draft_seconds"] is not None for r in result["records"] if r["method"] == "draft@hf")


def test_bench_table_has_the_drafting_cost_and_v1_columns(tiny_run):
    out, _ = tiny_run
    assert "| c | x plain at v=1 |" in (out / "results.md").read_text()


def test_predicted_speedup_at_v1_from_tau_and_drafting_cost():
    from specdec.bench.methods import draft_cost, predicted_speedup_v1

    plain = [RunRecord("plain", "p", "c", (1,) * 10, 1.0, 10)]  # 0.1 s a forward
    spec = [RunRecord("m", "p", "c", (1,) * 10, 0.6, 4, 8, 6, draft_seconds=0.08)]  # 0.02 s drafting a forward
    cost = draft_cost(spec, plain)
    assert cost == pytest.approx(0.2)
    assert predicted_speedup_v1(10 / 4, cost) == pytest.approx(2.5 / 1.2)
    assert draft_cost(plain, plain) == 0.0
    assert draft_cost([RunRecord("m", "p", "c", (1,), 0.1, 1, 1, 1)], plain) is None  # no drafting time
    assert predicted_speedup_v1(None, 0.1) is None


def test_bench_with_a_flat_verify_cost_chooses_as_on_a_gpu_and_says_so(tmp_path):
    """--verify-cost flat: every engine's methods see a flat v(k) (so trees and long chains are
    chosen as on a GPU), nothing measured under that assumption is kept for later runs, and the
    report says the choices were not this machine's; an unknown setting is refused."""
    from specdec.bench.methods import build_context
    from specdec.costmodel import FLAT_VERIFY_COST, AssumedVerifyCost

    target = LoadedModel(tiny_llama(seed=0, vocab_size=96, num_layers=2, hidden_size=48), None, "tiny")
    config = BenchConfig(max_new_tokens=8, k=3, out=tmp_path, backends=("hf", "fast"), warmup_tokens=0,
                         methods=("hf-generate", "plain", "prompt-lookup"), verify_cost="flat")
    ctx = build_context(config, target, None)
    for engine in ctx.engines.values():
        assert isinstance(engine.costs, AssumedVerifyCost) and engine.costs.directory is None
        assert engine.costs.verify_cost(engine.target.lm) == FLAT_VERIFY_COST
    measured = build_context(replace(config, verify_cost="measured"), target, None)
    assert not any(isinstance(e.costs, AssumedVerifyCost) for e in measured.engines.values())
    result = run_bench(config, target=target, prompts=PROMPTS)
    assert result["meta"]["verify_cost"] == "flat"
    assert "Verify cost assumed flat" in (tmp_path / "results.md").read_text()
    overall = {r["method"]: r for r in result["rows"] if r["category"] == "all"}
    assert overall["prompt-lookup@fast"]["equal_hf"] == len(PROMPTS)
    with pytest.raises(InvalidRequest, match="verify_cost"):
        BenchConfig(verify_cost="gpu")
