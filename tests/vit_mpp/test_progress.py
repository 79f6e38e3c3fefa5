"""Progress on long work (vit_mpp/progress.py), as predict, evaluate, analysis and a run's evaluations show it: a rich
bar with rate and ETA on a terminal; plain lines without escape codes otherwise, and nothing at all for work shorter
than a period."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from rich.console import Console

from finetune import predict
from tests.helpers.models import SMALL_MODEL
from vit_mpp.models.export import Export, write_export
from vit_mpp.models.vit import create_vit
from vit_mpp.progress import format_duration, progress

ESC = "\x1b"


def test_on_a_terminal_a_bar_with_count_rate_and_eta():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with progress("labelling", 10, console=console) as advance:
        for _ in range(10):
            advance(1)
    text = out.getvalue()
    assert ESC in text and "labelling" in text and "10/10" in text and "images/s" in text
    assert "━" in text  # the bar itself


def test_without_a_terminal_plain_lines_and_no_escape_codes():
    out = io.StringIO()
    console = Console(file=out, width=120)  # a file, as a log or a pipe is
    with progress("labelling", 10, console=console, every_s=0) as advance:
        for _ in range(5):
            advance(2)
    lines = out.getvalue().splitlines()
    assert ESC not in out.getvalue()
    assert len(lines) == 5 and lines[0].startswith("labelling: 2/10 images (20%), ") and "eta " in lines[0]
    assert lines[-1].startswith("labelling: 10/10 images (100%)")
    quiet = io.StringIO()
    with progress("labelling", 10, console=Console(file=quiet)) as advance:  # the default period: 30 s
        advance(10)
    assert quiet.getvalue() == ""  # short work: nothing but the tool's own final line
    unknown = io.StringIO()
    with progress("reading", None, unit="batches", console=Console(file=unknown), every_s=0) as advance:
        advance(3)
    assert unknown.getvalue().startswith("reading: 3 batches, ") and ESC not in unknown.getvalue()
    assert format_duration(3725) == "1h02m" and format_duration(59) == "0m59s"


def test_predict_reports_nothing_but_its_own_lines_when_not_on_a_terminal(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = SMALL_MODEL
    export = write_export(Export(tmp_path / "export", create_vit(cfg, 3).state_dict(), cfg, num_classes=3,
                                 mean=(0.5,) * 3, std=(0.5,) * 3, class_names=["a", "b", "c"]), kind="classifier")
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    predict.main(["--checkpoint", str(export), "--images", *(str(tmp_path / f"{i}.png") for i in range(3)),
                  "--out", str(tmp_path / "preds.csv")])
    captured = capsys.readouterr()
    assert ESC not in captured.err + captured.out
    assert captured.err.strip().splitlines() == [f"labelled 3 of 3 images -> {tmp_path / 'preds.csv'}"]


def test_an_evaluation_counts_every_process_images_on_the_main_process_only(monkeypatch):
    # vit_mpp/run/metering/eval_progress.py: validation, the k-NN monitor and fine-tuning's evaluations; in a log, plain
    # lines
    from functools import partial
    from types import SimpleNamespace

    from vit_mpp.run.metering import eval_progress

    out = io.StringIO()
    monkeypatch.setattr(eval_progress, "progress", partial(progress, console=Console(file=out), every_s=0.0))
    batches = [{"valid": torch.tensor([True, True, False])}, {"valid": torch.tensor([True, False, False])}]
    main = SimpleNamespace(is_main_process=True, num_processes=2)
    with eval_progress.with_progress(main, batches, "validation (val)", 6) as shown:
        assert list(shown) == batches
    lines = out.getvalue().splitlines()
    assert [line.split(":")[1].split("(")[0].strip() for line in lines] == ["4/6 images", "6/6 images"]
    assert ESC not in out.getvalue()
    other = SimpleNamespace(is_main_process=False, num_processes=2)
    with eval_progress.with_progress(other, batches, "validation (val)", 6) as shown:
        assert shown is batches  # other processes show nothing
