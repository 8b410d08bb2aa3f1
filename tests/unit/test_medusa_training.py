"""Medusa head training smoke tests on a tiny target saved to disk: the CLI trains, checkpoints,
refuses to overwrite a run, resumes to the same result as an uninterrupted run, and the heads
it writes drive `--method medusa` through the engine with output equal to plain decoding."""

import gzip
import json
import random

import pytest
import torch

from specdec.cli import main
from specdec.decode import plain_generate
from specdec.engine import Engine, EngineConfig
from specdec.medusa_heads import load_heads, read_config
from specdec.training.medusa import Example, head_labels, load_examples
from specdec.types import StopConditions


@pytest.fixture(scope="module")
def tiny_dir(tiny_target, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_target")
    tiny_target.model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data_file(tiny_target, tmp_path_factory):
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 96) for _ in range(5)] for _ in range(24)]
    answers = plain_generate(tiny_target, prompts, stop=StopConditions(max_new_tokens=24))
    path = tmp_path_factory.mktemp("data") / "part-00000.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for p, r in zip(prompts, answers):
            f.write(json.dumps({"category": "synthetic", "prompt_ids": p, "answer_ids": list(r.token_ids)}) + "\n")
    return path


def _train(tiny_dir, data_file, out, *extra):
    return main(["train", "medusa", "--target", str(tiny_dir), "--out", str(out), "--data", str(data_file),
                 "--vocab", "0", "--batch", "128", "--checkpoint-every", "0", *extra])


def test_head_labels_shift_by_head_on_greedy_text():
    # tokens[j] is the token after hidden row j; on greedy text head i at row j gets tokens[j + 1 + i].
    tokens = torch.tensor([10, 11, 12, 13])
    labels = head_labels(tokens, tokens.clone(), 2)
    assert labels.tolist() == [[11, 12], [12, 13], [13, -1], [-1, -1]]


def test_head_labels_stop_where_the_text_leaves_greedy_decoding():
    tokens = torch.tensor([10, 11, 12, 13, 14])
    greedy = torch.tensor([10, 99, 12, 13, 20])  # the text departs from the argmax at rows 1 and 4
    labels = head_labels(tokens, greedy, 2)
    # row 0: committed 10 (matches), head 0 -> greedy[1] = 99 (the target's own next choice);
    # head 1 needs rows 0 and 1 to match: row 1 does not.
    assert labels.tolist() == [[99, -1], [-1, -1], [13, 20], [20, -1], [-1, -1]]


def test_self_distilled_rows_load_from_a_directory(data_file):
    examples = load_examples([data_file.parent])
    assert len(examples) == 24 and all(isinstance(e, Example) and e.answer_ids for e in examples)


def test_cli_trains_heads_that_the_engine_uses_losslessly(tiny_target, tiny_dir, data_file, tmp_path):
    out = tmp_path / "heads"
    assert _train(tiny_dir, data_file, out, "--max-steps", "30") == 0
    cfg = read_config(out)
    assert cfg.num_heads == 4 and len(cfg.accuracy) == 4
    assert cfg.notes["steps"] == 30
    assert (out / "checkpoint.pt").is_file()
    engine = Engine(EngineConfig(target=str(tiny_dir), medusa_heads=str(out)))
    prompt = [3, 14, 15, 92, 65]
    stop = StopConditions(max_new_tokens=20)
    got = engine.generate_ids([prompt], method="medusa", stop=stop)[0].token_ids
    want = engine.generate_ids([prompt], method="plain", stop=stop)[0].token_ids
    assert got == want


def test_cli_refuses_to_overwrite_a_run_without_resume(tiny_dir, data_file, tmp_path, capsys):
    out = tmp_path / "heads"
    assert _train(tiny_dir, data_file, out, "--max-steps", "2") == 0
    assert _train(tiny_dir, data_file, out, "--max-steps", "4") == 2
    assert "--resume" in capsys.readouterr().err


def test_resumed_run_equals_an_uninterrupted_one(tiny_target, tiny_dir, data_file, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert _train(tiny_dir, data_file, whole, "--max-steps", "12") == 0
    # "Interrupted" after 5 steps; all 12 steps are in the warm-up, whose learning rate does not
    # depend on the budget, so the two runs see the same batches at the same rates.
    assert _train(tiny_dir, data_file, split, "--max-steps", "5") == 0
    assert _train(tiny_dir, data_file, split, "--max-steps", "12", "--resume") == 0
    assert read_config(split).notes["steps"] == 12
    a, b = load_heads(whole, tiny_target), load_heads(split, tiny_target)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x.float(), y.float(), atol=2e-3), name  # float16 on disk; the same batches


def test_missing_data_is_a_clear_error(tiny_dir, tmp_path, capsys):
    code = main(["train", "medusa", "--target", str(tiny_dir), "--out", str(tmp_path / "h"),
                 "--data", str(tmp_path / "nothing-here"), "--max-steps", "1"])
    assert code == 2 and "no self-distilled data" in capsys.readouterr().err
