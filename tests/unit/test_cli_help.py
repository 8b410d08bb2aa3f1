"""`specdec ... --help`: every option says what it does and what it defaults to."""

import argparse

from specdec.cli import HelpFormatter, build_parser


def _parsers(parser: argparse.ArgumentParser, name: str = "specdec"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _value_options(parser: argparse.ArgumentParser):
    """Options that take a value (flags are off unless given; -h has nothing to default)."""
    return [a for a in parser._actions if a.option_strings and a.nargs != 0 and a.default is not argparse.SUPPRESS]


def test_every_option_of_every_command_shows_its_default_in_help():
    missing = []
    for name, parser in _parsers(build_parser()):
        formatter = HelpFormatter(name)
        for action in _value_options(parser):
            shown = formatter._expand_help(action) if action.help else ""
            if not action.help or "default" not in shown.lower():
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, f"options without help or default: {missing}"


def test_generate_help_names_the_defaults_users_ask_for():
    [gen] = [p for n, p in _parsers(build_parser()) if n == "specdec generate"]
    text = " ".join(gen.format_help().split("options:", 1)[1].split())
    for option, default in (("--max-new-tokens", "128"), ("--top-p", "1.0"), ("--top-k", "0"), ("--seed", "none")):
        after = text[text.index(f"{option} "):]
        assert f"(default: {default})" in after[:400], option
