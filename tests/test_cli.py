"""The ``ds-megatron`` console script: ``groups`` output and subcommand dispatch."""
import json
import subprocess
import sys
import types

import pytest

from ds_megatron import cli
from ds_megatron.parallel.layout import ALL_GROUPS, ParallelLayout

SEED_ARGS = ["groups", "--world-size", "16", "--tp", "4", "--pp", "2", "--ep", "4", "--etp", "1"]


def run(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_table_lists_every_kind_with_the_seed_groups(capsys):
    code, out, err = run(capsys, SEED_ARGS)
    assert code == 0 and err == ""
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in ALL_GROUPS}
    assert set(rows) == set(ALL_GROUPS)
    assert "[0, 1, 2, 3]  [4, 5, 6, 7]  [8, 9, 10, 11]  [12, 13, 14, 15]" in rows["tp"]
    assert "[0, 4]  [1, 5]  [2, 6]  [3, 7]  [8, 12]  [9, 13]  [10, 14]  [11, 15]" in rows["dp"]
    assert "[0, 8]  [1, 9]  [2, 10]  [3, 11]  [4, 12]  [5, 13]  [6, 14]  [7, 15]" in rows["pp"]
    assert "[0, 1, 2, 3]  [4, 5, 6, 7]  [8, 9, 10, 11]  [12, 13, 14, 15]" in rows["ep"]
    assert "[0, 4]  [1, 5]  [2, 6]  [3, 7]  [8, 12]  [9, 13]  [10, 14]  [11, 15]" in rows["edp"]
    assert "dp=2" in out and "edp=2" in out
    # Aligned: the group lists of all rows start in the same column.
    starts = {line.index("[") for line in rows.values()}
    assert len(starts) == 1


@pytest.mark.parametrize("extra", [[], ["--cp", "2", "--ep", "1"], ["--order", "tp-cp-ep-pp-dp", "--ep", "1"]])
def test_json_equals_layout(capsys, extra):
    argv = ["groups", "--world-size", "16", "--tp", "2", "--pp", "2", "--ep", "2", *extra, "--json"]
    # argparse keeps the last --ep, like the layout below
    ep = int([a for i, a in enumerate(argv) if i and argv[i - 1] == "--ep"][-1])
    cp = 2 if "--cp" in extra else 1
    order = extra[extra.index("--order") + 1] if "--order" in extra else "tp-cp-ep-dp-pp"
    code, out, _ = run(capsys, argv)
    assert code == 0
    doc = json.loads(out)
    layout = ParallelLayout(world_size=16, tp=2, pp=2, ep=ep, cp=cp, order=order)
    assert doc["groups"] == layout.group_ranks()
    assert list(doc["groups"]) == list(ALL_GROUPS)
    assert doc["layout"] == {"world_size": 16, "tp": 2, "cp": cp, "dp": layout.dp, "pp": 2,
                             "etp": 2, "ep": ep, "edp": layout.edp, "order": order}


def test_rank_view(capsys):
    code, out, _ = run(capsys, SEED_ARGS + ["--rank", "5"])
    assert code == 0
    assert "coordinates: tp=1 cp=0 dp=1 pp=0 etp=0 ep=1 edp=1" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in ALL_GROUPS}
    assert rows["tp"].endswith("[4, 5, 6, 7]")
    assert rows["dp"].endswith("[1, 5]")
    assert rows["pp"].endswith("[5, 13]")
    assert rows["ep"].endswith("[4, 5, 6, 7]")
    assert rows["edp"].endswith("[1, 5]")


def test_rank_json_holds_one_group_per_kind(capsys):
    layout = ParallelLayout(world_size=16, tp=4, pp=2, ep=4, etp=1)
    code, out, _ = run(capsys, SEED_ARGS + ["--rank", "13", "--json"])
    doc = json.loads(out)
    assert doc["rank"] == 13 and doc["coordinates"] == layout.coordinates(13)
    # Learned positions live on the first pipeline stage only; rank 13 is on the last.
    assert doc["rank_groups"].pop("position-embedding") is None
    for kind, group in doc["rank_groups"].items():
        assert group in layout.group_ranks()[kind] and 13 in group
    assert doc["groups"] == layout.group_ranks()


def test_rank_outside_any_embedding_group(capsys):
    # With 4 stages, the middle stages hold no embedding.
    code, out, _ = run(capsys, ["groups", "--world-size", "4", "--pp", "4", "--rank", "1"])
    assert code == 0
    assert "(not a member)" in out


@pytest.mark.parametrize("argv,needle", [
    (["groups", "--world-size", "16", "--tp", "3"], "tp*cp*pp"),
    (["groups", "--world-size", "8", "--pp", "3"], "pp"),
    (["groups", "--world-size", "8", "--order", "tp-xx"], "xx"),
    (["groups", "--world-size", "8", "--rank", "8"], "--rank 8"),
    (["groups", "--world-size", "8", "--tp", "0"], "tp"),
])
def test_bad_sizes_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds-megatron groups: error: ") and needle in lines[0]


def test_bad_sizes_subprocess_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ds_megatron.cli", "groups", "--world-size", "16", "--tp", "3"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("ds-megatron groups: error: world size 16")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("tp,code", [(2, 0), (3, 2)])
def test_groups_does_not_import_torch(tp, code):
    # Fast because torch and DeepSpeed are never imported (checked by module, not by a clock).
    script = (f"import sys; from ds_megatron import cli; rc = cli.main(['groups', '--world-size', '4', '--tp', '{tp}']); "
              "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == code, proc.stderr


def test_delegated_subcommand_gets_its_argv(monkeypatch):
    seen = {}
    fake = types.ModuleType("ds_megatron.planning.report")

    def fake_main(argv):
        seen["argv"] = argv
        return 3
    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "ds_megatron.planning.report", fake)
    # The deepspeed launcher puts --local_rank before the subcommand.
    assert cli.main(["--local_rank=1", "plan", "--world-size", "8", "--help"]) == 3
    assert seen["argv"] == ["--world-size", "8", "--help"]


def test_import_error_inside_a_subcommand_module_is_not_masked(monkeypatch, tmp_path):
    (tmp_path / "dsm_cli_broken_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.DELEGATED, "plan", ("dsm_cli_broken_mod", "x"))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        cli.main(["plan"])


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for name in ("groups", "train", "preprocess", "plan"):
        assert name in out
