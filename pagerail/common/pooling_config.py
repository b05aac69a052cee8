"""What a model serves as a pooling model, read from its files: whether it is an encoder (which only pools), its
classification labels, and its default pooling and normalisation from sentence-transformers' files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagerail.common.json_flags import json_object

RUNNERS = ("auto", "generate", "pooling")
CONVERSIONS = ("auto", "embed", "classify")
POOLING_TYPES = ("last", "mean", "cls")
# Encoders: every token attends to every other, no next token to generate.
ENCODER_ARCHITECTURES = frozenset(
    {
        "BertModel",
        "XLMRobertaModel",
        "RobertaModel",
        "BertForSequenceClassification",
        "XLMRobertaForSequenceClassification",
        "RobertaForSequenceClassification",
    }
)
ENCODER_MODEL_TYPES = frozenset({"bert", "xlm-roberta", "roberta"})
# sentence-transformers' pooling modes (1_Pooling/config.json) → ours, in the order it gives them precedence.
_ST_MODES = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_mean_tokens", "mean"),
)


@dataclass(frozen=True)
class PoolingConfig:
    """`pooling_only`: the model serves embeddings, classification and scores, never generation (an encoder, or a
    causal LM under --runner pooling). `labels` (a classifier's, in logit order) are empty for an embedder."""

    pooling_only: bool = False
    encoder: bool = False
    default_pooling: str = "last"
    normalize: bool = True
    labels: tuple[str, ...] = field(default_factory=tuple)

    @property
    def classifies(self) -> bool:
        return bool(self.labels)


# A causal LM served as it is: it generates, and embeds with last-token pooling.
GENERATION_MODEL = PoolingConfig()


def pooler_overrides(text: str | None) -> dict[str, object]:
    """vLLM's --pooler-config, a JSON object such as {"pooling_type": "MEAN", "normalize": false}, as PoolingConfig
    fields; ValueError naming the flag and the key for anything else."""
    if text is None:
        return {}
    settings = json_object("pooler_config", text)
    unknown = set(settings) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"pooler_config takes pooling_type and normalize, got {', '.join(sorted(unknown))}")
    overrides: dict[str, object] = {}
    if "pooling_type" in settings:
        kind = str(settings["pooling_type"]).lower()
        if kind not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type must be one of LAST, MEAN, CLS, got {settings['pooling_type']!r}"
            )
        overrides["default_pooling"] = kind
    if "normalize" in settings:
        if not isinstance(settings["normalize"], bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {settings['normalize']!r}")
        overrides["normalize"] = settings["normalize"]
    return overrides


def read_pooling_config(
    model_dir: Path | None, runner: str = "auto", convert: str = "auto", pooler_config: str | None = None
) -> PoolingConfig:
    """The pooling facts of the model in `model_dir` (None: a generation model's defaults) under --runner,
    --convert and --pooler-config (which overrides the checkpoint's pooling and normalisation); ValueError naming
    the flag for a combination the model cannot serve."""
    overrides = pooler_overrides(pooler_config)
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERSIONS:
        raise ValueError(f"convert must be one of {', '.join(CONVERSIONS)}, got {convert!r}")
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        if runner == "pooling" or convert != "auto":
            raise ValueError("runner pooling and convert need a model directory with a config.json")
        return PoolingConfig(**overrides)
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    architecture = (config.get("architectures") or [""])[0]
    encoder = architecture in ENCODER_ARCHITECTURES or (
        not architecture and config.get("model_type") in ENCODER_MODEL_TYPES
    )
    classifier = architecture.endswith("ForSequenceClassification")
    if encoder and runner == "generate":
        raise ValueError(f"runner generate: {architecture or config.get('model_type')} is an encoder, it only pools")
    if convert == "classify" and not classifier:
        raise ValueError(
            "convert classify needs a checkpoint with a classification head (*ForSequenceClassification); "
            f"{architecture or 'this model'} has none"
        )
    if convert == "embed" and classifier:
        raise ValueError("convert embed: this checkpoint is a classifier; serve it as one (leave convert out)")
    labels: tuple[str, ...] = ()
    if classifier:
        count = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)
        names = config.get("id2label") or {}
        labels = tuple(str(names.get(str(i), f"LABEL_{i}")) for i in range(count))
    pooling, normalize = _sentence_transformers_pooling(model_dir)
    if pooling is None:
        pooling = "cls" if encoder else "last"
    settings = {"default_pooling": pooling, "normalize": normalize, **overrides}
    return PoolingConfig(
        pooling_only=encoder or runner == "pooling" or convert != "auto", encoder=encoder, labels=labels, **settings
    )


def _sentence_transformers_pooling(model_dir: Path) -> tuple[str | None, bool]:
    """The pooling sentence-transformers' files name (None without them), and whether they normalise (True when
    they do not say: an embedding is compared by cosine)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, True
    modules = json.loads(modules_file.read_text())
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            pooling_file = model_dir / str(module.get("path", "1_Pooling")) / "config.json"
            if pooling_file.is_file():
                settings = json.loads(pooling_file.read_text())
                for key, ours in _ST_MODES:
                    if settings.get(key):
                        return ours, normalize
    return None, normalize
