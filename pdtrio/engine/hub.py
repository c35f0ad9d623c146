"""Models named the way users name them: a Hugging Face repo id, ``Org/Name``.

``engine.model = "HuggingFaceTB/SmolLM2-135M-Instruct"`` is found in huggingface_hub's
cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ``~/.cache/huggingface/hub``) or
downloaded into it, then loaded as the checkpoint directory it is.  Only what the
engine reads comes down (config, safetensors, tokenizer files), and config.json
comes first: a model of an architecture this engine cannot run is refused before
its weights are fetched.  ``HF_HUB_OFFLINE=1`` forbids any download: a model that is
not cached is then an error naming it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from pdtrio.engine.config import UnsupportedModel, check_supported_architecture
from pdtrio.engine.progress import LoadProgress

# what an Org/Name looks like on the Hub (a local path that exists is a path, not an id)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

# the files the engine reads from a checkpoint, and nothing else (no .bin, .pt, .gguf, ...)
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)

_TRUE = frozenset({"1", "ON", "YES", "TRUE"})  # huggingface_hub's own reading of the flag


class ModelNotAvailable(FileNotFoundError):
    """A model named by repo id is neither in the cache nor downloadable now."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` names a Hub repository rather than a file or directory here."""
    return bool(_REPO_ID.match(name)) and not Path(name).exists()


def hub_offline(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def _cache_dir(environ: Mapping[str, str]) -> str | None:
    # read now, not when huggingface_hub was imported: what this process was given
    if environ.get("HF_HUB_CACHE"):
        return environ["HF_HUB_CACHE"]
    if environ.get("HF_HOME"):
        return str(Path(environ["HF_HOME"]) / "hub")
    return None


def resolve_repo_id(
    repo_id: str,
    *,
    progress: LoadProgress | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path:
    """The local snapshot directory of ``repo_id``: from the cache, or downloaded into it.

    Raises ModelNotAvailable (not cached and offline, or the download failed),
    UnsupportedModel (its config.json names an architecture this engine cannot run)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    environ = os.environ if environ is None else environ
    progress = LoadProgress() if progress is None else progress
    offline = hub_offline(environ)
    cache_dir = _cache_dir(environ)
    where = cache_dir or "huggingface_hub's default cache"
    progress.stage(
        "resolving %s in the Hugging Face cache (%s)%s",
        repo_id,
        where,
        ", offline (HF_HUB_OFFLINE)" if offline else ", downloading what is missing",
    )
    try:
        config_path = hf_hub_download(
            repo_id, "config.json", cache_dir=cache_dir, local_files_only=offline
        )
        raw = json.loads(Path(config_path).read_text(encoding="utf-8"))
        check_supported_architecture(raw, repo_id)
        directory = snapshot_download(
            repo_id,
            allow_patterns=list(ALLOW_PATTERNS),
            cache_dir=cache_dir,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError as exc:
        # (a name of this shape that was meant as a path: say that it is not one either)
        if offline:
            raise ModelNotAvailable(
                f"model {repo_id!r} is not in the Hugging Face cache ({where}) and "
                "HF_HUB_OFFLINE=1 forbids downloading it: download it where the Hub is "
                f"reachable (hf download {repo_id}) into that cache, or unset HF_HUB_OFFLINE "
                f"(nor is there a directory {repo_id!r} here)"
            ) from exc
        raise ModelNotAvailable(
            f"model {repo_id!r} is not in the Hugging Face cache ({where}) and could not "
            f"be downloaded (nor is there a directory {repo_id!r} here): {exc}"
        ) from exc
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as exc:
        raise ModelNotAvailable(
            f"model {repo_id!r}: the Hugging Face Hub has no such repository this "
            f"process may read (a typo, a private or gated repo without HF_TOKEN): {exc}"
        ) from exc
    except HfHubHTTPError as exc:
        raise ModelNotAvailable(f"model {repo_id!r} could not be downloaded: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise UnsupportedModel(f"model {repo_id!r}: its config.json is not JSON: {exc}") from exc
    path = Path(str(directory))
    progress.stage("found %s at %s", repo_id, path)
    return path
