"""Semi-supervised fine-tuning (`semi.pool`, finetune/semi.py): the pool read beside the labelled shards in one stream
(each set once per its epoch, resumed bit-identical after kill -9), its weak views and ignored labels, the
pseudo-label loss, and one line for every setting that cannot work."""

from __future__ import annotations

import collections
import json
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from finetune.__main__ import main as finetune_main
from finetune.config import SemiConfig
from finetune.loss import ClassificationLoss
from finetune.pool_gate import PoolGate
from finetune.semi import PseudoLabelLoss
from tests.helpers.processes import JOB_LAUNCH, Background, in_process, launch, run_module
from tests.helpers.runs import audit, read_metrics
from tests.helpers.shards import write_shard_set
from vit_mpp.config.engine import load_config
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.lineage import SplitOf, split_keys
from vit_mpp.data.manifest import load_split, read_manifest
from vit_mpp.data.stream import ReadSettings, TrainSet, TrainStream
from vit_mpp.data.stream_plan import Layout, first_generation
from vit_mpp.data.training_data import set_name

LABELLED, POOL = 24, 96  # the labelled set (tests/finetune/conftest.py `shards`) and the pool's training images


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Path:
    """96 images without labels in three shards, whose manifest says so: a pool as a user's unlabelled images would
    be."""
    out = write_shard_set(tmp_path_factory.mktemp("pool"), {"train": [30, 30, 36]}, seed=1,
                          labels={"train": [None] * POOL})
    manifest = json.loads((out / "_info.json").read_text())
    manifest.update(num_classes=0, class_names=[])  # what build-shards writes for images without labels
    (out / "_info.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> Path:
    """24 labelled training images (3 classes), 13 validation images."""
    return write_shard_set(tmp_path_factory.mktemp("labelled"), {"train": [12, 12], "val": [7, 6]})


def command(labelled: Path, pool: Path, init: Path, run_dir: Path, *extra: str) -> list[str]:
    """The semi-supervised fine-tuning of configs/finetune/tiny.yaml with two loader workers, RandAugment and colour
    jitter; a threshold just above chance (1/3), so that the random encoder's teacher passes it in a few steps."""
    return [sys.executable, "-m", "finetune", "--config", "configs/finetune/tiny.yaml", f"data.shards={labelled}",
            f"semi.pool={pool}", f"init.checkpoint={init}", f"train.run_dir={run_dir}", "train.ema_decay=0.9",
            "semi.threshold=0.34", "semi.ratio=3", "train.record_samples=true", "data.num_workers=2",
            "train.epochs=3", "train.log_every=1", "augment.auto_augment=rand-m9-mstd0.5-inc1",
            "augment.color_jitter=0.4", *extra]


def test_both_sets_are_read_once_per_epoch_and_a_kill_9_resumes_bit_identical(labelled, pool, pretrained, tmp_path):
    whole = Background(command(labelled, pool, pretrained, tmp_path / "whole"), tmp_path / "whole.log", "whole")
    whole.wait_gone(240)
    assert whole.proc.returncode == 0, whole.output()[-3000:]
    out = whole.output()
    assert "pool:test 96 images (75%, labels unused)" in out and "pseudo-labels from the EMA above 0.34" in out
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "whole") if "loss" in r}
    steps = max(losses)
    assert steps == 3 * (LABELLED * 4 // 8)  # an epoch is one pass over the labelled set (24 + 3 x 24 images)

    killed = Background(command(labelled, pool, pretrained, tmp_path / "killed"), tmp_path / "k1.log", "killed")
    killed.wait_for("step 11/")
    killed.kill()  # kill -9 of every process of the run: the last checkpoint (step 8) is what is left
    again = Background(command(labelled, pool, pretrained, tmp_path / "killed"), tmp_path / "k2.log", "again")
    again.wait_gone(240)
    assert again.proc.returncode == 0 and "resuming from" in again.output(), again.output()[-3000:]
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "killed") if "loss" in r}
    assert resumed == losses  # every step's loss, bit for bit, as the run that was not killed

    records = audit(tmp_path / "killed")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records == audit(tmp_path / "whole")
    assert epochs_of_each_set(tmp_path / "killed") == {"test": 3, "pool:test": 2}  # 3 x 72 pool images: 2.25 passes
    logged = [r for r in read_metrics(tmp_path / "killed") if "loss" in r]
    assert all(0 <= r["pseudo_kept"] <= 1 and "pseudo_acc" not in r for r in logged)  # the pool has no labels
    assert sum(r["pseudo_kept"] for r in logged) > 0  # the teacher grew confident: the pool trained the student
    # its pseudo-labels of the validation images, at the rule's thresholds of the moment, scored at each evaluation
    evaluations = [r for r in read_metrics(tmp_path / "whole") if "ema_val_top1" in r]
    assert evaluations and all(0 <= r["ema_val_pseudo_kept"] <= 1 and 0 <= r["ema_val_pseudo_acc"] <= 1
                               and "val_pseudo_kept" not in r for r in evaluations)
    poor, warned = poor_steps(evaluations), warned_at(out)
    assert warned == [str(poor[0])] if poor else not warned, (poor, warned)  # once, at the first


def poor_steps(evaluations: list[dict]) -> list[int]:
    """The steps of the evaluations whose teacher kept pseudo-labels of the validation images less than half right."""
    return [r["step"] for r in evaluations if r["ema_val_pseudo_kept"] > 0 and r["ema_val_pseudo_acc"] < 0.5]


def warned_at(output: str) -> list[str]:
    """The steps at which a run's output warned of a poor teacher."""
    return re.findall(r"warning: at step (\d+) the pool's teacher", output)


def epochs_of_each_set(run_dir: Path) -> dict[str, int]:
    """From the sample audit: no sample twice in an epoch of its set, and every epoch of a set but its last whole;
    returns how many whole epochs each set had."""
    seen: dict[tuple[str, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for record in audit(run_dir):
        for key, epoch, name in zip(record["keys"], record["epochs"], record["sets"]):
            seen[name, epoch][key] += 1
    assert all(max(c.values()) == 1 for c in seen.values())
    whole = {}
    for name, size in (("test", LABELLED), ("pool:test", POOL)):
        epochs = sorted(e for n, e in seen if n == name)
        assert epochs == list(range(len(epochs)))
        assert [len(seen[name, e]) for e in epochs[:-1]] == [size] * (len(epochs) - 1), name
        whole[name] = len(epochs) - (len(seen[name, epochs[-1]]) < size)
    return whole


def test_the_strong_view_and_adaptive_thresholds_resume_bit_identical_after_kill_9(labelled, pool, pretrained,
                                                                                     tmp_path):
    """FixMatch's strong view of the pool and FreeMatch's thresholds with alignment, through the real command: a run
    killed -9 and run again logs the same losses at every step as one that was not (the thresholds' running means come
    back from the checkpoint), and each log record has every class's threshold and share kept."""
    extra = ("semi.strong=rand-n2-m10-mstd101", "semi.strong_erasing=1", "semi.threshold_mode=freematch",
             "semi.align=true", "semi.momentum=0.9", "train.epochs=2")
    whole = Background(command(labelled, pool, pretrained, tmp_path / "whole", *extra), tmp_path / "w.log", "strong")
    whole.wait_gone(240)
    assert whole.proc.returncode == 0, whole.output()[-3000:]
    assert ("its own strong view (RandAugment rand-n2-m10-mstd101, erasing p=1), pseudo-labels from the EMA "
            "FreeMatch's adaptive thresholds (momentum 0.9), aligned to the uniform distribution") in whole.output()
    logged = [r for r in read_metrics(tmp_path / "whole") if "loss" in r]
    killed = Background(command(labelled, pool, pretrained, tmp_path / "killed", *extra), tmp_path / "k1.log", "k")
    killed.wait_for("step 11/")
    killed.kill()
    again = run_module(*command(labelled, pool, pretrained, tmp_path / "killed", *extra)[2:])
    assert again.returncode == 0 and "resuming from" in again.stdout, again.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(tmp_path / "killed") if "loss" in r] == [r["loss"] for r in logged]
    thresholds = [r["pseudo_class_threshold"] for r in logged]
    assert all(len(t) == 3 and all(0 < x <= 1 for x in t) for t in thresholds)
    assert thresholds[0] != thresholds[-1]  # they follow the teacher
    assert all(len(r["pseudo_class_kept"]) == 3 and len(r["pseudo_class_share"]) == 3 for r in logged)


@pytest.mark.slow
def test_two_processes_preempted_then_resumed_on_one_read_both_sets_once_per_epoch(labelled, pool, pretrained,
                                                                                   tmp_path):
    run_dir = tmp_path / "run"
    args = command(labelled, pool, pretrained, run_dir)[1:]  # -m finetune ...
    run = Background([*JOB_LAUNCH, *args, "train.epochs=1000", "train.eval_every_epochs=1000"], tmp_path / "log",
                     "semi2")
    run.wait_for("step 9/")
    run.signal_all(signal.SIGTERM)  # every process, as SLURM signals them
    run.wait_gone(60)
    out = run.output()
    step = int(re.search(r"preempted at step (\d+): checkpoint saved; run the same command to resume", out)[1])
    assert run.proc.returncode == 75 and out.count("preempted at step") == 1, out[-3000:]
    assert "Traceback" not in out and "frame #" not in out
    epochs = step // 12 + 2
    resumed = run_module(*args[1:], f"train.epochs={epochs}", "train.eval_every_epochs=1000")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "as 1 process x 2 workers x micro-batch 8" in resumed.stdout
    # no sample twice in an epoch of its set, every epoch but the last whole, across the layouts (a mixture's draws
    # are random: the run's last epoch may end a few labelled images short)
    assert epochs_of_each_set(run_dir)["test"] >= epochs - 1


def test_under_accelerate_launch_the_poor_teacher_warning_is_one_line_and_no_line_is_said_twice(
        labelled, pool, pretrained, tmp_path):
    # Every process's output, the launcher's included: the warning is the main process's, once, at the first
    # evaluation whose kept pseudo-labels are under half right (the metrics are reduced across the 2 processes)
    run_dir = tmp_path / "run"
    result = launch(*command(labelled, pool, pretrained, run_dir)[1:], timeout=400)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    evaluations = [r for r in read_metrics(run_dir) if "ema_val_top1" in r]
    assert len(evaluations) == 3 and all(r["val_samples"] == 13 for r in evaluations)
    poor = poor_steps(evaluations)
    assert poor, evaluations  # the random encoder's teacher: what this test is about
    assert warned_at(out) == [str(poor[0])], out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("step ")]
    assert len(lines) == len(set(lines)), out[-3000:]  # no line said twice (each rank its own would be)
    assert "error" not in out.lower() and "Traceback" not in out, out[-3000:]


def test_the_pool_leaves_the_workers_with_its_weak_view_and_without_labels(labelled, pool):
    """A pool image's `image` is its weak view through the augmentation; a labelled image's weak view is its image;
    the pool's labels are -1 and never checked against the classes."""
    data = DataConfig(shuffle_buffer=0, crop_scale=[0.5, 1.0])
    decoder = ImageDecoder.for_training(data, 16, augment=lambda x: 255 - x)
    sets = [TrainSet("test", load_split(labelled, "train")[0], 1.0),
            TrainSet("pool:test", load_split(pool, "train")[0], 5.0, labelled=False)]
    layout = Layout(1, 1, 12, 1)
    stream = TrainStream(sets, decoder, first_generation(layout, [LABELLED, POOL], 0), rank=0, resume_step=0,
                         read=ReadSettings(0, 0, 0.0, num_classes=3))
    batches = iter(stream)
    for _ in range(4):
        batch = next(batches)
        in_pool = torch.tensor([i == 1 for i in batch["set"]])
        assert torch.equal(batch["pool"], in_pool) and in_pool.any() and (~in_pool).any()
        assert torch.equal(batch["image"][in_pool], 255 - batch["weak"][in_pool])
        assert torch.equal(batch["image"][~in_pool], batch["weak"][~in_pool])
        assert (batch["label"][in_pool] == -1).all() and (batch["label"][~in_pool] >= 0).all()


def test_the_pools_own_strong_view_is_made_by_its_own_augmentation_in_the_workers(labelled, pool):
    """With `semi.strong` the pool's images go through their own augmentation (here x // 2) and the labelled images
    through theirs (255 - x): the pool's weak view is still the crop before it."""
    decoder = ImageDecoder.for_training(DataConfig(shuffle_buffer=0, crop_scale=[0.5, 1.0]), 16,
                                        augment=lambda x: 255 - x, pool_augment=lambda x: x // 2)
    sets = [TrainSet("test", load_split(labelled, "train")[0], 1.0),
            TrainSet("pool:test", load_split(pool, "train")[0], 5.0, labelled=False)]
    stream = TrainStream(sets, decoder, first_generation(Layout(1, 1, 12, 1), [LABELLED, POOL], 0), rank=0,
                         resume_step=0, read=ReadSettings(0, 0, 0.0, num_classes=3))
    plain = ImageDecoder.for_training(DataConfig(shuffle_buffer=0, crop_scale=[0.5, 1.0]), 16)
    unaugmented = next(iter(TrainStream(sets, plain, first_generation(Layout(1, 1, 12, 1), [LABELLED, POOL], 0),
                                        rank=0, resume_step=0, read=ReadSettings(0, 0, 0.0, num_classes=3))))
    batch = next(iter(stream))
    in_pool = batch["pool"]
    assert in_pool.any() and (~in_pool).any()
    assert torch.equal(batch["image"][in_pool], batch["weak"][in_pool] // 2)
    assert torch.equal(batch["weak"][in_pool], unaugmented["weak"][in_pool])  # the same crop, drawn alike
    assert torch.equal(batch["image"][~in_pool], 255 - unaugmented["image"][~in_pool])


def test_the_pools_strong_view_gets_its_erasing_and_none_of_the_labelled_augmentations():
    """Colour jitter (augment.*) on the labelled rows only; the pool's rows normalised, then erased (semi.strong_erasing
    1: every pool image has a rectangle at 0, the mean colour)."""
    cfg = load_config_for_loss()
    cfg.augment.color_jitter = 0.4
    labelled = ClassificationLoss(cfg, 3, 4, torch.device("cpu"), (0.5,) * 3, (0.5,) * 3)
    semi = SemiConfig(pool="x", strong_erasing=1.0)
    loss = PseudoLabelLoss(semi, labelled, type("Ema", (), {"module": None})(), Accelerator(cpu=True), 3)
    images = torch.randint(1, 255, (4, 3, 16, 16), dtype=torch.uint8)
    pool = torch.tensor([False, True, True, False])
    torch.manual_seed(0)
    got = loss.inputs({"image": images, "pool": pool})
    torch.manual_seed(0)
    jittered = labelled.inputs(images)
    plain = (images.float() / 255 - 0.5) / 0.5
    assert torch.equal(got[~pool], jittered[~pool])
    for row in (1, 2):
        erased = got[row] != plain[row]
        assert erased.any() and (got[row][erased] == 0).all()  # a rectangle of the mean colour, the rest as it was
    assert "its own strong view (erasing p=1)" in loss.describe()


def test_a_pool_with_labels_outside_the_classes_is_read_and_its_labels_dropped(labelled, tmp_path):
    """A labelled pool (a proxy experiment's) keeps the labels of the classes for the pseudo-label diagnostic; one
    outside them is no error there (it would be in data.shards)."""
    odd = write_shard_set(tmp_path / "odd", {"train": [12]}, labels={"train": [7, 1] * 6})
    decoder = ImageDecoder.for_training(DataConfig(shuffle_buffer=0), 16)
    sets = [TrainSet("test", load_split(labelled, "train")[0], 1.0),
            TrainSet("pool:odd", load_split(odd, "train")[0], 1.0, labelled=False)]
    stream = TrainStream(sets, decoder, first_generation(Layout(1, 1, 12, 1), [LABELLED, 12], 0), rank=0,
                         resume_step=0, read=ReadSettings(0, 0, 0.0, num_classes=3))
    batch = next(iter(stream))
    assert sorted(set(batch["label"][batch["pool"]].tolist())) == [-1, 1]


def loss_of(threshold: float, teacher_logits: torch.Tensor, weight: float = 2.0) -> tuple[PseudoLabelLoss, dict]:
    cfg = load_config_for_loss()
    labelled = ClassificationLoss(cfg, 3, 4, torch.device("cpu"), (0.5,) * 3, (0.5,) * 3)

    class Teacher(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return teacher_logits

    ema = type("Ema", (), {"module": Teacher()})()
    semi = SemiConfig(pool="x", threshold=threshold, weight=weight)
    loss = PseudoLabelLoss(semi, labelled, ema, Accelerator(cpu=True), 3, pool_labelled=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 3))
    batch = {"image": torch.randint(0, 256, (4, 3, 4, 4), dtype=torch.uint8),
             "weak": torch.zeros(4, 3, 4, 4, dtype=torch.uint8), "pool": torch.tensor([False, True, True, True]),
             "label": torch.tensor([2, 0, -1, 1])}
    return loss, {"out": loss(model, batch), "model": model, "batch": batch}


def load_config_for_loss():
    from finetune.config import FinetuneConfig

    return load_config(FinetuneConfig, "configs/finetune/tiny.yaml", [])


def test_the_pool_learns_the_teachers_confident_labels_and_nothing_below_the_threshold():
    teacher = torch.tensor([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.1]])
    _, got = loss_of(0.9, teacher)
    model, batch = got["model"], got["batch"]
    logits = model((batch["image"].float() / 255 - 0.5) / 0.5).float()
    supervised = F.cross_entropy(logits[:1], torch.tensor([2]))
    pseudo = F.cross_entropy(logits[1:3], torch.tensor([0, 1]), reduction="sum") / 3  # rows 1, 2 kept; 3 of the pool
    assert got["out"]["loss"].item() == pytest.approx((supervised + 2.0 * pseudo).item(), rel=1e-5)
    metrics = got["out"]["metrics"]
    assert metrics["pseudo_kept"].item() == pytest.approx(2 / 3)
    assert metrics["pseudo_acc"].item() == 1.0  # row 1's pseudo-label 0 is its label; row 2's label is unknown
    _, none_kept = loss_of(0.999, teacher)
    assert none_kept["out"]["loss"].item() == pytest.approx(supervised.item(), rel=1e-5)
    assert none_kept["out"]["metrics"]["pseudo_kept"].item() == 0


def test_a_threshold_above_what_a_smoothed_teacher_predicts_is_warned_of():
    loss, _ = loss_of(0.95, torch.zeros(4, 3))
    loss.labelled.label_smoothing = 0.1  # on 10 classes the teacher's top probability settles near 0.91
    assert loss.warning(10) == ("warning: semi.threshold 0.95 is above 0.91, the top probability of a teacher trained "
                                "with train.label_smoothing=0.1 on 10 classes: few pool images, if any, will train "
                                "the student")
    loss.semi.threshold = 0.9
    assert loss.warning(10) is None
    loss.labelled.label_smoothing = 0.0
    loss.semi.threshold = 1.0
    assert loss.warning(10) is None  # without smoothing the teacher can come as close to 1 as it likes


@pytest.mark.parametrize("settings, says", [
    ([], "error: config key 'semi.pool' the pool's labels come from the model's EMA (the teacher): set "
         "train.ema_decay (e.g. 0.999 for a short run, Semi-ViT: 0.9999)"),
    (["train.ema_decay=0.9", "augment.mixup=0.8"],
     "error: config key 'semi.pool' mixup and cutmix would mix labelled and pool images in a batch: set "
     "augment.mixup=0 and augment.cutmix=0"),
    (["train.ema_decay=0.9", "semi.ratio=0"], "error: config key 'semi.ratio' must be > 0, got 0.0"),
    (["train.ema_decay=0.9", "semi.strong=rand-x9"], "error: config key 'semi.strong' must be '' or a timm "
                                                      "RandAugment string"),
    (["train.ema_decay=0.9", "semi.strong_erasing=1.5"], "error: config key 'semi.strong_erasing' must be in [0, 1]"),
    (["train.ema_decay=0.9", "semi.threshold_mode=adaptive"], "error: config key 'semi.threshold_mode' expects one "
                                                              "of 'fixed' | 'freematch', got 'adaptive'"),
    (["train.ema_decay=0.9", "semi.momentum=1"], "error: config key 'semi.momentum' must be in [0, 1)"),
    (["train.ema_decay=0.9", "semi.gate=1.5"], "error: config key 'semi.gate' must be in [0, 1]"),
    (["train.ema_decay=0.9", "semi.gate=0.5", "data.val_split="],
     "error: config key 'semi.gate' opens the pool when an evaluation finds the teacher's pseudo-labels of the "
     "validation split mostly right, and data.val_split is empty: give a validation split (data.val_shards, "
     "data.val_split), or set semi.gate=0"),
    (["train.ema_decay=0.9", "semi.gate=0.5", "data.val_split=train"],  # it would judge the teacher on what it learned
     "error: config key 'semi.gate': the validation split ('train' of test) holds the shard "),
])
def test_a_setting_that_cannot_work_is_one_line_before_anything_is_written(labelled, pool, pretrained, tmp_path,
                                                                          capsys, settings, says):
    code, _, err = in_process(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={labelled}",
                                              f"semi.pool={pool}", f"init.checkpoint={pretrained}",
                                              f"train.run_dir={tmp_path / 'run'}", *settings], capsys)
    assert code == 2 and err.strip().startswith(says) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_cannot_change_how_the_pool_is_thresholded(labelled, pool, pretrained, tmp_path, capsys):
    """The thresholds' running means are in the checkpoint only with freematch or alignment: changing either on a
    run to resume is one line, and the run directory is left as it was."""
    from tests.helpers.runs import run_tiny_finetune

    run_dir = tmp_path / "run"
    run_tiny_finetune(labelled, run_dir, pretrained, f"semi.pool={pool}", "train.ema_decay=0.9", "train.epochs=1",
                      "train.ckpt_every=1")
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for change in ("semi.threshold_mode=freematch", "semi.align=true"):
        code, _, err = in_process(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={labelled}",
                                                  f"semi.pool={pool}", f"init.checkpoint={pretrained}",
                                                  f"train.run_dir={run_dir}", "train.ema_decay=0.9",
                                                  "train.epochs=2", "train.extend=true", "data.num_workers=0",
                                                  change], capsys)
        key = change.split("=")[0]
        assert code == 2 and len(err.strip().splitlines()) == 1 and "a resumed run cannot change" in err, err
        assert key in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_a_pool_list_naming_a_set_twice_is_one_line(labelled, pool, pretrained, tmp_path, capsys):
    code, _, err = in_process(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={labelled}",
                                              f"semi.pool=[{pool},{pool}]", "train.ema_decay=0.9",
                                              f"init.checkpoint={pretrained}", f"train.run_dir={tmp_path / 'run'}"],
                              capsys)
    assert code == 2 and err.startswith("error: config key 'semi.pool' names a set twice: "), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("where, says", [
    ("nowhere", "error: "),  # the manifest's own error, naming the path
    ("labelled/", "error: config key 'semi.pool': "),  # the labelled set again, named another way
])
def test_a_pool_that_cannot_be_read_or_is_the_labelled_set_is_one_line(labelled, pretrained, tmp_path, capsys,
                                                                       where, says):
    location = f"{labelled}/" if where == "labelled/" else str(tmp_path / where)
    code, _, err = in_process(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={labelled}",
                                              f"semi.pool={location}", "train.ema_decay=0.9",
                                              f"init.checkpoint={pretrained}", f"train.run_dir={tmp_path / 'run'}"],
                              capsys)
    assert code == 2 and err.startswith(says) and location.rstrip("/") in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
    if where == "labelled/":
        assert "give it shards of its own" in err


def test_a_run_records_the_pool_in_its_export(labelled, pool, pretrained, tmp_path):
    run_dir = tmp_path / "run"
    from tests.helpers.runs import run_tiny_finetune

    run_tiny_finetune(labelled, run_dir, pretrained, f"semi.pool={pool}", "train.ema_decay=0.9", "train.epochs=1")
    record = json.loads((run_dir / "export" / "config.json").read_text())["vit_mpp"]["data"]
    mixture = {m["name"]: m for m in record["mixture"]}
    assert mixture["pool:test"]["pool"] is True and "pool" not in mixture["test"]
    assert mixture["pool:test"]["weight"] == pytest.approx(5 / 6)
    assert record["val"]["set"] == "test"




def losses_and_gate(run_dir: Path) -> tuple[list[float], list[float], dict[int, float]]:
    """A run's loss and `pool_on` at every step, and its teacher's `ema_val_pseudo_acc` at every evaluation."""
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    evaluations = {r["step"]: r["ema_val_pseudo_acc"] for r in read_metrics(run_dir) if "ema_val_top1" in r}
    return [r["loss"] for r in steps], [r.get("pool_on") for r in steps], evaluations


def test_the_gate_keeps_the_pool_out_until_an_evaluation_finds_the_teacher_right_enough(labelled, pool, pretrained,
                                                                                         tmp_path):
    """Through the real command: closed, a run is the same run with semi.weight=0, step for step, bit for bit; it
    opens at the evaluation whose estimate reaches semi.gate, says so in one line instead of the poor-teacher warning,
    and a run killed -9 while open resumes open (the gate is in the checkpoint)."""
    off = run_module(*command(labelled, pool, pretrained, tmp_path / "off", "semi.weight=0")[2:])
    assert off.returncode == 0, off.stderr[-3000:]
    weightless = losses_and_gate(tmp_path / "off")[0]
    never = run_module(*command(labelled, pool, pretrained, tmp_path / "never", "semi.gate=0.9",
                                "train.eval_every_epochs=2")[2:])  # evaluated less often: training is the same
    assert never.returncode == 0 and "pool: on" not in never.stdout, never.stderr[-3000:]
    assert "off until an evaluation says so" in never.stdout  # the start-up summary
    assert "warning: semi.gate decides at evaluations, and the first is at step 24 of 36" in never.stderr
    losses, on, evaluations = losses_and_gate(tmp_path / "never")
    assert losses == weightless and set(on) == {0.0} and max(evaluations.values()) < 0.9
    assert sorted(evaluations) == [24, 36]

    gated = ("semi.gate=0.3",)  # the random encoder's teacher is 31% right at every evaluation (4 of 13 images)
    whole = run_module(*command(labelled, pool, pretrained, tmp_path / "whole", *gated)[2:])
    assert whole.returncode == 0, whole.stderr[-3000:]
    losses, on, evaluations = losses_and_gate(tmp_path / "whole")
    assert sorted(evaluations) == [12, 24, 36] and min(evaluations.values()) >= 0.3
    assert on == [0.0] * 12 + [1.0] * 24  # off until the first evaluation (step 12), on from the next step
    assert losses[:12] == weightless[:12] and losses[12] != weightless[12]
    said = [ln for ln in (whole.stdout + whole.stderr).splitlines() if ln.startswith("pool: ")]
    assert said == ["pool: on after step 12: the teacher would keep 100% of the validation images with pseudo-labels "
                    "31% right (at least semi.gate 0.3)"], said
    assert not warned_at(whole.stdout + whole.stderr)  # 31% right: ungated, the run would have warned

    killed = Background(command(labelled, pool, pretrained, tmp_path / "killed", *gated), tmp_path / "k.log", "k")
    killed.wait_for("step 19/")
    killed.kill()  # the last checkpoint is step 16's, taken with the gate open
    again = run_module(*command(labelled, pool, pretrained, tmp_path / "killed", *gated)[2:])
    assert again.returncode == 0 and "resuming from" in again.stdout, again.stderr[-3000:]
    assert losses_and_gate(tmp_path / "killed")[:2] == (losses, on)
    assert "pool: on" not in again.stdout  # it resumed open: nothing changed to say


@pytest.mark.slow
def test_under_accelerate_launch_the_gate_opens_on_both_processes_at_once_and_says_so_once(labelled, pool,
                                                                                          pretrained, tmp_path):
    run_dir = tmp_path / "run"
    result = launch(*command(labelled, pool, pretrained, run_dir, "semi.gate=0.3")[1:], timeout=400)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    _, on, evaluations = losses_and_gate(run_dir)
    first = min(evaluations)
    assert evaluations[first] >= 0.3 and on == [0.0] * first + [1.0] * (len(on) - first)
    assert len([ln for ln in out.splitlines() if ln.startswith("pool: on after step")]) == 1, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("step ")]
    assert len(lines) == len(set(lines)) and not warned_at(out), out[-3000:]
    assert "error" not in out.lower() and "Traceback" not in out, out[-3000:]


def test_the_gate_opens_and_closes_with_each_evaluation_and_says_so_each_time():
    gate = PoolGate.resumed(0.5, {})
    assert not gate.open and gate.state() == {"pool_open": False}
    assert gate.update({"val_pseudo_kept": 0.4, "val_pseudo_acc": 0.49}, 10, 100) is None  # closed: nothing to say
    assert gate.update({"val_pseudo_kept": 0.4, "val_pseudo_acc": 0.5}, 20, 100) == (
        "pool: on after step 20: the teacher would keep 40% of the validation images with pseudo-labels 50% right "
        "(at least semi.gate 0.5)")
    assert gate.open and gate.update({"val_pseudo_kept": 0.9, "val_pseudo_acc": 0.8}, 30, 100) is None
    assert gate.update({"val_pseudo_kept": 0.0, "val_pseudo_acc": 0.0}, 40, 100) == (
        "pool: off after step 40: the teacher would keep none of the validation images (under semi.gate 0.5)")
    assert gate.update({"val_pseudo_kept": 0.5, "val_pseudo_acc": 0.5}, 100, 100) == (
        "pool: on after step 100: the teacher would keep 50% of the validation images with pseudo-labels 50% right "
        "(at least semi.gate 0.5); the run ends here")  # measured at a 1,200-step run's last evaluation
    assert gate.state() == {"pool_open": True}  # kept for a run extended from its last checkpoint
    assert PoolGate.resumed(0.5, {"pool_open": True}).open  # as the checkpoint left it
    ungated = PoolGate.resumed(0.0, {"pool_open": False})
    assert ungated.open and ungated.state() == {} and ungated.describe() == ""
    assert ungated.update({"val_pseudo_kept": 1.0, "val_pseudo_acc": 0.0}, 5, 100) is None and ungated.open
    assert gate.late_warning(1000, 1200) == (
        "warning: semi.gate decides at evaluations, and the first is at step 1000 of 1200: the pool can train in the "
        "last 200 steps at most (a lower train.eval_every_epochs evaluates sooner)")
    assert gate.late_warning(None, 1200) is not None  # no evaluation but the last: the pool never trains
    assert gate.late_warning(600, 1200) is None and ungated.late_warning(1000, 1200) is None


def test_a_closed_gate_leaves_the_labelled_loss_alone_and_says_so_in_the_metrics():
    teacher = torch.tensor([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.1]])
    loss, got = loss_of(0.9, teacher)
    assert "pool_on" not in got["out"]["metrics"]  # ungated
    loss.gate = PoolGate.resumed(0.5, {})
    closed = loss(got["model"], got["batch"])
    _, weightless = loss_of(0.9, teacher, weight=0.0)
    assert closed["loss"].item() == weightless["out"]["loss"].item() < got["out"]["loss"].item()
    assert closed["metrics"]["pool_on"] == 0 and closed["metrics"]["pseudo_kept"].item() == pytest.approx(2 / 3)
    loss.gate.open = True
    opened = loss(got["model"], got["batch"])
    assert opened["loss"].item() == got["out"]["loss"].item() and opened["metrics"]["pool_on"] == 1


def test_semi_settings_without_a_pool_are_named_in_one_warning(labelled, pretrained, tmp_path, capsys):
    # a user who set the gate or the strong view and forgot the pool would otherwise measure plain fine-tuning
    base = ["--config", "configs/finetune/tiny.yaml", "--dry-run", f"data.shards={labelled}",
            f"init.checkpoint={pretrained}", f"train.run_dir={tmp_path / 'run'}"]
    code, _, err = in_process(finetune_main, [*base, "semi.gate=0.5", "semi.strong=rand-n2-m10-mstd101"], capsys)
    warned = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert code == 0 and warned == ["warning: semi.gate, semi.strong set without semi.pool: this run fine-tunes on the "
                                    "labels alone, and they do nothing"], err
    code, _, err = in_process(finetune_main, base, capsys)
    assert code == 0 and "semi." not in err, err


def test_a_gate_whose_validation_subset_shares_images_with_the_labelled_subset_is_one_line(labelled, pool, pretrained,
                                                                                          tmp_path, capsys):
    # the earlier gate runs drew their validation images from the source the labels came from, without --exclude:
    # 3 and 5 of 20 training images were among them, in shards of their own that a shard check cannot tell apart
    from data_tools.cli import main as build_main

    def draw(out: Path, seed: int, *more: str) -> Path:
        assert in_process(build_main, ["subset", str(labelled), str(out), "--per-class", "5", "--seed", str(seed),
                                       *more], capsys)[0] == 0
        return out

    train = draw(tmp_path / "train", 0)
    run = ["--config", "configs/finetune/tiny.yaml", f"data.shards={train}", f"semi.pool={pool}", "train.ema_decay=0.9",
           f"init.checkpoint={pretrained}", f"train.run_dir={tmp_path / 'run'}", "semi.gate=0.5",
           "data.val_split=train", "--dry-run"]
    for val, n in [(draw(tmp_path / "val", 1), None), (labelled, 15)]:
        n = n or len(split_keys(SplitOf(str(val), "train", read_manifest(val)))
                     & split_keys(SplitOf(str(train), "train", read_manifest(train))))
        assert n  # seeds 0 and 1 draw 15 of the 24 images each: they share some
        code, _, err = in_process(finetune_main, [*run, f"data.val_shards={val}"], capsys)
        name = set_name(str(val), read_manifest(val))
        assert code == 2 and err.strip().splitlines() == [
            f"error: config key 'semi.gate': the validation split ('train' of {name}) holds {n} of the 15 images "
            "the run trains on (train, drawn from the same source), so the gate would judge the teacher on images it "
            "learned: give a validation set of its own (build-shards subset SOURCE VAL --per-class K --exclude "
            "LABELLED, then data.val_shards=VAL data.val_split=train)"], err
    apart = draw(tmp_path / "apart", 1, "--exclude", str(train), "--per-class", "3")
    code, out, err = in_process(finetune_main, [*run, f"data.val_shards={apart}"], capsys)
    assert code == 0 and "would start a new run" in out, err
    assert not (tmp_path / "run").exists()
