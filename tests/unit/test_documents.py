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


def test_training_kind_prompts_are_real_ones_the_data_has_no_answer_to_and_template_ones(tmp_path):
    import json

    from specdec.training.selfdistill import real_prompts, training_kind_prompts

    real = tmp_path / "real.jsonl"
    real.write_text("".join(json.dumps({"category": c, "prompt": f"{c} question {i}"}) + "\n"
                            for i in range(40) for c in ("math", "chat")))
    order = real_prompts(real, seed=0, count=80)
    data = tmp_path / "data_real"
    data.mkdir()
    write_part(data, 0, [{"index": i, "category": p.category, "prompt_ids": [1], "answer_ids": [2]}
                         for i, p in enumerate(order[:50])])  # `--set real --count 50` answered these
    picked = training_kind_prompts(3, real_dir=data, prompts_file=real)
    answered = {p.text for p in order[:50]}
    reals = [p for p in picked if p.category.startswith("real-")]
    assert [p.text for p in reals if p.category == "real-math"] == \
        [p.text for p in order[50:] if p.category == "math"][:3]
    assert len(reals) == 6 and not answered & {p.text for p in reals}
    templates = {p.category for p in picked if p.category.startswith("template-")}
    assert templates == {f"template-{c}" for c in ("chat", "code", "math", "summarization", "translation", "qa", "rag")}
    assert all(sum(p.category == c for p in picked) == 3 for c in templates)
    # with no data yet every real prompt is unanswered: the first of the seeded order come first
    fresh = training_kind_prompts(3, real_dir=tmp_path / "none", prompts_file=real)
    assert [p.text for p in fresh if p.category == "real-chat"] == [p.text for p in order if p.category == "chat"][:3]


MAN_PAGE = r""".\" Copyright line that is a comment, not text
.TH TOOL 1 2024-01-01
.SH NAME
tool \- does a thing
.SH SYNOPSIS
\fBtool\fR [\fB\-v\fR] \fIFILE\fR...
.SH DESCRIPTION
\fBtool\fP reads each \fIFILE\fP and writes what it found to the standard output, one line for
every record it could parse. It stops at the first record it cannot read.
.PP
The output is sorted by the record's key \(em unless
.B \-\-keep\-order
is given, which keeps the order of the input. M\(:usli is eaten \(lqhere\(rq.
.nf
tool \-v a.txt b.txt | sort | uniq \-c | head
.fi
.TP
.B \-v
verbose
"""


def write_page(path, text):
    import gzip

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode()))


def test_roff_paragraphs_keep_the_prose_and_drop_macros_comments_and_examples():
    from specdec.training.documents import is_prose, roff_paragraphs

    paras = roff_paragraphs(MAN_PAGE)
    assert "tool reads each FILE and writes what it found to the standard output, one line for every record " \
           "it could parse. It stops at the first record it cannot read." in paras
    assert 'The output is sorted by the record\'s key - unless --keep-order is given, which keeps the order of ' \
           'the input. Müsli is eaten "here".' in paras
    assert not any("Copyright" in p or "sort | uniq" in p or "\\f" in p for p in paras)
    prose = [p for p in paras if is_prose(p, 8)]
    assert len(prose) == 2 and all(p.endswith(".") for p in prose)  # the synopsis and "verbose" are not prose


def test_man_passages_and_sentences_read_gzipped_pages_one_family_at_most_three_times(tmp_path):
    from specdec.training.documents import man_passages, sentences

    write_page(tmp_path / "man1" / "tool.1.gz", MAN_PAGE)
    for i in range(5):  # one tool's generated subcommand pages
        write_page(tmp_path / "man1" / f"cloud_sub{i}.1.gz", MAN_PAGE.replace("tool", f"cloud_sub{i}"))
    write_page(tmp_path / "man8" / "broken.8.gz", "not gzip")  # written gzipped: reads, no prose in it
    (tmp_path / "man1" / "bad.1.gz").write_bytes(b"\x1f\x8b not really gzip")
    passages = man_passages(tmp_path, min_words=10)
    assert [name for name, _ in passages] == ["cloud_sub0", "cloud_sub1", "cloud_sub2", "tool"]
    name, text = passages[-1]
    assert text.startswith("tool reads each FILE") and text.endswith('Müsli is eaten "here".')
    found = sentences(passages[-1:])
    assert found[0] == ("tool reads each FILE and writes what it found to the standard output, one line for every "
                        "record it could parse.")
    assert "It stops at the first record it cannot read." in found and len(found) == len(set(found))


def test_passage_prompts_are_the_evaluations_forms_over_the_passages_and_fixed_by_the_seed(tmp_path):
    from specdec.training.documents import passage_prompts

    passages = [("tool", "Tool reads files and writes records. It sorts them by key."),
                ("other", "Other removes files that are older than a week.")]
    german = {"de": ["Die Datei wurde nicht gefunden, bitte prüfen Sie den Pfad."]}
    prompts = passage_prompts(1, passages, 9, german)
    assert prompts == passage_prompts(1, passages, 9, german) != passage_prompts(2, passages, 9, german)
    assert [p.category for p in prompts] == ["summarization", "rag", "translation"] * 3
    assert all("Summarize" in p.text and any(t in p.text for _, t in passages) for p in prompts[::3])
    for p in prompts[1::3]:
        name, text = next((n, t) for n, t in passages if t in p.text)
        assert p.text.startswith(text) and p.text.rstrip("?").endswith(name) or name in p.text.split("\n")[-1]
    assert all(p.text == "Translate German to English: " + german["de"][0] for p in prompts[2::3])
    assert [p.category for p in passage_prompts(0, passages, 4, {})] == ["summarization", "rag"] * 2
    assert passage_prompts(0, [], 4, {}) == []


def test_the_passages_set_reads_the_manual_pages_and_says_when_there_are_none(tmp_path):
    write_page(tmp_path / "man1" / "tool.1.gz", MAN_PAGE)
    write_page(tmp_path / "de" / "man1" / "tool.1.gz", ".SH BESCHREIBUNG\nDas Werkzeug liest jede Datei und "
               "schreibt, was es gefunden hat, auf die Standardausgabe.\n")
    prompts = prompt_set("passages", None, seed=0, count=6, man_dir=tmp_path)
    assert {p.category for p in prompts} == {"summarization", "rag", "translation"}
    assert any(p.text == "Translate German to English: Das Werkzeug liest jede Datei und schreibt, was es gefunden "
                         "hat, auf die Standardausgabe." for p in prompts)
    with pytest.raises(SpecdecError, match="manual pages under"):
        prompt_set("passages", None, seed=0, count=6, man_dir=tmp_path / "none")


def test_the_code_set_reworks_the_standard_librarys_own_functions_and_resumes_by_index():
    """`--set code`: HumanEval-like completions from stdlib signatures and docstrings, real stdlib
    source to explain, rewrite, document or test, and tasks to write; deterministic by seed, so a
    generation resumes by prompt index, and never a dev prompt."""
    import json

    from specdec.prompt_sets import DEV_PROMPTS
    from specdec.training.prompts import _stdlib_sources, code_prompts

    prompts = prompt_set("code", None, seed=0, count=40)
    assert prompts == code_prompts(0, 40) and prompts[:8] == code_prompts(0, 8) and prompts != code_prompts(1, 40)
    assert {p.category for p in prompts} == {"code"}
    fenced = [p.text for p in prompts if "```python\n" in p.text]
    assert fenced and all(p.text.startswith("Write a ") and p.text.endswith(".") for p in prompts[3::4])
    source = fenced[0].split("```python\n", 1)[1].rsplit("\n```", 1)[0]
    name = source.split("def ", 1)[1].split("(", 1)[0]
    assert (name, source) in [(n.rsplit(".", 1)[1], s) for n, s in _stdlib_sources()]  # the function's own source
    dev = {json.loads(line)["turns"][0] for line in open(DEV_PROMPTS)}
    assert not dev & {p.text for p in code_prompts(0, 640)}
