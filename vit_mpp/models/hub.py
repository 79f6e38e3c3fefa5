"""Publishing an export: a model card written from what the export records, and the folder uploaded to the Hugging
Face Hub (`export.push_to_hub=OWNER/NAME`), where `timm.create_model("hf-hub:OWNER/NAME", pretrained=True)` loads it.

Access to the Hub is checked before training starts (offline, no token, unreachable: one line), so a run of days
does not fail at its last step. The upload itself runs once the export is written; if it fails then, the export
stays on disk and the error says how to upload it later.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vit_mpp.config.engine import ConfigError
from vit_mpp.config.sections import ExportConfig, ModelConfig
from vit_mpp.durable import writing
from vit_mpp.errors import UserError
from vit_mpp.models.export import read_export

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

CARD_NAME = "README.md"
CURVES_NAME = "curves.png"  # the training curves a card shows, copied from the run (vit_mpp/run/metering/curves.py)
FIGURES = (CURVES_NAME, "analysis/position_similarity.png", "analysis/embedding_filters.png",
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


CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ summary }}

## Use

```python
import timm

{% for line in loads %}{{ line }}
{% endfor %}config = timm.data.resolve_data_config({}, model=model)  # input size, mean, std, crop
```

Normalisation: mean {{ mean }}, std {{ std }}; evaluation crop {{ crop_pct }}.
{% if classes %}
Classes ({{ num_classes }}): {{ classes }}.
{% endif %}
## Training
{% for heading, rows in sections %}
{{ heading }}:

{{ rows }}
{% endfor %}{% if results %}
## Results

{{ results }}
{% endif %}{% if figures %}
## Figures

{% for name, path in figures %}![{{ name }}]({{ path }})
{% endfor %}{% endif %}"""
# Metrics that go into the card's model-index: metrics.jsonl key -> (metric type, name shown on the Hub).
INDEXED = {"classifier": {"val_top1": ("accuracy", "top-1 accuracy"), "val_top5": ("accuracy", "top-5 accuracy")},
           "encoder": {"knn_top1_cls": ("accuracy", "k-NN top-1 ([class] token)"),
                       "knn_top1_avg": ("accuracy", "k-NN top-1 (patch mean)"),
                       "val_acc": ("accuracy", "masked patch prediction accuracy (corrupted patches)")}}
SIZE_NAMES = re.compile(r"vit_(tiny|small|medium|base|large|huge|giant|gigantic)_patch")


def architecture_label(model: ModelConfig, patch: int) -> str:
    """`ViT-Tiny/16` for a model of the named size, `ViT/4 (width 128, 4 blocks, 4 heads)` for custom sizes."""
    from vit_mpp.models.vit import architecture

    named = SIZE_NAMES.match(model.name)
    actual = architecture(model)
    default = architecture(ModelConfig(name=model.name, img_size=model.img_size, patch_size=model.patch_size))
    if named and all(actual[k] == default[k] for k in ("embed_dim", "depth", "num_heads", "mlp_ratio")):
        return f"ViT-{named.group(1).capitalize()}/{patch}"
    blocks, heads = actual["depth"], actual["num_heads"]
    return (f"ViT/{patch} (width {actual['embed_dim']}, {blocks} block{'s' * (blocks != 1)}, "
            f"{heads} head{'s' * (heads != 1)})")


def data_label(data: dict[str, Any]) -> str:
    """What the shards are called: the Hub dataset they came from, else the manifest's name, else their folder."""
    return data.get("hf_dataset") or data.get("name") or Path(str(data.get("shards") or "?")).name


def card_title(ex: Any) -> str:
    """`ViT-Tiny/16 pretrained by masked patch prediction on <data>` or `... fine-tuned on <data> (K classes)`."""
    arch = architecture_label(ex.model, int(ex.state["patch_embed.proj.weight"].shape[-1]))
    data = data_label(ex.record.get("data") or {})
    if ex.record.get("kind", "encoder") == "classifier":
        return f"{arch} fine-tuned on {data} ({ex.num_classes} classes)"
    return f"{arch} pretrained by masked patch prediction on {data}"


def model_card(export_dir: str | Path, export: ExportConfig) -> ModelCard:
    """The model card of an export (huggingface_hub's ModelCard): metadata (library, tags, licence, datasets, base
    model, metrics as a model-index) and how to load it, the method and recipe, the data, the metrics, the figures."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    export_dir = Path(export_dir)
    ex = read_export(export_dir)
    record, model = ex.record, ex.model
    kind = record.get("kind", "encoder")
    data = record.get("data") or {}
    finetune = record.get("finetune") or {}
    pretrain = record.get("pretrain") or {}
    title = card_title(ex)
    task = "image-classification" if kind == "classifier" else "image-feature-extraction"
    datasets = [d for d in (data.get("hf_dataset"), pretrain.get("hf_dataset")) if d]
    metrics = record.get("metrics") or {}
    dataset_id = data.get("hf_dataset") or data_label(data)
    results = [EvalResult(task_type=task, dataset_type=dataset_id, dataset_name=data_label(data),
                          dataset_split=(data.get("val_split") or "val"), metric_type=metric_type, metric_name=name,
                          metric_value=round(float(metrics[key]), 4))
               for key, (metric_type, name) in INDEXED[kind].items() if isinstance(metrics.get(key), (int, float))]
    card_data = ModelCardData(
        library_name="timm", pipeline_tag=task, license=export.license or None, model_name=title,
        tags=["vit-mpp", "timm", "vision-transformer", "masked-patch-prediction", task],
        datasets=list(dict.fromkeys(datasets)) or None, base_model=finetune.get("base_model") or None,
        eval_results=results or None)
    params = sum(t.numel() for t in ex.state.values())
    what = (f"A {ex.num_classes}-class classifier fine-tuned" if kind == "classifier"
            else "A Vision Transformer encoder pretrained without labels by masked patch prediction")
    summary = (f"{what} with vit-mpp (the self-supervision of the ViT paper, Dosovitskiy et al. 2021, appendix "
               f"B.1.2): timm `{model.name}`, {params / 1e6:.2f}M parameters, input {_size(model.img_size)}, "
               f"{model.global_pool} pooling.")
    if finetune.get("step"):
        which = "the EMA of the weights" if finetune.get("weights") == "ema" else "the weights"
        summary += f" This export holds {which} at step {finetune['step']}."
    loads = [f'model = timm.create_model("local-dir:{export_dir}", pretrained=True)']
    if export.push_to_hub:
        loads = [f'model = timm.create_model("hf-hub:{export.push_to_hub}", pretrained=True)',
                 f'# or from the export folder it was uploaded from:\n# {loads[0]}']
    sections = [(heading, _table(record[key])) for key, heading in (
        ("pretrain", "Pretraining (masked patch prediction)"), ("finetune", "Fine-tuning")) if record.get(key)]
    if any(pretrain.get(key) for key in ("mixture", "val", "knn")):  # carried on from the export it started from
        sections += data_sections(pretrain, "Pretraining data")
    if data:
        sections += data_sections(data, "Data")
    figures = [(p.stem, p.relative_to(export_dir).as_posix()) for pattern in FIGURES
               for p in sorted(export_dir.glob(pattern))]
    classes = ", ".join(ex.class_names[:20]) + (", ..." if len(ex.class_names) > 20 else "") if ex.class_names else ""
    return ModelCard.from_template(
        card_data, template_str=CARD_TEMPLATE, title=title, summary=summary, loads=loads, mean=list(ex.mean),
        std=list(ex.std), crop_pct=ex.crop_pct, classes=classes, num_classes=len(ex.class_names or []),
        sections=sections, figures=figures,
        results=_table({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}) if metrics else "")


def mixture_table(sets: list[dict[str, Any]]) -> str:
    """A mixture set by set: its name, shards, weight (normalised), realised share (the share of the samples its
    steps took) and training images."""
    def number(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, (int, float)) else "not logged"

    rows = ["| set | shards | weight | realised share | training images |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| {m.get('name')} | {m.get('shards')} | {number(m.get('weight'))} | {number(m.get('share'))} | "
             f"{m.get('images', '')} |" for m in sets if isinstance(m, dict)]
    return "\n".join(rows)


def data_sections(data: dict[str, Any], heading: str) -> list[tuple[str, str]]:
    """The card's sections for a data record (an export's `data`, or a fine-tuned export's `pretrain`): the shards,
    or each set of a mixture; then which set and split validated the model and which fed the k-NN monitor."""
    sets = data.get("mixture") or []
    sections = [(f"{heading}: a mixture of {len(sets)} sets", mixture_table(sets))] if sets else []
    uses: dict[str, Any] = {}
    if not sets and "splits" in data:  # an export's own data record (a pretraining section names its data above)
        uses = {"shards": data_label(data), "source": data.get("source"),
                **{f"{k} images": v for k, v in (data.get("splits") or {}).items()}}
    val, knn = data.get("val") or {}, data.get("knn") or {}
    if val:
        uses["validated on"] = f"split '{val.get('split')}' of {val.get('set')} ({val.get('images')} images)"
    if knn:
        uses["k-NN monitor references"] = (f"the first {knn.get('images')} images of split '{knn.get('split')}' of "
                                           f"{knn.get('set')}")
    if uses:
        sections.append((heading if not sets else f"{heading}: validation{' and k-NN monitor' if knn else ''}",
                         _table(uses)))
    return sections


def _size(img_size: Any) -> str:
    return f"{img_size}x{img_size}" if isinstance(img_size, int) else "x".join(str(s) for s in img_size)


def _table(values: dict[str, Any]) -> str:
    rows = [(k, v) for k, v in values.items() if v not in (None, "", [], {}) and not isinstance(v, (dict, list))]
    return "\n".join(["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)])


def write_card(export_dir: str | Path, curves: Path, export: ExportConfig) -> Path:
    """Copy the run's training curves (`curves`, when drawn) into the export and write its README.md model card;
    returns the card's path."""
    export_dir = Path(export_dir)
    if curves.is_file():
        with writing(export_dir / CURVES_NAME):
            shutil.copyfile(curves, export_dir / CURVES_NAME)
    card = export_dir / CARD_NAME
    with writing(card):
        model_card(export_dir, export).save(card)
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


def publish(export_dir: str | Path, curves: Path, export: ExportConfig, shards: str, push_it: bool) -> str | None:
    """Write the export's model card (with the run's `curves`); with `export.push_to_hub` and `push_it`, draw the
    analysis figures into it and upload it. Returns the repo URL when uploaded."""
    if export.push_to_hub and push_it:
        draw_figures(export_dir, shards)
    write_card(export_dir, curves, export)
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
