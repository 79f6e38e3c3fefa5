"""What a kill may leave behind: a torn metrics line does not stop the restart; an export killed while it is being
written leaves no temporary file behind; exported weights are as readable as their config.json (the umask)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.helpers.models import SMALL_MODEL
from tests.helpers.processes import REPO, subprocess_env
from vit_mpp.models.export import Export, read_export, write_export
from vit_mpp.models.vit import create_vit
from vit_mpp.run.metering.metrics_log import MetricsLog


def test_rewind_drops_a_line_torn_by_a_kill(tmp_path):
    # rewind once parsed every line with json.loads: a half-written last line made the restart die with a traceback.
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 2, "loss": 1.0}\n{"step": 4, "loss": 0.9}\n{"step": 6, "lo')
    MetricsLog(tmp_path, is_main=True).rewind(4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2, 4]
    path.write_text('{"step": 2}\n[1, 2]\n{"step": "x"}\n{"step": 3}\n')  # not records: dropped, never a traceback
    MetricsLog(tmp_path, is_main=True).rewind(10)
    assert path.read_text() == '{"step": 2}\n{"step": 3}\n'


def test_exported_weights_follow_the_umask_like_their_config(tmp_path):
    # safetensors' save_file wrote the weights with mode 0600 while config.json followed the umask (0644).
    previous = os.umask(0o022)
    try:
        out = write_export(Export(tmp_path / "export", create_vit(SMALL_MODEL).state_dict(), SMALL_MODEL,
                                  mean=(0.5,) * 3, std=(0.5,) * 3), kind="encoder")
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644}


KILLED_EXPORT = """
import sys, torch
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.export import Export, read_export, write_export
from vit_mpp.models.vit import create_vit
cfg = ModelConfig(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6)
state = create_vit(cfg).state_dict()
print("ready", flush=True)
while True:
    write_export(Export(sys.argv[1], state, cfg, mean=(0.5,) * 3, std=(0.5,) * 3), kind="encoder")
"""


def test_an_export_killed_while_writing_leaves_no_temporary_file(tmp_path):
    # A kill during safetensors' save_file left its 22 MB `.tmpXXXX` in the export folder forever.
    out = tmp_path / "export"
    expected = {"model.safetensors", "config.json", "model.safetensors.new", "config.json.new"}
    for delay in (0.15, 0.4, 0.8):
        child = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, str(out)], stdout=subprocess.PIPE, text=True,
                                 env=subprocess_env(), cwd=REPO)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        left = {p.name for p in out.iterdir()} if out.exists() else set()
        assert left <= expected, left - expected
    # Whatever the kill left, the next export completes and reads back.
    write_export(Export(out, create_vit(SMALL_MODEL).state_dict(), SMALL_MODEL, mean=(0.5,) * 3, std=(0.5,) * 3),
                 kind="encoder")
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json"}

    assert read_export(out).model.embed_dim == 32
