"""``far_field="constant"`` from the command line: the flat string parses, passes the check
and builds constant layers in the qm9 task's model (the layer itself:
tests/library/test_far_constant.py)."""

import torch

from flt import FLTAttention
from flt.cli import build_parser
from flt.commands.train import preset_from_args
from flt.options import check_attention_options, parse_attention
from flt.tasks.qm9 import QM9Task


def test_the_cli_string_parses_and_builds_constant_layers():
    name, options = parse_attention("flt:near_neighbors=16:far_field=constant")
    assert (name, options) == ("flt", {"near_neighbors": 16, "far_field": "constant"})
    check_attention_options(name, options)
    args = build_parser().parse_args(["train", "qm9", "--preset", "small", "--attention",
                                      "flt:near_neighbors=16:far_field=constant"])
    model = QM9Task.build_model(preset_from_args(args, *parse_attention(args.attention)).model)
    layers = [m for m in model.modules() if isinstance(m, FLTAttention)]
    assert layers and all(m.far_field == "constant" and m.near_neighbors == 16 and m.coupling == "multiplicative"
                          for m in layers)
    assert all(torch.equal(m.far_constant.detach(), torch.zeros(m.heads)) for m in layers)
