"""``flt.fit``: coordinate networks on signals and images, their encodings, PSNR, the
even/odd split, the batched fit against separate fits, and ``flt fit`` end to end."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from conftest import assert_close

from flt.cli import main
from flt.fit import ENCODINGS, FitConfig, build_encoding, fit_problem, grid_coords, psnr
from flt.fit.core import Problem, StackedNetwork, build_net, diagnostics, even_mask
from flt.fit.encodings import AxisEncoding, default_dim

GAUSSIAN_PRODUCT = math.sqrt(math.log(10) / math.pi)  # 0.856, docs/math.md section 7


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def smooth_problem(n: int = 64, signals: int = 1) -> Problem:
    """Sums of sines up to 7 cycles over [0, 1): smooth, but far beyond what raw
    coordinates let a small MLP fit in a few hundred steps."""
    x = grid_coords((n,))[:, 0]
    rows = [0.5 + 0.2 * torch.sin(2 * math.pi * 3 * x + s) + 0.15 * torch.sin(2 * math.pi * 7 * x + 1 + s) for s in range(signals)]
    return Problem(grid_coords((n,)), torch.stack(rows).unsqueeze(-1), even_mask((n,)), (n,), tuple(f"s{s}" for s in range(signals)))


# -- encodings ---------------------------------------------------------------------------

#: A table indexed by integer positions (P = 1 only): not an encoding of real coordinates.
TABLES = ("learned",)


@pytest.mark.parametrize("pos_dim,axes", [(1, "joint"), (2, "joint"), (2, "concat"), (2, "product")])
@pytest.mark.parametrize("name", list(ENCODINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_encoding_maps_coordinates_to_features(name, pos_dim, axes, dtype):
    n = 6
    pos = torch.rand(2, n, pos_dim, dtype=dtype)
    dim = default_dim(name, pos_dim, None if name in ("raw", "basic") else 16, axes)
    if name == "raw" and axes == "product":
        with pytest.raises(ValueError, match="single feature"):
            build_encoding(name, dim, pos_dim, {}, axes=axes)
        return
    if name in TABLES:
        with pytest.raises(ValueError, match="integer|pos_dim"):
            build_encoding(name, dim, pos_dim, {}, axes=axes, dtype=dtype)(pos)
        return
    enc = build_encoding(name, dim, pos_dim, {}, axes=axes, dtype=dtype)
    out = enc(pos)
    assert out.shape == (2, n, dim) and out.dtype == dtype and enc.dim == dim
    assert torch.isfinite(out).all()


def test_raw_and_basic_values():
    pos = torch.tensor([[[0.0, 0.25], [0.125, 0.5]]], dtype=torch.float64)
    assert_close(build_encoding("raw", 2, 2, {})(pos), pos)
    angle = 2 * math.pi * pos
    assert_close(build_encoding("basic", 4, 2, {})(pos), torch.cat((angle.sin(), angle.cos()), -1))
    with pytest.raises(ValueError, match="--dim: the basic encoding has 2 features"):
        default_dim("basic", 1, 256)


def test_product_of_gaussian_axes_is_the_2d_gaussian_grid():
    # psi(x) (x) psi(y) on centres (t_i, t_j) equals exp(-|r - t|^2 / (2 w^2)): the full 2-D basis.
    w, k = 0.1, 5
    enc = build_encoding("shifted_basis", k * k, 2, {"kind": "gaussian", "width": w}, axes="product", dtype=torch.float64)
    assert isinstance(enc, AxisEncoding)
    pos = torch.rand(1, 7, 2, dtype=torch.float64)
    t = (torch.arange(k, dtype=torch.float64) + 0.5) / k
    centres = torch.stack(torch.meshgrid(t, t, indexing="ij"), -1).reshape(-1, 2)  # row-major, as the flatten
    expected = torch.exp(-((pos[0, :, None, :] - centres) ** 2).sum(-1) / (2 * w**2))
    assert_close(enc(pos)[0], expected)


def test_concat_equals_the_registry_for_shifted_bases():
    # The registry's shifted bases already embed each axis separately: joint == concat.
    opts = {"kind": "triangle", "width": 0.2}
    pos = torch.rand(1, 9, 2, dtype=torch.float64)
    joint = build_encoding("shifted_basis", 16, 2, opts, dtype=torch.float64)
    concat = build_encoding("shifted_basis", 16, 2, opts, axes="concat", dtype=torch.float64)
    assert_close(concat(pos), joint(pos))


def test_bad_encoding_names_and_options():
    with pytest.raises(ValueError, match="did you mean 'shifted_basis'"):
        build_encoding("shifted_basic", 8, 1, {})
    with pytest.raises(ValueError, match="'raw' takes no options"):
        build_encoding("raw", 1, 1, {"width": 1.0})
    with pytest.raises(ValueError, match="4-th power|2-th power"):
        build_encoding("shifted_basis", 20, 2, {}, axes="product")


# -- metrics and data --------------------------------------------------------------------


def test_psnr_against_a_hand_computed_value():
    # MSE = (0.1^2 + 0 + 0.1^2) / 3 = 0.02/3; PSNR = 10 log10(150) = 21.7609 dB.
    pred = torch.tensor([[0.1, 0.5, 0.9]], dtype=torch.float64)
    target = torch.tensor([[0.0, 0.5, 1.0]], dtype=torch.float64)
    assert float(psnr(pred, target)[0]) == pytest.approx(21.76091259, abs=1e-6)
    # Per signal: an MSE of 0.01 is 20 dB, 1e-4 is 40 dB.
    two = psnr(torch.tensor([[0.1, 0.1], [0.01, 0.01]], dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64))
    assert_close(two, torch.tensor([20.0, 40.0], dtype=torch.float64))


def test_even_odd_split_and_grid():
    assert even_mask((6,)).tolist() == [True, False, True, False, True, False]
    mask = even_mask((4, 3)).reshape(4, 3)
    assert mask.tolist() == [[True, False, True], [False] * 3, [True, False, True], [False] * 3]
    coords = grid_coords((4, 3))
    assert coords.shape == (12, 2)
    assert_close(coords[5], torch.tensor([1 / 4, 2 / 3], dtype=torch.float64))  # row 1, column 2
    assert_close(grid_coords((4,))[:, 0], torch.tensor([0.0, 0.25, 0.5, 0.75], dtype=torch.float64))


# -- fits --------------------------------------------------------------------------------


def test_gaussian_basis_beats_raw_coordinates():
    problem = smooth_problem()
    base = dict(width=32, epochs=200, eval_every=100)
    raw = fit_problem(problem, FitConfig(posenc="raw", **base))
    gauss = fit_problem(problem, FitConfig(posenc="shifted_basis", posenc_options={"kind": "gaussian", "width": 0.02}, dim=64, **base))
    assert gauss.final["psnr_test"] > raw.final["psnr_test"] + 5.0, (gauss.final, raw.final)
    assert gauss.final["psnr_train"] > 30.0
    # The test PSNR mixes the training samples and the held-out ones (half each).
    mse = lambda p: 10 ** (-p / 10)  # noqa: E731
    f = gauss.final
    assert mse(f["psnr_test"]) == pytest.approx((mse(f["psnr_train"]) + mse(f["psnr_odd"])) / 2, rel=1e-6)


def test_linear_layer_narrow_basis_memorises_wide_basis_interpolates():
    # One linear layer on a dense Gaussian basis (1024 centres): a width far below the
    # spacing of the training samples (1/32) fits them and leaves zeros between them; a
    # width near it interpolates (measured: odd-sample PSNR 10.7 vs 36.3 dB).
    problem = smooth_problem()
    base = dict(model="linear", dim=1024, epochs=300, lr=1e-2, eval_every=100, posenc="shifted_basis")
    narrow = fit_problem(problem, FitConfig(posenc_options={"kind": "gaussian", "width": 0.0005}, **base))
    wide = fit_problem(problem, FitConfig(posenc_options={"kind": "gaussian", "width": 0.03}, **base))
    assert narrow.final["psnr_train"] > 40.0 and narrow.final["psnr_odd"] < 12.0, narrow.final
    assert wide.final["psnr_odd"] > 30.0, wide.final
    # The narrow basis has nearly full stable rank on the 32 training samples, the wide one a third.
    assert narrow.diagnostics["stable_rank_train"] > 0.9 * 32 > 3 * wide.diagnostics["stable_rank_train"]


@pytest.mark.parametrize("posenc,options", [("shifted_basis", {"kind": "rff", "width": 0.05}), ("fourier", {"gamma": 0.1})])
def test_stacked_fit_equals_separate_fits_in_float64(posenc, options):
    # S networks trained together (vmap, summed loss, elementwise Adam) are S separate fits:
    # network 0 of a joint fit is the single fit of its signal (same seed), and network 1
    # does not notice when signal 0 changes. fourier: a learnable encoding per signal.
    a, b = smooth_problem(n=32, signals=2).targets
    c = 1.0 - a
    cfg = FitConfig(posenc=posenc, posenc_options=options, dim=16, width=16, epochs=15, eval_every=5, dtype="float64", seed=3)

    def fit(*targets):
        n = targets[0].shape[0]
        problem = Problem(grid_coords((n,)), torch.stack(targets), even_mask((n,)), (n,), tuple(map(str, range(len(targets)))))
        return fit_problem(problem, cfg)

    ab, cb, a_alone = fit(a, b), fit(c, b), fit(a)
    assert_close(ab.prediction[0], a_alone.prediction[0], scale=1e3)
    assert_close(ab.prediction[1], cb.prediction[1], scale=1e3)
    assert ab.per_signal["psnr_test"][0] == pytest.approx(a_alone.final["psnr_test"], rel=1e-9)
    assert not torch.allclose(ab.prediction[0], cb.prediction[0])  # the networks did learn their signal


@pytest.mark.parametrize("model,output", [("mlp", "sigmoid"), ("linear", "linear")])
def test_stacked_network_equals_its_modules_forward_and_backward(model, output):
    # The fast path (stacked weights; one product for inputs shared by every network)
    # against the S nn.Sequential it was built from, in float64, with random upstream
    # gradients: outputs, and gradients of every weight and bias.
    cfg = FitConfig(model=model, depth=3, width=5)
    nets = [build_net(cfg, 7, 2, dtype=torch.float64) for _ in range(3)]
    stacked = StackedNetwork(nets, output)
    act = torch.sigmoid if output == "sigmoid" else (lambda y: y)
    for x in (torch.randn(11, 7, dtype=torch.float64), torch.randn(3, 11, 7, dtype=torch.float64)):
        expected = torch.stack([act(net(x if x.ndim == 2 else x[s])) for s, net in enumerate(nets)])
        got = stacked(x)
        assert_close(got, expected)
        upstream = torch.randn_like(got)
        grads = torch.autograd.grad((got * upstream).sum(), list(stacked.parameters()))
        linears = [[m for m in net if isinstance(m, torch.nn.Linear)] for net in nets]
        params = [p for ls in linears for layer in ls for p in (layer.weight, layer.bias)]
        ref = torch.autograd.grad((expected * upstream).sum(), params)
        layers = len(linears[0])
        for i in range(layers):
            for s in range(3):
                assert_close(grads[i][s], ref[(s * layers + i) * 2].T)  # weights [S, in, out]
                assert_close(grads[layers + i][s, 0], ref[(s * layers + i) * 2 + 1])  # biases [S, 1, out]


def test_gaussian_diagnostics_product_is_sqrt_ln10_over_pi():
    # A dense basis (spacing sigma / 4): stable rank x distance preservation = 0.856 for every sigma.
    problem = smooth_problem(n=512)
    for sigma in (0.01, 0.02):
        enc = build_encoding("shifted_basis", round(4 / sigma), 1, {"kind": "gaussian", "width": sigma}, dtype=torch.float64)
        cfg = FitConfig(posenc="shifted_basis", posenc_options={"kind": "gaussian", "width": sigma})
        d = diagnostics(enc, cfg, problem)
        assert d["product"] == pytest.approx(GAUSSIAN_PRODUCT, rel=0.02)
        assert d["stable_rank_dense"] == pytest.approx(1 / (2 * sigma * math.sqrt(math.pi)), rel=0.02)


# -- images ------------------------------------------------------------------------------

skimage = pytest.importorskip("skimage", reason="the vision extra (scikit-image) is not installed")


def _write(path, array):
    from PIL import Image

    Image.fromarray(array).save(path)
    return str(path)


def test_shipped_images_load_from_the_wheel_without_a_download():
    import skimage.data

    from flt.fit.images import SHIPPED, load_image, shipped_path

    for name in SHIPPED:
        assert os.path.isfile(shipped_path(name))  # inside the installed package: no fetch
        img = load_image(name)
        assert img.ndim == 2 and img.dtype == np.float64 and 0.0 <= img.min() <= img.max() <= 1.0
    np.testing.assert_array_equal(load_image("camera"), skimage.data.camera() / 255.0)
    rgb = load_image("astronaut", mode="rgb", size=32)
    assert rgb.shape == (32, 32, 3)


def test_loader_reads_files_and_names_bad_ones(tmp_path):
    from flt.fit.images import load_image

    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (12, 10), dtype=np.uint8)
    np.testing.assert_array_equal(load_image(_write(tmp_path / "g.png", grey)), grey / 255.0)
    rgb = rng.integers(0, 256, (8, 9, 3), dtype=np.uint8)
    np.testing.assert_array_equal(load_image(_write(tmp_path / "c.png", rgb), mode="rgb"), rgb / 255.0)
    assert load_image(_write(tmp_path / "c.jpg", rgb), mode="rgb").shape == (8, 9, 3)
    opaque = np.concatenate([rgb, np.full((8, 9, 1), 255, np.uint8)], -1)
    np.testing.assert_array_equal(load_image(_write(tmp_path / "a.png", opaque), mode="rgb"), rgb / 255.0)

    with pytest.raises(FileNotFoundError, match="missing.png"):
        load_image(str(tmp_path / "missing.png"))
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(ValueError, match="corrupt.png.*not a readable PNG/JPEG"):
        load_image(str(tmp_path / "corrupt.png"))
    with pytest.raises(ValueError, match="is grey"):
        load_image(str(tmp_path / "g.png"), mode="rgb")
    transparent = opaque.copy()
    transparent[0, 0, 3] = 0
    with pytest.raises(ValueError, match="transparent"):
        load_image(_write(tmp_path / "t.png", transparent))
    with pytest.raises(ValueError, match="shape"):
        load_image(_write(tmp_path / "la.png", np.stack([grey, grey], -1)))
    with pytest.raises(ValueError, match="neither a shipped image"):
        load_image("cameraman")


# -- the command -------------------------------------------------------------------------

FAST = ["--no-progress", "--threads", "1", "--epochs", "20", "--eval-every", "10"]


@pytest.mark.cli
def test_fit_signal_writes_a_well_formed_summary(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["fit", "signal", "--preset", "smoke", "--rows", "0,100", "--posenc", "shifted_basis:kind=gaussian",
                 "--posenc-opt", "width=0.02", "--out-dir", str(out), *FAST])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    final = summary["final"]
    assert {"psnr_train", "psnr_test", "psnr_odd"} <= final.keys() and all(math.isfinite(v) for v in final.values())
    assert summary["config"]["rows"] == [0, 100] and summary["config"]["posenc_options"] == {"kind": "gaussian", "width": 0.02}
    assert len(summary["per_signal"]["psnr_test"]) == 2
    assert final["psnr_test"] == pytest.approx(sum(summary["per_signal"]["psnr_test"]) / 2)
    assert [h["epoch"] for h in summary["history"]] == [10, 20]
    assert np.load(out / "prediction.npy").shape == (2, 512)
    for png in ("reconstruction.png", "psnr.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out / "summary.json").st_mode & 0o777 == 0o666 & ~umask
    assert "test" in capsys.readouterr().out
    # No silent overwrite.
    assert main(["fit", "signal", "--preset", "smoke", "--out-dir", str(out), *FAST]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.cli
def test_fit_image_and_sweep_write_their_figures(tmp_path):
    out = tmp_path / "sweep"
    code = main(["fit", "image", "--preset", "smoke", "--size", "16", "--posenc", "shifted_basis", "--dim", "64",
                 "--axes", "product", "--sweep", "width=0.02,0.1", "--out-dir", str(out), *FAST])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    points = summary["sweep"]["points"]
    assert summary["sweep"]["key"] == "width" and [p["value"] for p in points] == [0.02, 0.1]
    assert np.load(out / "prediction.npy").shape == (2, 16, 16)
    best = max(points, key=lambda p: p["final"]["psnr_test"])
    assert summary["final"]["width"] == best["value"] and summary["final"]["psnr_test"] == best["final"]["psnr_test"]
    assert all(p["diagnostics"]["stable_rank_train"] >= 1 for p in points)
    for png in ("sweep.png", "sweep_reconstructions.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.cli
def test_ctrl_c_leaves_no_run(tmp_path, capsys, monkeypatch):
    import flt.fit.run as run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "fit_problem", interrupted)
    out = tmp_path / "stopped"
    assert main(["fit", "signal", "--preset", "smoke", "--out-dir", str(out), *FAST]) == 130
    assert "interrupted; nothing was written" in capsys.readouterr().err and not out.exists()


@pytest.mark.cli
@pytest.mark.parametrize("argv,needle", [
    (["--posenc", "gausian"], "--posenc must be one of"),
    (["--posenc", "shifted_basis:widht=0.1"], "did you mean 'width'"),
    (["--posenc", "shifted_basis", "--posenc-opt", "width=abc"], "'width'"),
    (["--posenc", "shifted_basis", "--sweep", "sigma=0.1,0.2"], "'sigma'"),
    (["--posenc", "learned"], "integer"),
    (["--image", "no/such/file.png"], "does not exist"),
    (["--rows", "0,9999"], "--rows"),
    (["--axes", "product"], "--axes"),
])
def test_fit_errors_name_the_argument(argv, needle, tmp_path, capsys):
    code = main(["fit", "signal", "--preset", "smoke", "--out-dir", str(tmp_path / "x"), *FAST, *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("flt fit: error:") and needle in err, err
