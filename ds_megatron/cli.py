"""The ``ds-megatron`` console script.

``groups`` prints the rank groups of a job (pure Python, no torch, answers at
once).  ``train``, ``preprocess``, ``plan`` and ``export-fp32`` hand their arguments, untouched,
to the ``main(argv)`` of the module that owns them; those modules are imported
only when their subcommand runs, so ``groups`` never pays for importing torch
or DeepSpeed, and each subcommand's options live next to the code they drive.

    ds-megatron groups --world-size 16 --tp 4 --pp 2 --ep 4 --etp 1
    ds-megatron groups --world-size 16 --tp 4 --pp 2 --rank 5 --json
    ds-megatron train --config ds_configs/gpt_cpu_tp2_dp2.json
    ds-megatron convert hf/Llama-tiny ckpt/llama_tp2 --tp 2
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Dict, List, Optional, Sequence

from ds_megatron.parallel.layout import DENSE_GROUPS, EXPERT_GROUPS, ParallelLayout
from ds_megatron.parallel.rank_generator import DEFAULT_ORDER

PROG = "ds-megatron"

# Subcommands whose module parses its own arguments: name -> (module, help).
DELEGATED: Dict[str, tuple] = {
    "train": ("ds_megatron.training.job", "train a model from a DeepSpeed JSON config with a \"megatron\" section"),
    "preprocess": ("ds_megatron.data.preprocess", "turn text/JSONL into Megatron-style .bin/.idx datasets"),
    "plan": ("ds_megatron.planning.report", "plan a layout: memory and communication per rank for given sizes"),
    "convert": ("ds_megatron.convert.checkpoint", "Hugging Face <-> ds_megatron checkpoints at any TP/PP/EP layout"),
    "export-fp32": ("ds_megatron.checkpointing.export_fp32", "consolidate a training checkpoint (any TP / PP / EP / DP) "
                                                       "into one fp32 state dict with GPTModel's names"),
}

COORDINATES = ("tp", "cp", "dp", "pp", "etp", "ep", "edp")


def layout_dict(layout: ParallelLayout) -> Dict[str, object]:
    """The sizes of a layout, derived ones (dp, edp) included, and its full order."""
    return {
        "world_size": layout.world_size,
        "tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp,
        "etp": layout.etp, "ep": layout.ep, "edp": layout.edp,
        # The generator appends the size-1 dimensions the user left out.
        "order": layout.dense_generator().order,
    }


def _fmt_group(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def _table(rows: List[List[str]], right: Sequence[int] = ()) -> List[str]:
    """Align columns; columns whose index is in ``right`` are right-aligned (numbers)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def format_groups(layout: ParallelLayout) -> str:
    """One row per group kind: its group size, how many groups, and all the groups."""
    d = layout_dict(layout)
    groups = layout.group_ranks()
    out = [f"world size {d['world_size']}, order {d['order']}",
           f"dense:  tp={d['tp']} cp={d['cp']} dp={d['dp']} pp={d['pp']}",
           f"expert: etp={d['etp']} ep={d['ep']} edp={d['edp']} pp={d['pp']}",
           ""]
    rows = [["kind", "size", "groups", "ranks"]]
    for section, kinds in (("dense", DENSE_GROUPS), ("expert", EXPERT_GROUPS)):
        for kind in kinds:
            gs = groups[kind]
            rows.append([kind, str(len(gs[0])), str(len(gs)), "  ".join(_fmt_group(g) for g in gs)])
    out.extend(_table(rows, right=(1, 2)))
    return "\n".join(out)


def rank_view(layout: ParallelLayout, rank: int) -> Dict[str, object]:
    """``rank``'s coordinates and, for every kind, the one group holding it (``None`` if it is in none)."""
    coords = layout.coordinates(rank)
    mine = {kind: next((g for g in gs if rank in g), None) for kind, gs in layout.group_ranks().items()}
    return {"rank": rank, "coordinates": coords, "rank_groups": mine}


def format_rank(layout: ParallelLayout, rank: int) -> str:
    view = rank_view(layout, rank)
    coords = " ".join(f"{k}={v}" for k, v in view["coordinates"].items())
    out = [f"rank {rank} of {layout.world_size}, order {layout_dict(layout)['order']}",
           f"coordinates: {coords}", ""]
    rows = [["kind", "size", "group"]]
    for kind, g in view["rank_groups"].items():
        # Embedding groups hold only the first/last pipeline stages.
        rows.append([kind, str(len(g)) if g else "-", _fmt_group(g) if g else "(not a member)"])
    out.extend(_table(rows, right=(1,)))
    return "\n".join(out)


def _cmd_groups(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        layout = ParallelLayout(world_size=args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                                etp=args.etp, order=args.order)
        if args.rank is not None and not 0 <= args.rank < layout.world_size:
            raise ValueError(f"--rank {args.rank} is not a rank of this job; give 0..{layout.world_size - 1}")
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"layout": layout_dict(layout), "groups": layout.group_ranks()}
        if args.rank is not None:
            doc.update(rank_view(layout, args.rank))
        print(json.dumps(doc))
    elif args.rank is not None:
        print(format_rank(layout, args.rank))
    else:
        print(format_groups(layout))
    return 0


def _run_delegated(name: str, argv: List[str]) -> int:
    # Imported here, not at the top: ``groups`` never pays for a subcommand's imports.
    module = importlib.import_module(DELEGATED[name][0])
    code = module.main(argv)
    return 0 if code is None else int(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Megatron-LM's parallel machinery inside DeepSpeed.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("groups", help="print the rank groups of a job (dense and expert)",
                       description="Print every rank group of a job: dense tp/cp/dp/pp and their "
                                   "combinations, expert etp/ep/edp (MoE folding shares the ranks).")
    g.add_argument("--world-size", type=int, required=True, help="number of ranks")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size (dense layers)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE layers)")
    g.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    g.add_argument("--order", default=DEFAULT_ORDER, help=f"rank order, fastest first (default {DEFAULT_ORDER})")
    g.add_argument("--json", action="store_true", help="print JSON: {layout, groups[, rank, coordinates, rank_groups]}")
    g.add_argument("--rank", type=int, default=None, help="show this rank's coordinates and its group of each kind")
    g.set_defaults(handler=_cmd_groups, parser=g)

    for name, (module, help_text) in DELEGATED.items():
        # Listed for --help only; main() hands these off before argparse sees their options.
        sub.add_parser(name, help=f"{help_text} (options: {PROG} {name} --help)", add_help=False)
    return parser


def _strip_local_rank(argv: List[str]) -> List[str]:
    """Drop the ``--local_rank`` the deepspeed launcher puts before the subcommand (LOCAL_RANK is in the env too)."""
    i = 0
    while i < len(argv) and argv[i].replace("-", "_").startswith("__local_rank"):
        i += 1 if "=" in argv[i] else 2
    return argv[i:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = _strip_local_rank(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] in DELEGATED:
        return _run_delegated(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
