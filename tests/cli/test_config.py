"""The YAML config loader: every problem reported at once with its line and a fix; overrides; types; round trip."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaloss_cli.config import ConfigError, ExperimentConfig, Problem, load_config, load_config_dict
from adaloss_cli.config.schema import to_dict
from adaloss.errors import UserError


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def problems_of(path: Path, overrides: tuple[str, ...] = ()) -> list[Problem]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


# ---------------------------------------------------------------- one bad snippet, one problem

BAD_SNIPPETS = [
    # (yaml, key path, line, phrases in the message)
    ("trainig:\n  epochs: 3\n", "trainig", 1, ["unknown key", "did you mean 'training'"]),
    ("training:\n  epochs: 3\n  optimizer:\n    lrr: 0.1\n", "training.optimizer.lrr", 4,
     ["unknown key", "valid keys in training.optimizer", "did you mean 'lr'"]),
    ("training:\n  lr: 0.1\n", "training.lr", 2, ["did you mean 'training.optimizer.lr'"]),
    ("run:\n  seed: 1\n  epochs: 4\n", "run.epochs", 3, ["did you mean 'training.epochs'"]),
    ("training:\n  epochs: 3.5\n", "training.epochs", 2, ["got 3.5 (a float)", "must be an integer >= 1"]),
    ("training:\n  epochs: 3.0\n", "training.epochs", 2, ["must be an integer", "did you mean 3?"]),
    ("training:\n  epochs: true\n", "training.epochs", 2, ["got true (a boolean)", "must be an integer"]),
    ("training:\n  batch_size: 0\n", "training.batch_size", 2, ["got 0", "must be an integer >= 1"]),
    ("training:\n  optimizer:\n    lr: 0\n", "training.optimizer.lr", 3, ["got 0", "must be a number > 0"]),
    ("training:\n  optimizer:\n    lr: fast\n", "training.optimizer.lr", 3, ["got 'fast' (a string)", "a number"]),
    ("training:\n  optimizer:\n    name: adamw\n", "training.optimizer.name", 3,
     ["got 'adamw'", "must be one of: sgd, adam", "did you mean 'adam'"]),
    ("model:\n  dropout: 1.5\n", "model.dropout", 2, ["got 1.5", ">= 0 and <= 1"]),
    ("data:\n  augment: 1\n", "data.augment", 2, ["got 1 (an integer)", "must be true or false"]),
    ("run:\n  name: 42\n", "run.name", 2, ["must be a string", 'quote it: "42"']),
    ("run:\n  seed: null\n", "run.seed", 2, ["got null", "must be an integer >= 0"]),
    ("model:\n  hidden_sizes: 64\n", "model.hidden_sizes", 2, ["got 64 (an integer)", "a list of integers"]),
    ("model:\n  hidden_sizes:\n    - 64\n    - wide\n", "model.hidden_sizes[1]", 4,
     ["got 'wide' (a string)", "must be an integer >= 1"]),
    ("training:\n  optimizer:\n    betas: [0.9]\n", "training.optimizer.betas", 3,
     ["got 1 item", "a list of 2 numbers"]),
    ("training:\n  optimizer:\n    betas: [0.9, 1.0]\n", "training.optimizer.betas[1]", 3, ["got 1.0", "< 1"]),
    ("training:\n  optimizer:\n    betas: null\n", "training.optimizer.betas", 3, ["got null"]),
    ("loss_scaling:\n  dynamic:\n    on_floor: clam\n", "loss_scaling.dynamic.on_floor", 3,
     ["one of: clamp, raise, or null", "did you mean 'clamp'"]),
    ("training:\n  optimizer:\n    momentum: 0\n    nesterov: true\n", "training.optimizer.nesterov", 4,
     ["needs momentum > 0"]),
    ("training:\n  lr_schedule:\n    milestones:\n      - 0.5\n      - 0.3\n", "training.lr_schedule.milestones[1]",
     5, ["got 0.3 after 0.5", "strictly increasing"]),
    ("training:\n  lr_schedule:\n    milestones: [0.5, 1.0]\n", "training.lr_schedule.milestones[1]", 3,
     ["got 1.0", "> 0 and < 1"]),
    ("run:\n  seed: 1\ndata:\n  name: cifar10\n", "data.root", 4, ["got null", "when data.name is cifar10"]),
    ("loss_scaling:\n  dynamic:\n    min_scale: 1024\n    max_scale: 16\n", "loss_scaling.dynamic.min_scale", 3,
     ["got 1024.0", "must be <= loss_scaling.dynamic.max_scale"]),
    ("loss_scaling:\n  adaptive:\n    u_max: 1\n    u_min: 1\n", "loss_scaling.adaptive.u_min", 4,
     ["must be < loss_scaling.adaptive.u_max"]),
    ("precision: float16\n", "precision", 1,
     ["got 'float16' (a string)", "must be a mapping", "did you mean 'precision.dtype: float16'"]),
    ("- run\n- training\n", "", 1, ["got ['run', 'training'] (a list)", "top level must be a mapping"]),
    ("training:\n  epochs: 2\n  epochs: 3\n", "training.epochs", 3, ["written twice (first on line 2)"]),
    ("training:\n  epochs: 3\n optimizer: {}\n", "", 3, ["malformed YAML"]),
]


@pytest.mark.parametrize("snippet, key, line, phrases", BAD_SNIPPETS, ids=[case[1] or "top" for case in BAD_SNIPPETS])
def test_bad_snippet_reports_key_line_and_fix(tmp_path, snippet, key, line, phrases):
    path = write(tmp_path, snippet)
    [problem] = problems_of(path)
    assert (problem.file, problem.key, problem.line) == (str(path), key, line)
    for phrase in phrases:
        assert phrase in problem.message


def test_error_text_has_header_and_one_line_per_problem(tmp_path):
    path = write(tmp_path, """
        run:
          seed: 1
        trainig:
          epochs: 3
        training:
          optimizer:
            lr: -1
        """)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert isinstance(info.value, UserError)
    lines = str(info.value).splitlines()
    assert lines[0] == f"Invalid config {path} (2 problems):"
    assert lines[1].startswith(f"  {path}:3: trainig: unknown key; ")
    assert lines[1].endswith("(did you mean 'training'?)")
    assert lines[2] == f"  {path}:7: training.optimizer.lr: got -1.0; must be a number > 0"


def test_every_problem_of_a_file_is_reported(tmp_path):
    path = write(tmp_path, """
        model:
          name: resnet21
          widht: 8
        training:
          epochs: 0
          optimizer:
            name: adam
            betas: [0.9, x]
        loss_scaling:
          method: adaptve
        """)
    found = {(p.key, p.line) for p in problems_of(path)}
    assert found == {("model.name", 2), ("model.widht", 3), ("training.epochs", 5),
                     ("training.optimizer.betas[1]", 8), ("loss_scaling.method", 10)}


def test_problems_are_listed_in_file_order(tmp_path):
    path = write(tmp_path, "output:\n  record_every: 0\nrun:\n  sed: 1\n")
    assert [p.line for p in problems_of(path)] == [2, 4]


def test_unreadable_file_is_a_config_error(tmp_path):
    [problem] = problems_of(tmp_path / "missing.yaml")
    assert "cannot read the file" in problem.message


# ---------------------------------------------------------------- types, defaults, round trip

@pytest.mark.parametrize("text", ["", "# only a comment\n\n   \n", "---\n"])
def test_a_file_without_any_key_is_refused_naming_it(tmp_path, text):
    # An empty file would silently train the all-defaults experiment (a float32 MLP): a wrong or truncated file.
    path = write(tmp_path, text)
    [problem] = problems_of(path, ("training.epochs=2",))
    assert problem.file == str(path) and "empty" in problem.message and "adaloss configs" in problem.message


def test_an_empty_mapping_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path, "{}\n")) == ExperimentConfig()


def test_missing_keys_and_empty_sections_take_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "training:\n  epochs: 2\noutput:\n"))
    assert cfg.training.epochs == 2
    assert cfg.training.optimizer == ExperimentConfig().training.optimizer
    assert cfg.output == ExperimentConfig().output


def test_number_text_and_ints_become_floats(tmp_path):
    cfg = load_config(write(tmp_path, """
        training:
          optimizer:
            lr: 1e-3
            weight_decay: 5E-4
            eps: 1
        loss_scaling:
          fixed:
            scale: 1024
        """))
    assert cfg.training.optimizer.lr == 0.001 and isinstance(cfg.training.optimizer.lr, float)
    assert cfg.training.optimizer.weight_decay == 5e-4
    assert cfg.training.optimizer.eps == 1.0 and isinstance(cfg.training.optimizer.eps, float)
    assert cfg.loss_scaling.fixed.scale == 1024.0 and isinstance(cfg.loss_scaling.fixed.scale, float)


def test_lists_become_tuples_of_the_item_type(tmp_path):
    cfg = load_config(write(tmp_path, "model:\n  hidden_sizes: [32, 16]\ntraining:\n  optimizer:\n"
                                      "    betas: [0, 1e-1]\n"))
    assert cfg.model.hidden_sizes == (32, 16)
    assert cfg.training.optimizer.betas == (0.0, 0.1)
    assert all(isinstance(b, float) for b in cfg.training.optimizer.betas)


def test_non_finite_numbers_are_rejected():
    with pytest.raises(ConfigError, match="not a finite number"):
        load_config_dict({"training": {"optimizer": {"lr": float("nan")}}})


def test_nullable_keys_accept_null(tmp_path):
    cfg = load_config(write(tmp_path, "data:\n  name: cifar10\n  root: /data/cifar\ntraining:\n  iterations: null\n"))
    assert cfg.training.iterations is None and cfg.data.root == "/data/cifar"


FULL_CONFIG = """
run: {name: roundtrip, seed: 3}
backend: torch
device: cpu
model: {name: cnn, hidden_sizes: [10], width: 8, dropout: 0.25}
data: {name: mnist, root: /tmp/mnist, val_fraction: 0.1, augment: false, limit_train: 100}
training:
  epochs: 2
  iterations: 50
  grad_clip_norm: 1.0
  optimizer: {name: adam, lr: 3e-4, momentum: 0.0, betas: [0.8, 0.99], eps: 1e-6}
  lr_schedule: {name: step, warmup_steps: 5, milestones: [0.3, 0.6, 0.9], gamma: 0.5}
precision: {dtype: float16}
loss_scaling:
  method: adaptive
  dynamic: {preset: deepspeed, init_scale: 65536, min_scale: 1, max_scale: 1e6, on_floor: raise, hysteresis: 2}
  adaptive: {loss_scale_method: abs_range, u_min: 1e-7, u_max: 60000, power_of_two: false}
output: {root: out, record_every: 5, progress: false}
"""


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(write(tmp_path, FULL_CONFIG))
    assert cfg != ExperimentConfig()
    dumped = write(tmp_path, yaml.safe_dump(to_dict(cfg), sort_keys=False), name="dumped.yaml")
    assert load_config(dumped) == cfg
    assert load_config_dict(to_dict(cfg)) == cfg


def test_config_is_frozen(tmp_path):
    cfg = load_config(write(tmp_path, "{}"))
    with pytest.raises(AttributeError):
        cfg.training.epochs = 3  # type: ignore[misc]


# ---------------------------------------------------------------- --set overrides

def test_overrides_parse_values_as_yaml(tmp_path):
    cfg = load_config(write(tmp_path, "training:\n  optimizer:\n    lr: 0.5\n"),
                      ["training.optimizer.lr=0.1", "model.hidden_sizes=[64,64]", "backend=chainer",
                       "data.root=", "training.optimizer={name: adam, eps: 1e-6}"])
    assert cfg.training.optimizer.lr == 0.1
    assert cfg.training.optimizer.name == "adam" and cfg.training.optimizer.eps == 1e-6
    assert cfg.model.hidden_sizes == (64, 64)
    assert cfg.backend == "chainer"
    assert cfg.data.root is None


def test_override_problems_name_set_instead_of_a_line(tmp_path):
    path = write(tmp_path, "training:\n  epochs: 2\n")
    problems = problems_of(path, ("training.optimzer.lr=0.1", "epochs", "training.epochs=-1", "lr=0.1"))
    by_key = {p.key: p for p in problems}
    assert all(p.file == "--set" and p.line is None for p in problems)
    assert "did you mean 'training.optimizer.lr'" in by_key["training.optimzer.lr"].message
    assert "must be key.path=value" in by_key["epochs"].message
    assert "must be an integer >= 1" in by_key["training.epochs"].message
    assert "did you mean 'training.optimizer.lr'" in by_key["lr"].message
    text = str(ConfigError(str(path), problems))
    assert "  --set: training.optimzer.lr: unknown key" in text


@pytest.mark.parametrize("given, meant", [("fp16", "float16"), ("half", "float16"), ("fp32", "float32"),
                                          ("float", "float32"), ("bf16", "bfloat16"), ("FP16", "float16")])
def test_other_names_of_a_dtype_are_refused_with_the_name_to_use(tmp_path, given, meant):
    path = write(tmp_path, f"precision:\n  dtype: {given}\n")
    problems = [str(p) for p in problems_of(path, ("device=gpu",))]
    assert problems == [f"{path}:2: precision.dtype: got '{given}'; must be one of: float32, float16, bfloat16 "
                        f"(did you mean '{meant}'?)",
                        "--set: device: got 'gpu'; must be one of: auto, cpu, cuda (did you mean 'cuda'?)"]
    section = problems_of(write(tmp_path, f"precision: {given}\n"))
    assert str(section[0]).endswith(f"(did you mean 'precision.dtype: {meant}'?)")


def test_override_below_a_value_is_a_problem(tmp_path):
    [problem] = problems_of(write(tmp_path, "{}"), ("training.epochs.max=3",))
    assert problem.file == "--set" and "training.epochs is a value" in problem.message


def test_file_and_override_problems_are_reported_together(tmp_path):
    path = write(tmp_path, "traning:\n  epochs: 2\n")
    problems = problems_of(path, ("model.name=resnet",))
    assert [(p.file, p.line, p.key) for p in problems] == [(str(path), 1, "traning"), ("--set", None, "model.name")]


def test_malformed_yaml_is_one_problem_with_its_line(tmp_path):
    path = write(tmp_path, "run:\n  name: x\n  seed: [1, 2\ntraining:\n  epochs: 3\n")
    [problem] = problems_of(path)
    assert problem.line is not None and problem.line >= 3
    assert "malformed YAML" in problem.message


# ---------------------------------------------------------------- programmatic use

def test_load_config_dict_uses_given_source_and_lines():
    with pytest.raises(ConfigError) as info:
        load_config_dict({"run": {"seed": "x"}}, source="cli", lines={"run.seed": 7})
    assert str(info.value.problems[0]) == "cli:7: run.seed: got 'x' (a string); must be an integer >= 0 and <= 4294967295"


# ---------------------------------------------------------------- property: only ConfigError, never a crash

def _paths(data: dict, prefix: tuple = ()) -> list[tuple]:
    found = []
    for key, value in data.items():
        found.append(prefix + (key,))
        if isinstance(value, dict):
            found.extend(_paths(value, prefix + (key,)))
    return found


_SCALARS = (st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=True)
            | st.text(max_size=8) | st.sampled_from(["1e-3", "nan", "adam", "dynamic", "-1", "3.0"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=3), max_leaves=6)
_MUTATIONS = st.lists(st.tuples(st.sampled_from(["set", "delete", "rename", "add"]), st.integers(0, 10**6),
                                _VALUES, st.text(max_size=8)), min_size=1, max_size=4)


def _mutate(data: dict, mutations: list) -> dict:
    data = copy.deepcopy(data)
    for kind, pick, value, name in mutations:
        paths = _paths(data)
        if not paths:
            data[name] = value
            continue
        *parents, key = paths[pick % len(paths)]
        node = data
        for parent in parents:
            node = node[parent]
        if kind == "set":
            node[key] = value
        elif kind == "delete":
            del node[key]
        elif kind == "rename":
            node[name] = node.pop(key)
        elif isinstance(node[key], dict):
            node[key][name] = value
        else:
            node[name] = value
    return data


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_MUTATIONS)
def test_any_mutation_gives_a_config_or_a_config_error(mutations):
    data = _mutate(to_dict(load_config_dict(yaml.safe_load(FULL_CONFIG))), mutations)
    try:
        cfg = load_config_dict(data)
    except ConfigError as err:
        assert err.problems and str(err).startswith("Invalid config <dict>")
    else:
        assert isinstance(cfg, ExperimentConfig)
