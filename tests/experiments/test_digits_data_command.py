"""The digits configs say how to make their data: the first command of each header (experiments/
pretrain_vs_scratch.py --data-only) builds the shards that the config, run as its header says, then reads. A dry
check: the command runs for real (in a temporary folder standing for the repository root) and each config's
data.shards then loads with its splits; no training."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from tests.helpers.processes import REPO, subprocess_env
from vit_mpp.config.engine import load_config
from vit_mpp.data.manifest import load_split

pytest.importorskip("sklearn")  # the dev extra; its bundled digits are the dataset

SCRIPT = REPO / "experiments" / "pretrain_vs_scratch.py"
CONFIGS = {"pretrain": (REPO / "configs" / "pretrain" / "digits.yaml", PretrainConfig),
           "finetune": (REPO / "configs" / "finetune" / "digits.yaml", FinetuneConfig)}


def header_commands(path: Path) -> list[list[str]]:
    """The commands in a config's opening comment (lines `#   python ...`), split as a shell splits them."""
    commands = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("#   python "):
            commands.append(shlex.split(line[1:]))
    return commands


def data_command(path: Path) -> list[str]:
    commands = header_commands(path)
    assert commands and commands[0][:2] == ["python", "experiments/pretrain_vs_scratch.py"], commands
    assert "--data-only" in commands[0]  # the data first, before any run that reads it
    return commands[0]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A folder standing for the repository root, where the header's data command has run."""
    commands = {tuple(data_command(path)) for path, _ in CONFIGS.values()}
    assert len(commands) == 1, commands  # both configs read the data of the same command
    root = tmp_path_factory.mktemp("root")
    argv = list(commands.pop())[2:]
    result = subprocess.run([sys.executable, str(SCRIPT), *argv, "--out", str(root / "runs/experiments/digits")],
                            capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_the_data_commands_default_place_is_where_the_configs_read():
    spec = importlib.util.spec_from_file_location("pretrain_vs_scratch_cli", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    default = script.build_parser().parse_args(["--data-only"]).out
    assert default == REPO / "runs" / "experiments" / "digits"
    for path, cls in CONFIGS.values():
        assert load_config(cls, path).data.shards.startswith("runs/experiments/digits/")


@pytest.mark.parametrize("stage", sorted(CONFIGS))
def test_the_header_data_command_makes_the_shards_the_config_reads(stage, root):
    path, cls = CONFIGS[stage]
    run = next(c for c in header_commands(path) if c[:3] == ["python", "-m", stage])
    cfg = load_config(cls, path, [a for a in run if "=" in a and not a.startswith("-")])
    shards = root / cfg.data.shards
    train, info = load_split(str(shards), cfg.data.train_split)
    val, _ = load_split(str(shards), cfg.data.val_split)
    assert val.num_samples == 360 and info["num_classes"] == 10
    assert train.num_samples == (1437 if stage == "pretrain" else 100)  # fine-tuning: 10 labels per digit


def test_the_experiment_is_a_call_of_compare_on_that_data(root):
    """The experiment's compare command passes compare's checks on the data its data command made: the pool is every
    training image (labelled, so the supervised arm runs), each seed fine-tunes on its own labelled subset, every
    arm is scored on the 360 validation images."""
    from experiments import compare

    spec = importlib.util.spec_from_file_location("pretrain_vs_scratch_cli", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    out = root / "runs/experiments/digits"
    args = script.build_parser().parse_args(["--seeds", "0", "--pretrain-steps", "300", "--out", str(out)])
    setup, _ = compare.check_args(script.compare_argv(args, out))
    assert setup.arms == ["scratch", "mpp", "scratch_equal", "supervised", "probe", "probe-avg"] and not setup.notes
    assert setup.labelled == str(out / "shards/labelled_k10_s{seed}") and setup.seeds == [0]
    assert (setup.test, setup.test_split, setup.test_samples) == (str(out / "shards/all"), "val", 360)
    assert setup.overrides == {"pretrain": ["train.steps=300"], "probe-avg.finetune": ["model.global_pool=avg"]}
