"""flt train --arch rebuilds the absolute encoding an flt search chose."""

from __future__ import annotations

import json

import pytest

from flt.cli import main

pytestmark = pytest.mark.cli


def test_cli_train_arch_rebuilds_the_searched_encoding(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["search", "graph", "--candidates", "flt,softmax", "--posenc-candidates", "none,fourier", "--preset", "smoke",
                 "--steps", "2", "--tune-steps", "1", "--batch-size", "64", "--out-dir", str(out), "--threads", "1",
                 "--no-plots"]) == 0
    result = json.loads((out / "search.json").read_text())
    from flt.train import load_checkpoint_model

    classes = {"none": "NoEncoding", "fourier": "LearnableFourierFeatures"}
    for selection in ("perturbation", "magnitude"):
        run_dir = tmp_path / f"t-{selection}"
        assert main(["train", "graph", "--arch", str(out), "--arch-select", selection, "--preset", "smoke", "--steps", "2",
                     "--run-opt", "draw_gap=false", "--out-dir", str(run_dir), "--threads", "1", "--no-progress",
                     "--no-plots"]) == 0
        model, meta = load_checkpoint_model(str(run_dir))
        chosen = result["posenc"][selection]
        assert meta["model"]["posenc"] == chosen and type(model.encoder.posenc).__name__ == classes[chosen]
        names = {c["label"]: c["attention"] for c in result["candidates"]}
        assert [e["attention"] for e in meta["model"]["layer_attention"]] == [names[c] for c in result[selection]]
    capsys.readouterr()
    other = "none" if result["posenc"]["perturbation"] == "fourier" else "fourier"
    if other != "none":  # --posenc none is the flag's default: it cannot ask for anything
        assert main(["train", "graph", "--arch", str(out), "--posenc", other, "--out-dir", str(tmp_path / "x")]) == 2
        assert "leave out --posenc" in capsys.readouterr().err
    assert main(["train", "graph", "--arch", str(out), "--posenc-opt", "scale=2.0", "--out-dir", str(tmp_path / "y")]) == 2
    assert "leave out --posenc" in capsys.readouterr().err
