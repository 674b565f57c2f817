"""The docs stay honest: config keys against the parser, links, the README's length, no internal issue numbers.

Pure Python and fast: ``ds_megatron.config`` is torch-free, and nothing here starts a process group.

* ``docs/configuration.md`` documents every key the ``"megatron"`` parser accepts exactly once, and names no key it
  does not accept.  The accepted set is derived from the parser's own pieces (``field_names`` of the dataclasses
  it reads the flat keys into, ``_PATH_KEYS``, the nested sections of ``_NESTED`` less ``INHERITED_MODEL_KEYS``)
  and cross-checked against the keys the parser reads the section by.  Every documented default is the
  dataclass default, and the documented defaults, fed to the parser, give the same config as an empty section.
* Its DeepSpeed tables cover exactly the top-level DeepSpeed keys our path has a rule for.
* The README's main-keys table names only documented keys, with the same defaults.
* Every relative link in README.md and docs/*.md resolves: the file or directory exists, and an ``#anchor``
  is a heading of the target (GitHub's slugs).  Source paths the pages name (as code, not links) exist, or
  belong to the package's new layout until that layout is in the tree.
"""
import collections
import dataclasses
import glob
import json
import os
import re

import pytest

from ds_megatron.config import ConfigError, DistributedDataParallelConfig, MegatronConfig, ParallelConfig
from ds_megatron.config import megatron as megatron_section
from ds_megatron.config.deepspeed_keys import HONOURED, REFUSED, UNUSED
from ds_megatron.config.parsing import SECTION, field_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
CONFIG_DOC = os.path.join(ROOT, "docs", "configuration.md")
DOC_FILES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
MARKDOWN = [README, *DOC_FILES]
README_MAX_LINES = 250
README_KEYS_HEADING = "Main config keys"
DEEPSPEED_HEADING = "DeepSpeed's own keys"

# The flat keys at the top of the section are read into these dataclasses (MegatronConfig.from_section).
FLAT_CLASSES = (ParallelConfig, DistributedDataParallelConfig)
PATH_KEYS = megatron_section._PATH_KEYS
NESTED = megatron_section._NESTED
INHERITED_MODEL_KEYS = megatron_section.INHERITED_MODEL_KEYS

KEY_CELL = re.compile(r"`([A-Za-z_][A-Za-z0-9_.]*)`")
JSON_CELL = re.compile(r"`([^`]*)`")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _rel(path):
    return os.path.relpath(path, ROOT)


def _outside_code(text):
    """The lines of ``text`` outside fenced code blocks, with their 1-based numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _cells(line):
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def table_rows(text):
    """``(h2 heading, cells)`` of every table row outside code blocks (header and separator rows included)."""
    h2 = None
    for _, line in _outside_code(text):
        heading = re.match(r"^(#{1,6})\s+(.*?)\s*$", line)
        if heading:
            if len(heading.group(1)) <= 2:
                h2 = heading.group(2)
            continue
        if line.startswith("|") and line.rstrip().endswith("|"):
            cells = _cells(line)
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                yield h2, cells


def keyed_rows(text, under=None, prefix=None):
    """``{key: [cells, ...]}`` of the rows whose first cell is one key in backticks."""
    rows = collections.defaultdict(list)
    for h2, cells in table_rows(text):
        match = KEY_CELL.fullmatch(cells[0])
        if not match or (under is not None and h2 != under):
            continue
        key = match.group(1)
        if prefix is None or key.startswith(prefix):
            rows[key].append(cells)
    return rows


def accepted_keys():
    """``{"megatron.<key>" or "megatron.<section>.<key>": the dataclass that holds it, or None}``."""
    keys = {}
    for cls in FLAT_CLASSES:
        keys.update({f"{SECTION}.{name}": cls for name in field_names(cls)})
    keys.update({f"{SECTION}.{name}": None for name in PATH_KEYS})
    for section, cls in NESTED.items():
        skip = INHERITED_MODEL_KEYS if section == "model" else ()
        keys.update({f"{SECTION}.{section}.{name}": cls for name in field_names(cls) if name not in skip})
    return keys


def _dataclass_default(cls, name):
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


def _documented_default(key, cells):
    match = JSON_CELL.match(cells[1]) if len(cells) > 1 else None
    assert match, (f"{key}: the default cell must start with the JSON value in backticks (`null` when derived), "
                   f"got {cells[1:2]}")
    try:
        return json.loads(match.group(1))
    except json.JSONDecodeError:
        pytest.fail(f"{key}: default {match.group(0)} is not a JSON value")


def _same_value(documented, real):
    if isinstance(documented, bool) or isinstance(real, bool):
        return documented is real
    return documented == real


# The "megatron" section


def test_the_key_set_is_the_parsers():
    """The derivation above names exactly the keys the parser reads the top of the section by, and what it refuses is
    left out."""
    listed = megatron_section.section_keys()
    flat = {key.split(".", 1)[1] for key in accepted_keys() if key.count(".") == 1}
    assert set(listed) == flat | set(NESTED)
    for key in listed:  # the parser reads each of them (a value of the wrong type names the key, not "unknown key")
        with pytest.raises(ConfigError) as err:
            MegatronConfig.from_section({key: object()}, {})
        assert "unknown key" not in str(err.value) and key in str(err.value), err.value
    for name in INHERITED_MODEL_KEYS:  # set at the top of the section, refused under "model"
        with pytest.raises(ConfigError, match="move it there"):
            MegatronConfig.from_section({"model": {name: _dataclass_default(ParallelConfig, name)}}, {})


def test_every_config_key_is_documented_once():
    documented = keyed_rows(_read(CONFIG_DOC), prefix=f"{SECTION}.")
    accepted = accepted_keys()
    missing = sorted(set(accepted) - set(documented))
    unknown = sorted(set(documented) - set(accepted))
    repeated = sorted(key for key, rows in documented.items() if len(rows) > 1)
    assert not missing, f"keys the parser accepts but docs/configuration.md does not document: {missing}"
    assert not unknown, f"keys docs/configuration.md documents but the parser does not accept: {unknown}"
    assert not repeated, f"keys docs/configuration.md documents more than once: {repeated}"


def test_documented_defaults_are_the_real_ones():
    documented = keyed_rows(_read(CONFIG_DOC), prefix=f"{SECTION}.")
    section = {}
    for key, cls in accepted_keys().items():
        if key not in documented:
            continue  # reported by test_every_config_key_is_documented_once
        value = _documented_default(key, documented[key][0])
        name = key.rsplit(".", 1)[1]
        if cls is not None:
            real = _dataclass_default(cls, name)
            assert _same_value(value, real), f"{key}: docs/configuration.md says {value!r}, the default is {real!r}"
        parts = key.split(".")[1:]
        target = section if len(parts) == 1 else section.setdefault(parts[0], {})
        target[parts[-1]] = value
    # Every documented default written out is the same config as leaving every key out.
    try:
        written = MegatronConfig.from_section(section, {})
    except ConfigError as e:
        pytest.fail(f"the parser refuses the defaults docs/configuration.md documents: {e}")
    empty = MegatronConfig.from_section({"model": {}}, {})
    for part in ("parallel", "ddp", "precision", "cuda_graph", "model", "train", "data"):
        assert getattr(written, part) == getattr(empty, part), f"{SECTION}.{part}: the documented defaults differ"


def test_deepspeed_keys_are_documented():
    rows = keyed_rows(_read(CONFIG_DOC), under=DEEPSPEED_HEADING)
    assert not [k for k in rows if k.startswith(f"{SECTION}.")], "megatron keys belong in their own tables"
    repeated = sorted(key for key, cells in rows.items() if len(cells) > 1)
    assert not repeated, f"DeepSpeed keys documented more than once: {repeated}"
    top_level = {key.split(".")[0] for key in rows}
    known = set(HONOURED) | set(REFUSED) | set(UNUSED)
    assert not known - top_level, f"DeepSpeed keys with a rule on our path but no row: {sorted(known - top_level)}"
    assert not top_level - known, f"rows for DeepSpeed keys our path has no rule for: {sorted(top_level - known)}"


def test_readme_main_keys_are_documented():
    rows = keyed_rows(_read(README), under=README_KEYS_HEADING)
    assert len(rows) >= 5, f"README.md has no '## {README_KEYS_HEADING}' table of keys"
    doc = _read(CONFIG_DOC)
    documented = keyed_rows(doc, prefix=f"{SECTION}.")
    deepspeed = keyed_rows(doc, under=DEEPSPEED_HEADING)
    accepted = accepted_keys()
    for key, cells in rows.items():
        if key.startswith(f"{SECTION}."):
            assert key in accepted, f"README.md names {key}, which the parser does not accept"
            assert key in documented, f"README.md names {key}, which docs/configuration.md does not document"
            assert _documented_default(key, cells[0]) == _documented_default(key, documented[key][0]), \
                f"{key}: README.md and docs/configuration.md give different defaults"
        else:
            assert key in deepspeed, f"README.md names {key}, which docs/configuration.md's DeepSpeed tables lack"


# Every page


def test_readme_is_short():
    lines = _read(README).count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES} (move the rest to docs/)"


def test_every_page_says_what_it_covers():
    for path in MARKDOWN:
        lines = _read(path).splitlines()
        assert lines and lines[0].startswith("# "), f"{_rel(path)} must start with a '# ' title"
        assert len(lines) > 2 and not lines[1].strip() and lines[2].strip(), \
            f"{_rel(path)}: the title is followed by one line saying what the page covers"


def slug(heading):
    """GitHub's anchor of a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path):
    seen = collections.Counter()
    out = set()
    for _, line in _outside_code(_read(path)):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            out.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path):
    """``(line number, target)`` of every markdown link outside code (a link's text may span lines)."""
    lines = dict(_outside_code(_read(path)))
    text = "\n".join(re.sub(r"`[^`]*`", "", lines.get(n, "")) for n in range(1, max(lines, default=0) + 1))
    for match in LINK.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match.group(1)


def test_relative_links_resolve():
    broken = []
    for path in MARKDOWN:
        for number, target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            where = f"{_rel(path)}:{number}: {target}"
            if not os.path.exists(dest):
                broken.append(f"{where} (no such file)")
            elif anchor:
                if not dest.endswith(".md"):
                    broken.append(f"{where} (an anchor into a file that is not markdown)")
                elif anchor not in anchors(dest):
                    broken.append(f"{where} (no heading with this anchor in {_rel(dest)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


# The package's new layout, which the docs already use.  Until it is in this tree (ds_megatron/checkpointing/
# exists) these paths may be missing; from then on every path the docs name must exist.
NEW_LAYOUT = {
    "ds_megatron/config/job.py", "ds_megatron/config/hf_config.py",
    "ds_megatron/planning/", "ds_megatron/planning/param_counts.py", "ds_megatron/planning/memory.py",
    "ds_megatron/planning/comm_volume.py", "ds_megatron/planning/report.py",
    "ds_megatron/integration/seams.py", "ds_megatron/integration/local_job.py",
    "ds_megatron/checkpointing/", "ds_megatron/checkpointing/api.py", "ds_megatron/checkpointing/run_dir.py",
    "ds_megatron/checkpointing/deepspeed_format.py", "ds_megatron/checkpointing/torch_dist.py",
    "ds_megatron/checkpointing/global_shards.py", "ds_megatron/checkpointing/export_fp32.py",
    "ds_megatron/checkpointing/rng.py",
    "ds_megatron/training/build.py", "ds_megatron/training/steps.py",
}
SOURCE_PATH = re.compile(r"(?<![\w/.-])((?:ds_megatron|tests|launch|ds_configs)/[\w./-]*[\w/])")


def test_named_source_paths_exist():
    landed = os.path.isdir(os.path.join(ROOT, "ds_megatron", "checkpointing"))
    missing = []
    for path in MARKDOWN:
        for number, line in enumerate(_read(path).splitlines(), 1):
            for name in SOURCE_PATH.findall(line):
                if not os.path.exists(os.path.join(ROOT, name)) and (landed or name not in NEW_LAYOUT):
                    missing.append(f"{_rel(path)}:{number}: {name}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


ISSUE_NUMBERS = (re.compile(r"\bissues?\s*#?\d+\b", re.I), re.compile(r"\(\d+ of \d+\)"),
                 re.compile(r"(?<![\w&/])#\d+\b"))


def test_no_internal_issue_numbers():
    found = []
    for path in MARKDOWN:
        for number, line in enumerate(_read(path).splitlines(), 1):
            found += [f"{_rel(path)}:{number}: {m.group(0)}" for p in ISSUE_NUMBERS for m in p.finditer(line)]
    assert not found, "internal issue numbers (say what the requirement is instead):\n" + "\n".join(found)


@pytest.mark.parametrize("heading,expected", [
    ("Interleaved (virtual) pipeline: refused", "interleaved-virtual-pipeline-refused"),
    ("`megatron.cuda_graph`", "megatroncuda_graph"),
    ("DeepSpeed's own keys", "deepspeeds-own-keys"),
    ("TP, SP and CP", "tp-sp-and-cp"),
])
def test_slug_follows_github(heading, expected):
    assert slug(heading) == expected
