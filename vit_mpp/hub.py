"""Publishing an export: a model card written from what the export records, and the folder uploaded to the Hugging
Face Hub (`export.push_to_hub=OWNER/NAME`), where `timm.create_model("hf-hub:OWNER/NAME", pretrained=True)` loads it.

Access to the Hub is checked before training starts (offline, no token, unreachable: one line), so a run of days
does not fail at its last step. The upload itself runs once the export is written; if it fails then, the export
stays on disk and the error says how to upload it later.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from vit_mpp.config import ConfigError, ExportConfig
from vit_mpp.errors import UserError
from vit_mpp.export import read_export
from vit_mpp.training_curves import CURVES_NAME

CARD_NAME = "README.md"
FIGURES = ("curves.png", "analysis/position_similarity.png", "analysis/embedding_filters.png",
           "analysis/attention_distance.png", "analysis/attention_0_*.png")


class HubError(UserError):
    """The Hub cannot take the export (offline, no token, refused)."""


def check_hub(export: ExportConfig) -> None:
    """Before training: with `export.push_to_hub`, the Hub must be online, reachable, and a token known."""
    if not export.push_to_hub:
        return
    from huggingface_hub import HfApi, constants, get_token  # a dependency of timm and datasets

    what = f"export.push_to_hub={export.push_to_hub}"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{what} needs the Hugging Face Hub, but HF_HUB_OFFLINE is set: unset it, or drop "
                          "export.push_to_hub and upload the export folder later")
    if get_token() is None:
        raise ConfigError(f"{what} needs a Hugging Face token: run `hf auth login` or set HF_TOKEN")
    try:
        HfApi().whoami()
    except Exception as e:  # no network, a revoked token, the Hub down: many types
        raise ConfigError(f"{what}: the Hugging Face Hub cannot be reached with this token "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


def model_card(export_dir: str | Path, export: ExportConfig, title: str) -> str:
    """The README.md of an export: how to load it, the method and recipe, the data, the metrics, the figures."""
    export_dir = Path(export_dir)
    ex = read_export(export_dir)
    record, model = ex.record, ex.model
    kind = record.get("kind", "encoder")
    tags = ["vit-mpp", "timm", "vision-transformer", "masked-patch-prediction",
            "image-classification" if kind == "classifier" else "image-feature-extraction"]
    lines = ["---", "library_name: timm", "tags:", *(f"- {t}" for t in tags)]
    if export.license:
        lines.append(f"license: {export.license}")
    lines += ["---", "", f"# {title}", ""]
    params = sum(t.numel() for t in ex.state.values())
    what = (f"A {ex.num_classes}-class classifier fine-tuned" if kind == "classifier"
            else "A Vision Transformer encoder pretrained without labels by masked patch prediction")
    lines += [f"{what} with vit-mpp (the self-supervision of the ViT paper, Dosovitskiy et al. 2021, appendix "
              f"B.1.2): timm `{model.name}`, {params / 1e6:.2f}M parameters, input "
              f"{_size(model.img_size)}, {model.global_pool} pooling.", "", "## Use", "", "```python",
              "import timm",
              f'model = timm.create_model("hf-hub:{export.push_to_hub or "OWNER/NAME"}", pretrained=True)',
              "config = timm.data.resolve_data_config({}, model=model)  # input size, mean, std, crop",
              "```", "", f"Normalisation: mean {list(ex.mean)}, std {list(ex.std)}; evaluation crop {ex.crop_pct}."]
    if ex.class_names:
        names = ", ".join(ex.class_names[:20]) + (", ..." if len(ex.class_names) > 20 else "")
        lines += ["", f"Classes ({len(ex.class_names)}): {names}."]
    lines += ["", "## Training", ""]
    for section, heading in (("pretrain", "Pretraining (masked patch prediction)"), ("finetune", "Fine-tuning")):
        if record.get(section):
            lines += [f"{heading}:", "", *_table(record[section]), ""]
    data = record.get("data") or {}
    if data:
        lines += ["Data:", "", *_table({"shards": data.get("name") or data.get("shards"), "source": data.get("source"),
                                          **{f"{k} images": v for k, v in (data.get("splits") or {}).items()}}), ""]
    if record.get("metrics"):
        lines += ["## Results", "", *_table({k: round(v, 4) if isinstance(v, float) else v
                                             for k, v in record["metrics"].items()}), ""]
    figures = [p for pattern in FIGURES for p in sorted(export_dir.glob(pattern))]
    if figures:
        lines += ["## Figures", "", *(f"![{p.stem}]({p.relative_to(export_dir).as_posix()})" for p in figures), ""]
    return "\n".join(lines) + "\n"


def _size(img_size: Any) -> str:
    return f"{img_size}x{img_size}" if isinstance(img_size, int) else "x".join(str(s) for s in img_size)


def _table(values: dict[str, Any]) -> list[str]:
    rows = [(k, v) for k, v in values.items() if v not in (None, "", [], {})]
    return ["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]


def write_card(export_dir: str | Path, run_dir: str | Path, export: ExportConfig, title: str) -> Path:
    """Copy the run's curves.png into the export and write its README.md model card; returns the card's path."""
    export_dir, run_dir = Path(export_dir), Path(run_dir)
    if (run_dir / CURVES_NAME).is_file():
        shutil.copyfile(run_dir / CURVES_NAME, export_dir / CURVES_NAME)
    card = export_dir / CARD_NAME
    card.write_text(model_card(export_dir, export, title))
    return card


def draw_figures(export_dir: str | Path, shards: str) -> None:
    """The analysis figures for the card, through `python -m analysis` (a separate tool: called, not imported)."""
    export_dir = Path(export_dir)
    result = subprocess.run([sys.executable, "-m", "analysis", str(export_dir), "--shards", shards, "--num-images",
                             "8", "--num-maps", "2", "--out", str(export_dir / "analysis")],
                            capture_output=True, text=True)
    if result.returncode:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"warning: the analysis figures for the model card could not be drawn: {reason}", file=sys.stderr)


def publish(export_dir: str | Path, run_dir: str | Path, export: ExportConfig, shards: str,
            push_it: bool) -> str | None:
    """Write the export's model card; with `export.push_to_hub` and `push_it`, draw the analysis figures into it
    and upload it. Returns the repo URL when uploaded."""
    title = export.push_to_hub.split("/")[-1] if export.push_to_hub else str(run_dir)
    if export.push_to_hub and push_it:
        draw_figures(export_dir, shards)
    write_card(export_dir, run_dir, export, title)
    return push(export_dir, export) if export.push_to_hub and push_it else None


def push(export_dir: str | Path, export: ExportConfig) -> str:
    """Upload the export folder (weights, config.json, card, figures) to `export.push_to_hub`; returns its URL."""
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        repo = api.create_repo(export.push_to_hub, private=export.private, exist_ok=True).repo_id
        api.upload_folder(repo_id=repo, folder_path=str(export_dir), commit_message="vit-mpp export",
                          ignore_patterns=["*.new", "analysis/params.*", "analysis/summary.json"])
    except Exception as e:  # network, permissions, quota: the export is on disk either way
        raise HubError(f"the export is written to {export_dir}, but uploading it to {export.push_to_hub} failed "
                       f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); upload it later with "
                       f"`hf upload {export.push_to_hub} {export_dir}`") from None
    return f"https://huggingface.co/{repo}"
