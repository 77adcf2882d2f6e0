"""A GLM checkpoint to GGUF through llama.cpp's own converter, for the llama.cpp side of the benches.

    PREFIX/venv/bin/python tools/bench/hf_to_gguf.py --src HF_DIR --out OUT.gguf [--outtype f32] --llamacpp PREFIX
    PREFIX/bin/llama-quantize OUT.gguf OUT-Q4_0.gguf Q4_0

PREFIX is what tools/bench/build_llamacpp.sh builds (PREFIX/src: llama.cpp's tree with convert_hf_to_gguf.py).  The
tensor mapping and hyper-parameters stay llama.cpp's; two things are adapted at run time, because the checkpoints
the benches make (the shipped model, tools/fixtures/synth_slice.py's slices) carry a small byte-level BPE tokenizer
llama.cpp's table does not list:

* a BPE pre-tokenizer whose hash llama.cpp does not know is written as "gpt-2" (byte-level BPE split by the GPT-2
  regex, which is what these tokenizers are) instead of failing;
* of GLM's special tokens (bos [gMASK], eot <|user|>, unk <|endoftext|>, eom <|observation|>) those the tokenizer has
  are set, and the others skipped instead of a KeyError.

Run by llama.cpp's venv (torch, transformers, gguf-py); it imports nothing of glm-jax.
"""
import argparse
import os
import runpy
import sys

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
GLM_SPECIAL = (("bos", "[gMASK]"), ("eot", "<|user|>"), ("unk", "<|endoftext|>"), ("eom", "<|observation|>"))


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="hf_to_gguf.py", description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--out", required=True, help="GGUF file to write")
    ap.add_argument("--outtype", default="f32", choices=OUTTYPES, help="tensor type of the GGUF")
    ap.add_argument("--llamacpp", required=True, help="prefix built by tools/bench/build_llamacpp.sh")
    return ap.parse_args(argv)


def adapt(base, gguf):
    """Patch llama.cpp's converter classes (``conversion.base``) for tokenizers its table does not list."""
    known_pre = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return known_pre(self, tokenizer)
        except NotImplementedError:
            print("hf_to_gguf: BPE pre-tokenizer not in llama.cpp's table; written as 'gpt-2'", file=sys.stderr)
            return "gpt-2"

    def set_vocab_glm(self):
        from transformers import AutoTokenizer
        added = AutoTokenizer.from_pretrained(self.dir_model).get_added_vocab()
        special = gguf.SpecialVocab(self.dir_model, load_merges=True)
        tokens, toktypes, tokpre = self.get_vocab_base()
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre(tokpre)
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types(toktypes)
        for kind, token in GLM_SPECIAL:
            if token in added:
                special._set_special_token(kind, added[token])
        special.add_to_gguf(self.gguf_writer)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    base.TextModel._set_vocab_glm = set_vocab_glm


def main(argv=None) -> int:
    a = parse_args(argv)
    src = os.path.join(os.path.abspath(a.llamacpp), "src")
    script = os.path.join(src, "convert_hf_to_gguf.py")
    if not os.path.isfile(script):
        print(f"hf_to_gguf.py: --llamacpp={a.llamacpp}: no {script} (build it with tools/bench/build_llamacpp.sh)",
              file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(a.src, "config.json")):
        print(f"hf_to_gguf.py: --src={a.src}: no config.json (a Hugging Face checkpoint directory)", file=sys.stderr)
        return 2
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    import gguf
    from conversion import base
    adapt(base, gguf)
    sys.argv = [script, a.src, "--outfile", a.out, "--outtype", a.outtype]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
