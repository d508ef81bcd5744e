"""Publishing tuned drafters: a reloadable folder with a measured model card, then (optionally) the Hub.

    pyramid-sd publish --model runs/draft --repo-id ORG/NAME --output-dir runs/publish --results runs/acc/acceptance.json

builds OUT (safetensors weights or a PEFT adapter, config, tokenizer, generation_config.json carrying the
tuned pyramid knobs under ``pyramid``, and README.md rendered from ``model_cards/drafter.md.j2`` with numbers
copied from the results files) and prints what would be uploaded; ``--push`` creates the repo and uploads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .config import PyramidConfig
from .feature_draft import is_feature_folder
from .vocab_head import SIDECAR, load_reduced_vocab

logger = logging.getLogger("pyramid_hf")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEMPLATE = ROOT / "model_cards" / "drafter.md.j2"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
ROLES = ("draft", "qualifier")


@dataclass
class PublishArgs:
    model: str = field(metadata={"help": "folder of the tuned model (save_pretrained output or a PEFT adapter)"})
    repo_id: str = field(metadata={"help": "Hub repository, ORG/NAME"})
    output_dir: str = field(metadata={"help": "where the complete, reloadable folder is written"})
    results: list[str] = field(default_factory=list, metadata={
        "help": "acceptance.json (eval-acceptance) and/or results.json (bench) whose numbers go into the card"})
    push: bool = field(default=False, metadata={"help": "create the repo and upload (default: dry run)"})
    private: bool = field(default=False, metadata={"help": "create the repo private (with --push)"})
    overwrite: bool = field(default=False, metadata={"help": "replace a non-empty --output_dir"})
    role: str = field(default="draft", metadata={"help": f"the model's level in the pyramid: {ROLES}"})
    base_model: str | None = field(default=None, metadata={"help": "Hub id of the model it was derived from"})
    teacher: str | None = field(default=None, metadata={"help": "Hub id of the model it was distilled toward"})
    target: str | None = field(default=None, metadata={"help": "Hub id of the pyramid's target"})
    qualifier: str | None = field(default=None, metadata={"help": "Hub id of the pyramid's qualifier (for a draft)"})
    recipe: str | None = field(default=None, metadata={"help": "recipe YAML it was trained with"})
    license: str | None = field(default=None, metadata={"help": "license id, inherited from the base model"})
    datasets: list[str] = field(default_factory=list, metadata={"help": "training datasets (card metadata)"})
    template: str | None = field(default=None, metadata={"help": "Jinja card template (default model_cards/drafter.md.j2)"})

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {ROLES}, got {self.role!r}")
        parts = self.repo_id.split("/")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"--repo_id must look like ORG/NAME, got {self.repo_id!r}")


# ---------------------------------------------------------------------------- the folder


def check_model_folder(folder: Path) -> str:
    """'model' or 'adapter'; refuses pickled weights and folders without safetensors."""
    if not folder.is_dir():
        raise FileNotFoundError(f"--model {folder} is not a folder")
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ValueError(f"refusing pickled weights in {folder}: {pickled}; save with safetensors "
                         "(model.save_pretrained(dir), the default) and publish that folder")
    if not any(p.suffix == ".safetensors" for p in folder.iterdir()):
        raise ValueError(f"{folder} holds no .safetensors weights")
    if (folder / "adapter_config.json").is_file():
        return "adapter"
    if (folder / "config.json").is_file():
        return "model"
    raise ValueError(f"{folder} has neither config.json (a model) nor adapter_config.json (a PEFT adapter)")


def prepare_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"--output_dir {out} is not empty; pass --overwrite to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def copy_model_files(src: Path, out: Path) -> list[str]:
    """Every plain file but the old card; sub-folders (e.g. checkpoints) are left behind."""
    copied = []
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name != "README.md" and not path.name.startswith("."):
            shutil.copy2(path, out / path.name)
            copied.append(path.name)
        elif path.is_dir():
            logger.info("not publishing sub-folder %s", path.name)
    return copied


def write_generation_config(src: Path, out: Path, knobs: dict) -> None:
    """generation_config.json with the tuned knobs under ``pyramid`` (and the draft length Transformers reads)."""
    from transformers import GenerationConfig

    if (src / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(src)
    elif (src / "config.json").is_file():
        from transformers import AutoConfig

        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(src))
    else:
        gen = GenerationConfig()
    gen.pyramid = dict(knobs)
    gen.num_assistant_tokens = int(knobs["draft_tokens"])
    gen.save_pretrained(out)


def stored_knobs(src: Path) -> dict:
    path = src / "generation_config.json"
    if path.is_file():
        return dict(json.loads(path.read_text()).get("pyramid") or {})
    return {}


# ---------------------------------------------------------------------------- the card


def measurement_sections(paths: list[str]) -> list[dict]:
    """One card section per results file, its table rendered from the file (never typed by hand)."""
    from .bench.report import load_results, markdown_table
    from .eval_acceptance import KIND, load_report, markdown

    sections = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"--results {path} does not exist")
        try:
            kind = json.loads(path.read_text()).get("kind")
        except (json.JSONDecodeError, AttributeError) as error:
            raise ValueError(f"--results {path} is not a JSON object: {error}") from None
        if kind == KIND:
            config, result = load_report(path)
            table = markdown(config, result).split("\n", 2)[2].strip()  # drop the report's own title
            sections.append({"title": f"Acceptance: {config['student']} -> {config['teacher']}", "source": path.name,
                             "command": config.get("command"), "table": table,
                             "metrics": {"mean_accepted_tokens": result["mean_accepted_tokens"],
                                         "acceptance_exact_greedy": result.get("acceptance_exact_greedy")}})
        else:
            config, records = load_results(path)
            table = markdown_table(config, records).split("\n", 2)[2].strip()
            sections.append({"title": f"Benchmark: {config.get('preset') or 'explicit models'} on "
                             f"{config.get('dataset', '?')} {config.get('split', '')}", "source": path.name,
                             "command": config.get("command"), "table": table})
    return sections


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def render_card(args: PublishArgs, knobs: dict, weights: str, sections: list[dict]):
    """A huggingface_hub `ModelCard` with valid metadata and the measured sections."""
    from huggingface_hub import ModelCard, ModelCardData

    template = Path(args.template or os.environ.get("PYRAMID_HF_CARD_TEMPLATE") or DEFAULT_TEMPLATE)
    if not template.is_file():
        raise FileNotFoundError(f"model card template {template} not found; pass --template")
    tags = ["speculative-decoding", "pyramid-speculative-decoding", f"pyramid-{args.role}", "pyramid-hf"]
    data = ModelCardData(
        base_model=args.base_model, library_name="peft" if weights.startswith("PEFT") else "transformers",
        pipeline_tag="text-generation", tags=tags, datasets=args.datasets or None, license=args.license,
    )
    return ModelCard.from_template(
        data, template_path=str(template), model_name=args.repo_id.split("/")[1], repo_id=args.repo_id,
        role=args.role, base_model=args.base_model, teacher=args.teacher, target=args.target,
        qualifier=args.qualifier, recipe=args.recipe, commit=git_commit(), weights=weights, knobs=knobs,
        measurements=sections, license=args.license,
    )


# ---------------------------------------------------------------------------- the Hub


def push_folder(folder: Path, repo_id: str, private: bool) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder``; clear errors offline, logged out, or unreachable."""
    from huggingface_hub import HfApi, constants, get_token

    from .models.loading import hub_offline, hub_reachable

    if hub_offline():
        raise RuntimeError("HF_HUB_OFFLINE=1: cannot push to the Hub; unset it, or publish without --push")
    token = get_token()
    if not token:
        raise RuntimeError("not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN")
    if not hub_reachable():
        raise RuntimeError(f"cannot reach the Hub at {constants.ENDPOINT}; check the network, or publish "
                           "without --push and upload the folder later")
    api = HfApi(token=token)
    try:
        user = api.whoami()
    except Exception as error:  # the message may echo request details; never the token itself
        raise RuntimeError(f"the Hub refused the stored token ({type(error).__name__}); run `hf auth login`") from None
    logger.info("pushing as %s", user.get("name", "?"))
    url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message="Publish with pyramid-sd publish")
    return str(url)


def publish(args: PublishArgs, config: PyramidConfig | None = None, explicit: set | None = None) -> Path:
    """Write the folder; with ``args.push`` upload it. ``explicit``: the PyramidConfig flags given by the user."""
    src, out = Path(args.model), Path(args.output_dir)
    if src.resolve() == out.resolve():
        raise ValueError("--output_dir must differ from --model")
    kind = check_model_folder(src)
    knobs = stored_knobs(src)
    if config is not None:
        given = config.to_dict()
        knobs = {**given, **{k: v for k, v in knobs.items() if k not in (explicit or set())}}
    knobs = PyramidConfig(**{k: v for k, v in knobs.items() if k in PyramidConfig.__dataclass_fields__}).to_dict()
    sections = measurement_sections(args.results)  # fail on a bad results file before writing anything
    prepare_output(out, args.overwrite)
    copy_model_files(src, out)
    write_generation_config(src, out, knobs)
    weights = "PEFT adapter (safetensors)" if kind == "adapter" else "safetensors"
    kept_ids = load_reduced_vocab(out)
    if kept_ids is not None:
        weights += (f"; LM head over a reduced vocabulary of {kept_ids.numel()} tokens (`{SIDECAR}`, applied by "
                    "`pyramid_hf.models.load_model`; plain `from_pretrained` loads the full head)")
    if is_feature_folder(out):
        weights += ("; a feature draft (EAGLE-style: one decoder layer over the qualifier's hidden states, using the "
                    "qualifier's embeddings and LM head), loaded by `pyramid_hf.FeatureDraft.load` or "
                    "`pyramid_hf.models.load_model`, not by `from_pretrained`")
    card = render_card(args, knobs, weights, sections)
    card.save(out / "README.md")
    files = sorted(p for p in out.iterdir() if p.is_file())
    print(f"published folder {out} ({sum(p.stat().st_size for p in files) / 1e6:.1f} MB):")
    for p in files:
        print(f"  {p.name}  {p.stat().st_size:,} bytes")
    if not args.push:
        print(f"dry run: would upload these files to https://huggingface.co/{args.repo_id} "
              f"({'private' if args.private else 'public'}); add --push to upload")
        return out
    print(f"uploaded: {push_folder(out, args.repo_id, args.private)}")
    return out
