"""Options and input errors (tracker issue 9): one syntax for every command, options checked
against the constructors' signatures, and clear errors for bad inputs of every ATTENTION entry."""

from __future__ import annotations

import copy
import inspect
import os
import pickle
import re

import pytest
import torch

from flt import ATTENTION, POSENC, SPECTRA, FLTAttention
from flt.cli import build_parser, main
from flt.options import (
    ATTENTION_ARGUMENTS,
    UnknownOptionError,
    check_attention_options,
    check_posenc_options,
    constructor_options,
    merge_options,
    parse_attention,
    parse_attention_list,
    parse_value,
)

NAMES = sorted(ATTENTION)
#: An int option of every entry (with a valid value), to feed it the wrong type.
INT_OPTION = {"flt": "num_features", "performer": "num_features", "toeplitz": "max_distance", "softmax": "max_distance"}


# -- 1. types ----------------------------------------------------------------------------


def test_flt_num_frequencies_of_the_wrong_type_is_named_with_its_type():
    with pytest.raises(TypeError) as err:
        FLTAttention.from_options(16, 2, num_frequencies="abc")
    assert str(err.value) == "attention 'flt': option 'num_frequencies' must be an int, got 'abc' (str)"


@pytest.mark.cli
def test_cli_num_frequencies_of_the_wrong_type_is_one_line(capsys):
    assert main(["train", "lm", "--attn-opt", "num_frequencies=abc"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "flt train: error: attention 'flt': option 'num_frequencies' must be an int, got 'abc' (str)"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value, shown", [("abc", "'abc' (str)"), (True, "True (bool)"), (4.0, "4.0 (float)")])
def test_every_entry_rejects_an_int_option_of_another_type(name, value, shown):
    option = INT_OPTION[name]
    with pytest.raises(TypeError, match=re.escape(f"attention '{name}': option '{option}' must be an int, got {shown}")):
        ATTENTION[name].from_options(16, 2, **{option: value})


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rope": 1}, "option 'rope' must be a bool (true or false), got 1 (int)"),
        ({"seed": True}, "option 'seed' must be an int or None (null), got True (bool)"),
        ({"temperature": "hot"}, "option 'temperature' must be a number, got 'hot' (str)"),
        ({"coupling": 1}, "option 'coupling' must be a string, got 1 (int)"),
        ({"components": 2.5}, "option 'components' (of spectrum 'gaussian_mixture') must be an int, got 2.5 (float)"),
        ({"spectrum": "gaussian", "length_scale": "wide"},
         "option 'length_scale' (of spectrum 'gaussian') must be a number or a list of numbers, got 'wide' (str)"),
        ({"spectrum": "local", "window_sizes": [1, "2"]},
         "option 'window_sizes' (of spectrum 'local') must be a list of numbers or None (null), got [1, '2'] (list)"),
        ({"spectrum": "local", "shift": "yes"}, "option 'shift' (of spectrum 'local') must be a bool (true or false), got 'yes' (str)"),
        ({"spectrum": "local", "smoothing": "wide"},
         "option 'smoothing' (of spectrum 'local') must be a number or a list of numbers, got 'wide' (str)"),
    ],
)
def test_flt_and_spectrum_options_are_type_checked(options, message):
    with pytest.raises(TypeError, match=re.escape(f"attention 'flt': {message}")):
        FLTAttention.from_options(16, 2, **options)


@pytest.mark.cli
@pytest.mark.parametrize("spectrum", ["gaussian", "matern", "neural"])
def test_shift_on_a_family_without_components_is_refused_before_the_model(spectrum, capsys):
    message = "family has no components to shift; use spectrum='gaussian_mixture' or 'local', or shift=False"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_attention_options("flt", {"spectrum": spectrum, "shift": True})
    check_attention_options("flt", {"spectrum": spectrum, "shift": False})
    check_attention_options("flt", {"spectrum": "local", "shift": True})
    # flt train refuses it as a usage error (before loading data), not from inside the model
    assert main(["train", "lm", "--attn-opt", f"spectrum={spectrum}", "--attn-opt", "shift=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flt train: error: attention 'flt': shift: the ") and err.endswith(message)


def test_numbers_accept_ints_and_sequences_accept_tuples_and_tensors():
    layer = FLTAttention.from_options(16, 2, spectrum="local", smoothing=[1, 2.0, 4, 8], shift=True, shift_scale=100)
    assert layer.spectrum.shift.shape == (2, 4, 1) and layer.spectrum.shift_scale == 100.0
    FLTAttention.from_options(16, 2, temperature=2, spectrum="gaussian", length_scale=(1.0, 2), pos_dim=2)
    FLTAttention.from_options(16, 2, spectrum="gaussian", length_scale=torch.tensor([1.0, 2.0]), pos_dim=2)


def test_cli_values_arrive_parsed_as_json():
    assert [parse_value(t) for t in ("3", "3.5", "true", "null", "[1,2]", "local", '"3"')] == [3, 3.5, True, None, [1, 2], "local", "3"]
    check_attention_options("flt", {"num_frequencies": parse_value("16")})
    # Python spellings of the constants, e.g. --data-opt require_utf8=False
    assert [parse_value(t) for t in ("False", "TRUE", "None", '"False"')] == [False, True, None, "False"]
    with pytest.raises(TypeError, match=r"'num_frequencies' must be an int, got '16' \(str\)"):
        check_attention_options("flt", {"num_frequencies": parse_value('"16"')})


@pytest.mark.cli
def test_posenc_options_are_type_checked(capsys):
    assert main(["train", "lm", "--posenc", "sinusoidal", "--posenc-opt", "base=abc"]) == 2
    assert "posenc 'sinusoidal': option 'base' must be a number, got 'abc' (str)" in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"posenc 'fourier': option 'hidden' must be an int, got False \(bool\)"):
        check_posenc_options("fourier", {"hidden": False})


@pytest.mark.parametrize("name", NAMES)
def test_every_annotated_default_passes_its_own_check(name):
    """The annotations agree with the defaults, for every entry and every spectrum."""
    params = constructor_options(ATTENTION[name]).params
    check_attention_options(name, {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty})
    if "spectrum" in params:
        for spectrum, cls in SPECTRA.items():
            extra = {k: p.default for k, p in constructor_options(cls).params.items()
                     if k not in params and p.default is not inspect.Parameter.empty and k not in ("device", "dtype")}
            check_attention_options(name, {"spectrum": spectrum, **extra})


def test_every_preset_option_passes():
    from flt.options import POSENC_ARGUMENTS
    from flt.train.presets import ATTENTION_DEFAULTS, POSENC_DEFAULTS

    for task, mechanisms in ATTENTION_DEFAULTS.items():
        for name, options in mechanisms.items():
            check_attention_options(name, options, reserved=ATTENTION_ARGUMENTS)
        for name, options in POSENC_DEFAULTS[task].items():
            check_posenc_options(name, options, reserved=POSENC_ARGUMENTS)


# -- 2. unknown names --------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_reports_an_unknown_option_against_its_registry_name(name):
    with pytest.raises(UnknownOptionError) as err:
        ATTENTION[name].from_options(16, 2, foo=1)
    text = str(err.value)
    assert text.startswith(f"attention '{name}': unknown option 'foo'")
    assert f"{ATTENTION[name].__name__} takes " in text and INT_OPTION[name] in text
    assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)


def test_flt_unknown_option_suggests_and_lists_the_layer_and_spectrum_options():
    with pytest.raises(UnknownOptionError) as err:
        FLTAttention.from_options(16, 2, numfreq=3)
    text = str(err.value)
    assert text.startswith("attention 'flt': unknown option 'numfreq'; did you mean 'num_frequencies'")
    assert "FLTAttention takes backend, check_condition, chunk_size, coupling," in text
    assert "its spectrum 'gaussian_mixture' takes alpha_scale, amplitude, basis, components," in text
    assert "Spectrum.__init__" not in text


def test_an_option_of_another_spectrum_says_which():
    with pytest.raises(UnknownOptionError, match=r"'length_scale' is an option of the spectrum 'gaussian_mixture', .* not of 'local'"):
        FLTAttention.from_options(16, 2, spectrum="local", length_scale=2.0)


def test_softmax_spectrum_options_are_checked_against_the_spectrum():
    with pytest.raises(UnknownOptionError, match=r"attention 'softmax': unknown option 'componets'; did you mean 'components'\?"):
        ATTENTION["softmax"].from_options(16, 2, relative_bias="spectrum", componets=2)
    # A valid spectrum option without relative_bias="spectrum" keeps the layer's own message.
    with pytest.raises(ValueError, match="spectrum options need relative_bias='spectrum'"):
        ATTENTION["softmax"].from_options(16, 2, amplitude=1.0)


@pytest.mark.cli
def test_cli_unknown_option_is_one_line_with_a_suggestion(capsys):
    assert main(["train", "lm", "--attn-opt", "numfreq=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("flt train: error: attention 'flt': unknown option 'numfreq'; did you mean 'num_frequencies'")
    assert "its spectrum 'local' takes" in err  # the lm preset's spectrum


@pytest.mark.cli
def test_cli_options_the_model_sets_are_refused(capsys):
    assert main(["train", "lm", "--attn-opt", "causal=false"]) == 2
    assert "attention 'flt': 'causal' is not an option: the model sets dim, heads, pos_dim, causal, device and dtype" in capsys.readouterr().err


@pytest.mark.cli
def test_posenc_unknown_option(capsys):
    assert main(["train", "lm", "--posenc", "sinusoidal", "--posenc-opt", "bse=3"]) == 2
    assert "posenc 'sinusoidal': unknown option 'bse'; did you mean 'base'? (SinusoidalEncoding takes base)" in capsys.readouterr().err
    for name in POSENC:  # every entry's options are inspectable
        assert not constructor_options(POSENC[name]).open


def _count_checks(monkeypatch) -> list[str]:
    """The owner of every option check run from now on (``attention 'flt'``)."""
    import flt.layers.base
    import flt.options
    from flt._signatures import check_options

    owners: list[str] = []

    def counting(owner, cls, options, **kw):
        owners.append(owner)
        check_options(owner, cls, options, **kw)

    monkeypatch.setattr(flt.layers.base, "check_options", counting)
    monkeypatch.setattr(flt.options, "check_options", counting)
    return owners


def test_a_training_run_checks_each_option_set_once_not_once_per_layer(monkeypatch):
    from flt.commands.train import preset_from_args
    from flt.tasks import get_task

    owners = _count_checks(monkeypatch)
    args = build_parser().parse_args(["train", "lm", "--preset", "smoke", "--posenc", "sinusoidal",
                                      "--model-opt", "depth=3", "--attn-opt", "num_features=16"])
    preset = preset_from_args(args, "flt")  # what flt train does before any data loads
    assert owners == ["attention 'flt'", "posenc 'sinusoidal'"]
    model = get_task("lm").build_model(preset.model)
    assert len(model.trunk.blocks) == 3 and model.trunk.blocks[2].attn.feature_map.num_features == 16
    assert owners == ["attention 'flt'", "posenc 'sinusoidal'"]  # the model checked nothing again


def test_a_model_checks_each_distinct_option_set_once(monkeypatch):
    from flt.models import Trunk

    owners = _count_checks(monkeypatch)
    t5, flt = {"attention": "softmax", "attention_options": {"relative_bias": "t5"}}, {"attention": "flt", "attention_options": {}}
    trunk = Trunk(16, 3, 2, attention="flt", attention_options={}, layer_attention=[t5, flt, t5], pos_dim=1, causal=True,
                  mlp_ratio=2.0, dropout=0.0)
    assert [type(a).__name__ for a in trunk.attention_layers()] == ["SoftmaxAttention", "FLTAttention", "SoftmaxAttention"]
    assert owners == ["attention 'softmax'", "attention 'flt'"]
    # A Python caller of a layer's builder is an entry point of its own: checked every call.
    FLTAttention.from_options(16, 2)
    FLTAttention.from_options(16, 2)
    assert owners[2:] == ["attention 'flt'", "attention 'flt'"]


def test_a_set_that_failed_fails_every_time_and_only_its_own_check_counts(monkeypatch):
    from flt.models import build_attention
    from flt.options import CheckedOptions

    owners = _count_checks(monkeypatch)
    for _ in range(2):
        with pytest.raises(TypeError, match="option 'num_frequencies' must be an int, got 'abc'"):
            check_attention_options("flt", {"num_frequencies": "abc"})
    checked = check_attention_options("flt", {"num_frequencies": 8}, reserved=ATTENTION_ARGUMENTS)
    assert isinstance(checked, CheckedOptions) and checked == {"num_frequencies": 8}
    assert len(owners) == 3
    build_attention("flt", 16, 2, pos_dim=1, causal=False, options=checked)
    assert len(owners) == 3  # the builder takes the set as checked
    build_attention("flt", 16, 2, pos_dim=1, causal=False, options={"num_frequencies": 8})
    assert len(owners) == 4  # a plain dict is checked
    # A set checked for another mechanism, or changed after its check, is checked again.
    with pytest.raises(UnknownOptionError, match="num_frequencies"):
        build_attention("performer", 16, 2, pos_dim=1, causal=False, options=checked)
    checked["num_frequencies"] = "abc"
    with pytest.raises(TypeError, match="option 'num_frequencies' must be an int, got 'abc'"):
        build_attention("flt", 16, 2, pos_dim=1, causal=False, options=checked)
    assert len(owners) == 6
    # 8.0 and True are other values to the check than 8: each is refused.
    with pytest.raises(TypeError, match=r"got 8.0 \(float\)"):
        check_attention_options("flt", {"num_frequencies": 8.0})
    with pytest.raises(TypeError, match=r"got True \(bool\)"):
        check_attention_options("flt", {"num_frequencies": True})


@pytest.mark.cli
def test_a_bad_option_fails_before_any_data_loads(monkeypatch, capsys):
    import flt.train.loop

    monkeypatch.setattr(flt.train.loop, "load_data", lambda *a, **k: pytest.fail("data loaded"))
    assert main(["train", "lm", "--preset", "smoke", "--attn-opt", "numfreq=3"]) == 2
    assert "attention 'flt': unknown option 'numfreq'; did you mean 'num_frequencies'" in capsys.readouterr().err


def test_layers_still_copy_and_pickle():
    lay = FLTAttention.from_options(16, 2, num_frequencies=8, causal=True)
    for other in (copy.deepcopy(lay), pickle.loads(pickle.dumps(lay))):
        assert other.spectrum.num_frequencies == 8 and other.causal


# -- 3. one syntax -----------------------------------------------------------------------


def test_the_one_parser():
    assert parse_attention("flt:num_frequencies=16:spectrum=local") == ("flt", {"num_frequencies": 16, "spectrum": "local"})
    assert parse_attention_list('flt,flt:window_sizes=[2,8]:x="a:b"') == [
        ("flt", "flt", {}), ('flt:window_sizes=[2,8]:x="a:b"', "flt", {"window_sizes": [2, 8], "x": "a:b"}),
    ]
    with pytest.raises(ValueError, match="sets 'a' twice"):
        parse_attention("flt:a=1:a=2")
    with pytest.raises(ValueError, match="no mechanism name"):
        parse_attention(":a=1")


def test_merge_conflicts_are_errors_and_agreements_are_not():
    assert merge_options({"a": 1}, {"a": 1, "b": 2}, entry_source="X") == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match=r"option 'a' is set twice: 1 by X and 2 by --attn-opt; give it once"):
        merge_options({"a": 1}, {"a": 2}, entry_source="X")
    with pytest.raises(ValueError, match="set twice"):
        merge_options({"a": True}, {"a": 1}, entry_source="X")


@pytest.mark.cli
def test_train_accepts_options_in_attention(monkeypatch, tmp_path):
    import flt.train

    seen = {}
    monkeypatch.setattr(flt.train, "train", lambda preset, out_dir, **kw: seen.update(preset=preset, out_dir=out_dir))
    monkeypatch.chdir(tmp_path)
    argv = ["train", "lm", "--preset", "smoke", "--attention", "flt:num_frequencies=8:spectrum=gaussian", "--attn-opt", "num_features=32"]
    assert main(argv) == 0
    options = seen["preset"].model.attention_options
    assert options["num_frequencies"] == 8 and options["spectrum"] == "gaussian" and options["num_features"] == 32
    assert seen["out_dir"] == "runs/lm-flt_num_frequencies=8_spectrum=gaussian-smoke-s0"


@pytest.mark.cli
def test_train_conflicting_options_are_one_line(capsys):
    assert main(["train", "lm", "--attention", "flt:num_frequencies=16", "--attn-opt", "num_frequencies=32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("flt train: error: option 'num_frequencies' is set twice: 16 by --attention flt:num_frequencies=16 "
                   "and 32 by --attn-opt; give it once")


@pytest.mark.cli
def test_compare_passes_entries_in_the_same_syntax_and_checks_them_first(monkeypatch, tmp_path, capsys):
    import flt.commands.compare as compare

    args = build_parser().parse_args(["compare", "lm", "--attention", "flt:spectrum=local:window_sizes=[2,8]"])
    (label, name, options), = compare.parse_entries(args.attention)
    argv = compare._child_argv(args, name, options, 0, str(tmp_path))
    child = build_parser().parse_args(argv[argv.index("train"):])
    assert parse_attention(child.attention) == (name, options) and not child.attn_opt
    # Run options given as flags reach every child run, --init-from as an absolute path.
    args = build_parser().parse_args(["compare", "lm", "--attention", "flt", "--init-from", "runs/x", "--compile", "--steps", "7"])
    child = build_parser().parse_args((argv := compare._child_argv(args, "flt", {}, 0, str(tmp_path)))[argv.index("train"):])
    assert (child.init_from, child.compile, child.steps) == (os.path.abspath("runs/x"), True, 7)

    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: pytest.fail("a run started"))
    bad = ["compare", "lm", "--attention", "flt,performer:numfeatures=8", "--out-dir", str(tmp_path / "c")]
    assert main(bad) == 2
    assert "attention 'performer': unknown option 'numfeatures'; did you mean 'num_features'?" in capsys.readouterr().err
    assert main(["compare", "lm", "--attention", "flt:num_frequencies=16,performer", "--attn-opt", "num_frequencies=8"]) == 2
    assert "option 'num_frequencies' is set twice: 16 by --attention entry 'flt:num_frequencies=16' and 8 by --attn-opt" in capsys.readouterr().err


def test_every_command_with_attention_uses_the_shared_parser():
    import pathlib

    import flt.commands

    for path in pathlib.Path(flt.commands.__file__).parent.glob("*.py"):
        text = path.read_text()
        if '"--attention"' in text:
            assert "flt.options import" in text or "preset_from_args" in text, path.name
            assert 'split(":")' not in text, path.name


# -- 4. inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_names_a_dtype_mismatch(name):
    lay = ATTENTION[name].from_options(16, 2)
    with pytest.raises(TypeError) as err:
        lay(torch.randn(2, 5, 16, dtype=torch.float64))
    assert str(err.value) == (
        "x has dtype float64 but the layer's parameters are float32; cast the input (x.to(torch.float32)) "
        "or the layer (layer.double())"
    )


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_names_an_empty_sequence(name):
    with pytest.raises(ValueError, match=re.escape("x has no tokens (N = 0, shape (2, 0, 16)); attention needs at least one token")):
        ATTENTION[name].from_options(16, 2)(torch.randn(2, 0, 16))


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_names_a_device_mismatch(name):
    with pytest.raises(ValueError, match=re.escape("x is on meta but the layer's parameters are on cpu")):
        ATTENTION[name].from_options(16, 2)(torch.empty(2, 5, 16, device="meta"))


@pytest.mark.parametrize("name", NAMES)
def test_autocast_still_mixes_dtypes(name):
    lay = ATTENTION[name].from_options(16, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lay(torch.randn(1, 4, 16, dtype=torch.bfloat16))
    assert out.shape == (1, 4, 16)


@pytest.mark.parametrize("name", sorted(ATTENTION))
@pytest.mark.parametrize("relative_bias", [None, "spectrum", "t5"])
def test_a_mechanism_says_whether_it_takes_a_spectrums_options_as_its_check_does(name, relative_bias):
    """``takes_spectrum_options`` (what the tasks ask before handing a preset's spectrum
    options on) agrees with the check: a spectrum's option passes exactly when it says so."""
    base = {} if relative_bias is None or name != "softmax" else {"relative_bias": relative_bias}
    options = {**base, "spectrum": "gaussian", "length_scale": 2.0}
    try:
        ATTENTION[name].from_options(16, 2, **options)
        accepted = True
    except (TypeError, ValueError):
        accepted = False
    assert ATTENTION[name].takes_spectrum_options(options) is accepted
