"""The documentation cannot drift from the code: the generated references are what tools/gen_docs.py
writes, the annotated reference config loads as the defaults, and every config key or ``infinity``
flag that README.md or docs/ names exists."""

import importlib.util
import re
from pathlib import Path

import pytest

from infinity.config import Config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_docs():
    return _gen_docs()


def test_generated_references_are_current(gen_docs):
    """docs/config-reference.md, docs/cli-reference.md and configs/reference.yaml are exactly what
    ``python tools/gen_docs.py`` writes from the field docs and the argparse parser."""
    stale = [str(path.relative_to(ROOT)) for path, text in gen_docs.outputs().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"out of date, run python tools/gen_docs.py: {', '.join(stale)}"


def test_the_drift_check_sees_a_changed_field_doc(gen_docs, monkeypatch):
    """A field doc changed without regenerating makes the config reference differ."""
    from infinity import config as cfgmod

    before = gen_docs.config_reference()
    original = gen_docs.config_keys
    monkeypatch.setattr(gen_docs, "config_keys", lambda: [
        (s, k, d, doc + " (changed)" if (s, k) == ("zero", "stage") else doc, size)
        for s, k, d, doc, size in original()])
    assert gen_docs.config_reference() != before
    assert cfgmod.ZeroConfig  # the module itself is untouched


def test_reference_yaml_is_the_defaults():
    """configs/reference.yaml names every key, and loads as the default config."""
    assert Config.from_file(ROOT / "configs" / "reference.yaml") == Config()
    text = (ROOT / "configs" / "reference.yaml").read_text()
    for section, key, *_ in _gen_docs().config_keys():
        assert re.search(rf"^{section}:$(?:\n  .*)*?\n  {key}: ", text, re.M), f"{section}.{key}"


# ---------------------------------------------------------------- names the pages use

def _sections() -> dict[str, set]:
    import dataclasses

    from infinity.config.sections import _SECTIONS
    from infinity.plan.auto import PLAN_KEYS
    keys = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in _SECTIONS.items()}
    keys["plan"] = set(PLAN_KEYS)
    return keys


def _prose(page: Path) -> str:
    """The page without the DeepSpeed key table (its keys are DeepSpeed's, e.g. ``optimizer.type``)."""
    text = page.read_text()
    return re.sub(r"<!-- deepspeed-keys:start -->.*?<!-- deepspeed-keys:end -->", "", text, flags=re.S)


def _spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced code blocks."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return inline + [line for block in blocks for line in block.splitlines()]


def named_keys(text: str, sections) -> set:
    """``section.key`` names in code spans, where ``section`` is a config section (not part of a dotted
    Python path such as ``infinity.train.schedule.build_lr_scheduler``)."""
    pattern = re.compile(rf"(?<![\w./-])({'|'.join(sections)})\.([A-Za-z_][A-Za-z0-9_]*)(?![\w(])")
    return {m.groups() for span in _spans(text) for m in pattern.finditer(span)
            if m.group(2) not in FILE_SUFFIXES}


FILE_SUFFIXES = {"py", "yaml", "json", "md", "c", "cpp", "sh"}   # `zeropp.py` is a file, not a key


def test_every_config_key_the_docs_name_exists():
    sections = _sections()
    bad = {f"{page.name}: {s}.{k}" for page in PAGES for s, k in named_keys(_prose(page), sections)
           if k not in sections[s]}
    assert not bad, sorted(bad)


def _flags_by_command() -> dict[str, set]:
    import argparse

    from infinity.cli import _parser
    parser = _parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {name: {o for a in sub._actions for o in a.option_strings} for name, sub in subs.items()}


def named_flags(text: str, commands) -> set:
    """``(command, flag)`` for each ``--flag`` after ``infinity COMMAND`` in a code span or code line
    (up to a pipe, ``;`` or a comment); ``(None, flag)`` for a span that is a flag alone."""
    out = set()
    for span in _spans(text):
        for m in re.finditer(rf"\binfinity (?:--debug )?({'|'.join(commands)})\b([^|;#]*)", span):
            out |= {(m.group(1), f) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2))}
        alone = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =]\S+)?", span.strip())
        if alone and "infinity " not in span:
            out.add((None, alone.group(1)))
    return out


# flags of other programs the pages name alone: torchrun's, the Trainer's and DeepSpeed's launcher's
FOREIGN_FLAGS = {"--nnodes", "--node_rank", "--nproc_per_node", "--deepspeed", "--bf16", "--fp16"}


def test_every_cli_flag_the_docs_name_exists():
    """A flag after ``infinity COMMAND`` is that command's; a flag named alone is some command's, one
    of a tool's or example script's in this repository (tools/, examples/), or another program's
    (:data:`FOREIGN_FLAGS`)."""
    flags = _flags_by_command()
    every = set().union(*flags.values())
    scripts = "".join(p.read_text() for d in ("tools", "examples") for p in (ROOT / d).rglob("*.py"))
    bad = set()
    for page in PAGES:
        for command, flag in named_flags(_prose(page), flags):
            known = flags[command] if command else every
            if flag not in known and not (command is None and (f'"{flag}"' in scripts or flag in FOREIGN_FLAGS)):
                bad.add(f"{page.name}: {'infinity ' + command if command else ''} {flag}".replace("  ", " "))
    assert not bad, sorted(bad)


def test_the_name_checks_catch_a_wrong_name():
    """The two checks above fail on a key or flag that does not exist."""
    sections = _sections()
    assert ("zero", "stag") in named_keys("set `zero.stag: 3`", sections)
    assert ("train", "--stepz") in named_flags("```bash\ninfinity train --stepz 5\n```", _flags_by_command())
