"""Long-context training prompts: gettext catalogs read correctly, only sentence-like messages
kept, document prompts deterministic and built from the articles the target wrote."""

import struct

import pytest

from specdec.errors import SpecdecError
from specdec.training.documents import article_specs, document_prompts, foreign_sentences, mo_messages
from specdec.training.selfdistill import drop_repeated_paragraphs, prompt_set, write_part, written_articles


def write_mo(path, pairs, order="<"):
    """A GNU .mo catalog (header, original table, translation table, strings)."""
    n = len(pairs)
    orig_off, trans_off = 28, 28 + 8 * n
    blob, origs, trans = b"", [], []
    start = 28 + 16 * n
    for table, idx in ((origs, 0), (trans, 1)):
        for pair in pairs:
            data = pair[idx].encode()
            table.append((len(data), start + len(blob)))
            blob += data + b"\x00"
    head = struct.pack(order + "7I", 0x950412DE, 0, n, orig_off, trans_off, 0, 0)
    tables = b"".join(struct.pack(order + "2I", *e) for e in origs + trans)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + tables + blob)


@pytest.mark.parametrize("order", ["<", ">"])
def test_mo_messages_reads_translations_and_plural_forms(tmp_path, order):
    write_mo(tmp_path / "a.mo", [("File not found", "Datei nicht gefunden"),
                                 ("one file\x00%d files", "eine Datei\x00%d Dateien")], order)
    assert mo_messages(tmp_path / "a.mo") == ["Datei nicht gefunden", "eine Datei", "%d Dateien"]


def test_mo_messages_ignores_files_that_are_not_catalogs(tmp_path):
    (tmp_path / "x.mo").write_bytes(b"not a catalog at all, just text")
    assert mo_messages(tmp_path / "x.mo") == []


def test_foreign_sentences_keeps_sentences_only(tmp_path):
    sentence = "Die Datei konnte nicht geöffnet werden, weil sie gesperrt ist."
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "tool.mo", [
        ("a", sentence), ("b", "Datei"), ("c", "%s: Datei nicht gefunden, bitte erneut versuchen."),
        ("d", "Verwendung: tool [OPTION]... DATEI\n  --hilfe   diese Hilfe anzeigen."),
    ])
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "other.mo", [("a", sentence)])
    assert foreign_sentences("de", tmp_path) == [sentence]
    assert foreign_sentences("fr", tmp_path) == []


ARTICLES = [("Storm hits town. Many homes were flooded on Monday.", "How much damage did the storm cause?"),
            ("The zoo has a new baby otter, keepers said.", "Which animal was born at the zoo?")]
SENTENCES = {"de": ["Die Aktualisierung ist fehlgeschlagen, bitte erneut versuchen."]}


def test_document_prompts_are_deterministic_and_built_from_the_articles():
    prompts = document_prompts(3, ARTICLES, 16, SENTENCES)
    assert prompts == document_prompts(3, ARTICLES, 16, SENTENCES)
    assert [p.category for p in prompts[:4]] == ["summarization", "rag", "translation", "qa"]
    for p in prompts:
        if p.category == "summarization":
            assert any(text in p.text for text, _ in ARTICLES)
        elif p.category == "rag":
            assert any(p.text.startswith(text) and p.text.endswith(q) for text, q in ARTICLES)
        elif p.category == "translation":
            assert p.text == "Translate German to English: " + SENTENCES["de"][0]


def test_document_prompts_skip_categories_without_material():
    assert {p.category for p in document_prompts(0, [], 8, {})} == {"qa"}


class WordTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


def test_written_articles_pair_each_text_with_its_question(tmp_path):
    write_part(tmp_path, 0, [{"index": 2, "category": "article", "sampled": False, "prompt_ids": [1],
                              "answer_ids": [5, 6]},
                             {"index": 0, "category": "article", "sampled": False, "prompt_ids": [1],
                              "answer_ids": [7]}])
    specs = article_specs(0, 3)
    assert written_articles(tmp_path, WordTokenizer(), seed=0) == [("w7", specs[0][1]), ("w5 w6", specs[2][1])]


def test_documents_set_without_articles_is_a_clear_error(tmp_path):
    with pytest.raises(SpecdecError, match="--set articles"):
        prompt_set("documents", None, seed=0, count=4, articles_dir=tmp_path)


def test_looping_articles_keep_each_paragraph_once():
    looping = "Storm hits.\n\nIt rained.\n\nStorm hits.\n\n\n\nIt rained.\n\nRoads closed."
    assert drop_repeated_paragraphs(looping) == "Storm hits.\n\nIt rained.\n\nRoads closed."


def test_the_real_prompt_set_mixes_every_source_and_is_fixed_by_its_seed(tmp_path):
    from specdec.training.selfdistill import REAL_PROMPTS, real_prompts

    first = real_prompts(REAL_PROMPTS, seed=0, count=60)
    assert len(first) == 60 and first == real_prompts(REAL_PROMPTS, seed=0, count=60)
    assert {p.category for p in first} == {"math", "chat", "qa"}  # the shuffle mixes GSM8K, roleplay, toolformer
    assert first != real_prompts(REAL_PROMPTS, seed=1, count=60)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "chat", "prompt": "hi"}\n{"text": "no prompt"}\n')
    with pytest.raises(SpecdecError, match=r"bad.jsonl:2"):
        real_prompts(bad, seed=0, count=2)
