import json
import os
import re

import pytest

from deepspeed_fused import docs
from deepspeed_fused.config import parse_config
from deepspeed_fused.docs import config_reference
from deepspeed_fused.features.registry import all_features

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFIG_PAGE = os.path.join(ROOT, "docs", "config.md")

# the README's set-up commands, word for word (the hook and .ci/run read the test command)
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
MAIN_JOB = ('pip install -e ".[test]" && deepspeed examples/train.py --deepspeed_config configs/fused_all.json '
            "--model qwen3-moe-tiny --steps 20")
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest tests -q --forked -n 2'
README_MAX_WORDS = 1600
SETUP_WITHIN_LINES = 40


def _read(*parts) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def test_config_reference_block_is_current():
    assert docs.main(["--check", CONFIG_PAGE]) == 0


def test_docs_tool_writes_only_the_files_it_is_given(tmp_path, capsys):
    assert docs.main([]) == 0  # no file: the table on stdout
    assert capsys.readouterr().out.strip() == docs.reference_table()
    f = tmp_path / "x.md"
    f.write_text(f"head\n{docs.START}\nold\n{docs.END}\ntail\n")
    assert docs.main(["--check", str(f)]) == 1
    assert docs.main(["--write", str(f)]) == 0
    assert f.read_text() == f"head\n{docs.START}\n{docs.reference_table()}\n{docs.END}\ntail\n"
    assert docs.main(["--check", str(f)]) == 0
    g = tmp_path / "y.md"  # a file without the markers is an error, not silently passed
    g.write_text("no block here\n")
    assert docs.main(["--check", str(g)]) == 1


def test_config_page_names_every_key_and_readme_links_it():
    page = _read("docs", "config.md")
    for row in config_reference():
        assert f"`{row['key']}`" in page
    readme = _read("README.md")
    assert "(docs/config.md)" in readme
    if docs.START in readme:  # a README that carries the generated block keeps it current
        assert docs.main(["--check", os.path.join(ROOT, "README.md")]) == 0


def test_readme_has_a_row_for_every_feature():
    readme = _read("README.md")
    for f in all_features():
        assert re.search(rf"^\| `{re.escape(f.name)}` \|", readme, re.M), f.name


def _json_blocks(text: str) -> list:
    return re.findall(r"```json\n(.*?)```", text, re.S)


@pytest.mark.parametrize("page", ["README.md", os.path.join("docs", "user_guide.md")])
def test_config_examples_in_the_docs_are_valid(page):
    """Every ds_config example of the README and the user guide parses, and its section turns on
    every registered feature it names (a typo in a key would raise)."""
    blocks = [b for b in _json_blocks(_read(page)) if "deepspeed_fused" in b]
    assert blocks, page
    for block in blocks:
        text = block.strip()
        cfg = json.loads(text if text.startswith("{") else "{" + text + "}")
        section = parse_config(cfg)
        for f in all_features():
            if f'"{f.name}"' in block:
                assert getattr(section, f.name).enabled, (page, f.name)


def test_readme_gives_the_setup_commands_within_its_first_lines():
    lines = _read("README.md").splitlines()
    head = [ln.strip() for ln in lines[:SETUP_WITHIN_LINES]]
    assert CPU_TORCH in head and MAIN_JOB in head and TEST_COMMAND in head, head
    assert head.index(CPU_TORCH) < head.index(MAIN_JOB) < head.index(TEST_COMMAND)


def test_readme_is_short():
    words = len(_read("README.md").split())
    assert words <= README_MAX_WORDS, f"README.md has {words} words (at most {README_MAX_WORDS}): move detail to docs/"


def test_readme_links_resolve():
    """Every relative link of the README names a file of the repository (the recipes included)."""
    readme = _read("README.md")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert "LICENSE" in local and "docs/integrations.md" in local
    missing = [link for link in local if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing
    # a link to a section of a page names one of its headings (GitHub's anchors)
    for page, anchor in re.findall(r"\]\(([^)#\s]+\.md)#([^)]+)\)", readme):
        headings = re.findall(r"^#+ (.+)$", _read(page), re.M)
        slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
        assert anchor in slugs, (page, anchor, sorted(slugs))


def test_ci_runs_the_readme_test_command():
    assert "python -m pytest tests -q --forked -n 2" in _read(".ci", "run")


def test_readme_architecture_and_makefile_give_the_gpu_test_command():
    command = "-m pytest tests/gpu -q -n 4 --forked"
    for name in ("README.md", os.path.join("docs", "architecture.md"), "Makefile"):
        assert command in _read(name), name


# ---- the project's text speaks to users: no development history ------------------------------
# Built from pieces, so that this file does not match its own pattern.
_S = "ses" + "sion"
HISTORY = re.compile("|".join([
    _S,
    "iss" + "ue [0-9]",
    "iss" + "ues? #?[0-9]",
    "lent" + " machine",
    "GPU" + " machine",
    "the" + " lent",
    "elev" + "enth", "twel" + "fth", "thirt" + "eenth", "fourt" + "eenth", "fift" + "eenth", "sixt" + "eenth",
]), re.I)
# the word in its other meanings: subprocess's keyword, pytest's object of that name in a hook
ALLOWED = re.compile("|".join([
    r"\bstart_new_" + _S + r"\b",
    r"\bdef pytest_\w+\(" + _S + r"\b",
    r"\b" + _S + r"\.(config|items)\b",
]))
SCANNED = ["README.md", "CHANGELOG.md", "docs", "deepspeed_fused", "tests", "examples", "configs"]
TEXT_SUFFIXES = (".md", ".py", ".json", ".cpp", ".txt", ".cfg", ".toml", ".yaml", ".yml")


def _scanned_files():
    for name in SCANNED:
        path = os.path.join(ROOT, name)
        if os.path.isfile(path):
            yield path
        for d, dirs, files in os.walk(path):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in files:
                if f.endswith(TEXT_SUFFIXES):
                    yield os.path.join(d, f)


def test_the_pattern_finds_history_and_spares_the_other_meanings():
    for text in ["the " + "twel" + "fth " + _S + "'s run", "iss" + "ue 27's target", "on the " + "lent" + " machine",
                 "a GPU" + " machine", "Iss" + "ue #14"]:
        assert HISTORY.search(ALLOWED.sub("", text)), text
    for text in ["Popen(cmd, start_new_" + _S + "=True)", "def pytest_collection_finish(" + _S + "):",
                 "for item in " + _S + ".items:", "report an issue with the script", "silent for 2.5 minutes"]:
        assert not HISTORY.search(ALLOWED.sub("", text)), text


def test_no_development_history_in_the_projects_text():
    hits = []
    for path in _scanned_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                m = HISTORY.search(ALLOWED.sub("", line))
                if m:
                    hits.append(f"{os.path.relpath(path, ROOT)}:{i}: {m.group(0)!r}: {line.strip()[:120]}")
    assert not hits, "date results and name the hardware instead:\n" + "\n".join(hits)
